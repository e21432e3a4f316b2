"""The FP8 row: e4m3 values `q` with one float32 `scale` per token x KV head (the row's value is q * scale; one scale a
row is what a kernel applies without touching the tile: bench/FP8_NOTES.md), its one quantizer and its dequantizers.
scale = amax / 448 (1 for a row of zeros); q = x / scale in float32, clamped, cast to e4m3 (nearest); the rounding
bound derived from it is the gates' (`foldkv.lab.gates.fp8_pool.rounding_bound`).
"""

from __future__ import annotations

import torch

from .moved import moved
from .validate import FoldKvInputError

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32  # one scale per token x KV head
E4M3_MAX = 448.0


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., W] float (finite) -> (q [..., W] float8_e4m3fn, scale [...] float32), on rows' device.
    The caller refuses non-finite rows first (`check_finite_rows`): a NaN or Inf has no finite scale."""
    x = rows.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    # amax / 448 as a division of two tensors: torch's CUDA kernel turns a division by a Python number into a product
    # with its float32 reciprocal (a last-bit difference from the division on some rows), the CPU one does not
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q [..., W] float8_e4m3fn, scale [...] float32 -> q * scale [..., W] in `dtype` (exact in float64)."""
    return q.to(dtype) * scale.to(dtype)[..., None]


def dequantize_rows_bf16(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., W] float8_e4m3fn, scale [...] float32 -> [..., W] bfloat16: one float32 product rounded to bf16, the
    rows the prefill over an FP8 pool reads (`kernels.dequant_pages` is held to it bit for bit)."""
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(torch.bfloat16)


def check_finite_rows(rows: torch.Tensor) -> None:
    """Refuse (FoldKvInputError) rows with a NaN or Inf, or past float32's range: an FP8 row's scale must be finite."""
    x = rows.to(torch.float32)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = [int(i) for i in torch.nonzero(bad)[0]]
        raise FoldKvInputError(
            f"row element {idx} is {float(x[tuple(idx)])}: an FP8 pool stores finite rows only (its scale, amax / 448,"
            " would not be finite); nothing was written")


__getattr__ = moved(__name__, dict.fromkeys(("ROW_REL", "ROW_SUB", "rounding_bound"),
                                       "foldkv.lab.gates.fp8_pool (only the gates and tests bound the quantizer)"))
