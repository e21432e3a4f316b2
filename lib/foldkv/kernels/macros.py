"""TileLang parts shared by the kernels: online softmax in the exp2 domain, masking a tile's rows or scores, the decode
query load, and the RoPE rotation of one rotate_half pair.

Each `*_macro` function returns a `@T.macro` for the given constants (TileLang is imported when it is called, never at
module import). Macro arguments are buffers or Python values: a TIR variable passed to a macro is renamed after the
macro's parameter (TileLang binds it), which would change the emitted CUDA, so a condition that reads the caller's
variables comes in as a Python function of the tile's indices instead.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

import math

LOG2E = math.log2(math.e)  # Gemma 4 global attention has scaling 1.0, so exp(s) = exp2(s * log2 e)
LN2 = math.log(2.0)


def online_softmax_macro(key_dim: int, *, scale: float = LOG2E, fold_scale: bool = False):
    """One key tile of the online softmax, in the exp2 domain: `scores` [rows, cols] holds one tile's scores with the
    keys along `key_dim` (0: token-major S^T, the decode partial; 1: S, the prefill); the running max and
    denominator (one per query) are updated, `rescale` gets the factor the output accumulator must be multiplied
    by, and the probabilities go to `p_shared` (the next gemm's operand), each key's times `key_weight(key)` when that
    function is given (a Python function of the key index: the denominators stay those of the probabilities).

    fold_scale: exp2(s * scale - max * scale) (one FMA per score, the prefill) instead of exp2((s - max) * scale)."""
    import tilelang.language as T

    def query_of(i, j):  # which running max a score [i, j] is normalised by
        return j if key_dim == 0 else i

    @T.macro
    def online_softmax(scores, p_shared, run_max, run_max_prev, rescale, tile_sum, denom, key_weight=None):
        rows, cols = scores.shape
        T.copy(run_max, run_max_prev)
        T.reduce_max(scores, run_max, dim=key_dim, clear=False)
        for q in T.Parallel(run_max.shape[0]):
            rescale[q] = T.exp2((run_max_prev[q] - run_max[q]) * scale)
        for i, j in T.Parallel(rows, cols):
            if fold_scale:
                scores[i, j] = T.exp2(scores[i, j] * scale - run_max[query_of(i, j)] * scale)
            else:
                scores[i, j] = T.exp2((scores[i, j] - run_max[query_of(i, j)]) * scale)
        T.reduce_sum(scores, tile_sum, dim=key_dim)
        for q in T.Parallel(run_max.shape[0]):
            denom[q] = denom[q] * rescale[q] + tile_sum[q]
        if key_weight is not None:  # P's column of key i times key_weight(i), after the sums (an FP8 row's scale)
            for i, j in T.Parallel(rows, cols):
                scores[i, j] *= key_weight(i if key_dim == 0 else j)
        T.copy(scores, p_shared)

    return online_softmax


def mask_scores_macro():
    """Scores whose `keep(i, j)` is false become -inf (probability 0): keys past the sequence, or after the query."""
    import tilelang.language as T

    @T.macro
    def mask_scores(scores, keep):
        rows, cols = scores.shape
        for i, j in T.Parallel(rows, cols):
            scores[i, j] = T.if_then_else(keep(i, j), scores[i, j], -T.infinity("float32"))

    return mask_scores


def zero_rows_macro():
    """Rows of a shared key tile whose `keep(row)` is false become 0. The slots of a page past the sequence hold
    arbitrary bits and a probability of 0 times NaN is NaN, so the value tile's tail rows are cleared before P.V.
    It is a read-modify-write (not a plain store) so that the warp-specialised pipeline waits for the tile's TMA."""
    import tilelang.language as T

    @T.macro
    def zero_rows(tile, keep):
        rows, cols = tile.shape
        for i, j in T.Parallel(rows, cols):
            tile[i, j] = T.if_then_else(keep(i), tile[i, j], T.cast(0, tile.dtype))

    return zero_rows


def load_group_query_macro(group: int, block_h: int):
    """Decode: the KV head's `group` query heads into padded [block_h, cols] shared tiles, one TMA copy per query
    piece (`pieces`: (tile, first column) pairs covering the score window). The copy takes block_h rows, so rows >=
    group are the next KV head's queries (zero past the last head): their scores and outputs are never stored, and
    one TMA lets the producer's first pool load start without waiting for the query."""
    import tilelang.language as T

    @T.macro
    def load_query(query, req, kvh, pieces):
        for piece in pieces:
            T.copy(query[req, kvh * group:kvh * group + block_h, piece.lo:piece.hi], piece.tile)

    return load_query


def rope_pair(lo, hi, ang):
    """RoPE of one rotate_half pair (x[d], x[d + D/2]) at angle `ang`: (lo cos - hi sin, hi cos + lo sin), each product
    and sum an IEEE round-to-nearest intrinsic in torch's order (no FMA contraction), so the kernel rounds as the
    torch prep does. An expression builder (not a macro): the pair's variables keep their names."""
    import tilelang.language as T

    c = T.cos(ang)
    s = T.sin(ang)
    return (T.ieee_add(T.ieee_mul(lo, c), T.ieee_mul(-hi, s)), T.ieee_add(T.ieee_mul(hi, c), T.ieee_mul(lo, s)))
