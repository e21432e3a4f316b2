"""A sliding layer's prefill without a mask: torch's FlashAttention-2 with its own window (`window_size_left =
window - 1`, causal to the last key), so no [T, S] mask is built, only the band's key tiles are computed and nothing
is set up per prompt length (sdpa over transformers' mask does all three). `refusal` says what it cannot serve (the
caller then takes the masked path); it is held to `foldkv.lab.window_reference`.
"""

from __future__ import annotations

import torch

from .moved import moved

MAX_HEAD_DIM = 256  # FlashAttention-2's largest head size


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


__getattr__ = moved(__name__, {n: f"foldkv.lab.window_reference.{n} (only tests and probes read it)"
                               for n in ("window_mask", "window_attention_reference")})


__all__ = ["MAX_HEAD_DIM", "refusal", "window_attention"]
