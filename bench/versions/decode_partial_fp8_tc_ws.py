"""The FP8 tensor-core partial with the transpose of V on its own warpgroup (run 20): a `T.WSSchedule`.

Lab notebook (bench/FP8_NOTES.md, "Run 20: prediction"). Question: run 19 priced the served FP8 tensor-core partial
(`decode_partial_folded_fp8_tc`: 64-token tile, one stage, two CTAs an SM) at 1.68 us a 64-token tile in L2 and ruled
out shorter tiles (~1 us fixed a tile); 0.55x the bf16 folded decode needs <= ~1.30 us, and the one measured part of
that size on the consumer's chain is the transpose of V (~0.40 us, run 14). Does taking it off the consumer reach it?

What it is: the library's rounding (`two_part_rounding`), softmax, masking and device code (`DEVICE_SOURCE`: the 4 x 4
byte transpose `foldkv_t4x4`, the tile's largest scale) in a kernel whose warp specialisation is written out as a
TileLang `T.WSSchedule` (0.1.15's explicit schedule, materialized by its `MaterializeWSSchedule` pass) instead of the
automatic split, which puts only TMA copies in the producer. Two roles, one warpgroup each:
  - transposer (warps 0-3): acquires the stage (pipeline `kv`: the four score panels and the tile's scales, one
    version), issues its TMA copies, commits; loads the tile's value window (row[128:640]) straight from global
    memory into registers, 4 sixteen-byte loads of a 4-token x 16-column block a panel (`foldkv_vt_load`; tokens past
    the chunk read as 0: their slots may hold NaN codes); acquires V^T (pipeline `vt`, one version), writes the block
    transposed, conflict-free as the served kernel's `foldkv_e4m3_t4x16` does (same column order and select network,
    `foldkv_vt_store`), fences to the async proxy, commits;
  - consumer (warps 4-7): the served chain less the transpose: waits for `kv`, score gemm (e4m3 wgmma), two-part
    scores, mask, softmax, P^T; waits for `vt`, then releases `kv` (after the wait: no transposer warp can then still
    be in the stage's acquire of this tile when the next phase completes, the parity hazard producer_guard.py
    describes), value gemm, releases `vt`, accumulates O in float32.
Why the value window comes from global memory and not from the stage: a WSPipeline joins exactly two roles and a role
cannot wait on its own TMA, so a transposer reading the stage needs a third role (a third warpgroup: 384 threads, ~85
registers a thread at two CTAs an SM) or the value panels loaded twice into shared memory (+32 KB: one CTA an SM).
DRAM bytes do not grow (panels 1-3 of the value window are the score window's: the first of the two reads brings them
into L2 for the other; panel 4 is read once); L2 -> SM bytes are 1,024 a token-row instead of 640.
Why one V^T buffer: V^T(k) is written while the consumer runs accumulate(k-1), the score gemm, scores and softmax of k
(~0.7-0.8 us of run 19's f + g), over the transpose's ~0.4 us; the loads of tile k are issued before the acquire of
V^T, so their latency hides in the same window.
Why not through the library program's hook points (`TcHooks`): a WSSchedule needs a stable id on every statement of
the kernel (`T.ws_op` / `annotations={T.WSID: ...}`), a plain serial loop in place of `T.Pipelined`, the score panels
without the fifth (V_rot's tail) and the transpose reading global memory: hooks for all of that would be the program
written twice; this file instead reuses the program's parts (`Rounding`, the softmax and mask macros, the device code).

Shared memory a CTA (bytes), as counted before building: stage 4 x 8,192 + 256 = 33,024 (one version); V^T 32,768;
q_s 16,384; q8 8,192; P^T 1,024; q_part / q_gain / q_inv 1,152; the softmax's scratch ~2,048: ~94.6 KB, two CTAs an SM
(<= 113 KB each). Emitted: `check_emitted` reads the launch's dynamic shared memory. Registers: two CTAs of 256
threads, 128 a thread on average: `NREG` = (transposer 112: 64 for the prefetched window; consumer 144), the one split
of three compiled that ptxas fits with no spill (96 / 160: 60 bytes of spill stores; 80 / 176: 252).
Emitted (CPU, sm_90a, CUDA 13.0 ptxas): 96,640 bytes of dynamic shared memory a CTA (94.4 KB; the served kernel: 90,112, its
merge pass overlapping q_s with V^T; `check_emitted` reads it), `__launch_bounds__(256, 2)`, 128 registers at launch, 5 named barriers, no spill.

Prediction (written before any run; bench/FP8_NOTES.md run 20): L2 span 1.17-1.30 us a 64-token tile; from DRAM
163,336: 106-118 us (0.54-0.61x bf16 folded); 81,653: 60-68 us; uniform8 130-145; uniform32 580-650; check passes with
the served error (2.2-3.2e-3).
Outcome (s24, bench/FP8_NOTES.md run 20): 143.7 us at 163,336 (0.75x bf16 folded), 80.8 at 81,653 (0.79x), uniform8
170.0 (0.73x), uniform32 777.9 (0.76x): 6-8% slower than the served tensor-core partial in the same run; the check
passed with the served error. Lost: the transposer, with the value window's global loads, is the longer chain.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

import re

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import FP8_PANEL
from foldkv.kernels.decode_partial_fp8_tc import DEVICE_SOURCE, two_part_rounding
from foldkv.kernels.tl import pass_configs, prim_func, require_tilelang, target

SYMBOL = "decode_partial_folded_fp8_tc_ws"
LOAD_FN, STORE_FN = "foldkv_vt_load", "foldkv_vt_store"
PARAMS = dict(page_size=64, block_n=64, block_h=16, reduce_batch=4, ctas_per_sm=2)
# setmaxnreg a thread: 128 x (112 + 144) = 32,768 = half the SM's registers. ptxas allocates each branch to its
# budget: (96, 160) spills 60 / 84 bytes (stores / loads), (80, 176) 252 / 292, (112, 144) none (CUDA 13.0 ptxas -v)
NREG = dict(transposer=112, consumer=144)
SMEM_LIMIT_2CTA = 113 * 1024  # a CTA's share of the SM's 228 KB at two CTAs (1 KB of each reserved)

# the library's device code, and the transposer's two halves of its block transpose
SOURCE = DEVICE_SOURCE + r"""
// A 4-token x 16-column block of the value window from global memory into 16 registers (tokens r >= keep: 0).
__device__ __forceinline__ void foldkv_vt_load(int keep, const void* s0, const void* s1, const void* s2,
                                               const void* s3, unsigned int* regs) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const uint4 r0 = keep > 0 ? *reinterpret_cast<const uint4*>(s0) : zero;
  const uint4 r1 = keep > 1 ? *reinterpret_cast<const uint4*>(s1) : zero;
  const uint4 r2 = keep > 2 ? *reinterpret_cast<const uint4*>(s2) : zero;
  const uint4 r3 = keep > 3 ? *reinterpret_cast<const uint4*>(s3) : zero;
  regs[0] = r0.x; regs[1] = r0.y; regs[2] = r0.z; regs[3] = r0.w;
  regs[4] = r1.x; regs[5] = r1.y; regs[6] = r1.z; regs[7] = r1.w;
  regs[8] = r2.x; regs[9] = r2.y; regs[10] = r2.z; regs[11] = r2.w;
  regs[12] = r3.x; regs[13] = r3.y; regs[14] = r3.z; regs[15] = r3.w;
}
// The block's transpose into V^T, as foldkv_e4m3_t4x16 (store n to column n ^ m, the same select network); every
// writing thread fences its stores to the async proxy (the value gemm reads V^T there) before the pipeline's arrive.
__device__ __forceinline__ void foldkv_vt_store(int m, const unsigned int* regs, void* d0, void* d1, void* d2,
    void* d3, void* d4, void* d5, void* d6, void* d7, void* d8, void* d9, void* d10, void* d11, void* d12, void* d13,
    void* d14, void* d15) {
  unsigned int out[16];
#pragma unroll
  for (int w = 0; w < 4; ++w) foldkv_t4x4(regs[w], regs[4 + w], regs[8 + w], regs[12 + w], out + 4 * w);
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
#pragma unroll
  for (int n = 0; n < 16; ++n) *reinterpret_cast<unsigned int*>(dst[n]) = out[n];
  asm volatile("fence.proxy.async.shared::cta;" : : : "memory");
}
"""


def program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64, block_h: int = 16,
            reduce_batch: int = 4, ctas_per_sm: int = 2, nreg: dict = NREG):
    """The prim_func (module docstring): the served tensor-core partial's arithmetic, its warp specialisation a
    T.WSSchedule of a transposer and a consumer warpgroup."""
    require_tilelang()
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    width = d + geom.rotary_width
    rot = geom.rotary_width  # the value window's first column (row[R:D+R])
    threads = 128  # a warpgroup a role
    assert page_size == block_n == 64 and d % FP8_PANEL == 0
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32, e4m3 = "bfloat16", "float32", "int32", "float8_e4m3"
    score_panels = d // FP8_PANEL  # 4
    tok_blocks, col_blocks = block_n // 4, FP8_PANEL // 16  # 16 x 8 blocks a panel: one a transposer thread
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    rounding = two_part_rounding(geom, block_n, block_h)
    cols = rounding.cols
    W = T.WSID

    # Python, not the macro: expressions at every use (an assignment in the macro is a Bind, which would need an id)
    def tile_page(page_ids, chunk_req, chunk_start, c, k):
        return page_ids[chunk_req[c], (chunk_start[c] + k * block_n) // page_size]

    def tile_off(chunk_start, c, k):
        return (chunk_start[c] + k * block_n) % page_size

    @T.macro
    def partial(query, pool, scales, page_ids, chunk_req, chunk_start, chunk_len, part_o, part_lse):
        with T.Kernel(num_chunks, hkv, threads=2 * threads) as (c, kvh):
            T.import_source(SOURCE)  # not producer_guard's mark: all four transposer warps work (its rewrite is for a producer that only waits)
            T.annotate_min_blocks_per_sm(ctas_per_sm)
            q_s = T.alloc_shared((block_h, d), bf16)
            q8 = [IRBuilder.name(f"q8_{p}", T.alloc_shared((block_h, FP8_PANEL), e4m3)) for p in range(score_panels)]
            stored = [IRBuilder.name(f"stored_{p}", T.alloc_shared((block_n, FP8_PANEL), e4m3))
                      for p in range(score_panels)]
            scale_s = T.alloc_shared((block_n,), f32)
            v_t = T.alloc_shared((d, block_n), e4m3)  # V^T [512, N], K-major, written by the transposer
            p8 = T.alloc_shared((block_h, block_n), e4m3)
            q_part = T.alloc_shared((block_h, 16), f32)
            q_gain = T.alloc_shared((block_h,), f32)
            q_inv = T.alloc_shared((block_h,), f32)
            acc_s = T.alloc_fragment((block_n, block_h), f32)
            acc_o_tile = T.alloc_fragment((d, block_h), f32)
            s_lo = T.alloc_fragment((block_n, group), f32)
            scores = T.alloc_fragment((block_n, cols), f32)
            o_lo = T.alloc_fragment((d, group), f32)
            acc_o = T.alloc_fragment((d, cols), f32)
            head_max = T.alloc_fragment((cols,), f32)
            head_max_prev = T.alloc_fragment((cols,), f32)
            rescale = T.alloc_fragment((cols,), f32)
            head_sum = T.alloc_fragment((cols,), f32)
            denom = T.alloc_fragment((cols,), f32)
            amax = T.alloc_local((1,), f32)
            tile_gain = T.alloc_local((1,), f32)
            tile_inv = T.alloc_local((1,), f32)
            vreg = T.alloc_local((score_panels * 16,), "uint32")  # the transposer's prefetched value window

            T.annotate_ws_schedule(T.WSSchedule(
                num_warps=8,
                roles=[T.WSRole("transposer", warps_lo=0, warps_hi=4, max_nreg=nreg["transposer"]),
                       T.WSRole("consumer", warps_lo=4, warps_hi=8, max_nreg=nreg["consumer"])],
                pipelines=[T.WSPipeline("kv", [*stored, scale_s], depth=1),
                           T.WSPipeline("vt", [v_t], depth=1)],
                scopes=[
                    T.WSScope(T.WSScope.ROOT, {
                        "transposer": ["tiles"],
                        "consumer": ["load_q", "round_q", "init", "tiles", "store"]}),
                    T.WSScope("tiles", {
                        "transposer": [T.WSSync.producer_acquire("kv"),
                                       *[f"tma_k{p}" for p in range(score_panels)], "tma_scale",
                                       T.WSSync.producer_commit("kv"),
                                       "v_load",
                                       T.WSSync.producer_acquire("vt"), "v_store", T.WSSync.producer_commit("vt")],
                        "consumer": [T.WSSync.consumer_wait("kv"), "clear_s",
                                     *[f"gemm_s{p}" for p in range(score_panels)],
                                     "scores", "mask", "softmax", "p_store",
                                     T.WSSync.consumer_wait("vt"), T.WSSync.consumer_release("kv"),
                                     "gemm_v", T.WSSync.consumer_release("vt"), "accumulate"]}),
                ]))

            with T.ws_op("load_q"):
                for i, j in T.Parallel(block_h, d):  # rows >= 8: the next KV head's (0 past the last)
                    q_s[i, j] = T.if_then_else(kvh * group + i < hq,
                                               query[chunk_req[c], T.min(kvh * group + i, hq - 1), j], T.cast(0, bf16))
            with T.ws_op("round_q"):
                rounding.query(q_s, q8, q_part, q_gain, q_inv, amax)
            with T.ws_op("init"):
                T.fill(acc_o, 0)
                T.fill(denom, 0)
                T.fill(head_max, -T.infinity(f32))

            for k in T.serial(T.ceildiv(chunk_len[c], block_n), annotations={W: "tiles"}):
                for p in list(range(score_panels)):
                    T.copy(pool[tile_page(page_ids, chunk_req, chunk_start, c, k), kvh, tile_off(chunk_start, c, k):tile_off(chunk_start, c, k) + block_n, p * FP8_PANEL:(p + 1) * FP8_PANEL], stored[p],
                           annotations={W: f"tma_k{p}"})
                T.copy(scales[tile_page(page_ids, chunk_req, chunk_start, c, k), kvh, tile_off(chunk_start, c, k):tile_off(chunk_start, c, k) + block_n], scale_s, annotations={W: "tma_scale"})
                with T.ws_op("v_load"):
                    for n in list(range(score_panels)):
                        for i, j in T.Parallel(tok_blocks, col_blocks):
                            T.call_extern("handle", LOAD_FN, chunk_len[c] - k * block_n - i * 4,
                                          *[T.address_of(pool[tile_page(page_ids, chunk_req, chunk_start, c, k), kvh, tile_off(chunk_start, c, k) + i * 4 + r,
                                                              rot + n * FP8_PANEL + j * 16]) for r in range(4)],
                                          T.address_of(vreg[n * 16]))
                with T.ws_op("v_store"):
                    for n in list(range(score_panels)):
                        for i, j in T.Parallel(tok_blocks, col_blocks):
                            T.call_extern("handle", STORE_FN, j % 8, T.address_of(vreg[n * 16]),
                                          *[T.access_ptr(v_t[n * FP8_PANEL + j * 16 + T.bitwise_xor(m, j % 8), i * 4], "w", 4)
                                            for m in range(16)])  # "w": the schedule sees the writes
                with T.ws_op("clear_s"):
                    T.clear(acc_s)
                for p in list(range(score_panels)):
                    T.gemm(stored[p], q8[p], acc_s, transpose_B=True, annotations={W: f"gemm_s{p}"})
                with T.ws_op("scores"):
                    rounding.scores(acc_s, s_lo, scores, scale_s, q_inv, tile_gain, tile_inv, chunk_len[c] - k * block_n)
                with T.ws_op("mask"):
                    mask_scores(scores, lambda i, j: k * block_n + i < chunk_len[c])
                with T.ws_op("softmax"):
                    online_softmax(scores, None, head_max, head_max_prev, rescale, head_sum, denom,
                                   lambda i: T.if_then_else(k * block_n + i < chunk_len[c], scale_s[i] * tile_gain[0], 0.0))
                with T.ws_op("p_store"):
                    rounding.p_store(scores, p8)
                T.gemm(v_t, p8, acc_o_tile, transpose_B=True, clear_accum=True, annotations={W: "gemm_v"})
                with T.ws_op("accumulate"):
                    rounding.accumulate(acc_o, acc_o_tile, o_lo, rescale, tile_inv)

            with T.ws_op("store"):
                for i, j in T.Parallel(d, cols):
                    if j < group:
                        part_o[c, kvh * group + j, i] = acc_o[i, j] / denom[j]
                for j in T.Parallel(cols):
                    if j < group:
                        part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * macros.LOG2E

    args = {
        "query": T.Tensor((batch, hq, d), bf16),
        "pool": T.Tensor((num_pages, hkv, page_size, width), e4m3),
        "scales": T.Tensor((num_pages, hkv, page_size), f32),
        "page_ids": T.Tensor((batch, max_pages), i32),
        "chunk_req": T.Tensor((num_chunks,), i32),
        "chunk_start": T.Tensor((num_chunks,), i32),
        "chunk_len": T.Tensor((num_chunks,), i32),
        "part_o": T.Tensor((num_chunks, hq, d), f32),
        "part_lse": T.Tensor((num_chunks, hq), f32),
    }
    return prim_func("decode_partial", args, lambda b: partial(*(b[n] for n in args))).with_attr(
        "global_symbol", SYMBOL)


def smem_bytes(host_src: str, threads: int = 256) -> int:
    """The dynamic shared memory a CTA from the host source's launch: the constant after the block's (threads, 1, 1)."""
    nums = [int(x) for x in re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", host_src)]
    for i in range(len(nums) - 3):
        if nums[i:i + 3] == [threads, 1, 1]:
            return nums[i + 3]
    raise AssertionError(f"no launch with a block of ({threads}, 1, 1) in the host source")


def _branches(body: str) -> tuple[str, str]:
    """(transposer, consumer) branches of the emitted kernel body: `if (threadIdx.x < 128) {...} else {...}`."""
    from foldkv.kernels.cuda_checks import _match

    head = re.search(r"if \(\(\(int\)threadIdx\.x\) < 128\) \{\n\s*tl::warpgroup_reg_dealloc<(\d+)>\(\);", body)
    if head is None:
        raise AssertionError(f"{SYMBOL}: no transposer branch (threads [0, 128), setmaxnreg.dec) in the emitted CUDA")
    open_at = body.index("{", head.start())
    end = _match(body, open_at, "{", "}")
    rest = body[end:].lstrip()
    if not rest.startswith("else {"):
        raise AssertionError(f"{SYMBOL}: the transposer branch has no consumer (else) branch after it")
    else_at = end + body[end:].index("{")
    return body[open_at:end], body[else_at:_match(body, else_at, "{", "}")]


def _order(branch: str, marks: list) -> list:
    """Offsets in `branch` of each regex in `marks` (first match), raising if one is missing."""
    at = []
    for m in marks:
        hit = re.search(m, branch)
        if hit is None:
            raise AssertionError(f"{SYMBOL}: {m!r} missing from its branch")
        at.append(hit.start())
    return at


def check_emitted(src: str, host_src: str, nreg: dict = NREG) -> dict:
    """What the design says, read from the emitted CUDA (raises on a miss, returns the facts):
      - two CTAs an SM (`__launch_bounds__(256, 2)`), dynamic shared memory a CTA <= SMEM_LIMIT_2CTA (the launch's);
      - the transposer branch (threads [0, 128), setmaxnreg.dec to nreg["transposer"]): waits for the stage's empty
        barrier, issues the TMA of the 4 score panels and the scales onto the full barrier, loads the value window
        from global memory (`foldkv_vt_load`, 4 calls), then waits for V^T's empty barrier, stores it (4
        `foldkv_vt_store` calls into v_t), fences to the async proxy and arrives on V^T's full barrier, in that order;
      - the consumer branch (setmaxnreg.inc to nreg["consumer"]): waits for the stage's full barrier, the four score
        wgmma over the stage, P^T's stores, waits for V^T's full barrier, then arrives on the stage's empty barrier,
        the value wgmma reading v_t, waits for it, arrives on V^T's empty barrier, in that order; no transpose in it;
      - all four barriers' arrival counts: the stage's and V^T's counted by 128 threads (every thread of the role
        arrives: no warp of a role can fall two phases behind, producer_guard.py's hazard)."""
    from foldkv.kernels.cuda_checks import kernel_definition

    _, body = kernel_definition(src, SYMBOL)
    trans, cons = _branches(body)
    facts = dict(smem_bytes=smem_bytes(host_src),
                 launch_bounds=re.findall(r"__launch_bounds__\(([^)]*)\)", src),
                 nreg=dict(transposer=int(re.search(r"warpgroup_reg_dealloc<(\d+)>", body).group(1)),
                           consumer=int(re.search(r"warpgroup_reg_alloc<(\d+)>", body).group(1))),
                 loads=len(re.findall(rf"\b{LOAD_FN}\(", trans)), stores=len(re.findall(rf"\b{STORE_FN}\(", trans)),
                 tma=len(re.findall(r"tl::tma_load\(", trans)),
                 consumer_transpose=len(re.findall(rf"\b(?:{LOAD_FN}|{STORE_FN}|foldkv_e4m3_t4x16)\(", cons)),
                 score_wgmma=len(re.findall(r"wgmma_ss<tl::DataType::kFloat8_e4m3.*?, 64, 16, 32", cons)),
                 inits=dict(re.findall(r"(\w+)\[0\]\.init\((\d+)\)", body)))
    want = dict(launch_bounds=["256, 2"], nreg=dict(nreg), loads=4, stores=4, tma=5, consumer_transpose=0,
                score_wgmma=5, inits={"kv_full": "1", "kv_empty": "128", "vt_full": "128", "vt_empty": "128"})
    bad = {k: (facts[k], w) for k, w in want.items() if facts[k] != w}
    if facts["smem_bytes"] > SMEM_LIMIT_2CTA:
        bad["smem_bytes"] = (facts["smem_bytes"], f"<= {SMEM_LIMIT_2CTA}")
    t = _order(trans, [r"kv_empty\[0\]\.wait", r"tl::tma_load\(", rf"\b{LOAD_FN}\(", r"vt_empty\[0\]\.wait",
                       rf"\b{STORE_FN}\(", r"tl::fence_proxy_async\(\);\s*vt_full\[0\]\.arrive\(\)"])
    c = _order(cons, [r"kv_full\[0\]\.wait", r"wgmma_ss<", r"\(\(fp8_e4_t\*\)p8\)\[[^;]*\] =",
                      r"vt_full\[0\]\.wait", r"kv_empty\[0\]\.arrive", r"\(\(fp8_e4_t\*\)v_t\)",
                      r"warpgroup_wait<0>\(\);[^;]*;\s*\}\s*vt_empty\[0\]\.arrive"])
    for name, at in (("transposer", t), ("consumer", c)):
        if at != sorted(at):
            bad[f"{name}_order"] = (at, "increasing")
    if bad:
        raise AssertionError(f"{SYMBOL}: emitted CUDA off the design (got, want): {bad}")
    return facts


def build(geom: AttentionGeometry, transposer_nreg: int = NREG["transposer"], **params):
    """Compile (JIT) the version; a drop-in for `kernels={"decode_partial_folded_fp8_tc": ...}` (the same argument
    list). `transposer_nreg`: the transposer's setmaxnreg (the consumer gets 256 - it). Its emitted CUDA is checked
    for this design's facts (`check_emitted`)."""
    tilelang = require_tilelang()
    cfg = {**PARAMS, **params}
    nreg = dict(transposer=transposer_nreg, consumer=256 - transposer_nreg)

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def decode_partial_fp8_tc_ws(page_size, block_n, block_h, reduce_batch, ctas_per_sm, transposer_nreg):
        return program(geom, page_size=page_size, block_n=block_n, block_h=block_h, reduce_batch=reduce_batch,
                       ctas_per_sm=ctas_per_sm, nreg=dict(transposer=transposer_nreg, consumer=256 - transposer_nreg))

    kernel = decode_partial_fp8_tc_ws(**cfg, transposer_nreg=transposer_nreg)
    check_emitted(kernel.get_kernel_source(), kernel.get_host_source(), nreg)
    return kernel
