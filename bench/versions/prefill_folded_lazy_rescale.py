"""`prefill_folded_two_stages_batched.py` with the output rescale skipped while the row max stands: the running max is
only moved when a tile's scores pass it by more than 2^8 (FlashAttention-4's conditional rescale), so most tiles'
rescale factors are exactly 1 and a consumer thread whose rows all have 1 skips its 128 multiplies of the output
accumulator. Same arguments and outputs as the library's prefill_folded.

What it tries (bench/PREFILL_NOTES.md, "Why 43-54% of the matmul rate, and the two-stage folded row"): between Q.K and
P.V of every 64-key tile, with the tensor cores idle, each consumer thread multiplies its 128 output registers by the
rescale (64 x 512 fp32 over 256 threads): 128 FMULs x 8 warps = ~256 cycles of an SM's FP32 issue a tile, ~8% of the
two-stage row's ~3,200-cycle tile. After the first tiles the max of a row rarely moves (i.i.d. scores: a new record in
the k-th tile with probability ~1/k); with the 2^8 slack it almost never does.
  - The softmax (this file's `lazy_softmax_macro`: the library's `macros.online_softmax_macro` with one change) keeps
    the old max m unless max(m, rowmax) - m > 8 / log2(e), in score units; probabilities are then exp2(s log2 e -
    m log2 e) <= 2^8 (exact in float32, no bf16 overflow: P in [0, 256]); the denominator and the LSE use the same m,
    so the result is the same softmax (not an approximation); the rescale is exp2(0) = 1 exactly when m stands.
  - The rescale (`lazy_rescale_macro`) runs under a per-thread flag: a warp executes it if any of its threads' rows
    moved (rare after the first tiles), otherwise branches over it.
  - Both warpgroups compute the same row max (the cross-warpgroup reduction) and so the same decision: their output
    halves stay on one scale.

Prediction (written before any GPU run): 4-8% faster than `prefill_folded_two_stages_batched.py` at 32K, 3-7% at 8K
(fewer tiles a CTA, more of them early ones whose max still moves). No gain: the multiplies were hidden (issued
beside the other warps' exp2 and barriers) or nvcc predicated the block instead of branching over it (the emitted
CUDA's `if` around the loop: look at the SASS for a BRA around the FMULs).

    python bench/versions/prefill_folded_lazy_rescale.py      # build here (sm_90a), print the CUDA size
    python bench/prefill_kernel_probe.py --out $OUT            # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.prefill_attention import DEFAULTS, check_geometry
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

from versions import prefill_folded_two_stages as two_stages  # bench/versions/
from versions import prefill_folded_two_stages_batched as batched  # bench/versions/

MAX_SLACK_LOG2 = 8.0  # the running max stands until a score passes it by 2^8 (P <= 256)


def lazy_softmax_macro(scale: float = macros.LOG2E, reduce_batch: int = batched.REDUCE_BATCH,
                       slack_log2: float = MAX_SLACK_LOG2):
    """`macros.online_softmax_macro(key_dim=1, fold_scale=True, reduce_batch=...)` whose running max moves only when
    the tile's passes it by more than `slack_log2` (in the exp2 domain), so that the rescale is exactly 1 otherwise."""
    import tilelang.language as T

    slack = slack_log2 / scale  # in score units

    @T.macro
    def online_softmax(scores, p_shared, run_max, run_max_prev, rescale, tile_sum, denom, key_weight=None):
        rows, cols = scores.shape
        T.copy(run_max, run_max_prev)
        T.reduce_max(scores, run_max, dim=1, clear=False, batch=reduce_batch)
        for q in T.Parallel(rows):  # the first tile always moves it: run_max_prev is -inf there
            run_max[q] = T.if_then_else(run_max[q] - run_max_prev[q] > slack, run_max[q], run_max_prev[q])
            rescale[q] = T.exp2((run_max_prev[q] - run_max[q]) * scale)
        for i, j in T.Parallel(rows, cols):
            scores[i, j] = T.exp2(scores[i, j] * scale - run_max[i] * scale)
        T.reduce_sum(scores, tile_sum, dim=1, batch=reduce_batch)
        for q in T.Parallel(rows):
            denom[q] = denom[q] * rescale[q] + tile_sum[q]
        T.copy(scores, p_shared)

    return online_softmax


def lazy_rescale_macro():
    """`prefill_attention.rescale_macro` under a per-thread flag: skipped by a thread whose rows' rescales are all 1."""
    import tilelang.language as T

    @T.macro
    def rescale_outputs(outs, rescale):
        moved = T.alloc_local([1], "int32")
        moved[0] = 0
        for q in T.Parallel(rescale.shape[0]):
            if rescale[q] != T.float32(1):
                moved[0] = 1
        if moved[0] != 0:
            for out in outs:
                for i, d in T.Parallel(out.acc.shape[0], out.acc.shape[1]):
                    out.acc[i, d] *= rescale[i]

    return rescale_outputs


def program(geom: AttentionGeometry = GEMMA4_31B, **tiling):
    """The TileLang prim_func: the two-stage row, batched reductions, lazy rescale (the library prefill's arguments)."""
    return two_stages.program(geom, **tiling, softmax=lazy_softmax_macro(), rescale=lazy_rescale_macro())


def build(geom: AttentionGeometry = GEMMA4_31B, *, page_size: int = 64, block_N: int = 64, num_stages: int = 1,
          threads: int = 256, arch: str | None = None):
    """Compile the lazy-rescale folded-row prefill (the library prefill's params; at least two stages)."""
    check_geometry(geom, KvFormat.FOLDED)
    tilelang = require_tilelang()
    num_stages = max(num_stages, two_stages.NUM_STAGES)

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_folded_lazy_rescale(page_size, block_N, num_stages, threads):
        return program(geom, page_size=page_size, block_N=block_N, num_stages=num_stages, threads=threads)

    return prefill_folded_lazy_rescale(page_size, block_N, num_stages, threads)


def main():
    kernel = build(GEMMA4_31B, **DEFAULTS)
    tiling = dict(DEFAULTS, num_stages=two_stages.NUM_STAGES)
    print(f"prefill_folded lazy rescale (slack 2^{MAX_SLACK_LOG2:g}) {tiling}: {len(kernel.get_kernel_source())} chars"
          " of CUDA")


if __name__ == "__main__":
    main()
