"""The one place TileLang is imported and configured: its version, the target and pass configs JIT and AOT share, and
the rewrite of the emitted CUDA every warp-specialised foldkv kernel gets (`producer_guard.install`)."""

from __future__ import annotations

import functools
import os

TILELANG_VERSION = "0.1.15"
# Hopper: wgmma and TMA need the arch-specific target.
DEFAULT_ARCH = os.environ.get("FOLDKV_CUDA_ARCH", "sm_90a")


class TileLangUnavailable(ImportError):
    """TileLang is not installed; kernels cannot be generated (the torch references still work)."""


@functools.lru_cache(maxsize=None)
def require_tilelang():
    """Import TileLang lazily, with a clear error when it is missing or the wrong version."""
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        raise TileLangUnavailable(
            f"TileLang is needed to generate foldkv kernels: pip install 'foldkv[kernels]' (tilelang=={TILELANG_VERSION});"
            f" import failed with: {exc}"
        ) from exc
    if getattr(tilelang, "__version__", "").split("+")[0] != TILELANG_VERSION:
        raise TileLangUnavailable(f"foldkv kernels are written for tilelang {TILELANG_VERSION}, found {tilelang.__version__}")
    from .producer_guard import install

    install()  # the rewrite every warp-specialised foldkv kernel's emitted CUDA gets (producer_guard.py says why)
    return tilelang


def target(arch: str = DEFAULT_ARCH):
    """The CUDA target for an arch such as 'sm_90a'; explicit so that generation works without a GPU."""
    require_tilelang()
    from tvm.target import Target

    return Target({"kind": "cuda", "arch": arch})


def pass_configs() -> dict:
    """Pass configs every foldkv kernel is built with (JIT and AOT alike). Keys are TileLang PassConfigKey values."""
    require_tilelang()
    # Fast math stays off: exp2/log2 accuracy is part of the gates, and the AOT build passes the same flags.
    return {"tl.enable_fast_math": False}


def compile_program(program):
    """Compile (JIT) a foldkv kernel's prim_func with the target and pass configs JIT and AOT share."""
    return require_tilelang().compile(program, target=target(), pass_configs=pass_configs())


def prim_func(name: str, args: dict, body):
    """The TileLang prim_func `name` whose arguments are `args` (name -> `T.Tensor(...)`, in order) and whose body is
    `body(buffers)` (name -> the argument's buffer): `@T.prim_func` with the argument list as data, so kernels whose
    arguments differ by a few (the fused tail's, an FP8 pool's scales) write each list once."""
    require_tilelang()
    from tilelang.language.eager.builder import Builder, _patch_prim_func_attrs

    builder = Builder()
    with builder.prim_func(name):
        body({n: builder.arg(n, a) for n, a in args.items()})
    return _patch_prim_func_attrs(builder.get(), builder)
