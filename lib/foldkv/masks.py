"""What foldkv's attention function receives as a layer's mask, and the names it is registered under.

transformers builds one mask per layer type and hands it to the model's attention function. Under foldkv's attention
implementations (`SLIDING_IMPLEMENTATION`, registered by `foldkv.hf`) that mask is, for a global layer, a `NewTokens`
(which of the forward's new columns are real tokens: foldkv's mask function reads it from the 2D padding mask, the
decode step makes one of one token a sequence) and, for a sliding layer at a decode step of `foldkv.hf_graph`, a
`RingMask` over the slots of the layer's ring (`foldkv.ring.ring_attention` reads it). Plain data, no imports of
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


__all__ = ["NewTokens", "RingMask", "SLIDING_IMPLEMENTATION"]
