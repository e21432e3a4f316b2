"""What a sliding layer's maskless prefill (`foldkv.window_attention.window_attention`) is held to: the window's mask
(`window_mask`) and the float64 attention through it (`window_attention_reference`). Only tests and probes read them.
"""

from __future__ import annotations

import torch


def window_mask(q_length: int, kv_length: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[q_length, kv_length] bool: query i (at key position kv_length - q_length + i) sees key j when
    pos - window < j <= pos, transformers' `sliding_window_overlay` over its causal mask."""
    pos = torch.arange(q_length, device=device)[:, None] + (kv_length - q_length)
    j = torch.arange(kv_length, device=device)[None, :]
    return (j <= pos) & (j > pos - window)


def window_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int,
                               scale: float) -> torch.Tensor:
    """`window_attention` in float64 on any device, through the explicit band: the definition the kernel is held to."""
    q, k, v = (t.double() for t in (query, key, value))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~window_mask(q.shape[2], k.shape[2], window, q.device), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


__all__ = ["window_mask", "window_attention_reference"]
