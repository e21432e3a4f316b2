"""The decode step's glue (DecodeStep's device prologue and the rotary tables) on a side branch of the step's graph.

What it tries (MODEL_DECODE_NOTES "Run 24: prediction"; written before any GPU run): a replay of the 31B's step starts
with ~35 small torch kernels that nothing of the first layer's GEMM needs: `DecodeStep._prologue` (the lengths, the
positions, the ring slot, the sliding mask, the pools' slots: ~15 kernels and copies) and the model's rotary
embeddings for its two layer types (a cast, a product, a cat, cos, sin, two scalings, two casts: ~9 kernels a type).
They run one after another at the head of the graph, each a full boundary (torch kernels never trigger programmatic
dependent launch), before the embedding lookup, the first input norm and the first layer's merged q|k|v GEMM, none of
which reads them. Here they are issued on a side stream forked at the step's head (a branch of the captured graph,
as fused_step's projection branches are): the prologue, then the model's own rotary module on the step's positions
for each layer type. The model's rotary call inside the forward returns those tables, and the main stream joins the
branch right before the first consumer: fused_step's `sliding_prologue` (a sliding layer's cos/sin, slot and mask,
after its GEMM) or fused_step's `rope` (a layer taking the module's formulas). The kernels
and their inputs are the same, so the step is bitwise the library's; only the order changes. The branch is taken
where the first decoder layer is sliding (the 31B's and the synthetic model's are): its `sliding_prologue` is then
the first consumer whatever the global layers run (run 23's forward reads cos/sin through its own kernels).

Prediction: the branch (~35 kernels at ~1.5-2.5 us each in a graph: ~50-80 us) overlaps the embedding, the first
input norm and the first GEMM (the 31B's layer 0 is sliding: its merged q|k|v reads 176 MB, ~40 us, plus ~5 us of
small kernels). Saved ~min(branch, main) ~40-45 us: **-0.03 to -0.05 ms a step**, the same at every cell (launches,
not bytes). What proves it wrong: under 0.02 ms saved at 4K x 1 (the glue kernels were shorter than counted, or a
graph's two branches do not overlap small kernels with a GEMM's body), or the step not bitwise (a consumer that read
the branch's outputs before the join: the tests' red twin is the branch writing the next slot instead).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_step_glue_branch_gpu.py`;
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --glue-ab` (label "glue on a branch").
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator
from unittest import mock

import torch

from foldkv import fused_step
from foldkv.hf import text_model_of
from foldkv.hf_graph import DecodeStep
from foldkv.step_options import using


@functools.lru_cache(maxsize=None)
def glue_stream(device: torch.device) -> torch.cuda.Stream:
    """The branch's stream of `device` (made once: a capture records streams by identity)."""
    return torch.cuda.Stream(device=device)


class _Branch:
    """One step's branch: its stream and whether the main stream has joined it yet."""

    def __init__(self, side: torch.cuda.Stream):
        self.side, self.joined = side, False

    def join(self) -> None:
        if not self.joined:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.joined = True


@contextlib.contextmanager
def installed(red_next_slot: bool = False) -> Iterator[dict]:
    """DecodeStep's step body with its glue on a branch, for the block (bench/model_decode_probe.py --glue-ab);
    yields {"steps": n}, the step bodies that took the branch. `red_next_slot` (the tests' red twin, never for use):
    the branch's prologue writes the ring slot one ahead."""
    served_body, served_prologue = DecodeStep._body, fused_step.sliding_prologue  # the body: the CPU's, unchanged
    served_rope = fused_step.rope
    took = {"steps": 0}
    state: dict = {}

    def body(self, forward):
        """DecodeStep._body with the prologue and the rotary tables on the branch, joined before the first consumer
        and, at the latest, before the step's column advances (the next step's branch reads it)."""
        own = self.forward
        text = text_model_of(own.model) if own is not None and self.pos.is_cuda and own.takes(self.kwargs) else None
        if text is None or text.config.layer_types[0] != "sliding_attention":
            return served_body(self, forward)  # the CPU's static step, or a first layer whose consumer is not joined
        took["steps"] += 1
        rotary = text.rotary_emb
        dev = self.pos.device
        branch = state["branch"] = _Branch(glue_stream(dev))
        branch.side.wait_stream(torch.cuda.current_stream(dev))
        probe = torch.empty(1, 1, 1, dtype=text.embed_tokens.weight.dtype, device=dev)  # dtype and device only
        with torch.cuda.stream(branch.side):
            self._prologue()
            if red_next_slot:
                self.slot.add_(1).remainder_(self.window)
            tables = {t: rotary(probe, self.pos, t) for t in dict.fromkeys(text.config.layer_types)}

        def tables_of(x, position_ids, layer_type=None):
            return tables[layer_type]

        with mock.patch.object(rotary, "forward", tables_of), using(self.options):
            out = own.decode(self, self.ids, self.pos, self.masks)
        branch.join()
        self.col.add_(1)
        return out

    def sliding_prologue(*a, **kw):
        state["branch"].join()
        return served_prologue(*a, **kw)

    def rope(*a, **kw):
        branch = state.get("branch")
        if branch is not None:
            branch.join()
        return served_rope(*a, **kw)

    with (mock.patch.object(DecodeStep, "_body", body), mock.patch.object(fused_step, "sliding_prologue",
                                                                          sliding_prologue),
          mock.patch.object(fused_step, "rope", rope)):
        yield took


__all__ = ["glue_stream", "installed"]
