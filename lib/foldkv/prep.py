"""The prep in torch: q/k RMSNorm, v-norm, proportional RoPE, the fold of w_k into the query, and the store of rows.

This is the semantic definition the fused GPU prep kernel is held to. Arithmetic is float32 (as transformers does it
for a float32 model; float64 for float64 inputs) with one rounding to the pool dtype at the end; an FP8 pool's rows
are computed in float32 and quantized once by `foldkv.fp8.quantize_rows` (its query is bf16).
"""

from __future__ import annotations

import torch

from .config import AttentionGeometry
from .fp8 import check_finite_rows, quantize_rows
from .layout import KvFormat, rotated_columns, unrotated_columns, value_window_columns
from .pool import BlockTable, PagedKvPool, check_pool_storage
from .validate import check_index_range, check_tensor
from .moved import moved

_COLUMNS: dict[tuple, torch.Tensor] = {}


def _columns_on(kind: str, geom: AttentionGeometry, fmt: KvFormat, device: torch.device) -> torch.Tensor:
    """A column map (rotated, unrotated or value window) on `device`, made once per (geometry, format, device): a
    decode step captured into a CUDA graph may not copy from pageable host memory, and an eager step saves the copy."""
    key = (kind, geom, fmt, device)
    cols = _COLUMNS.get(key)
    if cols is None:
        make = {"rot": rotated_columns, "unrot": unrotated_columns}.get(kind)
        cols = _COLUMNS[key] = (make(geom) if make else value_window_columns(geom, fmt)).to(device)
    return cols

FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def rope_inv_freq(geom: AttentionGeometry, device: torch.device | str = "cpu") -> torch.Tensor:
    """[D/2] float32 inverse frequencies of proportional RoPE: R/2 non-zero, the rest zero (transformers' formula:
    the exponent divides by the full head_dim, not the rotary width)."""
    pairs = geom.rotary_pairs
    rotated = 1.0 / (geom.rope_theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.int64).float() / geom.head_dim))
    inv = torch.cat([rotated, torch.zeros(geom.head_dim // 2 - pairs)])
    return inv.to(device)


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
    """Raw q [T, Hq, D] -> the format's query [T, Hq, D], rounded once to `out_dtype`, on q's device.

    q: float32/bf16/fp16/float64; q_norm_weight, k_norm_weight: [D] float (k_norm_weight is read by folded only);
    positions: [T] int32/int64; all on q's device. Nothing is checked here (prep_rows_and_query checks).
    split:  RoPE(q_norm(q))
    folded: [RoPE(q_n)[rot] | q_n[unrot] * w_k[unrot]]  (score-window order; RoPE is the identity on unrot)
    """
    return fold_query(geom, fmt, query_rope(geom, q, q_norm_weight, positions), k_norm_weight, out_dtype)


def query_rope(geom: AttentionGeometry, q: torch.Tensor, q_norm_weight: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """Raw q [T, Hq, D] -> RoPE(q_norm(q)) [T, Hq, D] head order in compute_dtype(q): the query Gemma 4's forward
    hands its attention. Unchecked."""
    cos, sin = rope_cos_sin(geom, positions)  # [T, D] each
    return apply_rope(rms_norm(q, geom.rms_norm_eps, q_norm_weight), cos, sin)


def key_value_rope(geom: AttentionGeometry, kv: torch.Tensor, k_norm_weight: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw kv [T, Hkv, D] -> (RoPE(k_norm(kv)), v_norm(kv)) [T, Hkv, D] each, head order in compute_dtype(kv): the
    key and value Gemma 4's forward hands its attention (RMSNorm scales, then weighs: k_norm(kv) is V * w_k exactly,
    so K = RoPE(V * w_k)). Unchecked."""
    cos, sin = rope_cos_sin(geom, positions)  # [T, D] each
    value = rms_norm(kv, geom.rms_norm_eps)  # [T, Hkv, D]
    return apply_rope(value * k_norm_weight.to(value.dtype), cos, sin), value


def fold_query(geom: AttentionGeometry, fmt: KvFormat | str, q_rope: torch.Tensor, k_norm_weight: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The normed, RoPE'd query [T, Hq, D] (head order, any float dtype) -> the format's query [T, Hq, D], computed in
    compute_dtype(q_rope) and rounded once to `out_dtype`, on q_rope's device. k_norm_weight: [D] float on that device
    (read by folded only). Unchecked.
    split:  q_rope as is
    folded: [q_rope[rot] | q_rope[unrot] * w_k[unrot]]  (score-window order)
    """
    fmt = KvFormat.parse(fmt)
    q_rope = q_rope.to(compute_dtype(q_rope))
    if fmt is KvFormat.SPLIT:
        return q_rope.to(out_dtype)
    dev = q_rope.device
    rot, unrot = _columns_on("rot", geom, fmt, dev), _columns_on("unrot", geom, fmt, dev)
    w_unrot = k_norm_weight.to(q_rope.dtype)[unrot]  # [D - R]
    return torch.cat([q_rope[..., rot], q_rope[..., unrot] * w_unrot], dim=-1).to(out_dtype)  # [T, Hq, D]


def prep_rows(geom: AttentionGeometry, fmt: KvFormat | str, kv: torch.Tensor, k_norm_weight: torch.Tensor,
              positions: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Raw kv [T, Hkv, D] -> page rows [T, Hkv, row_width], rounded once to `out_dtype`, on kv's device.

    kv: float32/bf16/fp16/float64; k_norm_weight: [D] float; positions: [T] int32/int64; all on kv's device.
    Nothing is checked here (prep_rows_and_query checks).
    split:  [RoPE(k_norm(kv)) | v_norm(kv)]            (1024 columns)
    folded: [RoPE(k_norm(kv))[rot] | V[unrot] | V[rot]] (640 columns; V = v_norm(kv), no scale)
    """
    key, value = key_value_rope(geom, kv, k_norm_weight, positions)  # the folded row keeps K's rotated columns
    return rows_from_key_value(geom, fmt, key, value, out_dtype)


def rows_from_key_value(geom: AttentionGeometry, fmt: KvFormat | str, key: torch.Tensor, value: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Page rows [T, Hkv, row_width] from the normed, RoPE'd key and the normed value (each [T, Hkv, D], head order,
    any float dtype, one device), rounded once to `out_dtype` on their device. Unchecked.
    split:  [K | V]
    folded: [K[rot] | V[unrot] | V[rot]]  (the unrotated key columns are V * w_k, which the folded query carries)
    """
    fmt = KvFormat.parse(fmt)
    if fmt is KvFormat.SPLIT:
        return torch.cat([key, value], dim=-1).to(out_dtype)
    dev = key.device
    rot, value_cols = _columns_on("rot", geom, fmt, dev), _columns_on("value", geom, fmt, dev)
    return torch.cat([key[..., rot], value[..., value_cols]], dim=-1).to(out_dtype)


def prep_rows_and_query(geom: AttentionGeometry, fmt: KvFormat | str, q: torch.Tensor, kv: torch.Tensor,
                        q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, positions: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Both halves of the prep, after checking every input: (query [T, Hq, D], rows [T, Hkv, row_width]), both
    `out_dtype` on q's device.

    q [T, Hq, D], kv [T, Hkv, D], q_norm_weight [D], k_norm_weight [D]: each float32/bf16/fp16/float64;
    positions [T] int32/int64 in [0, max_position); all on q's device. Refusals raise FoldKvInputError."""
    _check_prep_inputs(geom, q, kv, q_norm_weight, k_norm_weight, positions)
    return (prep_query(geom, fmt, q, q_norm_weight, k_norm_weight, positions, out_dtype),
            prep_rows(geom, fmt, kv, k_norm_weight, positions, out_dtype))


def prep_and_store(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                   q: torch.Tensor, kv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor) -> torch.Tensor:
    """Prep T tokens (token i belongs to batch entry request[i] at position positions[i]), write their rows into
    the pool in its format and return the query in that format's form: the norms and RoPE, then `fold_and_store`.

    pool: any PagedKvPool (format, dtype and device are the pool's).
    table: BlockTable (page_ids [batch, pages], seq_lens [batch] int32, any device); positions[i] must be below
        seq_lens[request[i]]: a request's length counts the tokens being stored.
    request: [T] int32/int64, any device, values in [0, batch).
    positions: [T] int32/int64, any device, values in [0, max_position).
    q: [T, Hq, D] raw q projection, float32/bf16/fp16/float64, on the pool's device.
    kv: [T, Hkv, D] raw k projection (k_eq_v: V is built from it too), float32/bf16/fp16/float64, on q's device.
    q_norm_weight, k_norm_weight: [D] float32/bf16/fp16/float64 on q's device (Gemma 4's q_norm / k_norm weights).
    Returns the query [T, Hq, D] in pool.layout.query_dtype (the pool's dtype; bf16 for an FP8 pool) on the pool's
    device: split, RoPE'd head order; folded, score-window order with w_k folded in. The rows [T, Hkv, row_width] go
    to pool.data[page, :, offset, :] (an FP8 pool's scales [T, Hkv] to pool.scales[page, :, offset]).
    Arithmetic is float32 (float64 for float64 inputs), rounded once to the pool dtype (FP8: `quantize_rows`).

    Everything is checked before the first write (FoldKvInputError): on a refusal the pool is unchanged.
    """
    geom = pool.geometry
    pages, offsets = check_prep_and_store(pool, table, request, positions, q, kv, q_norm_weight, k_norm_weight)
    positions = positions.to(q.device)
    key, value = key_value_rope(geom, kv, k_norm_weight, positions)
    return fold_and_store(pool, pages, offsets, query_rope(geom, q, q_norm_weight, positions), key, value,
                          k_norm_weight)


def check_prep_and_store(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                         q: torch.Tensor, kv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                         q_dtypes: tuple[torch.dtype, ...] = FLOAT_TYPES) -> tuple[torch.Tensor, torch.Tensor]:
    """Every refusal of `prep_and_store` (and of the fused prep, bench/versions/prep_fused.py, with the dtypes it
    reads), raised before anything is written; returns the tokens' (pages, offsets) [T] int64 on the CPU."""
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
    """Fold the query and store the rows: the one definition every path is held to (the prep above, a transformers
    forward's global layer, the decode step; `foldkv.global_step.fold_and_store` sends bf16 pools on CUDA to its
    kernels, bitwise this).

    query [N, Hq, D], key / value [N, Hkv, D]: normed and RoPE'd, head order, any float dtype and strides, on the
    pool's device; k_norm_weight [D] there. The rows `rows_from_key_value` (pool.layout.row_dtype) go to (pages,
    offsets) [N] integer (`store_rows`; check_finite as there); returns the format's query (`fold_query`, rounded once
    to pool.layout.query_dtype) [N, Hq, D], written into out[:N] when `out` ([>= N, Hq, D], that dtype, on the pool's
    device: a decode workspace's query) is given. Unchecked: callers check (the rows are stored before the query)."""
    geom, lay = pool.geometry, pool.layout
    store_rows(pool, pages, offsets, rows_from_key_value(geom, pool.format, key, value, lay.row_dtype),
               check_finite=check_finite)
    folded = fold_query(geom, pool.format, query, k_norm_weight, lay.query_dtype)
    if out is None:
        return folded
    return out[:folded.shape[0]].copy_(folded)


def store_rows(pool: PagedKvPool, pages: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, *,
               check_finite: bool = True) -> None:
    """Write rows [T, Hkv, row_width] (pool.layout.row_dtype, on the pool's device) at (pages, offsets) [T] integer;
    an FP8 pool's rows are quantized here, its scales written beside them. check_finite: refuse non-finite FP8 rows
    first (a host read of the rows; a step captured into a CUDA graph passes False: its rows come from the model's
    own forward and no host read can happen inside a capture). Nothing is read back: capturable."""
    dev = pool.device
    pages, offsets = pages.to(dev), offsets.to(dev)
    if not pool.layout.quantized:
        pool.data[pages, :, offsets, :] = rows
        return
    if check_finite:
        check_finite_rows(rows)
    q, scale = quantize_rows(rows)
    pool.data[pages, :, offsets, :] = q
    pool.scales[pages, :, offsets] = scale


def write_tokens(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                 rows: torch.Tensor) -> None:
    """Store already-prepped rows [T, Hkv, row_width] (pool.layout.row_dtype: the pool dtype, float32 for an FP8
    pool, which quantizes them here) on the pool's device at (request, position) slots; request, positions: [T]
    int32/int64 on any device."""
    geom = pool.geometry
    check_pool_storage(pool)
    check_tensor("rows", rows, dtype=pool.layout.row_dtype, device=pool.device,
                 shape=(positions.shape[0], geom.num_kv_heads, pool.layout.row_width))
    pages, offsets = pool.token_slots(table, request, positions)
    store_rows(pool, pages, offsets, rows)



__getattr__ = moved(__name__, {"fill_sequences": "foldkv.lab.gates.inputs.fill_sequences (it fills the gates' and the"
                                                 " benchmarks' pools; nothing served calls it)"})
