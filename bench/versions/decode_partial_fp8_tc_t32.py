"""The FP8 tensor-core partial with a 32-token tile and three stages a CTA at two CTAs an SM (run 19).

Outcome (bench/FP8_NOTES.md, "Run 19: outcome"): 1.04-1.08x the bf16 folded time (predicted 0.82-0.98x), two stages
the same as three, and its output FAILS the harness's check (LSE right, the value side wrong: P's parts at M = 32 or
V^T at 32 tokens). Kept as the measured negative: the fixed part of a tile is ~1 us, so no tile under 64 tokens.

Lab notebook (bench/FP8_NOTES.md, run 19). Question: run 14 left the served FP8 tensor-core partial
(`decode_partial_folded_fp8_tc`: 64-token tile, one stage, two CTAs an SM) at 0.64-0.67x the bf16 folded decode,
with two bounds named: the consumer's chain (transpose + two-part split + gemms: 1.57 us a 64-token tile in L2) and the
bytes in flight (one 40 KB stage a CTA: the next tile's load waits behind the chain; from DRAM the probe with no
transpose, chain 1.10, took 1.62 us a tile, the same as the full kernel). Does a 32-token tile, which lets three
stages fit at two CTAs an SM, take the load off the chain?

What it is: the library's program (`decode_partial_fp8_tc_program`, its `two_part_rounding`, its device code) with
block_n 32, num_stages 3 (or 2: `num_stages`), ctas_per_sm 2, through its hook points (decode_partial_fp8_mma.py's
`hooked_program`); the one new piece is the
transpose hook for a 32-token tile (`transpose_t32_macro`): a panel has 8 x 8 = 64 blocks of 4 tokens x 16 columns,
so the 128 consumer threads take two panels a call (thread t: panel 2c + t / 64, token block (t / 8) mod 8, column
block t mod 8), the library's `foldkv_e4m3_t4x16` doing each block (same loads, selects and barriers: the first of the
two calls waits before writing, the last fences and waits). A warp holds 4 token blocks x 8 column blocks of one panel:
its 16-byte loads are a quarter-warp a token row (128 bytes), and store n of column block j goes to V^T row
j * 16 + (n ^ j) at byte 4 i: rows mod 8 all differ across the warp's j, and V^T's 32-byte swizzle (16-byte chunk XOR
row bit 2, read from the emitted addresses) then puts the 32 stores on 32 banks.
Two changes the 32-row tile forces (found compiling): the score gemm S^T [32, 16] is not a wgmma (M < 64): TileLang
emits mma.sync m16n8k32 e4m3 over 2 x 2 warps, which puts S^T's columns 8-15 (the lo parts) in other warps than 0-7;
so `two_part_rounding_t32` copies S^T to shared memory ([32, 16] float32, 2 KB) and reads hi and lo from there (this
also frees the softmax state from the mma layout), and the softmax reduces 2 queries a batch (reduce_batch 2: a thread
holds 2 of the 8 columns in the layout TileLang then infers).

Shared memory a CTA (bytes; e4m3 = 1 byte), block_n = N tokens, S stages, as counted before building:
    stage (5 panels of N x 128 + N float32 scales)   S x (5 x 128 N + 4 N) = S x 644 N
    V^T [512, N] e4m3 (written by the consumer)      512 N
    q_s [16, 512] bf16                               16,384  (TileLang's merge pass aliases it with q8: prologue only)
    q8: 4 panels [16, 128] e4m3                      8,192
    P^T [16, N] e4m3                                 16 N
    q_part [16, 16] f32 + q_gain, q_inv [16] f32     1,152
    softmax's cross-warp reduction scratch           2 x 1 KB (TileLang's workspaces)
  served (N 64, S 1):   41,216 + 32,768 + 16,384 + 8,192 + 1,024 + 1,152 = 100,736 before aliasing
  N 64, S 2:            82,432 + 32,768 + 8,192 + 1,024 + 1,152 + 2,048  = 127,616 (over 113 KB: one CTA an SM)
  N 32, S 3:            61,824 + 16,384 + 8,192 + 512 + 1,152 + 2,048 + 2,048 (S^T in shared) = 92,160
  Emitted (the launch's dynamic shared memory, `check_emitted`): N 32, S 3: 91,648 bytes (89.5 KB; TileLang puts each
  panel's stages 4 KB apart and overlaps the prologue's buffers); S 2: 73,728; S 4: 122,880 (over: not built).
  Two CTAs an SM: 228 KB an SM, 1 KB of each CTA reserved, so <= 113 KB a CTA: S 3 fits (2 x 90.5 = 181 KB);
  bytes in flight an SM: 2 x 3 x 20.6 KB = 124 KB, against the served 2 x 41 = 82 KB. The emitted pipeline releases
  each panel's stage right after its own use (a full and an empty mbarrier per panel and stage): the V_rot panel after
  the transpose, the score panels after their mma.sync, so loads run up to 3 tiles ahead.

The chain (us, 2 CTAs an SM, L2; run 14: probe without transpose 1.10 a 64-token tile, + transpose 0.40, + two
parts 0.07 = 1.57): per tile it is f (fixed: the pipeline's barriers, the two cross-warp softmax reductions, the tile's
largest scale, P's store and its barrier, the value gemm's wait, the 512 x 16 float32 accumulation of O: all per tile
whatever N) plus g N (the score gemm's k32 steps per 64 rows, the transpose's blocks, the scores' and P's elements).
Read from the emitted code and runs 8-14: f ~ 0.7-0.9, g N ~ 0.7-0.9 at N = 64. At N = 32 a 64-token span costs
2 f + g 64 ~ 2.1-2.5 us; the score gemm also leaves wgmma (M = 32 < wgmma's 64 rows: TileLang's mma.sync k32 FP8
path, see `check_emitted`). So this version is chain-bound ABOVE the served one; three stages take the load off the
chain (DRAM time ~ max(chain, bytes 1.24)), but only a chain <= ~1.30 us a 64-token tile meets 0.55x (0.55 x 194 us at
163,336 over 77.3 tiles an SM, merges included). That needs the transpose off the chain (1.57 - 0.40 = 1.17) AND
loads ahead of it: the arithmetic of the two:
  - transpose in a producer warpgroup at N 64: V^T double-buffered (the consumer's value gemm of tile k overlaps the
    producer's transpose of k+1) with one raw stage: 41,216 + 2 x 32,768 + 16,384 + 8,192 + 1,024 + 1,152 = 132 KB:
    over; without q_s (the query read from global into the rounding) 116 KB: over by ~3 KB;
  - transpose in place into the stage after the score gemm (V^T [128, 64] of a panel is the panel's own 8 KB): two
    stages of 41 KB, no V^T buffer: 82,432 + 16,384 + 8,192 + 1,024 + 1,152 = 109 KB: fits, and half the
    transpose's work (its loads) moves under the score gemm (chain ~1.35-1.45); it needs the value gemm as four
    M = 128 gemms over views of the pipelined stage (T.view of a multi-versioned buffer: not supported by 0.1.15's
    pipeline rewrite as far as read here) and TileLang's WSSchedule (0.1.15 exposes `T.WSSchedule`,
    `annotate_ws_schedule`; no example installed) for the producer version. Neither is built: this file measures the
    one option that builds through the library's hook points, and so the fixed share f the two others rest on.

Prediction (written before any run; 2 CTAs an SM, planned for 264 CTAs a wave, pools in DRAM; bf16 folded run 14:
194 us at 163,336, 233 on uniform8, 1,027 on uniform32; served FP8 tc ~125 / 150 / 685):
  - 163,336 in L2 (32 resident pages): 2.1-2.5 us a 64-token span (served 1.57);
  - 163,336 from DRAM: 160-190 us (0.82-0.98x bf16 folded; served 0.65x); 81,653: 85-100 us;
  - uniform8: 190-225 us (0.82-0.97x); uniform32: 830-990 us (0.81-0.96x);
  - num_stages 2 (the arm `fp8_tc_t32s2`, 72 KB a CTA): within 5% of three stages in L2, 3-10% slower from DRAM;
  - its check against the float64 reference over the dequantized pool passes (error ~2-3e-3, the served kernel's:
    the same roundings, per 32-token tile P's gain taken from 32 scales, never larger than from 64);
  - if instead it comes in under the served kernel (f < ~0.45), the fixed share is smaller than read here, and a
    32-token tile with the transpose off the chain is the next build.
Outcome: to be written after the H200 run (bench/FP8_NOTES.md, run 19).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

import re

from foldkv.config import AttentionGeometry
from foldkv.kernels.decode_partial import FP8_PANEL
from foldkv.kernels.decode_partial_fp8_tc import (DEVICE_SOURCE, MAX_SCALE_FN, NAME, P_RANGE, TRANSPOSE_BARRIER_ID,
                                                  TRANSPOSE_FN, TWO_PART_LO, Rounding, two_part_rounding)
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from versions.decode_partial_fp8_mma import TcHooks, hooked_program  # bench/versions/: the program's hook points

SYMBOL = "decode_partial_folded_fp8_tc_t32"
PAIR_FN = "foldkv_e4m3_t4x16_pair"
# the library's device code and a wrapper that picks one of two panels' source rows (a panel is a separate shared
# buffer: TileLang cannot index the list of panels by a thread's variable, so both panels' addresses go in)
SOURCE = DEVICE_SOURCE + r"""
__device__ __forceinline__ void foldkv_e4m3_t4x16_pair(int first, int last, int barrier_id, int threads, int m,
    int keep, int second, const void* a0, const void* a1, const void* a2, const void* a3, const void* b0,
    const void* b1, const void* b2, const void* b3, void* d0, void* d1, void* d2, void* d3, void* d4, void* d5,
    void* d6, void* d7, void* d8, void* d9, void* d10, void* d11, void* d12, void* d13, void* d14, void* d15) {
  foldkv_e4m3_t4x16(first, last, barrier_id, threads, m, keep, second ? b0 : a0, second ? b1 : a1, second ? b2 : a2,
                    second ? b3 : a3, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15);
}
"""
PARAMS = dict(page_size=64, block_n=32, num_stages=3, block_h=16, reduce_batch=2, ctas_per_sm=2)
SMEM_LIMIT_2CTA = 113 * 1024  # a CTA's share of the SM's 228 KB at two CTAs (1 KB of each reserved)


def transpose_t32_macro(block_n: int, threads: int):
    """The value window's 4 panels ([32, 128] e4m3 each) into V^T [512, 32]: per call two panels, each thread one
    4-token x 16-column block (module docstring); tokens past the chunk written as 0 (`tokens_left()`)."""
    import tilelang.language as T

    tok_blocks, col_blocks = block_n // 4, FP8_PANEL // 16  # 8, 8
    assert block_n == 32 and 2 * tok_blocks * col_blocks == threads, "a 32-token tile, 128 consumer threads"

    @T.macro
    def transpose_pair(panels, c, v_t, first, last, tokens_left):
        # i2 < 8: panel 2c, token block i2; i2 >= 8: panel 2c + 1, token block i2 - 8
        for i2, j in T.Parallel(2 * tok_blocks, col_blocks):
            i = i2 % tok_blocks
            T.call_extern("handle", PAIR_FN, int(first), int(last), TRANSPOSE_BARRIER_ID, threads, j % 8,
                          tokens_left() - i * 4, i2 // tok_blocks,
                          *[T.address_of(panels[2 * c][i * 4 + r, j * 16]) for r in range(4)],
                          *[T.address_of(panels[2 * c + 1][i * 4 + r, j * 16]) for r in range(4)],
                          *[T.address_of(v_t[(2 * c + i2 // tok_blocks) * FP8_PANEL + j * 16
                                             + T.bitwise_xor(m, j % 8), i * 4]) for m in range(16)])

    @T.macro
    def transpose_values(panels, v_t, tokens_left):
        pairs = len(panels) // 2
        for c in list(range(pairs)):  # (range itself would be a device loop)
            transpose_pair(panels, c, v_t, c == 0, c == pairs - 1, tokens_left)

    return transpose_values


def two_part_rounding_t32(geom: AttentionGeometry, block_n: int, block_h: int) -> Rounding:
    """The library's `two_part_rounding` with its `scores` hook taking S^T's lo columns through shared memory: at
    32 rows the score gemm is not a wgmma (M < 64) and TileLang's mma.sync partition puts columns 8-15 of S^T in other
    warps than 0-7 (2 x 2 warps), where the library's copy assumes one thread holds both. [32, 8] float32 a CTA
    (1 KB), one more barrier a tile (TileLang's)."""
    import tilelang.language as T

    served = two_part_rounding(geom, block_n, block_h)
    group, unlo, f32 = geom.group_size, 1.0 / TWO_PART_LO, "float32"

    @T.macro
    def scores(acc_s, s_lo, out, scale_s, q_inv, tile_gain, tile_inv, valid):
        s_sh = T.alloc_shared((block_n, block_h), f32)
        T.copy(acc_s, s_sh)
        for i, j in T.Parallel(block_n, group):  # a token's row is its e4m3 values times its scale
            out[i, j] = (s_sh[i, j] + s_sh[i, j + group] * unlo) * scale_s[i] * q_inv[j]
        tile_inv[0] = T.call_extern(f32, MAX_SCALE_FN, T.address_of(scale_s[0]), valid) * (1.0 / P_RANGE)
        tile_gain[0] = 1.0 / tile_inv[0]

    return Rounding(cols=served.cols, query=served.query, scores=scores, p_store=served.p_store,
                    accumulate=served.accumulate)


def score_gemm_t32(block_n: int, block_h: int):
    """The score window's four panels into one accumulator, all warps along S^T's rows (FullRow)."""
    import tilelang.language as T

    @T.macro
    def score_gemm(stored, q8, acc_s, acc_p):
        for pair in list(zip(stored, q8)):
            T.gemm(pair[0], pair[1], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

    return score_gemm


HOOKS = TcHooks(source=SOURCE, transpose=transpose_t32_macro, rounding=two_part_rounding_t32,
                score_gemm=score_gemm_t32, symbol=SYMBOL)


def program(geom: AttentionGeometry, **params):
    """The prim_func: the library's tensor-core program with this version's tiling and transpose."""
    return hooked_program(geom, **{**PARAMS, **params}, hooks=HOOKS)


def smem_bytes(host_src: str, threads: int = 256) -> int:
    """The dynamic shared memory a CTA from the host source's launch: the constant after the block's (threads, 1, 1)."""
    nums = [int(x) for x in re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", host_src)]
    for i in range(len(nums) - 3):
        if nums[i:i + 3] == [threads, 1, 1]:
            return nums[i + 3]
    raise AssertionError("no launch with a block of (256, 1, 1) in the host source")


def check_emitted(src: str, host_src: str, num_stages: int = PARAMS["num_stages"]) -> dict:
    """What the design says, read from the emitted CUDA: the dynamic shared memory a CTA (<= SMEM_LIMIT_2CTA, from
    the launch), the pipeline's stage count (12 mbarriers a stage: full and empty for each of 6 TMA loads), two transpose calls a thread a tile,
    the launch bounds for two CTAs an SM, the score gemm on mma.sync k32 e4m3 and the value gemm on wgmma over V^T's
    32-byte swizzle (descriptor mode 3). Returns the facts; raises on a miss."""
    facts = dict(smem_bytes=smem_bytes(host_src),
                 # one full and one empty mbarrier per stage for each of the 6 TMA loads (5 panels, the scales)
                 stages=[int(n) // 12 for n in re.findall(r"uint64_t mbarrier_mem\[(\d+)\]", src)],
                 transpose_calls=len(re.findall(rf"\b{PAIR_FN}\((?!int first)", src)) - 0,
                 launch_bounds=re.findall(r"__launch_bounds__\(([^)]*)\)", src),
                 score_mma_sync_e4m3=len(re.findall(r"mma_sync<tl::DataType::kFloat8_e4m3", src)),
                 value_wgmma_32b=bool(re.search(r"initialize_wgmma_descriptor<3, 1, 16>\(desc_a, \(&\(\(\(fp8_e4_t\*\)v_t",
                                                src)))
    facts["transpose_calls"] = len(re.findall(rf"\b{PAIR_FN}\(\d", src))
    want = dict(stages=[num_stages], transpose_calls=2, launch_bounds=["256, 2"], value_wgmma_32b=True)
    bad = {k: (facts[k], w) for k, w in want.items() if facts[k] != w}
    if facts["smem_bytes"] > SMEM_LIMIT_2CTA:
        bad["smem_bytes"] = (facts["smem_bytes"], f"<= {SMEM_LIMIT_2CTA}")
    if bad:
        raise AssertionError(f"{SYMBOL}: emitted CUDA off the design (got, want): {bad}")
    return facts


def build(geom: AttentionGeometry, **params):
    """Compile (JIT) the version; a drop-in for `kernels={"decode_partial_folded_fp8_tc": ...}` (or the exact
    partial's name with fp8_math="exact": the same argument list). Its emitted CUDA is checked for the library's
    transpose barriers (`check_e4m3_conversion`) and this design's facts (`check_emitted`)."""
    tilelang = require_tilelang()

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def decode_partial_fp8_tc_t32(page_size, block_n, num_stages, block_h, reduce_batch, ctas_per_sm):
        return program(geom, page_size=page_size, block_n=block_n, num_stages=num_stages, block_h=block_h,
                       reduce_batch=reduce_batch, ctas_per_sm=ctas_per_sm)

    cfg = {**PARAMS, **params}
    kernel = decode_partial_fp8_tc_t32(**cfg)
    from foldkv.kernels.cuda_checks import check_e4m3_conversion

    check_e4m3_conversion(SYMBOL, kernel.get_kernel_source(), TRANSPOSE_BARRIER_ID, calls=(PAIR_FN,))
    check_emitted(kernel.get_kernel_source(), kernel.get_host_source(), cfg["num_stages"])
    return kernel


assert TRANSPOSE_FN in SOURCE and NAME  # the library's block transpose is what each call runs
