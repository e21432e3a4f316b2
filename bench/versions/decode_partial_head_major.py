"""Decode partial, head-major operand order: S = Q K^T with the 8 query heads padded to M = 16 (mma.sync), warps
split the tokens. Lost to the library's token-major order (S^T = K Q^T, wgmma); kept to time it against the default.

What it tried (version 1 of the decode partial, bench/DECODE_NOTES.md): the textbook order, heads as the MMA's M.
Hopper's wgmma needs M >= 64, so with M = 16 TileLang emits mma.sync, each warp a chain of dependent m16n8k16 MMAs
over K = 512 on one accumulator.

Prediction (before run 1): three stages of 32 rows keep 80-120 KB in flight per SM, enough for the read roof;
folded bn32s3 ~205 us at 163,336 tokens (91% of roof), split ~325 us (92%).

Measured (H200, median per decode step, partial + merges, 10,602 / 40,002 / 81,653 / 163,336 tokens):
    run 1  folded bn32s3  32.1 / 69.1 / 123.5 / 229.6 us   (81-88% of roof: consumer-bound, 1.47 us per 32-token tile)
           split  bn32s2  37.6 / 93.6 / 171.2 / 321.8 us
    run 2  folded hm64s2  30.6 / 67.8 / 114.9 / 205.8 us   vs token-major tm64s2 30.4 / 68.2 / 115.1 / 206.2
           split  hm32s2  37.2 / 92.3 / 167.9 / 311.6 us   vs token-major tm64s1 36.6 / 90.5 / 165.1 / 308.4
    run 3  folded hm64s2  28.0 / 63.5 / 111.8 / 203.6 us   vs token-major (default) 27.8 / 63.6 / 111.6 / 203.8
           split  hm32s2  35.0 / 89.2 / 164.9 / 313.2 us   vs token-major (default) 33.5 / 88.1 / 163.1 / 310.3
Outcome: with 64-row tiles head-major folded ties token-major (the version-1 loss was the 32-row tiles, not mma.sync
itself: each warp then has two independent accumulators); split head-major is 1-2 us slower at every length, and
folded hm64s2 spills 56 B. The library keeps token-major for both formats.

    python bench/versions/decode_partial_head_major.py     # build both formats
The kernels take the library partial's argument order, so `decode_harness.py` (tags hmXsY) times them through
the decode launcher's public `kernels=` (with the library's merges).
"""

import functools
from dataclasses import dataclass
from typing import Any

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros, producer_guard
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat, row_width

# the tilings measured as the other order's best (and gated as such on the H200)
DEFAULTS = {
    KvFormat.SPLIT: dict(page_size=64, block_n=32, num_stages=2, threads=128, block_h=16),
    KvFormat.FOLDED: dict(page_size=64, block_n=32, num_stages=3, threads=128, block_h=16),
}


@dataclass(frozen=True)
class Gemm:
    row_tile: Any
    other: Any
    col: int = 0


def _parts_macro(geom: AttentionGeometry, fmt: KvFormat, block_n: int, block_h: int):
    """The format's tiles (as the library's decode_partial.format_parts_macro) with head-major accumulators."""
    import tilelang.language as T

    from foldkv.kernels.decode_partial import FormatParts, Run

    d, rot = geom.head_dim, geom.rotary_width
    unrot = d - rot

    @T.macro
    def split_parts():
        q_s = T.alloc_shared((block_h, d), "bfloat16")
        k_s = T.alloc_shared((block_n, d), "bfloat16")
        v_s = T.alloc_shared((block_n, d), "bfloat16")
        acc_o = T.alloc_fragment((block_h, d), "float32")  # [16, D]
        return FormatParts(query=(Run(q_s, 0, d),), row=(Run(k_s, 0, d), Run(v_s, d, 2 * d)),
                           scores=(Gemm(k_s, q_s),), values=(Gemm(v_s, acc_o),))

    @T.macro
    def folded_parts():
        q_rot = T.alloc_shared((block_h, rot), "bfloat16")
        q_unrot = T.alloc_shared((block_h, unrot), "bfloat16")
        k_rot = T.alloc_shared((block_n, rot), "bfloat16")
        v_unrot = T.alloc_shared((block_n, unrot), "bfloat16")
        v_rot = T.alloc_shared((block_n, rot), "bfloat16")
        acc_o_unrot = T.alloc_fragment((block_h, unrot), "float32")  # [16, D-R]
        acc_o_rot = T.alloc_fragment((block_h, rot), "float32")  # [16, R]
        return FormatParts(query=(Run(q_rot, 0, rot), Run(q_unrot, rot, d)),
                           row=(Run(k_rot, 0, rot), Run(v_unrot, rot, d), Run(v_rot, d, d + rot)),
                           scores=(Gemm(k_rot, q_rot), Gemm(v_unrot, q_unrot)),
                           values=(Gemm(v_unrot, acc_o_unrot), Gemm(v_rot, acc_o_rot, unrot)))

    return split_parts if fmt is KvFormat.SPLIT else folded_parts


def program(geom: AttentionGeometry, fmt: KvFormat | str, *, page_size=64, block_n=32, num_stages=2, threads=128,
            block_h=16):
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
    parts_of = _parts_macro(geom, fmt, block_n, block_h)
    load_query = macros.load_group_query_macro(group, block_h)
    online_softmax = macros.online_softmax_macro(key_dim=1)
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
            parts = parts_of()
            acc_s = T.alloc_fragment((block_h, block_n), f32)  # S [16, N]
            p_shared = T.alloc_shared((block_h, block_n), bf16)  # P [16, N], shared by the warps' P.V gemms
            row_max = T.alloc_fragment((block_h,), f32)
            row_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            row_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, parts.query)
            for out in parts.values:
                T.fill(out.other, 0)
            T.fill(denom, 0)
            T.fill(row_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                for run in parts.row:
                    T.copy(pool[page, kvh, off:off + block_n, run.lo:run.hi], run.tile)
                T.clear(acc_s)
                for score in parts.scores:  # S [16, N] += Q K^T
                    T.gemm(score.other, score.row_tile, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                mask_scores(acc_s, lambda i, j: k * block_n + j < n_tok)
                online_softmax(acc_s, p_shared, row_max, row_max_prev, rescale, row_sum, denom)
                for out in parts.values:
                    for i, j in T.Parallel(block_h, out.other.shape[1]):
                        out.other[i, j] *= rescale[i]
                if (k + 1) * block_n > n_tok:
                    for out in parts.values:
                        zero_rows(out.row_tile, lambda i: k * block_n + i < n_tok)
                for out in parts.values:  # O [16, cols] += P V
                    T.gemm(p_shared, out.row_tile, out.other, policy=T.GemmWarpPolicy.FullCol)

            for out in parts.values:
                for i, j in T.Parallel(block_h, out.other.shape[1]):
                    if i < group:
                        part_o[c, kvh * group + i, out.col + j] = out.other[i, j] / denom[i]
            for i in T.Parallel(block_h):
                if i < group:
                    part_lse[c, kvh * group + i] = T.log2(denom[i]) + row_max[i] * scale

    return decode_partial.with_attr("global_symbol", f"decode_partial_{fmt.value}")


@functools.lru_cache(maxsize=None)
def build(geom: AttentionGeometry, fmt: KvFormat | str, **tiling):
    """Compile the head-major partial (the library partial's argument order) with DEFAULTS overridden by `tiling`."""
    tilelang = require_tilelang()
    fmt = KvFormat.parse(fmt)
    return tilelang.compile(program(geom, fmt, **{**DEFAULTS[fmt], **tiling}), target=target(),
                            pass_configs=pass_configs())


def main():
    for fmt in KvFormat:
        kernel = build(GEMMA4_31B, fmt)
        print(f"head-major decode_partial_{fmt.value} {DEFAULTS[fmt]}: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
