"""The float64 oracle every kernel is gated against, `paged_attention_reference`: it reads a pool exactly as stored
(an FP8 pool's rows dequantized exactly). The dense attention from raw inputs it is held to is the lab's
(`foldkv.lab.gates.fold.dense_attention_reference`).
"""

from __future__ import annotations

import torch

from .config import AttentionGeometry
from .layout import KvFormat, score_window, value_window, value_window_to_head
from .pool import BlockTable, PagedKvPool, check_block_table, check_pool_storage
from .validate import FoldKvInputError, check_tensor
from .moved import moved


def check_pool_format(pool: PagedKvPool, fmt: KvFormat | str | None, dtype: torch.dtype | None = None) -> None:
    """Refuse a pool whose format or stored dtype is not the reader's, or whose tensors are not its layout's."""
    if fmt is not None and KvFormat.parse(fmt) is not pool.format:
        raise FoldKvInputError(
            f"a {pool.format.value} pool was handed to a {KvFormat.parse(fmt).value} reader: the page format is fixed"
            " for a pool's life, build the query with the pool's own format")
    if dtype is not None and dtype != pool.layout.dtype:
        raise FoldKvInputError(
            f"a {pool.layout.dtype} pool was handed to a reader of {dtype} rows: the stored dtype is fixed for a"
            " pool's life, read it with a reader of its own dtype")
    check_pool_storage(pool)


def paged_attention_reference(pool: PagedKvPool, query: torch.Tensor, table: BlockTable,
                              q_lens: torch.Tensor | None = None, *, fmt: KvFormat | str | None = None,
                              dtype: torch.dtype | None = None, query_block: int | None = None, device: torch.device | str | None = None,
                              per_block=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries against a paged pool of either format, in float64 on `device` (default: the pool's).

    query [sum(q_lens), Hq, D] in the pool format's form (what prep_and_store returns); request r's q_lens[r] queries
    (default 1) are its last positions, bottom-right causal. Returns (out [Tq, Hq, D] head order, lse [Tq, Hq]
    natural log). `fmt` / `dtype`: the query's format and the stored dtype the caller reads (another is refused).
    `per_block(rows, qb, keys, vals, probs, mask)`: each query block's float64 work, handed over as computed (the lab's
    gates derive a kernel's rounding scales from it: `lab.gates.checks.reference_with_scales`).
    """
    check_pool_format(pool, fmt, dtype)
    geom, fmt = pool.geometry, pool.format
    check_block_table(pool.layout, table)
    q_lens = torch.ones(table.batch, dtype=torch.long) if q_lens is None else q_lens.to("cpu", torch.long)
    if q_lens.shape != (table.batch,) or bool((q_lens < 1).any()) or bool((q_lens > table.seq_lens.cpu()).any()):
        raise FoldKvInputError("q_lens must be [batch] with 1 <= q_len <= seq_len for every request")
    check_tensor("query", query, dtype=(torch.float64, torch.float32, torch.bfloat16, torch.float16),
                 shape=(int(q_lens.sum()), geom.num_q_heads, geom.head_dim))
    dev = torch.device(device) if device is not None else pool.device
    g, sw, vw = geom.group_size, score_window(geom, fmt), value_window(geom, fmt)
    to_head = value_window_to_head(geom, fmt).to(dev)
    out = torch.empty(query.shape, dtype=torch.float64, device=dev)
    lse = torch.empty(query.shape[:2], dtype=torch.float64, device=dev)
    hkv = geom.num_kv_heads
    start = 0
    for r in range(table.batch):
        n, m = int(table.seq_lens[r]), int(q_lens[r])
        rows = pool.gather_values(table, r, torch.float64).to(dev)  # [n, Hkv, W]
        keys, vals = rows[..., sw], rows[..., vw]  # [n, Hkv, D] each (values in value-window order)
        # queries per block: the float64 score block [Hq, b, n] stays near 2 GiB however long the context
        block = query_block or max(16, min(512, (1 << 31) // (n * geom.num_q_heads * 8)))
        for b0 in range(0, m, block):
            b1 = min(m, b0 + block)
            qb = query[start + b0:start + b1].to(dev, torch.float64).view(b1 - b0, hkv, g, -1)  # [b, Hkv, g, D]
            scores = torch.einsum("qhgd,khd->hgqk", qb, keys)  # [Hkv, g, b, n]
            qpos = torch.arange(n - m + b0, n - m + b1, device=dev)  # [b]
            mask = torch.arange(n, device=dev)[None, :] > qpos[:, None]  # [b, n]
            scores = scores.masked_fill(mask, float("-inf"))
            lse_b = torch.logsumexp(scores, dim=-1)  # [Hkv, g, b]
            probs = torch.exp(scores - lse_b[..., None])  # [Hkv, g, b, n]
            o = torch.einsum("hgqk,khd->qhgd", probs, vals).reshape(b1 - b0, hkv * g, -1)  # [b, Hq, D] window order
            out[start + b0:start + b1] = o[..., to_head]
            lse[start + b0:start + b1] = lse_b.reshape(hkv * g, b1 - b0).transpose(0, 1)
            if per_block is not None:
                per_block(slice(start + b0, start + b1), qb, keys, vals, probs, mask)
        start += m
    return out, lse


__getattr__ = moved(__name__, {"dense_attention_reference": "foldkv.lab.gates.fold (only the fold's gate and tests)"})
