"""A sliding layer's decode attention over its ring (`ring_attention`), which every caller reads as
`ring.ring_attention` at call time, so a lab version that replaces this one name replaces it everywhere.
"""

from __future__ import annotations

import torch

from .fused_step_ops import masked_softmax
from .masks import RingMask


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: RingMask, out: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """A sliding layer's decode attention over its ring, as transformers' eager attention computes it. query
    [B, Hq, 1, d], key/value [B, Hkv, W, d]: each KV head's query heads become its query rows (no K/V repeated; two
    batched matmuls over B x Hkv heads fill the chip). Returns ([B, 1, Hq, d], None); `out` ([B, Hkv, Hq / Hkv, d]
    packed): P.V written there."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)
    scores = torch.matmul(q, key.transpose(-1, -2))  # [B, Hkv, group, W]
    if float(module.scaling) != 1.0:
        scores = scores * float(module.scaling)
    if scores.is_cuda:  # one kernel for the float32 cast, the mask, the softmax and the rounding
        probs = masked_softmax(scores, mask.mask, value.dtype)
    else:
        probs = torch.softmax(scores.float().masked_fill(~mask.mask, float("-inf")), dim=-1).to(value.dtype)
    return torch.matmul(probs, value, out=out).reshape(b, 1, hq, d), None


__all__ = ["ring_attention"]
