"""What foldkv's attention function receives as a layer's mask (`NewTokens` of a global layer, `RingMask` of a
sliding layer's ring at a decode step, `SlidingWindow` of a CUDA prefill's plain window) and the implementation names
it is registered under. Plain data: the decode step, its forward and the transformers adapter all read these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# foldkv's attention implementations, each with the one its sliding layers keep.
SLIDING_IMPLEMENTATION = {"foldkv": "sdpa", "foldkv_eager": "eager"}


@dataclass(frozen=True)
class NewTokens:
    """The full-attention "mask" of one forward: real [B, T] bool on the model's device (True: a real token of that
    sequence; padding is on the left) and counts, the real tokens of each sequence among the T new columns (host)."""

    real: torch.Tensor
    counts: tuple[int, ...]


@dataclass(frozen=True)
class RingMask:
    """The sliding layers' mask of a decode step: mask [B, 1, 1, W] bool (True: attend) over the ring's slots."""

    mask: torch.Tensor


class SlidingWindow:
    """The sliding layers' "mask" of a prefill forward whose mask is the plain sliding window (no padding, no other
    overlay, the queries the last keys): `window_attention` serves it without a mask; a call it cannot serve asks
    `tensor()`, transformers' own mask, built once on first use."""

    def __init__(self, window: int, build):
        self.window, self._build, self._tensor = window, build, None

    def tensor(self):
        if self._build is not None:
            self._tensor, self._build = self._build(), None
        return self._tensor


def plain_window(sliding: str, q_length: int, kv_length: int, q_offset, kv_offset: int,
                  attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Is this sliding mask call the plain sliding-window causal mask of a CUDA prefill: sdpa's sliding layers, more
    than one query, no other mask function overlaid, the queries the last kv positions, and no padding."""
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else None)
    if sliding != "sdpa" or q_length < 2 or device is None or torch.device(device).type != "cuda":
        return False
    if kwargs.get("use_vmap", True) or not kwargs.get("allow_is_causal_skip", False):
        return False
    if int(q_offset) + q_length != kv_offset + kv_length:
        return False
    return attention_mask is None or bool(attention_mask.all())


__all__ = ["NewTokens", "RingMask", "SLIDING_IMPLEMENTATION", "SlidingWindow", "plain_window"]
