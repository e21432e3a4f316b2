"""A sliding layer's ring attention in two halves on two branches of the step's graph, the library's kernels in each.

What it tries (MODEL_DECODE_NOTES "Run 28: prediction"; written before any GPU run): `ring.ring_attention` is
cuBLAS's q.K^T, `fused_step.masked_softmax` and cuBLAS's P.V, one after another over all B x Hkv heads; s27's batch-8
profile puts the two matmuls at 82% of the read roof (18.5 + 18.4 us a layer for ~30 us of bytes) and s25's one-row
profile at ~11 us a layer for 3.5 us of bytes (32-256 CTAs each, a ramp and a tail each, every launch a full boundary).
Here the heads are cut in two halves (the batch's two halves when B is even: their rings, queries and masks are
contiguous slices; the KV heads' two halves at B = 1), each half's three kernels issued on its own stream (the main
one and fused_step's side stream: a fork and a join, branches of the captured graph), so one half's launches, ramps
and tails overlap the other's body. Each half is `ring.ring_attention` on its heads (the same matmuls per head,
the same softmax rows), writing into its slice of one output (its `out=`), so no copy joins them.
Described: CUDA, B even or B = 1 with an even Hkv; anything else is the library's, the reason counted.

Prediction: the second half's three launches and ramps hidden behind the first's body, ~1.5-3 us a layer at one row
(of ~11) and ~2-4 us at eight (of ~39): **-0.07 to -0.15 ms a step at 4K x 1 and 32K x 1, -0.1 to -0.2 at 4K x 8**.
What proves it wrong: under 0.04 ms saved at 4K x 8 (two streams of matmuls share the DRAM no better than one: the
tails were not idle bandwidth), or more time (run 24's branch cost more than it moved: the fork and join as graph
edges between small kernels); the outputs not bitwise the library's (cuBLAS chose another kernel for half the batch:
then this version needs test_ring_attention_split_gpu's bound, not torch.equal).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_ring_attention_branched_gpu.py`;
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --ring-branch-ab` (label "ring on two branches"; the calls it took and its refusals are printed).
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch

from foldkv import fused_step, ring
from foldkv.masks import RingMask
from versions import ring_attention_split as split  # bench/versions/: its installation (calls, refusals)


LIBRARY = ring.ring_attention  # each half's: taken at import, before `installed` patches the name
assert not hasattr(LIBRARY, "_ring_version"), "imported while a lab ring attention was installed"


def refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> str | None:
    """None when the two halves describe this call, else why the library's ring attention keeps it (the device asked
    last: on the CPU a call they describe answers "not on CUDA")."""
    b, hkv = key.shape[0], key.shape[1]
    if not (key.is_contiguous() and value.is_contiguous()):
        return "rings not packed"
    if b % 2 and not (b == 1 and hkv % 2 == 0):
        return f"batch {b} odd (B = 1 with an even Hkv, or an even B, split in halves)"
    if not key.is_cuda:
        return "not on CUDA"
    return None


def ring_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float,
                _red: str | None = None) -> torch.Tensor:
    """query [B, Hq, 1, d], rings [B, Hkv, W, d] packed, mask [B, 1, 1, W] bool -> [B, 1, Hq, d]: the two halves on
    the main and the side stream. `_red` (the tests' red twin, never for use): "swap_masks" gives each half the other
    half's mask rows (at B = 1, the second half's mask with slot 0 dead)."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    out = torch.empty(b, hkv, g, d, dtype=value.dtype, device=value.device)
    if b % 2 == 0:
        h = b // 2
        halves = [(slice(0, h), slice(None), slice(None)), (slice(h, b), slice(None), slice(None))]
        masks = [mask[:h], mask[h:]] if _red != "swap_masks" else [mask[h:], mask[:h]]
    else:
        h = hkv // 2
        halves = [(slice(None), slice(0, h), slice(0, h * g)), (slice(None), slice(h, hkv), slice(h * g, hq))]
        masks = [mask, mask] if _red != "swap_masks" else [mask, mask.clone().index_fill_(-1, mask.new_zeros(
            1, dtype=torch.long), False)]
    module = types.SimpleNamespace(scaling=scaling)
    main = torch.cuda.current_stream(value.device)
    side = fused_step.side_streams(value.device)[0]
    side.wait_stream(main)  # the query and the rings written

    def half(i: int) -> None:  # the library's ring attention on these heads, P.V into their slice of out
        (bs, hs, qs), ms = halves[i], masks[i]
        LIBRARY(module, query[bs, qs], key[bs, hs], value[bs, hs], RingMask(ms), out=out[bs, hs])

    with torch.cuda.stream(side):
        half(1)
    half(0)
    main.wait_stream(side)  # the join (o_proj reads both halves): after it main reuses nothing the side still reads
    return out.reshape(b, 1, hq, d)


@contextlib.contextmanager
def installed(red: str | None = None) -> Iterator[split.Installed]:
    """The library's ring attention replaced by the two halves for the block (ring_attention_split's installation:
    `.calls`, `.refusals`)."""
    state = split.Installed(red, name="two-branch", refuse=refusal,
                            attend=lambda q, k, v, m, scaling, r: ring_attend(q, k, v, m, scaling, _red=r))
    try:
        yield state
    finally:
        state.uninstall()


__all__ = ["refusal", "ring_attend", "installed"]
