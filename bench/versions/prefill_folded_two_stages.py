"""Folded prefill reading each key's 640 columns once, two stages deep: the rotary query part in registers (wgmma RS)
to make room for the second stage. Same arguments and outputs as the library's prefill_folded (a drop-in for the
launcher's `kernels={"prefill_folded": build(GEMMA4_31B)}`).

What it tries (bench/PREFILL_NOTES.md, "Why 43-54% of the matmul rate, and the two-stage folded row"):
  - The library's two windows (K_win = row[0:512], V_win = row[128:640]) bring 1,024 columns a key from L2 into
    shared memory: 128 KiB a 64-key tile for 8.4 MFLOP of tensor-core work (64 FLOP/B). At the measured 428 TFLOP/s
    that is ~6.7 TB/s of L2 reads across the chip, plausibly what Hopper's L2 delivers (not measured): the kernel
    looks L2-bound, and with one stage (the two windows and the query take 200 KiB of the 227) the next tile's load
    overlaps only part of this one.
  - Here a key block is the row read once: K_rot = row[0:128] and V_win = row[128:640] (80 KiB, 102 FLOP/B), scores =
    q_rot . K_rot^T + (q_unrot w_k) . V_win[:, :384]^T, values = P . V_win (value-window order, as the library's).
    `prefill_shared_tiles.py` read the same 640 columns with one stage and lost (339 against 428 TFLOP/s): V_win feeds
    both gemms, so its next load waited for P.V. Two stages of 80 KiB beside the 64 KiB query and P's 8 KiB are
    232 KiB, past 227; with q_rot [64, 128] held in registers (32 registers a consumer thread, the A operand of an RS
    wgmma, replicated in both warpgroups as the FullCol split needs) the query in shared memory is q_unrot [64, 384]
    (48 KiB): 2 x 80 + 48 + 8 = 216 KiB. The producer then loads block k + 1 while block k computes.
  - Everything else is the library's program (`prefill_attention.prefill_program` with this `key_block`): the same
    masking, softmax, tail-row clearing, epilogue and head-order store.

Prediction (written before any GPU run): 60-72% of the in-run bf16 matmul rate on a 4,096-query chunk at 32K of
context (library folded: 48-56% there). The L2 ceiling rises 1.6x (64 -> 102 FLOP/B: ~680 TFLOP/s at 6.7 TB/s);
what limits next is the consumer's serial tile: Q.K (its q_unrot part still re-reads A from shared memory in both
warpgroups: n32 a warpgroup), then the softmax with its cross-warpgroup reductions and the rescale of 128 accumulator
registers a thread, then P.V, with the tensor cores idle during the softmax (~20% of the tile).
What would prove it wrong: no gain over the library (then L2 bytes are not the limit: look at the consumer's serial
chain first, `prefill_folded_overlap.py`), or a gain at 8K but not at 32K (the stream from HBM, not L2).

Outcome (H100, bench/prefill_runs/h100_20261205_prefill_kernels.tgz, a 4,096-query chunk at 8K / 32K of context):
1.063x / 1.033x the two-window library (4.51 / 19.82 ms: 47.9% / 54.5% of the in-run matmul rate), so ~50.9% /
56.3%; gate passed. Far below the 60-72% predicted: the L2 bytes were not what held the two-window kernel back, the
consumer's serial tile is (its two successors took the rest). Its row key block was the library's bf16 folded block
until prefill_folded.py's seesaw replaced it; it is this file's `key_block` again, through the library program's
hook points (with its successors' softmax and rescale: `program(softmax=...)`); built here with the plain softmax (one
row a reduction, the max moved every tile), the step it measured.

    python bench/versions/prefill_folded_two_stages.py      # build here (sm_90a), print the CUDA size
    python bench/prefill_kernel_probe.py --out $OUT          # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import Run
from foldkv.kernels.prefill_attention import (KeyBlock, ScoreGemm, check_geometry, lazy_rescale_macro,
                                              prefill_program)
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

NUM_STAGES = 2  # two 80 KiB stages: 216 KiB with the query's 48 KiB and P's 8 KiB (module docstring)
SOFTMAX = dict(reduce_batch=1, max_slack_log2=None)  # this step's softmax: the library's before its two successors
# the row's tiling when it was the library's folded prefill (two stages, both rows of a thread a reduction, the lazy
# max): what the harnesses' params are laid over
DEFAULTS = dict(page_size=64, block_N=64, num_stages=2, threads=256, reduce_batch=2, max_slack_log2=8.0)


def key_block(geom: AttentionGeometry, fmt: KvFormat, block_M: int, block_N: int, fp8: bool = False):
    """The folded row's key block (`prefill_program`'s `key_block` hook): K_rot = row[0:128], V_win = row[128:640],
    q_rot in registers (module docstring)."""
    import tilelang.language as T

    D, R = geom.head_dim, geom.rotary_width
    U = D - R
    dtype = "bfloat16"

    @T.macro
    def folded_row_block():
        # q_rot in registers is what makes two stages of the row fit (PREFILL_SCHEDULE.md); it is replicated in both
        # consumer warpgroups, as the FullCol split of S needs: 32 registers a thread
        q_rot = T.alloc_fragment([block_M, R], dtype)  # score window [0, R): the A operand of an RS wgmma
        q_unrot = T.alloc_shared([block_M, U], dtype)  # score window [R, D): q_unrot * w_k
        K_rot = T.alloc_shared([block_N, R], dtype)  # row[0:128]
        V_win = T.alloc_shared([block_N, D], dtype)  # row[128:640] = [V_unrot | V_rot]
        return KeyBlock(query=(Run(q_rot, 0, R), Run(q_unrot, R, D)), row=(Run(K_rot, 0, R), Run(V_win, R, R + D)),
                        scores=(ScoreGemm(q_rot, K_rot), ScoreGemm(q_unrot, V_win[:, 0:U])), values=(V_win,))

    return folded_row_block


def tiling_of(softmax: dict, params: dict) -> dict:
    """The library prefill's params (the harnesses pass the registered ones through) with a step's softmax in place of
    the registered one and at least NUM_STAGES stages."""
    return {**DEFAULTS, **params, **softmax, "num_stages": max(params.get("num_stages", 1), NUM_STAGES)}


def program(geom: AttentionGeometry = GEMMA4_31B, softmax: dict = SOFTMAX, **tiling):
    """The TileLang prim_func: the library's program (the library prefill's arguments) with this row and a step's
    `softmax` (reduce_batch, max_slack_log2: with a slack, the rescale `lazy_rescale_macro`'s) and at least two
    stages, whatever the registered tiling says."""
    cfg = tiling_of(softmax, tiling)
    reduce_batch, slack = cfg.pop("reduce_batch"), cfg.pop("max_slack_log2")
    return prefill_program(geom, KvFormat.FOLDED, **cfg, key_block=key_block,
                           softmax=macros.online_softmax_macro(key_dim=1, fold_scale=True, reduce_batch=reduce_batch,
                                                               max_slack_log2=slack),
                           rescale=None if slack is None else lazy_rescale_macro())


def build(geom: AttentionGeometry = GEMMA4_31B, *, arch: str | None = None, **tiling):
    """Compile the two-stage folded-row prefill for `geom` (the library prefill's params; at least two stages)."""
    check_geometry(geom, KvFormat.FOLDED)
    tilelang = require_tilelang()

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_folded_two_stages(page_size, block_N, num_stages, threads):
        return program(geom, page_size=page_size, block_N=block_N, num_stages=num_stages, threads=threads)

    cfg = tiling_of(SOFTMAX, tiling)
    return prefill_folded_two_stages(cfg["page_size"], cfg["block_N"], cfg["num_stages"], cfg["threads"])


def main():
    kernel = build(GEMMA4_31B)
    print(f"prefill_folded two stages {tiling_of(SOFTMAX, {})}: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
