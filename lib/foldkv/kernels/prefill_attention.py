"""The paged causal prefill kernel of a split pool and of an FP8 folded pool read in-kernel (its e4m3 rows converted
exactly to bf16 tiles; a bf16 folded pool's is prefill_folded.py's): one CTA = 8 query tokens x the 8 query heads of
one KV group, streaming the request's pages in `block_N`-key tiles; the folded accumulator is in value-window order,
put back in head order by the epilogue's store addressing (`head_column_of`). Why each choice:
kernels/PREFILL_SCHEDULE.md.

Kernel arguments, in order (the AOT loader relies on it):
  Q       [Tq, 32, 512] bf16   query in the format's form, request r's rows at q_start[r]..q_start[r]+q_len[r]
  Pool    [P, 4, page, W] bf16 (W = 1024 split, 640 folded); e4m3 for prefill_folded_fp8
  Scales  [P, 4, page] float32 (prefill_folded_fp8 only: one scale per token x KV head, right after Pool)
  PageIds [B, MP] int32, SeqLens [B] int32, QStart [B] int32, QLens [B] int32
  TileReq [NT] int32, TileTok [NT] int32   (tile t covers tokens TileTok[t].. +8 of request TileReq[t])
  Out     [Tq, 32, 512] bf16 (head order), Lse [Tq, 32] float32 (natural log)
Grid (NT, 4 KV heads), 256 consumer threads plus the producer warpgroup TileLang adds for the TMA loads.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from dataclasses import dataclass
from typing import Any

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat, row_width
from . import macros, producer_guard, registry
from .cuda_checks import check_e4m3_conversion
from .decode_partial import FP8_PANEL, Run, fp8_row_macro
from .registry import hands_out
from .tl import compile_program, prim_func, require_tilelang


def check_geometry(geom: AttentionGeometry, fmt: KvFormat) -> None:
    if fmt is KvFormat.FOLDED and (geom.head_dim, geom.rotary_width, geom.group_size) != (512, 128, 8):
        raise NotImplementedError(f"prefill_folded is generated for head_dim 512, rotary width 128, GQA 8; got"
                                  f" {geom.head_dim}, {geom.rotary_width}, {geom.group_size}")
    if (geom.head_dim, geom.group_size) != (512, 8):
        raise NotImplementedError(f"prefill_split is generated for head_dim 512, GQA 8; got {geom.head_dim},"
                                  f" {geom.group_size}")


@dataclass(frozen=True)
class ScoreGemm:
    """S [M, N] += query key^T (not a tuple: a loop bound to buffers would rename them after its variables)."""
    query: Any
    key: Any


@dataclass(frozen=True)
class KeyBlock:
    """A format's shared tiles for one key block and which feeds which gemm."""
    query: tuple  # Runs of the query's score window (shared tiles, loaded once)
    row: tuple  # Runs of the row: one TMA copy each, in load order
    scores: tuple  # ScoreGemms, summed over the score window
    values: tuple  # key tiles feeding the output, in value-window order (one accumulator each)
    convert: tuple = ()  # Converts: an FP8 row's e4m3 panels into the bf16 tiles of the gemms
    token_scale: Any = None  # [N] float32 shared: an FP8 row's scale per token (None: bf16 rows)


@dataclass(frozen=True)
class Accumulator:
    """Output columns [col, col + width) of the value window in float32, and the key tile that feeds them."""
    acc: Any
    row_tile: Any
    col: int


def key_block_macro(geom: AttentionGeometry, fmt: KvFormat, block_M: int, block_N: int, fp8: bool = False):
    """A macro allocating the query's and a key block's tiles of `fmt` rows (under the emitted CUDA's names) and
    returning the KeyBlock: split's two windows, or (`fp8`) an FP8 folded row (`fp8_row_macro`). A bf16 folded row's
    block is a version's (`key_block`: bench/versions/prefill_folded_two_stages.py)."""
    import tilelang.language as T

    D, R = geom.head_dim, geom.rotary_width
    U = D - R
    dtype = "bfloat16"

    @T.macro
    def window_block():
        Q_shared = T.alloc_shared([block_M, D], dtype)  # score-window order
        K_shared = T.alloc_shared([block_N, D], dtype)  # row[0:512]
        V_shared = T.alloc_shared([block_N, D], dtype)  # row[512:1024]
        return KeyBlock(query=(Run(Q_shared, 0, D),), row=(Run(K_shared, 0, D), Run(V_shared, D, D + D)),
                        scores=(ScoreGemm(Q_shared, K_shared),), values=(V_shared,))

    fp8_row = fp8_row_macro(geom, block_N)

    @T.macro
    def folded_fp8_block():
        q_rot = T.alloc_shared([block_M, R], dtype)  # [64, 128] score window [0, R)
        q_unrot = T.alloc_shared([block_M, U], dtype)  # [64, 384] score window [R, D): q_unrot * w_k
        row = fp8_row()  # its tiles used as row.<name>: bound to another name, a buffer would be renamed after it
        return KeyBlock(query=(Run(q_rot, 0, R), Run(q_unrot, R, D)), row=row.row,
                        scores=(ScoreGemm(q_rot, row.k_rot), ScoreGemm(q_unrot, row.v_unrot)),
                        values=(row.v_unrot, row.v_rot), convert=row.convert, token_scale=row.scale)

    if fp8 and fmt is not KvFormat.FOLDED:
        raise ValueError("FP8 rows are folded only (foldkv.pool.PagedKvLayout refuses an FP8 split pool)")
    if not fp8 and fmt is not KvFormat.SPLIT:
        raise ValueError("a bf16 folded row's prefill is prefill_folded.py's (a version brings its own key_block)")
    return folded_fp8_block if fp8 else window_block


def accumulators_macro(block_M: int, D: int, fp8: bool = False):
    """The float32 output accumulators (value-window order), one per value tile of the key block."""
    import tilelang.language as T

    accum = "float32"

    @T.macro
    def window_accumulators(block):
        acc_o = T.alloc_fragment([block_M, D], accum)  # value-window order
        return (Accumulator(acc_o, block.values[0], 0),)

    @T.macro
    def folded_fp8_accumulators(block):
        acc_o_unrot = T.alloc_fragment([block_M, block.values[0].shape[1]], accum)  # value window [0, U)
        acc_o_rot = T.alloc_fragment([block_M, block.values[1].shape[1]], accum)  # value window [U, D)
        return (Accumulator(acc_o_unrot, block.values[0], 0),
                Accumulator(acc_o_rot, block.values[1], block.values[0].shape[1]))

    return folded_fp8_accumulators if fp8 else window_accumulators


def lazy_rescale_macro():
    """The output accumulators' rescale before P.V, skipped by a thread whose rows' rescales are all exactly 1 (the
    softmax's running max stood; PREFILL_SCHEDULE.md, "The lazy max")."""
    import tilelang.language as T

    @T.macro
    def rescale_outputs(outs, rescale):
        moved = T.alloc_local([1], "int32")
        moved[0] = 0
        for q in T.Parallel(rescale.shape[0]):
            if rescale[q] != T.float32(1):
                moved[0] = 1
        if moved[0] != 0:
            for out in outs:
                for i, d in T.Parallel(out.acc.shape[0], out.acc.shape[1]):
                    out.acc[i, d] *= rescale[i]

    return rescale_outputs


def causal_mask_macro(block_N: int):
    """The causal mask (scores, keep, the tile k, the CTA's first row position): `macros.mask_scores_macro` only on
    the tiles that cross the CTA's diagonal. Its rows sit at first_pos or later, so a tile whose last key is at or
    before first_pos keeps every score (and holds no key past the sequence). Of ~500 tiles a CTA walks at 32K, one or
    two cross the diagonal; the per-score select, with the tensor cores idle, was ~5% of the kernel on every tile."""
    import tilelang.language as T

    mask_scores = macros.mask_scores_macro()

    @T.macro
    def mask(scores, keep, k, first_pos):  # k: the key tile (the loop's own name, which TileLang would rename)
        if (k + 1) * block_N - 1 > first_pos:
            mask_scores(scores, keep)

    return mask


def tile_coords_macro():
    """(req, tok0, n_kv, q_len, q_base, pos0) of a CTA's tile: tokens tok0.. of request req, whose n_kv keys end with
    its q_len queries (rows q_base.. of the query), the first of them at causal position pos0."""
    import tilelang.language as T

    @T.macro
    def tile_coords(TileReq, TileTok, SeqLens, QLens, QStart, bx):
        req = TileReq[bx]
        tok0 = TileTok[bx]
        n_kv = SeqLens[req]
        q_len = QLens[req]
        q_base = QStart[req]
        pos0 = n_kv - q_len  # bottom-right aligned
        return req, tok0, n_kv, q_len, q_base, pos0

    return tile_coords


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


def prefill_program(geom: AttentionGeometry, fmt: KvFormat | str, *, page_size: int = 64, block_N: int = 64,
                    num_stages: int = 1, threads: int = 256, fp8: bool = False, key_block=None, softmax=None,
                    rescale=None, mask=None):
    """The TileLang prim_func of the prefill; `fp8`: over an FP8 folded pool. A version's hook points (None: the
    library's): `key_block`, `softmax`, `mask` (the signatures of `key_block_macro`, `macros.online_softmax_macro`,
    `causal_mask_macro`) and `rescale` (a macro (accumulators, rescale), e.g. `lazy_rescale_macro`; the library's is
    inline: as a macro it would rename the emitted CUDA's reduction workspaces)."""
    fmt = KvFormat.parse(fmt)
    check_geometry(geom, fmt)
    require_tilelang()
    import tilelang.language as T

    if page_size % block_N:
        raise ValueError(f"page_size {page_size} must be a multiple of block_N {block_N}")
    D = geom.head_dim
    HQ, HKV, G = geom.num_q_heads, geom.num_kv_heads, geom.group_size
    W = row_width(geom, fmt)
    block_M = 64
    TOK = block_M // G  # query tokens per tile (8)
    dtype, accum = "bfloat16", "float32"
    head_column = head_column_of(geom, fmt)

    Tq, NP, B, MP, NT = T.dynamic("Tq, NP, B, MP, NT")
    key_block = (key_block or key_block_macro)(geom, fmt, block_M, block_N, fp8=fp8)
    accumulators = accumulators_macro(block_M, D, fp8=fp8)
    convert_e4m3 = macros.convert_e4m3_macro(block_N, FP8_PANEL, threads)  # by every consumer thread
    online_softmax = softmax or macros.online_softmax_macro(key_dim=1, fold_scale=True)
    mask_tile = mask or causal_mask_macro(block_N)
    zero_rows = macros.zero_rows_macro()
    tile_coords = tile_coords_macro()

    @T.macro
    def load_query(Q, pieces, q_base, tok0, q_len, kv_head):
        # row i = (token tok0 + i // G, head kv_head * G + i % G); tokens past the chunk repeat its last token
        # (computed, never stored) so every row has a valid causal position and no row is all -inf.
        for piece in pieces:
            for i, d in T.Parallel(block_M, piece.hi - piece.lo):
                piece.tile[i, d] = Q[q_base + T.min(tok0 + i // G, q_len - 1), kv_head * G + i % G, piece.lo + d]

    @T.macro
    def attention(Q, Pool, Scales, PageIds, SeqLens, QStart, QLens, TileReq, TileTok, Out, Lse):
        with T.Kernel(NT, HKV, threads=threads) as (bx, by):
            T.import_source(producer_guard.imported_source(macros.E4M3_TO_BF16_SOURCE if fp8 else None))
            block = key_block()
            P_shared = T.alloc_shared([block_M, block_N], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum)
            outs = accumulators(block)
            m = T.alloc_fragment([block_M], accum)
            m_prev = T.alloc_fragment([block_M], accum)
            alpha = T.alloc_fragment([block_M], accum)
            row_sum = T.alloc_fragment([block_M], accum)
            l = T.alloc_fragment([block_M], accum)

            req, tok0, n_kv, q_len, q_base, pos0 = tile_coords(TileReq, TileTok, SeqLens, QLens, QStart, bx)

            load_query(Q, block.query, q_base, tok0, q_len, by)
            for out in outs:
                T.fill(out.acc, 0)
            T.fill(l, 0)
            T.fill(m, -T.infinity(accum))

            last_pos = pos0 + T.min(tok0 + TOK, q_len) - 1
            num_blocks = T.ceildiv(last_pos + 1, block_N)
            for k in T.Pipelined(num_blocks, num_stages=num_stages):
                page = PageIds[req, (k * block_N) // page_size]
                off = (k * block_N) % page_size
                # the score tile's copy first: the producer issues loads in this order and waits for each
                # buffer's release, so K (released after Q.K) is prefetched while the softmax and P.V run; an FP8
                # row's panels are released once converted, its scales after the softmax (so they come last)
                for run in block.row:
                    T.copy(Pool[page, by, off:off + block_N, run.lo:run.hi], run.tile)
                if block.token_scale is not None:
                    T.copy(Scales[page, by, off:off + block_N], block.token_scale)
                    convert_e4m3(block.convert)  # exact
                T.clear(acc_s)
                for score in block.scores:
                    T.gemm(score.query, score.key, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                if block.token_scale is not None:  # a token's row is its e4m3 values times its scale
                    for i, j in T.Parallel(block_M, block_N):
                        acc_s[i, j] *= block.token_scale[j]
                # the CTA's rows are at pos0 + tok0 or later (rows past the chunk repeat its last token)
                mask_tile(acc_s, lambda i, j: k * block_N + j <= pos0 + T.min(tok0 + i // G, q_len - 1), k,
                          pos0 + tok0)
                # P.V over scaled rows: the scale goes on P's column (keys past the sequence: 0, whatever it holds)
                key_weight = None if block.token_scale is None else (
                    lambda j: T.if_then_else(k * block_N + j < n_kv, block.token_scale[j], 0.0))
                online_softmax(acc_s, P_shared, m, m_prev, alpha, row_sum, l, key_weight)
                if (k + 1) * block_N > n_kv:
                    for out in outs:
                        zero_rows(out.row_tile, lambda j: k * block_N + j < n_kv)
                if rescale is None:
                    for out in outs:
                        for i, d in T.Parallel(block_M, out.acc.shape[1]):
                            out.acc[i, d] *= alpha[i]
                else:
                    rescale(outs, alpha)
                for out in outs:
                    T.gemm(P_shared, out.row_tile, out.acc, policy=T.GemmWarpPolicy.FullCol)

            # epilogue: normalise, value-window order -> head order, store only the chunk's real tokens
            for out in outs:
                for i, d in T.Parallel(block_M, out.acc.shape[1]):
                    if tok0 + i // G < q_len:
                        Out[q_base + tok0 + i // G, by * G + i % G, head_column(out.col + d)] = out.acc[i, d] / l[i]
            for i in T.Parallel(block_M):
                if tok0 + i // G < q_len:
                    Lse[q_base + tok0 + i // G, by * G + i % G] = m[i] + T.log2(l[i]) * macros.LN2

    args = {
        "Q": T.Tensor([Tq, HQ, D], dtype),
        "Pool": T.Tensor([NP, HKV, page_size, W], "float8_e4m3" if fp8 else dtype),
        **({"Scales": T.Tensor([NP, HKV, page_size], accum)} if fp8 else {}),  # an FP8 row's scale per token
        "PageIds": T.Tensor([B, MP], "int32"),
        **{name: T.Tensor([B], "int32") for name in ("SeqLens", "QStart", "QLens")},
        **{name: T.Tensor([NT], "int32") for name in ("TileReq", "TileTok")},
        "Out": T.Tensor([Tq, HQ, D], dtype),
        "Lse": T.Tensor([Tq, HQ], accum),
    }
    main = prim_func("main", args, lambda b: attention(b["Q"], b["Pool"], b.get("Scales"),
                                                       *(b[n] for n in args if n not in ("Q", "Pool", "Scales"))))
    return main.with_attr("global_symbol", f"prefill_{fmt.value}_fp8") if fp8 else main


@hands_out("prefill_{fmt}")
def build(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.SPLIT, *, page_size: int = 64,
          block_N: int = 64, num_stages: int = 1, threads: int = 256):
    """Compile (JIT) the prefill kernel for `geom` over a bf16 split pool (`fmt`: split; folded is prefill_folded's)."""
    return compile_program(prefill_program(geom, KvFormat.parse(fmt), page_size=page_size, block_N=block_N,
                                           num_stages=num_stages, threads=threads))


@hands_out("prefill_{fmt}_fp8")
def build_fp8(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, **tiling):
    """Compile (JIT) the prefill kernel over an FP8 folded pool with its registered params, overridden by `tiling`."""
    fmt = KvFormat.parse(fmt)
    kernel = compile_program(prefill_program(geom, fmt, **{**registry.get(f"prefill_{fmt.value}_fp8").params, **tiling},
                                             fp8=True))
    check_e4m3_conversion(f"prefill_{fmt.value}_fp8", kernel.get_kernel_source(), macros.CONVERT_BARRIER_ID)
    return kernel
