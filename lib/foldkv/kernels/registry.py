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


# --- the kernels this process handed out (for the provenance of the records it writes) ----------------------------
_HANDED_OUT: dict[tuple, dict] = {}


def note_kernel(name: str, backend: str, source_sha256: str, **details: Any) -> None:
    """Remember that this process built or loaded kernel `name` on `backend` from the CUDA source of that sha256
    (details: e.g. the cubin's sha256, the AOT folder, the builder's parameters). `foldkv.provenance.provenance` lists
    them in every record saved afterwards."""
    key = (name, backend, source_sha256)
    entry = _HANDED_OUT.setdefault(key, {"name": name, "backend": backend, "source_sha256": source_sha256})
    entry.update({k: v for k, v in details.items() if v is not None})


def kernels_handed_out() -> list[dict]:
    """Every kernel noted so far, sorted by name and backend (copies)."""
    return [dict(e) for _, e in sorted(_HANDED_OUT.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))]


def _plain(v: Any) -> Any:
    """A builder argument as JSON data (a format by its value, a geometry by its name)."""
    if isinstance(v, KvFormat):
        return v.value
    if isinstance(v, AttentionGeometry):
        return v.name
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def hands_out(name: str) -> Callable:
    """Decorate a JIT builder so that every kernel it returns is noted (`note_kernel`) under `name`, a template filled
    from the builder's bound arguments ("prep_{fmt}"), with the sha256 of the CUDA source TileLang generated for it
    and the builder's arguments. One decorator on each builder covers every launcher, test and harness that uses it."""
    import functools
    import hashlib
    import inspect

    def decorate(builder: Callable) -> Callable:
        sig = inspect.signature(builder)

        @functools.wraps(builder)
        def build(*args, **kwargs):
            kernel = builder(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            flat = {}
            for pname, value in bound.arguments.items():  # a **kwargs builder: its keywords, flattened
                if sig.parameters[pname].kind is inspect.Parameter.VAR_KEYWORD:
                    flat.update({k: _plain(v) for k, v in value.items()})
                else:
                    flat[pname] = _plain(value)
            kernel_name = name.format(**{k: v for k, v in flat.items() if isinstance(v, str)})
            source = kernel.get_kernel_source()
            note_kernel(kernel_name, "jit", hashlib.sha256(source.encode()).hexdigest(),
                        builder=f"{builder.__module__}.{builder.__qualname__}", arguments=flat)
            return kernel

        build.hands_out = name  # lets a test check that every registered variant's builder is covered
        return build

    return decorate
