"""A sliding layer's decode attention over its ring as three split-window Triton kernels, every one a PDL link.

What it tries (MODEL_DECODE_NOTES "Run 15: prediction"; written before any GPU run): `ring.ring_attention` is
cuBLAS q.K^T, `fused_step.masked_softmax`, cuBLAS P.V: ~10.8 us a sliding layer on the 31B at 4K x 1 (4.7 + 1.6 + 4.5,
nb05's profile, papermill_runs/h200-20261204-s23) where the ring's bytes (1,024 slots x 16 KV heads x 256 dims, K and
V, bf16: 16.8 MB) are 3.7 us at 4.5 TB/s; the cuBLAS kernels never trigger programmatic dependent launch, so the
kernels after them start at their exit. Run 8's one Triton kernel (`ring_attention_triton.py`) lost 1.0-2.3 ms: one
program a KV head (16 CTAs at batch 1) streaming 512 KB of K in [16, W] tiles of 32-byte row pieces.

The design: the window cut into S = ceil(W / CHUNK) chunks of CHUNK = 64 slots (batch 1: 16 heads x 16 chunks = 256
programs; batch 8: 2,048), each kernel reading its chunk's K or V as one coalesced [CHUNK, d] tile (rows of 512
contiguous bytes, 32 KB in flight a program at d = 256):
1. `ring_scores` (grid B x Hkv, S): the GROUP query rows of KV head (b, kv) (heads kv * GROUP + r: transformers'
   repeat_kv order, ring_attention's reshape) padded to 16 rows for `tl.dot` against the chunk's K^T; the scores
   accumulated in float32 over d, rounded to the model dtype (torch's bf16 matmul output), times scaling rounded again
   (when scaling is not 1.0), stored to a scratch [B x Hkv, GROUP, W] of the model dtype (the values are of that
   precision: stored without loss; 64 KB at batch 1).
2. `ring_pv` (grid B x Hkv, S): the head's whole score rows read back (GROUP x W x 2 bytes: 4 KB, from L2), each row's
   max and sum of exp over its live slots computed as `masked_softmax_rows` computes them (one 1-D row of the same
   block at a time: the same formula, the same reduction), then its chunk's P = round(exp(s - max) / sum) (bitwise
   what the whole row gives: the same float32 operations on the same values), P (padded to 16 rows) . V of the
   chunk's [CHUNK, d] tile by `tl.dot`, float32 partials to a scratch [B x Hkv, S, GROUP, d] (512 KB at batch 1).
   V's dead slots are not read (their P is 0; the rings start zeroed, so the sum is the same).
3. `ring_sum` (grid B x Hq): the S partials of a query head summed in one fixed order (a [S, d] tile reduced along S),
   rounded once into out [B, 1, Hq, d].
So K is read once (kernel 1), V once (kernel 2), and the rounding points are ring_attention's; only float32
summation orders differ (over d for a score, over W for the softmax's sum and for P.V), and the tensor cores
accumulate on both sides. Not bitwise ring_attention: within the bounds tests/test_ring_attention_split_gpu.py derives.

Why `tl.dot` with the group padded to 16 rows rather than elementwise products and `tl.sum` for 2 query rows: the
work is tiny either way (a program's padded MMA is 16 x 64 x 256 MACs, ~0.1 us on an SM's tensor cores; its 32 KB tile
takes ~1 us of that SM's share of the roof); the elementwise form needs GROUP x CHUNK x BLOCK_D float32 products in
registers and, for P.V, a reduction over slots that crosses warps, where `tl.dot` keeps a [16, 64] / [16, d] float32
accumulator (8 / 32 registers a thread at 4 warps) and reads the tile once. The bytes are K and V either way.

Why three kernels: the exact P before P.V needs the row's max and sum, which need every chunk's scores; K and V are
different bytes, so a scores pass and a P.V pass read nothing twice. The third launch (the fixed-order sum over
chunks) is the price of determinism without atomics; if it costs more than ~2 us, fold it into ring_pv (the last
program of a head to finish, by a counter it resets, sums the partials) or use 128-slot chunks (S = 8).

PDL: every kernel is `_chain(GDC)` at its top (triggers its dependents, then waits for the kernel ahead before its
first load): everything it reads (q, the rings, the mask, the scratch) is written by the step, so nothing loads
before the wait. Launched with `gemv.pdl_kw(q)`: PDL when the library's switch is on; its outputs are bitwise the
plain launch's. The chain then has no cuBLAS kernel between `kv_to_ring` and o_proj's PDL GEMV.

Described: bf16 or fp16 query and rings of one dtype, rings [B, Hkv, W, d] contiguous, query [B, Hq, 1, d] (any
strides), a RingMask [B, 1, 1, W] bool, d a power of two in [16, 256], GROUP = Hq / Hkv <= 16, W <= 4,096, CUDA with
Triton. Anything else is the library's ring_attention, the reason counted (`Installed.refusals`).

Prediction (run 15): ~8 us a layer at batch 1 (6.5-11) against ~10.8, plus ~4 PDL boundaries a layer (~0.7 us each):
~0.25 ms a step at 4K x 1 (16.43 -> ~16.2 ms device); at batch 8 ~40 us a layer (K and V at ~80% of the roof): the
step at 4K x 8 / 128K x 8 ~0.15-0.5 ms faster depending on where cuBLAS reads the batch-8 rings.
Outcome (run 15, s24): slower everywhere: device step +0.12 ms at 4K x 1, +0.44 at 4K x 8, +0.46 at 128K x 8 (the
kernels took all 300 ring attentions). Three launches a layer with their own ramps and tails cost more than cuBLAS's two
GEMMs and the softmax. Lost; the library keeps ring.ring_attention.

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_ring_attention_split_gpu.py tests/test_ring_attention_split_cpu.py`;
2. that the route fires in the probe's cells: `Installed.calls` > 0 and `refusals` empty (the probe prints both);
3. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:131072:8
   --ring-ab` (library cells first, then "ring split").

    from versions.ring_attention_split import installed   # bench/ on sys.path
    with installed() as route:                             # patches the library's ring attention for the block
        ...                                                # route.calls, route.refusals
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch

from foldkv import gemv
from foldkv import ring
from foldkv.masks import RingMask

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the route refuses ("no Triton"), the plan and refusals still answer
    triton = None

CHUNK = 64  # ring slots a program: 16 chunks of a 1,024-slot window (256 programs at batch 1)
G_MIN = 16  # tl.dot's least M: the GROUP query rows are padded to it
D_MAX = 256  # a [CHUNK, d] tile of 32 KB at d = 256
W_BLOCK_MAX = 4096  # the score row ring_pv holds (32 float32 registers a thread at 4 warps)
DTYPES = (torch.bfloat16, torch.float16)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def plan(batch: int, hq: int, hkv: int, window: int, d: int, chunk: int = CHUNK) -> dict:
    """The launch geometry of an accepted shape (`shape_refusal` None): CHUNK (at most the window's power of two, at
    least 16), S chunks covering the window once, GROUP and its padding, the blocks, the programs of kernels 1-2."""
    group = hq // hkv
    chunk = min(int(chunk), max(16, _pow2(window)))
    chunks = -(-window // chunk)
    return dict(GROUP=group, G_PAD=max(G_MIN, _pow2(group)), D=d, CHUNK=chunk, chunks=chunks,
                W_BLOCK=_pow2(window), S_BLOCK=_pow2(chunks), programs=batch * hkv * chunks,
                sum_programs=batch * hq)


def chunk_slots(p: dict, window: int) -> list[range]:
    """The ring slots each of p's chunks reads (kernel 1's K rows, kernel 2's V rows): they partition range(window)."""
    return [range(c * p["CHUNK"], min((c + 1) * p["CHUNK"], window)) for c in range(p["chunks"])]


def shape_refusal(batch: int, hq: int, hkv: int, window: int, d: int, dtype: torch.dtype,
                  chunk: int = CHUNK) -> str | None:
    """The part of `refusal` that reads no device: None when the kernels describe the shape, else why not."""
    if dtype not in DTYPES:
        return f"{dtype}: the kernels take bf16 or fp16"
    if min(batch, hq, hkv, window) < 1 or hq % hkv:
        return f"{hq} query heads over {hkv} KV heads: not whole groups"
    if hq // hkv > G_MIN:
        return f"group {hq // hkv}: past the {G_MIN} rows of a tl.dot tile"
    if d < 16 or d > D_MAX or d & (d - 1):
        return f"head_dim {d}: a power of two in [16, {D_MAX}]"
    if _pow2(window) > W_BLOCK_MAX:
        return f"window {window}: past the {W_BLOCK_MAX}-slot score row ring_pv holds"
    if chunk < 16 or chunk & (chunk - 1):
        return f"chunk {chunk}: a power of two >= 16"
    return None


def refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> str | None:
    """None when `ring_attend` takes ring.ring_attention's call, else why not (the mask, the shapes, the layout,
    then the device and Triton)."""
    if not isinstance(mask, RingMask):
        return "not a RingMask"
    if query.dim() != 4 or key.dim() != 4 or query.shape[2] != 1:
        return "not one decode token against [B, Hkv, W, d] rings"
    b, hq, _, d = query.shape
    hkv, w = key.shape[1], key.shape[2]
    if key.shape != (b, hkv, w, d) or value.shape != key.shape:
        return f"rings {tuple(key.shape)} / {tuple(value.shape)} against query {tuple(query.shape)}"
    if not query.dtype == key.dtype == value.dtype:
        return f"dtypes {query.dtype} / {key.dtype} / {value.dtype}"
    why = shape_refusal(b, hq, hkv, w, d, query.dtype)
    if why is not None:
        return why
    m = mask.mask
    if m.shape != (b, 1, 1, w) or m.dtype != torch.bool:
        return f"mask {tuple(m.shape)} {m.dtype}, not [{b}, 1, 1, {w}] bool"
    if not (key.is_contiguous() and value.is_contiguous()):
        return "the rings are not contiguous"
    if not (query.is_cuda and key.device == query.device == value.device == m.device):
        return "not on CUDA"
    if triton is None:
        return "no Triton"
    return None


if triton is not None:
    from foldkv.fused_step_kernels import _chain, _rounded

    @triton.jit
    def group_query(q_ptr, bh, heads_kv, q_sb, q_sh, q_sd, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                    D: tl.constexpr):
        """KV head bh = b * heads_kv + kv's GROUP query rows q[b, kv * GROUP + r, 0, :] (strides q_sb, q_sh, q_sd:
        transformers' repeat_kv order), padded with zero rows to G_PAD for tl.dot: [G_PAD, D]."""
        rows = tl.arange(0, G_PAD)
        dd = tl.arange(0, D)
        head_rows = ((bh % heads_kv) * GROUP + rows)[:, None].to(tl.int64)
        at = (bh // heads_kv) * q_sb + head_rows * q_sh + dd[None, :] * q_sd
        return tl.load(q_ptr + at, mask=(rows < GROUP)[:, None], other=0.0)

    @triton.jit
    def ring_scores(q_ptr, k_ptr, s_ptr, heads_kv, window, q_sb, q_sh, q_sd, scaling, GROUP: tl.constexpr,
                    G_PAD: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, SCALE: tl.constexpr,
                    GDC: tl.constexpr = False):
        """Scores of KV head bh = program_id(0) = b * heads_kv + kv over chunk program_id(1): its GROUP query rows
        (q[b, kv * GROUP + r, 0, :] at strides q_sb, q_sh, q_sd; padded to G_PAD) against K [B, heads_kv, window, D]
        packed; round(q.K^T) [, round(. * scaling)] into s [B * heads_kv, GROUP, window] of the model dtype."""
        _chain(GDC)
        bh = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        out_ty = s_ptr.dtype.element_ty
        rows = tl.arange(0, G_PAD)
        row_ok = rows < GROUP
        dd = tl.arange(0, D)
        slots = c * CHUNK + tl.arange(0, CHUNK)
        slot_ok = slots < window
        q = group_query(q_ptr, bh, heads_kv, q_sb, q_sh, q_sd, GROUP, G_PAD, D)
        k = tl.load(k_ptr + (bh * window + slots)[:, None] * D + dd[None, :], mask=slot_ok[:, None], other=0.0)
        acc = tl.dot(q, tl.trans(k))  # [G_PAD, CHUNK] float32
        s = _rounded(acc, out_ty)
        if SCALE:
            s = _rounded(s * scaling, out_ty)
        tl.store(s_ptr + (bh * GROUP + rows)[:, None] * window + slots[None, :], s.to(out_ty),
                 mask=row_ok[:, None] & slot_ok[None, :])

    @triton.jit
    def ring_pv(s_ptr, m_ptr, v_ptr, o_ptr, heads_kv, window, chunks, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                D: tl.constexpr, CHUNK: tl.constexpr, W_BLOCK: tl.constexpr, RED_NO_MASK: tl.constexpr = False,
                GDC: tl.constexpr = False):
        """P.V of KV head bh = program_id(0) over chunk program_id(1): each score row's max and sum of exp over the
        live slots (mask [B, window] uint8, 1: attend) as masked_softmax_rows computes them, the chunk's
        P = round(exp(s - max) / sum) (model dtype), P . V[chunk] accumulated in float32 into
        o [B * heads_kv, chunks, GROUP, D]. RED_NO_MASK (a red twin, never for use): every slot live."""
        _chain(GDC)
        bh = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        b = bh // heads_kv
        p_ty = v_ptr.dtype.element_ty
        rows = tl.arange(0, G_PAD)
        row_ok = rows < GROUP
        cols = tl.arange(0, W_BLOCK)
        keep = cols < window
        live = tl.load(m_ptr + b * window + cols, mask=keep, other=0) != 0
        if RED_NO_MASK:
            live = keep
        big_m = tl.zeros([G_PAD], dtype=tl.float32)
        big_l = tl.full([G_PAD], 1.0, dtype=tl.float32)
        for r in tl.static_range(GROUP):  # masked_softmax_rows' row, one at a time
            s = tl.load(s_ptr + (bh * GROUP + r) * window + cols, mask=keep, other=0.0).to(tl.float32)
            s = tl.where(live & keep, s, float("-inf"))
            mx = tl.max(s, axis=0)
            l = tl.sum(tl.exp(s - mx), axis=0)
            big_m = tl.where(rows == r, mx, big_m)
            big_l = tl.where(rows == r, l, big_l)
        slots = c * CHUNK + tl.arange(0, CHUNK)
        slot_ok = slots < window
        live_c = tl.load(m_ptr + b * window + slots, mask=slot_ok, other=0) != 0
        if RED_NO_MASK:
            live_c = slot_ok
        sc = tl.load(s_ptr + (bh * GROUP + rows)[:, None] * window + slots[None, :],
                     mask=row_ok[:, None] & slot_ok[None, :], other=0.0).to(tl.float32)
        sc = tl.where((live_c & slot_ok)[None, :], sc, float("-inf"))
        p = _rounded(tl.exp(sc - big_m[:, None]) / big_l[:, None], p_ty)
        p = tl.where(row_ok[:, None], p, 0.0).to(p_ty)
        dd = tl.arange(0, D)
        v = tl.load(v_ptr + (bh * window + slots)[:, None] * D + dd[None, :], mask=(live_c & slot_ok)[:, None],
                    other=0.0)
        acc = tl.dot(p, v)  # [G_PAD, D] float32
        tl.store(o_ptr + ((bh * chunks + c) * GROUP + rows)[:, None] * D + dd[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def ring_sum(o_ptr, out_ptr, chunks, skip, GROUP: tl.constexpr, D: tl.constexpr, S_BLOCK: tl.constexpr,
                 GDC: tl.constexpr = False):
        """Query head row = program_id(0) = b * Hq + kv * GROUP + r: the sum over chunks of o[b * Hkv + kv, :, r, :]
        (float32, one fixed order), rounded once into out [B * Hq, D]. skip (a red twin, never for use; -1 off): that
        chunk left out."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        bh = row // GROUP
        r = row % GROUP
        ss = tl.arange(0, S_BLOCK)
        dd = tl.arange(0, D)
        take = (ss < chunks) & (ss != skip)
        x = tl.load(o_ptr + ((bh * chunks + ss) * GROUP + r)[:, None] * D + dd[None, :], mask=take[:, None],
                    other=0.0)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * D + dd, _rounded(tl.sum(x, axis=0), out_ty).to(out_ty))


def ring_attend(query: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, mask: torch.Tensor, scaling: float,
                *, chunk: int = CHUNK, pdl: bool | None = None, scratch: dict | None = None,
                _red: str | None = None) -> torch.Tensor:
    """ring.ring_attention's output [B, 1, Hq, d] for query [B, Hq, 1, d] (any strides), rings [B, Hkv, W, d]
    packed, mask [B, 1, 1, W] bool (True: attend; every row has one), by the three kernels (module docstring). The
    caller has checked `refusal`. pdl None: `gemv.pdl_kw(query)` (the library's switch); False: plain launches; True:
    PDL launches. scratch (a dict): gets "scores" [B, Hkv, GROUP, W] and "partials" [B, Hkv, S, GROUP, d] (the tests
    read them). _red (red twins, never for use): "no_mask" (every slot attended), "drop_chunk" (chunk 0 left out of
    the sum)."""
    b, hq, _, d = query.shape
    hkv, w = ring_k.shape[1], ring_k.shape[2]
    p = plan(b, hq, hkv, w, d, chunk)
    group, chunks = p["GROUP"], p["chunks"]
    if pdl is None:
        kw = gemv.pdl_kw(query)
    else:
        kw = dict(GDC=True, launch_pdl=True) if pdl else {}
    m = mask.reshape(b, w).contiguous().view(torch.uint8)  # a view, no copy
    scores = torch.empty((b, hkv, group, w), dtype=query.dtype, device=query.device)
    partials = torch.empty((b, hkv, chunks, group, d), dtype=torch.float32, device=query.device)
    out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=query.device)
    scaling = float(scaling)
    ring_scores[(b * hkv, chunks)](
        query, ring_k, scores, hkv, w, query.stride(0), query.stride(1), query.stride(3), scaling, GROUP=group,
        G_PAD=p["G_PAD"], D=d, CHUNK=p["CHUNK"], SCALE=scaling != 1.0, num_warps=4, **kw)
    ring_pv[(b * hkv, chunks)](
        scores, m, ring_v, partials, hkv, w, chunks, GROUP=group, G_PAD=p["G_PAD"], D=d, CHUNK=p["CHUNK"],
        W_BLOCK=p["W_BLOCK"], RED_NO_MASK=_red == "no_mask", num_warps=4, **kw)
    ring_sum[(b * hq,)](
        partials, out, chunks, 0 if _red == "drop_chunk" else -1, GROUP=group, D=d, S_BLOCK=p["S_BLOCK"],
        num_warps=4 if p["S_BLOCK"] * d <= 4096 else 8, **kw)
    if scratch is not None:
        scratch.update(scores=scores, partials=partials, plan=p)
    return out


class Installed:
    """One installation: `foldkv.ring.ring_attention` (what fused_step's sliding forward and foldkv's attention
    function for a RingMask both call) patched; calls (ring attentions the
    kernels served), refusals (reason -> count). `attend` (query, key, value, mask [B, 1, 1, W] bool, scaling, red)
    and `refuse` (query, key, value, RingMask) are a version's (this file's `ring_attend` and `refusal` by default;
    ring_attention_one_launch.py installs its own through this class); `name` is what the patched function's
    `_ring_version` says."""

    def __init__(self, red: str | None = None, *, attend=None, refuse=None, name: str = "split"):
        installed_name = getattr(ring.ring_attention, "_ring_version", None)
        if installed_name is not None:
            raise RuntimeError(f"ring.ring_attention already has the {installed_name} kernels installed")
        attend = attend or (lambda q, k, v, m, scaling, red: ring_attend(q, k, v, m, scaling, _red=red))
        refuse = refuse or refusal
        self.library = ring.ring_attention
        self.calls = 0
        self.refusals: collections.Counter = collections.Counter()
        library, state = self.library, self

        def ring_attention(module, query, key, value, mask):
            why = refuse(query, key, value, mask)
            if why is not None:
                state.refusals[why] += 1
                return library(module, query, key, value, mask)
            state.calls += 1
            return attend(query, key, value, mask.mask, float(module.scaling), red), None

        ring_attention._ring_version = name
        ring_attention.__doc__ = f"ring.ring_attention by the {name} kernels (bench/versions/)."
        ring.ring_attention = ring_attention

    def uninstall(self) -> None:
        ring.ring_attention = self.library

    def report(self) -> dict:
        return {"calls": self.calls, "refusals": dict(self.refusals)}


def install(red: str | None = None) -> Installed:
    """Patch the library's ring attention until `.uninstall()` (red: `ring_attend`'s red twins, for the tests)."""
    return Installed(red)


@contextlib.contextmanager
def installed(red: str | None = None) -> Iterator[Installed]:
    """`install` for the block; the library's ring attention is back after it, whatever happens inside."""
    state = install(red)
    try:
        yield state
    finally:
        state.uninstall()


__all__ = ["CHUNK", "plan", "chunk_slots", "shape_refusal", "refusal", "ring_attend", "Installed", "install",
           "installed"]
