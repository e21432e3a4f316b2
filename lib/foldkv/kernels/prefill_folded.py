"""The bf16 folded prefill (`prefill_folded`): FlashMLA's seesaw over the folded row, the way FlashMLA's sparse prefill
runs it. Same arguments, grid and outputs as prefill_attention's kernels (its module docstring lists them): one CTA =
8 query tokens x the 8 query heads of one KV group (64 rows), a TMA producer warpgroup and two consumer warpgroups.

Per pair of 64-key tiles (2i in stage 0, 2i + 1 in stage 1), warpgroup w takes tile 2i + w's whole Q.K (m64n64, the
512-column score window) and keeps output columns [256 w, 256 w + 256) of the value window, fed by both tiles' P:
  WG0: S0 = Q.K0 | m0, handed over | P0 = exp2(S0 - m0) | O_L += P0.V0_L | m1 back: P0, O_L onto m1 | O_L += P1.V1_L
  WG1: S1 = Q.K1 | m1 = max(m0, S1)   | P1 = exp2(S1 - m1) | O_R += P1.V1_R |                         | O_R += P0.V0_R
Each stage is released in two parts as their readers finish, and the producer loads them in that order, so the next
pair's loads start inside this one. Why each choice, and what it replaced: kernels/PREFILL_SCHEDULE.md.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat, row_width
from . import macros, producer_guard
from .prefill_attention import (Accumulator, causal_mask_macro, check_geometry, head_column_of, lazy_rescale_macro,
                                tile_coords_macro)
from .registry import hands_out
from .tl import compile_program, prim_func, require_tilelang

CONSUMER_REGS, PRODUCER_REGS = 232, 40  # 2 x 128 x 232 + 128 x 40 = 64,512 of an SM's 65,536
# mbarrier indices: the query; stage parts loaded (X0, X1, Y0, Y1) and released (same order); warpgroup w's row max
# (or, after the loop, its row sum) written; warpgroup w's P written
QUERY, LOADED, FREE, MAX, P_READY = 0, 1, 5, 9, 11
ARRIVALS = [384, 1, 1, 1, 1, 128, 128, 128, 128, 128, 128, 128, 128]
X0, X1, Y0, Y1 = 0, 1, 2, 3


def part_columns(geom: AttentionGeometry, part: int) -> tuple[tuple[int, int], ...]:
    """The row's column runs of a stage part (its stage: part % 2), in load order: X_s the owner's value half (X0 =
    row[128:384], X1 = row[384:640]), Y_s the rest (Y0 = K_rot and row[384:640], Y1 = row[0:384])."""
    R, H = geom.rotary_width, geom.head_dim // 2
    W = row_width(geom, KvFormat.FOLDED)
    return {X0: ((R, R + H),), X1: ((R + H, W),), Y0: ((0, R), (R + H, W)), Y1: ((0, R + H),)}[part]


@dataclass(frozen=True)
class ValueSchedule:
    """How the consumers issue their P.Vs and release the stage parts those read (a version's hook point; the
    library's waits for each gemm): `own(acc_p, KV, acc_o, mbarrier)`, warpgroup 0's P0.V0 from registers, before its
    wait for m1; `own_retired(acc_o, acc_p, mbarrier)` or None, after P0's store; `pair(KV, acc_o, mbarrier, i,
    num_blocks)`, warpgroup 1's P1.V1 and P0.V0 (after P0 is written) and the releases of X1 and Y0."""
    own: Any
    own_retired: Any
    pair: Any


def waited_values(geom: AttentionGeometry, block_N: int) -> ValueSchedule:
    """The library's: every gemm waited for, each part released after its last gemm."""
    import tilelang.language as T

    R, H = geom.rotary_width, geom.head_dim // 2
    W = row_width(geom, KvFormat.FOLDED)

    @T.macro
    def own(acc_p, KV, acc_o, mbarrier):
        T.gemm(acc_p, KV[0, :, R:R + H], acc_o)  # P0 on m0, from registers
        T.barrier_arrive(mbarrier[FREE + X0])

    @T.macro
    def pair(KV, acc_o, mbarrier, i, num_blocks):
        if 2 * i + 1 < num_blocks:
            T.gemm(KV[1, :, 0:block_N], KV[1, :, R + H:W], acc_o)
        T.barrier_arrive(mbarrier[FREE + X1])
        T.barrier_wait(mbarrier[P_READY + 0], i & 1)
        T.gemm(KV[0, :, 0:block_N], KV[0, :, R + H:W], acc_o)  # P0, already on m1
        T.barrier_arrive(mbarrier[FREE + Y0])

    return ValueSchedule(own, None, pair)


def program(geom: AttentionGeometry, *, page_size: int = 64, block_N: int = 64, max_slack_log2: float | None = 8.0,
            values: Callable[[AttentionGeometry, int], ValueSchedule] = waited_values):
    """The TileLang prim_func (prefill_attention's arguments, in its order); `values`: the P.Vs' schedule."""
    check_geometry(geom, KvFormat.FOLDED)
    require_tilelang()
    import tilelang.language as T

    if block_N != 64 or page_size % block_N:
        raise ValueError(f"the seesaw prefill takes 64-key tiles within a page; got block_N {block_N},"
                         f" page {page_size}")
    D, R = geom.head_dim, geom.rotary_width
    HQ, HKV, G = geom.num_q_heads, geom.num_kv_heads, geom.group_size
    W = row_width(geom, KvFormat.FOLDED)  # 640 = K_rot 128 | V_unrot 384 | V_rot 128
    H = D // 2  # output columns a warpgroup keeps: value window [w * H, (w + 1) * H) = row[R + w * H, R + (w + 1) * H)
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
    value_gemms = values(geom, block_N)

    def score_runs(part):
        # a part's columns inside the score window row[0:512] (X0 and X1 are one run each)
        return tuple((lo, min(hi, D)) for lo, hi in part_columns(geom, part) if lo < D)

    @T.macro
    def rescale(acc_o, factor):
        if rescale_outputs is None:
            for r, d in T.Parallel(block_M, H):
                acc_o[r, d] *= factor[r]
        else:
            rescale_outputs((Accumulator(acc_o, None, 0),), factor)

    @T.macro
    def scores(w, Q_shared, KV, acc_s, mbarrier, i, k, num_blocks, n_kv, q_len, pos0, tok0):
        # S = Q.K of tile k in stage w over the score window row[0:512], the owner's value half first (X_w), then
        # the rest once it has landed (Y_w); a tile past the CTA's last causal key: all scores masked
        T.barrier_wait(mbarrier[LOADED + w], i & 1)
        if k < num_blocks:
            for lo, hi in score_runs(w):
                T.gemm(Q_shared[:, lo:hi], KV[w, :, lo:hi], acc_s, transpose_B=True, clear_accum=True)
        T.barrier_wait(mbarrier[LOADED + 2 + w], i & 1)
        if k < num_blocks:
            for lo, hi in score_runs(2 + w):
                T.gemm(Q_shared[:, lo:hi], KV[w, :, lo:hi], acc_s, transpose_B=True)
            mask_tile(acc_s, lambda r, j: k * block_N + j <= pos0 + T.min(tok0 + r // G, q_len - 1), k, pos0 + tok0)
            if (k + 1) * block_N > n_kv:  # value rows past the sequence hold arbitrary bits (macros.zero_rows_macro's
                # rule on the stage's value columns, a region of the buffer, which that macro does not take)
                for j, d in T.Parallel(block_N, D):
                    KV[w, j, R + d] = T.if_then_else(k * block_N + j < n_kv, KV[w, j, R + d], T.cast(0, dtype))
        else:
            T.fill(acc_s, NEG)

    @T.macro
    def softmax_rows(acc_s, m, m_prev, alpha, l, l_tile):
        # P = exp2 of the scores on the max m, the denominator moved from m_prev to m
        for r in T.Parallel(block_M):
            alpha[r] = T.exp2((m_prev[r] - m[r]) * scale)
        for r, j in T.Parallel(block_M, block_N):
            acc_s[r, j] = T.exp2(acc_s[r, j] * scale - m[r] * scale)
        T.reduce_sum(acc_s, l_tile, dim=1)
        for r in T.Parallel(block_M):
            l[r] = l[r] * alpha[r] + l_tile[r]

    @T.macro
    def lazy_max(m, base):
        # the lazy max: m moves from base only past the slack (P <= 2^8); the one decision both warpgroups then use
        if slack is not None:
            for r in T.Parallel(block_M):
                m[r] = T.if_then_else(m[r] - base[r] > slack, m[r], base[r])

    @T.macro
    def epilogue(w, acc_o, m, l, l_tile, l_shared, mbarrier, num_blocks, tok0, q_len, q_base, Out, Lse, by):
        # the denominator: this warpgroup's tiles' sum plus the other's, on the same max
        T.copy(l, l_shared[w, :])
        T.barrier_arrive(mbarrier[MAX + w])
        T.barrier_wait(mbarrier[MAX + 1 - w], T.ceildiv(num_blocks, 2) & 1)
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
    def consumer_state(with_p):
        # a consumer's registers (232 of them): S, (warpgroup 0) P in bf16, its half of the output, the row max and sum
        T.set_max_nreg(CONSUMER_REGS, 1)
        acc_s = T.alloc_fragment([block_M, block_N], accum)
        acc_p = T.alloc_fragment([block_M, block_N], dtype) if with_p else None
        acc_o = T.alloc_fragment([block_M, H], accum)
        m = T.alloc_fragment([block_M], accum)
        m_prev = T.alloc_fragment([block_M], accum)
        m_peer = T.alloc_fragment([block_M], accum)
        alpha = T.alloc_fragment([block_M], accum)
        l = T.alloc_fragment([block_M], accum)
        l_tile = T.alloc_fragment([block_M], accum)
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, NEG)
        return acc_s, acc_p, acc_o, m, m_prev, m_peer, alpha, l, l_tile

    @T.macro
    def consumer0(Q_shared, KV, m_shared, l_shared, mbarrier, tok0, n_kv, q_len, q_base, pos0, num_blocks, Out, Lse,
                  by):
        # warpgroup 0: tiles 2i (stage 0), output columns value window [0, H) = row[R:R + H]
        acc_s, acc_p, acc_o, m, m_prev, m_peer, alpha, l, l_tile = consumer_state(True)
        for i in T.serial(T.ceildiv(num_blocks, 2)):
            scores(0, Q_shared, KV, acc_s, mbarrier, i, 2 * i, num_blocks, n_kv, q_len, pos0, tok0)
            # m0 from this tile alone, handed over before the softmax
            T.copy(m, m_prev)
            T.reduce_max(acc_s, m, dim=1, clear=False)
            lazy_max(m, m_prev)
            T.copy(m, m_shared[0, :])
            T.barrier_arrive(mbarrier[MAX + 0])
            softmax_rows(acc_s, m, m_prev, alpha, l, l_tile)
            rescale(acc_o, alpha)
            T.copy(acc_s, acc_p)
            value_gemms.own(acc_p, KV, acc_o, mbarrier)
            # m1 back: P0 (for warpgroup 1), the output and the denominator onto it
            T.barrier_wait(mbarrier[MAX + 1], i & 1)
            T.copy(m_shared[1, :], m_peer)
            for r in T.Parallel(block_M):
                alpha[r] = T.exp2((m[r] - m_peer[r]) * scale)
                m[r] = m_peer[r]
                l[r] *= alpha[r]
            for r, j in T.Parallel(block_M, block_N):
                acc_s[r, j] *= alpha[r]
            T.copy(acc_s, KV[0, :, 0:block_N])  # over K_rot's first 64 columns, which only this Q.K read
            T.fence_proxy_async()
            T.barrier_arrive(mbarrier[P_READY + 0])
            if value_gemms.own_retired is not None:
                value_gemms.own_retired(acc_o, acc_p, mbarrier)
            rescale(acc_o, alpha)
            T.barrier_wait(mbarrier[P_READY + 1], i & 1)
            if 2 * i + 1 < num_blocks:
                T.gemm(KV[1, :, 0:block_N], KV[1, :, R:R + H], acc_o)
            T.barrier_arrive(mbarrier[FREE + Y1])
        epilogue(0, acc_o, m, l, l_tile, l_shared, mbarrier, num_blocks, tok0, q_len, q_base, Out, Lse, by)

    @T.macro
    def consumer1(Q_shared, KV, m_shared, l_shared, mbarrier, tok0, n_kv, q_len, q_base, pos0, num_blocks, Out, Lse,
                  by):
        # warpgroup 1: tiles 2i + 1 (stage 1), output columns value window [H, D) = row[R + H:W]
        acc_s, _, acc_o, m, m_prev, m_peer, alpha, l, l_tile = consumer_state(False)
        for i in T.serial(T.ceildiv(num_blocks, 2)):
            scores(1, Q_shared, KV, acc_s, mbarrier, i, 2 * i + 1, num_blocks, n_kv, q_len, pos0, tok0)
            # m1 = max(m0, this tile), decided against m0, handed back
            T.copy(m, m_prev)
            T.reduce_max(acc_s, m, dim=1, clear=True)
            T.barrier_wait(mbarrier[MAX + 0], i & 1)
            T.copy(m_shared[0, :], m_peer)
            for r in T.Parallel(block_M):
                m[r] = T.max(m[r], m_peer[r])
            lazy_max(m, m_peer)
            T.copy(m, m_shared[1, :])
            T.barrier_arrive(mbarrier[MAX + 1])
            softmax_rows(acc_s, m, m_prev, alpha, l, l_tile)
            T.copy(acc_s, KV[1, :, 0:block_N])  # P1 over K_rot's first 64 columns, for both P.Vs
            T.fence_proxy_async()
            T.barrier_arrive(mbarrier[P_READY + 1])
            rescale(acc_o, alpha)
            value_gemms.pair(KV, acc_o, mbarrier, i, num_blocks)
        epilogue(1, acc_o, m, l, l_tile, l_shared, mbarrier, num_blocks, tok0, q_len, q_base, Out, Lse, by)

    @T.macro
    def load_part(Pool, KV, mbarrier, part, i, tile, num_blocks, PageIds, req, by):
        # one released part of a stage, by TMA onto its mbarrier (a tile past the last: the arrival alone)
        T.barrier_wait(mbarrier[FREE + part], (i & 1) ^ 1)
        if tile < num_blocks:
            page = PageIds[req, (tile * block_N) // page_size]
            off = (tile * block_N) % page_size
            for lo, hi in part_columns(geom, part):
                T.tma_copy(Pool[page, by, off:off + block_N, lo:hi], KV[part % 2, :, lo:hi],
                           barrier=mbarrier[LOADED + part])
        if T.shuffle_elect(128):  # the thread that set the barrier's expected bytes, after it
            T.barrier_arrive(mbarrier[LOADED + part])

    @T.macro
    def attention(Q, Pool, PageIds, SeqLens, QStart, QLens, TileReq, TileTok, Out, Lse):
        with T.Kernel(NT, HKV, threads=384) as (bx, by):
            T.import_source(producer_guard.imported_source())  # the producer loop in the warp that issues the TMA
            Q_shared = T.alloc_shared([block_M, D], dtype)  # score-window order
            KV = T.alloc_shared([2, block_N, W], dtype)  # two stages of the row; P over each stage's [:, 0:64]
            m_shared = T.alloc_shared([2, block_M], accum)
            l_shared = T.alloc_shared([2, block_M], accum)
            mbarrier = T.alloc_barrier(arrive_count=ARRIVALS)
            req, tok0, n_kv, q_len, q_base, pos0 = tile_coords(TileReq, TileTok, SeqLens, QLens, QStart, bx)
            num_blocks = T.ceildiv(pos0 + T.min(tok0 + TOK, q_len), block_N)
            tx = T.get_thread_binding()

            # row r = (token tok0 + r // G, head by * G + r % G); tokens past the chunk repeat its last token
            for r, d in T.Parallel(block_M, D):
                Q_shared[r, d] = Q[q_base + T.min(tok0 + r // G, q_len - 1), by * G + r % G, d]
            T.barrier_arrive(mbarrier[QUERY])
            T.barrier_wait(mbarrier[QUERY], 0)

            if tx < 128:  # the producer warpgroup first, as TileLang's warp specialisation places it
                T.set_max_nreg(PRODUCER_REGS, 0)
                for i in T.serial(T.ceildiv(num_blocks, 2)):
                    # in the order the parts are released: FlashMLA's V0L, V1R, V0R, V1L
                    load_part(Pool, KV, mbarrier, X0, i, 2 * i, num_blocks, PageIds, req, by)
                    load_part(Pool, KV, mbarrier, X1, i, 2 * i + 1, num_blocks, PageIds, req, by)
                    load_part(Pool, KV, mbarrier, Y0, i, 2 * i, num_blocks, PageIds, req, by)
                    load_part(Pool, KV, mbarrier, Y1, i, 2 * i + 1, num_blocks, PageIds, req, by)
            elif tx < 256:
                consumer0(Q_shared, KV, m_shared, l_shared, mbarrier, tok0, n_kv, q_len, q_base, pos0, num_blocks,
                          Out, Lse, by)
            else:
                consumer1(Q_shared, KV, m_shared, l_shared, mbarrier, tok0, n_kv, q_len, q_base, pos0, num_blocks,
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




@hands_out("prefill_{fmt}")
def build(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, *, page_size: int = 64,
          block_N: int = 64, max_slack_log2: float | None = 8.0):
    """Compile (JIT) the bf16 folded prefill for `geom` (`fmt` must be folded: split's is prefill_attention's)."""
    if KvFormat.parse(fmt) is not KvFormat.FOLDED:
        raise ValueError(f"prefill_folded.build makes the folded prefill; got {fmt} (split: prefill_attention.build)")
    return compile_program(program(geom, page_size=page_size, block_N=block_N, max_slack_log2=max_slack_log2))
