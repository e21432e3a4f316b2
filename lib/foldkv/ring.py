"""A sliding layer's decode attention over its ring (`ring_attention`), the one function both foldkv's attention
function (`foldkv.hf`, for a `RingMask`) and the decode step's fused sliding forward (`foldkv.fused_step`) call.

Both read it as `ring.ring_attention` at call time, so a lab version (bench/versions/ring_attention_*.py) that
replaces this one name replaces it for every caller.
"""

from __future__ import annotations

import torch

from .fused_step_ops import masked_softmax
from .masks import RingMask


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: RingMask, out: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """A sliding layer's decode attention over its ring, computed as transformers' eager attention computes it (scores
    by a matmul in the model's dtype, softmax in float32, rounded back, a matmul with V). query [B, Hq, 1, d],
    key/value [B, Hkv, W, d]: each KV head's query heads (h = kv * group + r, transformers' repeat_kv order) become
    that head's query rows, so no K/V is repeated. Two batched matmuls over B x Hkv heads keep the whole chip busy
    where an SDPA kernel parallel over heads and query rows runs B x Hkv CTAs (16 at batch 1). Returns
    ([B, 1, Hq, d], None), what transformers' attention functions return; `out` ([B, Hkv, Hq / Hkv, d] packed): P.V
    written there (the lab's ring attention in parts writes each part into its slice)."""
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
