"""A sliding layer's prefill without a mask: torch's FlashAttention-2 with its own window (`window_size_left =
window - 1`, causal to the last key), so no [T, S] mask is built, only the band's key tiles are computed and nothing
is set up per prompt length (sdpa over transformers' mask does all three). `refusal` says what it cannot serve (the
caller then takes the masked path); `window_mask` and `window_attention_reference` are what it is held to.
"""

from __future__ import annotations

import torch

MAX_HEAD_DIM = 256  # FlashAttention-2's largest head size


def window_mask(q_length: int, kv_length: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[q_length, kv_length] bool: query i (at key position kv_length - q_length + i) sees key j when
    pos - window < j <= pos, transformers' `sliding_window_overlay` over its causal mask."""
    pos = torch.arange(q_length, device=device)[:, None] + (kv_length - q_length)
    j = torch.arange(kv_length, device=device)[None, :]
    return (j <= pos) & (j > pos - window)


def refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int | None,
            softcap: float | None = None, dropout: float = 0.0) -> str | None:
    """Why `window_attention` cannot serve this call (None: it can). query [B, H, T, D], key/value [B, Hkv, S, D]."""
    if window is None or window < 1:
        return f"no sliding window ({window})"
    if not query.is_cuda:
        return f"on {query.device.type}"
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype}"
    if query.shape[-1] > MAX_HEAD_DIM or key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return f"head_dim {query.shape[-1]} (at most {MAX_HEAD_DIM}, the same for K and V)"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} KV heads"
    if key.shape[2] < query.shape[2]:
        return f"{key.shape[2]} keys for {query.shape[2]} queries"
    if softcap:
        return f"logit softcap {softcap}"
    if dropout:
        return f"dropout {dropout}"
    return None


def window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int,
                     scale: float) -> torch.Tensor:
    """query [B, H, T, D], key/value [B, Hkv, S, D] (S >= T; the queries are the last T key positions), CUDA, bf16 or
    fp16 -> [B, T, H, D] in query's dtype: softmax(scale * q.k) v over the `window` keys up to each query's position.
    Check `refusal` first."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, T|S, heads, D]: the layout FlashAttention reads
    return torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False, scale=scale,
        window_size_left=window - 1, window_size_right=0)[0]


def window_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int,
                               scale: float) -> torch.Tensor:
    """`window_attention` in float64 on any device, through the explicit band: the definition the kernel is held to."""
    q, k, v = (t.double() for t in (query, key, value))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~window_mask(q.shape[2], k.shape[2], window, q.device), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


__all__ = ["MAX_HEAD_DIM", "window_mask", "refusal", "window_attention", "window_attention_reference"]
