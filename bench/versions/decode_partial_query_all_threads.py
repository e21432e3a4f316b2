"""Decode partial, query loaded by all threads: the library's token-major partial with version 3's query load (every
thread copies its share of the KV head's 8 query rows into the padded [16, D] tile, rows >= 8 set to zero, then a
block barrier) instead of one TMA copy. Lost to the TMA copy by ~1 us at short lengths; kept to time it.

What it tried: nothing new -- this is the query load before version 4 (bench/DECODE_NOTES.md). The load sits before
TileLang's warp-specialised split, so the producer's first page-id load and pool TMA wait for two dependent global
round trips (chunk_req, then the query) and a barrier.

Prediction (version 4): loading the query by TMA on its own mbarrier starts the pipeline one global round trip
earlier: ~0.5-1 us per decode step.

Measured (run 5, H200, one run, partial kernel alone, folded, 10,602 / 40,002 / 81,653 / 163,336 tokens):
    query by TMA (library)  21.3 / 58.0 / 107.4 / 197.3 us
    query by all threads    22.5 / 59.3 / 107.3 / 198.1 us
Outcome: ~1 us at short lengths for folded, nothing measurable at 81,653 and up; split < 1 us. The runs move by 1-3 us
between machines, so the two are compared in one run (decode_harness.py tags tm64s2v3 / tm64s1v3).

    python bench/versions/decode_partial_query_all_threads.py     # build both formats
"""

import functools

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros, producer_guard
from foldkv.kernels.decode_partial import DEFAULTS, format_parts_macro
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat, row_width


def load_query_all_threads_macro(group: int, block_h: int):
    """Every thread loads; rows >= group are zero (their scores and outputs are never stored)."""
    import tilelang.language as T

    @T.macro
    def load_query(query, req, kvh, pieces):
        for piece in pieces:
            for i, j in T.Parallel(block_h, piece.hi - piece.lo):
                piece.tile[i, j] = T.if_then_else(i < group, query[req, kvh * group + i, piece.lo + j],
                                                  T.cast(0, "bfloat16"))

    return load_query


def program(geom: AttentionGeometry, fmt: KvFormat | str, *, page_size=64, block_n=64, num_stages=1, threads=128,
            block_h=16, reduce_batch=1):
    """The library's decode_partial_program with the query load above."""
    require_tilelang()
    import tilelang.language as T

    fmt = KvFormat.parse(fmt)
    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    width = row_width(geom, fmt)
    assert page_size % block_n == 0 and block_h >= group
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    scale = macros.LOG2E
    format_parts = format_parts_macro(geom, fmt, block_n, block_h)
    load_query = load_query_all_threads_macro(group, block_h)
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    zero_rows = macros.zero_rows_macro()

    @T.prim_func
    def decode_partial(
        query: T.Tensor((batch, hq, d), bf16),
        pool: T.Tensor((num_pages, hkv, page_size, width), bf16),
        page_ids: T.Tensor((batch, max_pages), i32),
        chunk_req: T.Tensor((num_chunks,), i32),
        chunk_start: T.Tensor((num_chunks,), i32),
        chunk_len: T.Tensor((num_chunks,), i32),
        part_o: T.Tensor((num_chunks, hq, d), f32),
        part_lse: T.Tensor((num_chunks, hq), f32),
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            T.import_source(producer_guard.imported_source())
            parts = format_parts()
            p_shared = T.alloc_shared((block_n, block_h), bf16)
            acc_s = T.alloc_fragment((block_n, block_h), f32)
            head_max = T.alloc_fragment((block_h,), f32)
            head_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            head_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, parts.query)
            for out in parts.values:
                T.fill(out.other, 0)
            T.fill(denom, 0)
            T.fill(head_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                for run in parts.row:
                    T.copy(pool[page, kvh, off:off + block_n, run.lo:run.hi], run.tile)
                T.clear(acc_s)
                for score in parts.scores:
                    T.gemm(score.row_tile, score.other, acc_s, transpose_B=True)
                mask_scores(acc_s, lambda i, j: k * block_n + i < n_tok)
                online_softmax(acc_s, p_shared, head_max, head_max_prev, rescale, head_sum, denom)
                for out in parts.values:
                    for i, j in T.Parallel(out.other.shape[0], block_h):
                        out.other[i, j] *= rescale[j]
                if (k + 1) * block_n > n_tok:
                    for out in parts.values:
                        zero_rows(out.row_tile, lambda i: k * block_n + i < n_tok)
                for out in parts.values:
                    T.gemm(out.row_tile, p_shared, out.other, transpose_A=True)

            for out in parts.values:
                for i, j in T.Parallel(out.other.shape[0], block_h):
                    if j < group:
                        part_o[c, kvh * group + j, out.col + i] = out.other[i, j] / denom[j]
            for j in T.Parallel(block_h):
                if j < group:
                    part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * scale

    return decode_partial.with_attr("global_symbol", f"decode_partial_{fmt.value}")


@functools.lru_cache(maxsize=None)
def build(geom: AttentionGeometry, fmt: KvFormat | str, **tiling):
    """Compile (the library partial's argument order) with the library's DEFAULTS overridden by `tiling`."""
    tilelang = require_tilelang()
    fmt = KvFormat.parse(fmt)
    return tilelang.compile(program(geom, fmt, **{**DEFAULTS[fmt], **tiling}), target=target(),
                            pass_configs=pass_configs())


def main():
    for fmt in KvFormat:
        kernel = build(GEMMA4_31B, fmt)
        print(f"query-by-all-threads decode_partial_{fmt.value}: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
