"""What every record names its code by (`provenance`), and the stamp by which a copy of the checkout without .git (the
device machine gets the working tree only) names its commit: written here, in the git checkout, before the device call
(`write_checkout_stamp`, scripts/prepare_device_run.sh); read wherever a record is made (`checkout_state`)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from typing import Sequence

from .. import provenance as _git_provenance
from ..kernels.registry import kernels_handed_out
from ..provenance import PROVENANCE_IGNORED_DIRS, _git, checkout_root

# written in the checkout before a device call; `checkout_state` says when it is read
CHECKOUT_STAMP = os.path.join("build", "checkout.json")


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


def stamp_state(root: str, reason: str, *, same_only: bool = False) -> dict | None:
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


def checkout_state(repo: str | os.PathLike | None = None) -> dict:
    """`foldkv.provenance.checkout_state` with the stamp: a copy of a checkout made elsewhere (no .git, or a stale one)
    names its commit through CHECKOUT_STAMP when there is no git here, and when git here sees changed files but every
    file the stamp lists hashes the same (the tree is the stamped commit's, whatever HEAD the copy's .git holds)."""
    return _git_provenance.checkout_state(repo, stamp=stamp_state)


def provenance(repo: str | os.PathLike | None = None) -> dict:
    """What every record carries, taken when it is saved: `checkout_state()` plus `kernels`, each kernel this
    process built or loaded (`foldkv.kernels.registry.kernels_handed_out`)."""
    return {**checkout_state(repo), "kernels": kernels_handed_out()}


def write_checkout_stamp(repo: str | os.PathLike | None = None) -> str:
    """Write CHECKOUT_STAMP in a git checkout: its `checkout_state()` and a sha256 over its tracked files outside
    PROVENANCE_IGNORED_DIRS, so that a copy of the tree without .git can still say which commit it is and whether any of
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


__all__ = ["CHECKOUT_STAMP", "checkout_state", "provenance", "stamp_state", "write_checkout_stamp"]
