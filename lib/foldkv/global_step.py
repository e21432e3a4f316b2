"""A global layer's fold and store as two Triton kernels (`fold_and_store`: `query_into`, `row_into_pool`), bitwise
`foldkv.prep.fold_and_store`, which every call they do not describe takes (`kernel_refusal`, `global_route`); inside
the step's own forward, the same two with the model's norms and RoPE folded in (`*_from_projection`: PDL links).
"""

from __future__ import annotations

from typing import Any

import torch

from . import prep
from .fused_step_ops import _block, _head_rows, _pdl, _rope_table, _warps
from .layout import KvFormat, rotated_columns, score_window_columns, value_window_columns
from .step_options import in_force
from .transformers_compat import norm_eps
from .moved import moved

BF16 = torch.bfloat16
W_K_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # converted exactly to float32, as fold_query does


def _kernels():
    from . import fused_step_kernels as k

    return k


_MAPS: dict[tuple, tuple[torch.Tensor, torch.Tensor, int, int]] = {}


def column_maps(geom: Any, fmt: KvFormat | str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(score_cols [D] int32, row_cols [row_width] int32, fold_from, key_cols) on `device`, made once (a graph
    capture makes none): query column j is head column score_cols[j], folded from fold_from on; row column j is
    key (j < key_cols) or value at row_cols[j]."""
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
               out: torch.Tensor) -> None:
    """query [B, Hq, 1, D] (normed, RoPE'd, any strides) -> the format's query in out[:B] (out [>= B, Hq, D]
    packed; rows past B untouched): bitwise `fold_query(geom, fmt, query[:, :, 0], k_norm_weight, out.dtype)`."""
    fmt = KvFormat.parse(fmt)
    b, hq, _, d = query.shape
    score, _, fold_from, _ = column_maps(geom, fmt, query.device)
    block = _block(d)
    _kernels().global_query_rows[(b * hq,)](query, k_norm_weight, score, out, hq, query.stride(0), query.stride(1),
                                            query.stride(3), D=d, BLOCK=block, FOLD_FROM=fold_from,
                                            FOLDED=fmt is KvFormat.FOLDED, num_warps=_warps(block))


def row_into_pool(geom: Any, pool: Any, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                  offsets: torch.Tensor) -> None:
    """key/value [B, Hkv, 1, D] (normed, RoPE'd key; normed value; any strides) -> one row per (b, h) at
    pool.data[pages[b], h, offsets[b]] (pages/offsets int64 on the device; an FP8 pool's scale at the same place of
    pool.scales): bitwise `prep.store_rows` of `prep.rows_from_key_value` (unchecked: no finiteness check)."""
    b, hkv, _, _ = key.shape
    _, row, _, key_cols = column_maps(geom, pool.format, key.device)
    width = pool.layout.row_width
    block = _block(width)
    _kernels().global_row_store[(b * hkv,)](key, value, row, pages, offsets, pool.data, _scales(pool), hkv,
                                            pool.layout.page_size, key.stride(0), key.stride(1), key.stride(3),
                                            value.stride(0), value.stride(1), value.stride(3), WIDTH=width,
                                            BLOCK=block, KEY_COLS=key_cols, QUANTIZED=pool.layout.quantized,
                                            num_warps=_warps(block))


def query_from_projection(geom: Any, fmt: KvFormat | str, q: torch.Tensor, attn: torch.nn.Module,
                          cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """q [B, 1, Hq * D] (the q projection's output, read in place), cos/sin [B, 1, D] -> the format's query of
    RoPE(q_norm(q)) in out[:B]: bitwise `rms_norm`, `rope`, then `query_into`, in one launch (a PDL link)."""
    fmt = KvFormat.parse(fmt)
    hq, d = geom.num_q_heads, geom.head_dim
    b = q.shape[0]
    stride = _head_rows(q, hq, d, "q")
    cos, sin = _rope_table(cos, b, d, q.dtype, "cos"), _rope_table(sin, b, d, q.dtype, "sin")
    score, _, fold_from, _ = column_maps(geom, fmt, q.device)
    _kernels().global_query_prologue[(b * hq,)](
        q, attn.q_norm.weight, cos, sin, attn.k_norm.weight, score, out, hq, stride, d, norm_eps(attn.q_norm), D=d,
        FOLD_FROM=fold_from, FOLDED=fmt is KvFormat.FOLDED, num_warps=_warps(d), **_pdl(q))


def row_from_projection(geom: Any, pool: Any, k: torch.Tensor, v: torch.Tensor, attn: torch.nn.Module,
                        cos: torch.Tensor, sin: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """k, v [B, 1, Hkv * D] (the projections' outputs; one tensor for k_eq_v) -> one row per (b, h) at its page and
    offset: bitwise the key's `rms_norm` and `rope`, the value's `rms_norm`, then `row_into_pool`, in one launch."""
    hkv, d = geom.num_kv_heads, geom.head_dim
    b = k.shape[0]
    ks, vs = _head_rows(k, hkv, d, "k"), _head_rows(v, hkv, d, "v")
    cos, sin = _rope_table(cos, b, d, k.dtype, "cos"), _rope_table(sin, b, d, k.dtype, "sin")
    _, row, _, key_cols = column_maps(geom, pool.format, k.device)
    width = pool.layout.row_width
    _kernels().global_row_prologue[(b * hkv,)](
        k, v, attn.k_norm.weight, cos, sin, row, pages, offsets, pool.data, _scales(pool), hkv, pool.layout.page_size,
        ks, vs, d, norm_eps(attn.k_norm), norm_eps(attn.v_norm), D=d, WIDTH=width, BLOCK=_block(width),
        KEY_COLS=key_cols, QUANTIZED=pool.layout.quantized, num_warps=_warps(d), **_pdl(k))


def describe_pool(pool: Any) -> str | None:
    """Why the kernels do not describe this pool (None: they do): a bf16 pool, or an FP8 one (the row kernels
    quantize as `foldkv.fp8.quantize_rows` does), packed."""
    lay = pool.layout
    if lay.dtype != BF16 and not lay.quantized:
        return f"a {lay.dtype} pool: the kernels store bf16 rows or quantize them to FP8"
    if not pool.data.is_contiguous():
        return "the pool's data is not packed [pages, Hkv, page_size, row_width]"
    if lay.quantized and not pool.scales.is_contiguous():
        return "the FP8 pool's scales are not packed [pages, Hkv, page_size]"
    return None


def _scales(pool: Any) -> torch.Tensor:
    """What the row kernels take as the scales' pointer: an FP8 pool's scales (a bf16 pool's data, never written)."""
    return pool.scales if pool.layout.quantized else pool.data


def kernel_refusal(pool: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   k_norm_weight: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
                   out: torch.Tensor | None) -> str | None:
    """None when the two kernels describe this `fold_and_store`, else why it takes the torch definition (the device
    and Triton asked last: on the CPU a call the kernels describe answers "not CUDA")."""
    if not in_force().fuse_global:
        return "StepOptions.fuse_global is off"
    if why := describe_pool(pool):
        return why
    geom = pool.geometry
    n = query.shape[0]
    hq, hkv, d = geom.num_q_heads, geom.num_kv_heads, geom.head_dim
    if query.shape != (n, hq, d) or key.shape != (n, hkv, d) or value.shape != key.shape:
        return f"shapes q {tuple(query.shape)} k {tuple(key.shape)} v {tuple(value.shape)}"
    if not (query.dtype == key.dtype == value.dtype == BF16):
        return f"dtypes q {query.dtype} k {key.dtype} v {value.dtype}: the kernels take bf16"
    if out is not None and (out.dtype != pool.layout.query_dtype or not out.is_contiguous()
                            or out.shape[1:] != (hq, d) or out.shape[0] < n or out.device != query.device):
        return f"query out {tuple(out.shape)} {out.dtype}"
    w = k_norm_weight
    if w.dtype not in W_K_DTYPES or w.shape != (d,) or w.device != query.device:
        return f"k_norm weight {tuple(w.shape)} {w.dtype} on {w.device}"
    for name, t in (("pages", pages), ("offsets", offsets)):
        if t.dtype != torch.long or t.dim() != 1 or t.shape[0] < n or t.device != pool.data.device:
            return f"{name} {tuple(t.shape)} {t.dtype} on {t.device}"
    devices = {t.device for t in (query, key, value, pool.data)}
    if len(devices) != 1:
        return f"tensors on {sorted(map(str, devices))}"
    if query.device.type != "cuda":
        return "not CUDA"
    if _kernels().triton is None:
        return "no Triton"
    return None


def fold_and_store(pool: Any, pages: torch.Tensor, offsets: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, k_norm_weight: torch.Tensor, *, out: torch.Tensor | None = None,
                   check_finite: bool = True, kernels: bool | None = None) -> torch.Tensor:
    """`foldkv.prep.fold_and_store`, bitwise: the two kernels when they describe the call (`kernel_refusal`;
    kernels=True / False: the caller's `global_route` has answered), else the torch definition. An FP8 pool's
    finiteness check (`check_finite`, a host read) is the torch definition's: asked for, the kernels are not used."""
    if check_finite and pool.layout.quantized:
        kernels = False
    if kernels is None:
        kernels = kernel_refusal(pool, query, key, value, k_norm_weight, pages, offsets, out) is None
    if not kernels:
        return prep.fold_and_store(pool, pages, offsets, query, key, value, k_norm_weight, out=out,
                                   check_finite=check_finite)
    n = query.shape[0]
    if out is None:
        out = query.new_empty(n, pool.geometry.num_q_heads, pool.geometry.head_dim, dtype=pool.layout.query_dtype)
    query_into(pool.geometry, pool.format, query.unsqueeze(2), k_norm_weight, out)
    row_into_pool(pool.geometry, pool, key.unsqueeze(2), value.unsqueeze(2), pages, offsets)
    return out[:n]


def global_route(step: Any, layer: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> str | None:
    """None when the two kernels describe this call of `DecodeStep.attend` (its own global decode, its workspace's
    query, its slots; then `kernel_refusal`), else why it takes the torch path."""
    if not in_force().fuse_global:
        return "StepOptions.fuse_global is off"
    if getattr(step, "ws", None) is None:
        return "no foldkv DecodeWorkspace (reference attention, or another library's global decode)"
    if not step.serves_global_decode():
        return f"{type(step).__name__} decodes the global layers its own way"
    if not (query.dim() == key.dim() == value.dim() == 4 and query.shape[2] == key.shape[2] == value.shape[2] == 1):
        return f"shapes q {tuple(query.shape)} k {tuple(key.shape)} v {tuple(value.shape)}"
    return kernel_refusal(layer.pool, query[:, :, 0], key[:, :, 0], value[:, :, 0], module.k_norm.weight,
                          step.store_pages, step.store_offsets, step.ws.query)


_MOVED = {"FUSE_GLOBAL": "pass StepOptions(fuse_global=...) (foldkv.step_options) where the step is made"}


__getattr__ = moved(__name__, _MOVED)


__all__ = ["fold_and_store", "kernel_refusal", "column_maps", "describe_pool", "global_route", "query_into",
           "row_into_pool", "query_from_projection", "row_from_projection"]
