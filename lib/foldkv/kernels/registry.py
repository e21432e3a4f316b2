"""The list of generated kernel variants: what the AOT build walks and what the JIT launchers look up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import AttentionGeometry
from ..layout import KvFormat


@dataclass(frozen=True)
class KernelVariant:
    """One generated kernel: `build(geom)` returns a compiled TileLang JIT kernel for that geometry."""

    name: str  # unique, e.g. "decode_partial_folded"
    family: str  # decode_partial | merge_groups | merge_final | prefill | prep
    format: KvFormat | None  # None for format-independent kernels (the merges)
    build: Callable[[AttentionGeometry], Any]
    in_place_merge: bool = False  # the emitted-source barrier check applies
    params: dict = field(default_factory=dict)  # tuning constants baked into the build (chunk size, tiles, ...)


_REGISTRY: dict[str, KernelVariant] = {}


def register(variant: KernelVariant) -> KernelVariant:
    if variant.name in _REGISTRY and _REGISTRY[variant.name] != variant:
        raise ValueError(f"kernel variant {variant.name!r} registered twice with different definitions")
    _REGISTRY[variant.name] = variant
    return variant


def all_variants() -> list[KernelVariant]:
    """Every registered variant (importing the kernel modules registers them)."""
    from . import _load_all  # noqa: F401  (side effect: registration)

    return list(_REGISTRY.values())


def get(name: str) -> KernelVariant:
    all_variants()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel variant {name!r}; known: {sorted(_REGISTRY)}") from None
