"""o_proj's first weight rows read into L2 on a branch of the step's graph while one row's ring attention runs.

What it tries (MODEL_DECODE_NOTES "Run 27: prediction"; written before any GPU run): at batch 1 a sliding layer's ring
attention (cuBLAS's q.K^T, the fused softmax, cuBLAS's P.V over 16.8 MB of ring) takes ~11 us with DRAM ~2/3 idle,
and the layer's o_proj after it streams 88 MB. Here `ring.ring_attention` (what fused_step's sliding forward
calls) is wrapped: at one row it forks fused_step's second side stream after the work issued so far (the query and
the rings written), where the read roof's streaming kernel (`foldkv.lab.bench.roofs.stream_read_kernel`, the kernel
bench/l2_prefix_probe.py times) reads the first PREFIX_MB of the layer's o_proj weight (whole rows: whole row tiles
of the GEMV's K-split grid, whose programs then find all their bytes in L2) with PROGRAMS programs into a partial
sum; the ring attention is the library's, on the main stream, which joins the branch before returning (o_proj, the
next launch, reads the prefix from L2). The outputs are the library's, bitwise: the read writes only its partials.
Refused (the library's, the reason counted): a batch over MAX_BATCH (the batch-8 rings keep DRAM at ~82%), off CUDA,
an o_proj weight that is not a contiguous bf16 tensor of whole stream blocks.

Prediction: ~P / roof off each sliding o_proj if L2 keeps the prefix beside the attention's reads: 24 MB ~5 us at
most, **-0.1 to -0.2 ms a step at 4K x 1 and 32K x 1**, nothing at 4K x 8 (refused). What proves it wrong: under
0.05 ms at 4K x 1, or a loss (the branch's 132 programs delay the attention's CTAs, or the join holds o_proj behind a
read longer than the attention: PREFIX_MB 16 next); tokens not the library's (the GPU test).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_oproj_l2_prefetch_gpu.py`;
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --ring-branch-ab --l2-prefetch-ab` (label "o_proj prefix in L2"; its calls and refusals are printed).
It composes with bench/versions/ring_attention_branched.py installed before it (that one uses the first side stream).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Iterator

import torch

from foldkv import fused_step, ring

PREFIX_MB = 24  # o_proj's first rows read into L2: 24 of the sliding o_proj's 84 row tiles at the 31B
PROGRAMS = 132  # the read's programs: one an SM, beside the attention's CTAs
MAX_BATCH = 1  # rows of a step whose ring attention leaves DRAM idle enough (s25's profile: ~1.5 of ~4.5 TB/s)


def prefix_blocks(weight: torch.Tensor, prefix_mb: int = PREFIX_MB) -> int:
    """The stream read's whole blocks covering the first `prefix_mb` MB of `weight` (at most all of it)."""
    from foldkv.lab.bench.roofs import STREAM_BLOCK

    return min(weight.numel() // STREAM_BLOCK, -(-(prefix_mb << 20) // (weight.element_size() * STREAM_BLOCK)))


def refusal(module: torch.nn.Module, query: torch.Tensor) -> str | None:
    """None when the prefetch describes this ring attention call, else why the library's runs alone."""
    from foldkv.lab.bench.roofs import STREAM_BLOCK

    if query.shape[0] > MAX_BATCH:
        return f"batch {query.shape[0]} > {MAX_BATCH} (the rings keep DRAM busy)"
    w = getattr(getattr(module, "o_proj", None), "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.is_contiguous()
            and w.numel() % STREAM_BLOCK == 0):
        return "o_proj's weight not a contiguous bf16 tensor of whole stream blocks"
    if not (query.is_cuda and w.is_cuda):
        return "not on CUDA"
    return None


@functools.lru_cache(maxsize=None)
def _partials(device: torch.device) -> torch.Tensor:
    """The read's partial sums (one a program), made once a device (a capture records its address)."""
    return torch.full((PROGRAMS,), float("nan"), dtype=torch.float32, device=device)


class Installed:
    """`ring.ring_attention` wrapped for the block; `calls` (ring attentions with the prefetch beside them),
    `refusals` (reason -> count), `last` (the last prefetched weight and its blocks: the GPU test checks the sum)."""

    def __init__(self, prefix_mb: int = PREFIX_MB):
        from foldkv.lab.bench.roofs import stream_read_kernel

        self.library = ring.ring_attention
        self.calls, self.refusals, self.last = 0, collections.Counter(), None
        read, library, state = stream_read_kernel(), self.library, self

        def ring_attention(module, query, key, value, mask, out=None):
            why = refusal(module, query)
            if why is not None:
                state.refusals[why] += 1
                return library(module, query, key, value, mask, out=out)
            state.calls += 1
            w = module.o_proj.weight
            blocks = prefix_blocks(w, prefix_mb)
            main = torch.cuda.current_stream(query.device)
            side = fused_step.side_streams(query.device)[1]
            side.wait_stream(main)  # after the work issued so far: the read overlaps the attention, not the GEMVs
            with torch.cuda.stream(side):
                read(w.view(-1), _partials(query.device), blocks)
            result = library(module, query, key, value, mask, out=out)
            main.wait_stream(side)  # the join: o_proj after the read, and the branch ends inside the capture
            state.last = (w, blocks)
            return result

        ring_attention._l2_prefetch = prefix_mb
        ring.ring_attention = ring_attention

    def uninstall(self) -> None:
        ring.ring_attention = self.library

    def report(self) -> dict:
        return {"calls": self.calls, "refusals": dict(self.refusals)}


@contextlib.contextmanager
def installed(prefix_mb: int = PREFIX_MB) -> Iterator[Installed]:
    """The prefetch beside every ring attention it describes, for the block (bench/model_decode_probe.py
    --l2-prefetch-ab); the library's ring attention is back after it."""
    state = Installed(prefix_mb)
    try:
        yield state
    finally:
        state.uninstall()


__all__ = ["MAX_BATCH", "PREFIX_MB", "PROGRAMS", "Installed", "installed", "prefix_blocks", "refusal"]
