"""Write the emitted CUDA of every registered kernel variant to DIR/<name>.cu, plus DIR/SHA256SUMS.

A refactor of the kernel files keeps the kernels when the sources are byte-identical before and after:

    PYTHONPATH=$PWD/lib python scripts/dump_kernel_sources.py /tmp/before     # on the old tree
    PYTHONPATH=$PWD/lib python scripts/dump_kernel_sources.py /tmp/after      # on the new tree
    diff -r /tmp/before /tmp/after

Builds for the 31B geometry and sm_90a by default (nvcc is needed, a GPU is not), in a fresh TileLang cache so that
no kernel compiled by another tree is reused, with PYTHONHASHSEED=0 (--hash-seed).

One thing is not a function of the kernel code: which of two equal reduction workspaces (`workspace`,
`workspace_1`: shared-memory scratch of the same size, one per block-wide reduce) a reduce is handed. TileLang 0.1.15
picks it in an order that changes between processes (with the hash seed, and with unrelated changes of the Python
that builds the kernel): the untouched tree emits both assignments. So DIR/SHA256SUMS.canonical also lists the hash
of each source with every workspace name written `workspace`; a refactor keeps the kernels when each raw hash or,
failing that, each canonical hash is unchanged (then the raw diff shows only workspace names).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path


def canonical(source: str) -> str:
    """The source with every reduction workspace named `workspace` (see the module docstring)."""
    return re.sub(r"\bworkspace_\d+\b", "workspace", source)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--geometry", default="gemma-4-31b", help="a name foldkv.config.resolve_geometry accepts")
    ap.add_argument("--only", nargs="*", help="variant names (default: every registered variant)")
    ap.add_argument("--hash-seed", type=int, default=0, help="PYTHONHASHSEED of the build")
    args = ap.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != str(args.hash_seed):  # read at interpreter start: run again with it
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": str(args.hash_seed)})

    # Both are read when foldkv / TileLang are imported, so they are set first.
    os.environ["FOLDKV_CUDA_ARCH"] = args.arch
    cache = tempfile.mkdtemp(prefix="foldkv-tlcache-")
    os.environ["TILELANG_CACHE_DIR"] = cache
    try:
        from foldkv.config import resolve_geometry
        from foldkv.kernels.registry import all_variants

        geom = resolve_geometry(args.geometry)
        variants = sorted(all_variants(), key=lambda v: v.name)
        if args.only:
            unknown = set(args.only) - {v.name for v in variants}
            if unknown:
                ap.error(f"no registered variant {sorted(unknown)}")
            variants = [v for v in variants if v.name in args.only]
        args.out_dir.mkdir(parents=True, exist_ok=True)
        sums, canonical_sums = [], []
        for v in variants:
            t0 = time.perf_counter()
            src = v.build(geom).get_kernel_source()
            (args.out_dir / f"{v.name}.cu").write_text(src)
            digest = hashlib.sha256(src.encode()).hexdigest()
            sums.append(f"{digest}  {v.name}.cu\n")
            canonical_sums.append(f"{hashlib.sha256(canonical(src).encode()).hexdigest()}  {v.name}.cu\n")
            print(f"{v.name:24s} {digest[:16]}  {len(src):7d} chars  {time.perf_counter() - t0:6.1f} s", flush=True)
        (args.out_dir / "SHA256SUMS").write_text("".join(sums))
        (args.out_dir / "SHA256SUMS.canonical").write_text("".join(canonical_sums))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
