"""Split-KV decode partial over FOLDED pages: one CTA = one chunk of one request's pages x one KV head.

The folded row is [K_rot (R) | V_unrot (D-R) | V_rot (R)] (640 columns for the 31B). Each token's row is streamed
once, as three shared tiles (the three column runs), and used twice:
    score  = q_rot . K_rot + q_unrot' . V_unrot   (the folded query carries w_k on its unrotated columns)
    output = P . [V_unrot | V_rot]                (value-window order: unrot columns, then rot)
so the 8 query heads of the KV head read 640 columns per token instead of the split format's 1024. The output stays
in value-window order here; `merge_final` puts it back in head order.

Two operand orders (DEFAULTS below says which is used and why): token-major (S^T = K Q^T, wgmma with the tile's 64
tokens as M) and head-major (S = Q K^T, mma.sync with the heads as M).
Per CTA: the 8 query heads are loaded once (padded to 16: the smallest MMA M / N) and reused for every K/V byte;
online softmax in the exp2 domain (scaling is 1.0, so the exp2 scale is log2 e); the partial output (normalised,
float32) and its base-2 LSE go to the chunk's slot.

Kernel argument order (what a backend's callable takes):
    decode_partial_folded(query [B, Hq, D] bf16, pool [P, Hkv, page, D+R] bf16, page_ids [B, MP] i32,
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
# token_major (default): S^T = K Q^T and O^T = V^T P^T, so the MMA's M is the 64 tokens of a tile and Hopper's wgmma
# applies (M >= 64); head_major: S = Q K^T with the 8 heads padded to M = 16, mma.sync (version 1, kept for the
# benchmark: its score gemm is a 32-long dependent chain of mma.sync per warp, which bounds the consumer).
# query_tma: the query tiles by TMA (_load_query_macro).
DEFAULTS = dict(page_size=64, block_n=64, num_stages=2, threads=128, block_h=16, operand_order="token_major",
                query_tma=True)


def decode_partial_folded_program(geom: AttentionGeometry, *, operand_order: str = "token_major", **tiling):
    """The TileLang prim_func of the folded partial kernel for one geometry, operand order and tiling."""
    if operand_order == "token_major":
        return _token_major_program(geom, **tiling)
    if operand_order == "head_major":
        return _head_major_program(geom, **tiling)
    raise ValueError(f"operand_order={operand_order!r}: expected 'token_major' or 'head_major'")


def _token_major_program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 64, num_stages: int = 2,
                         threads: int = 128, block_h: int = 16, query_tma: bool = True):
    """Scores and output transposed (tokens x heads): every gemm has M = block_n tokens (wgmma, async, operands
    from shared memory), N = 16 padded heads; the softmax reduces over the token dimension (dim 0)."""
    require_tilelang()
    import tilelang.language as T

    hq, hkv, d, rot = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.rotary_width
    unrot, width, group = d - rot, d + rot, geom.group_size
    assert page_size % block_n == 0 and block_h >= group
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    scale = LOG2E  # Gemma 4 global attention: scaling 1.0, so exp(s) = exp2(s * log2 e)
    load_query = _load_query_macro(geom, block_h, query_tma)

    @T.prim_func
    def decode_partial_folded(
        query: T.Tensor((batch, hq, d), bf16),  # [B, Hq, D] folded query (score-window order)
        pool: T.Tensor((num_pages, hkv, page_size, width), bf16),  # [P, Hkv, page, D+R]
        page_ids: T.Tensor((batch, max_pages), i32),  # [B, MP]
        chunk_req: T.Tensor((num_chunks,), i32),  # [C] request of chunk c
        chunk_start: T.Tensor((num_chunks,), i32),  # [C] first token (multiple of page_size)
        chunk_len: T.Tensor((num_chunks,), i32),  # [C] tokens in the chunk (>= 1)
        part_o: T.Tensor((num_chunks, hq, d), f32),  # [C, Hq, D] value-window order
        part_lse: T.Tensor((num_chunks, hq), f32),  # [C, Hq] base 2
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            q_rot = T.alloc_shared((block_h, rot), bf16)  # [16, R]   rows >= 8: see _load_query_macro
            q_unrot = T.alloc_shared((block_h, unrot), bf16)  # [16, D-R]
            k_rot = T.alloc_shared((block_n, rot), bf16)  # [N, R]   row[0:R]
            v_unrot = T.alloc_shared((block_n, unrot), bf16)  # [N, D-R] row[R:D]: a key column and a value column
            v_rot = T.alloc_shared((block_n, rot), bf16)  # [N, R]   row[D:D+R]
            p_shared = T.alloc_shared((block_n, block_h), bf16)  # P^T [N, 16], the B operand of O^T += V^T P^T
            acc_s = T.alloc_fragment((block_n, block_h), f32)  # S^T [N, 16] scores, then probabilities
            acc_o_unrot = T.alloc_fragment((unrot, block_h), f32)  # O^T [D-R, 16]
            acc_o_rot = T.alloc_fragment((rot, block_h), f32)  # O^T [R, 16]
            head_max = T.alloc_fragment((block_h,), f32)
            head_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            head_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, q_rot, q_unrot)
            T.fill(acc_o_unrot, 0)
            T.fill(acc_o_rot, 0)
            T.fill(denom, 0)
            T.fill(head_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                T.copy(pool[page, kvh, off:off + block_n, 0:rot], k_rot)
                T.copy(pool[page, kvh, off:off + block_n, rot:d], v_unrot)
                T.copy(pool[page, kvh, off:off + block_n, d:width], v_rot)
                T.clear(acc_s)
                T.gemm(k_rot, q_rot, acc_s, transpose_B=True)  # S^T [N, 16] = K_rot q_rot^T
                T.gemm(v_unrot, q_unrot, acc_s, transpose_B=True)  #          + V_unrot q_unrot'^T
                for i, j in T.Parallel(block_n, block_h):  # tokens past the chunk: probability 0
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
                for i, j in T.Parallel(unrot, block_h):
                    acc_o_unrot[i, j] *= rescale[j]
                for i, j in T.Parallel(rot, block_h):
                    acc_o_rot[i, j] *= rescale[j]
                if (k + 1) * block_n > n_tok:  # rows past the sequence may hold anything (NaN): 0 * NaN is NaN
                    for i, j in T.Parallel(block_n, unrot):
                        v_unrot[i, j] = T.if_then_else(k * block_n + i < n_tok, v_unrot[i, j], T.cast(0, bf16))
                    for i, j in T.Parallel(block_n, rot):
                        v_rot[i, j] = T.if_then_else(k * block_n + i < n_tok, v_rot[i, j], T.cast(0, bf16))
                T.gemm(v_unrot, p_shared, acc_o_unrot, transpose_A=True)  # O^T [D-R, 16] += V_unrot^T P^T
                T.gemm(v_rot, p_shared, acc_o_rot, transpose_A=True)  # O^T [R, 16] += V_rot^T P^T

            for i, j in T.Parallel(unrot, block_h):
                if j < group:
                    part_o[c, kvh * group + j, i] = acc_o_unrot[i, j] / denom[j]
            for i, j in T.Parallel(rot, block_h):
                if j < group:
                    part_o[c, kvh * group + j, unrot + i] = acc_o_rot[i, j] / denom[j]
            for j in T.Parallel(block_h):
                if j < group:
                    part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * scale

    return decode_partial_folded


def _head_major_program(geom: AttentionGeometry, *, page_size: int = 64, block_n: int = 32, num_stages: int = 3,
                        threads: int = 128, block_h: int = 16, query_tma: bool = True):
    """Version 1: scores [16 padded heads, N] with mma.sync (M = 16), warps split the tokens."""
    require_tilelang()
    import tilelang.language as T

    hq, hkv, d, rot = geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.rotary_width
    unrot, width, group = d - rot, d + rot, geom.group_size
    assert page_size % block_n == 0 and block_h >= group
    batch, num_pages, max_pages, num_chunks = (T.dynamic(n) for n in ("batch", "num_pages", "max_pages",
                                                                       "num_chunks"))
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    scale = LOG2E  # Gemma 4 global attention: scaling 1.0, so exp(s) = exp2(s * log2 e)
    load_query = _load_query_macro(geom, block_h, query_tma)

    @T.prim_func
    def decode_partial_folded(
        query: T.Tensor((batch, hq, d), bf16),  # [B, Hq, D] folded query (score-window order)
        pool: T.Tensor((num_pages, hkv, page_size, width), bf16),  # [P, Hkv, page, D+R]
        page_ids: T.Tensor((batch, max_pages), i32),  # [B, MP]
        chunk_req: T.Tensor((num_chunks,), i32),  # [C] request of chunk c
        chunk_start: T.Tensor((num_chunks,), i32),  # [C] first token (multiple of page_size)
        chunk_len: T.Tensor((num_chunks,), i32),  # [C] tokens in the chunk (>= 1)
        part_o: T.Tensor((num_chunks, hq, d), f32),  # [C, Hq, D] value-window order
        part_lse: T.Tensor((num_chunks, hq), f32),  # [C, Hq] base 2
    ):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            q_rot = T.alloc_shared((block_h, rot), bf16)  # [16, R]   rows >= 8: see _load_query_macro
            q_unrot = T.alloc_shared((block_h, unrot), bf16)  # [16, D-R]
            k_rot = T.alloc_shared((block_n, rot), bf16)  # [N, R]   row[0:R]
            v_unrot = T.alloc_shared((block_n, unrot), bf16)  # [N, D-R] row[R:D]: a key column and a value column
            v_rot = T.alloc_shared((block_n, rot), bf16)  # [N, R]   row[D:D+R]
            acc_s = T.alloc_fragment((block_h, block_n), f32)  # [16, N] scores, then probabilities
            p_shared = T.alloc_shared((block_h, block_n), bf16)  # probabilities, shared by the warps' P.V gemms
            acc_o_unrot = T.alloc_fragment((block_h, unrot), f32)  # [16, D-R]
            acc_o_rot = T.alloc_fragment((block_h, rot), f32)  # [16, R]
            row_max = T.alloc_fragment((block_h,), f32)
            row_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            row_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)

            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, q_rot, q_unrot)
            T.fill(acc_o_unrot, 0)
            T.fill(acc_o_rot, 0)
            T.fill(denom, 0)
            T.fill(row_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                T.copy(pool[page, kvh, off:off + block_n, 0:rot], k_rot)
                T.copy(pool[page, kvh, off:off + block_n, rot:d], v_unrot)
                T.copy(pool[page, kvh, off:off + block_n, d:width], v_rot)
                T.clear(acc_s)
                T.gemm(q_rot, k_rot, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(q_unrot, v_unrot, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
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
                for i, j in T.Parallel(block_h, unrot):
                    acc_o_unrot[i, j] *= rescale[i]
                for i, j in T.Parallel(block_h, rot):
                    acc_o_rot[i, j] *= rescale[i]
                if (k + 1) * block_n > n_tok:  # rows past the sequence may hold anything (NaN): 0 * NaN is NaN
                    for i, j in T.Parallel(block_n, unrot):
                        v_unrot[i, j] = T.if_then_else(k * block_n + i < n_tok, v_unrot[i, j], T.cast(0, bf16))
                    for i, j in T.Parallel(block_n, rot):
                        v_rot[i, j] = T.if_then_else(k * block_n + i < n_tok, v_rot[i, j], T.cast(0, bf16))
                T.gemm(p_shared, v_unrot, acc_o_unrot, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_shared, v_rot, acc_o_rot, policy=T.GemmWarpPolicy.FullCol)

            for i, j in T.Parallel(block_h, unrot):
                if i < group:
                    part_o[c, kvh * group + i, j] = acc_o_unrot[i, j] / denom[i]
            for i, j in T.Parallel(block_h, rot):
                if i < group:
                    part_o[c, kvh * group + i, unrot + j] = acc_o_rot[i, j] / denom[i]
            for i in T.Parallel(block_h):
                if i < group:
                    part_lse[c, kvh * group + i] = T.log2(denom[i]) + row_max[i] * scale

    return decode_partial_folded


def _load_query_macro(geom: AttentionGeometry, block_h: int, query_tma: bool):
    """The KV head's 8 query heads into the two padded [16, R] / [16, D-R] score-window tiles, for either operand
    order. query_tma (default): one TMA per window, so the producer's first pool load does not wait for the query
    (version 4, ~1 us at short lengths; DECODE_NOTES.md run 5); rows >= 8 are then the next KV head's queries (zero
    past the last head). Otherwise (version 3) every thread loads, rows >= 8 zero, then a block barrier. Either way
    the padded rows' scores and outputs are never stored."""
    import tilelang.language as T

    rot, d, group = geom.rotary_width, geom.head_dim, geom.group_size
    unrot = d - rot

    @T.macro
    def load_query(query, req, kvh, q_rot, q_unrot):
        if query_tma:
            T.copy(query[req, kvh * group:kvh * group + block_h, 0:rot], q_rot)
            T.copy(query[req, kvh * group:kvh * group + block_h, rot:d], q_unrot)
        else:
            for i, j in T.Parallel(block_h, rot):
                q_rot[i, j] = T.if_then_else(i < group, query[req, kvh * group + i, j], T.cast(0, "bfloat16"))
            for i, j in T.Parallel(block_h, unrot):
                q_unrot[i, j] = T.if_then_else(i < group, query[req, kvh * group + i, rot + j],
                                               T.cast(0, "bfloat16"))

    return load_query


@functools.lru_cache(maxsize=None)
@hands_out("decode_partial_folded")
def build_decode_partial_folded(geom: AttentionGeometry, **params):
    tilelang = require_tilelang()
    cfg = {**DEFAULTS, **params}
    return tilelang.compile(decode_partial_folded_program(geom, **cfg), target=target(), pass_configs=pass_configs())


VARIANT = register(KernelVariant("decode_partial_folded", "decode_partial", KvFormat.FOLDED,
                                 build_decode_partial_folded, params=dict(DEFAULTS)))


# --- plain torch reference of one partial (what a CTA computes), for reading the kernel ------------------------
def reference_partial(query: torch.Tensor, rows: torch.Tensor, geom: AttentionGeometry = GEMMA4_31B):
    """query [g, D] folded form, rows [n, D+R] one KV head's folded rows -> (o [g, D] value-window order, lse2 [g])."""
    rot, d = geom.rotary_width, geom.head_dim
    q = query.double()  # [g, D]
    s = q @ rows[:, :d].double().T  # [g, n]  score window row[0:D]
    lse2 = torch.logsumexp(s, -1) * LOG2E  # [g]  base 2
    p = torch.softmax(s, -1)  # [g, n]
    return p @ rows[:, rot:rot + d].double(), lse2  # [g, D] value window row[R:R+D]


def main(**overrides):
    """Compile with the defaults (or overrides) and print the CUDA source size and the kernel's resource usage."""
    kernel = build_decode_partial_folded(GEMMA4_31B, **overrides)
    src = kernel.get_kernel_source()
    print(f"decode_partial_folded {dict(DEFAULTS, **overrides)}: {len(src)} chars of CUDA")
    return kernel


if __name__ == "__main__":
    main()
