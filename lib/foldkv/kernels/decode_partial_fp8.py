"""The FP8 folded decode partial: one CTA = one chunk of one request's pages x one KV head, over an FP8 pool, both
gemms on Hopper's FP8 tensor cores (no e4m3 -> bf16 conversion).

An FP8 pool's row is 640 e4m3 bytes plus one float32 scale per token and KV head (`foldkv.fp8`); the score window is
row[0:D] and the value window row[R:D+R], as in the bf16 folded partial (decode_partial.py). Per 64-token tile:
    S^T [64, 16] = K8 Q8^T        the four e4m3 panels of the score window as TMA wrote them (FP8 wgmma: k32 steps)
    S *= scale_token / q_scale    the row's scale and the query's, in float32; then the float32 online softmax
    O^T [512, 16] = V8^T P8^T     V^T transposed by the consumer from the four value-window panels, P^T in e4m3
FP8 wgmma reads both operands K-major. The stored row is K-major for the scores (a token's 640 bytes contiguous) but
not for the values (V^T's K is the token), so the consumer transposes the value window each tile
(`transpose_values_macro`, 4-token x 16-column blocks per thread, conflict-free on both sides) behind its own named
barrier, as the e4m3 conversion does (`cuda_checks.check_opaque_shared_writes`).
Precision (bench/FP8_NOTES.md, runs 12-14). The query and P each go to the tensor cores as two e4m3 parts,
x = hi + lo / 16 (lo = e4m3(16 (x - hi))): |x - hi - lo / 16| <= 2^-8 |x| + 2^-14, about bf16's precision. The two
parts share one gemm: wgmma's N is 16 and the KV head has 8 query heads, so rows 0-7 carry the hi parts and rows 8-15
(which the bf16 partial fills with the next KV head's queries, never stored) the lo parts; the gemm's columns j and
j + 8 are added in float32. The query is scaled per head to e4m3's largest value (448 / max |q|, once per CTA), P x
scale per tile (256 / the tile's largest valid token scale: P <= 1, so P x scale x gain <= 256). Each tile's value gemm
goes into a fresh accumulator, added into the running O in float32: FP8 wgmma accumulates in reduced precision, so it
never sums across tiles (the two-level accumulation issue 15 names).
Schedule: two CTAs per SM (`ctas_per_sm`, one stage of 40 KB e4m3 tiles each: ~99 KB of shared memory a CTA), so the
plan's wave is 2 x SMs (`plan.partial_slots`): one CTA's chain (the transpose, two gemms, the softmax) overlaps the
other's. The bf16 partial's structure otherwise: the producer warpgroup's TMA loads, one consumer warpgroup, the
softmax's batched reductions, the normalised partial and base-2 LSE to the chunk's slot.

Kernel argument order: that of decode_partial.py's FP8 partial (a drop-in for "decode_partial_folded_fp8"):
    (query [B, Hq, D] bf16, pool [P, Hkv, page, W] e4m3, scales [P, Hkv, page] f32, page_ids [B, MP] i32,
     chunk_req [C] i32, chunk_start [C] i32, chunk_len [C] i32, part_o [C, Hq, D] f32, part_lse [C, Hq] f32)
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which use closure values

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat
from . import macros, registry
from .decode_partial import FP8_PANEL
from .registry import hands_out
from .tl import pass_configs, require_tilelang, target

DEFAULTS = dict(registry.get("decode_partial_folded_fp8").params)  # registry.py says why these
TRANSPOSE_FN = "foldkv_e4m3_t4x16"
MAX_SCALE_FN = "foldkv_max_scale64"
# The transpose's named barrier: the e4m3 conversion's id (no TileLang barrier uses it; checked on the emitted CUDA)
TRANSPOSE_BARRIER_ID = macros.CONVERT_BARRIER_ID
TWO_PART_LO = 16.0  # the lo part is stored times 16: e4m3 keeps 3 fraction bits, so |x - hi| <= 2^-4 |x|
P_RANGE = 256.0  # P x scale x gain <= 256 < 448, e4m3's largest

DEVICE_SOURCE = r"""
// (inserted before the kernel's includes: plain CUDA types and PTX only)
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
// A 4-token x 16-column block of an e4m3 panel (src[r]: the 16 bytes of token r) into V^T (dst[n]: 4 bytes, the 4
// tokens of column n ^ m): 4 sixteen-byte loads, 32 byte permutes, 16 four-byte stores. Store n goes to column n ^ m
// (m = the thread's column block mod 8), so the eight column blocks of a warp store to eight different (row parity,
// 16-byte chunk) slots of V^T's 64-byte swizzle and a warp's 32 stores hit 32 banks; a three-level select network on
// m's bits puts the data in that order. The call is opaque to TileLang, which therefore places no barrier for the
// tile it writes: `first` waits on the named barrier before writing (the previous tile's value gemm reads V^T),
// `last` fences to the async proxy and waits again (the next gemm reads it), as the e4m3 conversion does.
__device__ __forceinline__ void foldkv_e4m3_t4x16(int first, int last, int barrier_id, int threads, int m,
    const void* s0, const void* s1, const void* s2, const void* s3, void* d0, void* d1, void* d2, void* d3, void* d4,
    void* d5, void* d6, void* d7, void* d8, void* d9, void* d10, void* d11, void* d12, void* d13, void* d14,
    void* d15) {
  const uint4 r0 = *reinterpret_cast<const uint4*>(s0), r1 = *reinterpret_cast<const uint4*>(s1);
  const uint4 r2 = *reinterpret_cast<const uint4*>(s2), r3 = *reinterpret_cast<const uint4*>(s3);
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
// loads and five shuffles (a 64-step loop over shared memory is a chain of dependent loads: ~1 us a tile).
__device__ __forceinline__ float foldkv_max_scale64(const float* scale, int valid) {
  const int lane = threadIdx.x & 31;
  float m = fmaxf(lane < valid ? scale[lane] : 0.0f, lane + 32 < valid ? scale[lane + 32] : 0.0f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return fmaxf(m, 1e-30f);
}
"""


def transpose_values_macro(block_n: int, threads: int):
    """The value window's e4m3 panels (four [block_n, 128] shared tiles, in column order) into V^T [512, block_n],
    the K-major operand FP8 wgmma needs, by `threads` consumer threads: each one 4-token x 16-column block of every
    panel (T.Parallel(block_n / 4, 8): a quarter-warp reads one token row's 128 bytes); the first and the last panel's
    calls carry the barriers (DEVICE_SOURCE)."""
    import tilelang.language as T

    tok_blocks, col_blocks = block_n // 4, FP8_PANEL // 16
    assert tok_blocks * col_blocks == threads

    @T.macro
    def transpose_panel(stored, v_t, d0, first, last):
        for i, j in T.Parallel(tok_blocks, col_blocks):
            T.call_extern("handle", TRANSPOSE_FN, int(first), int(last), TRANSPOSE_BARRIER_ID, threads, j % 8,
                          *[T.address_of(stored[i * 4 + r, j * 16]) for r in range(4)],
                          *[T.address_of(v_t[d0 + j * 16 + T.bitwise_xor(n, j % 8), i * 4]) for n in range(16)])

    @T.macro
    def transpose_values(panels, v_t):
        for n, stored in enumerate(panels):
            transpose_panel(stored, v_t, n * FP8_PANEL, n == 0, n == len(panels) - 1)

    return transpose_values


def two_part_macro():
    """x as two e4m3 parts: `hi(x)` = e4m3(x), `lo(x)` = e4m3(16 (x - hi)); expression builders of a float32 x."""
    import tilelang.language as T

    def hi(x):
        return T.cast(x, "float8_e4m3")

    def lo(x):
        return T.cast((x - T.cast(T.cast(x, "float8_e4m3"), "float32")) * TWO_PART_LO, "float8_e4m3")

    return hi, lo


def decode_partial_fp8_program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64,
                               num_stages: int = 1, reduce_batch: int = 4, ctas_per_sm: int = 2):
    """The TileLang prim_func of the FP8 partial for one geometry and tiling (module docstring); `reduce_batch`: the
    softmax's queries per cross-warp reduction (macros.online_softmax_macro); `ctas_per_sm`: CTAs each SM holds at
    once (`__launch_bounds__`' second argument; the warpgroups' registers set to share 65,536 that many ways)."""
    require_tilelang()
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    width = d + geom.rotary_width
    threads, block_h = 128, 2 * group  # one consumer warpgroup; wgmma N = 16: the hi and the lo rows
    if block_h != 16 or page_size % block_n or d % FP8_PANEL or width % FP8_PANEL:
        raise ValueError(f"the FP8 partial is written for 8 query heads per KV head and {FP8_PANEL}-column panels")
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    f32, e4m3 = "float32", "float8_e4m3"
    panels, score_panels = width // FP8_PANEL, d // FP8_PANEL  # 5 and 4: scores row[0:D], values row[R:D+R]
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    transpose_values = transpose_values_macro(block_n, threads)
    hi, lo = two_part_macro()
    unlo = 1.0 / TWO_PART_LO
    q_chunk = d // 16  # query elements each of 16 threads scans per head for its largest |q|

    @T.prim_func
    def decode_partial(
        query: T.Tensor((batch, hq, d), "bfloat16"),  # [B, Hq, D] query in the folded form
        pool: T.Tensor((num_pages, hkv, page_size, width), e4m3),  # [P, Hkv, page, W] e4m3
        scales: T.Tensor((num_pages, hkv, page_size), f32),  # [P, Hkv, page] one scale per token x KV head
        page_ids: T.Tensor((batch, max_pages), "int32"),  # [B, MP]
        chunk_req: T.Tensor((num_chunks,), "int32"),  # [C] request of chunk c
        chunk_start: T.Tensor((num_chunks,), "int32"),  # [C] first token (multiple of page_size)
        chunk_len: T.Tensor((num_chunks,), "int32"),  # [C] tokens in the chunk (>= 1)
        part_o: T.Tensor((num_chunks, hq, d), f32),  # [C, Hq, D] value-window order
        part_lse: T.Tensor((num_chunks, hq), f32),  # [C, Hq] base 2
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            T.import_source(DEVICE_SOURCE)
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                # per CTA 65,536 / ctas_per_sm registers: the producer warpgroup keeps 24, the consumer the rest
                per_thread = 65536 // ctas_per_sm // (threads + 128)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(min((per_thread * (threads + 128) - 24 * 128) // threads // 8 * 8, 240))
            q_s = T.alloc_shared((block_h, d), "bfloat16")  # rows >= 8: the next KV head's (read, not used)
            q8 = [IRBuilder.name(f"q8_{p}", T.alloc_shared((block_h, FP8_PANEL), e4m3)) for p in range(score_panels)]
            stored = [IRBuilder.name(f"stored_{p}", T.alloc_shared((block_n, FP8_PANEL), e4m3))
                      for p in range(panels)]
            scale_s = T.alloc_shared((block_n,), f32)  # [N] the tokens' scales
            v_t = T.alloc_shared((d, block_n), e4m3)  # V^T [512, N], K-major, written by transpose_values
            p8 = T.alloc_shared((block_h, block_n), e4m3)  # P^T [16, N]: rows 0-7 hi, 8-15 lo
            q_part = T.alloc_shared((block_h, 16), f32)  # per head, 16 partial maxima of |q|
            q_gain = T.alloc_shared((block_h,), f32)  # per head, 448 / max |q|
            q_inv = T.alloc_shared((block_h,), f32)  # per head, max |q| / 448
            acc_s = T.alloc_fragment((block_n, block_h), f32)  # S^T [N, 16]: columns 0-7 hi, 8-15 lo
            acc_o_tile = T.alloc_fragment((d, block_h), f32)  # this tile's O^T [D, 16]: columns 0-7 hi, 8-15 lo
            # the lo columns brought to 0-7 (a parallel loop indexes a fragment one way only), the summed scores and
            # P, the running output and the softmax state: over the 8 heads
            s_lo = T.alloc_fragment((block_n, group), f32)
            scores = T.alloc_fragment((block_n, group), f32)
            o_lo = T.alloc_fragment((d, group), f32)
            acc_o = T.alloc_fragment((d, group), f32)
            head_max = T.alloc_fragment((group,), f32)
            head_max_prev = T.alloc_fragment((group,), f32)
            rescale = T.alloc_fragment((group,), f32)
            head_sum = T.alloc_fragment((group,), f32)
            denom = T.alloc_fragment((group,), f32)
            amax = T.alloc_local((1,), f32)
            tile_gain = T.alloc_local((1,), f32)
            tile_inv = T.alloc_local((1,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            T.copy(query[req, kvh * group:kvh * group + block_h, 0:d], q_s)
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
                    qp[0][i, j] = T.if_then_else(
                        i < group, hi(T.cast(q_s[i % group, qp[1] + j], f32) * q_gain[i % group]),
                        lo(T.cast(q_s[i % group, qp[1] + j], f32) * q_gain[i % group]))
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
                transpose_values(stored[panels - score_panels:], v_t)
                T.clear(acc_s)
                for pair in list(zip(stored, q8)):
                    T.gemm(pair[0], pair[1], acc_s, transpose_B=True)  # S^T [N, 16] += K8 Q8^T
                for i, j in T.Parallel(block_n, group):
                    s_lo[i, j] = acc_s[i, j + group]
                for i, j in T.Parallel(block_n, group):  # a token's row is its e4m3 values times its scale
                    scores[i, j] = (acc_s[i, j] + s_lo[i, j] * unlo) * scale_s[i] * q_inv[j]
                tile_inv[0] = T.call_extern(f32, MAX_SCALE_FN, T.address_of(scale_s[0]), n_tok - k * block_n) * (
                    1.0 / P_RANGE)
                tile_gain[0] = 1.0 / tile_inv[0]
                mask_scores(scores, lambda i, j: k * block_n + i < n_tok)  # tokens past the chunk: probability 0
                # P.V over scaled rows: the scale (times the tile's gain) goes on P's column (past the chunk: 0)
                online_softmax(scores, None, head_max, head_max_prev, rescale, head_sum, denom,
                               lambda i: T.if_then_else(k * block_n + i < n_tok, scale_s[i] * tile_gain[0], 0.0))
                for i, j in T.Parallel(block_n, group):
                    p8[j, i] = hi(scores[i, j])
                for i, j in T.Parallel(block_n, group):
                    p8[j + group, i] = lo(scores[i, j])
                T.gemm(v_t, p8, acc_o_tile, transpose_B=True, clear_accum=True)  # O^T tile = V^T P^T
                for i, j in T.Parallel(d, group):
                    o_lo[i, j] = acc_o_tile[i, j + group]
                for i, j in T.Parallel(d, group):  # float32: the second level of the accumulation
                    acc_o[i, j] = acc_o[i, j] * rescale[j] + (acc_o_tile[i, j] + o_lo[i, j] * unlo) * tile_inv[0]

            for i, j in T.Parallel(d, group):
                part_o[c, kvh * group + j, i] = acc_o[i, j] / denom[j]
            for j in T.Parallel(group):
                part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * macros.LOG2E

    return decode_partial.with_attr("global_symbol", "decode_partial_folded_fp8")


@hands_out("decode_partial_{fmt}_fp8")
def build(geom: AttentionGeometry, fmt: KvFormat | str = KvFormat.FOLDED, **tiling):
    """Compile (JIT) the FP8 partial with its registered params, overridden by `tiling`; its emitted CUDA is checked
    for the transpose's barriers (`cuda_checks.check_opaque_shared_writes`) before it is handed out."""
    tilelang = require_tilelang()
    if KvFormat.parse(fmt) is not KvFormat.FOLDED:
        raise ValueError("FP8 rows are folded only (foldkv.pool.PagedKvLayout refuses an FP8 split pool)")
    cfg = {**DEFAULTS, **tiling}

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def decode_partial_fp8(page_size, block_n, num_stages, reduce_batch, ctas_per_sm):
        return decode_partial_fp8_program(geom, page_size=page_size, block_n=block_n, num_stages=num_stages,
                                          reduce_batch=reduce_batch, ctas_per_sm=ctas_per_sm)

    kernel = decode_partial_fp8(**cfg)
    from .cuda_checks import check_opaque_shared_writes

    check_opaque_shared_writes("decode_partial_folded_fp8", kernel.get_kernel_source(), TRANSPOSE_BARRIER_ID,
                               calls=(TRANSPOSE_FN,))
    return kernel


def main(seq_len: int = 163336, **tiling):
    """Build with the registered params (or `tiling`); on a GPU, check one whole-sequence decode over an FP8 pool of
    random rows against the float64 reference over its dequantized rows, and time the partial kernel alone."""
    import torch

    import foldkv
    from ..fp8 import FP8_DTYPE, quantize_rows
    from .decode import decode
    from .plan import plan_decode

    geom = GEMMA4_31B
    kernel = build(geom, **tiling)
    print(f"decode_partial_folded_fp8 {dict(DEFAULTS, **tiling)}: {len(kernel.get_kernel_source())} chars of CUDA")
    if not torch.cuda.is_available():
        print("no CUDA device: built, not checked or timed")
        return kernel
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    layout = foldkv.PagedKvLayout(geom, KvFormat.FOLDED, 64, -(-seq_len // 64), dtype=FP8_DTYPE)
    pool = foldkv.PagedKvPool(layout, device=dev)
    codes, scales = quantize_rows(torch.randn(pool.data.shape, generator=gen, device=dev))
    pool.data.copy_(codes)
    pool.scales.copy_(scales)
    table = pool.allocate([seq_len]).to(dev)
    query = (torch.randn(1, geom.num_q_heads, geom.head_dim, generator=gen, device=dev) * 0.05).to(torch.bfloat16)
    plan = plan_decode(layout, [seq_len], device=dev)
    out, lse = decode(pool, query, table, plan=plan, kernels={"decode_partial_folded_fp8": kernel})
    want, want_lse = foldkv.paged_attention_reference(pool, query, table)
    err = float((out.double() - want).norm() / want.norm())
    print(f"relative error {err:.2e}, max LSE error {float((lse.double() - want_lse).abs().max()):.2e} (natural log)")
    from tilelang.profiler import do_bench  # TileLang's timer, in ms

    run = lambda: kernel(query, pool.data, pool.scales, table.page_ids, plan.chunk_req, plan.chunk_start,  # noqa: E731
                         plan.chunk_len, plan.part_o, plan.part_lse)
    print(f"{do_bench(run) * 1e3:.1f} us per partial ({seq_len} tokens, {len(plan.chunks)} chunks)")
    return kernel


if __name__ == "__main__":
    main()
