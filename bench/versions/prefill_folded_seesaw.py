"""The folded prefill with FlashMLA's seesaw schedule: the two consumer warpgroups take alternate key tiles for Q.K (each
a whole 64 x 64 score tile, no cross-warpgroup reduction inside a tile) and each keeps one half of the 512 output
columns, fed by both tiles' P. Same arguments and outputs as the library's prefill_folded.

What it tries (bench/PREFILL_NOTES.md, "Prediction: the seesaw schedule"): the library's kernel (FullCol: the two
warpgroups split every tile's 64 keys, 32 each) runs one serial chain a tile in both warpgroups at once: Q.K, four
cross-warpgroup reductions through shared memory and named barriers, the softmax, P.V, with the tensor cores idle
between the gemms. Its Q.K is wgmma m64n32 with the query re-read by both warpgroups (the shared-memory reads of a
tile ~1.3x the tensor-core time). Here, per pair of tiles (2i, 2i+1) held in the two stages:
  WG0: S0 = Q.K0 (m64n64k16, 512 deep) | max exchange | P0 = exp2(..) | O_L += P0.V0_L | O_L += P1.V1_L
  WG1: S1 = Q.K1                       | max exchange | P1 = exp2(..) | O_R += P1.V1_R | O_R += P0.V0_R
One exchange of the row max per pair (an mbarrier each way, no named-barrier round trips), the two warpgroups out of
step by design (one's softmax beside the other's gemms: the tensor cores see both), and the query read once a tile.
  - Shared memory: the query [64, 512] (score-window order q_rot | q_unrot * w_k) 64 KiB, two stages of the row [64,
    640] 160 KiB, P of stage s written over the first 64 columns of that stage's K_rot (row[0:128]), which only its
    own Q.K reads: 224 KiB + the row max / sum exchange (1 KiB) under the 227 KiB of an SM.
  - A producer warpgroup (setmaxnreg 40) loads each tile by TMA (one page of one KV head: 80 KiB contiguous), onto
    an mbarrier per stage; the consumers (setmaxnreg 232) release a stage after both P.Vs on it.
  - The lazy max (max_slack_log2, the library's): both warpgroups hold the same max after each exchange, so they
    decide alike and skip the output rescale alike.
  - A tile past the CTA's last causal key (the odd tile of a last pair): no load, all scores masked, no P.V on it.
    Keys past the sequence in the last real tile: their value rows zeroed by the tile's owner before it hands P over
    (0 x NaN is NaN in P.V).

Outcome (H100, bench/prefill_runs/h100_20261206_seesaw.tgz, a 4,096-query chunk at 8K / 32K of context): 0.993x /
0.951x the two-stage row (3.80 / 17.27 ms against 3.78 / 16.43 ms; 59.3% of the matmul rate at 32K), predicted
1.10-1.25x at 32K: lost. The hostile gate and the 44 GPU prefill tests passed with it as the library's kernel. Likely
cause (not profiled): a pair holds both 80 KiB stages until its last P.V, so the producer cannot load the next pair
while this one computes; the two-stage row prefetches a tile ahead (bench/PREFILL_NOTES.md, "Outcome: the seesaw").

    python bench/versions/prefill_folded_seesaw.py      # build here (sm_90a), print the CUDA size and ptxas resources
    python bench/prefill_kernel_probe.py --out $OUT      # on the device: gate, then time against the library
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros, producer_guard
from foldkv.kernels.prefill_attention import (Accumulator, causal_mask_macro, check_geometry, head_column_of,
                                              lazy_rescale_macro, tile_coords_macro)
from foldkv.kernels.tl import pass_configs, prim_func, require_tilelang, target
from foldkv.layout import KvFormat, row_width

CONSUMER_REGS, PRODUCER_REGS = 232, 40  # 2 x 128 x 232 + 128 x 40 = 64,512 of an SM's 65,536


def program(geom: AttentionGeometry, *, page_size: int = 64, block_N: int = 64, max_slack_log2: float | None = 8.0,
            **_library_tiling):
    """The TileLang prim_func (the library prefill's arguments, in its order; the library's stages, threads and
    reduce_batch do not apply to this schedule)."""
    check_geometry(geom, KvFormat.FOLDED)
    require_tilelang()
    import tilelang.language as T

    if block_N != 64 or page_size % block_N:
        raise ValueError(f"the seesaw prefill takes 64-key tiles within a page; got block_N {block_N}, page {page_size}")
    D, R = geom.head_dim, geom.rotary_width
    HQ, HKV, G = geom.num_q_heads, geom.num_kv_heads, geom.group_size
    W = row_width(geom, KvFormat.FOLDED)  # 640
    H = D // 2  # output columns a warpgroup keeps
    block_M = 64
    TOK = block_M // G
    dtype, accum = "bfloat16", "float32"
    scale = macros.LOG2E
    slack = None if max_slack_log2 is None else max_slack_log2 / scale
    head_column = head_column_of(geom, KvFormat.FOLDED)
    Tq, NP, B, MP, NT = T.dynamic("Tq, NP, B, MP, NT")
    NEG = -T.infinity(accum)
    tile_coords = tile_coords_macro()
    mask_tile = causal_mask_macro(block_N)
    rescale_outputs = lazy_rescale_macro() if slack is not None else None

    @T.macro
    def consumer(w, Q_shared, KV, m_shared, l_shared, mbarrier, tok0, n_kv, q_len, q_base, pos0, num_blocks, Out, Lse,
                 by):
        # warpgroup w: tiles 2i + w, output columns [w * H, (w + 1) * H) of the value window (row[128 + w * H ...])
        T.set_max_nreg(CONSUMER_REGS, 1)
        acc_s = T.alloc_fragment([block_M, block_N], accum)
        acc_o = T.alloc_fragment([block_M, H], accum)
        m = T.alloc_fragment([block_M], accum)  # the running max, the same in both warpgroups
        m_prev = T.alloc_fragment([block_M], accum)
        m_peer = T.alloc_fragment([block_M], accum)
        alpha = T.alloc_fragment([block_M], accum)
        l = T.alloc_fragment([block_M], accum)  # this warpgroup's tiles' share of the denominator
        l_tile = T.alloc_fragment([block_M], accum)
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, NEG)
        first_pos = pos0 + tok0
        for i in T.serial(T.ceildiv(num_blocks, 2)):
            k = 2 * i + w
            T.barrier_wait(mbarrier[1 + w], i & 1)
            if k < num_blocks:
                T.gemm(Q_shared, KV[w, :, 0:D], acc_s, transpose_B=True, clear_accum=True)
                mask_tile(acc_s, lambda r, j: k * block_N + j <= pos0 + T.min(tok0 + r // G, q_len - 1), k, first_pos)
                if (k + 1) * block_N > n_kv:  # value rows past the sequence hold arbitrary bits (macros.zero_rows_macro's
                    # rule on the stage's value columns, a region of the buffer, which that macro does not take)
                    for j, d in T.Parallel(block_N, D):
                        KV[w, j, R + d] = T.if_then_else(k * block_N + j < n_kv, KV[w, j, R + d], T.cast(0, dtype))
            else:
                T.fill(acc_s, NEG)
            # the row max: this tile's, then both tiles' through shared memory (one mbarrier each way)
            T.copy(m, m_prev)
            T.reduce_max(acc_s, m, dim=1, clear=False)
            T.copy(m, m_shared[w, :])
            T.barrier_arrive(mbarrier[5 + w])
            T.barrier_wait(mbarrier[6 - w], i & 1)
            T.copy(m_shared[1 - w, :], m_peer)
            for r in T.Parallel(block_M):
                m[r] = T.max(m[r], m_peer[r])
                if slack is not None:  # the lazy max: the same decision in both warpgroups
                    m[r] = T.if_then_else(m[r] - m_prev[r] > slack, m[r], m_prev[r])
                alpha[r] = T.exp2((m_prev[r] - m[r]) * scale)
            for r, j in T.Parallel(block_M, block_N):
                acc_s[r, j] = T.exp2(acc_s[r, j] * scale - m[r] * scale)
            T.reduce_sum(acc_s, l_tile, dim=1)
            for r in T.Parallel(block_M):
                l[r] = l[r] * alpha[r] + l_tile[r]
            if rescale_outputs is None:
                for r, d in T.Parallel(block_M, H):
                    acc_o[r, d] *= alpha[r]
            else:
                rescale_outputs((Accumulator(acc_o, None, 0),), alpha)
            # P of this tile over its K_rot's first 64 columns (only this warpgroup's Q.K read them), for both P.Vs
            T.copy(acc_s, KV[w, :, 0:block_N])
            T.fence_proxy_async()
            T.barrier_arrive(mbarrier[7 + w])
            if k < num_blocks:
                T.gemm(KV[w, :, 0:block_N], KV[w, :, R + w * H:R + (w + 1) * H], acc_o)
            T.barrier_wait(mbarrier[8 - w], i & 1)
            if 2 * i + 1 - w < num_blocks:
                T.gemm(KV[1 - w, :, 0:block_N], KV[1 - w, :, R + w * H:R + (w + 1) * H], acc_o)
            T.barrier_arrive(mbarrier[3])
            T.barrier_arrive(mbarrier[4])
        # the denominator: this warpgroup's tiles' sum plus the other's, on the same max
        T.copy(l, l_shared[w, :])
        T.barrier_arrive(mbarrier[5 + w])
        T.barrier_wait(mbarrier[6 - w], T.ceildiv(num_blocks, 2) & 1)
        T.copy(l_shared[1 - w, :], l_tile)
        for r in T.Parallel(block_M):
            l[r] += l_tile[r]
        for r, d in T.Parallel(block_M, H):
            if tok0 + r // G < q_len:
                Out[q_base + tok0 + r // G, by * G + r % G, head_column(w * H + d)] = acc_o[r, d] / l[r]
        if w == 0:
            for r in T.Parallel(block_M):
                if tok0 + r // G < q_len:
                    Lse[q_base + tok0 + r // G, by * G + r % G] = m[r] + T.log2(l[r]) * macros.LN2

    @T.macro
    def attention(Q, Pool, PageIds, SeqLens, QStart, QLens, TileReq, TileTok, Out, Lse):
        with T.Kernel(NT, HKV, threads=384) as (bx, by):
            T.import_source(producer_guard.imported_source())  # the producer loop in the warp that issues the TMA
            Q_shared = T.alloc_shared([block_M, D], dtype)  # score-window order
            KV = T.alloc_shared([2, block_N, W], dtype)  # two stages of the row; P over each stage's [:, 0:64]
            m_shared = T.alloc_shared([2, block_M], accum)
            l_shared = T.alloc_shared([2, block_M], accum)
            # one array, as TileLang's own warp specialisation names it (producer_guard reads its waits by that name):
            # [0] the query, [1, 2] stage s loaded (the producer's elected thread and the TMA's bytes), [3, 4] stage s
            # free (both consumers), [5, 6] warpgroup w's row max or sum written, [7, 8] warpgroup w's P written
            mbarrier = T.alloc_barrier(arrive_count=[384, 1, 1, 256, 256, 128, 128, 128, 128])
            req, tok0, n_kv, q_len, q_base, pos0 = tile_coords(TileReq, TileTok, SeqLens, QLens, QStart, bx)
            num_blocks = T.ceildiv(pos0 + T.min(tok0 + TOK, q_len), block_N)
            tx = T.get_thread_binding()

            # row r = (token tok0 + r // G, head by * G + r % G); tokens past the chunk repeat its last token
            for r, d in T.Parallel(block_M, D):
                Q_shared[r, d] = Q[q_base + T.min(tok0 + r // G, q_len - 1), by * G + r % G, d]
            T.barrier_arrive(mbarrier[0])
            T.barrier_wait(mbarrier[0], 0)

            if tx < 128:  # the producer warpgroup first, as TileLang's warp specialisation places it
                T.set_max_nreg(PRODUCER_REGS, 0)
                for i in T.serial(T.ceildiv(num_blocks, 2)):
                    for s in T.unroll(2, explicit=True):
                        k = 2 * i + s
                        T.barrier_wait(mbarrier[3 + s], (i & 1) ^ 1)
                        if k < num_blocks:
                            page = PageIds[req, (k * block_N) // page_size]
                            off = (k * block_N) % page_size
                            T.tma_copy(Pool[page, by, off:off + block_N, 0:W], KV[s, :, :], barrier=mbarrier[1 + s])
                        if T.shuffle_elect(128):  # the thread that set the barrier's expected bytes, after it
                            T.barrier_arrive(mbarrier[1 + s])
            elif tx < 256:
                consumer(0, Q_shared, KV, m_shared, l_shared, mbarrier, tok0, n_kv, q_len, q_base, pos0, num_blocks,
                         Out, Lse, by)
            else:
                consumer(1, Q_shared, KV, m_shared, l_shared, mbarrier, tok0, n_kv, q_len, q_base, pos0, num_blocks,
                         Out, Lse, by)

    args = {
        "Q": T.Tensor([Tq, HQ, D], dtype),
        "Pool": T.Tensor([NP, HKV, page_size, W], dtype),
        "PageIds": T.Tensor([B, MP], "int32"),
        **{name: T.Tensor([B], "int32") for name in ("SeqLens", "QStart", "QLens")},
        **{name: T.Tensor([NT], "int32") for name in ("TileReq", "TileTok")},
        "Out": T.Tensor([Tq, HQ, D], dtype),
        "Lse": T.Tensor([Tq, HQ], accum),
    }
    return prim_func("main", args, lambda b: attention(*(b[n] for n in args)))


def build(geom: AttentionGeometry = GEMMA4_31B, *, arch: str | None = None, page_size: int = 64, block_N: int = 64,
          max_slack_log2: float | None = 8.0, **_library_tiling):
    """Compile the seesaw folded prefill (the library's other tiling params, stages and threads, do not apply)."""
    tilelang = require_tilelang()
    prog = program(geom, page_size=page_size, block_N=block_N, max_slack_log2=max_slack_log2)
    return tilelang.compile(prog, target=target(arch) if arch else target(), pass_configs=pass_configs())


def main():
    kernel = build(GEMMA4_31B)
    print(f"prefill_folded seesaw: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
