"""The gates on what is built, on the CPU: the emitted-CUDA barrier checks with their red twins, and the AOT build and
its verification (with the JIT cache that "AOT == JIT" compares against)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time

from ...config import AttentionGeometry


def barrier_check(geom: AttentionGeometry, record) -> None:
    """CPU gate: the in-place merge as generated passes the emitted-source barrier check, and the same kernel generated
    without its `__syncthreads()` is refused; the FP8 decode partial and prefill as generated pass the e4m3
    conversion's barrier check, and each with its tile-closing barrier taken out of the emitted CUDA is refused.
    Records `barrier_check` (not run without TileLang)."""
    from ...kernels.tl import TileLangUnavailable

    try:
        from ...kernels import cuda_checks, macros, merge, registry

        t0 = time.time()
        merge.build_merge_groups(geom)  # runs the check; raises if it fails
        try:
            merge.build_merge_groups(geom, barrier=False)
            red, red_message = False, "accepted a merge without a barrier"
        except cuda_checks.BarrierCheckError as exc:
            red, red_message = True, str(exc)
        print(f"as generated: passes. without the barrier: {'refused' if red else 'NOT refused'}: {red_message}")
        conversion = {}
        for name in ("decode_partial_folded_fp8", "prefill_folded_fp8"):
            src = registry.get(name).build(geom).get_kernel_source()  # the builder runs the check; raises if it fails
            broken = src.replace("foldkv_e4m3x8_to_bf16(0, 1,", "foldkv_e4m3x8_to_bf16(0, 0,")
            try:
                cuda_checks.check_e4m3_conversion(name, broken, macros.CONVERT_BARRIER_ID)
                conversion[name] = "NOT refused"
            except cuda_checks.ConversionCheckError as exc:
                conversion[name] = f"refused: {exc}"
            print(f"{name}: conversion barriers as generated: pass. without the closing one: {conversion[name]}")
        conversion_red = all(v.startswith("refused") for v in conversion.values())
        record.ran("barrier_check", green=True, red_refused=red, red_message=red_message,
                   conversion_red=conversion, passed=red and conversion_red, seconds=round(time.time() - t0, 1))
    except TileLangUnavailable as exc:
        record.not_run("barrier_check", f"not run: {exc}")
        print(record.sections["barrier_check"])
    except Exception as exc:
        record.failed("barrier_check", f"{type(exc).__name__}: {exc}")
        print(record.sections["barrier_check"])


def _jit_cache_note() -> dict:
    """Which JIT kernels "AOT == JIT" compares against: this machine's TileLang cache, and the record
    scripts/device_run.sh leaves in FOLDKV_JIT_BUILD_RECORD when it compiles them first into an empty cache."""
    note = {"tilelang_cache_dir": os.environ.get("TILELANG_CACHE_DIR") or "~/.tilelang/cache (TileLang's default)"}
    if os.path.isfile(os.environ.get("FOLDKV_JIT_BUILD_RECORD", "")):
        with open(os.environ["FOLDKV_JIT_BUILD_RECORD"]) as fh:
            jit_build = json.load(fh)
        note.update({k: jit_build.get(k) for k in ("cache_mode", "cache_started_empty", "seconds", "workers")},
                    kernels=len(jit_build.get("kernels", [])), kernels_failed=len(jit_build.get("failed", [])))
        print(f"JIT: {note['kernels']} kernels built by TileLang on this machine into "
              f"{'an empty' if note['cache_started_empty'] else 'a non-empty'} cache ({note['cache_mode']} mode)"
              f" in {note['seconds']} s")
    return note


def aot_build_gate(aot_dir: str | None, record, arch: str = "sm_90a") -> str | None:
    """CPU gate: build every registered kernel AOT (into a temp folder removed when this process exits, since the GPU
    gates load from it) and verify the build; or, given `aot_dir`, verify that prebuilt folder. Records
    `aot_build_verify` and returns the build folder (None when nothing was built or verified)."""
    from ... import aot
    from ...kernels.tl import TileLangUnavailable

    jit_cache = _jit_cache_note()
    try:
        if aot_dir is None:
            tmp_root = tempfile.mkdtemp(prefix="foldkv_aot_")
            atexit.register(shutil.rmtree, tmp_root, ignore_errors=True)
            build_dir = os.path.join(tmp_root, "build")
            t0 = time.time()
            aot.build(build_dir, arch=arch, log=None)
            build_s = round(time.time() - t0, 1)
            manifest = aot.verify(build_dir)
            origin = f"built {len(manifest['kernels'])} kernels in {build_s:.0f} s"
        else:  # a folder built elsewhere: verified here, not built
            build_dir, build_s = aot_dir, None
            manifest = aot.verify(build_dir)
            made = manifest.get("provenance") or {}
            commit = made.get("git_commit")
            origin = (f"verified the prebuilt folder {aot_dir} (not built here; "
                      + (f"built from commit {commit[:10]}{', with uncommitted changes' if made.get('dirty') else ''}"
                         if commit else "its manifest records no commit") + ")")
    except TileLangUnavailable as exc:
        record.not_run("aot_build_verify", f"not run: {exc}")
    except aot.NvccUnavailable:
        record.not_run("aot_build_verify", "not run: no nvcc")
    except Exception as exc:  # recorded as a failed gate; the verdict fails the notebook
        record.failed("aot_build_verify", f"{type(exc).__name__}: {exc}")
    else:
        kernels = sorted(k["name"] for k in manifest["kernels"])
        print(f"{origin}; verify: ok, {len(kernels)} kernels, {manifest['arch']}, nvcc {manifest['nvcc_version']}")
        record.ran("aot_build_verify", kernels=kernels, built_here=aot_dir is None, build_seconds=build_s,
                   built_from=manifest.get("provenance"), verify=aot.manifest_summary(manifest), jit_cache=jit_cache,
                   passed=True)
        return build_dir
    print(record.sections["aot_build_verify"])
    return None
