"""FP8 folded decode partial with both gemms on FP8 tensor cores (no e4m3 -> bf16 conversion): runs 12-14.

Lab notebook (bench/FP8_NOTES.md, runs 12-14; numbers there). Question: issue 15's 0.55x-of-bf16 target allows ~1.40
us per 64-token tile per SM; the library's FP8 tile takes ~3.3 us in L2, ~1.6 of it the chain every partial of this
structure pays and ~1.0 the conversion. Hopper's FP8 wgmma reads e4m3 operands (k32 per instruction, half the
instructions of bf16; both operands K-major): the score gemm S^T = K8 Q8^T reads the e4m3 panels as TMA wrote them,
and O^T = V^T P^T reads V^T, which must be transposed first (the row stores a token's 512 value columns contiguously,
so V^T as loaded is M-major).

Options (one file, one reference: the harness's float64 check over the dequantized pool):
  - transpose: "none" (V^T never written: a timing probe, WRONG output by design, the chain without a transpose),
    "t16x4" (the consumer transposes the value window in 16-token x 4-column blocks per thread, before the score
    gemm; its stores conflict 4-way on V^T's 64-byte swizzle) or "t4x16" (4-token x 16-column blocks, store n to
    column n ^ (block mod 8): conflict-free loads and stores).
  - precise: the query and P each as two e4m3 parts, hi + lo / 16, in the 16 rows of wgmma's N that the 8 query
    heads only half use (rows 8-15 held the next KV head's queries, never stored), so the gemms' instructions do not
    change; a per-head query scale (448 / max |q|, once per CTA) and a per-tile P scale (256 / the tile's largest
    valid token scale, `foldkv_max_scale64`). Else one e4m3 part with the constant gains Q_GAIN and P_GAIN (a probe:
    ~20x the library's error).
  - ctas_per_sm 2 (one stage each, ~99 KB of shared memory a CTA; plan for 264 CTAs a wave) or 1 (two stages).
Kept as in the library: the tokens' scales on S and on P, the float32 online softmax (batched reductions), and the
value gemm into a per-tile accumulator added into the running O in float32 (the two-level accumulation issue 15
asks for: FP8 wgmma accumulates in reduced precision, so it never sums across tiles).
Best so far (run 14): t4x16, precise, two CTAs per SM: 0.64-0.67x the bf16 folded decode at 163,336 tokens and on
ragged batches (the library's FP8 partial: 1.22-1.36x), error 2.2-3.2e-3 against float64, within the gate's bound.
Not in the library yet: its gate bound needs the query's two-part rounding and FP8 accumulation terms (FP8_NOTES).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros, producer_guard
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
TRANSPOSE_BARRIER_ID = macros.CONVERT_BARRIER_ID  # the library conversion's named barrier: unused by TileLang
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
// A 4-token x 16-column block (src[r]: 16 bytes of token r) into its transpose, 4 sixteen-byte loads, 32 byte
// permutes, 16 four-byte stores. Store n goes to column n ^ m (dst[n] is that column's address, m = the thread's
// column block mod 8): the eight column blocks of a warp then store to eight different (row parity, 16-byte chunk)
// slots of V^T's 64-byte swizzle, so a warp's 32 stores hit 32 banks (the 16 x 4 blocks above conflict 4-way). The
// data is put in that order by a three-level select network on m's bits (48 selects).
__device__ __forceinline__ void foldkv_e4m3_t4x16(int first, int last, int barrier_id, int threads, int m, int keep,
    const void* s0, const void* s1, const void* s2, const void* s3, void* d0, void* d1, void* d2, void* d3, void* d4,
    void* d5, void* d6, void* d7, void* d8, void* d9, void* d10, void* d11, void* d12, void* d13, void* d14,
    void* d15) {
  // tokens r >= keep are past the chunk: their slots hold arbitrary bits (a NaN code, say), and a probability of 0
  // times NaN is NaN in the value gemm, so they are written as 0 (the gates' hostile pools caught it, run 16)
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const uint4 r0 = keep > 0 ? *reinterpret_cast<const uint4*>(s0) : zero;
  const uint4 r1 = keep > 1 ? *reinterpret_cast<const uint4*>(s1) : zero;
  const uint4 r2 = keep > 2 ? *reinterpret_cast<const uint4*>(s2) : zero;
  const uint4 r3 = keep > 3 ? *reinterpret_cast<const uint4*>(s3) : zero;
  const unsigned int a[4] = {r0.x, r0.y, r0.z, r0.w}, b[4] = {r1.x, r1.y, r1.z, r1.w};
  const unsigned int c[4] = {r2.x, r2.y, r2.z, r2.w}, e[4] = {r3.x, r3.y, r3.z, r3.w};
  unsigned int out[16];  // out[q]: column q, the 4 tokens
#pragma unroll
  for (int w = 0; w < 4; ++w) foldkv_t4x4(a[w], b[w], c[w], e[w], out + 4 * w);
#pragma unroll
  for (int bit = 1; bit < 8; bit <<= 1) {
    const bool flip = (m & bit) != 0;
    unsigned int tmp[16];
#pragma unroll
    for (int n = 0; n < 16; ++n) tmp[n] = flip ? out[n ^ bit] : out[n];
#pragma unroll
    for (int n = 0; n < 16; ++n) out[n] = tmp[n];
  }
  void* dst[16] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15};
  if (first) asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
#pragma unroll
  for (int n = 0; n < 16; ++n) *reinterpret_cast<unsigned int*>(dst[n]) = out[n];
  if (last) {
    asm volatile("fence.proxy.async.shared::cta;" : : : "memory");
    asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
  }
}
// The largest of a tile's first `valid` (of 64) token scales, in every lane of the warp (scales are > 0): two shared
// loads and five shuffles, where a 64-step loop over shared memory is a chain of dependent loads.
__device__ __forceinline__ float foldkv_max_scale64(const float* scale, int valid) {
  const int lane = threadIdx.x & 31;
  float m = fmaxf(lane < valid ? scale[lane] : 0.0f, lane + 32 < valid ? scale[lane + 32] : 0.0f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return fmaxf(m, 1e-30f);
}
"""


def transpose_v_macro(block_n: int, threads: int, kind: str = "t16x4"):
    """The value window's panels (stored [block_n, 128] e4m3 each) into V^T [4 x 128, block_n], the K-major operand
    FP8 wgmma needs. "t16x4": each thread one 16-token x 4-column block of every panel (T.Parallel(4, 32): a warp
    reads 128 contiguous bytes of one token row; its stores conflict 4-way); "t4x16": one 4-token x 16-column block
    (T.Parallel(16, 8): a quarter-warp reads one token row's 128 bytes, a warp's stores hit 32 banks)."""
    import tilelang.language as T

    if kind == "t16x4":
        tok_blocks, col_blocks = block_n // 16, FP8_PANEL // 4
    else:
        tok_blocks, col_blocks = block_n // 4, FP8_PANEL // 16
    assert tok_blocks * col_blocks == threads and kind in ("t16x4", "t4x16")

    # a panel is reached through its list (`panels[n]`): a buffer passed as a macro argument, or bound to a loop
    # variable, would be renamed after it, all panels under one name, and TileLang would then number them in an
    # order that changes from process to process
    @T.macro
    def transpose_panel(panels, n, v_t, d0, first, last, tokens_left):
        for i, j in T.Parallel(tok_blocks, col_blocks):
            if kind == "t16x4":  # (run 12: no zeroing of the tokens past the chunk; probe pools have no NaN slots)
                T.call_extern("handle", TRANSPOSE_FN, int(first), int(last), TRANSPOSE_BARRIER_ID, threads,
                              *[T.address_of(panels[n][i * 16 + r, j * 4]) for r in range(16)],
                              *[T.address_of(v_t[d0 + j * 4 + q, i * 16]) for q in range(4)])
            else:
                T.call_extern("handle", "foldkv_e4m3_t4x16", int(first), int(last), TRANSPOSE_BARRIER_ID, threads,
                              j % 8, tokens_left() - i * 4,
                              *[T.address_of(panels[n][i * 4 + r, j * 16]) for r in range(4)],
                              *[T.address_of(v_t[d0 + j * 16 + T.bitwise_xor(m, j % 8), i * 4]) for m in range(16)])

    @T.macro
    def transpose_v(panels, v_t, tokens_left):
        for n in list(range(len(panels))):  # (range itself would be a device loop)
            transpose_panel(panels, n, v_t, n * FP8_PANEL, n == 0, n == len(panels) - 1, tokens_left)

    return transpose_v


def program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64, num_stages: int = 2,
            block_h: int = 16, reduce_batch: int = 4, ctas_per_sm: int = 1, transpose: str = "none",
            precise: bool = False, panel_acc: bool = False):
    """The probe's prim_func, the library FP8 partial's argument list (a drop-in for decode_partial_folded_fp8).
    transpose: "none" (V^T unwritten), "t16x4" or "t4x16" (transpose_v_macro). precise: the query and P each as two
    e4m3 parts (hi + lo / 16) in the 16 rows of wgmma's N (8 query heads, rows 8-15 the lo parts), with a per-head
    query scale and a per-tile P scale from the tile's largest token scale; else one e4m3 part with constant gains."""
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
    share_sm_registers = macros.share_sm_registers_macro(ctas_per_sm, threads) if ctas_per_sm > 1 else None
    assert transpose in ("none", "t16x4", "t4x16")
    transpose_v = transpose_v_macro(block_n, threads, "t16x4" if transpose == "none" else transpose)
    assert not precise or 2 * group == block_h
    lo = 1.0 / 16.0  # the lo part is stored times 16 (e4m3 keeps 3 fraction bits: the hi part's error is < 2^-4 of it)

    def hi_part(x):  # x ~ hi + lo / 16: the two e4m3 parts of a float32 expression
        return T.cast(x, e4m3)

    def lo_part(x):
        return T.cast((x - T.cast(T.cast(x, e4m3), f32)) * 16.0, e4m3)

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
            T.import_source(producer_guard.imported_source(
                TRANSPOSE_SOURCE if transpose != "none" or precise else None))
            if ctas_per_sm > 1:
                share_sm_registers()
            q_s = T.alloc_shared((block_h, d), bf16)
            q8 = [IRBuilder.name(f"q8_{p}", T.alloc_shared((block_h, FP8_PANEL), e4m3)) for p in range(score_panels)]
            stored = [IRBuilder.name(f"stored_{p}", T.alloc_shared((block_n, FP8_PANEL), e4m3))
                      for p in range(panels)]
            scale_s = T.alloc_shared((block_n,), f32)
            v_t = T.alloc_shared((d, block_n), e4m3)  # V^T [512, 64], K-major: unwritten with transpose "none"
            p8 = T.alloc_shared((block_h, block_n), e4m3)  # P^T [16, 64], K-major (tokens contiguous)
            q_part = T.alloc_shared((block_h, 16), f32)  # precise: per head, 16 partial maxima of |q|
            q_gain = T.alloc_shared((block_h,), f32)  # precise: per head, 448 / max |q|
            q_inv = T.alloc_shared((block_h,), f32)  # precise: per head, max |q| / 448
            acc_s = T.alloc_fragment((block_n, block_h), f32)
            acc_p = T.alloc_fragment((block_n, block_h), f32)  # panel_acc: one panel's scores
            acc_o_tile = T.alloc_fragment((d, block_h), f32)
            # precise: the score and output pieces of the lo rows (columns 8-15) brought to columns 0-7 (a loop may
            # index a fragment one way only), and the running output and softmax state over the 8 heads
            s_lo = T.alloc_fragment((block_n, group), f32)
            acc_c = T.alloc_fragment((block_n, group), f32)
            o_lo = T.alloc_fragment((d, group), f32)
            cols = group if precise else block_h
            acc_o = T.alloc_fragment((d, cols), f32)
            head_max = T.alloc_fragment((cols,), f32)
            head_max_prev = T.alloc_fragment((cols,), f32)
            rescale = T.alloc_fragment((cols,), f32)
            head_sum = T.alloc_fragment((cols,), f32)
            denom = T.alloc_fragment((cols,), f32)
            amax = T.alloc_local((1,), f32)
            tile_gain = T.alloc_local((1,), f32)
            tile_inv = T.alloc_local((1,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            T.copy(query[req, kvh * group:kvh * group + block_h, 0:d], q_s)
            if precise:
                for h, t in T.Parallel(block_h, 16):
                    amax[0] = 0.0
                    for e in T.serial(d // 16):
                        amax[0] = T.max(amax[0], T.abs(T.cast(q_s[h, t * (d // 16) + e], f32)))
                    q_part[h, t] = amax[0]
                for h in T.Parallel(block_h):
                    amax[0] = 1e-30
                    for t in T.serial(16):
                        amax[0] = T.max(amax[0], q_part[h, t])
                    q_gain[h] = 448.0 / amax[0]
                    q_inv[h] = amax[0] * (1.0 / 448.0)
                for qp in [(t, n * FP8_PANEL) for n, t in enumerate(q8)]:  # a list, not range(): range is a TIR loop
                    for i, j in T.Parallel(block_h, FP8_PANEL):
                        x = T.cast(q_s[i % group, qp[1] + j], f32) * q_gain[i % group]  # an expression, inlined
                        qp[0][i, j] = T.if_then_else(i < group, hi_part(x), lo_part(x))
            else:
                for qp in [(t, n * FP8_PANEL) for n, t in enumerate(q8)]:
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
                if transpose != "none":
                    transpose_v(stored[panels - score_panels:], v_t, lambda: n_tok - k * block_n)
                if panel_acc:  # each panel's 4 k32 steps into a fresh accumulator, the panels added in float32
                    T.clear(acc_s)
                    for pair in list(zip(stored, q8)):
                        T.gemm(pair[0], pair[1], acc_p, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(block_n, block_h):
                            acc_s[i, j] += acc_p[i, j]
                else:
                    T.clear(acc_s)
                    for pair in list(zip(stored, q8)):
                        T.gemm(pair[0], pair[1], acc_s, transpose_B=True)  # S^T [N, 16] += K8 Q8^T (FP8 wgmma)
                if precise:
                    for i, j in T.Parallel(block_n, group):
                        s_lo[i, j] = acc_s[i, j + group]
                    for i, j in T.Parallel(block_n, group):
                        acc_c[i, j] = (acc_s[i, j] + s_lo[i, j] * lo) * scale_s[i] * q_inv[j]
                    # P x scale <= the tile's largest valid scale: times 256 / that, it stays inside e4m3's range
                    tile_inv[0] = T.call_extern(f32, "foldkv_max_scale64", T.address_of(scale_s[0]),
                                                n_tok - k * block_n) * (1.0 / 256.0)
                    tile_gain[0] = 1.0 / tile_inv[0]
                    scores = acc_c
                else:
                    for i, j in T.Parallel(block_n, block_h):
                        acc_s[i, j] *= scale_s[i] * (1.0 / Q_GAIN)
                    tile_gain[0] = P_GAIN
                    tile_inv[0] = 1.0 / P_GAIN
                    scores = acc_s
                mask_scores(scores, lambda i, j: k * block_n + i < n_tok)
                online_softmax(scores, None, head_max, head_max_prev, rescale, head_sum, denom,
                               lambda i: T.if_then_else(k * block_n + i < n_tok, scale_s[i] * tile_gain[0], 0.0))
                if precise:  # rows 0-7 of P^T: P's hi part; rows 8-15: its lo part, times 16
                    for i, j in T.Parallel(block_n, group):
                        p8[j, i] = hi_part(scores[i, j])
                    for i, j in T.Parallel(block_n, group):
                        p8[j + group, i] = lo_part(scores[i, j])
                else:
                    for i, j in T.Parallel(block_n, block_h):
                        p8[j, i] = T.cast(scores[i, j], e4m3)
                T.gemm(v_t, p8, acc_o_tile, transpose_B=True, clear_accum=True)  # O^T tile = V^T P^T (FP8 wgmma)
                if precise:
                    for i, j in T.Parallel(d, group):
                        o_lo[i, j] = acc_o_tile[i, j + group]
                    for i, j in T.Parallel(d, group):  # float32: the second level
                        acc_o[i, j] = acc_o[i, j] * rescale[j] + (acc_o_tile[i, j] + o_lo[i, j] * lo) * tile_inv[0]
                else:
                    for i, j in T.Parallel(d, block_h):
                        acc_o[i, j] = acc_o[i, j] * rescale[j] + acc_o_tile[i, j] * tile_inv[0]

            for i, j in T.Parallel(d, cols):
                if j < group:
                    part_o[c, kvh * group + j, i] = acc_o[i, j] / denom[j]
            for j in T.Parallel(cols):
                if j < group:
                    part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * scale

    return decode_partial.with_attr("global_symbol", "decode_partial_folded_fp8_mma_probe")


def build(geom: AttentionGeometry, **tiling):
    """Compile the probe (JIT); a drop-in for `kernels={"decode_partial_folded_fp8": ...}`."""
    tilelang = require_tilelang()

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def probe(page_size, block_n, num_stages, block_h, reduce_batch, ctas_per_sm, transpose, precise, panel_acc):
        return program(geom, page_size=page_size, block_n=block_n, num_stages=num_stages, block_h=block_h,
                       reduce_batch=reduce_batch, ctas_per_sm=ctas_per_sm, transpose=transpose, precise=precise,
                       panel_acc=panel_acc)

    cfg = {**dict(page_size=64, block_n=64, num_stages=2, block_h=16, reduce_batch=4, ctas_per_sm=1,
                  transpose="none", precise=False, panel_acc=False), **tiling}
    return probe(**cfg)
