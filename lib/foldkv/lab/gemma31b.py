"""Gemma 4 31B's text architecture at full size, with random weights made on the device: the model the end-to-end
decode benchmark (notebook 05) times.

The configuration is the published 31B's text configuration (google/gemma-4-31B-it, `config.json` -> `text_config`,
as public configuration fixtures and the model card spell it, found through the search tool): hidden 5,376,
intermediate 21,504, 60 layers in the pattern five sliding + one full attention, 32 query heads; sliding layers 16 KV
heads of 256 over a window of 1,024 (RoPE theta 1e4), full-attention layers 4 KV heads of 512 with `attention_k_eq_v`
and proportional RoPE (factor 0.25, theta 1e6); vocab 262,144 with tied embeddings, final logit softcap 30, GELU-tanh,
no per-layer embeddings, no MoE, no KV sharing: 30,697,345,280 parameters (61.4 GB in bf16).

Why random weights do not change a timing: a decode step reads every weight once and the KV its sequences hold, and
its kernels' work depends on the shapes and lengths alone (no data-dependent branch or sparsity anywhere in the
forward). What random weights change is which tokens come out: agreement between arms is still a fair comparison
(the same model, the same prompts), but not a quality figure.

The weights follow `foldkv.lab.synthetic`'s rules (unit-scale activations, attention spread over many keys rather than
one-hot), drawn per tensor on the device from a generator seeded by (seed, the tensor's name). The module tree is made
on the meta device and `to_empty`'d onto the device; its buffers are then set to what the model computes for them
(`to_empty` leaves them uninitialised): the RoPE inverse frequencies (a fresh rotary module on the device), the
embedding scale sqrt(hidden) and the layer scalars (1), and the LM head is tied to the embedding again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .synthetic import draw_tensor, synthetic_config

PARAMETERS_31B = 30_697_345_280  # Gemma 4 31B's text model, tied embeddings (the published config; counted by `count_parameters`)


def gemma4_31b_config(*, num_layers: int | None = None, dtype: str = "bfloat16", **overrides) -> dict[str, Any]:
    """The 31B text configuration as a config.json dict. For tests only: `num_layers`, the first that many layers of
    the pattern (a multiple of 6: the last must be a full-attention layer), and `overrides` of other fields (a
    smaller vocab or width)."""
    layers = (["sliding_attention"] * 5 + ["full_attention"]) * 10
    if num_layers is not None:
        if num_layers < 6 or num_layers % 6:
            raise ValueError(f"num_layers={num_layers}: a multiple of 6 (Gemma 4's last layer is full attention)")
        layers = layers[:num_layers]
    cfg = synthetic_config(vocab_size=262_144, hidden_size=5_376, intermediate_size=21_504, layer_types=layers,
                           sliding_window=1_024, sliding_head_dim=256, sliding_kv_heads=16, num_q_heads=32,
                           global_kv_heads=4, global_head_dim=512, partial_rotary_factor=0.25,
                           global_rope_theta=1_000_000.0, final_logit_softcapping=30.0, dtype=dtype)
    cfg.pop("foldkv_synthetic")
    cfg.update(tie_word_embeddings=True, vocab_size_per_layer_input=262_144, name_or_path="gemma-4-31b-random")
    cfg.update(overrides)
    return cfg


def _text_config(cfg: dict[str, Any], attn_implementation: str):
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(**cfg)
    config._attn_implementation = attn_implementation
    return config


def meta_model(cfg: dict[str, Any] | None = None, attn_implementation: str = "sdpa") -> nn.Module:
    """The `Gemma4ForCausalLM` that `cfg` (a config.json dict; default: the 31B) describes, on the meta device: its
    module shapes without memory."""
    from transformers import Gemma4ForCausalLM

    with torch.device("meta"):
        return Gemma4ForCausalLM(_text_config(cfg or gemma4_31b_config(), attn_implementation))


def count_parameters(cfg: dict[str, Any] | None = None) -> int:
    """Parameters of the model `cfg` describes (default: the 31B), counted on the meta device (no memory), the tied
    LM head once."""
    return sum(p.numel() for p in meta_model(cfg).parameters())  # parameters() yields a tied tensor once


@torch.no_grad()
def build_gemma4_31b(device: torch.device | str = "cuda", *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                     attn_implementation: str = "sdpa", num_layers: int | None = None, **overrides) -> nn.Module:
    """A `Gemma4ForCausalLM` of the 31B architecture (module docstring) with random weights on `device`, in eval mode.
    attn_implementation: any transformers or foldkv implementation (import foldkv.hf first for "foldkv").
    num_layers, overrides: a smaller model of the same kind, for tests (`gemma4_31b_config`)."""
    from transformers import Gemma4ForCausalLM

    cfg = gemma4_31b_config(num_layers=num_layers, dtype=str(dtype).removeprefix("torch."), **overrides)
    config = _text_config(cfg, attn_implementation)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config).to(dtype)
    model.to_empty(device=device)
    text = model.model
    hidden = cfg["hidden_size"]
    for name, p in model.named_parameters():  # a tied weight is yielded once (the embedding)
        p.copy_(draw_tensor(name, p.shape, seed, hidden_size=hidden, device=device))
    # the buffers to_empty left uninitialised: what the model computes for them
    text.rotary_emb = type(text.rotary_emb)(text.config, device=device)
    embed = text.embed_tokens
    embed.embed_scale.fill_(float(getattr(embed, "scalar_embed_scale", hidden ** 0.5)))
    for layer in text.layers:
        layer.layer_scalar.fill_(1.0)
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != embed.weight.data_ptr():
        raise RuntimeError("the LM head is not tied to the embedding after tie_weights()")
    for name, b in model.named_buffers():
        if b.is_floating_point() and not bool(torch.isfinite(b).all()):
            raise RuntimeError(f"buffer {name} is not finite after the build")
    return model.eval()


def write_gemma4_31b_checkpoint(out_dir: str, *, seed: int = 0, device: torch.device | str = "cuda",
                                dtype: str = "bfloat16", num_layers: int | None = None, **overrides) -> str:
    """The model `build_gemma4_31b(device, seed=seed)` makes, as a checkpoint folder (config.json, safetensors shards
    and their index; 61.4 GB at full size): the same draws, for what loads through `from_pretrained`, such as
    transformers' tensor parallelism (`tp_plan="auto"`), which shards a checkpoint as it reads it. Returns out_dir."""
    from .synthetic import write_drawn_checkpoint

    return write_drawn_checkpoint(out_dir, gemma4_31b_config(num_layers=num_layers, dtype=dtype, **overrides), seed,
                                  device=device)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters this process holds (a tied tensor once; under tensor parallelism its shards
    and the replicated tensors): what every decode step of this process reads."""
    from ..hf import local_tensor

    return sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())


__all__ = ["PARAMETERS_31B", "gemma4_31b_config", "meta_model", "count_parameters", "build_gemma4_31b",
           "write_gemma4_31b_checkpoint", "weight_bytes"]
