"""The paged KV pool: its layout (page size, format, row width, bytes), its tensor, a page allocator and block tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .config import GEMMA4_31B, AttentionGeometry
from .fp8 import FP8_DTYPE, SCALE_BYTES, SCALE_DTYPE, dequantize_rows
from .layout import KvFormat, row_width
from .validate import FoldKvInputError, check_device, check_index_range, check_tensor

GIB = 1 << 30
STORED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, FP8_DTYPE)


@dataclass(frozen=True)
class PagedKvLayout:
    """One global layer's pool: `num_pages` pages of `page_size` tokens, each [num_kv_heads, page_size, row_width].

    The tensor is [num_pages, num_kv_heads, page_size, row_width] of `dtype` (bf16 by default; the kernels read
    bf16 only, the references any of bf16/fp16/float32/float64/float8_e4m3fn): one (page, KV head) is a contiguous
    page_size x row_width tile, the unit a decode CTA streams. row_width is 2D (split) or D + R (folded).

    dtype float8_e4m3fn (`quantized`): the FP8 row of `foldkv.fp8` (e4m3 values, one float32 scale per token x KV
    head), folded only. Its scales are a second tensor `scale_shape` = [num_pages, num_kv_heads, page_size] float32,
    page-major like the rows, so one (page, KV head) tile's scales are a contiguous page_size vector (256 B at 64).
    An FP8 split row would be 1028 B per token-head, 0.80x the bf16 folded row it would replace: refused.
    """

    geometry: AttentionGeometry = GEMMA4_31B
    format: KvFormat = KvFormat.FOLDED
    page_size: int = 64
    num_pages: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", KvFormat.parse(self.format))
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise FoldKvInputError(f"page_size={self.page_size} must be a positive power of two")
        if self.num_pages < 0:
            raise FoldKvInputError(f"num_pages={self.num_pages} must be >= 0")
        if self.dtype not in STORED_DTYPES:
            raise FoldKvInputError(f"pool dtype {self.dtype} is not a type foldkv stores: one of {STORED_DTYPES}")
        if self.quantized and self.format is not KvFormat.FOLDED:
            raise FoldKvInputError(
                f"an FP8 pool stores folded rows only: an FP8 {self.format.value} row ({self.row_width} + 4 B per token"
                f" and KV head) reads more than 0.55x the bf16 folded row and would lose to it; use format='folded'"
            )

    @property
    def quantized(self) -> bool:
        """True for an FP8 (e4m3) pool: rows need their scales (`scale_shape`) to mean anything."""
        return self.dtype == FP8_DTYPE

    @property
    def scale_shape(self) -> tuple[int, int, int] | None:
        """[num_pages, num_kv_heads, page_size] float32 scales of an FP8 pool (one per token x KV head); None else."""
        return (self.num_pages, self.geometry.num_kv_heads, self.page_size) if self.quantized else None

    @property
    def row_dtype(self) -> torch.dtype:
        """The dtype the prep rounds rows to before the store: the pool's, or float32 for FP8 (then quantized)."""
        return torch.float32 if self.quantized else self.dtype

    @property
    def query_dtype(self) -> torch.dtype:
        """The dtype of the query the prep returns for this pool: the pool's, or bf16 for FP8 (kernels read a bf16
        query and a bf16 output whatever the pool stores)."""
        return torch.bfloat16 if self.quantized else self.dtype

    @property
    def row_width(self) -> int:
        return row_width(self.geometry, self.format)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_head(self) -> int:
        """Bytes one token occupies per KV head: its row, and its scale in an FP8 pool."""
        return self.row_width * self.element_bytes + (SCALE_BYTES if self.quantized else 0)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in this layer's pool (all KV heads, scales included)."""
        return self.geometry.num_kv_heads * self.bytes_per_token_head

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.geometry.num_kv_heads, self.page_size, self.row_width)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's tensors (rows, and scales in an FP8 pool)."""
        return self.num_pages * self.page_size * self.bytes_per_token

    def pages_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.page_size)

    def with_pages(self, num_pages: int) -> "PagedKvLayout":
        return PagedKvLayout(self.geometry, self.format, self.page_size, num_pages, self.dtype)

    @classmethod
    def for_tokens(cls, tokens: int, **kw) -> "PagedKvLayout":
        """A layout with just enough pages for `tokens` tokens; `kw` are the other fields (geometry, format,
        page_size, dtype)."""
        base = cls(**kw)
        return base.with_pages(base.pages_for(tokens))


@dataclass
class BlockTable:
    """Pages of each request of a batch: page_ids [batch, max_pages] int32 (entries past a request's pages are
    padding and never read) and seq_lens [batch] int32, the tokens each request holds.

    `PagedKvPool.allocate` makes both on the CPU; the kernels need them on the pool's device (`.to(device)`), the
    prep and the references read them on any device."""

    page_ids: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def batch(self) -> int:
        return int(self.seq_lens.numel())

    def to(self, device: torch.device | str) -> "BlockTable":
        device = check_device(device)
        return BlockTable(self.page_ids.to(device), self.seq_lens.to(device))

    def pages_of(self, request: int, page_size: int) -> torch.Tensor:
        n = -(-int(self.seq_lens[request]) // page_size)
        return self.page_ids[request, :n]


def check_block_table(layout: PagedKvLayout, table: BlockTable, *, max_batch: int | None = None,
                      max_len: int | None = None, device: torch.device | str | None = None) -> "BlockTable":
    """Refuse a block table that would read outside the pool or past a request's pages (FoldKvInputError): int32
    page_ids [batch, pages] and seq_lens [batch], on `device` when given, 1 <= seq_len (<= max_len), page ids of
    each request's pages in [0, num_pages). Returns the table on the host (the copy the checks read: a caller that
    plans on the host reads a device table back once)."""
    if not isinstance(table, BlockTable):
        raise FoldKvInputError(f"table must be a BlockTable, got {type(table).__name__}")
    check_tensor("page_ids", table.page_ids, dtype=torch.int32, device=device)
    check_tensor("seq_lens", table.seq_lens, dtype=torch.int32, device=device)
    if table.page_ids.dim() != 2 or table.seq_lens.dim() != 1 or table.page_ids.shape[0] != table.seq_lens.shape[0]:
        raise FoldKvInputError(
            f"page_ids {list(table.page_ids.shape)} and seq_lens {list(table.seq_lens.shape)} must be [batch, pages]"
            " and [batch]"
        )
    batch = table.batch
    if batch == 0:
        raise FoldKvInputError("empty batch")
    if max_batch is not None and batch > max_batch:
        raise FoldKvInputError(f"batch of {batch} requests exceeds the limit of {max_batch}")
    lens = table.seq_lens.cpu()
    if int(lens.min()) < 1:
        raise FoldKvInputError(f"seq_lens holds {int(lens.min())}: every request needs at least one token")
    if max_len is not None and int(lens.max()) > max_len:
        raise FoldKvInputError(f"seq_lens holds {int(lens.max())}, above the limit of {max_len} tokens")
    need = (lens + layout.page_size - 1) // layout.page_size
    if int(need.max()) > table.page_ids.shape[1]:
        r = int(torch.argmax(need))
        raise FoldKvInputError(
            f"request {r} has {int(lens[r])} tokens but its block table holds only {table.page_ids.shape[1]} pages of"
            f" {layout.page_size}"
        )
    ids = table.page_ids.cpu()
    used = torch.arange(ids.shape[1])[None, :] < need[:, None]
    check_index_range("page_ids (within each request's pages)", ids[used], 0, layout.num_pages)
    return BlockTable(ids, lens)


def check_pool_storage(pool: "PagedKvPool") -> None:
    """Refuse (FoldKvInputError) a pool whose tensors are not what its layout says: data of the layout's dtype and
    shape, contiguous; for an FP8 pool, scales float32 of `scale_shape`, contiguous, on data's device; for any other
    pool, no scales. Every reader and writer runs this before it reads or writes."""
    lay = pool.layout
    check_tensor("pool data", pool.data, dtype=lay.dtype, shape=lay.shape, contiguous=True)
    scales = getattr(pool, "scales", None)
    if not lay.quantized:
        if scales is not None:
            raise FoldKvInputError(f"a {lay.dtype} pool holds no scales; this one has scales {list(scales.shape)}")
        return
    if scales is None:
        raise FoldKvInputError(
            "an FP8 pool has no scales: its e4m3 rows mean nothing without them (one float32 per token x KV head,"
            f" shape {list(lay.scale_shape)})"
        )
    check_tensor("pool scales", scales, dtype=SCALE_DTYPE, device=pool.data.device, shape=lay.scale_shape,
                 contiguous=True)


class PagedKvPool:
    """A layer's pool tensor with a free-page allocator. The format and dtype are fixed for the pool's life.

    data: [num_pages, Hkv, page_size, row_width] of layout.dtype on `device` (uninitialised unless `fill` is given),
    or the given `data` tensor (layout dtype and shape, contiguous; its device is the pool's).
    scales: an FP8 pool's [num_pages, Hkv, page_size] float32 (layout.scale_shape), made beside data (filled with
    `fill` too) or given with it (then both are given); None for any other pool."""

    def __init__(self, layout: PagedKvLayout, device: torch.device | str = "cpu", fill: float | None = None,
                 data: torch.Tensor | None = None, scales: torch.Tensor | None = None):
        self.layout = layout
        if data is not None:
            self.data, self.scales = data, scales
        else:
            if scales is not None:
                raise FoldKvInputError("scales were given without data: give both, or neither")
            dev = check_device(device)
            self.data = torch.empty(layout.shape, dtype=layout.dtype, device=dev)
            self.scales = torch.empty(layout.scale_shape, dtype=SCALE_DTYPE, device=dev) if layout.quantized else None
            if fill is not None:
                self.data.fill_(fill)
                if self.scales is not None:
                    self.scales.fill_(fill)
        check_pool_storage(self)
        self._free = list(range(layout.num_pages - 1, -1, -1))

    # --- properties -------------------------------------------------------------------------------------------
    @property
    def format(self) -> KvFormat:
        return self.layout.format

    @property
    def geometry(self) -> AttentionGeometry:
        return self.layout.geometry

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def unused_page_ids(self) -> list[int]:
        """Pages no block table holds (ascending)."""
        return sorted(self._free)

    # --- allocation -------------------------------------------------------------------------------------------
    def allocate(self, seq_lens: Sequence[int], *, scatter_seed: int | None = None, pad_pages: int = 0,
                 pad_value: int = -1) -> BlockTable:
        """Pages for a batch of requests of `seq_lens` tokens: a BlockTable of int32 CPU tensors, page_ids
        [batch, max pages + pad_pages], seq_lens [batch]. With `scatter_seed`, pages are drawn in a random
        order (scattered page tables). `pad_pages` extra columns hold `pad_value` (never read)."""
        lens = [int(n) for n in seq_lens]
        if not lens or min(lens) < 1:
            raise FoldKvInputError(f"seq_lens {lens[:8]} must be a non-empty list of positive lengths")
        need = [self.layout.pages_for(n) for n in lens]
        if sum(need) > len(self._free):
            raise FoldKvInputError(
                f"{sum(need)} pages needed for {len(lens)} requests, {len(self._free)} free of {self.layout.num_pages}"
            )
        if scatter_seed is not None:
            g = torch.Generator().manual_seed(scatter_seed)
            order = torch.randperm(len(self._free), generator=g).tolist()
            self._free = [self._free[i] for i in order]
        width = max(need) + pad_pages
        ids = torch.full((len(lens), width), pad_value, dtype=torch.int32)
        for r, n in enumerate(need):
            ids[r, :n] = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.int32)
        return BlockTable(ids, torch.tensor(lens, dtype=torch.int32))

    def release(self, table: BlockTable) -> None:
        """Return each request's pages, those its seq_len covers now (ceil(seq_len / page_size)), to the free list."""
        for r in range(table.batch):
            self._free.extend(int(p) for p in table.pages_of(r, self.layout.page_size))

    # --- rows -------------------------------------------------------------------------------------------------
    def token_slots(self, table: BlockTable, request: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of each token given its request index and position: request, positions [T] integer on
        any device -> pages, offsets [T] int64 on the CPU. Refuses a position at or past the request's length."""
        request = request.to("cpu", torch.long)
        positions = positions.to("cpu", torch.long)
        check_index_range("request index", request, 0, table.batch)
        check_index_range("positions", positions, 0, self.geometry.max_position)
        cap = table.page_ids.shape[1] * self.layout.page_size
        if positions.numel() and int(positions.max()) >= cap:
            raise FoldKvInputError(f"position {int(positions.max())} is past the {cap} tokens the block table holds")
        lens = table.seq_lens.cpu().long()[request]
        if positions.numel() and bool((positions >= lens).any()):
            i = int(torch.nonzero(positions >= lens)[0])
            raise FoldKvInputError(
                f"token {i} at position {int(positions[i])} is past its request's length {int(lens[i])}"
            )
        page_col = positions // self.layout.page_size
        pages = table.page_ids.cpu().long()[request, page_col]
        check_index_range("page_ids of the written tokens", pages, 0, self.layout.num_pages)
        return pages, positions % self.layout.page_size

    def gather(self, table: BlockTable, request: int) -> torch.Tensor:
        """Rows of one request in token order: [seq_len, num_kv_heads, row_width], a copy in the pool's dtype on its
        device (an FP8 pool's e4m3 values, without their scales: `gather_values` applies them)."""
        n = int(table.seq_lens[request])
        pages = table.pages_of(request, self.layout.page_size).to(self.device, torch.long)
        rows = self.data[pages].permute(0, 2, 1, 3).reshape(-1, self.geometry.num_kv_heads, self.layout.row_width)
        return rows[:n]

    def gather_scales(self, table: BlockTable, request: int) -> torch.Tensor:
        """An FP8 pool's scales of one request in token order: [seq_len, num_kv_heads] float32 on its device."""
        if not self.layout.quantized:
            raise FoldKvInputError(f"a {self.layout.dtype} pool has no scales")
        n = int(table.seq_lens[request])
        pages = table.pages_of(request, self.layout.page_size).to(self.device, torch.long)
        return self.scales[pages].permute(0, 2, 1).reshape(-1, self.geometry.num_kv_heads)[:n]

    def gather_values(self, table: BlockTable, request: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The values the rows of one request stand for, in token order: [seq_len, num_kv_heads, row_width] in
        `dtype` on the pool's device: the stored rows upcast, or an FP8 pool's e4m3 rows times their scales
        (`foldkv.fp8.dequantize_rows`, exact in float64)."""
        rows = self.gather(table, request)
        if not self.layout.quantized:
            return rows.to(dtype)
        return dequantize_rows(rows, self.gather_scales(table, request), dtype)

    # --- reports ----------------------------------------------------------------------------------------------
    def report(self) -> dict:
        lay = self.layout
        return {
            "format": lay.format.value,
            "page_size": lay.page_size,
            "num_pages": lay.num_pages,
            "free_pages": self.free_pages,
            "row_width": lay.row_width,
            "bytes_per_token": lay.bytes_per_token,
            "scales": None if lay.scale_shape is None else list(lay.scale_shape),
            "pool_bytes": lay.nbytes,
            "pool_gib": lay.nbytes / GIB,
            "dtype": str(lay.dtype).replace("torch.", ""),
            "device": str(self.device),
        }

    def __repr__(self) -> str:
        r = self.report()
        return (f"PagedKvPool({r['format']}, {r['num_pages']} pages x {r['page_size']}, row {r['row_width']},"
                f" {r['pool_gib']:.3f} GiB {r['dtype']} on {r['device']})")
