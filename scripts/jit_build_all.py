#!/usr/bin/env python3
"""Compile, through TileLang's JIT, every kernel a device run uses, once, into TILELANG_CACHE_DIR, several at a time;
record whether the cache started empty and how long the compiles took.

    python3 scripts/jit_build_all.py --record $OUT/jit_build.json [--workers 12]

scripts/device_run.sh runs it first, on the device, with a fresh cache: the GPU tests and notebooks that then run side
by side load these kernels instead of racing to compile them, and notebook 02's "AOT == JIT" compares this machine's
JIT compile with the AOT cubins built elsewhere. The kernels: every registered variant (the default geometry, the
synthetic checkpoint's, which the drift tests use, and one tensor-parallel rank's, gemma-4-31b-tp2, which
tests/test_per_rank_geometry_gpu.py gates), plus the variants the GPU tests add (bench/versions/: the variants
that lost, which the harness times too; the fused prep of bench/versions/prep_fused.py, also on float32 inputs).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import sys
import time

# (label, geometry, module, function, keyword arguments). module "variant": registry.get(function).build(geometry);
# "versions/<file>": bench/versions/<file>.py's function(geometry, **kwargs) (the variants that lost, which the GPU
# tests gate and the harness times); otherwise foldkv.kernels.<module>.<function>(geometry, **kwargs).
GPU_TEST_EXTRAS = [
    *[(f"{version} {fmt}", "gemma4", f"versions/{version}", "build", dict(fmt=fmt))
      for version in ("decode_partial_head_major", "decode_partial_query_all_threads", "decode_fused_ll")
      for fmt in ("split", "folded")],
    *[(f"decode_fused_ll_compact {fmt} {wait or 'none'}", "gemma4", "versions/decode_fused_ll_compact", "build",
       dict(fmt=fmt, wait=wait)) for wait in (None, "spin", "spin_warp") for fmt in ("split", "folded")],
    ("prefill_shared_tiles", "gemma4", "versions/prefill_shared_tiles", "build", {}),
    *[(f"prep_fused {fmt}{dtype}", "gemma4", "versions/prep_fused", builder, dict(fmt=fmt, in_dtype=in_dtype))
      for fmt, builder, dtype, in_dtype in (("split", "build", "", "bfloat16"), ("folded", "build", "", "bfloat16"),
                                            ("folded", "build_fp8", " fp8", "bfloat16"),
                                            ("split", "build", " float32", "float32"),
                                            ("folded", "build", " float32", "float32"))],
]


def _geometry(key: str):
    import foldkv
    from foldkv.config import geometry_from_config
    from foldkv.lab.synthetic import synthetic_config

    if key in foldkv.PRESETS:
        return foldkv.PRESETS[key]
    return foldkv.GEMMA4_31B if key == "gemma4" else geometry_from_config(synthetic_config(), name="synthetic")


def tasks() -> list[list[tuple]]:
    """Two waves: the default geometry's kernels, then the synthetic geometry's (a kernel whose program is the same
    for both is then a cache hit in the second wave instead of two processes compiling it at once) beside one
    tensor-parallel rank's (other programs: half the heads)."""
    from foldkv.kernels import registry

    names = [v.name for v in registry.all_variants()]
    first = [(name, "gemma4", "variant", name, {}) for name in names] + GPU_TEST_EXTRAS
    second = [(f"{name} synthetic", "synthetic", "variant", name, {}) for name in names]
    second += [(f"{name} gemma-4-31b-tp2", "gemma-4-31b-tp2", "variant", name, {}) for name in names]
    return [first, second]


def _bench_version(name: str):
    """bench/versions/<name>.py, imported as the harnesses and the GPU tests import it: `versions.<name>` with bench/
    on the path."""
    import importlib

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(f"versions.{name}")


def build_one(task: tuple) -> dict:
    """Compile one kernel in this worker process; its label, seconds and the sha256 of the CUDA source."""
    import importlib

    from foldkv.kernels import registry

    label, geom_key, module, function, kwargs = task
    geom = _geometry(geom_key)
    t0 = time.perf_counter()
    if module == "variant":
        kernel = registry.get(function).build(geom)
    elif module.startswith("versions/"):
        kernel = getattr(_bench_version(module.split("/", 1)[1]), function)(geom, **kwargs)
    else:
        kernel = getattr(importlib.import_module(f"foldkv.kernels.{module}"), function)(geom, **kwargs)
    return {"kernel": label, "seconds": round(time.perf_counter() - t0, 1),
            "source_sha256": hashlib.sha256(kernel.get_kernel_source().encode()).hexdigest()}


def cache_entries(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if os.path.isdir(path) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", help="write the record (JSON) here too")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = ap.parse_args(argv)

    cache_dir = os.environ.get("TILELANG_CACHE_DIR")
    if not cache_dir:
        print("jit_build_all: set TILELANG_CACHE_DIR (the cache the later processes load)", file=sys.stderr)
        return 2
    before = cache_entries(cache_dir)
    waves = tasks()
    record = {"cache_dir": cache_dir, "cache_mode": os.environ.get("FOLDKV_JIT_CACHE_MODE", "fresh"),
              "cache_entries_before": before, "cache_started_empty": before == 0, "workers": args.workers,
              "kernels": [], "failed": []}
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # no state (CUDA, TileLang) shared with the parent
    with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        for wave in waves:
            futures = {pool.submit(build_one, t): t for t in wave}
            for fut in cf.as_completed(futures):
                try:
                    row = fut.result()
                    record["kernels"].append(row)
                    print(f"[jit] {row['kernel']}: {row['seconds']} s", flush=True)
                except Exception as exc:  # reported and counted: a kernel that does not compile fails the run below
                    record["failed"].append({"kernel": futures[fut][0], "error": f"{type(exc).__name__}: {exc}"})
                    print(f"[jit] {futures[fut][0]}: FAILED {type(exc).__name__}: {exc}", flush=True)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["cache_entries_after"] = cache_entries(cache_dir)
    record["kernels"].sort(key=lambda r: r["kernel"])
    state = "an empty" if record["cache_started_empty"] else f"a non-empty ({before} files)"
    print(f"[jit] {len(record['kernels'])} kernels compiled by TileLang's JIT into {state} cache in"
          f" {record['seconds']} s ({args.workers} processes); {len(record['failed'])} failed", flush=True)
    if args.record:
        os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
        with open(args.record, "w") as fh:
            json.dump(record, fh, indent=1)
    return 1 if record["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
