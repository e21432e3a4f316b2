"""The decode step's choices as one frozen object, passed in where the step is made (`FoldKvCache(step_options=)`,
`DecodeStep`, `foldkv.fused_step.StepForward`), never module globals flipped from outside.

The defaults are the served path; each other value is a way of computing the same thing that the tests and the lab's
probes (bench/model_decode_probe.py's `--*-ab` arms) compare against it: every field but `pdl` gives bitwise the
same tokens and logits but `fuse_prefill` and `merge_prefill` (see there), `pdl=False` the projections of cuBLAS's
F.linear (within the GEMV's float32 bound).

How the functions deep inside the step read them: the one who makes the step passes the options; while the step's
forward runs (`DecodeStep` around its body and its prefill) they are the options `in_force()`, scoped by
`using(options)` (a context variable: per thread, restored on exit), so the step's forward, the ops and the GEMV
ask `in_force()` instead of taking one more argument through every call between them. Outside any step the served options are in force. A FoldKvCache made without `step_options` takes those in
force where it is made (a probe's `with using(StepOptions(...)):` around the cells it builds).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from .validate import FoldKvInputError


@dataclass(frozen=True)
class StepOptions:
    """What the decode step fuses, merges and overlaps (module docstring); `StepOptions()` is the served step.

    merge: projections that read one input (a layer's q|k|v, gate|up) read as one GEMV over their weights merged into
        one tensor (`fused_step.merge_projections`): fewer launches, a larger matrix nearer the read roof.
    branches: unmerged projections of one input issued on side streams (graph branches whose tails overlap); with
        merge on, only the groups that could not merge.
    tail_sums: a split-K projection's float32 partials summed by the norm that reads them (its split_sum launch gone).
    tail_next_norm: the next decoder layer's input norm made by this layer's last kernel (its own launch gone).
    fuse_sliding: a sliding layer's norms, RoPE and ring writes as one launch before its ring attention
        (`fused_step.sliding_prologue`).
    fuse_global_prologue: a global layer's norms, RoPE, query and row from its projections as two PDL kernels
        (`global_step.query_from_projection`, `row_from_projection`).
    fuse_global: a global layer's query and row (after the model's norms and RoPE; a prefill's, an eager decode's
        and the step's) as two Triton kernels (`global_step.fold_and_store`) instead of the torch definition.
    pdl: the step's projections at 1..16 rows through `foldkv.gemv`'s tensor-core kernels and the step's Triton
        kernels launched under programmatic dependent launch; False: F.linear and plain launches.
    fuse_prefill: a prefill forward on CUDA (more than one token a sequence) runs through the step's own forward too
        (`DecodeStep.prefill`, `StepForward.prefill`): its norms, RoPE, GELU x up and residual tails one Triton pass
        each over its rows instead of transformers' float32 modules (a 32K prompt of the 31B: 5.80 -> 4.56 s on an H100), within the
        neutral figure of transformers' modules, not bitwise (the merged projections take other cuBLAS kernels); its
        projections cuBLAS's at every row count (`pdl` off inside a prefill: nothing built for a short chunk).
    merge_prefill: inside a prefill, a merged projection group (q|k(|v), gate|up) as one GEMM over its merged weight;
        False: one GEMM a projection over its row block of that weight (a contiguous view: no memory added). cuBLAS
        picks its kernel by shape, and the 31B's merged shapes looked ~4% slower at 4,096 rows (bench/PREFILL_NOTES.md):
        False measures the other side. The same sums over the same K, but on CUDA another kernel may reduce in another order:
        within the GEMM's float32 bound, not bitwise. Decode steps always read the merged weight (`merge`).
    fuse_prefill_norm_rope: inside a prefill on CUDA, each q and k head row's RMSNorm and RoPE as one pass
        (`fused_step_ops.norm_rope`) instead of two (`rms_norm`, then `rope`): the same formulas at the same rounding
        points (the normed row rounded to the model's dtype before RoPE), bitwise the two; one write and one read of
        the chunk's q and k less. Off by default: a served path changes only on a measured gain, and this one's is a
        prediction so far (bench/PREFILL_NOTES.md).
    sliding_scratch: inside a prefill, each sliding layer's [kept window | chunk] K and V assembled in one scratch the
        cache's sliding layers share (`foldkv.sliding_cache`; at batch 1 the norm and RoPE kernels write the chunk's
        rows there) instead of transformers' torch.cat a layer a chunk, and each layer keeping a window of its own
        instead of a view that holds the whole concatenation: the same values at the same places (bitwise). Off by
        default until its A/B has run on the GPU (bench/PREFILL_NOTES.md: -11 to -12 ms a 4K chunk of the 31B
        predicted, 3.3 GB less held).
    """

    merge: bool = True
    branches: bool = True
    tail_sums: bool = True
    tail_next_norm: bool = True
    fuse_sliding: bool = True
    fuse_global_prologue: bool = True
    fuse_global: bool = True
    pdl: bool = True
    fuse_prefill: bool = True
    merge_prefill: bool = True
    fuse_prefill_norm_rope: bool = False
    sliding_scratch: bool = False


SERVED = StepOptions()
_IN_FORCE: ContextVar[StepOptions] = ContextVar("foldkv_step_options", default=SERVED)


def in_force() -> StepOptions:
    """The options of the step running now (module docstring); the served ones outside any step."""
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
