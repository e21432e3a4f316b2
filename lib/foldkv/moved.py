"""Names a runtime module no longer has: reading one raises an AttributeError saying, in one line, where it went, so
code written against an earlier foldkv finds its way (`__getattr__ = moved(__name__, {name: where})`)."""

from __future__ import annotations

from typing import Callable, Mapping


def moved(module: str, where: Mapping[str, str]) -> Callable[[str], object]:
    def __getattr__(name: str):
        if name in where:
            raise AttributeError(f"{module}.{name} moved: {where[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["moved"]
