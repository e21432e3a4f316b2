"""The prefill's compute floor: the FLOPs a prompt needs, counted from the model's own module shapes, and the seconds
they take at a dense bf16 matmul rate measured in the same run.

What a prompt of T tokens (each of `batch` sequences) needs, and nothing a particular implementation adds:
- projections and MLP: 2 x (in x out) of every `nn.Linear` of the text model (q/k/v/o, gate/up/down, and any other
  projection the text model applies per token) for every token;
- attention, per layer and query head, 4 x head_dim FLOPs a query-key pair (2 d for q.k, 2 d for p.v) over the pairs
  the layer's mask allows: a full-attention layer every causal pair (T (T + 1) / 2), a sliding layer a query at
  position p over min(p + 1, window) keys (transformers' sliding mask: keys p - window < j <= p);
- the LM head for the last token of each sequence only (generate() needs the next token's logits, not the prompt's).
Norms, RoPE, activations and the softcap are elementwise and left out (they are not matmul work). A chunked prefill
needs the same pairs (a chunk's queries attend to what precedes them), so its chunks sum to the prompt's FLOPs; the
LM head is counted in the last chunk.

    shapes = model_shapes(model)                    # or a config.json dict: built on the meta device
    flops = prefill_flops(shapes, 32_768, chunk=8_192)
    floor = floor_seconds(flops.total, roofs.measure_matmul_roof(dev)["tflops"])
    prefill_floor(model, 32_768, chunk=8_192, device=dev)   # both, the rate measured now
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

ATTENTION_FLOPS_PER_PAIR_PER_DIM = 4  # q.k (2 d) + p.v (2 d) per query head and query-key pair


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention as the floor counts it: query heads, head dim and sliding window (None: causal over
    everything before)."""

    heads: int
    head_dim: int
    window: int | None


@dataclass(frozen=True)
class ModelShapes:
    """What the floor reads from a model: the weights every token multiplies (in x out summed over the text model's
    Linear modules), the LM head's in x out, and every layer's attention."""

    linear_weights: int
    lm_head_weights: int
    attention: tuple[AttentionShape, ...]


@dataclass(frozen=True)
class PrefillFlops:
    """A prompt's FLOPs by component; `chunks`: each chunk's share when a chunk size was given (they sum to total)."""

    projections: int
    global_attention: int
    sliding_attention: int
    lm_head: int
    chunks: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.projections + self.global_attention + self.sliding_attention + self.lm_head

    def as_dict(self) -> dict:
        return {"projections": self.projections, "global_attention": self.global_attention,
                "sliding_attention": self.sliding_attention, "lm_head": self.lm_head, "total": self.total,
                "chunks": list(self.chunks)}


def _text_model(model: nn.Module) -> nn.Module:
    for cand in (getattr(model, "model", None), getattr(getattr(model, "model", None), "language_model", None), model):
        if cand is not None and hasattr(cand, "layers") and hasattr(getattr(cand, "config", None), "layer_types"):
            return cand
    raise ValueError(f"{type(model).__name__} has no text model with .layers and config.layer_types")


def model_shapes(model_or_config: nn.Module | Mapping[str, Any]) -> ModelShapes:
    """The shapes the floor counts, read from the model's modules: a Gemma 4 causal LM (any device, meta included) or
    a config.json dict (`gemma31b.gemma4_31b_config()`), whose model is built on the meta device."""
    if isinstance(model_or_config, ModelShapes):
        return model_or_config
    if isinstance(model_or_config, Mapping):
        from .gemma31b import meta_model

        model = meta_model(dict(model_or_config))
    elif isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        raise TypeError(f"expected a model or a config.json dict, got {type(model_or_config).__name__}")
    text = _text_model(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no Linear output projection (LM head)")
    linear = sum(m.in_features * m.out_features for m in text.modules() if isinstance(m, nn.Linear))
    attention = []
    for i, layer in enumerate(text.layers):
        attn = layer.self_attn
        d = int(attn.head_dim)
        if attn.q_proj.out_features % d:
            raise ValueError(f"layer {i}: q_proj has {attn.q_proj.out_features} rows, not a multiple of head_dim {d}")
        window = getattr(attn, "sliding_window", None) if getattr(attn, "is_sliding", False) else None
        attention.append(AttentionShape(attn.q_proj.out_features // d, d, None if window is None else int(window)))
    return ModelShapes(linear, head.in_features * head.out_features, tuple(attention))


def causal_pairs(n: int) -> int:
    """Query-key pairs of positions 0..n-1 under a causal mask: n (n + 1) / 2."""
    return n * (n + 1) // 2


def window_pairs(n: int, window: int) -> int:
    """Query-key pairs of positions 0..n-1 under a sliding window: the query at p sees min(p + 1, window) keys."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if n <= window:
        return causal_pairs(n)
    return causal_pairs(window) + (n - window) * window


def _pairs(n: int, window: int | None) -> int:
    return causal_pairs(n) if window is None else window_pairs(n, window)


def _span_flops(shapes: ModelShapes, start: int, end: int) -> tuple[int, int, int]:
    """(projections, global attention, sliding attention) FLOPs of one sequence's queries at positions start..end-1."""
    proj = 2 * shapes.linear_weights * (end - start)
    full = slide = 0
    for a in shapes.attention:
        f = ATTENTION_FLOPS_PER_PAIR_PER_DIM * a.heads * a.head_dim * (_pairs(end, a.window) - _pairs(start, a.window))
        if a.window is None:
            full += f
        else:
            slide += f
    return proj, full, slide


def prefill_flops(model_or_config: nn.Module | Mapping[str, Any] | ModelShapes, prompt_tokens: int, batch: int = 1,
                  chunk: int | None = None) -> PrefillFlops:
    """The FLOPs `batch` prompts of `prompt_tokens` tokens each need (module docstring), by component; with `chunk`
    (a chunked prefill's chunk size), each chunk's share as well, the LM head in the last one."""
    for name, v in (("prompt_tokens", prompt_tokens), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk={chunk!r} must be a positive int or None")
    shapes = model_shapes(model_or_config)
    proj, full, slide = (batch * x for x in _span_flops(shapes, 0, prompt_tokens))
    head = 2 * shapes.lm_head_weights * batch
    chunks: tuple[int, ...] = ()
    if chunk is not None:
        starts = list(range(0, prompt_tokens, chunk))
        chunks = tuple(batch * sum(_span_flops(shapes, s, min(s + chunk, prompt_tokens))) for s in starts)
        chunks = chunks[:-1] + (chunks[-1] + head,)
    return PrefillFlops(proj, full, slide, head, chunks)


def floor_seconds(flops: int | float, matmul_tflops: float) -> float:
    """Seconds `flops` take at `matmul_tflops` (TFLOP/s; `roofs.measure_matmul_roof(device)["tflops"]`, measured in
    the same run as the time it is compared with)."""
    if not matmul_tflops or matmul_tflops <= 0:
        raise ValueError(f"matmul_tflops={matmul_tflops!r} must be positive")
    return float(flops) / (matmul_tflops * 1e12)


def prefill_floor(model_or_config: nn.Module | Mapping[str, Any] | ModelShapes, prompt_tokens: int, *, batch: int = 1,
                  chunk: int | None = None, device: Any = "cuda", roof: Mapping[str, Any] | None = None) -> dict:
    """A prompt's FLOPs (`prefill_flops`) and its floor in seconds at the bf16 matmul rate measured now on `device`
    (`bench.roofs.measure_matmul_roof`), or at `roof`'s (that function's result, measured earlier in the same run):
    {"flops": PrefillFlops.as_dict(), "tflops", "floor_s", "chunk_floor_s": each chunk's}."""
    flops = prefill_flops(model_or_config, prompt_tokens, batch, chunk)
    if roof is None:
        from .bench.roofs import measure_matmul_roof

        roof = measure_matmul_roof(device)
    rate = float(roof["tflops"])
    return {"flops": flops.as_dict(), "tflops": rate, "floor_s": floor_seconds(flops.total, rate),
            "chunk_floor_s": [floor_seconds(c, rate) for c in flops.chunks]}


__all__ = ["ATTENTION_FLOPS_PER_PAIR_PER_DIM", "AttentionShape", "ModelShapes", "PrefillFlops", "causal_pairs",
           "floor_seconds", "model_shapes", "prefill_flops", "prefill_floor", "window_pairs"]
