"""The FP8 tensor-core partial over a pool whose V_rot panel is stored pre-transposed: the consumer transposes three
value panels a tile instead of four.

What it tries (bench/FP8_NOTES.md "Run 21: prediction"; written before any GPU run): the served partial
(kernels/decode_partial_fp8_tc.py) transposes the value window's four e4m3 panels [64 tokens, 128 columns] into V^T
[512, 64] every tile, since FP8 wgmma reads both operands K-major and the value gemm's K is the token. The transpose
is ~0.40 us of the 1.57-1.68 us a tile's chain takes (runs 14, 19), and the kernel runs at that chain from DRAM. Of
the folded row [K_rot (128) | V_unrot (384) | V_rot (128)], V_unrot feeds both gemms (the score gemm's K is the
dimension there), so one of the two must transpose it whatever the pool stores; V_rot feeds only the value gemm. So
the pool may hold V_rot transposed, in the same 8 KB of a page's panel (`vrot_pool`): row r of a (page, KV head)'s
V_rot panel holds V_rot dimension r's 64 tokens in bytes 0-63 and dimension r + 64's in bytes 64-127. The TMA copy
of that panel is unchanged ([64, 128] e4m3), and the consumer moves it into V^T's rows 384-511 as it stands: a
thread's 4 x 16-byte block by 4 sixteen-byte loads and 4 stores (`foldkv_e4m3_copy4x16`), where the transpose of a
panel takes 4 loads, 32 byte permutes, a 48-select network and 16 four-byte stores. Tokens past the chunk are
written as 0 here too (their slots may hold NaN codes), now a byte mask along the row. The copy carries the tile's
closing barrier (proxy fence, named barrier), the first transpose its opening one, as the served kernel's calls do
(checked on the emitted CUDA: `cuda_checks.check_e4m3_conversion` over both function names).

Everything else is the served kernel's, built through its hook points (decode_partial_fp8_mma.py's `TcHooks`: this file's device source and
`transpose`): the score gemm, the two-part rounding, the softmax, the value gemm over V^T, two CTAs an SM. V^T holds
the same bytes as the served kernel's, so the outputs are bitwise the served kernel's over the unpermuted pool
(tests/test_fp8_tc_vrot_gpu.py).

How it is timed (bench/fp8_harness.py, arm `fp8_tc_vrot`): `OverVrotPool` wraps the kernel and hands it a permuted
copy of whatever pool the decode passes, made at the first call with that pool (the harness's check and its eager
sizing run before any capture) and refused inside a capture; the float64 reference reads the unpermuted pool.

Prediction (FP8_NOTES run 21): ~0.07-0.10 us off a tile's chain, 4-6% off the served partial from DRAM: 163,336
~126-129 us (0.66-0.67x bf16 folded), 81,653 ~71-73 us, uniform8 / uniform32 ~0.65-0.68x; the check passes with the
served kernel's error (bitwise its output).

    cd bench && python fp8_harness.py --no-flashinfer --rounds 5 --single 81653 163336 --batches uniform8 uniform32 \\
        --arms folded_jit folded_fp8_jit fp8_tc_vrot read_folded read_folded_fp8
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

import torch

from foldkv.config import AttentionGeometry
from foldkv.kernels import decode_partial_fp8_tc as tc
from foldkv.kernels import registry
from foldkv.kernels.cuda_checks import check_e4m3_conversion, kernel_definition
from foldkv.kernels.decode_partial import FP8_PANEL
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from versions import decode_partial_fp8_mma as mma  # bench/versions/: the served program with its hook points

SYMBOL = "decode_partial_folded_fp8_tc_vrot"
COPY_FN = "foldkv_e4m3_copy4x16"
PAGE = 64  # the pre-transposed panel is a page's: 64 tokens x 128 dimensions

COPY_SOURCE = r"""
// bytes e of v with from + e >= keep set to 0 (tokens past the chunk; little-endian: byte e is bits 8e..8e+7 of word
// e / 4)
__device__ __forceinline__ unsigned int foldkv_keep_word(unsigned int w, int n) {
  return n >= 4 ? w : (n <= 0 ? 0u : (w & ((1u << (8 * n)) - 1u)));
}
__device__ __forceinline__ uint4 foldkv_keep_tokens(uint4 v, int n) {
  return make_uint4(foldkv_keep_word(v.x, n), foldkv_keep_word(v.y, n - 4), foldkv_keep_word(v.z, n - 8),
                    foldkv_keep_word(v.w, n - 12));
}
// A 4-row x 16-column block of the pre-transposed V_rot panel (src[r]: 16 bytes of row r: 16 tokens of one
// dimension) into V^T's rows as it stands (dst[r]): 4 sixteen-byte loads and stores. `from`: the block's first token,
// `keep`: the tile's tokens in the chunk. The barriers as foldkv_e4m3_t4x16's (first: wait before the stores; last:
// proxy fence and wait after them).
__device__ __forceinline__ void foldkv_e4m3_copy4x16(int first, int last, int barrier_id, int threads, int from,
    int keep, const void* s0, const void* s1, const void* s2, const void* s3, void* d0, void* d1, void* d2, void* d3) {
  const int n = keep - from;
  const uint4 r0 = foldkv_keep_tokens(*reinterpret_cast<const uint4*>(s0), n);
  const uint4 r1 = foldkv_keep_tokens(*reinterpret_cast<const uint4*>(s1), n);
  const uint4 r2 = foldkv_keep_tokens(*reinterpret_cast<const uint4*>(s2), n);
  const uint4 r3 = foldkv_keep_tokens(*reinterpret_cast<const uint4*>(s3), n);
  if (first) asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
  *reinterpret_cast<uint4*>(d0) = r0;
  *reinterpret_cast<uint4*>(d1) = r1;
  *reinterpret_cast<uint4*>(d2) = r2;
  *reinterpret_cast<uint4*>(d3) = r3;
  if (last) {
    asm volatile("fence.proxy.async.shared::cta;" : : : "memory");
    asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
  }
}
"""


def vrot_pool(pool: torch.Tensor) -> torch.Tensor:
    """A copy of an FP8 folded pool [P, Hkv, 64, 640] with each (page, KV head)'s V_rot panel (columns 512-639)
    stored pre-transposed: row r holds V_rot dimension r's 64 tokens, then dimension r + 64's."""
    p, h, page, width = pool.shape
    if page != PAGE or width != 5 * FP8_PANEL:
        raise ValueError(f"vrot_pool: a folded pool of {PAGE}-token pages and {5 * FP8_PANEL} columns, got "
                         f"{tuple(pool.shape)}")
    out = pool.clone()
    src = pool.view(torch.uint8)[..., 4 * FP8_PANEL:].reshape(p, h, page, 2, PAGE)  # [token, half, r]: dim 64 half + r
    out.view(torch.uint8)[..., 4 * FP8_PANEL:] = src.permute(0, 1, 4, 3, 2).reshape(p, h, PAGE, 2 * PAGE)
    return out


def unvrot_pool(pool: torch.Tensor) -> torch.Tensor:
    """`vrot_pool`'s inverse."""
    p, h, page, _ = pool.shape
    out = pool.clone()
    src = pool.view(torch.uint8)[..., 4 * FP8_PANEL:].reshape(p, h, PAGE, 2, page)  # [r, half, token]
    out.view(torch.uint8)[..., 4 * FP8_PANEL:] = src.permute(0, 1, 4, 3, 2).reshape(p, h, page, 2 * PAGE)
    return out


def copy_destination(i, j, r):
    """Where `foldkv_e4m3_copy4x16`'s row r of thread (i, j)'s block lands in V^T [512, 64]: (row, first token).
    Python ints or TileLang expressions alike (the macro's addresses and the CPU test's emulation)."""
    return 3 * FP8_PANEL + (j // 4) * (FP8_PANEL // 2) + i * 4 + r, (j % 4) * 16


def transpose_vrot_macro(block_n: int, threads: int):
    """The `transpose` hook: the value window's panels 0-2 (V_unrot) transposed into V^T's rows 0-383 by the served
    kernel's `transpose_panel_macro` (the first opening the tile's barrier), panel 3 (V_rot, pre-transposed in the
    pool) copied into rows 384-511 by `foldkv_e4m3_copy4x16` (closing it): thread (i, j) of T.Parallel(16, 8) copies
    rows 4i..4i+3, columns 16j..16j+15 of the panel to V^T rows 384 + 64 (j // 4) + 4i + r, tokens 16 (j % 4)..+15."""
    import tilelang.language as T

    if block_n != PAGE:
        raise ValueError(f"the pre-transposed V_rot panel is a page's: block_n must be {PAGE}")
    transpose_panel = tc.transpose_panel_macro(block_n, threads)
    rows, cols = PAGE // 4, FP8_PANEL // 16
    assert rows * cols == threads

    @T.macro
    def copy_vrot(panels, n, v_t, tokens_left):
        for i, j in T.Parallel(rows, cols):
            T.call_extern("handle", COPY_FN, 0, 1, tc.TRANSPOSE_BARRIER_ID, threads, copy_destination(i, j, 0)[1],
                          tokens_left(), *[T.address_of(panels[n][i * 4 + r, j * 16]) for r in range(4)],
                          *[T.address_of(v_t[copy_destination(i, j, r)]) for r in range(4)])

    @T.macro
    def transpose_values(panels, v_t, tokens_left):
        for n in [0, 1, 2]:  # (a list: range would be a device loop)
            transpose_panel(panels, n, v_t, n * FP8_PANEL, n == 0, False, tokens_left)
        copy_vrot(panels, 3, v_t, tokens_left)

    return transpose_values


HOOKS = mma.TcHooks(source=tc.DEVICE_SOURCE + COPY_SOURCE, transpose=transpose_vrot_macro, symbol=SYMBOL)


def check_emitted(src: str) -> dict:
    """The tile's barriers on the emitted CUDA (one call opens, one closes: `check_e4m3_conversion` over the
    transpose and the copy), three panels transposed, one copied."""
    facts = check_e4m3_conversion(SYMBOL, src, tc.TRANSPOSE_BARRIER_ID, calls=(tc.TRANSPOSE_FN, COPY_FN))
    _, body = kernel_definition(src, SYMBOL)
    facts.update(transposes=body.count(f"{tc.TRANSPOSE_FN}("), copies=body.count(f"{COPY_FN}("))
    if (facts["transposes"], facts["copies"]) != (3, 1):
        raise AssertionError(f"{SYMBOL}: {facts['transposes']} panel transposes and {facts['copies']} copies, off the"
                             " design (3 and 1)")
    return facts


def build(geom: AttentionGeometry, **params):
    """JIT build with the served kernel's registered params (overridden by `params`), its emitted CUDA checked."""
    tilelang = require_tilelang()
    cfg = {**registry.get(tc.NAME).params, **params}
    for k in tc.SERVED:
        cfg.pop(k)

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def decode_partial_fp8_tc_vrot(page_size, block_n, num_stages, block_h, reduce_batch, ctas_per_sm):
        return mma.hooked_program(geom, page_size=page_size, block_n=block_n, num_stages=num_stages,
                                  block_h=block_h, reduce_batch=reduce_batch, ctas_per_sm=ctas_per_sm, hooks=HOOKS)

    kernel = decode_partial_fp8_tc_vrot(**cfg)
    check_emitted(kernel.get_kernel_source())
    return kernel


class OverVrotPool:
    """The kernel called as the served partial is (query, pool, scales, ...), over `vrot_pool(pool)`: one permuted
    copy a pool (by address and shape), made at the first call with it; a first call inside a CUDA-graph capture is
    refused (the copy would be captured into every replay). One wrapper for one set of live pools (a harness cell, a
    test case): a pool freed and another made at its address would be read as the old one's copy."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.pools: dict = {}

    def __call__(self, query, pool, scales, *rest):
        key = (pool.data_ptr(), tuple(pool.shape))
        if key not in self.pools:
            if pool.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("OverVrotPool: a pool first seen inside a capture; call it once eagerly first")
            self.pools[key] = vrot_pool(pool)
        return self.kernel(query, self.pools[key], scales, *rest)


def harness_kernel(geom: AttentionGeometry) -> OverVrotPool:
    """The harness arm's kernel: `build` wrapped in a fresh `OverVrotPool` (one a case)."""
    return OverVrotPool(build(geom))


__all__ = ["vrot_pool", "unvrot_pool", "copy_destination", "transpose_vrot_macro", "check_emitted", "build",
           "OverVrotPool", "harness_kernel"]
