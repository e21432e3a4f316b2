"""A global layer's per-step work after transformers' forward as two Triton kernels: the format's query written straight
into the workspace, the page row assembled and stored at the step's device slot. Then the same `ws.step(...)`.

What it tries (MODEL_DECODE_NOTES "Run 10: prediction", at a narrower seam; written before any GPU run): run 10's
design replaces everything between the merged q|k GEMV and o_proj (the norms and RoPE too). This version keeps the
model's q_norm, RoPE of q, k_norm, RoPE of k and v_norm (fused_step's one kernel each) and takes over at
`DecodeStep.attend`, where transformers' forward hands over query [B, Hq, 1, D] and key/value [B, Hkv, 1, D] already
normed and RoPE'd. What `attend` then does in the library, `rows_from_key_value` + `fold_query` + `store_rows` +
`_global_decode`'s `ws.query[:b].copy_`, becomes:
- `global_query_rows` (grid B x Hq): program (b, h) reads query[b, h, 0, score_cols[j]] (strided, in place) for each
  score-window column j and writes ws.query[b, h, j]; folded, for j >= R, `bf16(fp32(q) * fp32(w_k[c]))`: fold_query's
  arithmetic (q to float32, w_k to float32, one float32 product, rounded once to the query dtype, RNE as `.to`). The
  rotated columns and the whole split query are bf16 values moved (split's float32 round trip is the identity).
- `global_row_store` (grid B x Hkv): program (b, h) builds row column j from key (j < KEY_COLS) or value at head column
  row_cols[j] (folded: [K[rot] | V[unrot] | V[rot]], split: [K | V]) and stores it at pool.data[page, h, offset, j],
  page = store_pages[b], offset = store_offsets[b] read on the device (the prologue's int64 tensors: graph-safe, as
  `fused_step.kv_to_ring` reads its slot). Moves of bf16 values only: no other row is written.
Described: a bf16 pool (folded or split; not FP8, whose rows are quantized with a per-row scale), bf16 query/key/value,
foldkv's DecodeWorkspace (not the reference, not another library's step), CUDA with Triton. Anything else falls back to
the library's `attend`, the reason counted (`Installed.refusals`).

Launches per global layer (bench/global_step_ops.log; MODEL_DECODE_NOTES "The global layers' step work, counted"):
| | folded | split |
| --- | ---: | ---: |
| before: the 5 norm/RoPE kernels + rows_from_key_value (3 / 1) + fold_query (8 / 2) + index_put + copy_ + decode | 19 | 11 |
| with this seam: the 5 norm/RoPE kernels + global_query_rows + global_row_store + decode | 8 | 8 |
| a step of the 31B (10 global layers) | 190 -> 80 (110 fewer) | 110 -> 80 (30 fewer) |
(Run 10's full design: 3 a layer, 30 a step; the 5 norm/RoPE launches a layer stay here.)

Prediction (from run 10's numbers, the replaced kernels' eager times at 4K x 1 folded, `probe.log` of s22): fp32 gathers
0.097 ms, bf16 row gathers 0.070, index_put 0.039, `direct_copy` 20 of 23 0.045, mul 0.016, the two cats 0.025,
`bfloat16_copy` 10 of 14 0.011, Memcpy DtoD 0.010: ~0.31 ms in 130 launches, against 20 new launches at ~2 us
(~0.04 ms): ~0.27 ms saved; priced as 110 launches at ~2 us, 0.22 ms; run 9's method under-predicted by ~1.25x.
Folded: device 17.96 -> ~17.7 ms at 4K x 1 (0.22-0.34 ms saved), the same absolute saving at 128K x 8 (launch-bound
work, not context-bound). Split: ~0.09 ms replaced (its cat, the query's two conversions, index_put, copy_: 50 launches)
-> ~0.05 ms saved, within the runs' spread. The folded - split gap at 4K x 1 (0.33 ms in run 9's record) should shrink
to ~0.1 ms; what is left of it then is in the two decode kernels (profile both formats in one run to settle it).
Not measured yet. Bitwise by construction (the same float32 product rounded once; moves otherwise): the whole step's
greedy tokens and logits equal with the version installed and not (tests/test_global_step_triton_gpu.py).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_global_step_triton_gpu.py` (each kernel bitwise the library functions it
   replaces, the slot-only write, the red twins; the whole step installed vs not, graph mode);
2. that the route fires in the probe's cells: `Installed.calls` > 0 and `refusals` empty (the probe prints both);
3. then `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-split:4096:1
   foldkv-folded:131072:8 --global-ab` (library cells first, then "global kernels").

    from versions.global_step_triton import installed   # bench/ on sys.path
    with installed() as route:                           # patches DecodeStep.attend for the block
        ...                                              # route.calls, route.refusals
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

import torch

from foldkv.hf_graph import DecodeStep
from foldkv.layout import KvFormat, score_window_columns, value_window_columns, rotated_columns

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: the version installs, and every call falls back (reason "no Triton")
    triton = None

BF16 = torch.bfloat16
W_K_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # converted exactly to float32, as fold_query does

if triton is not None:
    from foldkv.fused_step_kernels import _rounded

    @triton.jit
    def global_query_rows(q_ptr, w_ptr, cols_ptr, out_ptr, heads, q_sb, q_sh, q_sd, D: tl.constexpr,
                          BLOCK: tl.constexpr, FOLD_FROM: tl.constexpr, FOLDED: tl.constexpr):
        """Row (b, h) = program_id(0) of the format's query into out [rows, D] packed: column j holds the head
        column cols[j] of q [B, heads, 1, D] (strides q_sb, q_sh, q_sd); FOLDED, columns j >= FOLD_FROM are
        fp32(q) * fp32(w[cols[j]]) rounded once to out's dtype (fold_query's arithmetic)."""
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        h = row % heads
        j = tl.arange(0, BLOCK)
        keep = j < D
        src = tl.load(cols_ptr + j, mask=keep, other=0).to(tl.int64)
        x = tl.load(q_ptr + b * q_sb + h * q_sh + src * q_sd, mask=keep, other=0.0).to(tl.float32)
        if FOLDED:
            w = tl.load(w_ptr + src, mask=keep, other=0.0).to(tl.float32)
            x = tl.where(j >= FOLD_FROM, x * w, x)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * D + j, _rounded(x, out_ty).to(out_ty), mask=keep)

    @triton.jit
    def global_row_store(k_ptr, v_ptr, cols_ptr, pages_ptr, offsets_ptr, pool_ptr, heads, page_size, k_sb, k_sh,
                         k_sd, v_sb, v_sh, v_sd, WIDTH: tl.constexpr, BLOCK: tl.constexpr, KEY_COLS: tl.constexpr):
        """Row (b, h) = program_id(0): column j < KEY_COLS is key[b, h, 0, cols[j]], the others value[b, h, 0,
        cols[j]] (key/value [B, heads, 1, D] strided, the pool's dtype: moved, not converted), stored at
        pool[pages[b], h, offsets[b], j] (pool [pages, heads, page_size, WIDTH] packed; pages/offsets int64 read on
        the device). Nothing else is written."""
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        h = row % heads
        j = tl.arange(0, BLOCK)
        keep = j < WIDTH
        is_key = j < KEY_COLS
        src = tl.load(cols_ptr + j, mask=keep, other=0).to(tl.int64)
        kx = tl.load(k_ptr + b * k_sb + h * k_sh + src * k_sd, mask=keep & is_key, other=0.0)
        vx = tl.load(v_ptr + b * v_sb + h * v_sh + src * v_sd, mask=keep & (j >= KEY_COLS), other=0.0)
        x = tl.where(is_key, kx, vx)
        page = tl.load(pages_ptr + b).to(tl.int64)
        offset = tl.load(offsets_ptr + b).to(tl.int64)
        tl.store(pool_ptr + ((page * heads + h) * page_size + offset) * WIDTH + j, x, mask=keep)


def _block(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


_MAPS: dict[tuple, tuple[torch.Tensor, torch.Tensor, int, int]] = {}


def column_maps(geom: Any, fmt: KvFormat | str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(score_cols [D] int32, row_cols [row_width] int32, fold_from, key_cols) on `device`, made once per (geometry,
    format, device) before a capture (the warm-up step makes them): the query's column j is head column
    score_cols[j], folded from fold_from on; the row's column j is key (j < key_cols) or value at row_cols[j]."""
    fmt = KvFormat.parse(fmt)
    key = (geom, fmt, torch.device(device))
    got = _MAPS.get(key)
    if got is None:
        d = geom.head_dim
        score = score_window_columns(geom, fmt)
        if fmt is KvFormat.SPLIT:
            row, fold_from, key_cols = torch.cat([torch.arange(d), torch.arange(d)]), d, d
        else:
            row = torch.cat([rotated_columns(geom), value_window_columns(geom, fmt)])
            fold_from = key_cols = geom.rotary_width
        got = _MAPS[key] = (score.to(torch.int32).to(device), row.to(torch.int32).to(device), fold_from, key_cols)
    return got


def query_into(geom: Any, fmt: KvFormat | str, query: torch.Tensor, k_norm_weight: torch.Tensor,
               out: torch.Tensor, score_cols: torch.Tensor | None = None) -> None:
    """query [B, Hq, 1, D] (normed, RoPE'd, any strides) -> the format's query in out[:B] (out [>= B, Hq, D]
    packed): bitwise `fold_query(geom, fmt, query[:, :, 0], k_norm_weight, out.dtype)` copied into out[:B].
    score_cols: another [D] int32 column map (the tests' red twin); the format's by default."""
    fmt = KvFormat.parse(fmt)
    b, hq, _, d = query.shape
    score, _, fold_from, _ = column_maps(geom, fmt, query.device)
    score = score if score_cols is None else score_cols
    global_query_rows[(b * hq,)](query, k_norm_weight, score, out, hq, query.stride(0), query.stride(1),
                                 query.stride(3), D=d, BLOCK=_block(d), FOLD_FROM=fold_from,
                                 FOLDED=fmt is KvFormat.FOLDED, num_warps=_warps(_block(d)))


def row_into_pool(geom: Any, pool: Any, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                  offsets: torch.Tensor) -> None:
    """key/value [B, Hkv, 1, D] (normed, RoPE'd key; normed value; the pool's dtype, any strides) -> one row per
    (b, h) at pool.data[pages[b], h, offsets[b]]: bitwise `store_rows(pool, pages, offsets,
    rows_from_key_value(geom, pool.format, key[:, :, 0], value[:, :, 0], row_dtype))` for a bf16 pool."""
    b, hkv, _, _ = key.shape
    _, row, _, key_cols = column_maps(geom, pool.format, key.device)
    width = pool.layout.row_width
    global_row_store[(b * hkv,)](key, value, row, pages, offsets, pool.data, hkv, pool.layout.page_size,
                                 key.stride(0), key.stride(1), key.stride(3), value.stride(0), value.stride(1),
                                 value.stride(3), WIDTH=width, BLOCK=_block(width), KEY_COLS=key_cols,
                                 num_warps=_warps(_block(width)))


def describe_pool(pool: Any) -> str | None:
    """Why the kernels do not describe this pool (None: they do). Checkable without a GPU."""
    lay = pool.layout
    if lay.quantized:
        return (f"an FP8 pool ({lay.dtype}): its rows are quantized with a per-row scale (store_rows' quantize_rows),"
                " which global_row_store does not do")
    if lay.dtype != BF16:
        return f"a {lay.dtype} pool: the kernels store bf16 rows"
    if not pool.data.is_contiguous():
        return "the pool's data is not packed [pages, Hkv, page_size, row_width]"
    return None


def route(step: Any, layer: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
          value: torch.Tensor) -> str | None:
    """None when the two kernels describe this call of `attend`, else the reason the library's path runs."""
    if triton is None:
        return "no Triton"
    if query.device.type != "cuda":
        return "not CUDA"
    if getattr(step, "ws", None) is None:
        return "no foldkv DecodeWorkspace (reference attention, or another library's global decode)"
    if type(step)._global_decode is not DecodeStep._global_decode:
        return f"{type(step).__name__} decodes the global layers its own way"
    pool, geom = layer.pool, layer.geometry
    why = describe_pool(pool)
    if why:
        return why
    b = query.shape[0]
    hq, hkv, d = geom.num_q_heads, geom.num_kv_heads, geom.head_dim
    if query.shape != (b, hq, 1, d) or key.shape != (b, hkv, 1, d) or value.shape != key.shape:
        return f"shapes q {tuple(query.shape)} k {tuple(key.shape)} v {tuple(value.shape)}"
    if not (query.dtype == key.dtype == value.dtype == BF16):
        return f"dtypes q {query.dtype} k {key.dtype} v {value.dtype}: the kernels take bf16"
    ws = step.ws
    q_out = ws.query
    if (q_out.dtype != pool.layout.query_dtype or not q_out.is_contiguous() or q_out.shape[1:] != (hq, d)
            or q_out.shape[0] < b):
        return f"workspace query {tuple(q_out.shape)} {q_out.dtype}"
    w = module.k_norm.weight
    if w.dtype not in W_K_DTYPES or w.shape != (d,) or w.device != query.device:
        return f"k_norm weight {tuple(w.shape)} {w.dtype} on {w.device}"
    for name in ("store_pages", "store_offsets"):
        t = getattr(step, name)
        if t.dtype != torch.long or t.dim() != 1 or t.shape[0] < b or t.device != pool.data.device:
            return f"{name} {tuple(t.shape)} {t.dtype} on {t.device}"
    return None


class Installed:
    """One installation on `step_class`: calls (attends the kernels served), refusals (reason -> count)."""

    def __init__(self, step_class: type):
        if getattr(step_class.attend, "_global_step_triton", False):
            raise RuntimeError(f"{step_class.__name__}.attend already has the global kernels installed")
        self.step_class = step_class
        self.own = "attend" in step_class.__dict__
        self.library = step_class.attend  # the function the fallback calls (possibly inherited)
        self.calls = 0
        self.refusals: collections.Counter = collections.Counter()
        library, state = self.library, self

        def attend(self, layer, module, query, key, value):
            why = route(self, layer, module, query, key, value)
            if why is not None:
                state.refusals[why] += 1
                return library(self, layer, module, query, key, value)
            state.calls += 1
            pool = layer.pool
            b, hq, _, d = query.shape
            query_into(layer.geometry, pool.format, query, module.k_norm.weight, self.ws.query)
            row_into_pool(layer.geometry, pool, key, value, self.store_pages, self.store_offsets)
            self.ws.step(pool, backend=self.cache.backend, check=False)
            return self.ws.out[:b].to(query.dtype).view(b, 1, hq, d)

        attend._global_step_triton = True
        attend.__doc__ = "DecodeStep.attend with the global kernels (bench/versions/global_step_triton.py)."
        step_class.attend = attend

    def uninstall(self) -> None:
        if self.own:
            self.step_class.attend = self.library
        else:
            del self.step_class.attend

    def report(self) -> dict:
        return {"calls": self.calls, "refusals": dict(self.refusals)}


def install(step_class: type = DecodeStep) -> Installed:
    """Patch step_class.attend (DecodeStep's: every subclass that does not override it) until `.uninstall()`."""
    return Installed(step_class)


@contextlib.contextmanager
def installed(step_class: type = DecodeStep) -> Iterator[Installed]:
    """`install` for the block; the library's attend is back after it, whatever happens inside."""
    state = install(step_class)
    try:
        yield state
    finally:
        state.uninstall()
