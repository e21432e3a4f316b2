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

    python bench/versions/prefill_folded_two_stages.py      # build here (sm_90a), print the CUDA size
    python bench/prefill_kernel_probe.py --out $OUT          # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels.decode_partial import Run
from foldkv.kernels.prefill_attention import DEFAULTS, KeyBlock, ScoreGemm, check_geometry, prefill_program
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

NUM_STAGES = 2  # two 80 KiB stages: 216 KiB with the query's 48 KiB and P's 8 KiB (module docstring)


def row_block_macro(geom: AttentionGeometry, fmt: KvFormat, block_M: int, block_N: int, fp8: bool = False):
    """The folded row read once (K_rot = row[0:128], V_win = row[128:640]) and the query's rotary part in registers,
    as a `prefill_attention.key_block_macro` (its signature: `prefill_program(key_block=...)`)."""
    import tilelang.language as T

    if fmt is not KvFormat.FOLDED or fp8:
        raise ValueError("the two-stage row is the bf16 folded row's")
    D, R = geom.head_dim, geom.rotary_width
    U = D - R
    dtype = "bfloat16"

    @T.macro
    def row_block():
        q_rot = T.alloc_fragment([block_M, R], dtype)  # score window [0, R): the A operand of an RS wgmma
        q_unrot = T.alloc_shared([block_M, U], dtype)  # score window [R, D): q_unrot * w_k
        K_rot = T.alloc_shared([block_N, R], dtype)  # row[0:128]
        V_win = T.alloc_shared([block_N, D], dtype)  # row[128:640] = [V_unrot | V_rot]
        return KeyBlock(query=(Run(q_rot, 0, R), Run(q_unrot, R, D)), row=(Run(K_rot, 0, R), Run(V_win, R, R + D)),
                        scores=(ScoreGemm(q_rot, K_rot), ScoreGemm(q_unrot, V_win[:, 0:U])), values=(V_win,))

    return row_block


def program(geom: AttentionGeometry = GEMMA4_31B, *, page_size: int = 64, block_N: int = 64,
            num_stages: int = NUM_STAGES, threads: int = 256, softmax=None, rescale=None):
    """The TileLang prim_func (the library prefill's arguments; `softmax`, `rescale`: `prefill_program`'s, for the
    versions built on this one). `num_stages` is at least this version's two, whatever the registered tiling says:
    the harnesses pass the library's params through."""
    return prefill_program(geom, KvFormat.FOLDED, page_size=page_size, block_N=block_N,
                           num_stages=max(num_stages, NUM_STAGES), threads=threads, key_block=row_block_macro,
                           softmax=softmax, rescale=rescale)


def build(geom: AttentionGeometry = GEMMA4_31B, *, page_size: int = 64, block_N: int = 64, num_stages: int = 1,
          threads: int = 256, arch: str | None = None):
    """Compile the two-stage folded-row prefill for `geom` (the library prefill's params; at least two stages)."""
    check_geometry(geom, KvFormat.FOLDED)
    tilelang = require_tilelang()
    num_stages = max(num_stages, NUM_STAGES)

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_folded_two_stages(page_size, block_N, num_stages, threads):
        return program(geom, page_size=page_size, block_N=block_N, num_stages=num_stages, threads=threads)

    return prefill_folded_two_stages(page_size, block_N, num_stages, threads)


def main():
    kernel = build(GEMMA4_31B, **DEFAULTS)
    print(f"prefill_folded two stages {dict(DEFAULTS, num_stages=NUM_STAGES)}: {len(kernel.get_kernel_source())}"
          " chars of CUDA")


if __name__ == "__main__":
    main()
