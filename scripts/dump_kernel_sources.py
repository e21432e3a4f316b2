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

`--versions` also dumps the kernels built by bench/versions/ (the variants that lost, and the harness arms that build
the library's kernels with other params), under the names of VERSIONS below: a refactor of the library's builders
must keep those too, since the versions build through the library's programs and macros.
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


def _version(name: str):
    """bench/versions/<name>.py, imported as the harnesses import it (`versions.<name>`, bench/ on the path)."""
    import importlib

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(f"versions.{name}")


def _library(name: str):
    import importlib

    return importlib.import_module(f"foldkv.kernels.{name}")


# name -> build(geom): every kernel the harnesses and the GPU tests build from bench/versions/, and the harness arms
# that build the library's kernels with params other than the registered ones (bench/fp8_harness.py)
VERSIONS = {
    **{f"head_major_{f}": lambda g, f=f: _version("decode_partial_head_major").build(g, f) for f in ("split", "folded")},
    **{f"query_all_threads_{f}": lambda g, f=f: _version("decode_partial_query_all_threads").build(g, f)
       for f in ("split", "folded")},
    "prefill_shared_tiles": lambda g: _version("prefill_shared_tiles").build(
        g, **_library("resolve").kernel_params("prefill_folded")),
    **{f"fused_ll_{f}": lambda g, f=f: _version("decode_fused_ll").build(g, f) for f in ("split", "folded")},
    **{f"fused_ll_folded_{p}": lambda g, p=p: _version("decode_fused_ll").build(g, "folded", p)
       for p in ("inline", "no_wait")},
    **{f"fused_ll_compact_{f}_{w or 'none'}": lambda g, f=f, w=w: _version("decode_fused_ll_compact").build(g, f, w)
       for f in ("split", "folded") for w in (None, "spin", "spin_warp")},
    **{f"fused_tail_{f}_{n}": lambda g, f=f, n=n: _version("decode_fused_tail_paths").build(g, f, n)
       for f in ("split", "folded") for n in ("p8", "p4", "one33")},
    **{f"fused_smem_tail_{f}": lambda g, f=f: _version("decode_fused_smem_tail").build(g, f)
       for f in ("split", "folded")},
    **{f"fp8_probe_{k}": lambda g, k=k: _version("decode_partial_fp8_probe").build(g, k) for k in ("copy", "skip")},
    "fp8_probe_skip_t128": lambda g: _version("decode_partial_fp8_probe").build(g, "skip", threads=128),
    "fp8_rs": lambda g: _version("decode_partial_fp8_rs").build(g),
    "fp8_rs_rb2": lambda g: _version("decode_partial_fp8_rs").build(g, reduce_batch=2),
    **{f"fp8_mma_{t}{'p' if p else ''}{'_2cta' if two else ''}": lambda g, t=t, p=p, two=two: _version(
        "decode_partial_fp8_mma").build(g, transpose=t, precise=p, num_stages=1 if two else 2,
                                        ctas_per_sm=2 if two else 1)
       for t, p in (("none", False), ("t16x4", False), ("t4x16", False), ("t4x16", True)) for two in (False, True)},
    **{f"fp8_tc_t32s{s}": lambda g, s=s: _version("decode_partial_fp8_tc_t32").build(g, num_stages=s) for s in (3, 2)},
    **{f"fp8_tc_ws{suffix}": lambda g, n=n: _version("decode_partial_fp8_tc_ws").build(g, transposer_nreg=n)
       for suffix, n in (("", 112), ("_r96", 96))},
    **{f"prep_fused_{f}": lambda g, f=f: _version("prep_fused").build(g, f) for f in ("split", "folded")},
    "prep_fused_folded_fp8": lambda g: _version("prep_fused").build_fp8(g, "folded"),
    "fp8_cvt": lambda g: _version("decode_partial_fp8_cvt").build(g),
    "fp8_t256": lambda g: _library("decode_partial").build_decode_partial_fp8(g, "folded", threads=256),
    "folded_t256": lambda g: _library("decode_partial").build_decode_partial(g, "folded", threads=256, reduce_batch=2),
    "folded_2cta": lambda g: _version("decode_partial_two_ctas").build(g, "folded", reduce_batch=4),
    **{f"l2_prefetch{d}": lambda g, d=d: _version("decode_partial_l2_prefetch").build(g, "folded", d) for d in (2, 3)},
    # the sliding layers' window (its own geometry, the 31B's sliding layers: not g's)
    **{f"window_tilelang{suffix}": lambda g, s=s: _version("window_attention_tilelang").build(max_slack_log2=s)
       for suffix, s in (("", None), ("_lazy", 8.0))},
}


def canonical(source: str) -> str:
    """The source with every reduction workspace named `workspace` (see the module docstring)."""
    return re.sub(r"\bworkspace_\d+\b", "workspace", source)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--geometry", default="gemma-4-31b", help="a name foldkv.config.resolve_geometry accepts")
    ap.add_argument("--only", nargs="*", help="variant names (default: every registered variant)")
    ap.add_argument("--versions", action="store_true", help="also the kernels of bench/versions/ (VERSIONS)")
    ap.add_argument("--shard", default="0/1", help="K/N: only every N-th kernel from the K-th (a process per core)")
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
        builds = {v.name: v.build for v in sorted(all_variants(), key=lambda v: v.name)}
        if args.versions:
            builds.update({f"version.{name}": build for name, build in VERSIONS.items()})
        if args.only:
            unknown = set(args.only) - set(builds)
            if unknown:
                ap.error(f"no registered variant {sorted(unknown)}" + ("" if args.versions else " (--versions?)"))
            builds = {name: b for name, b in builds.items() if name in args.only}
        k, n = map(int, args.shard.split("/"))
        builds = dict(list(builds.items())[k::n])
        args.out_dir.mkdir(parents=True, exist_ok=True)
        sums, canonical_sums = [], []
        for name, build in builds.items():
            t0 = time.perf_counter()
            src = build(geom).get_kernel_source()
            (args.out_dir / f"{name}.cu").write_text(src)
            digest = hashlib.sha256(src.encode()).hexdigest()
            sums.append(f"{digest}  {name}.cu\n")
            canonical_sums.append(f"{hashlib.sha256(canonical(src).encode()).hexdigest()}  {name}.cu\n")
            print(f"{name:32s} {digest[:16]}  {len(src):7d} chars  {time.perf_counter() - t0:6.1f} s", flush=True)
        (args.out_dir / "SHA256SUMS").write_text("".join(sums))
        (args.out_dir / "SHA256SUMS.canonical").write_text("".join(canonical_sums))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
