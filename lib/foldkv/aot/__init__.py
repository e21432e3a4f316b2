"""Ahead-of-time kernels: build (TileLang -> CUDA source + cubin + manifest), verify, and load without TileLang.

    python -m foldkv aot build --arch sm_90a --out DIR     # needs TileLang + nvcc, no GPU
    python -m foldkv aot verify DIR                        # needs neither
    foldkv.aot.use_build(DIR); launcher(..., backend="aot")  # needs cuda-python + a GPU, never TileLang

Importing this package imports neither TileLang nor cuda-python: `build()` imports TileLang when it runs, the loader
imports `cuda.bindings.driver` when it first loads a cubin.

`foldkv.aot.build` and `foldkv.aot.verify` are the functions (`build(out_dir, arch=..., ...)`, `verify(dir)`); the
modules of the same names are imported here first, so `from foldkv.aot.build import ...` still reaches the module.
"""

from .loader import (
    AOT_DIR_ENV,
    AotBuild,
    AotKernel,
    AotLaunchError,
    AotMismatchError,
    active_build,
    aot_kernel,
    arch_runs_on,
    check_build_matches,
    check_pool_matches,
    use_build,
)
from .verify import AotVerifyError, read_manifest, verify
from .verify import summary as manifest_summary
from . import build as _build_module  # no TileLang at import: it is imported inside build()

build = _build_module.build
AotBuildError = _build_module.AotBuildError
NvccUnavailable = _build_module.NvccUnavailable


def _decode_backend(geometry, fmt) -> dict:
    """backend="aot" for `foldkv.kernels.decode`: one AOT kernel per name the decode step launches."""
    from ..kernels.decode import kernel_names

    return {name: aot_kernel(name, geometry=geometry, fmt=fmt) for name in kernel_names(fmt)}


def _register_backends() -> None:
    # decode.py asks that importing foldkv.aot registers "aot"; prefill and prep look the AOT kernels up themselves.
    from ..kernels import decode

    decode.register_backend("aot", _decode_backend)


_register_backends()


__all__ = [
    "AOT_DIR_ENV", "AotBuild", "AotBuildError", "AotKernel", "AotLaunchError", "AotMismatchError", "AotVerifyError",
    "NvccUnavailable", "active_build", "aot_kernel", "arch_runs_on", "build", "check_build_matches", "check_pool_matches",
    "manifest_summary", "read_manifest", "use_build", "verify",
]
