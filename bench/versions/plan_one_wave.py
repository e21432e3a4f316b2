"""Decode chunking that balances the number of CTAs, not their bytes: the smallest chunk (in pages) whose CTA count
(chunks x KV heads) fits in one wave of the SMs, every request cut into chunks of that size in request order; when
even unsplit requests need more than one wave (33+ requests on 132 SMs), the longest request's pages.

What it tried: no partial wave at the end, every SM streaming about the same number of pages. It does that whenever
all CTAs fit one wave (one request, a few short ones), where the library's planner still lays out exactly this.

Measured against the plain read of the same bytes (H200, notebook 04 of h200-20261130, ragged batches of mean
16,384 tokens): batch 4 at 85% of the roof, batch 16 at 84%, batch 32 at 69% (903.9 us; FlashInfer TC 1,013.2). At
32 requests the 128 CTAs already fill the wave with one CTA per request and head, so nothing is split and the step
lasts as long as the longest request's read (1.85x the mean chunk). Lost to byte-balanced pieces; its numbers beside
the winner's are in bench/DECODE_NOTES.md (run 7).

    plan_decode(layout, lens, device=dev, chunk_tokens=chunk_tokens(layout, lens, num_sms))   # this chunking
"""

from typing import Sequence

from foldkv.kernels.plan import one_wave_cap
from foldkv.pool import PagedKvLayout


def chunk_pages(layout: PagedKvLayout, lens: Sequence[int], num_sms: int) -> int:
    """The smallest chunk (pages) whose CTAs fit one wave of `num_sms`, else the longest request's pages."""
    pages = [layout.pages_for(n) for n in lens]
    return one_wave_cap(pages, layout.geometry.num_kv_heads, num_sms) or max(pages)


def chunk_tokens(layout: PagedKvLayout, lens: Sequence[int], num_sms: int) -> int:
    """`chunk_pages` in tokens: what `plan_decode(..., chunk_tokens=...)` takes."""
    return chunk_pages(layout, lens, num_sms) * layout.page_size
