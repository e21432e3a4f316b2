"""`prefill_folded_two_stages.py` with the softmax's cross-warpgroup reductions batched: each consumer thread's two
query rows share one reduction (its named barriers and shared-memory exchange) per max and per sum, instead of one
reduction per row. Same arguments and outputs as the library's prefill_folded.

What it tries (bench/PREFILL_NOTES.md, "Why 43-54% of the matmul rate, and the two-stage folded row"): the two
consumer warpgroups split every score row's 64 keys (FullCol: 32 each), so the row max and the row sum cross the
warpgroups through shared memory. TileLang's reduction does that one row at a time: per 64-key tile, per thread,
2 rows x (max, sum) = 4 cross-warpgroup AllReduces, each a 256-thread named barrier round trip, on the consumer's
serial path between Q.K and P.V (the tensor cores idle through all of it). `reduce_batch=2` (the decode partial's
option, `macros.online_softmax_macro`) carries both rows in one: 2 round trips a tile instead of 4.

Prediction (written before any GPU run): 2-6% faster than `prefill_folded_two_stages.py` (~60-150 cycles of the
~3,000 of a tile, if a round trip costs 30-75 cycles with both warpgroups arriving together); no change would say the
barriers overlap or cost less than that, and the serial softmax is exp2 and the accumulator rescale (128 FMULs a
thread a tile), not its reductions.

    python bench/versions/prefill_folded_two_stages_batched.py   # build here (sm_90a), print the CUDA size
    python bench/prefill_kernel_probe.py --out $OUT               # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.prefill_attention import DEFAULTS, check_geometry
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

from versions import prefill_folded_two_stages as two_stages  # bench/versions/

REDUCE_BATCH = 2  # the two query rows a consumer thread holds of S [64, 64] split over 2 warpgroups


def batched_softmax_macro():
    """The library prefill's online softmax (`macros.online_softmax_macro`, keys along dim 1, the scale folded into
    one FMA a score) with REDUCE_BATCH rows a cross-warpgroup reduction."""
    return macros.online_softmax_macro(key_dim=1, fold_scale=True, reduce_batch=REDUCE_BATCH)


def program(geom: AttentionGeometry = GEMMA4_31B, **tiling):
    """The TileLang prim_func: the two-stage version's with REDUCE_BATCH (the library prefill's arguments)."""
    return two_stages.program(geom, **tiling, softmax=batched_softmax_macro())


def build(geom: AttentionGeometry = GEMMA4_31B, *, page_size: int = 64, block_N: int = 64, num_stages: int = 1,
          threads: int = 256, arch: str | None = None):
    """Compile the two-stage folded-row prefill with batched softmax reductions (the library prefill's params)."""
    check_geometry(geom, KvFormat.FOLDED)
    tilelang = require_tilelang()
    num_stages = max(num_stages, two_stages.NUM_STAGES)

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_folded_two_stages_batched(page_size, block_N, num_stages, threads):
        return program(geom, page_size=page_size, block_N=block_N, num_stages=num_stages, threads=threads)

    return prefill_folded_two_stages_batched(page_size, block_N, num_stages, threads)


def main():
    kernel = build(GEMMA4_31B, **DEFAULTS)
    print(f"prefill_folded two stages, batched reductions {dict(DEFAULTS, num_stages=two_stages.NUM_STAGES)}:"
          f" {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
