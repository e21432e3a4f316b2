"""Folded prefill, 640 columns per key: tiles K_rot = row[0:128] and V_win = row[128:640], scores =
q_rot . K_rot + q_unrot . V_win[:, :384]. Lost to the library's two full windows (K_win = row[0:512], V_win =
row[128:640], the 384 shared columns read twice from L2); kept to time it.

What it tried (bench/PREFILL_NOTES.md, runs 1-3): read each key's 640 folded columns once instead of 1,024, so the
folded prefill moves fewer L2 bytes than split.

Prediction: folded faster than split (fewer L2 bytes per key); folded ~330 TFLOP/s.

Measured (H200, one 8,192-token chunk ending at 163,336 tokens, one layer, median of 7 interleaved rounds):
    run 2  "shared", V copy first        278.0 ms  307.6 TFLOP/s
    run 3  "shared", K copy first        252.0 ms  339.3 TFLOP/s   (1.94x FlashInfer)
    run 3  "windows" (library default)   199.6 ms  428.3 TFLOP/s   (2.45x FlashInfer; split 200.1 ms)
Outcome: wrong. V_win is needed by Q.K (its first 384 columns are V_unrot) and released only after P.V, so with the
one stage that fits in 227 KiB at block_N 64 its load cannot be prefetched: what limits is the producer's order and
the buffers' release points, not L2 bytes. The windows layout costs 1,024 columns per key from L2 but only 640 from
HBM and runs at split's speed. Not tried: two stages at block_N 48, or splitting P.V so V_unrot is released first.

    python bench/versions/prefill_shared_tiles.py      # build (the library prefill's argument order)
`prefill_harness.py` (tag bn64s1-shared) times it through the prefill launcher's public `kernels=`.
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros, producer_guard
from foldkv.kernels.prefill_attention import check_geometry, head_column_of
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat, row_width


NUM_STAGES = 1  # the query's 64 KiB beside the row's 80 KiB: two stages would take 232 KiB of the 227


def build(geom: AttentionGeometry = GEMMA4_31B, *, page_size: int = 64, block_N: int = 64, threads: int = 256,
          num_stages: int = NUM_STAGES, reduce_batch: int = 1, max_slack_log2: float | None = None):
    """Compile the shared-tile folded prefill for `geom`; same arguments as foldkv.kernels.prefill_attention. The
    harnesses pass the library's registered params through; `num_stages`, `reduce_batch` and `max_slack_log2` are the
    library's row (two stages, its softmax) and not this version's, which is measured with NUM_STAGES and the plain
    softmax whatever they say."""
    num_stages = NUM_STAGES
    fmt = KvFormat.FOLDED
    check_geometry(geom, fmt)
    tilelang = require_tilelang()
    import tilelang.language as T

    if page_size % block_N:
        raise ValueError(f"page_size {page_size} must be a multiple of block_N {block_N}")
    D, R = geom.head_dim, geom.rotary_width
    U = D - R
    HQ, HKV, G = geom.num_q_heads, geom.num_kv_heads, geom.group_size
    W = row_width(geom, fmt)
    block_M = 64
    TOK = block_M // G
    dtype, accum = "bfloat16", "float32"
    head_column = head_column_of(geom, fmt)

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def prefill_shared_tiles(page_size, block_N, num_stages, threads):
        Tq, NP, B, MP, NT = T.dynamic("Tq, NP, B, MP, NT")
        online_softmax = macros.online_softmax_macro(key_dim=1, fold_scale=True)
        mask_scores = macros.mask_scores_macro()
        zero_rows = macros.zero_rows_macro()

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
                T.import_source(producer_guard.imported_source())
                Q_shared = T.alloc_shared([block_M, D], dtype)
                K_rot = T.alloc_shared([block_N, R], dtype)  # row[0:128]; V_unrot is read from V_win
                V_win = T.alloc_shared([block_N, D], dtype)  # row[128:640] = [V_unrot | V_rot]
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
                pos0 = n_kv - q_len

                for i, d in T.Parallel(block_M, D):
                    Q_shared[i, d] = Q[q_base + T.min(tok0 + i // G, q_len - 1), by * G + i % G, d]
                T.fill(acc_o, 0)
                T.fill(l, 0)
                T.fill(m, -T.infinity(accum))

                last_pos = pos0 + T.min(tok0 + TOK, q_len) - 1
                num_blocks = T.ceildiv(last_pos + 1, block_N)
                for k in T.Pipelined(num_blocks, num_stages=num_stages):
                    page = PageIds[req, (k * block_N) // page_size]
                    off = (k * block_N) % page_size
                    T.copy(Pool[page, by, off:off + block_N, 0:R], K_rot)
                    T.copy(Pool[page, by, off:off + block_N, R:W], V_win)
                    T.clear(acc_s)
                    T.gemm(Q_shared[:, 0:R], K_rot, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(Q_shared[:, R:D], V_win[:, 0:U], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                    mask_scores(acc_s, lambda i, j: k * block_N + j <= pos0 + T.min(tok0 + i // G, q_len - 1))
                    online_softmax(acc_s, P_shared, m, m_prev, alpha, row_sum, l)
                    if (k + 1) * block_N > n_kv:
                        zero_rows(V_win, lambda j: k * block_N + j < n_kv)
                    for i, d in T.Parallel(block_M, D):
                        acc_o[i, d] *= alpha[i]
                    T.gemm(P_shared, V_win, acc_o, policy=T.GemmWarpPolicy.FullCol)

                for i, d in T.Parallel(block_M, D):
                    if tok0 + i // G < q_len:
                        Out[q_base + tok0 + i // G, by * G + i % G, head_column(d)] = acc_o[i, d] / l[i]
                for i in T.Parallel(block_M):
                    if tok0 + i // G < q_len:
                        Lse[q_base + tok0 + i // G, by * G + i % G] = m[i] + T.log2(l[i]) * macros.LN2

        return main

    return prefill_shared_tiles(page_size, block_N, num_stages, threads)


def main():
    kernel = build(GEMMA4_31B)
    print(f"prefill_folded shared tiles (num_stages {NUM_STAGES}): {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
