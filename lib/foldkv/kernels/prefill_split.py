"""Paged causal prefill over a SPLIT pool (row = [K 512 | V 512], head order), GQA, head_dim 512.

One CTA = one tile of `block_M` = 8 query tokens x 8 query heads of one KV group (the group's heads share every key
tile, so a one-token chunk still fills 8 of the 64 MMA rows), streaming the request's pages in `block_N`-key tiles:
K = row[0:512] for the scores, V = row[512:1024] for the values, output already in head order.

Kernel argument order (the AOT loader relies on it):
  Q       [Tq, 32, 512] bf16   split query (head order), request r's rows at q_start[r]..q_start[r]+q_len[r]
  Pool    [P, 4, page, 1024] bf16
  PageIds [B, MP] int32, SeqLens [B] int32, QStart [B] int32, QLens [B] int32
  TileReq [NT] int32, TileTok [NT] int32   (tile t covers tokens TileTok[t].. +8 of request TileReq[t])
  Out     [Tq, 32, 512] bf16 (head order), Lse [Tq, 32] float32 (natural log)
Grid (NT, 4 KV heads), 256 consumer threads (two warpgroups split the key / output columns; the MLA-decode
arrangement) plus the producer warpgroup TileLang adds for the TMA loads.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from ..config import GEMMA4_31B, AttentionGeometry
from .registry import hands_out
from .tl import pass_configs, require_tilelang, target

# Tuning constants baked into a build (the registry records them; the AOT build compiles the same).
DEFAULTS = dict(page_size=64, block_N=64, num_stages=1, threads=256)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _check_geometry(geom: AttentionGeometry) -> None:
    if (geom.head_dim, geom.group_size) != (512, 8):
        raise NotImplementedError(
            f"prefill_split is generated for head_dim 512, GQA 8; got {geom.head_dim}, {geom.group_size}"
        )


@hands_out("prefill_split")
def build(geom: AttentionGeometry = GEMMA4_31B, *, page_size: int = 64, block_N: int = 64, num_stages: int = 1,
          threads: int = 256, arch: str | None = None):
    """Compile (JIT) the split prefill kernel for `geom`; returns a TileLang kernel taking the arguments above."""
    _check_geometry(geom)
    tilelang = require_tilelang()
    import tilelang.language as T

    if page_size % block_N:
        raise ValueError(f"page_size {page_size} must be a multiple of block_N {block_N}")
    D = geom.head_dim
    HQ, HKV, G = geom.num_q_heads, geom.num_kv_heads, geom.group_size
    W = 2 * D  # split row width (1024)
    block_M = 64
    TOK = block_M // G  # query tokens per tile (8)
    dtype, accum = "bfloat16", "float32"

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_split(page_size, block_N, num_stages, threads):
        Tq, NP, B, MP, NT = T.dynamic("Tq, NP, B, MP, NT")

        @T.macro
        def load_query(Q, Q_shared, q_base, tok0, q_len, kv_head):
            # row i = (token tok0 + i // G, head kv_head * G + i % G); tokens past the chunk repeat its last token
            # (computed, never stored) so every row has a valid causal position and no row is all -inf.
            for i, d in T.Parallel(block_M, D):
                Q_shared[i, d] = Q[q_base + T.min(tok0 + i // G, q_len - 1), kv_head * G + i % G, d]

        @T.macro
        def online_softmax(acc_s, P_shared, m, m_prev, alpha, row_sum, l):
            # scores are in natural units (Gemma 4 scaling 1.0); exp2 with log2(e) folded into one FMA
            T.copy(m, m_prev)
            T.reduce_max(acc_s, m, dim=1, clear=False)
            for i in T.Parallel(block_M):
                alpha[i] = T.exp2((m_prev[i] - m[i]) * LOG2E)
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * LOG2E - m[i] * LOG2E)
            T.reduce_sum(acc_s, row_sum, dim=1)
            for i in T.Parallel(block_M):
                l[i] = l[i] * alpha[i] + row_sum[i]
            T.copy(acc_s, P_shared)

        @T.prim_func
        def main(
            Q: T.Tensor([Tq, HQ, D], dtype),
            Pool: T.Tensor([NP, HKV, page_size, W], dtype),
            PageIds: T.Tensor([B, MP], "int32"),
            SeqLens: T.Tensor([B], "int32"),
            QStart: T.Tensor([B], "int32"),
            QLens: T.Tensor([B], "int32"),
            TileReq: T.Tensor([NT], "int32"),
            TileTok: T.Tensor([NT], "int32"),
            Out: T.Tensor([Tq, HQ, D], dtype),
            Lse: T.Tensor([Tq, HQ], accum),
        ):
            with T.Kernel(NT, HKV, threads=threads) as (bx, by):
                Q_shared = T.alloc_shared([block_M, D], dtype)
                K_shared = T.alloc_shared([block_N, D], dtype)
                V_shared = T.alloc_shared([block_N, D], dtype)
                P_shared = T.alloc_shared([block_M, block_N], dtype)
                acc_s = T.alloc_fragment([block_M, block_N], accum)
                acc_o = T.alloc_fragment([block_M, D], accum)
                m = T.alloc_fragment([block_M], accum)
                m_prev = T.alloc_fragment([block_M], accum)
                alpha = T.alloc_fragment([block_M], accum)
                row_sum = T.alloc_fragment([block_M], accum)
                l = T.alloc_fragment([block_M], accum)

                req = TileReq[bx]
                tok0 = TileTok[bx]
                n_kv = SeqLens[req]
                q_len = QLens[req]
                q_base = QStart[req]
                pos0 = n_kv - q_len  # causal position of the chunk's first query (bottom-right aligned)

                load_query(Q, Q_shared, q_base, tok0, q_len, by)
                T.fill(acc_o, 0)
                T.fill(l, 0)
                T.fill(m, -T.infinity(accum))

                last_pos = pos0 + T.min(tok0 + TOK, q_len) - 1
                num_blocks = T.ceildiv(last_pos + 1, block_N)
                for k in T.Pipelined(num_blocks, num_stages=num_stages):
                    page = PageIds[req, (k * block_N) // page_size]
                    off = (k * block_N) % page_size
                    T.copy(Pool[page, by, off:off + block_N, 0:D], K_shared)
                    T.copy(Pool[page, by, off:off + block_N, D:W], V_shared)
                    T.clear(acc_s)
                    T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                    for i, j in T.Parallel(block_M, block_N):
                        acc_s[i, j] = T.if_then_else(
                            k * block_N + j <= pos0 + T.min(tok0 + i // G, q_len - 1), acc_s[i, j], -T.infinity(accum)
                        )
                    online_softmax(acc_s, P_shared, m, m_prev, alpha, row_sum, l)
                    if (k + 1) * block_N > n_kv:
                        # slots past the sequence hold arbitrary bits: 0 * NaN would poison every row. A read-modify-
                        # write (not a plain store) so the warp-specialised pipeline waits for the tile's TMA first.
                        for j, d in T.Parallel(block_N, D):
                            V_shared[j, d] = T.if_then_else(k * block_N + j < n_kv, V_shared[j, d], T.cast(0, dtype))
                    for i, d in T.Parallel(block_M, D):
                        acc_o[i, d] *= alpha[i]
                    T.gemm(P_shared, V_shared, acc_o, policy=T.GemmWarpPolicy.FullCol)

                # epilogue: normalise and store only the chunk's real tokens (head order already)
                for i, d in T.Parallel(block_M, D):
                    if tok0 + i // G < q_len:
                        Out[q_base + tok0 + i // G, by * G + i % G, d] = acc_o[i, d] / l[i]
                for i in T.Parallel(block_M):
                    if tok0 + i // G < q_len:
                        Lse[q_base + tok0 + i // G, by * G + i % G] = m[i] + T.log2(l[i]) * LN2

        return main

    return prefill_split(page_size, block_N, num_stages, threads)
