"""A synthetic Gemma 4 checkpoint: few layers, small vocab and width, but global layers with the 31B attention geometry.

`make_synthetic_checkpoint(dir, seed=...)` writes `config.json` + `model.safetensors` in the layout a real Gemma 4 text
checkpoint uses (`write_drawn_checkpoint`: any configuration, shards for a full-size one), so the drift study loads
it through the same `from_pretrained` path as a real model. The global (full-attention) layers keep what foldkv
folds: 32 query heads over 4 KV heads, head_dim 512, `attention_k_eq_v`, proportional RoPE with factor 0.25 (theta
1e6). Everything else is shrunk (hidden 256, vocab 512, 4 layers) so a CPU runs it in seconds.

Why the weights are drawn the way they are:
- Linear layers ~ N(0, 1/fan_in): every projection keeps unit-scale activations.
- q_norm weights ~ (score_std / sqrt(head_dim)) * lognormal: Gemma 4 uses attention scaling 1.0, so q.k of two
  unit-RMS 512-vectors would have std ~22 and every softmax would be one-hot. Scaling the query norm gives score std
  of a few units: attention spread over many keys, as in a trained model.
- k_norm weights ~ lognormal(0, 0.5): far from 1 and different per column, so folding w_k into the query (the folded
  format's one algebraic step) is exercised; a fold that forgets or misplaces w_k moves the logits visibly.
- Other RMSNorm weights ~ 1 + 0.2 N(0, 1) (Gemma 4's RMSNorm multiplies by the weight as is).
- The post-attention / post-feedforward RMSNorm weights ~ 2 (1 + 0.2 N(0, 1)): each block's output outweighs the
  scaled input embedding in the residual stream, so what attention returns reaches the logits.
- Embedding and LM head are untied, both ~ N(0, logit_std / sqrt(hidden)): logits have std ~logit_std before the final
  softcap (30), neither flat nor saturated, and the top-1/top-2 margins spread down to ~0 (what the argmax claim is
  tested on). (Tied, the residual's copy of the input embedding makes the input token win every step by ~15.)
Values are drawn per tensor from a generator seeded by (seed, crc32(name)), so they do not depend on module order or
on the transformers version that builds the module tree.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from typing import Any

import torch

SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    # Two sliding layers, two global ones; the last layer must be global in Gemma 4.
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "sliding_window": 128,
    "sliding_head_dim": 32,
    "sliding_kv_heads": 4,
}


def synthetic_config(*, vocab_size: int = 512, hidden_size: int = 256, intermediate_size: int = 512,
                     layer_types: list[str] | None = None, sliding_window: int = 128, sliding_head_dim: int = 32,
                     sliding_kv_heads: int = 4, num_q_heads: int = 32, global_kv_heads: int = 4,
                     global_head_dim: int = 512, partial_rotary_factor: float = 0.25,
                     global_rope_theta: float = 1_000_000.0, final_logit_softcapping: float | None = 30.0,
                     dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json dict, written the way a real Gemma 4 text checkpoint spells it (`global_head_dim`,
    `num_global_key_value_heads`, per-layer-type `rope_parameters`), which every transformers 5.x Gemma 4 reads and
    `foldkv.geometry_from_config` reads too."""
    layer_types = list(layer_types or SYNTHETIC_DEFAULTS["layer_types"])
    if layer_types[-1] != "full_attention":
        raise ValueError("Gemma 4's last layer is a full_attention layer (transformers forces it)")
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": num_q_heads,
        "num_key_value_heads": sliding_kv_heads,
        "head_dim": sliding_head_dim,
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv_heads,
        "attention_k_eq_v": True,
        "sliding_window": sliding_window,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial_rotary_factor,
                               "rope_theta": global_rope_theta},
        },
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 262_144,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": final_logit_softcapping,
        "hidden_size_per_layer_input": 0,  # no per-layer embeddings (the 31B has none)
        "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "dtype": dtype,
        "foldkv_synthetic": True,  # marker read by `describe_checkpoint`; transformers keeps unknown keys as attributes
    }


def _generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))


def draw_tensor(name: str, shape: torch.Size, seed: int, *, hidden_size: int, logit_std: float = 4.0,
                score_std: float = 2.5, device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor of a synthetic state dict, by the rules in the module docstring (float32, on `device`). On the CPU
    the draw is float64 (the synthetic checkpoints' values); on another device it is float32 from that device's
    generator (a full-size model's 30B values in seconds; other numbers than the CPU's for the same seed)."""
    g = _generator(seed, name, device)
    cpu = torch.device(device).type == "cpu"
    normal = torch.randn(shape, generator=g, dtype=torch.float64 if cpu else torch.float32, device=device)
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return (normal * (logit_std / math.sqrt(hidden_size))).float()
    if name.endswith("q_norm.weight"):
        head_dim = shape[0]
        return ((score_std / math.sqrt(head_dim)) * torch.exp(0.3 * normal)).float()
    if name.endswith("k_norm.weight"):
        return torch.exp(0.5 * normal).float()
    if name.endswith("layer_scalar"):
        return torch.ones(shape, device=device)
    if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
        return (2.0 * (1.0 + 0.2 * normal)).float()
    if len(shape) == 1:  # the other RMSNorm scales
        return (1.0 + 0.2 * normal).float()
    if len(shape) == 2:  # nn.Linear [out, in]
        return (normal / math.sqrt(shape[1])).float()
    raise ValueError(f"no synthetic rule for {name} {list(shape)}")


def make_synthetic_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0, logit_std: float = 4.0,
                              score_std: float = 2.5, **config_overrides) -> str:
    """Write a synthetic Gemma 4 text checkpoint (config.json + model.safetensors, bf16) into `out_dir`; return it."""
    cfg_dict = synthetic_config(**config_overrides)
    cfg_dict["foldkv_synthetic_seed"] = int(seed)
    return write_drawn_checkpoint(out_dir, cfg_dict, seed, logit_std=logit_std, score_std=score_std)


def write_drawn_checkpoint(out_dir: str | os.PathLike, cfg_dict: dict[str, Any], seed: int, *,
                           device: torch.device | str = "cpu", shard_bytes: int = 4 << 30, **draw_kw) -> str:
    """Write `cfg_dict` as config.json and every tensor of the model it describes, drawn by `draw_tensor` on `device`
    (the tied LM head once, as the embedding), in the model's dtype, into `out_dir`; return it. One
    `model.safetensors`, or shards of at most `shard_bytes` (a full-size model) with `model.safetensors.index.json`,
    the layout `from_pretrained` reads. The module tree comes from the installed transformers
    (`Gemma4ForCausalLM(config)` on the meta device), so the tensor names are the ones its `from_pretrained` expects;
    each tensor is drawn, moved to the host and written shard by shard (host memory: one shard)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, Gemma4ForCausalLM

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg_dict, fh, indent=2)
    config = AutoConfig.from_pretrained(out_dir)
    with torch.device("meta"):
        skeleton = Gemma4ForCausalLM(config)
    dtype = getattr(torch, cfg_dict["dtype"])
    tied = {"lm_head.weight"} if cfg_dict["tie_word_embeddings"] else set()
    shapes = [(name, t.shape) for name, t in skeleton.state_dict().items() if name not in tied]
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    for name, shape in shapes:  # consecutive tensors up to shard_bytes a file
        n = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file, shard in zip(files, shards):
        state = {name: draw_tensor(name, shape, seed, hidden_size=cfg_dict["hidden_size"], device=device,
                                   **draw_kw).to(dtype).contiguous().cpu() for name, shape in shard}
        save_file(state, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, file))
        del state
    if len(files) > 1:
        total = sum(math.prod(shape) * dtype.itemsize for _, shape in shapes)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    return out_dir


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint directory is: synthetic (with its seed) or a real one (its name), and its text geometry."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as fh:
        raw = json.load(fh)
    tc = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    return {
        "path": os.path.abspath(path),
        "kind": "synthetic" if tc.get("foldkv_synthetic") else "checkpoint",
        "seed": tc.get("foldkv_synthetic_seed"),
        "model_type": raw.get("model_type"),
        "architectures": raw.get("architectures"),
        "num_hidden_layers": tc.get("num_hidden_layers"),
        "hidden_size": tc.get("hidden_size"),
        "vocab_size": tc.get("vocab_size"),
        "num_global_layers": sum(1 for t in tc.get("layer_types") or [] if t == "full_attention"),
        "global_head_dim": tc.get("global_head_dim"),
        "num_global_key_value_heads": tc.get("num_global_key_value_heads"),
        "num_attention_heads": tc.get("num_attention_heads"),
    }
