"""Fused decode: the partial merges its own request-head at its tail, one launch for the whole step (one wave only).

Lab notebook (bench/DECODE_NOTES.md, run 12). Question: issue 14's short end pays ~6-8 us of merges after the partial
(runs 4, 5, 9: three merge structures, each a kernel boundary plus a round trip through the partials, or an atomic
hand-off to one CTA that then merges alone). Here nothing is launched after the partial: when every CTA of the plan is
resident at once (one wave, the plan for up to 8 requests and every single request), the CTAs of one request and KV
head count themselves in after writing their partial, wait for the last of them, and each then merges a 1/n slice of
the request-head's 8 x 512 columns from every member's partial (one round trip of loads from L2, all SMs busy) into
the output, in head order, with the LSE. `decode_partial_program(tail_merge=True)` (the library's partial with the
tail; macros.TAIL_SOURCE: the hand-off, with a trap instead of a hang).

Prediction (before the run): after the slowest CTA of a request-head stores its partial, a fence, the atomic's round
trip, the waiters' poll (~0.5 us each), then one round trip of 33 partial loads (~1 us) and the bf16 stores: ~2-2.5 us
in place of the ~6-8 us the two merge launches take, so ~4 us less at every one-wave length: 10,602 ~25.4 -> ~21.5
(1.47x the plain read, target 1.35x), 40,002 ~59.2 -> ~55 (1.14x, target 1.15x), 131,072 ~160.6 -> ~156.5 (1.04x,
target 1.05x); uniform8 ~230 -> ~226; split the same ~4 us (uniform8 split vs FlashInfer TC 0.99x -> ~1.0x).
"""

from __future__ import annotations

import torch

from foldkv.config import AttentionGeometry
from foldkv.kernels.decode_partial import DEFAULTS, decode_partial_program
from foldkv.kernels.plan import DecodePlan
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat


def build(geom: AttentionGeometry, fmt: KvFormat | str, **tiling):
    """Compile the fused kernel of `fmt` with the format's registered partial tiling, overridden by `tiling`.
    Arguments: (query, pool, page_ids, chunk_req, chunk_start, chunk_len, merge_first, merge_count, part_o,
    part_lse, counters, value_head_column, out, lse)."""
    tilelang = require_tilelang()
    fmt = KvFormat.parse(fmt)
    cfg = {**DEFAULTS[fmt], **tiling}
    return tilelang.compile(decode_partial_program(geom, fmt, tail_merge=True, **cfg), target=target(),
                            pass_configs=pass_configs())


def tail_tensors(plan: DecodePlan, num_sms: int) -> dict[str, torch.Tensor]:
    """The fused kernel's extra plan arrays for `plan` (each chunk's request's first slot and chunk count) and its
    zeroed counters; refuses a plan whose CTAs do not all fit one wave of `num_sms` (they would wait on CTAs that
    cannot start)."""
    hkv = plan.layout.geometry.num_kv_heads
    if plan.num_chunks * hkv > num_sms:
        raise ValueError(f"{plan.num_chunks} chunks x {hkv} KV heads is more than one wave of {num_sms} CTAs")
    reqs = [r for r, _, _ in plan.chunks]
    first = {r: reqs.index(r) for r in set(reqs)}
    count = {r: reqs.count(r) for r in set(reqs)}
    if any(reqs[first[r]:first[r] + count[r]] != [r] * count[r] for r in first):
        raise ValueError("a request's chunks are not consecutive")
    i32 = dict(dtype=torch.int32, device=plan.device)
    return dict(merge_first=torch.tensor([first[r] for r in reqs], **i32),
                merge_count=torch.tensor([count[r] for r in reqs], **i32),
                counters=torch.zeros(plan.batch, hkv, 2, **i32))
