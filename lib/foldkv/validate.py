"""Argument checks shared by the prep, the references and every kernel launcher: refuse before anything runs."""

from __future__ import annotations

from typing import Sequence

import torch


class FoldKvInputError(ValueError):
    """Bad input refused before any launch or write; the message names the argument."""


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device, refused (FoldKvInputError) when this torch cannot reach it; every entry point that
    puts tensors on a caller's device asks here, so a CPU-only torch answers in foldkv's words, not an assertion."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise FoldKvInputError(f"device {device!r} is not a torch device ({exc})") from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise FoldKvInputError(
                f"device {str(dev)!r}: CUDA is not available in this torch build (torch {torch.__version__}, CPU only):"
                " use device='cpu', or install a CUDA build of torch (README: torch, and GPU users)")
        raise FoldKvInputError(
            f"device {str(dev)!r}: torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no CUDA"
            " device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides it): use device='cpu' or run where a GPU is")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise FoldKvInputError(f"device {str(dev)!r} does not exist: torch sees {count} CUDA device(s)")
    return dev


def check_tensor(name: str, t: torch.Tensor, *, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                 device: torch.device | str | None = None, shape: Sequence[int | None] | None = None,
                 contiguous: bool = False) -> None:
    """Raise FoldKvInputError unless `t` is a tensor of the given dtype(s), device, shape (None = any) and layout."""
    if not isinstance(t, torch.Tensor):
        raise FoldKvInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise FoldKvInputError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, allowed))}")
    want = None if device is None else torch.device(device)
    if want is not None and (want.type != t.device.type or want.index not in (None, t.device.index)):
        raise FoldKvInputError(f"{name} is on {t.device}; expected {want}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            pretty = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise FoldKvInputError(f"{name} has shape {list(t.shape)}; expected {pretty}")
    if contiguous and not t.is_contiguous():
        raise FoldKvInputError(f"{name} must be contiguous (call .contiguous() first)")


def check_index_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every element of integer tensor `t` in [low, high)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        raise FoldKvInputError(f"{name} holds {lo if lo < low else hi}, outside [{low}, {high})")
