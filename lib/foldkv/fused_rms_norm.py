"""Gemma 4's RMSNorm as one Triton kernel, for the decode step's CUDA graph.

transformers' `Gemma4RMSNorm` is seven small kernels (cast to float32, square, mean, add eps, power -0.5, multiply,
multiply by the weight, cast back); a 31B decode step runs 420 of them, ~5 ms of a 31 ms step at batch 1 spent in
launches of a few microseconds each (notebook 05's step profile). This kernel computes the same formula in float32,
one program a row: y = x * (mean(x^2) + eps)^-0.5 [* weight], rounded once to x's dtype. The sum of squares is
reduced in another order than torch's, so a bf16 output may differ from the module's by one bf16 ulp (the float32
result within a few float32 ulps); `foldkv.hf_graph` uses it inside its decode step only (`fused_norms`), the prompt's
forwards keep the module's own.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch import nn

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def rms_norm_rows(x_ptr, w_ptr, y_ptr, n, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            keep = cols < n
            x = tl.load(x_ptr + row * n + cols, mask=keep, other=0.0).to(tl.float32)
            scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
            y = x * scale
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
            tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=keep)

        _KERNEL = rms_norm_rows
    return _KERNEL


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., n] (CUDA, any float dtype) -> x * (mean(x^2, -1) + eps)^-0.5 [* weight (n)], in x's dtype."""
    import triton

    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    block = triton.next_power_of_2(n)
    _kernel()[(rows.shape[0],)](rows, weight if weight is not None else rows, out, n, float(eps),
                                HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


def _forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight if module.with_scale else None, module.eps)


def norm_modules(model: nn.Module) -> list[nn.Module]:
    """The model's Gemma 4 RMSNorm modules (their class's name and the attributes the formula reads)."""
    return [m for m in model.modules()
            if type(m).__name__ == "Gemma4RMSNorm" and hasattr(m, "eps") and hasattr(m, "with_scale")]


@contextlib.contextmanager
def fused_norms(model: nn.Module) -> Iterator[int]:
    """Within the block, every Gemma4RMSNorm of `model` runs `rms_norm` (its forward replaced on the instance);
    yields how many. Outside it, the modules are as they were."""
    mods = norm_modules(model)
    for m in mods:
        m.forward = functools.partial(_forward, m)
    try:
        yield len(mods)
    finally:
        for m in mods:
            del m.forward


__all__ = ["rms_norm", "fused_norms", "norm_modules"]
