"""Run a bench script with a kernel version of bench/versions/ served as the library's registered variant, so that
what the script times through the runtime (generate(), the decode step) runs the version. The lab's A/B of a kernel
before it becomes the library's: the same script without this wrapper is the other arm.

    python bench/serve_version.py prefill_folded=prefill_folded_seesaw_async -- \
        bench/prefill_probe.py --out $OUT ttft ...
"""

from __future__ import annotations

import dataclasses
import runpy
import sys
from pathlib import Path


def serve(variant: str, version: str) -> None:
    """Replace the registered builder of `variant` by bench/versions/<version>.py's `build` (JIT only: an AOT build
    still loads the library's cubin, so the script must run with backend "jit")."""
    bench = str(Path(__file__).resolve().parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import importlib

    from foldkv.kernels import registry

    module = importlib.import_module(f"versions.{version}")
    served = registry.get(variant)
    built = []

    def build(geom, **params):
        built.append(params)
        print(f"[serve_version] {variant} built from bench/versions/{version}.py ({len(built)})", flush=True)
        return module.build(geom, **params)

    registry._BY_NAME[variant] = dataclasses.replace(served, builder=build)  # the lab's swap; the library has no switch


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    for pair in argv[:split]:
        variant, _, version = pair.partition("=")
        serve(variant, version)
    script, *args = argv[split + 1:]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
