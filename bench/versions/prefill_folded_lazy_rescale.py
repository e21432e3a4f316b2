"""`prefill_folded_two_stages_batched.py` with the output rescale skipped while the row max stands: the running max is
only moved when a tile's scores pass it by more than 2^8 (FlashAttention-4's conditional rescale), so most tiles'
rescale factors are exactly 1 and a consumer thread whose rows all have 1 skips its 128 multiplies of the output
accumulator. Same arguments and outputs as the library's prefill_folded.

What it tries (bench/PREFILL_NOTES.md, "Why 43-54% of the matmul rate, and the two-stage folded row"): between Q.K and
P.V of every 64-key tile, with the tensor cores idle, each consumer thread multiplies its 128 output registers by the
rescale (64 x 512 fp32 over 256 threads): 128 FMULs x 8 warps = ~256 cycles of an SM's FP32 issue a tile, ~8% of the
two-stage row's ~3,200-cycle tile. After the first tiles the max of a row rarely moves (i.i.d. scores: a new record in
the k-th tile with probability ~1/k); with the 2^8 slack it almost never does.
  - The softmax (then this file's `lazy_softmax_macro`: the library's `macros.online_softmax_macro` with one change) keeps
    the old max m unless max(m, rowmax) - m > 8 / log2(e), in score units; probabilities are then exp2(s log2 e -
    m log2 e) <= 2^8 (exact in float32, no bf16 overflow: P in [0, 256]); the denominator and the LSE use the same m,
    so the result is the same softmax (not an approximation); the rescale is exp2(0) = 1 exactly when m stands.
  - The rescale (then this file's `lazy_rescale_macro`) runs under a per-thread flag: a warp executes it if any of its threads' rows
    moved (rare after the first tiles), otherwise branches over it.
  - Both warpgroups compute the same row max (the cross-warpgroup reduction) and so the same decision: their output
    halves stay on one scale.

Prediction (written before any GPU run): 4-8% faster than `prefill_folded_two_stages_batched.py` at 32K, 3-7% at 8K
(fewer tiles a CTA, more of them early ones whose max still moves). No gain: the multiplies were hidden (issued
beside the other warps' exp2 and barriers) or nvcc predicated the block instead of branching over it (the emitted
CUDA's `if` around the loop: look at the SASS for a BRA around the FMULs).

Outcome (H100, bench/prefill_runs/h100_20261205_prefill_kernels.tgz, a 4,096-query chunk at 8K / 32K of context):
1.157x / 1.157x the two-window library (4.51 / 19.82 ms), 55.4% / 63.0% of the in-run matmul rate, i.e. 1.051x /
1.069x `prefill_folded_two_stages_batched.py`: within the 3-7% / 4-8% predicted; gate passed on the hostile
case (rel 1.99e-3, max|err| 2.52e-2; the library 1.69e-3 / 1.55e-2). The winner: it is now the library's
prefill_folded (registered num_stages=2, reduce_batch=2, max_slack_log2=8.0): the lazy max is
`macros.online_softmax_macro(max_slack_log2=...)`, the skipped rescale `prefill_attention.lazy_rescale_macro`. This
file builds the two-stage row (`prefill_folded_two_stages.program`) with that softmax, pinned, as the record of the
step.

    python bench/versions/prefill_folded_lazy_rescale.py      # build here (sm_90a), print the CUDA size
    python bench/prefill_kernel_probe.py --out $OUT            # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels.prefill_attention import check_geometry
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

from versions import prefill_folded_two_stages as two_stages  # bench/versions/
from versions import prefill_folded_two_stages_batched as batched  # bench/versions/

MAX_SLACK_LOG2 = 8.0  # the running max stands until a score passes it by 2^8 (P <= 256)
SOFTMAX = dict(reduce_batch=batched.REDUCE_BATCH, max_slack_log2=MAX_SLACK_LOG2)  # this step's softmax


def program(geom: AttentionGeometry = GEMMA4_31B, **tiling):
    """The TileLang prim_func: the two-stage row, batched reductions, lazy rescale (the library prefill's arguments)."""
    return two_stages.program(geom, SOFTMAX, **tiling)


def build(geom: AttentionGeometry = GEMMA4_31B, *, arch: str | None = None, **tiling):
    """Compile the lazy-rescale folded-row prefill (the library prefill's params; at least two stages)."""
    check_geometry(geom, KvFormat.FOLDED)
    tilelang = require_tilelang()

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_folded_lazy_rescale(page_size, block_N, num_stages, threads):
        return program(geom, page_size=page_size, block_N=block_N, num_stages=num_stages, threads=threads)

    cfg = two_stages.tiling_of(SOFTMAX, tiling)
    return prefill_folded_lazy_rescale(cfg["page_size"], cfg["block_N"], cfg["num_stages"], cfg["threads"])


def main():
    kernel = build(GEMMA4_31B)
    tiling = two_stages.tiling_of(SOFTMAX, {})
    print(f"prefill_folded lazy rescale (slack 2^{MAX_SLACK_LOG2:g}) {tiling}: {len(kernel.get_kernel_source())} chars"
          " of CUDA")


if __name__ == "__main__":
    main()
