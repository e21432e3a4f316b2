"""Which code a result came from: the checkout's commit and dirty flag (or, in a copy without .git, the stamp written
beside it) and every kernel this process built or loaded. Records, benchmark results and AOT manifests carry it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from typing import Any, Sequence

from .kernels.registry import kernels_handed_out
from .moved import moved

# What runs wrote, not code: a run that writes its records there does not make the code dirty, and a copy may travel
# without them (the device call's 64 MiB cap: scripts/device_tree.sh holds them back) and still match its stamp.
PROVENANCE_IGNORED_DIRS = ("papermill_runs/", "bench/decode_runs/", "bench/fp8_runs/")
MAX_DIRTY_PATHS = 20
# written in the checkout before a device call (`foldkv.lab.checkout_stamp`); `checkout_state` says when it is read
CHECKOUT_STAMP = os.path.join("build", "checkout.json")


def checkout_root() -> str:
    """The folder foldkv is imported from, two levels above the package (lib/foldkv -> the checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True, timeout=30).stdout


def checkout_state(repo: str | os.PathLike | None = None) -> dict:
    """The code a record was made with: `git_commit` (HEAD of the checkout, None with `git_reason` when foldkv is not
    imported from the top of a git checkout), `dirty` (tracked files changed against HEAD, staged or not, outside
    PROVENANCE_IGNORED_DIRS) and up to MAX_DIRTY_PATHS of those paths (`dirty_paths_total` counts them all).

    A copy of a checkout made elsewhere (the device machine gets the working tree, with no .git or a stale one) names
    its commit through CHECKOUT_STAMP: used when there is no git here, and when git here sees changed files but every
    file the stamp lists hashes the same (the tree is the stamped commit's, whatever HEAD the copy's .git holds)."""
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
        return _stamp_state(root, "git is not installed") or {**state, "git_reason": "git is not installed"}
    except subprocess.CalledProcessError as exc:
        reason = f"{root} is not a git checkout with a commit: {(exc.stderr or '').strip()[:200]}"
        return _stamp_state(root, reason) or {**state, "git_reason": reason}
    except subprocess.TimeoutExpired:
        state["git_reason"] = "git did not answer within 30 s"
        return state
    paths, fields = [], iter(status.split("\0"))
    for entry in fields:
        if len(entry) < 4:
            continue
        if entry[0] in "RC":  # a rename or copy: the next field is the old path
            next(fields, None)
        if not entry[3:].startswith(PROVENANCE_IGNORED_DIRS):
            paths.append(entry[3:])
    state.update(dirty=bool(paths), dirty_paths=sorted(paths)[:MAX_DIRTY_PATHS], dirty_paths_total=len(paths))
    if paths:
        stamped = _stamp_state(root, f"git here says HEAD {state['git_commit'][:12]} with {len(paths)} changed files",
                               same_only=True)
        if stamped is not None and stamped["git_commit"] != state["git_commit"]:
            return stamped
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


def _stamp_state(root: str, reason: str, *, same_only: bool = False) -> dict | None:
    """The state CHECKOUT_STAMP of `root` gives, `reason` saying why git's was not taken: its commit, dirty when the
    stamp says so or any file it lists hashes differently here. None without a stamp (or, `same_only`, when a listed
    file differs: the tree is not that commit's)."""
    path = os.path.join(root, CHECKOUT_STAMP)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        stamp = json.load(fh)
    same = _files_sha256(root, stamp["files"]) == stamp["files_sha256"]
    if same_only and not same:
        return None
    return {"git_commit": stamp["git_commit"], "dirty": bool(stamp["dirty"]) or not same,
            "dirty_paths": stamp["dirty_paths"] + ([] if same else ["(files changed since the stamp)"]),
            "dirty_paths_total": stamp["dirty_paths_total"],
            "git_reason": f"{reason}; commit from {CHECKOUT_STAMP} (written {stamp['utc']}), whose"
                          f" {len(stamp['files'])} tracked files {'hash the same' if same else 'DIFFER'} here"}


def provenance(repo: str | os.PathLike | None = None) -> dict:
    """What every record carries, taken when it is saved: `checkout_state()` plus `kernels`, each kernel this
    process built or loaded (`foldkv.kernels.registry.kernels_handed_out`)."""
    return {**checkout_state(repo), "kernels": kernels_handed_out()}


__getattr__ = moved(__name__, {"write_checkout_stamp": "foldkv.lab.checkout_stamp.write_checkout_stamp (only the run"
                                                       " before a device call writes it)"})
