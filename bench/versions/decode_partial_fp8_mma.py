"""FP8 folded decode partial with both gemms on FP8 tensor cores (no e4m3 -> bf16 conversion): a timing probe, WRONG
output by design.

Lab notebook (bench/FP8_NOTES.md, run 12). Question: issue 15's 0.55x-of-bf16 target allows ~1.40 us per 64-token
tile per SM; the library's FP8 tile takes ~3.3 us in L2, ~2.0 of it a chain every partial of this structure pays
(run 8) and ~1.0 the conversion. With Hopper's FP8 wgmma neither gemm needs the bf16 tiles: the score gemm
S^T = K8 Q8^T reads the e4m3 panels as TMA wrote them (K-major, as FP8 wgmma requires of both operands), and
O^T = V^T P^T reads V^T from shared memory. So how short is a tile's chain when its gemms are FP8 (half the wgmma
instructions of bf16: k32 instead of k16) and nothing is converted?

What is wrong by design, and why the timing still answers the question:
  - FP8 wgmma needs both operands K-major, and V^T's K is the token: the row stores a token's 512 value columns
    contiguously, so V^T is M-major. A real kernel needs V^T transposed in shared memory (FA3's FP8 path: the producer
    warpgroup transposes each tile, off the consumer's chain). Here `v_t` [512, 64] is never written: the value gemm
    reads whatever it holds. The probe therefore times the consumer's chain without the transpose (a lower bound).
  - The query is rounded to e4m3 once per CTA (times a constant, Q_GAIN, no per-head scale or hi/lo split): a real kernel
    might carry two e4m3 parts (wgmma N = 32 instead of 16) to keep the score's precision; P x scale is multiplied
    by a constant (P_GAIN) before its rounding to e4m3, where a real kernel would take the tile's largest scale.
  - With `transpose=True` the consumer transposes the value window into `v_t` (16-token x 4-column blocks, byte
    permutes, before the score gemm): the output is then attention with the query and P in e4m3, and the harness's
    float64 check says how far that is from the library's.
Kept as a real kernel would have them: the tokens' scales on S and on P (as the library's), the float32 online
softmax (batched reductions), P rounded to e4m3 into shared memory (P^T [16, 64], K-major), and the value gemm into a
per-tile accumulator added into the running O in float32 (the two-level accumulation issue 15 asks for: FP8 wgmma
accumulates in reduced precision, so it never sums across tiles).
Prediction (before the run), from run 10's 1.60 us bf16 chain in L2: the two gemms are ~0.5-0.7 us of it (64 wgmma
k16 instructions, each ~16-20 clocks issue at N=16 plus the dependent waits); FP8 halves the instructions, the rest
(softmax, scale multiplies, P's store, O's FMA pass: ~0.15 us more than bf16) stays. So in L2 ~1.25-1.45 us per tile,
from DRAM ~1.35-1.5 (the bytes take 1.24). Two CTAs per SM (FP8 stages are 40 KB: two of them fit per CTA) hide
part of the chain: in L2 ~1.0-1.2, from DRAM ~1.25-1.35. If one CTA stays above 1.4 us per tile in L2, an FP8 MMA
partial with one chain per SM cannot meet the 0.55x target even before its transpose is paid.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import FP8_PANEL
from foldkv.kernels.tl import pass_configs, require_tilelang, target


# P x scale is at most the tile's largest token scale (amax / 448 of a row: ~0.007-0.06 for RMS-normalised rows with
# outlier channels), deep in e4m3's subnormals; times 2^12 it spans e4m3's normal range. A probe's constant: a real
# kernel would take the factor from the tile's largest scale.
P_GAIN = 4096.0
# The query times 2^6 before its rounding to e4m3 (the harness's folded queries have elements of ~0.01-1): a probe's
# constant where a real kernel would scale each head by its largest element.
Q_GAIN = 64.0
TRANSPOSE_FN = "foldkv_e4m3_t16x4"
TRANSPOSE_BARRIER_ID = 7  # the library conversion's barrier id (macros.CONVERT_BARRIER_ID): unused by TileLang
TRANSPOSE_SOURCE = r"""
// rows a, b, c, d of a 4 x 4 byte block in, its columns out
__device__ __forceinline__ void foldkv_t4x4(unsigned int a, unsigned int b, unsigned int c, unsigned int d,
                                            unsigned int* col) {
  const unsigned int t0 = __byte_perm(a, b, 0x5140u), t1 = __byte_perm(a, b, 0x7362u);
  const unsigned int t2 = __byte_perm(c, d, 0x5140u), t3 = __byte_perm(c, d, 0x7362u);
  col[0] = __byte_perm(t0, t2, 0x5410u);
  col[1] = __byte_perm(t0, t2, 0x7632u);
  col[2] = __byte_perm(t1, t3, 0x5410u);
  col[3] = __byte_perm(t1, t3, 0x7632u);
}
// A 16-token x 4-column block of a shared e4m3 tile (src[r]: 4 bytes of token r) into its transpose (dst[q]: 16 bytes,
// the 16 tokens of column q): 16 four-byte loads, 32 byte permutes, 4 sixteen-byte stores. `first` waits on the named
// barrier before writing (the previous tile's gemm reads the destination), `last` fences to the async proxy and waits
// again (the next gemm reads it), as the library's e4m3 conversion does.
__device__ __forceinline__ void foldkv_e4m3_t16x4(int first, int last, int barrier_id, int threads,
    const void* s0, const void* s1, const void* s2, const void* s3, const void* s4, const void* s5, const void* s6,
    const void* s7, const void* s8, const void* s9, const void* s10, const void* s11, const void* s12,
    const void* s13, const void* s14, const void* s15, void* d0, void* d1, void* d2, void* d3) {
  const void* src[16] = {s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15};
  void* dst[4] = {d0, d1, d2, d3};
  unsigned int in[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) in[r] = *reinterpret_cast<const unsigned int*>(src[r]);
  unsigned int out[4][4];  // out[q][g]: column q, tokens 4g..4g+3
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    unsigned int col[4];
    foldkv_t4x4(in[4 * g], in[4 * g + 1], in[4 * g + 2], in[4 * g + 3], col);
#pragma unroll
    for (int q = 0; q < 4; ++q) out[q][g] = col[q];
  }
  if (first) asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
#pragma unroll
  for (int q = 0; q < 4; ++q)
    *reinterpret_cast<uint4*>(dst[q]) = make_uint4(out[q][0], out[q][1], out[q][2], out[q][3]);
  if (last) {
    asm volatile("fence.proxy.async.shared::cta;" : : : "memory");
    asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
  }
}
"""


def transpose_v_macro(block_n: int, threads: int):
    """The value window's panels (stored [block_n, 128] e4m3 each) into V^T [4 x 128, block_n], the K-major operand
    FP8 wgmma needs: each thread one 16-token x 4-column block of every panel (T.Parallel(4, 32): a warp reads 128
    contiguous bytes of one token row)."""
    import tilelang.language as T

    tok_blocks, col_blocks = block_n // 16, FP8_PANEL // 4
    assert tok_blocks * col_blocks == threads

    @T.macro
    def transpose_panel(stored, v_t, d0, first, last):
        for i, j in T.Parallel(tok_blocks, col_blocks):
            T.call_extern("handle", TRANSPOSE_FN, int(first), int(last), TRANSPOSE_BARRIER_ID, threads,
                          *[T.address_of(stored[i * 16 + r, j * 4]) for r in range(16)],
                          *[T.address_of(v_t[d0 + j * 4 + q, i * 16]) for q in range(4)])

    @T.macro
    def transpose_v(panels, v_t):
        for n, stored in enumerate(panels):
            transpose_panel(stored, v_t, n * FP8_PANEL, n == 0, n == len(panels) - 1)

    return transpose_v


def program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64, num_stages: int = 2,
            block_h: int = 16, reduce_batch: int = 4, ctas_per_sm: int = 1, transpose: bool = False):
    """The probe's prim_func, the library FP8 partial's argument list (a drop-in for decode_partial_folded_fp8)."""
    require_tilelang()
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    width = d + geom.rotary_width
    threads = 128
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32, e4m3 = "bfloat16", "float32", "int32", "float8_e4m3"
    scale = macros.LOG2E
    panels = width // FP8_PANEL  # 5: score window = panels 0..3 (row[0:D]), value window = panels 1..4 (row[R:D+R])
    score_panels = d // FP8_PANEL
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    transpose_v = transpose_v_macro(block_n, threads)

    @T.prim_func
    def decode_partial(
        query: T.Tensor((batch, hq, d), bf16),
        pool: T.Tensor((num_pages, hkv, page_size, width), e4m3),
        scales: T.Tensor((num_pages, hkv, page_size), f32),
        page_ids: T.Tensor((batch, max_pages), i32),
        chunk_req: T.Tensor((num_chunks,), i32),
        chunk_start: T.Tensor((num_chunks,), i32),
        chunk_len: T.Tensor((num_chunks,), i32),
        part_o: T.Tensor((num_chunks, hq, d), f32),
        part_lse: T.Tensor((num_chunks, hq), f32),
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            if transpose:
                T.import_source(TRANSPOSE_SOURCE)
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                per_thread = 65536 // ctas_per_sm // (threads + 128)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(min((per_thread * (threads + 128) - 24 * 128) // threads // 8 * 8, 240))
            q_s = T.alloc_shared((block_h, d), bf16)
            q8 = [IRBuilder.name(f"q8_{p}", T.alloc_shared((block_h, FP8_PANEL), e4m3)) for p in range(score_panels)]
            stored = [IRBuilder.name(f"stored_{p}", T.alloc_shared((block_n, FP8_PANEL), e4m3))
                      for p in range(panels)]
            scale_s = T.alloc_shared((block_n,), f32)
            v_t = T.alloc_shared((d, block_n), e4m3)  # V^T [512, 64], K-major: written only with `transpose`
            p8 = T.alloc_shared((block_h, block_n), e4m3)  # P^T [16, 64], K-major (tokens contiguous)
            acc_s = T.alloc_fragment((block_n, block_h), f32)
            acc_o = T.alloc_fragment((d, block_h), f32)
            acc_o_tile = T.alloc_fragment((d, block_h), f32)
            head_max = T.alloc_fragment((block_h,), f32)
            head_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            head_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            T.copy(query[req, kvh * group:kvh * group + block_h, 0:d], q_s)
            for qp in [(t, n * FP8_PANEL) for n, t in enumerate(q8)]:  # a list, not range(): range is a TIR loop
                for i, j in T.Parallel(block_h, FP8_PANEL):
                    qp[0][i, j] = T.cast(q_s[i, qp[1] + j] * Q_GAIN, e4m3)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(head_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                for sp in [(t, n * FP8_PANEL) for n, t in enumerate(stored)]:
                    T.copy(pool[page, kvh, off:off + block_n, sp[1]:sp[1] + FP8_PANEL], sp[0])
                T.copy(scales[page, kvh, off:off + block_n], scale_s)
                if transpose:
                    transpose_v(stored[panels - score_panels:], v_t)
                T.clear(acc_s)
                for pair in list(zip(stored, q8)):
                    T.gemm(pair[0], pair[1], acc_s, transpose_B=True)  # S^T [N, 16] += K8 Q8^T (FP8 wgmma)
                for i, j in T.Parallel(block_n, block_h):
                    acc_s[i, j] *= scale_s[i] * (1.0 / Q_GAIN)
                mask_scores(acc_s, lambda i, j: k * block_n + i < n_tok)
                online_softmax(acc_s, None, head_max, head_max_prev, rescale, head_sum, denom,
                               lambda i: T.if_then_else(k * block_n + i < n_tok, scale_s[i] * P_GAIN, 0.0))
                for i, j in T.Parallel(block_n, block_h):
                    p8[j, i] = T.cast(acc_s[i, j], e4m3)
                T.gemm(v_t, p8, acc_o_tile, transpose_B=True, clear_accum=True)  # O^T tile = V^T P^T (FP8 wgmma)
                for i, j in T.Parallel(d, block_h):
                    acc_o[i, j] = acc_o[i, j] * rescale[j] + acc_o_tile[i, j]  # float32: the second level

            for i, j in T.Parallel(d, block_h):
                if j < group:
                    part_o[c, kvh * group + j, i] = acc_o[i, j] / (denom[j] * P_GAIN)
            for j in T.Parallel(block_h):
                if j < group:
                    part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * scale

    return decode_partial.with_attr("global_symbol", "decode_partial_folded_fp8_mma_probe")


def build(geom: AttentionGeometry, **tiling):
    """Compile the probe (JIT); a drop-in for `kernels={"decode_partial_folded_fp8": ...}`."""
    tilelang = require_tilelang()

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def probe(page_size, block_n, num_stages, block_h, reduce_batch, ctas_per_sm, transpose):
        return program(geom, page_size=page_size, block_n=block_n, num_stages=num_stages, block_h=block_h,
                       reduce_batch=reduce_batch, ctas_per_sm=ctas_per_sm, transpose=transpose)

    cfg = {**dict(page_size=64, block_n=64, num_stages=2, block_h=16, reduce_batch=4, ctas_per_sm=1,
                  transpose=False), **tiling}
    return probe(**cfg)
