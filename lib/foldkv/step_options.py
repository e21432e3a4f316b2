"""The decode step's choices as one frozen object (`StepOptions`), passed where the step is made and in force while
its forward runs (`using`, `in_force`: a context variable, so the ops and the GEMV need no extra argument). The
defaults are the served path; any other value computes the same thing (bitwise, unless its field says not).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from .validate import FoldKvInputError


@dataclass(frozen=True)
class StepOptions:
    """What the decode step fuses, merges and overlaps; `StepOptions()` is the served step."""

    merge: bool = True
    """projections that read one input (q|k|v, gate|up) as one GEMV over their weights merged into one tensor
    (`fused_step.merge_projections`): fewer launches, a larger matrix nearer the read roof."""
    branches: bool = True
    """unmerged projections of one input (with merge on: groups that could not merge) on side streams: graph
    branches whose tails overlap."""
    tail_sums: bool = True
    """a split-K projection's float32 partials summed by the norm that reads them (its split_sum launch gone)."""
    tail_next_norm: bool = True
    """the next decoder layer's input norm made by this layer's last kernel (its own launch gone)."""
    fuse_sliding: bool = True
    """a sliding layer's norms, RoPE and ring writes as one launch (`fused_step.sliding_prologue`)."""
    fuse_global_prologue: bool = True
    """a global layer's norms, RoPE, query and row from its projections as two PDL kernels
    (`global_step.query_from_projection`, `row_from_projection`)."""
    fuse_global: bool = True
    """a global layer's query and row after the model's norms and RoPE (any forward's) as two Triton kernels
    (`global_step.fold_and_store`) instead of the torch definition."""
    pdl: bool = True
    """the step's projections at 1..16 rows through `foldkv.gemv`'s tensor-core kernels and the step's Triton kernels
    launched under programmatic dependent launch; False: F.linear and plain launches."""
    fuse_prefill: bool = True
    """a prefill on CUDA through the step's own forward too (`StepForward.prefill`): elementwise work one Triton pass
    each instead of transformers' float32 modules (faster; within their rounding, not bitwise); projections cuBLAS's
    (no PDL inside a prefill)."""
    merge_prefill: bool = True
    """inside a prefill, a merged group as one GEMM; False: one GEMM a projection over its row block (cuBLAS picks
    kernels by shape: bench/PREFILL_NOTES.md). Not bitwise: another kernel's order, within the GEMM's float32 bound."""
    fuse_prefill_norm_rope: bool = True
    """inside a prefill on CUDA, each q and k head row's RMSNorm and RoPE as one pass (`fused_step_ops.norm_rope`):
    ~1% of a 32K prompt's time to first token (bench/PREFILL_NOTES.md)."""
    sliding_scratch: bool = True
    """inside a prefill, each sliding layer's [kept window | chunk] K and V in one scratch the sliding layers share
    (`foldkv.sliding_cache`; at batch 1 the norm and RoPE kernels write the chunk's rows there) instead of a torch.cat
    a layer a chunk, each layer keeping a window of its own, not a view holding the whole concatenation. On the 31B:
    -1.6% of a 32K prompt's time to first token, 3.1 GiB less at the prefill's peak (bench/PREFILL_NOTES.md)."""


SERVED = StepOptions()
_IN_FORCE: ContextVar[StepOptions] = ContextVar("foldkv_step_options", default=SERVED)


def in_force() -> StepOptions:
    """The options of the step running now; the served ones outside any step."""
    return _IN_FORCE.get()


@contextlib.contextmanager
def using(options: StepOptions) -> Iterator[StepOptions]:
    """`options` in force for the block (nested blocks restore what was in force before them)."""
    if not isinstance(options, StepOptions):
        raise FoldKvInputError(f"step options {options!r}: expected a foldkv StepOptions")
    token = _IN_FORCE.set(options)
    try:
        yield options
    finally:
        _IN_FORCE.reset(token)


__all__ = ["SERVED", "StepOptions", "in_force", "using"]
