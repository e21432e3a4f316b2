"""What a notebook records: its sections (ran / not run and why), its numbers as JSON, and tables for display."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
from typing import Any, Iterable, Sequence

import torch

from foldkv.lab.jsonsafe import jsonable

NOT_RUN_NO_CUDA = "not run: no CUDA device"
# Run outputs live under papermill_runs/: a run that writes its own records there does not make the code dirty.
PROVENANCE_IGNORED_DIRS = ("papermill_runs/",)
MAX_DIRTY_PATHS = 20
# A copy of the checkout without .git (the device machine gets the working tree only) takes its commit from this file,
# written in the checkout beforehand by `write_checkout_stamp()` (scripts/prepare_device_run.sh does).
CHECKOUT_STAMP = os.path.join("build", "checkout.json")


def checkout_root() -> str:
    """The folder foldkv is imported from, two levels above the package (lib/foldkv -> the checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True, timeout=30).stdout


def checkout_state(repo: str | os.PathLike | None = None) -> dict:
    """The code a record was made with: `git_commit` (HEAD of the checkout, None with `git_reason` when foldkv is not
    imported from the top of a git checkout), `dirty` (tracked files changed against HEAD, staged or not, outside
    papermill_runs/) and up to MAX_DIRTY_PATHS of those paths (`dirty_paths_total` counts them all)."""
    root = os.path.abspath(os.fspath(repo) if repo is not None else checkout_root())
    state: dict[str, Any] = {"git_commit": None, "dirty": None, "dirty_paths": [], "dirty_paths_total": None}
    try:
        top = _git(root, "rev-parse", "--show-toplevel").strip()
        if os.path.realpath(top) != os.path.realpath(root):
            state["git_reason"] = f"{root} is not the top of a git checkout (it lies inside {top})"
            return state
        state["git_commit"] = _git(root, "rev-parse", "HEAD").strip()
        status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=no")
    except FileNotFoundError:
        state["git_reason"] = "git is not installed"
        return _from_stamp(root, state)
    except subprocess.CalledProcessError as exc:
        state["git_reason"] = f"{root} is not a git checkout with a commit: {(exc.stderr or '').strip()[:200]}"
        return _from_stamp(root, state)
    except subprocess.TimeoutExpired:
        state["git_reason"] = "git did not answer within 30 s"
        return state
    paths, fields = [], status.split("\0")
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        if entry[0] in "RC":  # a rename or copy: the next field is the old path
            i += 1
        path = entry[3:]
        if not path.startswith(PROVENANCE_IGNORED_DIRS):
            paths.append(path)
    state["dirty"] = bool(paths)
    state["dirty_paths"] = sorted(paths)[:MAX_DIRTY_PATHS]
    state["dirty_paths_total"] = len(paths)
    return state


def _files_sha256(root: str, paths: Sequence[str]) -> str:
    """One sha256 over the listed files' names and bytes as they are under `root` (a missing file counts as empty)."""
    h = hashlib.sha256()
    for rel in paths:
        h.update(rel.encode() + b"\0")
        full = os.path.join(root, rel)
        if os.path.isfile(full):
            with open(full, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def write_checkout_stamp(repo: str | os.PathLike | None = None) -> str:
    """Write CHECKOUT_STAMP in a git checkout: its `checkout_state()` and a sha256 over its tracked files outside
    papermill_runs/, so that a copy of the tree without .git can still say which commit it is and whether any of
    those files changed since (see `checkout_state`). Returns the path."""
    root = os.path.abspath(os.fspath(repo) if repo is not None else checkout_root())
    state = checkout_state(root)
    if state["git_commit"] is None:
        raise RuntimeError(f"cannot stamp {root}: {state.get('git_reason')}")
    files = [p for p in _git(root, "ls-files", "-z").split("\0") if p and not p.startswith(PROVENANCE_IGNORED_DIRS)]
    stamp = {**state, "files": files, "files_sha256": _files_sha256(root, files),
             "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    path = os.path.join(root, CHECKOUT_STAMP)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(stamp, fh, indent=1)
    return path


def _from_stamp(root: str, state: dict) -> dict:
    """No git here: take the commit from CHECKOUT_STAMP if the checkout carries one; the copy is dirty when the stamp
    says so or when any file it lists hashes differently here."""
    path = os.path.join(root, CHECKOUT_STAMP)
    if not os.path.isfile(path):
        return state
    with open(path) as fh:
        stamp = json.load(fh)
    same = _files_sha256(root, stamp["files"]) == stamp["files_sha256"]
    state.update(git_commit=stamp["git_commit"], dirty=bool(stamp["dirty"]) or not same,
                 dirty_paths=stamp["dirty_paths"], dirty_paths_total=stamp["dirty_paths_total"],
                 git_reason=f"{state['git_reason']}; commit from {CHECKOUT_STAMP} (written {stamp['utc']}), whose "
                            f"{len(stamp['files'])} tracked files {'hash the same' if same else 'DIFFER'} here")
    if not same:
        state["dirty_paths"] = state["dirty_paths"] + ["(files changed since the stamp)"]
    return state


def provenance(repo: str | os.PathLike | None = None) -> dict:
    """What every record carries, taken when it is saved: `checkout_state()` plus `kernels`, each kernel this
    process built (JIT: the sha256 of the CUDA source TileLang generated) or loaded (AOT: the manifest's sha256 of
    the source and the cubin, and the commit the build was made from), as noted by `foldkv.kernels.registry`."""
    from .kernels.registry import kernels_handed_out

    return {**checkout_state(repo), "kernels": kernels_handed_out()}


REDRAWN_FROM = "redrawn from"  # a section's status "redrawn from <run>": shown again from that run, not measured now


def _installed_version(*distributions: str) -> str | None:
    """The installed version of the first of `distributions` that is installed (without importing it), else None."""
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def environment(device: torch.device | str | None = None) -> dict:
    """Where a record was made: enough to tell an H200 run from a CPU one, with the versions of what ran (torch,
    CUDA, TileLang, FlashInfer) and the active AOT build. With `device`: that device's type, name, capability, SMs
    and memory (what the benchmarks' results carry as `env`)."""
    from foldkv.lab.bench.arms import aot_build_dir

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "host": platform.node(),
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cuda": torch.version.cuda,
        "flashinfer": _installed_version("flashinfer-python", "flashinfer"),
        "aot_build": aot_build_dir(),
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    env["tilelang"] = _installed_version("tilelang")
    if device is not None:
        device = torch.device(device)
        env["device_type"] = device.type
        if device.type == "cuda":
            p = torch.cuda.get_device_properties(device)
            env.update(device_name=p.name, capability=list(torch.cuda.get_device_capability(device)),
                       sms=p.multi_processor_count, memory_bytes=p.total_memory)
        else:
            env["device_name"] = f"CPU ({platform.processor() or platform.machine()})"
    return env


class RunRecord:
    """A notebook's record: `sections` maps a section name to "ran", "redrawn from <run>" (results of an earlier run
    shown again, nothing measured now), "failed: ..." or "not run: <reason>".

    `save()` writes `<out_dir>/<notebook>.record.json`; the batch driver reads every record's sections to say plainly
    which GPU sections did not run. (Notebooks with a richer results file of their own write that beside it.)
    """

    def __init__(self, notebook: str, out_dir: str | os.PathLike, parameters: dict | None = None):
        self.notebook = notebook
        self.out_dir = os.fspath(out_dir)
        self.data: dict[str, Any] = {
            "notebook": notebook,
            "parameters": parameters or {},
            "environment": environment(),
            "sections": {},
            "results": {},
        }

    @property
    def sections(self) -> dict:
        return self.data["sections"]

    @property
    def results(self) -> dict:
        return self.data["results"]

    def ran(self, section: str, **results: Any) -> None:
        self.sections[section] = "ran"
        if results:
            self.results.setdefault(section, {}).update(results)

    def redrawn(self, section: str, source_run: str, **results: Any) -> None:
        """The section shows the results of `source_run` (a run tag, e.g. h200-20261129-s2): nothing measured now."""
        if not str(source_run).strip():
            raise ValueError(f"{section}: redrawn from which run? source_run is empty")
        self.sections[section] = f"{REDRAWN_FROM} {source_run}"
        if results:
            self.results.setdefault(section, {}).update(results)

    def not_run(self, section: str, reason: str) -> None:
        self.sections[section] = reason if reason.startswith("not run") else f"not run: {reason}"

    def failed(self, section: str, error: str) -> None:
        self.sections[section] = f"failed: {error}"

    def cuda_or_not_run(self, section: str) -> bool:
        """True if a CUDA device is here; otherwise record the section as not run and return False."""
        if torch.cuda.is_available():
            return True
        self.not_run(section, NOT_RUN_NO_CUDA)
        return False

    def path(self) -> str:
        return os.path.join(self.out_dir, f"{self.notebook}.record.json")

    def save(self) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        self.data["provenance"] = provenance()
        with open(self.path(), "w") as fh:
            json.dump(jsonable(self.data), fh, indent=1, allow_nan=False)
        return self.path()

    def summary(self) -> str:
        width = max([len(s) for s in self.sections] + [7])
        return "\n".join(f"{name:<{width}}  {status}" for name, status in self.sections.items())


def markdown_table(rows: Iterable[dict], columns: Sequence[str] | dict[str, str], formats: dict[str, str] | None = None) -> str:
    """A Markdown table of `rows` (dicts). `columns` is a list of keys or {key: header}; `formats` {key: format spec}."""
    cols = dict(columns) if isinstance(columns, dict) else {c: c for c in columns}
    formats = formats or {}
    lines = ["| " + " | ".join(cols.values()) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = []
        for key in cols:
            value = row.get(key, "")
            spec = formats.get(key)
            cells.append(format(value, spec) if spec and isinstance(value, (int, float)) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
