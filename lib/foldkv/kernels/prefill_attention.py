"""Paged causal prefill for either page format, GQA, head_dim 512: scores from the score window, values from the value
window of each row.

One CTA = one tile of `block_M` = 8 query tokens x 8 query heads of one KV group (the group's heads share every key
tile, so a one-token chunk still fills 8 of the 64 MMA rows), streaming the request's pages in `block_N`-key tiles,
two TMA tiles per key block (`windows`):
    SPLIT  (row [K 512 | V 512]): K = row[0:512], V = row[512:1024]; the output is already in head order.
    FOLDED (row [K_rot 128 | V_unrot 384 | V_rot 128]): K_win = row[0:512] against the folded query
           [q_rot | q_unrot * w_k] (the w_k fold is in the query), V_win = row[128:640]. The same shapes, gemms and
           pipeline as split (the 384 shared columns are read twice from L2, once from HBM); the accumulator is in
           value-window order and the epilogue's store addressing puts it back in head order: window [0,192) ->
           head [64,256), [192,384) -> [320,512), [384,448) -> [0,64), [448,512) -> [256,320).
A folded tiling that loads the shared columns once lost (bench/versions/prefill_shared_tiles.py).

Kernel argument order (the AOT loader relies on it):
  Q       [Tq, 32, 512] bf16   query in the format's form, request r's rows at q_start[r]..q_start[r]+q_len[r]
  Pool    [P, 4, page, W] bf16 (W = 1024 split, 640 folded)
  PageIds [B, MP] int32, SeqLens [B] int32, QStart [B] int32, QLens [B] int32
  TileReq [NT] int32, TileTok [NT] int32   (tile t covers tokens TileTok[t].. +8 of request TileReq[t])
  Out     [Tq, 32, 512] bf16 (head order), Lse [Tq, 32] float32 (natural log)
Grid (NT, 4 KV heads), 256 consumer threads (two warpgroups split the key / output columns; the MLA-decode
arrangement) plus the producer warpgroup TileLang adds for the TMA loads.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from dataclasses import dataclass
from typing import Any

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat, row_width
from . import macros
from . import registry
from .registry import hands_out
from .tl import pass_configs, require_tilelang, target

# The registered tuning constants (the same for both formats; the AOT build compiles the same).
DEFAULTS = dict(registry.get("prefill_folded").params)


def check_geometry(geom: AttentionGeometry, fmt: KvFormat) -> None:
    if fmt is KvFormat.FOLDED and (geom.head_dim, geom.rotary_width, geom.group_size) != (512, 128, 8):
        raise NotImplementedError(
            f"prefill_folded is generated for head_dim 512, rotary width 128, GQA 8; got {geom.head_dim},"
            f" {geom.rotary_width}, {geom.group_size}"
        )
    if (geom.head_dim, geom.group_size) != (512, 8):
        raise NotImplementedError(
            f"prefill_split is generated for head_dim 512, GQA 8; got {geom.head_dim}, {geom.group_size}"
        )


@dataclass(frozen=True)
class Windows:
    """The two shared key tiles of a key block: the score window and the value window of its rows."""
    score: Any
    value: Any


def windows_macro(fmt: KvFormat, block_N: int, D: int, dtype: str):
    """Allocate the format's two window tiles, under the names the emitted CUDA uses."""
    import tilelang.language as T

    @T.macro
    def split_windows():
        K_shared = T.alloc_shared([block_N, D], dtype)  # row[0:512]
        V_shared = T.alloc_shared([block_N, D], dtype)  # row[512:1024]
        return Windows(K_shared, V_shared)

    @T.macro
    def folded_windows():
        K_win = T.alloc_shared([block_N, D], dtype)  # row[0:512]   = [K_rot | V_unrot]
        V_win = T.alloc_shared([block_N, D], dtype)  # row[128:640] = [V_unrot | V_rot]
        return Windows(K_win, V_win)

    return split_windows if fmt is KvFormat.SPLIT else folded_windows


def head_column_of(geom: AttentionGeometry, fmt: KvFormat):
    """Value-window position d -> head column, as a TIR expression (the identity for split)."""
    import tilelang.language as T

    if fmt is KvFormat.SPLIT:
        return lambda d: d
    D, R = geom.head_dim, geom.rotary_width
    U = D - R  # unrotated columns (384)
    HALF_U = U // 2  # 192: the unrotated columns are two runs of 192 in head order
    HALF_R = R // 2  # 64

    def head_column(d):
        # value window [V_unrot (384) | V_rot (128)] -> head: [0,192) -> [64,256), [192,384) -> [320,512),
        # [384,448) -> [0,64), [448,512) -> [256,320)
        return T.if_then_else(
            d < U, d + HALF_R + T.if_then_else(d < HALF_U, 0, HALF_R),
            d - U + T.if_then_else(d < U + HALF_R, 0, HALF_U))

    return head_column


@hands_out("prefill_{fmt}")
def build(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, *, page_size: int = 64,
          block_N: int = 64, num_stages: int = 1, threads: int = 256, arch: str | None = None):
    """Compile (JIT) the prefill kernel for `geom` and `fmt`; returns a TileLang kernel taking the arguments above."""
    fmt = KvFormat.parse(fmt)
    check_geometry(geom, fmt)
    tilelang = require_tilelang()
    import tilelang.language as T

    if page_size % block_N:
        raise ValueError(f"page_size {page_size} must be a multiple of block_N {block_N}")
    D = geom.head_dim
    HQ, HKV, G = geom.num_q_heads, geom.num_kv_heads, geom.group_size
    W = row_width(geom, fmt)
    V_LO = D if fmt is KvFormat.SPLIT else geom.rotary_width  # the value window row[V_LO:V_LO + D]
    block_M = 64
    TOK = block_M // G  # query tokens per tile (8)
    dtype, accum = "bfloat16", "float32"
    head_column = head_column_of(geom, fmt)

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill(page_size, block_N, num_stages, threads):
        Tq, NP, B, MP, NT = T.dynamic("Tq, NP, B, MP, NT")
        windows = windows_macro(fmt, block_N, D, dtype)
        online_softmax = macros.online_softmax_macro(key_dim=1, fold_scale=True)
        mask_scores = macros.mask_scores_macro()
        zero_rows = macros.zero_rows_macro()

        @T.macro
        def load_query(Q, Q_shared, q_base, tok0, q_len, kv_head):
            # row i = (token tok0 + i // G, head kv_head * G + i % G); tokens past the chunk repeat its last token
            # (computed, never stored) so every row has a valid causal position and no row is all -inf.
            for i, d in T.Parallel(block_M, D):
                Q_shared[i, d] = Q[q_base + T.min(tok0 + i // G, q_len - 1), kv_head * G + i % G, d]

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
                Q_shared = T.alloc_shared([block_M, D], dtype)  # score-window order
                win = windows()
                P_shared = T.alloc_shared([block_M, block_N], dtype)
                acc_s = T.alloc_fragment([block_M, block_N], accum)
                acc_o = T.alloc_fragment([block_M, D], accum)  # value-window order
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
                    # the score tile's copy first: the producer issues loads in this order and waits for each
                    # buffer's release, so K (released after Q.K) is prefetched while the softmax and P.V run
                    T.copy(Pool[page, by, off:off + block_N, 0:D], win.score)
                    T.copy(Pool[page, by, off:off + block_N, V_LO:V_LO + D], win.value)
                    T.clear(acc_s)
                    T.gemm(Q_shared, win.score, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                    mask_scores(acc_s, lambda i, j: k * block_N + j <= pos0 + T.min(tok0 + i // G, q_len - 1))
                    online_softmax(acc_s, P_shared, m, m_prev, alpha, row_sum, l)
                    if (k + 1) * block_N > n_kv:
                        zero_rows(win.value, lambda j: k * block_N + j < n_kv)
                    for i, d in T.Parallel(block_M, D):
                        acc_o[i, d] *= alpha[i]
                    T.gemm(P_shared, win.value, acc_o, policy=T.GemmWarpPolicy.FullCol)

                # epilogue: normalise, value-window order -> head order, store only the chunk's real tokens
                for i, d in T.Parallel(block_M, D):
                    if tok0 + i // G < q_len:
                        Out[q_base + tok0 + i // G, by * G + i % G, head_column(d)] = acc_o[i, d] / l[i]
                for i in T.Parallel(block_M):
                    if tok0 + i // G < q_len:
                        Lse[q_base + tok0 + i // G, by * G + i % G] = m[i] + T.log2(l[i]) * macros.LN2

        return main

    return prefill(page_size, block_N, num_stages, threads)


def main(fmt: KvFormat | str = KvFormat.FOLDED, context: int = 16384, chunk: int = 2048, **tiling):
    """Build with the defaults (or `tiling`); on a GPU, check one chunk at the end of `context` against the float64
    reference and time it."""
    import torch

    import foldkv
    from .prefill import prefill

    fmt = KvFormat.parse(fmt)
    kernel = build(GEMMA4_31B, fmt, **{**DEFAULTS, **tiling})
    built = f"prefill_{fmt.value} {dict(DEFAULTS, **tiling)}: {len(kernel.get_kernel_source())} chars of CUDA"
    if not torch.cuda.is_available():
        print(f"{built}; no CUDA device: not checked or timed")
        return kernel
    print(built)
    geom, dev = GEMMA4_31B, torch.device("cuda")
    torch.manual_seed(0)
    pool = foldkv.PagedKvPool(foldkv.PagedKvLayout(geom, fmt, 64, -(-context // 64)), device=dev)
    table = pool.allocate([context]).to(dev)
    kv = torch.randn(context, geom.num_kv_heads, geom.head_dim, device=dev)  # raw projections, prepped into rows
    foldkv.fill_sequences(pool, table, [kv], torch.rand(geom.head_dim, device=dev) + 0.5)
    q_lens = torch.tensor([chunk], dtype=torch.int32)
    query = (torch.randn(chunk, geom.num_q_heads, geom.head_dim, device=dev) * 0.05).to(torch.bfloat16)
    run = lambda: prefill(pool, query, table, q_lens, params=tiling)  # noqa: E731
    out, lse = run()
    want, want_lse = foldkv.paged_attention_reference(pool, query, table, q_lens, query_block=256)
    print(f"relative error {float((out.double() - want).norm() / want.norm()):.2e}, "
          f"max LSE error {float((lse.double() - want_lse).abs().max()):.2e}")
    from tilelang.profiler import do_bench  # TileLang's timer, in ms
    print(f"{do_bench(run):.2f} ms per {chunk}-token chunk at {context}")
    return kernel


if __name__ == "__main__":
    main()
