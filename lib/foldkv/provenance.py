"""Which code a result came from: the checkout's commit and dirty flag, as AOT manifests carry it (the lab's records
add the stamp a copy without .git names its commit by, and every kernel the process built or loaded:
`foldkv.lab.checkout_stamp.provenance`)."""

from __future__ import annotations

import os
import subprocess
from typing import Any, Callable

from .moved import moved

# What runs wrote, not code: a run that writes its records there does not make the code dirty, and a copy may travel
# without them (the device call's 64 MiB cap: scripts/device_tree.sh holds them back) and still match its stamp.
PROVENANCE_IGNORED_DIRS = ("papermill_runs/", "bench/decode_runs/", "bench/fp8_runs/")
MAX_DIRTY_PATHS = 20


def checkout_root() -> str:
    """The folder foldkv is imported from, two levels above the package (lib/foldkv -> the checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True, timeout=30).stdout


def checkout_state(repo: str | os.PathLike | None = None, stamp: Callable[..., dict | None] | None = None) -> dict:
    """The code a record was made with: `git_commit` (HEAD of the checkout, None with `git_reason` when foldkv is not
    imported from the top of a git checkout), `dirty` (tracked files changed against HEAD, staged or not, outside
    PROVENANCE_IGNORED_DIRS) and up to MAX_DIRTY_PATHS of those paths (`dirty_paths_total` counts them all).

    `stamp(root, reason, same_only=False)`: the state a copy of a checkout made elsewhere names itself by (the lab's
    `checkout_stamp.stamp_state`), taken when there is no git here, and (`same_only`) when git sees changed files but
    the stamp's files all hash the same and it names another commit."""
    root = os.path.abspath(os.fspath(repo) if repo is not None else checkout_root())
    state: dict[str, Any] = {"git_commit": None, "dirty": None, "dirty_paths": [], "dirty_paths_total": None}
    stamp = stamp or (lambda *args, **kwargs: None)
    try:
        top = _git(root, "rev-parse", "--show-toplevel").strip()
        if os.path.realpath(top) != os.path.realpath(root):
            state["git_reason"] = f"{root} is not the top of a git checkout (it lies inside {top})"
            return state
        state["git_commit"] = _git(root, "rev-parse", "HEAD").strip()
        status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=no")
    except FileNotFoundError:
        return stamp(root, "git is not installed") or {**state, "git_reason": "git is not installed"}
    except subprocess.CalledProcessError as exc:
        reason = f"{root} is not a git checkout with a commit: {(exc.stderr or '').strip()[:200]}"
        return stamp(root, reason) or {**state, "git_reason": reason}
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
        stamped = stamp(root, f"git here says HEAD {state['git_commit'][:12]} with {len(paths)} changed files",
                        same_only=True)
        if stamped is not None and stamped["git_commit"] != state["git_commit"]:
            return stamped
    return state


__getattr__ = moved(__name__, {name: f"foldkv.lab.checkout_stamp.{name} (the stamp is written before a device call and"
                                     " read, with the kernels handed out, by the lab's records only)"
                               for name in ("write_checkout_stamp", "provenance", "CHECKOUT_STAMP")})
