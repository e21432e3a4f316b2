"""The host-built decode plan: how a batch's pages are cut into chunks, where each chunk's partial goes (its slot),
and how slots are grouped for the two-level merge. Everything a decode step reads is a device tensor made here,
before launch, so the step itself does no host work or synchronisation and can be captured in a CUDA graph.

Slots: chunk c writes slot c; chunks of a request are consecutive. Merge groups: runs of at most `merge_group`
consecutive chunks of one request; level one merges a group into its first slot, level two merges a request's
groups (consecutive too) into the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..layout import value_window_columns
from ..pool import PagedKvLayout
from ..validate import FoldKvInputError, check_device

MAX_BATCH = 32
MAX_LEN = 262_144
DEFAULT_MERGE_GROUP = 8
DEFAULT_SMS = 132  # H200; used when the device is not a CUDA device (CPU plans in tests)


@dataclass
class DecodePlan:
    """A decode step's chunking, slots and merge groups (host lists for inspection, device int32 tensors for the
    kernels) and its float32 workspace of partials."""

    layout: PagedKvLayout
    seq_lens: tuple[int, ...]
    chunk_tokens: int
    merge_group: int
    chunks: list[tuple[int, int, int]]  # (request, first token, tokens) per slot
    groups: list[tuple[int, int]]  # (first slot, members) per group
    request_groups: list[tuple[int, int]]  # (first group, groups) per request
    device: torch.device
    tensors: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def __getattr__(self, name: str) -> torch.Tensor:  # plan.chunk_req, plan.part_o, ...
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)


def _parse_lens(seq_lens) -> list[int]:
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
            raise FoldKvInputError(f"seq_lens must be a 1-D integer tensor, got {seq_lens.dtype} {list(seq_lens.shape)}")
        lens = [int(x) for x in seq_lens.cpu().tolist()]
    else:
        try:
            lens = [int(x) for x in seq_lens]
        except TypeError:
            raise FoldKvInputError(f"seq_lens must be a sequence of ints, got {type(seq_lens).__name__}") from None
    if not 1 <= len(lens) <= MAX_BATCH:
        raise FoldKvInputError(f"batch of {len(lens)} requests: decode takes 1 to {MAX_BATCH}")
    bad = [n for n in lens if not 1 <= n <= MAX_LEN]
    if bad:
        raise FoldKvInputError(f"seq_lens holds {bad[0]}: decode takes lengths 1 to {MAX_LEN}")
    return lens


def default_chunk_pages(layout: PagedKvLayout, lens: Sequence[int], num_sms: int) -> int:
    """The smallest chunk (in pages) whose CTA count (chunks x KV heads) fits in one wave of `num_sms` CTAs: every
    SM streams about the same number of pages, and no partial wave is left at the end."""
    pages = [layout.pages_for(n) for n in lens]
    hkv = layout.geometry.num_kv_heads
    cp = max(1, math.ceil(sum(pages) * hkv / num_sms))
    while cp < max(pages) and sum(math.ceil(p / cp) for p in pages) * hkv > num_sms:
        cp += 1
    return cp


def plan_decode(layout: PagedKvLayout, seq_lens, *, device, chunk_tokens: int | None = None,
                merge_group: int | None = None, num_sms: int | None = None) -> DecodePlan:
    """Cut each request into chunks of `chunk_tokens` (a multiple of the page size; default: one wave of CTAs on
    `device`), group them for the merge and put the plan's tensors and workspace on `device`."""
    lens = _parse_lens(seq_lens)
    device = check_device(device)
    page = layout.page_size
    if num_sms is None:
        num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if device.type == "cuda" else DEFAULT_SMS)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_pages(layout, lens, num_sms) * page
    chunk_tokens = int(chunk_tokens)
    if chunk_tokens < page or chunk_tokens % page:
        raise FoldKvInputError(f"chunk_tokens={chunk_tokens} must be a positive multiple of the page size {page}")
    merge_group = DEFAULT_MERGE_GROUP if merge_group is None else int(merge_group)
    if merge_group < 1:
        raise FoldKvInputError(f"merge_group={merge_group} must be >= 1")

    chunks: list[tuple[int, int, int]] = []
    groups: list[tuple[int, int]] = []
    request_groups: list[tuple[int, int]] = []
    for r, n in enumerate(lens):
        first_chunk, first_group = len(chunks), len(groups)
        chunks += [(r, s, min(chunk_tokens, n - s)) for s in range(0, n, chunk_tokens)]
        count = len(chunks) - first_chunk
        groups += [(first_chunk + g, min(merge_group, count - g)) for g in range(0, count, merge_group)]
        request_groups.append((first_group, len(groups) - first_group))

    geom = layout.geometry
    i32 = dict(dtype=torch.int32, device=device)
    col = lambda rows, i: torch.tensor([row[i] for row in rows], **i32)  # noqa: E731
    tensors = {
        "chunk_req": col(chunks, 0), "chunk_start": col(chunks, 1), "chunk_len": col(chunks, 2),
        "group_first": col(groups, 0), "group_count": col(groups, 1),
        "req_group_first": col(request_groups, 0), "req_group_count": col(request_groups, 1),
        "value_head_column": value_window_columns(geom, layout.format).to(**i32),
        "part_o": torch.empty(len(chunks), geom.num_q_heads, geom.head_dim, dtype=torch.float32, device=device),
        "part_lse": torch.empty(len(chunks), geom.num_q_heads, dtype=torch.float32, device=device),
    }
    return DecodePlan(layout, tuple(lens), chunk_tokens, merge_group, chunks, groups, request_groups, device, tensors)
