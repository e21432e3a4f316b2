"""The FP8 row: e4m3 values `q` with one float32 `scale` per token x KV head (the row's value is q * scale; one scale a
row is what a kernel applies without touching the tile: bench/FP8_NOTES.md), its one quantizer, dequantizers and
rounding bound. scale = amax / 448 (1 for a row of zeros); q = x / scale in float32, clamped, cast to e4m3 (nearest).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
E4M3_MAX = 448.0
SCALE_BYTES = 4  # one float32 scale per token x KV head

# |q*scale - x| <= ROW_REL * |x| + ROW_SUB * scale, elementwise, derived from the rounding above:
#  - e4m3 has 3 fraction bits: round to nearest moves a normal value (|y| >= 2^-6) by <= 2^-4 |y|, a subnormal one by
#    <= 2^-10 (half the spacing 2^-9); so |q - y| <= 2^-4 |y| + 2^-10;
#  - y = x / scale in float32 is off by <= 2^-24 |y|, and the clamp, which only float32 rounding can reach, by as
#    much again; the float64 product q*scale is exact. Together ROW_REL = 2^-4 + 2^-21 (a margin over 2^-4 + 2^-22).
ROW_REL, ROW_SUB = 2.0**-4 + 2.0**-21, 2.0**-10


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


def rounding_bound(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most `quantize_rows` may move each element of `rows`: ROW_REL * |x| + ROW_SUB * scale, float64."""
    return ROW_REL * rows.to(torch.float32).double().abs() + ROW_SUB * scale.double()[..., None]


def check_finite_rows(rows: torch.Tensor) -> None:
    """Refuse (FoldKvInputError) rows with a NaN or Inf, or past float32's range: an FP8 row's scale must be finite."""
    from .validate import FoldKvInputError

    x = rows.to(torch.float32)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = [int(i) for i in torch.nonzero(bad)[0]]
        raise FoldKvInputError(
            f"row element {idx} is {float(x[tuple(idx)])}: an FP8 pool stores finite rows only (its scale, amax / 448,"
            " would not be finite); nothing was written"
        )
