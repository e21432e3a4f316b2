"""The step's ops that only the tests launch: the residual tails by their own names (`norm_add_norm`,
`norm_add_scale`: `fused_step_ops._norm_add` as fused_step calls it) and a sliding layer's KV rows into its rings as
a launch of their own (`kv_to_ring`, its kernel `kv_norm_rope_ring`): with `q_norm_rope`, the two launches that
`fused_step_ops.sliding_prologue` runs as one, bitwise (conftest.two_launch_prologue)."""

from __future__ import annotations

import torch
from torch import nn

from foldkv import fused_step_ops as ops

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: no kernel here (the residual tails' callers skip on such a machine too)
    triton = None


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, first: nn.Module,
                  second: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = residual + first(x), y = second(h), each rounded to x's dtype where the modules round."""
    return ops._norm_add(x, residual, first, second, None)


def norm_add_scale(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, scalar: torch.Tensor) -> torch.Tensor:
    """(residual + norm(x)) * scalar ([1] tensor), each rounded to x's dtype where torch rounds."""
    return ops._norm_add(x, residual, norm, None, scalar)[0]


if triton is not None:
    from foldkv.fused_step_kernels import _chain, _kv_row

    @triton.jit
    def kv_norm_rope_ring(k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, ring_k_ptr, ring_v_ptr, slot_ptr, heads, k_stride,
                          v_stride, window, n, eps_k, eps_v, D: tl.constexpr,
                          GDC: tl.constexpr = False):
        """KV head row r = (b, h): RoPE(k_norm(k)) into ring_k[b, h, slot] and v_norm(v) (no weight) into
        ring_v[b, h, slot]; rings [B, heads, window, D] packed, slot read from the device (slot_ptr[0], int64)."""
        _chain(GDC)
        _kv_row(tl.program_id(0).to(tl.int64), k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, ring_k_ptr, ring_v_ptr,
                slot_ptr, heads, k_stride, v_stride, window, n, eps_k, eps_v, D)


def kv_to_ring(k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor, k_eps: float, v_eps: float,
               cos: torch.Tensor, sin: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor,
               slot: torch.Tensor) -> None:
    """k, v [B, 1, Hkv * d] (read in place): RoPE(k_norm(k)) into ring_k[:, :, slot] and v_norm(v) into
    ring_v[:, :, slot] (rings [B, Hkv, W, d] packed, slot [1] int64 read on the device), with `q_norm_rope`'s
    formulas: what update_sliding stores after the modules' norms and RoPE."""
    rows, args, d = ops.kv_rows_args(k, v, k_weight, k_eps, v_eps, cos, sin, ring_k, ring_v, slot)
    kv_norm_rope_ring[(rows,)](*args, D=d, num_warps=ops._warps(d), **ops._pdl(k))
