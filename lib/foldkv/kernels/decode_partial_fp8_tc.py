"""The FP8 folded decode partial on FP8 tensor cores (`fp8_math="tensor_cores"`, the FP8 pool's default): both gemms
in e4m3 wgmma, the value window transposed by the consumer, the query and P in two e4m3 parts (DECODE_SCHEDULE.md,
"The tensor-core FP8 partial"). Only the served configuration; the probe's other options are in bench/versions/
decode_partial_fp8_mma.py. Kernel arguments: the exact FP8 partial's (decode_partial.py).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from dataclasses import dataclass
from typing import Any

from ..config import AttentionGeometry
from ..layout import KvFormat
from . import macros, producer_guard, registry
from .cuda_checks import check_e4m3_conversion
from .decode_partial import FP8_PANEL, TailContext, partial_args, partial_inputs
from .registry import hands_out
from .tl import compile_program, prim_func, require_tilelang

NAME = "decode_partial_folded_fp8_tc"
TRANSPOSE_FN = "foldkv_e4m3_t4x16"
MAX_SCALE_FN = "foldkv_max_scale64"
# the transpose's named barrier: the e4m3 conversion's id (no TileLang barrier uses it; checked on the emitted CUDA)
TRANSPOSE_BARRIER_ID = macros.CONVERT_BARRIER_ID
TWO_PART_LO = 16.0  # the lo part is stored times 16: e4m3 keeps 3 fraction bits, so |x - hi| <= 2^-4 |x|
P_RANGE = 256.0  # P x scale x gain <= 256 < 448, e4m3's largest
SERVED = dict(transpose="t4x16", precise=True)  # the registered values of the probe's options (the only ones built)

DEVICE_SOURCE = r"""
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
// A 4-token x 16-column block (src[r]: 16 bytes of token r) into its transpose, 4 sixteen-byte loads, 32 byte
// permutes, 16 four-byte stores. Store n goes to column n ^ m (dst[n] is that column's address, m = the thread's
// column block mod 8): the eight column blocks of a warp then store to eight different (row parity, 16-byte chunk)
// slots of V^T's 64-byte swizzle, so a warp's 32 stores hit 32 banks. The data is put in that order by a three-level
// select network on m's bits (48 selects). The call is opaque to TileLang, which places no barrier for the tile it
// writes: `first` waits on the named barrier before writing (the previous tile's value gemm reads V^T), `last`
// fences to the async proxy and waits again (the next gemm reads it), as the e4m3 conversion does.
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


def transpose_panel_macro(block_n: int, threads: int):
    """One e4m3 panel [block_n, 128] of the value window into V^T's rows d0..d0+127 (the K-major operand FP8 wgmma
    needs): each consumer thread one 4-token x 16-column block, a quarter-warp one token row's 128 bytes; `first` /
    `last` carry the barriers (DEVICE_SOURCE). `tokens_left()`: the tile's tokens in the chunk (past it: 0 in V^T)."""
    import tilelang.language as T

    tok_blocks, col_blocks = block_n // 4, FP8_PANEL // 16
    assert tok_blocks * col_blocks == threads

    # a panel is reached through its list (`panels[n]`): passed as a macro argument or bound to a loop variable, all
    # panels would be renamed after it, then numbered in an order that changes from process to process
    @T.macro
    def transpose_panel(panels, n, v_t, d0, first, last, tokens_left):
        for i, j in T.Parallel(tok_blocks, col_blocks):
            T.call_extern("handle", TRANSPOSE_FN, int(first), int(last), TRANSPOSE_BARRIER_ID, threads, j % 8,
                          tokens_left() - i * 4, *[T.address_of(panels[n][i * 4 + r, j * 16]) for r in range(4)],
                          *[T.address_of(v_t[d0 + j * 16 + T.bitwise_xor(m, j % 8), i * 4]) for m in range(16)])

    return transpose_panel


def transpose_values_macro(block_n: int, threads: int):
    """The value window's e4m3 panels (a list, in column order) into V^T [512, block_n] by `transpose_panel_macro`."""
    import tilelang.language as T

    transpose_panel = transpose_panel_macro(block_n, threads)

    @T.macro
    def transpose_values(panels, v_t, tokens_left):
        for n in list(range(len(panels))):  # (range itself would be a device loop)
            transpose_panel(panels, n, v_t, n * FP8_PANEL, n == 0, n == len(panels) - 1, tokens_left)

    return transpose_values


@dataclass(frozen=True)
class Rounding:
    """How the query and P go to the FP8 tensor cores: four T.macros called with the kernel's own buffers (a version
    brings its own through the probe's hooks):
        cols        columns of the running output and softmax state (8 when rows 8-15 of wgmma's N carry lo parts)
        query       (q_s, q8, q_part, q_gain, q_inv, amax): the bf16 query rows [16, D] into the e4m3 panels q8
        scores      (acc_s, s_lo, scores, scale_s, q_inv, tile_gain, tile_inv, valid): S^T [N, 16] into `scores`
                    [N, cols] float32, scales applied, and the tile's P gain and inverse (`valid`: tokens in the chunk)
        p_store     (scores, p8): P [N, cols] (times the gain) into P^T [16, N] e4m3
        accumulate  (acc_o, acc_o_tile, o_lo, rescale, tile_inv): the tile's O^T [D, 16] into the running O"""
    cols: int
    query: Any
    scores: Any
    p_store: Any
    accumulate: Any


def two_part_rounding(geom: AttentionGeometry, block_n: int, block_h: int) -> Rounding:
    """The served rounding: the query (per head scaled to 448 / max |q|) and P (per tile scaled to 256 / the tile's
    largest valid token scale) each as two e4m3 parts, hi in rows 0-7 of wgmma's N, lo (times 16) in rows 8-15."""
    import tilelang.language as T

    d, group, f32 = geom.head_dim, geom.group_size, "float32"
    if 2 * group != block_h:
        raise ValueError(f"two e4m3 parts in wgmma's N: 2 x {group} query heads must be block_h={block_h}")
    unlo = 1.0 / TWO_PART_LO
    q_chunk = d // 16  # query elements each of 16 threads scans per head for its largest |q|

    def hi_part(x):  # the e4m3 hi part of a float32 expression x (x ~ hi + lo / TWO_PART_LO)
        return T.cast(x, "float8_e4m3")

    def lo_part(x):  # its lo part: e4m3(TWO_PART_LO (x - hi))
        return T.cast((x - T.cast(T.cast(x, "float8_e4m3"), "float32")) * TWO_PART_LO, "float8_e4m3")

    @T.macro
    def query(q_s, q8, q_part, q_gain, q_inv, amax):
        for h, t in T.Parallel(block_h, 16):
            amax[0] = 0.0
            for e in T.serial(q_chunk):
                amax[0] = T.max(amax[0], T.abs(T.cast(q_s[h, t * q_chunk + e], f32)))
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

    @T.macro
    def scores(acc_s, s_lo, out, scale_s, q_inv, tile_gain, tile_inv, valid):
        for i, j in T.Parallel(block_n, group):  # the lo columns brought to 0-7 (a loop indexes a fragment one way)
            s_lo[i, j] = acc_s[i, j + group]
        for i, j in T.Parallel(block_n, group):  # a token's row is its e4m3 values times its scale
            out[i, j] = (acc_s[i, j] + s_lo[i, j] * unlo) * scale_s[i] * q_inv[j]
        # P x scale <= the tile's largest valid scale: times 256 / that, it stays inside e4m3's range
        tile_inv[0] = T.call_extern(f32, MAX_SCALE_FN, T.address_of(scale_s[0]), valid) * (1.0 / P_RANGE)
        tile_gain[0] = 1.0 / tile_inv[0]

    @T.macro
    def p_store(probs, p8):  # rows 0-7 of P^T: P's hi part; rows 8-15: its lo part, times 16
        for i, j in T.Parallel(block_n, group):
            p8[j, i] = hi_part(probs[i, j])
        for i, j in T.Parallel(block_n, group):
            p8[j + group, i] = lo_part(probs[i, j])

    @T.macro
    def accumulate(acc_o, acc_o_tile, o_lo, rescale, tile_inv):
        for i, j in T.Parallel(d, group):
            o_lo[i, j] = acc_o_tile[i, j + group]
        for i, j in T.Parallel(d, group):  # float32: the second level of the accumulation
            acc_o[i, j] = acc_o[i, j] * rescale[j] + (acc_o_tile[i, j] + o_lo[i, j] * unlo) * tile_inv[0]

    return Rounding(cols=group, query=query, scores=scores, p_store=p_store, accumulate=accumulate)


def decode_partial_fp8_tc_program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64,
                                  num_stages: int = 1, block_h: int = 16, reduce_batch: int = 4, ctas_per_sm: int = 2):
    """The TileLang prim_func of the FP8 tensor-core partial: V^T by `transpose_values_macro`, the query and P by
    `two_part_rounding`; `reduce_batch` as in decode_partial_program; `ctas_per_sm`: CTAs an SM holds at once
    (`macros.share_sm_registers_macro`)."""
    require_tilelang()
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    hkv, d, group = geom.num_kv_heads, geom.head_dim, geom.group_size
    width = d + geom.rotary_width
    threads = 128  # one consumer warpgroup
    if page_size % block_n or d % FP8_PANEL or width % FP8_PANEL or block_h < group:
        raise ValueError(f"the FP8 tensor-core partial is written for {FP8_PANEL}-column panels, pages of whole tiles"
                         f" and block_h >= the {group} query heads of a KV head")
    batch, num_pages, max_pages, num_chunks = T.dynamic("batch, num_pages, max_pages, num_chunks")
    bf16, f32, e4m3 = "bfloat16", "float32", "float8_e4m3"
    panels, score_panels = width // FP8_PANEL, d // FP8_PANEL  # 5 and 4: scores row[0:D], values row[R:D+R]
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    share_sm_registers = macros.share_sm_registers_macro(ctas_per_sm, threads) if ctas_per_sm > 1 else None
    transpose_values = transpose_values_macro(block_n, threads)
    rounding = two_part_rounding(geom, block_n, block_h)
    cols = rounding.cols

    @T.macro
    def partial(query, pool, scales, page_ids, chunk_req, chunk_start, chunk_len, part_o, part_lse):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            T.import_source(producer_guard.imported_source(DEVICE_SOURCE))
            if ctas_per_sm > 1:
                share_sm_registers()
            q_s = T.alloc_shared((block_h, d), bf16)  # rows >= 8: the next KV head's (read, not used)
            q8 = [IRBuilder.name(f"q8_{p}", T.alloc_shared((block_h, FP8_PANEL), e4m3)) for p in range(score_panels)]
            stored = [IRBuilder.name(f"stored_{p}", T.alloc_shared((block_n, FP8_PANEL), e4m3))
                      for p in range(panels)]
            scale_s = T.alloc_shared((block_n,), f32)  # [N] the tokens' scales
            v_t = T.alloc_shared((d, block_n), e4m3)  # V^T [512, N], K-major
            p8 = T.alloc_shared((block_h, block_n), e4m3)  # P^T [16, N], K-major (tokens contiguous)
            q_part = T.alloc_shared((block_h, 16), f32)  # per head, 16 partial maxima of |q|
            q_gain = T.alloc_shared((block_h,), f32)  # per head, the query's gain before e4m3
            q_inv = T.alloc_shared((block_h,), f32)  # per head, its inverse
            acc_s = T.alloc_fragment((block_n, block_h), f32)  # S^T [N, 16] as the gemm leaves it
            acc_o_tile = T.alloc_fragment((d, block_h), f32)  # this tile's O^T [D, 16]
            s_lo = T.alloc_fragment((block_n, group), f32)
            scores = T.alloc_fragment((block_n, cols), f32)  # the scores, then the probabilities
            o_lo = T.alloc_fragment((d, group), f32)
            acc_o = T.alloc_fragment((d, cols), f32)  # the running O^T
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
            rounding.query(q_s, q8, q_part, q_gain, q_inv, amax)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(head_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                page, off = macros.tile_page(page_ids, req, start + k * block_n, page_size)
                for sp in [(t, n * FP8_PANEL) for n, t in enumerate(stored)]:
                    T.copy(pool[page, kvh, off:off + block_n, sp[1]:sp[1] + FP8_PANEL], sp[0])
                T.copy(scales[page, kvh, off:off + block_n], scale_s)
                transpose_values(stored[panels - score_panels:], v_t, lambda: n_tok - k * block_n)
                T.clear(acc_s)
                for pair in list(zip(stored, q8)):
                    T.gemm(pair[0], pair[1], acc_s, transpose_B=True)  # S^T [N, 16] += K8 Q8^T (FP8 wgmma)
                rounding.scores(acc_s, s_lo, scores, scale_s, q_inv, tile_gain, tile_inv, n_tok - k * block_n)
                mask_scores(scores, lambda i, j: k * block_n + i < n_tok)  # tokens past the chunk: probability 0
                # P.V over scaled rows: the scale (times the tile's gain) goes on P's column (past the chunk: 0)
                online_softmax(scores, None, head_max, head_max_prev, rescale, head_sum, denom,
                               lambda i: T.if_then_else(k * block_n + i < n_tok, scale_s[i] * tile_gain[0], 0.0))
                rounding.p_store(scores, p8)
                T.gemm(v_t, p8, acc_o_tile, transpose_B=True, clear_accum=True)  # O^T tile = V^T P^T (FP8 wgmma)
                rounding.accumulate(acc_o, acc_o_tile, o_lo, rescale, tile_inv)

            for i, j in T.Parallel(d, cols):
                if j < group:
                    part_o[c, kvh * group + j, i] = acc_o[i, j] / denom[j]
            for j in T.Parallel(cols):
                if j < group:
                    part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * macros.LOG2E

    ctx = TailContext(geom, threads, batch, num_chunks)
    args = {**partial_inputs(ctx, num_pages, max_pages, page_size, width, fp8=True), **partial_args(ctx)}
    return prim_func("decode_partial", args, lambda b: partial(*(b[n] for n in args))).with_attr(
        "global_symbol", NAME)


@hands_out("decode_partial_{fmt}_fp8_tc")
def build(geom: AttentionGeometry, fmt: KvFormat | str = KvFormat.FOLDED, **tiling):
    """Compile (JIT) the FP8 tensor-core partial with its registered params, overridden by `tiling` (options other
    than `SERVED` are refused) and check the transpose's barriers on its emitted CUDA."""
    if KvFormat.parse(fmt) is not KvFormat.FOLDED:
        raise ValueError("FP8 rows are folded only (foldkv.pool.PagedKvLayout refuses an FP8 split pool)")
    cfg = {**registry.get(NAME).params, **tiling}
    options = {k: cfg.pop(k) for k in SERVED}
    if options != SERVED:
        raise ValueError(f"{NAME} is built with {SERVED} only; {options} is a probe's (bench/versions/"
                         "decode_partial_fp8_mma.py)")

    kernel = compile_program(decode_partial_fp8_tc_program(geom, **cfg))
    check_e4m3_conversion(NAME, kernel.get_kernel_source(), TRANSPOSE_BARRIER_ID, calls=(TRANSPOSE_FN,))
    return kernel
