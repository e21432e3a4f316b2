"""FP8 folded decode partial, both gemms with A from registers (wgmma RS): each consumer thread reads its e4m3 bytes
from the TMA'd panels (16- and 8-byte shared loads), converts them exactly to bf16 in registers and hands them to
S^T = K Q^T and O^T = V^T P^T as their A operands. No bf16 tile is written to shared memory: no conversion pass, no
named barrier 7, no proxy fence; the tensor cores read only the B operands (permuted query, P) from shared memory.
Same argument list and outputs as the library's decode_partial_folded_fp8 (a drop-in for the launcher's
`kernels={"decode_partial_folded_fp8": build(GEMMA4_31B)}` with `fp8_math="exact"`).

What it tries (bench/FP8_NOTES.md runs 2-3: the library partial is consumer-bound, ~3.3 us per 64-token tile against
~1.2 us for its bytes; run 2 -> 3 (one -> two consumer warpgroups, 4.4 -> 3.3 us) puts its conversion at ~2.2 us of
one warpgroup's time and the rest of the consumer's tile (SS gemms, softmax, barriers) at ~1.1 us).
  - Score gemm: A = the K window (row[0:512] = panels 0-3), one [64, 128] bf16 fragment per panel, four gemms into
    S^T. TileLang's wgmma A layout (cuda/intrinsics/macro/wgmma_macro_generator.py make_mma_load_layout) gives a
    thread rows {r, r+8} and, per 16-column k-step, columns {2q, 2q+1, 2q+8, 2q+9}: 2-byte pieces. The reduction
    index can be permuted if the query is permuted the same way, so fragment column 8cb + 2q + p holds panel column
    32q + 2cb + p (`score_column`): a thread's 32 bytes of a row are contiguous, two 16-byte loads. The permuted
    query (q_perm_0..3, 16 KB) is built at the first tile from the TMA'd query. M = 64 on 8 warps can only be split
    (4, 2) (src/cuda/op/gemm.cc ComputeWgmmaWarpPartition): the warpgroups split S^T's 16 query columns and the A
    fragment is replicated, so BOTH warpgroups convert the whole K window (half of that work feeds the 8 padding
    query columns).
  - Value gemm: A = V^T (value window = panels 1-4) as one [64 tokens, 512] fragment (transpose_A, FullRow (8, 1):
    each warpgroup 256 output rows, no duplicate). A thread holds, per token, rows {128m + 16w + 8h + r} and tokens
    {16ki + 8g + 2q + p}; one register pairs tokens (n, n+1) of one column. The output rows are permuted
    (`value_column`) so that a thread's 8 rows are 8 contiguous bytes of a token row: one 8-byte load per token, the
    pairs built by prmt across the two tokens' words; the epilogue writes row i to value-window column
    value_column(i) (part_o in value-window order, as the library's).
  - Conversion: the library's exact one (macros.E4M3_TO_BF16_SOURCE: the code as bf16 bits is the value times 2^-120,
    mul.bf16x2 by 2^120 restores it), per pair as prmt with sign replication, shift, and, mul (3 integer ops + 1
    bf16x2 multiply). All 256 codes give finite bf16, so the tail tokens' arbitrary bytes need no clearing (P = 0).
  - The panels carry TileLang's 128-byte swizzle (annotated; the pool's TMA descriptor gets CU_TENSOR_MAP_SWIZZLE_128B)
    so that every warp's 16- and 8-byte loads are conflict-free (4 and 2 wavefronts: the minimum).
  - overlap=True (default): the score gemms are async (T.wgmma_gemm, two A fragments in turn, T.wait_wgmma(1)), the
    next panel and then the value fragment are converted while they run; overlap=False: four synchronous T.gemm.
  How it is written, and why (TileLang 0.1.15): a T.Parallel fill, `a[i, j] = T.cast(stored[i, j], "bfloat16")`,
  does lower to wgmma RS, but with 2-byte shared loads (score) or 1-byte loads (value) and TileLang's conversion
  (__tl_cvt_e4m3x2_to_bfloat162: cvt.rn.f16x2.e4m3x2 + two cvt.rn.bf16.f16 per pair, the conversion unit run 1
  measured); the same fill with integer ops and T.reinterpret loses even that (1-byte loads, scalar ops). So each
  thread's loads and conversions are one T.call_extern (RS_SOURCE), made from a T.Parallel over the fragment by the
  one element per thread that passes a condition, so that TileLang's own layout gives the thread its row, column and
  register. Two TileLang rules shape the call: every access to a fragment inside a T.Parallel must have the same
  indices (src/op/parallel.cc ParallelOpNode::RecordBufferAccess), so the call gets one register's address and
  reaches the thread's others at fixed offsets (`check_fragment_layouts` holds every word against
  make_mma_load_layout, CPU); and a T.Parallel that only reads a replicated fragment runs on one replica
  (BuildReplicationGuardsIfNeeded), so the call returns that register's bits and the loop stores them. A T.Parallel
  that reads the TMA'd query before the pipelined loop turns the query TMA into a copy by all threads (the version
  that lost ~1 us, bench/versions/decode_partial_query_all_threads.py), hence the permutation at k == 0.

Compile (CPU, sm_90a, `python bench/versions/decode_partial_fp8_rs.py`): 5 tl::wgmma_rs, 0 wgmma_ss (PTX: the
m64n8k16 and m64n16k16 wgmma take A as registers); ptxas 168 registers (the cap of 384 threads; the consumers get 240
by setmaxnreg), 0 spills, 4 named barriers (library: 168, 0 spills, 8); PTX shared accesses: 16 ld.shared.v4.u32
(score, 4 per panel) and 64 ld.shared.v2.u32 (value, 16 per thread on its panel's branch), no byte or 2-byte loads,
no shared stores but the permuted query's; shared memory ~120 KB (library ~185 KB).

Prediction (per 64-token tile per SM; ~1.85 GHz; written before any run):
  conversion: K window 32,768 pairs x 2 warpgroups + V window 16,384 pairs = 49,152 pairs per tile (library: 20,480
    pairs, ~4 integer ops each, plus 80 KB of stores and two barriers). At 2-3 integer ops per pair on the 64/clock
    integer pipe (ptxas may move the shift to IMAD) and 4 issued instructions per pair at 128/clock: 1,540-2,300
    clocks = 0.85-1.25 us.
  the rest of the tile: the library's ~1.1 us minus its SS gemms' shared-memory reads (128 KB of bf16 K read by the
    two warpgroups + 64 KB of V: ~1,500 clocks at 128 B/clock, now ~20 KB of B operands) and the conversion barriers
    = ~0.5-0.8 us (softmax with its two cross-warpgroup reductions, scale, mask, rescale, value gemm); the score gemms'
    latency hidden behind the next conversion (overlap).
  so ~1.4-2.1 us per tile, central 1.8 us: FP8 at ~0.6-0.85x the bf16 folded time (library 1.28-1.32x), 2x faster
  than the library partial, still above the ~1.2 us byte floor (the conversion stays on the consumer's path, cheaper
  and without its barriers). If instead the conversion costs what the library's does per pair (incl. its stores),
  49,152 pairs take ~2.6 us and nothing is gained: the measurement decides. Next, if it wins: take out the duplicated
  K conversion (a 128-token tile, M = 128 split (8, 1) for both gemms: 32,768 pairs per 64 tokens, -33%), and more
  stages (120 KB of shared memory leaves room for 3).
Correctness: checked on the CPU only (the pair formula for every code against the library's; every A register word
against TileLang's layouts); no GPU run yet (the float64 gates through the launcher's kernels= decide).

Outcome (2026-12-01, H200, commit 1654a4a clean, `cd bench && python
fp8_harness.py --no-flashinfer --rounds 5 --single 163336 10602 --arms folded_jit folded_fp8_jit fp8_rs
read_folded_fp8`; raw: bench/fp8_runs/fp8_run5.json / .log): WRONG and not faster. Its output fails the arm check
(relative error 1.2 against the float64 reference over the dequantized pool, every case), so some register mapping
the CPU checks accepted is not what the hardware does; and its time is the library FP8 partial's (163,336: 250.9
against 254.9 us; ragged 32-128: 0.97-0.98x; 10,602: 32.5 against 29.7), 1.28-1.30x the bf16 folded time, where
0.6-0.85x was predicted. So even before it is made correct, removing the shared-memory tiles bought ~2%: tripling the
converted pairs (49,152 per tile) costs what the library's stores and barriers cost. Kept as the record of the
attempt; the next try must cut the converted pairs (a 128-token tile: no duplicated K window; or FP8 MMA for the
scores), not the shared-memory traffic alone.

Suspected cause (CPU reading, not verified on a GPU): the part_o store, not the loads. TileLang 0.1.15 labels the
wgmma accumulator warpgroup-major (wgmma_macro_generator.py make_mma_store_layout: acc_o row i = 256g + 64m + 16w + 8h
+ r, warpgroup g, instruction m) but lays out an RS A fragment warp-major (make_mma_load_layout: instruction m of
warpgroup g reads vt columns 128m + 64g + 16w + 8h + r); wgmma_rs_atom pairs A block m with C block m, so with M
split over two warpgroups (FullRow (8, 1)) the hardware writes A column 128m + 64g + ... into the register TileLang
calls row 256g + 64m + ..., and value_column(i) stored 6 of the 8 (g, m) blocks of 64 rows to the wrong value-window
columns (expected relative error sqrt(2 x 6/8) = 1.22, as measured). check_fragment_layouts held only the A side.
Fixed here: the epilogue stores row i to output_column(i) = value_column(128 ((i % 256) // 64) + 64 (i // 256) +
i % 64); check_output_rows (PTX register fragments + TileLang's A/C layouts and register offsets) passes on it and
refuses the old mapping (6,144 of 8,192 accumulator registers). Checked and consistent: the pool descriptor's
swizzle (3 = CU_TENSOR_MAP_SWIZZLE_128B, panels 1024-aligned) and the thread XOR; a0..a3 order; q_perm (values,
swizzle, barrier, fence); the score gemm's rows (one warpgroup along M); both warpgroups fill the replicated a_s.
Any TileLang RS gemm with M split over two warpgroups likely has the same mismatch (not tried).

    python bench/versions/decode_partial_fp8_rs.py     # CPU checks, then both builds: wgmma calls, ptxas, PTX loads
"""

import functools
import os
import re
import subprocess
import tempfile

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros, producer_guard, registry
from foldkv.kernels.decode_partial import FP8_PANEL, Run
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat, row_width

# the library partial's registered params (the thread mapping below is written for these: 64-token tiles, two consumer
# warpgroups, 16 query columns)
DEFAULTS = dict(registry.get("decode_partial_folded_fp8").params)

RS_FN_SCORE = "foldkv_rs_score_panel"
RS_FN_VALUE = "foldkv_rs_value"
RS_SOURCE = r"""
// e4m3 -> bf16 into wgmma RS A registers. A pair of codes becomes one bf16x2 word exactly as
// foldkv_e4m3x8_to_bf16_one does it (byte s.eeee.mmm as bf16 bits s.0000eeee.mmm0000, times 2^120): prmt with sign
// replication puts each code in a 16-bit half as a sign-extended byte, then (t << 4) & 0x87F087F0 keeps the sign at
// bit 15 and the 7 magnitude bits at 10..4.
__device__ __forceinline__ unsigned int foldkv_rs_pair(unsigned int lo_word, unsigned int hi_word, unsigned int sel) {
  unsigned int t;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(lo_word), "r"(hi_word), "r"(sel));
  const unsigned int bits = (t << 4) & 0x87F087F0u;
  unsigned int out;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(bits), "r"(0x7B807B80u));
  return out;
}
// selector: result half 0 = byte e0 (sign-extended), half 1 = byte e1 (bytes 0-3 of lo_word, 4-7 of hi_word)
#define FOLDKV_RS_SEL(e0, e1) ((unsigned int)((e0) | ((8 | (e0)) << 4) | ((e1) << 8) | ((8 | (e1)) << 12)))

// S^T = K Q^T: one thread's share of one 64 x 128 panel. src: 4 x 16 bytes, (h, s) = rows {r, r + 8} x column halves
// {32q, 32q + 16}; dst: the thread's A registers (TileLang's local index 4cb + 2h + p for row r + 8h, fragment
// column 8cb + 2q + p): word 2cb + h = codes (2cb, 2cb + 1) of the thread's 32 contiguous bytes of row h.
// Returns the bf16 bits of the first element (the one the T.Parallel's assignment stores): TileLang then sees the
// fragment written (a loop that only reads a replicated fragment runs on one replica only).
__device__ __forceinline__ unsigned short foldkv_rs_score_panel(const void* s0, const void* s1, const void* s2,
                                                                const void* s3, void* dst) {
  const void* src[4] = {s0, s1, s2, s3};
  unsigned int* out = reinterpret_cast<unsigned int*>(dst);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint4 in = *reinterpret_cast<const uint4*>(src[2 * h + s]);
      const unsigned int w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
      for (int m = 0; m < 8; ++m) {  // cb = 8s + m
        const unsigned int sel = (m & 1) ? FOLDKV_RS_SEL(2, 3) : FOLDKV_RS_SEL(0, 1);
        out[2 * (8 * s + m) + h] = foldkv_rs_pair(w[m >> 1], w[m >> 1], sel);
      }
    }
  }
  return (unsigned short)(out[0] & 0xFFFFu);
}

// O^T = V^T P^T: one thread's 16 tokens x 8 rows of the value A fragment. src: 16 x 8 bytes, (ki, g, p) = token
// 16ki + 8g + 2q + p; dst: the thread's A registers (TileLang's local index 32ki + 8m + 4g + 2h + p for token
// 16ki + 8g + 2q + p, fragment column 128m + 16w + 8h + r): word 16ki + 4m + 2g + h = (token p = 0, token p = 1) at
// byte e = 2m + h of the two tokens' 8 contiguous bytes.
template <typename... P>
__device__ __forceinline__ unsigned short foldkv_rs_value(void* dst, P... p) {
  static_assert(sizeof...(P) == 16, "16 token rows");
  const void* src[16] = {((const void*)p)...};
  unsigned int* out = reinterpret_cast<unsigned int*>(dst);
#pragma unroll
  for (int kg = 0; kg < 8; ++kg) {  // kg = 2ki + g
    const uint2 t0 = *reinterpret_cast<const uint2*>(src[2 * kg]);
    const uint2 t1 = *reinterpret_cast<const uint2*>(src[2 * kg + 1]);
    const unsigned int w0[2] = {t0.x, t0.y}, w1[2] = {t1.x, t1.y};
#pragma unroll
    for (int e = 0; e < 8; ++e) {  // e = 2m + h
      out[16 * (kg >> 1) + 4 * (e >> 1) + 2 * (kg & 1) + (e & 1)] =
          foldkv_rs_pair(w0[e >> 2], w1[e >> 2], FOLDKV_RS_SEL(e & 3, 4 + (e & 3)));
    }
  }
  return (unsigned short)(out[0] & 0xFFFFu);
}
"""


def score_column(j):
    """Panel column held by column j of a score A fragment [64, 128]: j = 8cb + 2q + p -> 32q + 2cb + p."""
    return 32 * ((j % 8) // 2) + 2 * (j // 8) + j % 2


def value_column(i):
    """Value-window column of row i of O^T (and of column i of the value A fragment [64, 512]):
    i = 128m + 16w + 8h + r -> 64w + 8r + 2m + h (a thread's 8 rows = 8 contiguous bytes of a token row)."""
    return 64 * ((i % 128) // 16) + 8 * (i % 8) + 2 * (i // 128) + (i % 16) // 8


def output_column(i):
    """Value-window column of row i of acc_o (O^T) as TileLang labels it. TileLang's wgmma accumulator layout
    (make_mma_store_layout) is warpgroup-major, i = 256g + 64m + 16w + 8h + r (warpgroup g, instruction m, warp w of
    the group), while its RS A layout (make_mma_load_layout) is warp-major: instruction m of warpgroup g reads the A
    columns 128m + 64g + 16w + 8h + r, and the hardware writes their rows into the C registers labelled i. So row i
    holds A column 128 ((i % 256) // 64) + 64 (i // 256) + i % 64, whose value-window column is value_column of that
    (`check_output_rows`); value_column(i) itself is right for 2 of the 8 (g, m) blocks only."""
    return value_column(128 * ((i % 256) // 64) + 64 * (i // 256) + i % 64)


def check_pair_formula():
    """CPU: the pair conversion of RS_SOURCE (prmt with sign replication, shift, and) gives the library's bf16 bits
    (macros.E4M3_TO_BF16_SOURCE: (x & 0x80008000) | ((x >> 4) & 0x07F007F0), bytes in the halves' high bytes) for
    every pair of codes; and the two permutations are bijections."""
    def prmt(a, b, sel):
        src = [(a >> 8 * n) & 255 for n in range(4)] + [(b >> 8 * n) & 255 for n in range(4)]
        out = 0
        for n in range(4):
            s = (sel >> 4 * n) & 15
            v = src[s & 7]
            out |= ((0xFF if v & 0x80 else 0) if s & 8 else v) << 8 * n
        return out

    def sel(e0, e1):
        return e0 | (8 | e0) << 4 | e1 << 8 | (8 | e1) << 12

    for b0 in range(256):
        for b1 in range(256):
            x = b1 << 24 | b0 << 8
            want = (x & 0x80008000) | ((x >> 4) & 0x07F007F0)
            for got in (prmt(b0 | b1 << 8, b0 | b1 << 8, sel(0, 1)), prmt(b0 << 24, b1 << 24, sel(3, 7))):
                assert ((got << 4) & 0x87F087F0) == want, (b0, b1)
    assert sorted(map(score_column, range(128))) == list(range(128))
    assert sorted(map(value_column, range(512))) == list(range(512))


def check_fragment_layouts(block_n=64, d=512, block_h=16, threads=256):
    """CPU: every register word RS_SOURCE writes holds the element TileLang's wgmma RS lowering expects there.

    The A layouts are TileLang's own (cuda/intrinsics/macro/wgmma_macro_generator.py make_mma_load_layout, built as
    cuda/op/gemm/gemm_wgmma.py infer_layout builds them, with the warp partition src/cuda/op/gemm.cc
    ComputeWgmmaWarpPartition gives: FullCol (4, 2) for the score gemm, FullRow (8, 1) for the value gemm). For each
    thread: exactly one element passes the T.Parallel's condition and it is local element 0 (the address the call
    writes from); each word (two local elements) is the pair of codes the call converts into it."""
    require_tilelang()
    from tilelang.cuda.intrinsics.macro.wgmma_macro_generator import TensorCoreIntrinEmitter
    from tvm import tirx

    def owners(m_warp, n_warp, m, n, k, transposed, shape):
        emitter = TensorCoreIntrinEmitter(a_dtype="bfloat16", b_dtype="bfloat16", accum_dtype="float32",
                                          a_transposed=transposed, b_transposed=not transposed,
                                          block_row_warps=m_warp, block_col_warps=n_warp, warp_row_tiles=m // m_warp,
                                          warp_col_tiles=n // n_warp, chunk=k)
        frag = emitter.make_mma_load_layout(tirx.decl_buffer(shape, "bfloat16", scope="local.fragment"), "A")
        exprs = [str(frag.thread), *map(str, frag.index)]
        assert all(re.fullmatch(r"[\w\s*+/%()]+", e) for e in exprs) and len(exprs) == 2, exprs
        names = [str(v) for v in frag.get_forward_vars()]
        thread, index = (compile(e, "<layout>", "eval") for e in exprs)
        own = {}
        for rep in range(n_warp):  # A is replicated over the warps that split N
            for i in range(shape[0]):
                for j in range(shape[1]):
                    env = dict(zip(names, (rep, i, j) if len(names) == 3 else (i, j)))
                    own.setdefault(eval(thread, {}, env), {})[eval(index, {}, env)] = (i, j)
        assert sorted(own) == list(range(threads)), "every consumer thread holds A elements"
        return own

    # score: a [block_n, 128], S^T = a q_perm^T
    for t, mine in owners(4, 2, block_n, block_h, FP8_PANEL, False, (block_n, FP8_PANEL)).items():
        picked = [l for l, (i, j) in mine.items() if i % 16 < 8 and j < 8 and j % 2 == 0]
        assert picked == [0] and len(mine) == 64, (t, picked)
        i0, j0 = mine[0]
        for h in range(2):
            for s in range(2):
                for m in range(8):
                    for p in range(2):
                        i, j = mine[2 * (2 * (8 * s + m) + h) + p]
                        assert i == i0 + 8 * h and score_column(j) == 16 * j0 + 16 * s + 2 * m + p, (t, h, s, m, p)
    # value: vt [block_n tokens, d], O^T = vt^T p_shared
    for t, mine in owners(8, 1, d, block_h, block_n, True, (block_n, d)).items():
        picked = [l for l, (i, j) in mine.items() if i < 8 and i % 2 == 0 and j < 128 and j % 16 < 8]
        assert picked == [0] and len(mine) == 128, (t, picked)
        i0, j0 = mine[0]
        col0 = FP8_PANEL * (j0 // 32) + 64 * ((j0 // 16) % 2) + 8 * (j0 % 16)  # value-window column of byte 0
        for ki in range(block_n // 16):
            for g in range(2):
                for p in range(2):
                    for e in range(8):
                        i, j = mine[2 * (16 * ki + 4 * (e >> 1) + 2 * g + (e & 1)) + p]
                        assert i == i0 + 16 * ki + 8 * g + p and value_column(j) == col0 + e, (t, ki, g, p, e)


def _wgmma_emitter(m_warp, n_warp, m, n, k, transposed):
    """TileLang's wgmma emitter as cuda/op/gemm/gemm_wgmma.py infer_layout builds it (A transposed iff `transposed`,
    B the other way: S^T = a q^T, O^T = vt^T p)."""
    from tilelang.cuda.intrinsics.macro.wgmma_macro_generator import TensorCoreIntrinEmitter

    return TensorCoreIntrinEmitter(a_dtype="bfloat16", b_dtype="bfloat16", accum_dtype="float32",
                                   a_transposed=transposed, b_transposed=not transposed, block_row_warps=m_warp,
                                   block_col_warps=n_warp, warp_row_tiles=m // m_warp, warp_col_tiles=n // n_warp,
                                   chunk=k)


def _fragment_owners(frag, shape, n_rep, threads=256):
    """{thread: {local index: (i, j)}} of a TileLang Fragment over `shape` (replicated `n_rep` times)."""
    exprs = [str(frag.thread), *map(str, frag.index)]
    assert all(re.fullmatch(r"[\w\s*+/%()]+", e) for e in exprs) and len(exprs) == 2, exprs
    names = [str(v) for v in frag.get_forward_vars()]
    thread, index = (compile(e, "<layout>", "eval") for e in exprs)
    own = {}
    for rep in range(n_rep):
        for i in range(shape[0]):
            for j in range(shape[1]):
                env = dict(zip(names, (rep, i, j) if len(names) == 3 else (i, j)))
                own.setdefault(eval(thread, {}, env), {})[eval(index, {}, env)] = (i, j)
    assert sorted(own) == list(range(threads))
    return own


def check_output_rows(store_column=None, block_n=64, d=512, block_h=16, threads=256):
    """CPU: which output row the hardware puts in each accumulator register, against the row TileLang's accumulator
    layout says is there (the one the epilogue, scale and mask use). The model of the hardware is the PTX ISA's
    register fragments of wgmma m64nNk16 (bf16 A in registers, f32 D): in each warpgroup, warp w's A words
    a0..a3 hold rows 16w + lane/4 + 8 (a & 1), k 2 (lane % 4) + 8 (a >> 1) (+1); D register d holds row
    16w + lane/4 + 8 ((d >> 1) & 1), column 8 (d >> 2) + 2 (lane % 4) + (d & 1); and TileLang's register offsets
    (wgmma_rs_atom: A_offset = ki warp_rows local_size_a + m local_size_a, C_offset = m warp_cols local_size_out).
    Score gemm: the row label of each acc_s register is the token of the A row the hardware used. Value gemm: the
    epilogue's column `store_column(i)` (default: output_column) of each acc_o row label is the value-window column
    of the A column (vt) the hardware used, value_column(j) (check_fragment_layouts: what fill_value puts there)."""
    require_tilelang()
    from tvm import tirx

    store_column = output_column if store_column is None else store_column
    gemms = (  # (m_warp, n_warp, M, K, A transposed, A shape, C shape, what the C row label must be)
        (4, 2, block_n, FP8_PANEL, False, (block_n, FP8_PANEL), (block_n, block_h), lambda i, a_row: i == a_row),
        (8, 1, d, block_n, True, (block_n, d), (d, block_h),
         lambda i, a_col: store_column(i) == value_column(a_col)),
    )
    for m_warp, n_warp, m, k, transposed, a_shape, c_shape, row_ok in gemms:
        em = _wgmma_emitter(m_warp, n_warp, m, block_h, k, transposed)
        a_own = _fragment_owners(em.make_mma_load_layout(
            tirx.decl_buffer(a_shape, "bfloat16", scope="local.fragment"), "A"), a_shape, n_warp, threads)
        c_own = _fragment_owners(em.make_mma_store_layout(
            tirx.decl_buffer(c_shape, "float32", scope="local.fragment")), c_shape, 1, threads)
        bad = 0
        for t in range(threads):
            lane, warp = t % 32, t // 32
            warp_n = warp // m_warp  # TileLang: warp_id = warp_m + block_row_warps * warp_n
            for inst in range(em.wgmma_num_inst_m):
                a_rows = {}  # hardware row position within the instruction -> the A element's M index (label)
                for ki in range(em.wgmma_num_k_atoms):
                    for word in range(4):
                        for p in range(2):
                            local = ki * em.warp_rows * em.local_size_a + inst * em.local_size_a + 2 * word + p
                            i, j = a_own[t][local]
                            mn, kk = (j, i) if transposed else (i, j)
                            assert kk == 16 * ki + 2 * (lane % 4) + 8 * (word >> 1) + p, (t, inst, ki, word, p)
                            a_rows.setdefault(word & 1, set()).add(mn)
                assert all(len(v) == 1 for v in a_rows.values()), (t, inst, a_rows)
                for dreg in range(em.local_size_out):
                    i, j = c_own[t][inst * em.warp_cols * em.local_size_out + dreg]
                    assert j == warp_n * em.wgmma_inst_n + 8 * (dreg >> 2) + 2 * (lane % 4) + (dreg & 1), (t, dreg)
                    bad += not row_ok(i, next(iter(a_rows[(dreg >> 1) & 1])))
        assert bad == 0, f"{bad} accumulator registers of the {'value' if transposed else 'score'} gemm stored wrong"


def program(geom: AttentionGeometry, *, page_size=64, block_n=64, num_stages=2, threads=256, block_h=16,
            overlap: bool = True, reduce_batch: int = 1):
    """The library's FP8 folded partial (decode_partial_program(..., fp8=True)) with both gemms' A from registers."""
    require_tilelang()
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout
    from tvm.script.ir_builder import IRBuilder

    fmt = KvFormat.FOLDED
    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    rot = geom.rotary_width
    width = row_width(geom, fmt)
    # the thread mapping of RS_SOURCE: M = 64 tokens, two consumer warpgroups, 4 score panels + 4 value panels
    assert (block_n, threads, block_h, d, rot, FP8_PANEL) == (64, 256, 16, 512, 128, 128), "written for the 31B tiling"
    assert page_size % block_n == 0 and block_h >= group
    n_panels = (d + rot) // FP8_PANEL  # 5
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32, e4m3 = "bfloat16", "float32", "int32", "float8_e4m3"
    scale = macros.LOG2E
    load_query = macros.load_group_query_macro(group, block_h)
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    # Python-level loops (a `range` in the kernel body is a TIR loop)
    four, all_panels, k_steps = tuple(range(4)), tuple(range(n_panels)), tuple(range(block_n // 16))

    @T.macro
    def fill_score(panel, a):
        """a [64, 128] (score A fragment) <- panel [64, 128] e4m3, column j holding panel column score_column(j)."""
        for i, j in T.Parallel(block_n, FP8_PANEL):
            # one element per thread: its first row (r) and first column (2q) of the fragment
            if i % 16 < 8:
                if j < 8:
                    if j % 2 == 0:
                        # (every access of a fragment in a T.Parallel has the same indices: the other registers
                        # are reached from this one's address; the store makes every replica run the loop)
                        a[i, j] = T.reinterpret(T.call_extern(
                            "uint16", RS_FN_SCORE,
                            *[T.address_of(panel[i + 8 * h, 16 * j + 16 * s]) for h in range(2) for s in range(2)],
                            T.address_of(a[i, j])), "bfloat16")

    @T.macro
    def fill_value(panels, vt):
        """vt [64 tokens, 512] (value A fragment, transposed) <- the value window's panels, column i of vt holding
        value-window column value_column(i)."""
        for i, j in T.Parallel(block_n, d):
            # one element per thread: its first token (2q) and first row (16w + r); w // 2 picks the panel
            if i < 8:
                if i % 2 == 0:
                    if j < 128:
                        if j % 16 < 8:
                            for pnl in four:
                                if j // 32 == pnl:
                                    vt[i, j] = T.reinterpret(T.call_extern(
                                        "uint16", RS_FN_VALUE, T.address_of(vt[i, j]),
                                        *[T.address_of(panels[pnl][i + 16 * ki + 8 * g + p,
                                                                   64 * ((j // 16) % 2) + 8 * (j % 16)])
                                          for ki in k_steps for g in range(2) for p in range(2)]), "bfloat16")

    @T.prim_func
    def decode_partial(
        query: T.Tensor((batch, hq, d), bf16),  # [B, Hq, D] query in the folded form
        pool: T.Tensor((num_pages, hkv, page_size, width), e4m3),  # [P, Hkv, page, W] e4m3
        scales: T.Tensor((num_pages, hkv, page_size), f32),  # [P, Hkv, page] one scale per token x KV head
        page_ids: T.Tensor((batch, max_pages), i32),  # [B, MP]
        chunk_req: T.Tensor((num_chunks,), i32),  # [C] request of chunk c
        chunk_start: T.Tensor((num_chunks,), i32),  # [C] first token (multiple of page_size)
        chunk_len: T.Tensor((num_chunks,), i32),  # [C] tokens in the chunk (>= 1)
        part_o: T.Tensor((num_chunks, hq, d), f32),  # [C, Hq, D] value-window order
        part_lse: T.Tensor((num_chunks, hq), f32),  # [C, Hq] base 2
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            T.import_source(producer_guard.imported_source(RS_SOURCE))
            q_rot = T.alloc_shared((block_h, rot), bf16)  # [16, R]   TMA'd query (rows >= 8: next KV head's)
            q_unrot = T.alloc_shared((block_h, d - rot), bf16)  # [16, D-R]
            q_perm = [IRBuilder.name(f"q_perm_{p}", T.alloc_shared((block_h, FP8_PANEL), bf16)) for p in range(4)]
            stored = [IRBuilder.name(f"stored_{p}", T.alloc_shared((block_n, FP8_PANEL), e4m3))
                      for p in range(n_panels)]
            scale_s = T.alloc_shared((block_n,), f32)
            p_shared = T.alloc_shared((block_n, block_h), bf16)  # P^T [N, 16]
            # score A: K-window panels [N, 128], two in turn (overlap) so that one is filled while the other's gemm runs
            a_s = [IRBuilder.name(f"a_s{n}", T.alloc_fragment((block_n, FP8_PANEL), bf16))
                   for n in range(2 if overlap else 1)]
            vt = T.alloc_fragment((block_n, d), bf16)  # value A: V^T as [N, 512], rows permuted
            acc_s = T.alloc_fragment((block_n, block_h), f32)  # S^T [N, 16]
            acc_o = T.alloc_fragment((d, block_h), f32)  # O^T [512, 16], row i = value column output_column(i)
            head_max = T.alloc_fragment((block_h,), f32)
            head_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            head_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)
            rescale_o = T.alloc_shared((block_h,), f32)  # the two warpgroups hold different S columns
            denom_o = T.alloc_shared((block_h,), f32)
            T.annotate_layout({t: make_swizzled_layout(t) for t in stored})

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, (Run(q_rot, 0, rot), Run(q_unrot, rot, d)))
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(head_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                for p in all_panels:
                    T.copy(pool[page, kvh, off:off + block_n, p * FP8_PANEL:(p + 1) * FP8_PANEL], stored[p])
                T.copy(scales[page, kvh, off:off + block_n], scale_s)
                if k == 0:  # the query in the score fragments' column order (here: the query stays a TMA copy)
                    for p in four:
                        for n, j in T.Parallel(block_h, FP8_PANEL):
                            if p == 0:
                                q_perm[p][n, j] = q_rot[n, score_column(j)]
                            else:
                                q_perm[p][n, j] = q_unrot[n, (p - 1) * FP8_PANEL + score_column(j)]
                T.clear(acc_s)
                if overlap:  # S^T [N, 16] += K Q^T, A from registers; async wgmma, at most one gemm in flight
                    for p in four:
                        if p >= 2:
                            T.wait_wgmma(1)  # the gemm that read a_s[p % 2] is done
                        fill_score(stored[p], a_s[p % 2])
                        T.wgmma_gemm(a_s[p % 2], q_perm[p], acc_s, transpose_B=True,
                                     policy=T.GemmWarpPolicy.FullCol)
                    fill_value(stored[1:], vt)  # while the last score gemms run
                    T.wait_wgmma(0)
                    # as T.gemm does after its wait: S^T's registers are not read before it (per thread: 4)
                    T.warpgroup_fence_operand(acc_s, num_regs=block_n * block_h // threads)
                else:
                    for p in four:  # S^T [N, 16] += K Q^T over the K window's panels, A from registers
                        fill_score(stored[p], a_s[0])
                        T.gemm(a_s[0], q_perm[p], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                    fill_value(stored[1:], vt)
                for i, j in T.Parallel(block_n, block_h):  # a token's row is its e4m3 values times its scale
                    acc_s[i, j] *= scale_s[i]
                mask_scores(acc_s, lambda i, j: k * block_n + i < n_tok)
                online_softmax(acc_s, p_shared, head_max, head_max_prev, rescale, head_sum, denom,
                               lambda i: T.if_then_else(k * block_n + i < n_tok, scale_s[i], 0.0))
                T.copy(rescale, rescale_o)
                for i, j in T.Parallel(d, block_h):
                    acc_o[i, j] *= rescale_o[j]
                # O^T [512, 16] += V^T P^T, A from registers (tail tokens: finite codes times P = 0)
                T.gemm(vt, p_shared, acc_o, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)

            T.copy(denom, denom_o)
            for i, j in T.Parallel(d, block_h):
                if j < group:
                    part_o[c, kvh * group + j, output_column(i)] = acc_o[i, j] / denom_o[j]
            for j in T.Parallel(block_h):
                if j < group:
                    part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * scale

    return decode_partial.with_attr("global_symbol", "decode_partial_folded_fp8")


@functools.lru_cache(maxsize=None)
def build(geom: AttentionGeometry, **params):
    """Compile (the library's decode_partial_folded_fp8 argument list) with the registered params overridden by
    `params`."""
    tilelang = require_tilelang()
    cfg = {**DEFAULTS, **params}
    return tilelang.compile(program(geom, **cfg), target=target(), pass_configs=pass_configs())


def ptxas_report(src: str) -> tuple[str, dict]:
    """Registers / spills of the emitted CUDA, from nvcc -Xptxas -v for sm_90a (as bench/prefill_harness.py's
    resources()), and the shared-memory loads and stores of its PTX by width (no cuobjdump here for the SASS)."""
    tl_dir = os.path.dirname(require_tilelang().__file__)
    flags = ["-std=c++17", "-arch=sm_90a", "-O3", "-w", f"-I{tl_dir}/src", f"-I{tl_dir}/3rdparty/cutlass/include"]
    with tempfile.TemporaryDirectory() as tmp:
        cu = os.path.join(tmp, "k.cu")
        with open(cu, "w") as f:
            f.write(src)
        r = subprocess.run(["nvcc", *flags, "--cubin", "-Xptxas", "-v", "-o", os.path.join(tmp, "k.cubin"), cu],
                           capture_output=True, text=True)
        if r.returncode:
            return "nvcc failed:\n" + r.stderr[-3000:], {}
        subprocess.run(["nvcc", *flags, "-ptx", "-o", os.path.join(tmp, "k.ptx"), cu], check=True)
        with open(os.path.join(tmp, "k.ptx")) as f:
            ptx = f.read()
    info = " ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line)
    widths = {}
    for op in re.findall(r"\b(?:ld|st)\.shared(?:::cta)?\.[\w.]+", ptx):
        widths[op] = widths.get(op, 0) + 1
    return info, widths


def main():
    check_pair_formula()
    check_fragment_layouts()
    check_output_rows()
    try:  # the epilogue as first run on the H200 (value_column(i) for acc_o row i) must fail this check
        check_output_rows(store_column=value_column)
        raise RuntimeError("check_output_rows accepts the old epilogue mapping")
    except AssertionError:
        pass
    print("CPU checks: pair formula over all codes, register words against TileLang's wgmma A layouts, accumulator "
          "rows against the hardware's (old epilogue refused): ok")
    for overlap in (True, False):
        kernel = build(GEMMA4_31B, overlap=overlap)
        src = kernel.get_kernel_source()
        calls = {name: len(re.findall(rf"tl::{name}<", src)) for name in ("wgmma_rs", "wgmma_ss")}
        info, widths = ptxas_report(src)
        print(f"decode_partial_fp8_rs overlap={overlap} {DEFAULTS}: {len(src)} chars of CUDA, wgmma calls {calls}")
        print(f"  ptxas: {info}")
        print(f"  PTX shared-memory accesses (static count): {widths}")


if __name__ == "__main__":
    main()
