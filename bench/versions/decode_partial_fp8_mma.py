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
In the library since run 17b as `decode_partial_folded_fp8_tc` (lib/foldkv/kernels/decode_partial_fp8_tc.py,
`fp8_math="tensor_cores"`, the FP8 pool's default decode partial since run 17's outcome): that served configuration
(t4x16, precise) is the library's kernel, built there without hook points; this file holds that program with its
hook points (`TcHooks`, `hooked_program`: what the probe and the versions built on it, decode_partial_fp8_tc_vrot.py
and decode_partial_fp8_tc_t32.py, plug into) and builds the probe's other options through them: transpose "none" /
"t16x4", one e4m3 part (precise=False: the red twin of the GPU tests), panel_acc.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from dataclasses import dataclass
from typing import Callable

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros, producer_guard
from foldkv.kernels.decode_partial import FP8_PANEL
from foldkv.kernels.decode_partial_fp8_tc import (DEVICE_SOURCE, NAME, TRANSPOSE_BARRIER_ID, Rounding,
                                                  transpose_values_macro, two_part_rounding)
from foldkv.kernels.tl import pass_configs, prim_func, require_tilelang, target


# P x scale is at most the tile's largest token scale (amax / 448 of a row: ~0.007-0.06 for RMS-normalised rows with
# outlier channels), deep in e4m3's subnormals; times 2^12 it spans e4m3's normal range. A probe's constant: a real
# kernel would take the factor from the tile's largest scale.
P_GAIN = 4096.0
# The query times 2^6 before its rounding to e4m3 (the harness's folded queries have elements of ~0.01-1): a probe's
# constant where a real kernel would scale each head by its largest element.
Q_GAIN = 64.0
TRANSPOSE_FN = "foldkv_e4m3_t16x4"
# the library partial's device code (the 4 x 4 byte transpose, the 4 x 16 block transpose, the tile's largest scale)
# and run 12's 16 x 4 block transpose
TRANSPOSE_SOURCE = DEVICE_SOURCE + r"""
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


def transpose_v_macro(block_n: int, threads: int, kind: str = "t16x4"):
    """The value window's panels (stored [block_n, 128] e4m3 each) into V^T [4 x 128, block_n], the K-major operand
    FP8 wgmma needs. "t16x4": each thread one 16-token x 4-column block of every panel (T.Parallel(4, 32): a warp
    reads 128 contiguous bytes of one token row; its stores conflict 4-way; run 12: no zeroing of the tokens past the
    chunk, probe pools have no NaN slots); "t4x16": the library's (`transpose_values_macro`, conflict-free)."""
    import tilelang.language as T

    assert kind in ("t16x4", "t4x16")
    if kind == "t4x16":
        return transpose_values_macro(block_n, threads)
    tok_blocks, col_blocks = block_n // 16, FP8_PANEL // 4
    assert tok_blocks * col_blocks == threads

    @T.macro
    def transpose_panel(panels, n, v_t, d0, first, last):
        for i, j in T.Parallel(tok_blocks, col_blocks):
            T.call_extern("handle", TRANSPOSE_FN, int(first), int(last), TRANSPOSE_BARRIER_ID, threads,
                          *[T.address_of(panels[n][i * 16 + r, j * 4]) for r in range(16)],
                          *[T.address_of(v_t[d0 + j * 4 + q, i * 16]) for q in range(4)])

    @T.macro
    def transpose_v(panels, v_t, tokens_left):
        for n in list(range(len(panels))):  # (range itself would be a device loop)
            transpose_panel(panels, n, v_t, n * FP8_PANEL, n == 0, n == len(panels) - 1)

    return transpose_v


def one_part_rounding(geom: AttentionGeometry, block_n: int, block_h: int) -> Rounding:
    """precise=False: the query (times Q_GAIN) and P (times P_GAIN) as one e4m3 part each, all 16 rows of wgmma's N
    the queries of the CTA's rows (8-15 the next KV head's, never stored): ~20x the library's error (run 16b)."""
    import tilelang.language as T

    d = geom.head_dim

    @T.macro
    def query(q_s, q8, q_part, q_gain, q_inv, amax):
        for qp in [(t, n * FP8_PANEL) for n, t in enumerate(q8)]:
            for i, j in T.Parallel(block_h, FP8_PANEL):
                qp[0][i, j] = T.cast(q_s[i, qp[1] + j] * Q_GAIN, "float8_e4m3")

    @T.macro
    def scores(acc_s, s_lo, out, scale_s, q_inv, tile_gain, tile_inv, valid):
        for i, j in T.Parallel(block_n, block_h):
            out[i, j] = acc_s[i, j] * scale_s[i] * (1.0 / Q_GAIN)
        tile_gain[0] = P_GAIN
        tile_inv[0] = 1.0 / P_GAIN

    @T.macro
    def p_store(probs, p8):
        for i, j in T.Parallel(block_n, block_h):
            p8[j, i] = T.cast(probs[i, j], "float8_e4m3")

    @T.macro
    def accumulate(acc_o, acc_o_tile, o_lo, rescale, tile_inv):
        for i, j in T.Parallel(d, block_h):
            acc_o[i, j] = acc_o[i, j] * rescale[j] + acc_o_tile[i, j] * tile_inv[0]

    return Rounding(cols=block_h, query=query, scores=scores, p_store=p_store, accumulate=accumulate)


def panel_score_gemm(block_n: int, block_h: int):
    """panel_acc: each score panel's 4 k32 steps into a fresh accumulator, the panels added in float32 (run 16b)."""
    import tilelang.language as T

    @T.macro
    def score_gemm(stored, q8, acc_s, acc_p):
        for pair in list(zip(stored, q8)):
            T.gemm(pair[0], pair[1], acc_p, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(block_n, block_h):
                acc_s[i, j] += acc_p[i, j]

    return score_gemm


@dataclass(frozen=True)
class TcHooks:
    """The hook points of `hooked_program` (defaults: the served kernel):
        source      the device code the kernel imports
        transpose   (block_n, threads) -> T.macro(panels, v_t, tokens_left) writing V^T; None leaves V^T unwritten
                    (a timing probe's: wrong output)
        rounding    (geom, block_n, block_h) -> Rounding
        score_gemm  None: the score window's four panels into one accumulator (16 k32 steps); else
                    (block_n, block_h) -> T.macro(stored, q8, acc_s, acc_p) (acc_p: a second [N, 16] float32
                    fragment, allocated only then)
        symbol      the kernel's global symbol"""
    source: str = DEVICE_SOURCE
    transpose: Callable | None = transpose_values_macro
    rounding: Callable = two_part_rounding
    score_gemm: Callable | None = None
    symbol: str = NAME


def hooked_program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64,
                   num_stages: int = 1, block_h: int = 16, reduce_batch: int = 4, ctas_per_sm: int = 2,
                   hooks: TcHooks = TcHooks()):
    """The library's FP8 tensor-core program (`decode_partial_fp8_tc.decode_partial_fp8_tc_program`, which builds
    only the served configuration) with its rounding, transpose and score gemm from `hooks`; `reduce_batch`: the softmax's queries per cross-warp reduction
    (macros.online_softmax_macro); `ctas_per_sm`: CTAs each SM holds at once (macros.share_sm_registers_macro)."""
    require_tilelang()
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    width = d + geom.rotary_width
    threads = 128  # one consumer warpgroup
    if page_size % block_n or d % FP8_PANEL or width % FP8_PANEL or block_h < group:
        raise ValueError(f"the FP8 tensor-core partial is written for {FP8_PANEL}-column panels, pages of whole tiles"
                         f" and block_h >= the {group} query heads of a KV head")
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32, e4m3 = "bfloat16", "float32", "int32", "float8_e4m3"
    panels, score_panels = width // FP8_PANEL, d // FP8_PANEL  # 5 and 4: scores row[0:D], values row[R:D+R]
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    share_sm_registers = macros.share_sm_registers_macro(ctas_per_sm, threads) if ctas_per_sm > 1 else None
    transpose_values = hooks.transpose(block_n, threads) if hooks.transpose is not None else None
    rounding = hooks.rounding(geom, block_n, block_h)
    score_gemm = hooks.score_gemm(block_n, block_h) if hooks.score_gemm is not None else None
    cols = rounding.cols

    @T.macro
    def partial(query, pool, scales, page_ids, chunk_req, chunk_start, chunk_len, part_o, part_lse):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            T.import_source(producer_guard.imported_source(hooks.source))
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
            acc_p = None
            if score_gemm is not None:  # a second score accumulator (a probe's score gemm)
                acc_p = T.alloc_fragment((block_n, block_h), f32)
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
                if transpose_values is not None:
                    transpose_values(stored[panels - score_panels:], v_t, lambda: n_tok - k * block_n)
                T.clear(acc_s)
                if score_gemm is not None:
                    score_gemm(stored, q8, acc_s, acc_p)
                else:
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

    # the arguments (what a backend's callable takes, in order): the module docstring's
    args = {
        "query": T.Tensor((batch, hq, d), bf16),  # [B, Hq, D] query in the folded form
        "pool": T.Tensor((num_pages, hkv, page_size, width), e4m3),  # [P, Hkv, page, W] e4m3
        "scales": T.Tensor((num_pages, hkv, page_size), f32),  # [P, Hkv, page] one scale per token x KV head
        "page_ids": T.Tensor((batch, max_pages), i32),  # [B, MP]
        "chunk_req": T.Tensor((num_chunks,), i32),  # [C] request of chunk c
        "chunk_start": T.Tensor((num_chunks,), i32),  # [C] first token (multiple of page_size)
        "chunk_len": T.Tensor((num_chunks,), i32),  # [C] tokens in the chunk (>= 1)
        "part_o": T.Tensor((num_chunks, hq, d), f32),  # [C, Hq, D] value-window order
        "part_lse": T.Tensor((num_chunks, hq), f32),  # [C, Hq] base 2
    }
    return prim_func("decode_partial", args, lambda b: partial(*(b[n] for n in args))).with_attr(
        "global_symbol", hooks.symbol)


def hooks(transpose: str = "none", precise: bool = False, panel_acc: bool = False) -> TcHooks:
    """The library program's hook points for the probe's options."""
    assert transpose in ("none", "t16x4", "t4x16")
    return TcHooks(source=TRANSPOSE_SOURCE,
                   transpose=None if transpose == "none" else (
                       lambda block_n, threads: transpose_v_macro(block_n, threads, transpose)),
                   rounding=two_part_rounding if precise else one_part_rounding,
                   score_gemm=panel_score_gemm if panel_acc else None,
                   symbol="decode_partial_folded_fp8_mma_probe")


def program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64, num_stages: int = 2,
            block_h: int = 16, reduce_batch: int = 4, ctas_per_sm: int = 1, transpose: str = "none",
            precise: bool = False, panel_acc: bool = False):
    """The probe's prim_func, the library FP8 partial's argument list (a drop-in for decode_partial_folded_fp8): the
    library's tensor-core program with `hooks(transpose, precise, panel_acc)`."""
    return hooked_program(geom, page_size=page_size, block_n=block_n, num_stages=num_stages, block_h=block_h,
                          reduce_batch=reduce_batch, ctas_per_sm=ctas_per_sm, hooks=hooks(transpose, precise, panel_acc))


def build(geom: AttentionGeometry, **tiling):
    """Compile the probe (JIT); a drop-in for `kernels={"decode_partial_folded_fp8": ...}` with
    `fp8_math="exact"` (the name it stands in for is the exact partial's), or for
    `kernels={"decode_partial_folded_fp8_tc": ...}` by default."""
    tilelang = require_tilelang()

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def probe(page_size, block_n, num_stages, block_h, reduce_batch, ctas_per_sm, transpose, precise, panel_acc):
        return program(geom, page_size=page_size, block_n=block_n, num_stages=num_stages, block_h=block_h,
                       reduce_batch=reduce_batch, ctas_per_sm=ctas_per_sm, transpose=transpose, precise=precise,
                       panel_acc=panel_acc)

    cfg = {**dict(page_size=64, block_n=64, num_stages=2, block_h=16, reduce_batch=4, ctas_per_sm=1,
                  transpose="none", precise=False, panel_acc=False), **tiling}
    return probe(**cfg)
