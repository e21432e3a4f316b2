"""The one way a launcher gets a kernel (DEVELOPERS.md, "One launch path"): `kernel(name, geometry, params, backend)`,
one cache; `launch_kernels` with a launcher's `kernels={name: callable}`."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..config import AttentionGeometry
from ..validate import FoldKvInputError
from . import registry

BACKENDS = ("jit", "aot")

# (name, geometry, frozen params, backend) -> kernel; an "aot" entry also holds the build it came from, and is used
# only while that build is the active one (foldkv.aot.use_build can change it).
_CACHE: dict[tuple, tuple[Any, Callable]] = {}


def check_backend(backend: str) -> None:
    """Refuse a backend name that is not one of BACKENDS (launchers call it with their other input checks)."""
    if backend not in BACKENDS:
        raise FoldKvInputError(f"unknown backend {backend!r}; known: {list(BACKENDS)}")


def kernel_params(name: str, params: Mapping[str, Any] | None = None) -> dict:
    """The params a kernel of variant `name` is built with: the registered ones, overridden by `params`."""
    return registry.get(name).arguments(params)


def _check_manifest_params(build, name: str, params: dict) -> None:
    """Refuse every param that differs from what `build`'s manifest recorded for kernel `name`."""
    from ..aot import AotMismatchError

    entry = next((k for k in build.manifest.get("kernels", []) if k.get("name") == name), None)
    if entry is None:
        raise AotMismatchError(f"the AOT build in {build.dir} has no kernel {name!r}; it has {build.names}")
    built = entry.get("variant_params") or {}
    problems = [f"{p} built {built[p]!r}, asked {params[p]!r}" if p in built else
                f"{p} not recorded in the manifest, asked {params[p]!r}" for p in sorted(params)
                if p not in built or built[p] != params[p]]
    problems += [f"{p} built {built[p]!r}, which this version of {name} does not have" for p in sorted(built)
                 if p not in params]
    if problems:
        raise AotMismatchError(f"backend 'aot': kernel {name} in {build.dir} does not match: " + "; ".join(problems))


def kernel(name: str, geometry: AttentionGeometry, params: Mapping[str, Any] | None = None,
           backend: str = "jit") -> Callable:
    """The kernel of variant `name` for `geometry`, built ("jit") or loaded ("aot") with its registered params
    overridden by `params`; refusals (AotMismatchError for "aot") before anything is built or loaded."""
    check_backend(backend)
    variant = registry.get(name)
    full = variant.arguments(params)
    key = (name, geometry, tuple(sorted(full.items())), backend)
    if backend == "jit":
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = (None, variant.build(geometry, **full))
        return hit[1]
    from .. import aot  # imports neither TileLang nor cuda-python until a cubin is loaded

    build = aot.active_build()
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not build:
        _check_manifest_params(build, name, full)
        loaded = build.kernel(name, geometry=geometry, fmt=variant.format, page_size=full.get("page_size"))
        hit = _CACHE[key] = (build, loaded)
    return hit[1]


def check_kernels(names: tuple[str, ...], kernels: Mapping[str, Callable] | None) -> None:
    """Refuse a launcher's `kernels=` naming a kernel the launch does not use, or giving one a non-callable."""
    kernels = dict(kernels or {})
    unknown = sorted(set(kernels) - set(names))
    if unknown:
        raise FoldKvInputError(f"kernels= names {unknown}; this launch uses {list(names)}")
    not_callable = sorted(n for n, k in kernels.items() if not callable(k))
    if not_callable:
        raise FoldKvInputError(f"kernels= gives {not_callable} a value that is not callable")


def launch_kernels(names: tuple[str, ...], geometry: AttentionGeometry, params: Mapping[str, Mapping] | None = None,
                   backend: str = "jit", kernels: Mapping[str, Callable] | None = None) -> tuple[Callable, ...]:
    """The kernels a launch needs, in the order of `names`: `kernels[name]` where given, else
    `kernel(name, geometry, params.get(name), backend)`."""
    check_kernels(names, kernels)
    kernels = dict(kernels or {})
    params = params or {}
    return tuple(kernels[n] if n in kernels else kernel(n, geometry, params.get(n), backend) for n in names)


def clear_cache() -> None:
    _CACHE.clear()


__all__ = ["BACKENDS", "check_backend", "check_kernels", "kernel", "kernel_params", "launch_kernels", "clear_cache"]
