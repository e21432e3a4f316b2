"""Ahead-of-time kernels: build (TileLang -> CUDA source + cubin + manifest), verify, and load without TileLang.

    python -m foldkv aot build --arch sm_90a --out DIR     # needs TileLang + nvcc, no GPU
    python -m foldkv aot verify DIR                        # needs neither
    foldkv.aot.use_build(DIR); launcher(..., backend="aot")  # needs cuda-python + a GPU, never TileLang

Importing this package imports neither TileLang nor cuda-python. `foldkv.aot.build` is the function;
`from foldkv.aot.build import ...` still reaches the module."""

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
    use_build,
)
from .verify import AotVerifyError, read_manifest, verify
from .verify import summary as manifest_summary
from .build import AotBuildError, NvccUnavailable, build  # (no TileLang at import)


__all__ = [
    "AOT_DIR_ENV", "AotBuild", "AotBuildError", "AotKernel", "AotLaunchError", "AotMismatchError", "AotVerifyError",
    "NvccUnavailable", "active_build", "aot_kernel", "arch_runs_on", "build", "check_build_matches", "manifest_summary",
    "read_manifest", "use_build", "verify",
]
