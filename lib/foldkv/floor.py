"""The byte floor of decode: bytes a step must read for each format, pool size at a context, and time at a bandwidth.

Decode at long context reads the whole pool of every request once; query and output are a rounding error beside it.
The floor is those bytes over the measured HBM read bandwidth (GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .config import AttentionGeometry
from .layout import KvFormat
from .pool import GIB, PagedKvLayout


@dataclass(frozen=True)
class DecodeBytes:
    format: str
    context: int
    batch: int
    pool_bytes_per_layer: int  # KV rows read (all requests, all KV heads)
    io_bytes_per_layer: int  # query read + output written
    bytes_per_layer: int
    bytes_per_step: int  # all global layers
    floor_us_per_layer: float
    floor_us_per_step: float
    pool_gib_per_layer: float  # pages allocated for the context (whole pages)
    pool_gib_all_layers: float

    def as_dict(self) -> dict:
        return asdict(self)


def decode_bytes(geom: AttentionGeometry, fmt: KvFormat | str, context: int, *, batch: int = 1,
                 bandwidth_gbps: float, page_size: int = 64, elem_bytes: int = 2) -> DecodeBytes:
    """Bytes one decode step reads for `batch` requests of `context` tokens, and the floor time at a bandwidth
    (GB/s). Plain numbers, no tensors: `elem_bytes` is the stored element's size (2: bf16)."""
    if context < 1 or batch < 1 or bandwidth_gbps <= 0:
        raise ValueError(f"context={context}, batch={batch}, bandwidth_gbps={bandwidth_gbps} must all be positive")
    lay = PagedKvLayout(geom, KvFormat.parse(fmt), page_size=page_size)
    per_token = geom.num_kv_heads * lay.row_width * elem_bytes
    pool = batch * context * per_token
    io = 2 * batch * geom.num_q_heads * geom.head_dim * elem_bytes  # q in, out back
    per_layer = pool + io
    pages = lay.pages_for(context) * batch
    pool_gib = pages * page_size * per_token / GIB
    return DecodeBytes(
        format=lay.format.value,
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
                     elem_bytes: int = 2) -> int:
    """Whole pages of context (all global layers' pools) that fit in `budget_gib` GiB, in tokens."""
    lay = PagedKvLayout(geom, KvFormat.parse(fmt), page_size=page_size)
    page_bytes = page_size * geom.num_kv_heads * lay.row_width * elem_bytes * geom.num_global_layers
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
