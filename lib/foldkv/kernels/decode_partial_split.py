"""Split-KV decode partial over SPLIT pages: one CTA = one chunk of one request's pages x one KV head.

The split row is [K (D, head order) | V (D, head order)] (1024 columns for the 31B): each token's K and V are streamed
once, as two shared tiles, scores from K and values from V; the output is already in head order.

Two operand orders (DEFAULTS below says which is used and why): token-major (S^T = K Q^T, wgmma with the tile's 64
tokens as M) and head-major (S = Q K^T, mma.sync with the heads as M).
Per CTA: the 8 query heads are loaded once (padded to 16: the smallest MMA M / N) and reused for every K/V byte;
online softmax in the exp2 domain (scaling is 1.0, so the exp2 scale is log2 e); the partial output (normalised,
float32) and its base-2 LSE go to the chunk's slot.

Kernel argument order (what a backend's callable takes):
    decode_partial_split(query [B, Hq, D] bf16, pool [P, Hkv, page, 2D] bf16, page_ids [B, MP] i32,
                         chunk_req [C] i32, chunk_start [C] i32, chunk_len [C] i32,
                         part_o [C, Hq, D] f32, part_lse [C, Hq] f32)
B, P, MP, C are dynamic; the grid is (C, Hkv). chunk_start is a multiple of the page size, chunk_len >= 1.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which use closure values

import functools
import math

import torch

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat
from .registry import KernelVariant, hands_out, register
from .tl import pass_configs, require_tilelang, target

LOG2E = math.log2(math.e)
# token_major (default): S^T = K Q^T, O^T = V^T P^T with M = 64 tokens (wgmma). A 64-row split tile is 128 KB, so
# one stage fits; K and V are separate buffers that the warp-specialised pipeline releases separately (K after the
# score gemm, V after P V), so the next K load overlaps the current softmax and P V: measured fastest (run 2, notes).
# head_major: S = Q K^T with the 8 heads padded to M = 16 (mma.sync), warps split the tokens (version 1).
# query_tma: the query tile by TMA (_load_query_macro).
DEFAULTS = dict(page_size=64, block_n=64, num_stages=1, threads=128, block_h=16, operand_order="token_major",
                query_tma=True)


def decode_partial_split_program(geom: AttentionGeometry, *, operand_order: str = "head_major", **tiling):
    """The TileLang prim_func of the split partial kernel for one geometry, operand order and tiling."""
    if operand_order == "token_major":
        return _token_major_program(geom, **tiling)
    if operand_order == "head_major":
        return _head_major_program(geom, **tiling)
    raise ValueError(f"operand_order={operand_order!r}: expected 'token_major' or 'head_major'")


def _token_major_program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64, num_stages: int = 1,
                         threads: int = 128, block_h: int = 16, query_tma: bool = True):
    """Scores and output transposed (tokens x heads): gemms with M = block_n tokens (wgmma); see the folded file."""
    require_tilelang()
    import tilelang.language as T

    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    width = 2 * d
    assert page_size % block_n == 0 and block_h >= group
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    scale = LOG2E
    load_query = _load_query_macro(geom, block_h, query_tma)

    @T.prim_func
    def decode_partial_split(
        query: T.Tensor((batch, hq, d), bf16),  # [B, Hq, D] RoPE'd query (head order)
        pool: T.Tensor((num_pages, hkv, page_size, width), bf16),  # [P, Hkv, page, 2D]
        page_ids: T.Tensor((batch, max_pages), i32),  # [B, MP]
        chunk_req: T.Tensor((num_chunks,), i32),  # [C]
        chunk_start: T.Tensor((num_chunks,), i32),  # [C]
        chunk_len: T.Tensor((num_chunks,), i32),  # [C]
        part_o: T.Tensor((num_chunks, hq, d), f32),  # [C, Hq, D] head order
        part_lse: T.Tensor((num_chunks, hq), f32),  # [C, Hq] base 2
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            q_s = T.alloc_shared((block_h, d), bf16)  # [16, D]  rows >= 8: see _load_query_macro
            k_s = T.alloc_shared((block_n, d), bf16)  # [N, D]   row[0:D]
            v_s = T.alloc_shared((block_n, d), bf16)  # [N, D]   row[D:2D]
            p_shared = T.alloc_shared((block_n, block_h), bf16)  # P^T [N, 16]
            acc_s = T.alloc_fragment((block_n, block_h), f32)  # S^T [N, 16]
            acc_o = T.alloc_fragment((d, block_h), f32)  # O^T [D, 16]
            head_max = T.alloc_fragment((block_h,), f32)
            head_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            head_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, q_s)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(head_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                T.copy(pool[page, kvh, off:off + block_n, 0:d], k_s)
                T.copy(pool[page, kvh, off:off + block_n, d:width], v_s)
                T.clear(acc_s)
                T.gemm(k_s, q_s, acc_s, transpose_B=True)  # S^T [N, 16] = K Q^T
                for i, j in T.Parallel(block_n, block_h):
                    acc_s[i, j] = T.if_then_else(k * block_n + i < n_tok, acc_s[i, j], -T.infinity(f32))
                T.copy(head_max, head_max_prev)
                T.reduce_max(acc_s, head_max, dim=0, clear=False)
                for j in T.Parallel(block_h):
                    rescale[j] = T.exp2((head_max_prev[j] - head_max[j]) * scale)
                for i, j in T.Parallel(block_n, block_h):
                    acc_s[i, j] = T.exp2((acc_s[i, j] - head_max[j]) * scale)
                T.reduce_sum(acc_s, head_sum, dim=0)
                for j in T.Parallel(block_h):
                    denom[j] = denom[j] * rescale[j] + head_sum[j]
                T.copy(acc_s, p_shared)
                for i, j in T.Parallel(d, block_h):
                    acc_o[i, j] *= rescale[j]
                if (k + 1) * block_n > n_tok:  # rows past the sequence may hold anything (NaN): 0 * NaN is NaN
                    for i, j in T.Parallel(block_n, d):
                        v_s[i, j] = T.if_then_else(k * block_n + i < n_tok, v_s[i, j], T.cast(0, bf16))
                T.gemm(v_s, p_shared, acc_o, transpose_A=True)  # O^T [D, 16] += V^T P^T

            for i, j in T.Parallel(d, block_h):
                if j < group:
                    part_o[c, kvh * group + j, i] = acc_o[i, j] / denom[j]
            for j in T.Parallel(block_h):
                if j < group:
                    part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * scale

    return decode_partial_split


def _head_major_program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 32, num_stages: int = 2,
                        threads: int = 128, block_h: int = 16, query_tma: bool = True):
    """Scores [16 padded heads, N] with mma.sync (M = 16), warps split the tokens."""
    require_tilelang()
    import tilelang.language as T

    hq, hkv, d, group = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size
    width = 2 * d
    assert page_size % block_n == 0 and block_h >= group
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    scale = LOG2E  # Gemma 4 global attention: scaling 1.0, so exp(s) = exp2(s * log2 e)
    load_query = _load_query_macro(geom, block_h, query_tma)

    @T.prim_func
    def decode_partial_split(
        query: T.Tensor((batch, hq, d), bf16),  # [B, Hq, D] RoPE'd query (head order)
        pool: T.Tensor((num_pages, hkv, page_size, width), bf16),  # [P, Hkv, page, 2D]
        page_ids: T.Tensor((batch, max_pages), i32),  # [B, MP]
        chunk_req: T.Tensor((num_chunks,), i32),  # [C] request of chunk c
        chunk_start: T.Tensor((num_chunks,), i32),  # [C] first token (multiple of page_size)
        chunk_len: T.Tensor((num_chunks,), i32),  # [C] tokens in the chunk (>= 1)
        part_o: T.Tensor((num_chunks, hq, d), f32),  # [C, Hq, D] head order
        part_lse: T.Tensor((num_chunks, hq), f32),  # [C, Hq] base 2
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            q_s = T.alloc_shared((block_h, d), bf16)  # [16, D]  rows >= 8: see _load_query_macro
            k_s = T.alloc_shared((block_n, d), bf16)  # [N, D]   row[0:D]
            v_s = T.alloc_shared((block_n, d), bf16)  # [N, D]   row[D:2D]
            p_shared = T.alloc_shared((block_h, block_n), bf16)  # probabilities, shared by the warps' P.V gemm
            acc_s = T.alloc_fragment((block_h, block_n), f32)  # [16, N] scores, then probabilities
            acc_o = T.alloc_fragment((block_h, d), f32)  # [16, D]
            row_max = T.alloc_fragment((block_h,), f32)
            row_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            row_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, q_s)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(row_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                T.copy(pool[page, kvh, off:off + block_n, 0:d], k_s)
                T.copy(pool[page, kvh, off:off + block_n, d:width], v_s)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(block_h, block_n):  # tokens past the chunk: probability 0
                    acc_s[i, j] = T.if_then_else(k * block_n + j < n_tok, acc_s[i, j], -T.infinity(f32))
                T.copy(row_max, row_max_prev)
                T.reduce_max(acc_s, row_max, dim=1, clear=False)
                for i in T.Parallel(block_h):
                    rescale[i] = T.exp2((row_max_prev[i] - row_max[i]) * scale)
                for i, j in T.Parallel(block_h, block_n):
                    acc_s[i, j] = T.exp2((acc_s[i, j] - row_max[i]) * scale)
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(block_h):
                    denom[i] = denom[i] * rescale[i] + row_sum[i]
                T.copy(acc_s, p_shared)
                for i, j in T.Parallel(block_h, d):
                    acc_o[i, j] *= rescale[i]
                if (k + 1) * block_n > n_tok:  # rows past the sequence may hold anything (NaN): 0 * NaN is NaN
                    for i, j in T.Parallel(block_n, d):
                        v_s[i, j] = T.if_then_else(k * block_n + i < n_tok, v_s[i, j], T.cast(0, bf16))
                T.gemm(p_shared, v_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

            for i, j in T.Parallel(block_h, d):
                if i < group:
                    part_o[c, kvh * group + i, j] = acc_o[i, j] / denom[i]
            for i in T.Parallel(block_h):
                if i < group:
                    part_lse[c, kvh * group + i] = T.log2(denom[i]) + row_max[i] * scale

    return decode_partial_split


def _load_query_macro(geom: AttentionGeometry, block_h: int, query_tma: bool):
    """The KV head's 8 query heads into the padded [16, D] tile, for either operand order. query_tma (default): one
    TMA, so the producer's first pool load does not wait for the query (version 4; DECODE_NOTES.md run 5); rows >= 8
    are then the next KV head's queries (zero past the last head). Otherwise (version 3) every thread loads, rows
    >= 8 zero, then a block barrier. Either way the padded rows' scores and outputs are never stored."""
    import tilelang.language as T

    d, group = geom.head_dim, geom.group_size

    @T.macro
    def load_query(query, req, kvh, q_s):
        if query_tma:
            T.copy(query[req, kvh * group:kvh * group + block_h, 0:d], q_s)
        else:
            for i, j in T.Parallel(block_h, d):
                q_s[i, j] = T.if_then_else(i < group, query[req, kvh * group + i, j], T.cast(0, "bfloat16"))

    return load_query


@functools.lru_cache(maxsize=None)
@hands_out("decode_partial_split")
def build_decode_partial_split(geom: AttentionGeometry, **params):
    tilelang = require_tilelang()
    cfg = {**DEFAULTS, **params}
    return tilelang.compile(decode_partial_split_program(geom, **cfg), target=target(), pass_configs=pass_configs())


VARIANT = register(KernelVariant("decode_partial_split", "decode_partial", KvFormat.SPLIT,
                                 build_decode_partial_split, params=dict(DEFAULTS)))


# --- plain torch reference of one partial (what a CTA computes), for reading the kernel ------------------------
def reference_partial(query: torch.Tensor, rows: torch.Tensor, geom: AttentionGeometry = GEMMA4_31B):
    """query [g, D] head order, rows [n, 2D] one KV head's split rows -> (o [g, D] head order, lse2 [g])."""
    d = geom.head_dim
    q = query.double()  # [g, D]
    s = q @ rows[:, :d].double().T  # [g, n]  K = row[0:D]
    lse2 = torch.logsumexp(s, -1) * LOG2E  # [g]  base 2
    p = torch.softmax(s, -1)  # [g, n]
    return p @ rows[:, d:].double(), lse2  # [g, D]  V = row[D:2D]


def main(**overrides):
    """Compile with the defaults (or overrides) and print the CUDA source size."""
    kernel = build_decode_partial_split(GEMMA4_31B, **overrides)
    src = kernel.get_kernel_source()
    print(f"decode_partial_split {dict(DEFAULTS, **overrides)}: {len(src)} chars of CUDA")
    return kernel


if __name__ == "__main__":
    main()
