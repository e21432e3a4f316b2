"""The paged KV pool: its layout, its tensor, block tables, and the allocator that never loses a page nor hands one
to two requests: each table's grant is recorded on the host, and `release` returns exactly it and refuses (the pool
unchanged) a second release, another pool's table, a copy, or edited page ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Sequence

import torch

from .config import GEMMA4_31B, AttentionGeometry
from .fp8 import FP8_DTYPE, SCALE_DTYPE, dequantize_rows
from .layout import KvFormat, row_width
from .validate import FoldKvInputError, check_device, check_index_range, check_tensor

GIB = 1 << 30
STORED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, FP8_DTYPE)


@dataclass(frozen=True)
class PagedKvLayout:
    """One global layer's pool: [num_pages, num_kv_heads, page_size, row_width] of `dtype`, one (page, KV head) a
    contiguous tile. float8_e4m3fn (`quantized`, folded only): `foldkv.fp8`'s rows, their float32 scales a second
    tensor of `scale_shape`, page-major like the rows."""

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
                f" and KV head) reads more than 0.55x the bf16 folded row and would lose to it; use format='folded'")

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
        """The dtype of the query the prep returns for this pool: the pool's, or bf16 for FP8."""
        return torch.bfloat16 if self.quantized else self.dtype

    @property
    def row_width(self) -> int:
        return row_width(self.geometry, self.format)

    @property
    def bytes_per_token_head(self) -> int:
        """Bytes one token occupies per KV head: its row, and its scale in an FP8 pool."""
        return self.row_width * self.dtype.itemsize + (SCALE_DTYPE.itemsize if self.quantized else 0)

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

    @classmethod
    def for_tokens(cls, tokens: int, **kw) -> "PagedKvLayout":
        """A layout with just enough pages for `tokens` tokens; `kw` are the other fields."""
        base = cls(**kw)
        return replace(base, num_pages=base.pages_for(tokens))


@dataclass
class BlockTable:
    """Pages of each request of a batch: page_ids [batch, max_pages] int32 (entries past a request's pages are
    padding, never read) and seq_lens [batch] int32. `allocation` names the pool grant that made it (None for a table
    made by hand or a `.to()` copy, which the pool cannot release)."""

    page_ids: torch.Tensor
    seq_lens: torch.Tensor
    allocation: "Allocation | None" = field(default=None, compare=False)

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
    """Refuse (FoldKvInputError) a block table that would read outside the pool or past a request's pages. Returns
    the table on the host (the copy the checks read)."""
    if not isinstance(table, BlockTable):
        raise FoldKvInputError(f"table must be a BlockTable, got {type(table).__name__}")
    check_tensor("page_ids", table.page_ids, dtype=torch.int32, device=device)
    check_tensor("seq_lens", table.seq_lens, dtype=torch.int32, device=device)
    if table.page_ids.dim() != 2 or table.seq_lens.dim() != 1 or table.page_ids.shape[0] != table.seq_lens.shape[0]:
        raise FoldKvInputError(
            f"page_ids {list(table.page_ids.shape)} and seq_lens {list(table.seq_lens.shape)} must be [batch, pages]"
            " and [batch]")
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
            f" {layout.page_size}")
    ids = table.page_ids.cpu()
    used = torch.arange(ids.shape[1])[None, :] < need[:, None]
    check_index_range("page_ids (within each request's pages)", ids[used], 0, layout.num_pages)
    return BlockTable(ids, lens)


def check_pool_storage(pool: "PagedKvPool") -> None:
    """Refuse (FoldKvInputError) a pool whose tensors are not what its layout says; every reader and writer asks."""
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
            f" shape {list(lay.scale_shape)})")
    check_tensor("pool scales", scales, dtype=SCALE_DTYPE, device=pool.data.device, shape=lay.scale_shape,
                 contiguous=True)


class Allocation(NamedTuple):
    """Which grant a table is: the pool that made it (`pool`, unique in the process) and its number there."""

    pool: int
    table: int


class PageHolder(NamedTuple):
    """Who holds a page: the table's allocation and the request (row) of that table."""

    allocation: Allocation
    request: int


@dataclass
class _Grant:
    """The pages a table's requests hold (per row, in column order) and what fills its columns past them."""

    rows: list[list[int]]
    pad_value: int


_POOL_SERIALS = itertools.count()


class PagedKvPool:
    """A layer's pool tensor (`data`, an FP8 pool's `scales`: made, or given together) with a free-page allocator."""

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
        self._free = list(range(layout.num_pages - 1, -1, -1))  # a stack: allocate pops from the end
        self._serial = next(_POOL_SERIALS)
        self._tables = itertools.count()
        self._grants: dict[int, _Grant] = {}  # table number -> its grant (tables not released)
        self._holder: list[PageHolder | None] = [None] * layout.num_pages

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
        """Pages no table holds."""
        return len(self._free)

    def unused_page_ids(self) -> list[int]:
        """Pages no block table holds (ascending)."""
        return sorted(self._free)

    def holder_of(self, page: int) -> PageHolder | None:
        """The (allocation, request) holding `page`, or None when it is free."""
        page = int(page)
        if not 0 <= page < self.layout.num_pages:
            raise FoldKvInputError(f"page {page} is outside the pool's {self.layout.num_pages} pages")
        return self._holder[page]

    def ownership(self) -> dict[int, PageHolder]:
        """Every held page -> its holder."""
        return {p: h for p, h in enumerate(self._holder) if h is not None}

    def held_tables(self) -> list[Allocation]:
        """The allocations of the tables this pool has made and not released."""
        return [Allocation(self._serial, n) for n in self._grants]

    def pages_held(self, table: BlockTable, request: int) -> list[int]:
        """The pages request `request` of `table` holds (its capacity, in column order)."""
        return list(self._grant_of(table, "read")[1].rows[self._request_index(table, request)])

    # --- allocation -------------------------------------------------------------------------------------------
    def allocate(self, seq_lens: Sequence[int], *, scatter_seed: int | None = None, pad_pages: int = 0,
                 pad_value: int = -1) -> BlockTable:
        """Pages for a batch of requests of `seq_lens` tokens: a host BlockTable whose requests hold their pages until
        `release`. `scatter_seed`: pages in a random order. `pad_pages` extra columns of `pad_value` (`grow` fills)."""
        lens = [int(n) for n in seq_lens]
        if not lens or min(lens) < 1:
            raise FoldKvInputError(f"seq_lens {lens[:8]} must be a non-empty list of positive lengths")
        if pad_pages < 0:
            raise FoldKvInputError(f"pad_pages={pad_pages} must be >= 0")
        need = [self.layout.pages_for(n) for n in lens]
        if sum(need) > len(self._free):
            raise FoldKvInputError(
                f"{sum(need)} pages needed for {len(lens)} requests, {len(self._free)} free of {self.layout.num_pages}")
        if scatter_seed is not None:
            g = torch.Generator().manual_seed(scatter_seed)
            order = torch.randperm(len(self._free), generator=g).tolist()
            self._free = [self._free[i] for i in order]
        table = self._new_table(len(lens), max(need) + pad_pages, pad_value)
        table.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for r, n in enumerate(need):
            self._give(table, r, n)
        return table

    def empty_table(self, batch: int, max_pages: int, *, pad_value: int = -1) -> BlockTable:
        """A table of `batch` empty request slots of up to `max_pages` pages each, for `grow` and `release`."""
        if int(batch) < 1 or int(max_pages) < 1:
            raise FoldKvInputError(f"an empty table needs batch >= 1 and max_pages >= 1, got {batch} and {max_pages}")
        return self._new_table(int(batch), int(max_pages), pad_value)

    def grow(self, table: BlockTable, request: int, tokens: int) -> list[int]:
        """Give request `request` of `table` pages for `tokens` tokens in its next columns; returns the new pages.
        Refused (nothing changes) for a row too narrow, too few free pages, or a table this pool does not hold.
        seq_lens are the caller's."""
        number, grant = self._grant_of(table, "grow")
        r = self._request_index(table, request)
        if int(tokens) < 0:
            raise FoldKvInputError(f"grow: tokens={int(tokens)} must be >= 0")
        self._check_rows(table, grant, [r])
        need = self.layout.pages_for(tokens) - len(grant.rows[r])
        if need <= 0:
            return []
        width = table.page_ids.shape[1]
        if len(grant.rows[r]) + need > width:
            raise FoldKvInputError(f"request {r} would hold {len(grant.rows[r]) + need} pages for {int(tokens)} tokens;"
                                   f" its block-table row holds {width}")
        if need > len(self._free):
            raise FoldKvInputError(f"{need} pages needed to grow request {r} to {int(tokens)} tokens, {len(self._free)}"
                                   f" free of {self.layout.num_pages}")
        return self._give(table, r, need)

    def release(self, table: BlockTable, request: int | None = None) -> list[int]:
        """Return the pages `table`'s requests were granted (not those their seq_lens cover) and pad their page ids:
        only `request`'s (its slot can grow again), or every request's (the table is done). Refused, the pool
        unchanged, as the module says. Returns the freed pages."""
        number, grant = self._grant_of(table, "release")
        rows = range(table.batch) if request is None else [self._request_index(table, request)]
        self._check_rows(table, grant, rows)
        freed = []
        for r in rows:
            pages = grant.rows[r]
            table.page_ids[r, :len(pages)] = grant.pad_value
            for p in pages:
                self._holder[p] = None
            freed += pages
            grant.rows[r] = []
        self._free.extend(reversed(freed))  # the first freed page is the next one handed out
        if request is None:
            del self._grants[number]
        return freed

    def _new_table(self, batch: int, width: int, pad_value: int) -> BlockTable:
        number = next(self._tables)
        self._grants[number] = _Grant([[] for _ in range(batch)], int(pad_value))
        return BlockTable(torch.full((batch, width), int(pad_value), dtype=torch.int32),
                          torch.zeros(batch, dtype=torch.int32), Allocation(self._serial, number))

    def _give(self, table: BlockTable, request: int, n: int) -> list[int]:
        """Pop `n` free pages onto the end of `request`'s row (checked by the caller)."""
        row = self._grants[table.allocation.table].rows[request]
        pages = [self._free.pop() for _ in range(n)]
        table.page_ids[request, len(row):len(row) + n] = torch.tensor(pages, dtype=torch.int32)
        holder = PageHolder(table.allocation, request)
        for p in pages:
            self._holder[p] = holder
        row += pages
        return pages

    def _grant_of(self, table: BlockTable, op: str) -> tuple[int, _Grant]:
        """The table's grant in this pool, or a FoldKvInputError saying why `op` cannot use it."""
        if not isinstance(table, BlockTable):
            raise FoldKvInputError(f"{op}: table must be a BlockTable, got {type(table).__name__}")
        a = table.allocation
        if a is None:
            raise FoldKvInputError(f"{op}: this table was not made by a pool's allocate (made by hand, or a copy made"
                                   " by .to()): only the host table allocate / empty_table returned holds pages")
        if a.pool != self._serial:
            raise FoldKvInputError(f"{op}: this table was made by another pool (pool {a.pool}; this is pool"
                                   f" {self._serial}): its pages are that pool's")
        if a.table not in self._grants:
            raise FoldKvInputError(f"{op}: table {a.table} of this pool was released already: it holds no pages (a"
                                   " second release would hand its pages to two requests)")
        if table.page_ids.device.type != "cpu" or table.page_ids.dtype != torch.int32 or table.page_ids.dim() != 2:
            raise FoldKvInputError(f"{op}: the table's page_ids must be the int32 [batch, pages] CPU tensor allocate"
                                   f" made, got {table.page_ids.dtype} {list(table.page_ids.shape)} on"
                                   f" {table.page_ids.device}")
        grant = self._grants[a.table]
        if table.page_ids.shape[0] != len(grant.rows):
            raise FoldKvInputError(f"{op}: the table has {table.page_ids.shape[0]} rows; it was made with"
                                   f" {len(grant.rows)}")
        return a.table, grant

    @staticmethod
    def _request_index(table: BlockTable, request) -> int:
        r = int(request)
        if not 0 <= r < table.page_ids.shape[0]:
            raise FoldKvInputError(f"request {r} is outside the table's {table.page_ids.shape[0]} requests")
        return r

    @staticmethod
    def _check_rows(table: BlockTable, grant: _Grant, rows) -> None:
        """Refuse a table whose granted page ids (the first columns of each row in `rows`) are not the ones the
        pool gave: releasing what it holds now would free pages another request holds, or lose its own."""
        for r in rows:
            held = grant.rows[r]
            now = table.page_ids[r, :len(held)].tolist()
            if now != held:
                col = next(i for i, (a, b) in enumerate(zip(now, held)) if a != b)
                raise FoldKvInputError(f"request {r}'s page ids were changed after the pool gave them: column {col}"
                                       f" holds {now[col]}, the pool gave page {held[col]}; nothing was released")

    # --- rows -------------------------------------------------------------------------------------------------
    def token_slots(self, table: BlockTable, request: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, offsets) [T] int64 on the CPU of tokens at (request, position) below the request's length."""
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
                f"token {i} at position {int(positions[i])} is past its request's length {int(lens[i])}")
        page_col = positions // self.layout.page_size
        pages = table.page_ids.cpu().long()[request, page_col]
        check_index_range("page_ids of the written tokens", pages, 0, self.layout.num_pages)
        return pages, positions % self.layout.page_size

    def gather(self, table: BlockTable, request: int) -> torch.Tensor:
        """Rows of one request in token order: [seq_len, num_kv_heads, row_width], a copy in the pool's dtype on its
        device (an FP8 pool's e4m3 values, without their scales: `gather_values` applies them)."""
        pages = table.pages_of(request, self.layout.page_size).to(self.device, torch.long)
        return self.data[pages].transpose(1, 2).flatten(0, 1)[:int(table.seq_lens[request])]

    def gather_scales(self, table: BlockTable, request: int) -> torch.Tensor:
        """An FP8 pool's scales of one request in token order: [seq_len, num_kv_heads] float32 on its device."""
        if not self.layout.quantized:
            raise FoldKvInputError(f"a {self.layout.dtype} pool has no scales")
        pages = table.pages_of(request, self.layout.page_size).to(self.device, torch.long)
        return self.scales[pages].transpose(1, 2).flatten(0, 1)[:int(table.seq_lens[request])]

    def gather_values(self, table: BlockTable, request: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The values one request's rows stand for (an FP8 pool's dequantized), in token order, in `dtype`."""
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
            "tables_held": len(self._grants),
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
