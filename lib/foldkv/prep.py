"""The prep in torch, the definition the GPU prep is held to: q/k RMSNorm, v-norm, proportional RoPE, the fold of w_k
into the query and the store of rows, in float32 (float64 for float64 inputs) rounded once to the pool dtype.
"""

from __future__ import annotations

import functools

import torch

from .config import AttentionGeometry
from .fp8 import check_finite_rows, quantize_rows
from .layout import KvFormat, rotated_columns, unrotated_columns, value_window_columns
from .pool import BlockTable, PagedKvPool, check_pool_storage
from .validate import check_index_range, check_tensor
from .moved import moved

FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@functools.cache
def _columns_on(device: torch.device, make, *args) -> torch.Tensor:
    """The column map `make(*args)` on `device`, made once: a graph capture may not copy from the host."""
    return make(*args).to(device)


def rope_inv_freq(geom: AttentionGeometry, device: torch.device | str = "cpu") -> torch.Tensor:
    """[D/2] float32 inverse frequencies of proportional RoPE: R/2 non-zero, the rest zero (transformers' formula:
    the exponent divides by the full head_dim, not the rotary width)."""
    pairs = geom.rotary_pairs
    rotated = 1.0 / (geom.rope_theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.int64).float() / geom.head_dim))
    return torch.cat([rotated, torch.zeros(geom.head_dim // 2 - pairs)]).to(device)


def rope_cos_sin(geom: AttentionGeometry, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] float32 on positions' device for integer positions [T], computed as transformers computes them
    (float32 angles)."""
    inv = rope_inv_freq(geom, positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs (the exactness tests), float32 otherwise (as transformers computes norms)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma 4 RMSNorm: x * (mean(x^2) + eps)^-0.5 [* weight] (weight used as is, no 1 + w), in compute_dtype(x)."""
    x = x.to(compute_dtype(x))
    out = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return out if weight is None else out * weight.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D]: x*cos + rotate_half(x)*sin with rotate_half pairing (d, d + D/2)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def _check_prep_inputs(geom: AttentionGeometry, q, kv, q_norm_w, k_norm_w, positions) -> None:
    check_tensor("q", q, dtype=FLOAT_TYPES, shape=(None, geom.num_q_heads, geom.head_dim))
    t = q.shape[0]
    check_tensor("kv", kv, dtype=FLOAT_TYPES, device=q.device, shape=(t, geom.num_kv_heads, geom.head_dim))
    check_tensor("q_norm_weight", q_norm_w, dtype=FLOAT_TYPES, device=q.device, shape=(geom.head_dim,))
    check_tensor("k_norm_weight", k_norm_w, dtype=FLOAT_TYPES, device=q.device, shape=(geom.head_dim,))
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), device=q.device, shape=(t,))
    check_index_range("positions", positions, 0, geom.max_position)


def prep_query(geom: AttentionGeometry, fmt: KvFormat | str, q: torch.Tensor, q_norm_weight: torch.Tensor,
               k_norm_weight: torch.Tensor, positions: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Raw q [T, Hq, D] -> the format's query [T, Hq, D] rounded once to `out_dtype` (`query_rope`, `fold_query`).
    Unchecked (prep_rows_and_query checks)."""
    return fold_query(geom, fmt, query_rope(geom, q, q_norm_weight, positions), k_norm_weight, out_dtype)


def query_rope(geom: AttentionGeometry, q: torch.Tensor, q_norm_weight: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """Raw q [T, Hq, D] -> RoPE(q_norm(q)) in compute_dtype(q), as Gemma 4's forward hands its attention. Unchecked."""
    cos, sin = rope_cos_sin(geom, positions)  # [T, D] each
    return apply_rope(rms_norm(q, geom.rms_norm_eps, q_norm_weight), cos, sin)


def key_value_rope(geom: AttentionGeometry, kv: torch.Tensor, k_norm_weight: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw kv [T, Hkv, D] -> (RoPE(k_norm(kv)), v_norm(kv)) in compute_dtype(kv), as Gemma 4's forward hands its
    attention (k_norm(kv) is V * w_k exactly). Unchecked."""
    cos, sin = rope_cos_sin(geom, positions)  # [T, D] each
    value = rms_norm(kv, geom.rms_norm_eps)  # [T, Hkv, D]
    return apply_rope(value * k_norm_weight.to(value.dtype), cos, sin), value


def fold_query(geom: AttentionGeometry, fmt: KvFormat | str, q_rope: torch.Tensor, k_norm_weight: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The normed, RoPE'd query [T, Hq, D] -> the format's query, rounded once to `out_dtype`. Unchecked.
    split: q_rope as is; folded: [q_rope[rot] | q_rope[unrot] * w_k[unrot]] (score-window order)."""
    fmt = KvFormat.parse(fmt)
    q_rope = q_rope.to(compute_dtype(q_rope))
    if fmt is KvFormat.SPLIT:
        return q_rope.to(out_dtype)
    dev = q_rope.device
    rot, unrot = _columns_on(dev, rotated_columns, geom), _columns_on(dev, unrotated_columns, geom)
    w_unrot = k_norm_weight.to(q_rope.dtype)[unrot]  # [D - R]
    return torch.cat([q_rope[..., rot], q_rope[..., unrot] * w_unrot], dim=-1).to(out_dtype)  # [T, Hq, D]


def prep_rows(geom: AttentionGeometry, fmt: KvFormat | str, kv: torch.Tensor, k_norm_weight: torch.Tensor,
              positions: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Raw kv [T, Hkv, D] -> page rows [T, Hkv, row_width] rounded once to `out_dtype` (`key_value_rope`,
    `rows_from_key_value`). Unchecked (prep_rows_and_query checks)."""
    key, value = key_value_rope(geom, kv, k_norm_weight, positions)  # the folded row keeps K's rotated columns
    return rows_from_key_value(geom, fmt, key, value, out_dtype)


def rows_from_key_value(geom: AttentionGeometry, fmt: KvFormat | str, key: torch.Tensor, value: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Page rows [T, Hkv, row_width] from the normed, RoPE'd key and the normed value, rounded once to `out_dtype`.
    Unchecked. split: [K | V]; folded: [K[rot] | V[unrot] | V[rot]] (the folded query carries w_k)."""
    fmt = KvFormat.parse(fmt)
    if fmt is KvFormat.SPLIT:
        return torch.cat([key, value], dim=-1).to(out_dtype)
    dev = key.device
    rot, value_cols = _columns_on(dev, rotated_columns, geom), _columns_on(dev, value_window_columns, geom, fmt)
    return torch.cat([key[..., rot], value[..., value_cols]], dim=-1).to(out_dtype)


def prep_rows_and_query(geom: AttentionGeometry, fmt: KvFormat | str, q: torch.Tensor, kv: torch.Tensor,
                        q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, positions: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Both halves of the prep after checking every input (FoldKvInputError): (query [T, Hq, D], rows
    [T, Hkv, row_width]), both `out_dtype` on q's device. q [T, Hq, D], kv [T, Hkv, D], weights [D] float;
    positions [T] int32/int64 in [0, max_position); all on q's device."""
    _check_prep_inputs(geom, q, kv, q_norm_weight, k_norm_weight, positions)
    return (prep_query(geom, fmt, q, q_norm_weight, k_norm_weight, positions, out_dtype),
            prep_rows(geom, fmt, kv, k_norm_weight, positions, out_dtype))


def prep_and_store(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                   q: torch.Tensor, kv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor) -> torch.Tensor:
    """Prep T tokens (token i of request request[i] at positions[i], below its seq_len), store their rows and return
    the query [T, Hq, D] (pool.layout.query_dtype). request, positions [T] int32/int64, any device; the raw q
    [T, Hq, D] and kv [T, Hkv, D] (k_eq_v: V comes from kv too), norm weights [D]: float, on the pool's device.
    Everything is checked before the first write (FoldKvInputError): a refusal leaves the pool unchanged."""
    geom = pool.geometry
    pages, offsets = check_prep_and_store(pool, table, request, positions, q, kv, q_norm_weight, k_norm_weight)
    positions = positions.to(q.device)
    key, value = key_value_rope(geom, kv, k_norm_weight, positions)
    return fold_and_store(pool, pages, offsets, query_rope(geom, q, q_norm_weight, positions), key, value,
                          k_norm_weight)


def check_prep_and_store(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                         q: torch.Tensor, kv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                         q_dtypes: tuple[torch.dtype, ...] = FLOAT_TYPES) -> tuple[torch.Tensor, torch.Tensor]:
    """Every refusal of `prep_and_store` (and of the lab's fused prep, with its dtypes), raised before anything is
    written; returns the tokens' (pages, offsets) [T] int64 on the CPU."""
    geom = pool.geometry
    check_pool_storage(pool)
    check_tensor("q", q, dtype=q_dtypes, device=pool.device, shape=(None, geom.num_q_heads, geom.head_dim))
    check_tensor("request", request, dtype=(torch.int32, torch.int64), shape=(q.shape[0],))
    # positions may live on either device
    _check_prep_inputs(geom, q, kv, q_norm_weight, k_norm_weight, positions.to(q.device))
    return pool.token_slots(table, request, positions)  # refuses positions past a request's pages or length


def fold_and_store(pool: PagedKvPool, pages: torch.Tensor, offsets: torch.Tensor, query: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor, k_norm_weight: torch.Tensor, *,
                   out: torch.Tensor | None = None, check_finite: bool = True) -> torch.Tensor:
    """Fold the query and store the rows: the one definition every path is held to (`global_step.fold_and_store`'s
    kernels bitwise). query [N, Hq, D], key / value [N, Hkv, D]: normed and RoPE'd, on the pool's device. The rows go
    to (pages, offsets) [N]; returns the format's query, written into out[:N] when `out` is given. Unchecked."""
    geom, lay = pool.geometry, pool.layout
    store_rows(pool, pages, offsets, rows_from_key_value(geom, pool.format, key, value, lay.row_dtype),
               check_finite=check_finite)
    folded = fold_query(geom, pool.format, query, k_norm_weight, lay.query_dtype)
    return folded if out is None else out[:folded.shape[0]].copy_(folded)


def store_rows(pool: PagedKvPool, pages: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, *,
               check_finite: bool = True) -> None:
    """Write rows [T, Hkv, row_width] (pool.layout.row_dtype) at (pages, offsets) [T]; an FP8 pool's are quantized
    here. check_finite: refuse non-finite FP8 rows first (a host read; a graph capture passes False)."""
    pages, offsets = pages.to(pool.device), offsets.to(pool.device)
    if not pool.layout.quantized:
        pool.data[pages, :, offsets, :] = rows
        return
    if check_finite:
        check_finite_rows(rows)
    q, scale = quantize_rows(rows)
    pool.data[pages, :, offsets, :] = q
    pool.scales[pages, :, offsets] = scale


__getattr__ = moved(__name__, {
    "fill_sequences": "foldkv.lab.gates.inputs.fill_sequences (it fills the gates' and the benchmarks' pools;"
                      " nothing served calls it)",
    "write_tokens": "foldkv.lab.gates.inputs.write_tokens (it stores the gates' and the tests' rows; nothing served"
                    " calls it)"})
