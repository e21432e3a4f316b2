"""Check an AOT build folder against its manifest (what every file must be, what the loader needs of each launch,
the emitted-source checks run again); needs neither TileLang nor a GPU nor cuda-python."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190  # ELF e_machine of a cubin

_REQUIRED_TOP = ("manifest_version", "tilelang_version", "nvcc_version", "arch", "geometry", "formats", "kernels")
_REQUIRED_KERNEL = ("name", "family", "format", "in_place_merge", "source", "cubin", "source_sha256", "cubin_sha256",
                    "nvcc_options", "params", "dynamic_symbols", "out_idx", "launches", "tensor_maps")
_REQUIRED_LAUNCH = ("symbol", "grid", "block", "dynamic_smem_bytes", "args")


def geometry_record(geom) -> dict:
    """The geometry fields kernels are specialised on (the `name` label is kept apart: it does not change a kernel)."""
    return {f.name: getattr(geom, f.name) for f in dataclasses.fields(geom) if f.compare}


class AotVerifyError(RuntimeError):
    """An AOT build folder does not match its manifest (the message lists every problem)."""


def read_manifest(build_dir: str | os.PathLike) -> dict:
    path = os.path.join(os.fspath(build_dir), MANIFEST_NAME)
    if not os.path.isfile(path):
        raise AotVerifyError(f"no {MANIFEST_NAME} in {os.fspath(build_dir)!r}: not an AOT build folder")
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except json.JSONDecodeError as exc:
        raise AotVerifyError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise AotVerifyError(f"{path} does not hold a JSON object")
    return manifest


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cubin_problem(path: str) -> str | None:
    with open(path, "rb") as fh:
        head = fh.read(20)
    if len(head) < 20 or head[:4] != ELF_MAGIC:
        return "is not an ELF image"
    machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")  # EI_DATA: 1 little-endian
    if machine != EM_CUDA:
        return f"is an ELF for machine {machine}, not CUDA ({EM_CUDA})"
    return None


def manifest_problems(manifest: dict) -> list[str]:
    """Structural problems of a manifest (missing fields, bad names); [] when it is well formed."""
    problems = [f"manifest lacks {key!r}" for key in _REQUIRED_TOP if key not in manifest]
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        problems.append(f"manifest_version {manifest.get('manifest_version')!r}, this foldkv reads {MANIFEST_VERSION}")
    kernels = manifest.get("kernels")
    if not isinstance(kernels, list) or not kernels:
        problems.append("manifest lists no kernels")
        return problems
    names = set()
    for k in kernels:
        name = k.get("name", "?")
        if name in names:
            problems.append(f"kernel {name!r} listed twice")
        names.add(name)
        problems += [f"{name}: lacks {key!r}" for key in _REQUIRED_KERNEL if key not in k]
        for key in ("source", "cubin"):
            f = k.get(key, "")
            if not isinstance(f, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", f) or f.startswith("."):
                problems.append(f"{name}: {key} {f!r} is not a plain file name in the build folder")
        for ln in k.get("launches", []):
            problems += [f"{name}: a launch lacks {key!r}" for key in _REQUIRED_LAUNCH if key not in ln]
            if ln.get("cluster_dims") or ln.get("pdl"):
                problems.append(f"{name}: {ln.get('symbol')} needs a cluster or a programmatic dependent launch, which"
                                " the loader does not make")
        if not k.get("launches"):
            problems.append(f"{name}: no launches")
        if k.get("in_place_merge") and not k.get("barrier_checked"):
            problems.append(f"{name}: in-place merge without a recorded barrier check")
    return problems


def file_problems(build_dir: str | os.PathLike, manifest: dict) -> list[str]:
    """Files that are missing, changed (sha256), not cubins, or not listed in the manifest."""
    build_dir = os.fspath(build_dir)
    problems, listed = [], {MANIFEST_NAME}
    for k in manifest.get("kernels", []):
        name = k.get("name", "?")
        for key in ("source", "cubin"):
            fname = k.get(key)
            if not isinstance(fname, str):
                continue
            listed.add(fname)
            path = os.path.join(build_dir, fname)
            if not os.path.isfile(path):
                problems.append(f"{name}: {key} file {fname} is missing")
                continue
            with open(path, "rb") as fh:
                digest = sha256_bytes(fh.read())
            if digest != k.get(f"{key}_sha256"):
                problems.append(f"{name}: {fname} has sha256 {digest[:16]}..., the manifest records"
                                f" {str(k.get(f'{key}_sha256'))[:16]}...: the file changed after the build")
            elif key == "cubin":
                bad = _cubin_problem(path)
                if bad:
                    problems.append(f"{name}: {fname} {bad}")
    return problems + [f"{fname} is in the build folder but not in the manifest"
                       for fname in sorted(os.listdir(build_dir)) if fname not in listed]


def merge_barrier_problems(name: str, source: str, symbols) -> list[str]:
    """`cuda_checks.check_in_place_merge` on every kernel symbol of an in-place merge's emitted source."""
    from ..kernels.cuda_checks import check_in_place_merge

    problems = []
    for sym in symbols:
        try:
            check_in_place_merge(sym, source)
        except Exception as exc:
            problems.append(f"{name}: barrier check fails on {sym}: {exc}")
    return problems


def barrier_problems(build_dir: str | os.PathLike, manifest: dict) -> list[str]:
    """Re-run the emitted-source checks (text only, no TileLang): the producer guard on every kernel's source
    (kernels.producer_guard), the barrier check on every in-place merge's."""
    from ..kernels.producer_guard import check_producer_guard

    problems = []
    for k in manifest.get("kernels", []):
        path = os.path.join(os.fspath(build_dir), k.get("source", ""))
        if not os.path.isfile(path):
            continue  # reported by file_problems
        with open(path) as fh:
            source = fh.read()
        try:
            check_producer_guard(k["name"], source)
        except Exception as exc:
            problems.append(f"{k['name']}: producer guard check fails: {exc}")
        if k.get("in_place_merge"):
            problems += merge_barrier_problems(k["name"], source, [ln["symbol"] for ln in k["launches"]])
    return problems


def verify(build_dir: str | os.PathLike) -> dict:
    """Return the manifest of a build that matches it; raise AotVerifyError listing every problem otherwise."""
    manifest = read_manifest(build_dir)
    problems = manifest_problems(manifest)
    if not problems:
        problems += file_problems(build_dir, manifest)
    if not problems:
        problems += barrier_problems(build_dir, manifest)
    if problems:
        raise AotVerifyError(f"AOT build {os.fspath(build_dir)!r} does not match its manifest:\n  - "
                             + "\n  - ".join(problems))
    return manifest


def summary(manifest: dict) -> dict[str, Any]:
    return {
        "arch": manifest.get("arch"),
        "tilelang": manifest.get("tilelang_version"),
        "nvcc": manifest.get("nvcc_version"),
        "formats": manifest.get("formats"),
        "kernels": [k["name"] for k in manifest.get("kernels", [])],
    }
