"""The paged causal prefill kernel over a bf16 folded pool: FlashMLA's seesaw schedule over the folded row. Its
arguments are the split prefill's (`prefill_attention`'s docstring lists them, in the order the AOT loader relies on);
grid (NT tiles, 4 KV heads), 384 threads: a TMA producer warpgroup, then two consumer warpgroups. Why each choice:
kernels/PREFILL_SCHEDULE.md, "The bf16 folded prefill".
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat, row_width
from . import macros, producer_guard
from .prefill_attention import check_geometry, head_column_of, tile_coords_macro
from .registry import hands_out
from .tl import compile_program, prim_func, require_tilelang

CONSUMER_REGS, PRODUCER_REGS = 232, 40  # 2 x 128 x 232 + 128 x 40 = 64,512 of an SM's 65,536


def prefill_folded_program(geom: AttentionGeometry, *, page_size: int = 64, block_N: int = 64,
                           max_slack_log2: float | None = 8.0):
    """The TileLang prim_func of the bf16 folded prefill (same arguments as `prefill_attention.prefill_program`'s)."""
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

    @T.macro
    def consumer(w, Q_shared, KV, m_shared, l_shared, mbarrier, c, num_blocks, Out, Lse, by):
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
        moved = T.alloc_local([1], "int32")
        tok0, q_len, q_base, pos0, n_kv = c.tok0, c.q_len, c.q_base, c.pos0, c.n_kv
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, NEG)
        first_pos = pos0 + tok0
        for i in T.serial(T.ceildiv(num_blocks, 2)):
            k = 2 * i + w
            T.barrier_wait(mbarrier[1 + w], i & 1)
            if k < num_blocks:
                T.gemm(Q_shared, KV[w, :, 0:D], acc_s, transpose_B=True, clear_accum=True)
                if (k + 1) * block_N - 1 > first_pos:  # a tile crossing the diagonal (or past the sequence)
                    for r, j in T.Parallel(block_M, block_N):
                        acc_s[r, j] = T.if_then_else(
                            k * block_N + j <= pos0 + T.min(tok0 + r // G, q_len - 1), acc_s[r, j], NEG)
                if (k + 1) * block_N > n_kv:  # value rows past the sequence hold arbitrary bits
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
            moved[0] = 0
            for r in T.Parallel(block_M):
                if alpha[r] != T.float32(1):
                    moved[0] = 1
            if moved[0] != 0:
                for r, d in T.Parallel(block_M, H):
                    acc_o[r, d] *= alpha[r]
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
            c = tile_coords(TileReq, TileTok, SeqLens, QLens, QStart, bx)
            req, tok0, q_len, q_base = c.req, c.tok0, c.q_len, c.q_base
            num_blocks = T.ceildiv(c.pos0 + T.min(tok0 + TOK, q_len), block_N)
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
                consumer(0, Q_shared, KV, m_shared, l_shared, mbarrier, c, num_blocks, Out, Lse, by)
            else:
                consumer(1, Q_shared, KV, m_shared, l_shared, mbarrier, c, num_blocks, Out, Lse, by)

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


@hands_out("prefill_{fmt}")
def build(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, *, page_size: int = 64,
          block_N: int = 64, max_slack_log2: float | None = 8.0):
    """Compile (JIT) the bf16 folded prefill for `geom`."""
    if KvFormat.parse(fmt) is not KvFormat.FOLDED:
        raise ValueError(f"prefill_folded reads folded rows; got {fmt!r} (prefill_attention.build builds the split one)")
    return compile_program(prefill_folded_program(geom, page_size=page_size, block_N=block_N,
                                                  max_slack_log2=max_slack_log2))
