"""What foldkv's attention function receives as a layer's mask, and the names it is registered under.

transformers builds one mask per layer type and hands it to the model's attention function. Under foldkv's attention
implementations (`SLIDING_IMPLEMENTATION`, registered by `foldkv.hf`) that mask is, for a global layer, a `NewTokens`
(which of the forward's new columns are real tokens: foldkv's mask function reads it from the 2D padding mask, the
decode step makes one of one token a sequence) and, for a sliding layer at a decode step of `foldkv.hf_graph`, a
`RingMask` over the slots of the layer's ring (`foldkv.ring.ring_attention` reads it), at a CUDA prefill whose
sliding mask is the plain window a `SlidingWindow` (`foldkv.window_attention` serves it without a mask;
`plain_window` says when). Plain data, no imports of
foldkv: the decode step, its fused forward and the transformers adapter all read these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The attention implementations foldkv registers with transformers, each with the implementation its sliding layers
# keep.
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
    """Is this sliding mask call transformers' plain sliding-window causal mask of a CUDA prefill forward: sdpa's
    sliding layers, more than one query, no overlay of another mask function (transformers then asks for vmap or
    forbids the causal skip), the queries the last kv positions, and no padding (one read of the 2D mask)."""
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else None)
    if sliding != "sdpa" or q_length < 2 or device is None or torch.device(device).type != "cuda":
        return False
    if kwargs.get("use_vmap", True) or not kwargs.get("allow_is_causal_skip", False):
        return False
    if int(q_offset) + q_length != kv_offset + kv_length:
        return False
    return attention_mask is None or bool(attention_mask.all())


__all__ = ["NewTokens", "RingMask", "SLIDING_IMPLEMENTATION", "SlidingWindow", "plain_window"]
