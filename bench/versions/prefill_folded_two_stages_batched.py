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

Outcome (H100, bench/prefill_runs/h100_20261205_prefill_kernels.tgz, a 4,096-query chunk at 8K / 32K of context):
1.101x / 1.082x the two-window library (4.51 / 19.82 ms), i.e. 1.036x / 1.047x `prefill_folded_two_stages.py`: within
the 2-6% predicted; gate passed. Batched reductions are the library's softmax option
(`macros.online_softmax_macro(reduce_batch=)`); this file builds the two-stage row (`prefill_folded_two_stages.program`)
with them and the max moved every tile.

    python bench/versions/prefill_folded_two_stages_batched.py   # build here (sm_90a), print the CUDA size
    python bench/prefill_kernel_probe.py --out $OUT               # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels.prefill_attention import check_geometry
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

from versions import prefill_folded_two_stages as two_stages  # bench/versions/

REDUCE_BATCH = 2  # the two query rows a consumer thread holds of S [64, 64] split over 2 warpgroups
SOFTMAX = dict(reduce_batch=REDUCE_BATCH, max_slack_log2=None)  # this step's softmax


def program(geom: AttentionGeometry = GEMMA4_31B, **tiling):
    """The TileLang prim_func: the two-stage version's with REDUCE_BATCH (the library prefill's arguments)."""
    return two_stages.program(geom, SOFTMAX, **tiling)


def build(geom: AttentionGeometry = GEMMA4_31B, *, arch: str | None = None, **tiling):
    """Compile the two-stage folded-row prefill with batched softmax reductions (the library prefill's params)."""
    check_geometry(geom, KvFormat.FOLDED)
    tilelang = require_tilelang()

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_folded_two_stages_batched(page_size, block_N, num_stages, threads):
        return program(geom, page_size=page_size, block_N=block_N, num_stages=num_stages, threads=threads)

    cfg = two_stages.tiling_of(SOFTMAX, tiling)
    return prefill_folded_two_stages_batched(cfg["page_size"], cfg["block_N"], cfg["num_stages"], cfg["threads"])


def main():
    kernel = build(GEMMA4_31B)
    print(f"prefill_folded two stages, batched reductions {two_stages.tiling_of(SOFTMAX, {})}:"
          f" {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
