"""The byte floor of attention: bytes a step must move for each format, pool size at a context, and time at a bandwidth.

Decode at long context reads the whole pool of every request once; the query read and the output and LSE written are a
rounding error beside it, but they are counted. The floor is those bytes over the measured HBM read bandwidth
(GB/s = 1e9 bytes/s). `step_bytes` is the one byte model: the floor table and the benchmarks' % of roof both use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from ..config import AttentionGeometry
from ..layout import KvFormat
from ..pool import GIB, PagedKvLayout


@dataclass(frozen=True)
class DecodeBytes:
    format: str
    context: int
    batch: int
    pool_bytes_per_layer: int  # KV rows read (all requests, all KV heads)
    io_bytes_per_layer: int  # query read + output and LSE written
    bytes_per_layer: int
    bytes_per_step: int  # all global layers
    floor_us_per_layer: float
    floor_us_per_step: float
    pool_gib_per_layer: float  # pages allocated for the context (whole pages)
    pool_gib_all_layers: float

    def as_dict(self) -> dict:
        return asdict(self)


LSE_BYTES = 4  # the log-sum-exp a step writes per query row and head is float32


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def step_bytes(geom: AttentionGeometry, fmt: KvFormat | str, seq_lens: Sequence[int], *,
               q_lens: Sequence[int] | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes one attention step over one layer moves at least, by part: "kv" (the context's pool rows, every KV
    head, and an FP8 pool's scales), "query" (read), "out" (written; both in the pool's query dtype, bf16 for an
    FP8 pool) and "lse" (float32, written), and their "total". Request r holds seq_lens[r] tokens and asks
    q_lens[r] queries (default 1: decode; a prefill chunk gives its length). `dtype` is the pool's stored dtype."""
    seq_lens = [int(n) for n in seq_lens]
    q_lens = [1] * len(seq_lens) if q_lens is None else [int(m) for m in q_lens]
    if not seq_lens or len(q_lens) != len(seq_lens) or any(not 1 <= m <= n for m, n in zip(q_lens, seq_lens)):
        raise ValueError(f"seq_lens {seq_lens} and q_lens {q_lens}: need one 1 <= q_len <= seq_len per request")
    lay = PagedKvLayout(geom, KvFormat.parse(fmt), dtype=dtype)
    queries = sum(q_lens)
    q = queries * geom.num_q_heads * geom.head_dim * _elem_bytes(lay.query_dtype)
    parts = {"kv": sum(seq_lens) * lay.bytes_per_token, "query": q, "out": q,
             "lse": queries * geom.num_q_heads * LSE_BYTES}
    parts["total"] = sum(parts.values())
    return parts


def pool_bytes(geom: AttentionGeometry, fmt: KvFormat | str, context: int, *, page_size: int = 64,
               dtype: torch.dtype = torch.bfloat16, layers: int = 1) -> int:
    """Bytes of the whole pages (rows, and an FP8 pool's scales) one request of `context` tokens holds, over
    `layers` global layers, in a pool of stored `dtype`."""
    lay = PagedKvLayout(geom, KvFormat.parse(fmt), page_size=page_size, dtype=dtype)
    return lay.pages_for(context) * page_size * lay.bytes_per_token * layers


def decode_bytes(geom: AttentionGeometry, fmt: KvFormat | str, context: int, *, batch: int = 1,
                 bandwidth_gbps: float, page_size: int = 64, dtype: torch.dtype = torch.bfloat16) -> DecodeBytes:
    """Bytes one decode step moves for `batch` requests of `context` tokens (`step_bytes`), and the floor time at a
    bandwidth (GB/s), for a pool of stored `dtype`. Its `format` names the dtype past bf16 ("folded-float8_e4m3fn")."""
    if context < 1 or batch < 1 or bandwidth_gbps <= 0:
        raise ValueError(f"context={context}, batch={batch}, bandwidth_gbps={bandwidth_gbps} must all be positive")
    lay = PagedKvLayout(geom, KvFormat.parse(fmt), page_size=page_size, dtype=dtype)
    parts = step_bytes(geom, lay.format, [context] * batch, dtype=dtype)
    pool, io, per_layer = parts["kv"], parts["query"] + parts["out"] + parts["lse"], parts["total"]
    pool_gib = batch * pool_bytes(geom, lay.format, context, page_size=page_size, dtype=dtype) / GIB
    name = lay.format.value if dtype == torch.bfloat16 else f"{lay.format.value}-{str(dtype).replace('torch.', '')}"
    return DecodeBytes(
        format=name,
        context=context,
        batch=batch,
        pool_bytes_per_layer=pool,
        io_bytes_per_layer=io,
        bytes_per_layer=per_layer,
        bytes_per_step=per_layer * geom.num_global_layers,
        floor_us_per_layer=per_layer / (bandwidth_gbps * 1e9) * 1e6,
        floor_us_per_step=per_layer * geom.num_global_layers / (bandwidth_gbps * 1e9) * 1e6,
        pool_gib_per_layer=pool_gib,
        pool_gib_all_layers=pool_gib * geom.num_global_layers,
    )


def tokens_in_budget(geom: AttentionGeometry, fmt: KvFormat | str, budget_gib: float, *, page_size: int = 64,
                     dtype: torch.dtype = torch.bfloat16) -> int:
    """Whole pages of context (all global layers' pools of stored `dtype`) that fit in `budget_gib` GiB, in tokens."""
    page_bytes = pool_bytes(geom, fmt, page_size, page_size=page_size, dtype=dtype,
                            layers=geom.num_global_layers)  # one whole page
    return int(budget_gib * GIB // page_bytes) * page_size


def floor_table(geom: AttentionGeometry, contexts: list[int], *, bandwidth_gbps: float, batch: int = 1,
                page_size: int = 64) -> list[dict]:
    """One row per (context, format), plus the folded/split byte ratio on each folded row."""
    rows = []
    for n in contexts:
        split = decode_bytes(geom, KvFormat.SPLIT, n, batch=batch, bandwidth_gbps=bandwidth_gbps, page_size=page_size)
        folded = decode_bytes(geom, KvFormat.FOLDED, n, batch=batch, bandwidth_gbps=bandwidth_gbps, page_size=page_size)
        rows.append(split.as_dict() | {"folded_over_split": None})
        rows.append(folded.as_dict() | {"folded_over_split": folded.bytes_per_layer / split.bytes_per_layer})
    return rows
