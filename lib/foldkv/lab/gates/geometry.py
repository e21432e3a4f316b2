"""The geometry the gates run at: the 31B's, or one rank's share of it under tensor parallelism (preset
`gemma-4-31b-tp2`: 16 query heads over 2 KV heads). Every gate takes it as a preset name, a config path or an
`AttentionGeometry`, and refuses, before any work, one the registered kernels are not generated for."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ...config import GEMMA4_31B, AttentionGeometry, ConfigError, resolve_geometry

# What the registered kernels are generated for (the prefill's tiles are one KV group of 8 query heads over a 512
# head with 128 rotated columns; the decode's block_h of 16 holds one group). A rank's share of the 31B keeps all
# three; a plan that splits a KV head's query group across ranks leaves a smaller group, which no kernel serves.
KERNEL_HEAD = {"head_dim": GEMMA4_31B.head_dim, "rotary_width": GEMMA4_31B.rotary_width,
               "group_size": GEMMA4_31B.group_size}


def gate_geometry(spec: str | os.PathLike | Mapping[str, Any] | AttentionGeometry | None = None) -> AttentionGeometry:
    """The geometry `spec` names (None: the 31B), or ConfigError when it is unknown or its head or query group is not
    the one the kernels are generated for (KERNEL_HEAD)."""
    geom = resolve_geometry(spec)
    have = {k: getattr(geom, k) for k in KERNEL_HEAD}
    if have != KERNEL_HEAD:
        diff = ", ".join(f"{k} {have[k]} (kernels: {v})" for k, v in KERNEL_HEAD.items() if have[k] != v)
        raise ConfigError(
            f"geometry {geom.name!r} ({geom.num_q_heads} query heads over {geom.num_kv_heads} KV heads): {diff}; the"
            " gates run the registered kernels, which are generated for whole KV heads of 512 with their query group"
            " of 8 (the 31B, or one rank's share of it: AttentionGeometry.per_rank)")
    return geom
