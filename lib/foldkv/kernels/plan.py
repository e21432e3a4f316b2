"""The host-built decode plan (kernels/DECODE_SCHEDULE.md): a batch's pages cut into chunks, each chunk's slot and
the slots' groups for the two-level merge, as device tensors made before launch (so the step can be graph-captured).

Chunk c writes slot c; a request's chunks are consecutive (requests in any order: level two finds a request's groups
through req_group_first); a merge group is a run of at most `merge_group` of them, merged into its first slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..layout import value_window_columns
from ..pool import PagedKvLayout
from ..validate import FoldKvInputError, check_device

MAX_BATCH = 256
MAX_LEN = 262_144
DEFAULT_MERGE_GROUP = 8
DEFAULT_SMS = 132  # H200: the plan off a CUDA device (CPU plans in tests), and the SMs foldkv.gemv's grids cover
# A CTA's fixed cost in page reads: ~1.5 us of prologue and pipeline fill and its 16 KB partial written and merged,
# against a folded page tile of 82 KB at one SM's share of the read roof (~2.4 us on the H200).
PIECE_OVERHEAD_PAGES = 1.0


@dataclass
class DecodePlan:
    """A decode step's chunks, slots and merge groups (host lists, device int32 tensors) and its partials."""

    layout: PagedKvLayout
    seq_lens: tuple[int, ...]
    chunk_tokens: int  # the longest chunk, rounded up to whole pages (every chunk when fixed chunks were asked for)
    merge_group: int
    chunks: list[tuple[int, int, int]]  # (request, first token, tokens) per slot
    groups: list[tuple[int, int]]  # (first slot, members) per group
    request_groups: list[tuple[int, int]]  # (first group, groups) per request
    device: torch.device
    tensors: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    fused: bool = False  # one launch (decode_fused_<format>): every CTA fits one wave and the rows are bf16

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def __getattr__(self, name: str) -> torch.Tensor:  # plan.chunk_req, plan.part_o, ...
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)


def check_lens(seq_lens, *, max_batch: int = MAX_BATCH, max_len: int = MAX_LEN, holder: str = "decode",
               host_only: bool = False) -> np.ndarray:
    """seq_lens (ints, numpy or an integer tensor) as a 1-D int64 array of 1 to `max_batch` lengths of 1 to `max_len`
    tokens, else FoldKvInputError naming `holder`; `host_only`: refuse a device tensor."""
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu" and host_only:
            raise FoldKvInputError("seq_lens must be on the host (a list, a numpy array or a CPU tensor): reading"
                                   " device lengths would wait for the device")
        seq_lens = seq_lens.cpu().numpy()
    try:
        lens = np.asarray(seq_lens)
    except ValueError:  # ragged nesting
        lens = np.asarray(seq_lens, dtype=object)
    if lens.ndim == 1 and lens.size == 0:  # numpy makes an empty sequence float: the batch check says what is wrong
        lens = lens.astype(np.int64)
    if lens.ndim != 1 or not np.issubdtype(lens.dtype, np.integer):
        raise FoldKvInputError(f"seq_lens must be a 1-D sequence of ints, got {lens.dtype} {list(lens.shape)}")
    if not 1 <= len(lens) <= max_batch:
        raise FoldKvInputError(f"a batch of {len(lens)} requests: {holder} takes 1 to {max_batch}")
    if lens.min() < 1 or lens.max() > max_len:
        bad = int(lens.max()) if lens.max() > max_len else int(lens.min())
        raise FoldKvInputError(f"seq_lens holds {bad}: {holder} takes lengths 1 to {max_len}")
    return lens.astype(np.int64)


def cta_count(pages: Sequence[int], cap: int, hkv: int) -> int:
    """CTAs of the partial kernel when requests of `pages` are cut at `cap` pages: pieces x KV heads."""
    return sum(-(-p // cap) for p in pages) * hkv


def estimated_step(pages: Sequence[int], cap: int, hkv: int, num_sms: int,
                   overhead: float = PIECE_OVERHEAD_PAGES) -> float:
    """The modelled length of a step (in page reads of one SM) whose requests of `pages` are cut at `cap` pages."""
    longest = min(cap, max(pages)) + overhead
    ctas = cta_count(pages, cap, hkv)
    if ctas <= num_sms:
        return longest
    return (sum(pages) * hkv + ctas * overhead) / num_sms + longest


def one_wave_cap(pages: Sequence[int], hkv: int, num_sms: int) -> int | None:
    """The smallest cap whose CTAs (pieces x KV heads) all fit in one wave of `num_sms`; None if none does."""
    ctas = lambda cap: cta_count(pages, cap, hkv)  # noqa: E731  (non-increasing in cap)
    lo, hi = 1, max(pages)
    if ctas(hi) > num_sms:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ctas(mid) <= num_sms else (mid + 1, hi)
    return lo


def balanced_chunk_pages(layout: PagedKvLayout, lens: Sequence[int], num_sms: int) -> int:
    """The piece cap (pages) with the shortest `estimated_step` of: the smallest that fits one wave, and a ladder
    (x3/4) from the longest request down to one page; ties go to the larger."""
    pages = [layout.pages_for(n) for n in lens]
    hkv = layout.geometry.num_kv_heads
    caps = {max(pages)}
    cap = max(pages)
    while cap > 1:
        cap = (cap * 3) // 4 if cap > 4 else cap - 1
        caps.add(cap)
    wave = one_wave_cap(pages, hkv, num_sms)
    if wave is not None:
        caps.add(wave)
    return min(sorted(caps, reverse=True), key=lambda c: estimated_step(pages, c, hkv, num_sms))


def smallest_cap(pages: np.ndarray, num_chunks: int) -> int:
    """The smallest piece cap P with sum(ceil(pages / P)) <= num_chunks >= len(pages) (int64 `pages`), searched from
    a lower bound 64 caps at a time: a few array operations of host time."""
    total, batch = int(pages.sum()), len(pages)
    cap = max(-(-total // num_chunks), 1)
    for _ in range(3):  # sum(max(1, pages / P)) <= num_chunks at the smallest feasible P: a lower bound on it
        long = pages > cap
        cap = max(cap, -(-int(pages[long].sum()) // max(num_chunks - (batch - int(long.sum())), 1)))
    pages_f = pages.astype(np.float64)
    lo, hi = min(cap, int(pages.max())), int(pages.max())  # the cap is in [lo, hi]: hi always fits
    while lo < hi:  # 64 caps of [lo, hi] at once, then the gap before the first that fits
        caps = lo + (hi - lo) * _STEPS // 63  # non-decreasing: the first that fits is found by argmax
        fits = np.ceil(pages_f[None, :] / caps[:, None]).sum(1) <= num_chunks  # [caps]; exact in float64
        first = int(np.argmax(fits))
        lo, hi = (int(caps[first - 1]) + 1 if first else lo), int(caps[first])
    return lo


def fixed_count_pieces(pages: np.ndarray, num_chunks: int) -> np.ndarray:
    """Pieces per request (int64, 1 <= pieces <= pages) cutting the batch into exactly `num_chunks` >= len(pages)
    chunks, the longest piece as short as whole pages allow: `smallest_cap`, then the spare chunks one each to the
    longest pieces. A batch of fewer pages than chunks: every page a piece (the caller pads the rest)."""
    if int(pages.sum()) <= num_chunks:
        return pages.copy()
    cap = smallest_cap(pages, num_chunks)
    pieces = -(-pages // cap)
    spare = num_chunks - int(pieces.sum())
    if spare and cap > 1:  # cap - 1 does not fit: the spare chunks go to the longest pieces first
        more = np.minimum(-(-pages // (cap - 1)), pages) - pieces
        order = np.argsort(-(pages / pieces), kind="stable")
        give = np.minimum(more[order], np.maximum(spare - (np.cumsum(more[order]) - more[order]), 0))
        pieces[order] += give
    return pieces


_STEPS = np.arange(64)
PLAN_ARRAYS = ("chunk_req", "chunk_start", "chunk_len", "group_first", "group_count", "req_group_first",
               "req_group_count", "merge_first", "merge_count")


def chunk_layout(lens: np.ndarray, pieces: np.ndarray, *, page: int, merge_group: int,
                 fixed_pages: int | None = None) -> dict[str, np.ndarray]:
    """The slots and merge groups of requests of `lens` tokens cut into `pieces` chunks each, as int64 arrays named
    as the kernels' arguments (PLAN_ARRAYS). `fixed_pages`: every chunk but a request's last holds that many pages,
    requests in order; else pages cut as evenly as whole pages allow, largest pieces first (ties in request order)."""
    pages = -(-lens // page)
    if fixed_pages is not None:
        order = np.arange(len(lens))
    else:
        largest = -(-pages // pieces)
        order = np.lexsort((np.arange(len(lens)), -largest))
    k = pieces[order]
    first = np.cumsum(k) - k  # first slot of each request, in layout order
    req = np.repeat(order, k)
    j = np.arange(int(k.sum())) - np.repeat(first, k)  # index of the chunk within its request
    if fixed_pages is not None:
        start_pages = j * fixed_pages
        span = np.full_like(j, fixed_pages)
    else:
        base, extra = np.divmod(pages[order], k)
        base, extra = np.repeat(base, k), np.repeat(extra, k)
        start_pages = j * base + np.minimum(j, extra)
        span = base + (j < extra)
    start = start_pages * page
    length = np.minimum(span * page, lens[req] - start)
    ng = -(-k // merge_group)  # groups of each request, layout order
    gfirst = np.cumsum(ng) - ng
    m = np.arange(int(ng.sum())) - np.repeat(gfirst, ng)
    group_first = np.repeat(first, ng) + m * merge_group
    group_count = np.minimum(merge_group, np.repeat(k, ng) - m * merge_group)
    req_group_first = np.empty(len(lens), dtype=np.int64)
    req_group_count = np.empty(len(lens), dtype=np.int64)
    req_group_first[order], req_group_count[order] = gfirst, ng
    return dict(chunk_req=req, chunk_start=start, chunk_len=length, group_first=group_first, group_count=group_count,
                req_group_first=req_group_first, req_group_count=req_group_count, merge_first=np.repeat(first, k),
                merge_count=np.repeat(k, k))


def device_sms(device: torch.device) -> int:
    """The SMs of a CUDA `device` (DEFAULT_SMS off CUDA)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS


def plan_decode(layout: PagedKvLayout, seq_lens, *, device, chunk_tokens: int | None = None,
                merge_group: int | None = None, num_sms: int | None = None) -> DecodePlan:
    """The plan on `device`: byte-balanced pieces for `num_sms` (default the device's SMs), or fixed chunks of
    `chunk_tokens` (a multiple of the page size) in request order."""
    lens = check_lens(seq_lens).tolist()
    device = check_device(device)
    page = layout.page_size
    num_sms = device_sms(device) if num_sms is None else num_sms
    if chunk_tokens is not None:
        chunk_tokens = int(chunk_tokens)
        if chunk_tokens < page or chunk_tokens % page:
            raise FoldKvInputError(f"chunk_tokens={chunk_tokens} must be a positive multiple of the page size {page}")
    merge_group = DEFAULT_MERGE_GROUP if merge_group is None else int(merge_group)
    if merge_group < 1:
        raise FoldKvInputError(f"merge_group={merge_group} must be >= 1")

    pages = np.array([layout.pages_for(n) for n in lens], dtype=np.int64)
    hkv = layout.geometry.num_kv_heads
    if chunk_tokens is not None:
        fixed = chunk_tokens // page
    else:
        cap = balanced_chunk_pages(layout, lens, num_sms)
        # one wave: every CTA runs at once, so neither order nor evening out shortens the step; fixed chunks of `cap`
        # in request order measured faster there (DECODE_SCHEDULE.md)
        fixed = cap if cta_count(pages.tolist(), cap, hkv) <= num_sms else None
    cut = fixed if fixed is not None else cap
    pieces = -(-pages // cut)  # pieces per request
    arrays = chunk_layout(np.array(lens, dtype=np.int64), pieces, page=page, merge_group=merge_group,
                          fixed_pages=fixed)
    chunks = list(zip(*(arrays[k].tolist() for k in ("chunk_req", "chunk_start", "chunk_len"))))
    groups = list(zip(*(arrays[k].tolist() for k in ("group_first", "group_count"))))
    request_groups = list(zip(*(arrays[k].tolist() for k in ("req_group_first", "req_group_count"))))
    chunk_tokens = page * (fixed if fixed is not None else int((-(-pages // pieces)).max()))
    # every CTA resident at once, bf16 rows: one launch, the partial merging at its tail (decode_fused_<format>)
    fused = len(chunks) * hkv <= num_sms and not layout.quantized

    geom = layout.geometry
    i32 = dict(dtype=torch.int32, device=device)
    tensors = {name: torch.from_numpy(arrays[name].astype(np.int32)).to(device) for name in PLAN_ARRAYS}
    tensors.update(
        value_head_column=value_window_columns(geom, layout.format).to(**i32),
        part_o=torch.empty(len(chunks), geom.num_q_heads, geom.head_dim, dtype=torch.float32, device=device),
        part_lse=torch.empty(len(chunks), geom.num_q_heads, dtype=torch.float32, device=device),
        # the fused tail's counter per (request, KV head): a multiple of macros.TAIL_STEP between launches
        tail_counters=torch.zeros(len(lens), hkv, **i32),
    )
    return DecodePlan(layout, tuple(lens), chunk_tokens, merge_group, chunks, groups, request_groups, device, tensors,
                      fused=fused)
