"""The geometry of one Gemma 4 global-attention layer, and a loader that reads it from a `config.json`."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping


class ConfigError(ValueError):
    """A model config foldkv cannot serve (the message says which field and why)."""


@dataclass(frozen=True)
class AttentionGeometry:
    """Shape and constants of a global (full-attention) layer with `attention_k_eq_v`; the defaults are Gemma 4 31B's."""

    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 512
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    num_global_layers: int = 10
    num_layers: int = 60
    max_position: int = 262_144
    name: str = field(default="gemma-4-31b", compare=False)

    def __post_init__(self) -> None:
        if self.num_q_heads <= 0 or self.num_kv_heads <= 0 or self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_q_heads={self.num_q_heads} must be a positive multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be positive and even (rotate_half pairs d with d+D/2)")
        if self.rotary_pairs <= 0 or self.rotary_pairs * 2 != round(self.partial_rotary_factor * self.head_dim):
            raise ConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} x head_dim={self.head_dim} does not give an even,"
                " positive rotary width: the folded row needs a whole number of rotated pairs")
        if self.rotary_pairs * 2 >= self.head_dim:
            raise ConfigError("the whole head is rotated: nothing to fold (partial_rotary_factor must be < 1)")
        if not 0 < self.num_global_layers <= self.num_layers:
            raise ConfigError(f"num_global_layers={self.num_global_layers} must be in 1..num_layers={self.num_layers}")
        if self.max_position <= 0:
            raise ConfigError(f"max_position={self.max_position} must be positive")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def rotary_pairs(self) -> int:
        """Rotated (d, d + D/2) pairs: proportional RoPE gives int(factor * D // 2) non-zero frequencies."""
        return int(self.partial_rotary_factor * self.head_dim // 2)

    @property
    def rotary_width(self) -> int:
        """Rotated columns per head (128 for the 31B)."""
        return 2 * self.rotary_pairs

    def per_rank(self, ranks: int) -> "AttentionGeometry":
        """The geometry one of `ranks` tensor-parallel ranks holds: whole KV heads with their query groups (ConfigError
        when the KV heads do not divide among the ranks)."""
        ranks = int(ranks)
        if ranks < 1 or self.num_kv_heads % ranks:
            raise ConfigError(f"{ranks} tensor-parallel ranks over {self.num_kv_heads} KV heads: each rank must hold"
                              " whole KV heads with their query groups (a rank count dividing the KV heads)")
        if ranks == 1:
            return self
        return replace(self, num_q_heads=self.num_q_heads // ranks, num_kv_heads=self.num_kv_heads // ranks,
                       name=f"{self.name}-tp{ranks}")


GEMMA4_31B = AttentionGeometry()

# the 31B, and one rank of it under tensor parallelism over 2 ranks (16 query heads over 2 KV heads)
PRESETS: dict[str, AttentionGeometry] = {"gemma-4-31b": GEMMA4_31B, "gemma-4-31b-tp2": GEMMA4_31B.per_rank(2)}


def _global_head_shape(tc: Mapping[str, Any], source: str) -> tuple[int, int]:
    """(head_dim, num_kv_heads) of the global layers, from a serialized `per_layer_config` or from
    `global_head_dim` / `num_global_key_value_heads` (transformers' defaults: 512 and the sliding layers' count)."""
    per_layer = tc.get("per_layer_config")
    if isinstance(per_layer, Mapping) and per_layer:
        shapes = {(int(v.get("head_dim", 0)), int(v.get("num_key_value_heads", tc.get("num_key_value_heads", 0))))
                  for v in per_layer.values() if isinstance(v, Mapping)}
        if len(shapes) != 1:
            raise ConfigError(f"{source}: global layers disagree on head shape: {sorted(shapes)}")
        return shapes.pop()
    head_dim = int(tc.get("global_head_dim") or 512)
    num_kv = int(tc.get("num_global_key_value_heads") or tc.get("num_key_value_heads") or 0)
    return head_dim, num_kv


def geometry_from_config(config: str | os.PathLike | Mapping[str, Any], name: str | None = None) -> AttentionGeometry:
    """Read the global-layer geometry from a Gemma 4 `config.json` (a path, a model directory or a dict; fields at
    top level or under `text_config`). Refuses (ConfigError, naming the field) a config foldkv cannot serve."""
    if isinstance(config, Mapping):
        raw, source = config, name or "<dict>"
    else:
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no config.json at {path!r}")
        with open(path) as fh:
            raw = json.load(fh)
        source = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    tc = raw["text_config"] if isinstance(raw.get("text_config"), Mapping) else raw

    if not tc.get("attention_k_eq_v", False):
        raise ConfigError(
            f"{source}: attention_k_eq_v is not set: K and V come from separate projections, so there is nothing"
            " to fold (foldkv serves only k_eq_v global layers)")
    layer_types = tc.get("layer_types")
    num_layers = int(tc.get("num_hidden_layers", len(layer_types) if layer_types else 0))
    if layer_types:
        num_global = sum(1 for t in layer_types if t == "full_attention")
    else:  # transformers' default pattern: every sixth layer is global, and the last one always is
        num_global = len({i for i in range(num_layers) if (i + 1) % 6 == 0} | {num_layers - 1})
    if num_global == 0:
        raise ConfigError(f"{source}: layer_types has no full_attention layer")

    rope = tc.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope) if isinstance(rope, Mapping) else {}
    rope_type = rope.get("rope_type", "proportional" if not rope else "default")
    if rope_type != "proportional":
        raise ConfigError(
            f"{source}: global-layer rope_type is {rope_type!r}; foldkv needs 'proportional' RoPE (a partial rotary"
            " width with the unrotated columns left as they are)")
    head_dim, num_kv = _global_head_shape(tc, source)
    try:
        return AttentionGeometry(
            num_q_heads=int(tc.get("num_attention_heads", 0)), num_kv_heads=num_kv, head_dim=head_dim,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            rope_theta=float(rope.get("rope_theta", 1_000_000.0)), rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            num_global_layers=num_global, num_layers=num_layers,
            max_position=int(tc.get("max_position_embeddings", 262_144)), name=source)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def resolve_geometry(spec: str | os.PathLike | Mapping[str, Any] | AttentionGeometry | None) -> AttentionGeometry:
    """A preset name, a config path/dict, a geometry, or None (the 31B default)."""
    if spec is None:
        return GEMMA4_31B
    if isinstance(spec, AttentionGeometry):
        return spec
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    if isinstance(spec, str) and not os.path.exists(spec):  # neither a preset nor a path: most likely a preset typo
        close = difflib.get_close_matches(spec, PRESETS, n=1)
        raise ConfigError(
            f"unknown geometry {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a path that exists."
            f"{f' Did you mean {close[0]!r}?' if close else ''} A path to a Gemma 4 config.json (or to the model folder"
            " that holds it) is accepted too.")
    return geometry_from_config(spec)
