"""The stamp by which a copy of the checkout without .git (the device machine gets the working tree only) names its
commit: written here, in the git checkout, before the device call (scripts/prepare_device_run.sh); read by
`foldkv.provenance.checkout_state` wherever a record is made."""

from __future__ import annotations

import datetime as _dt
import json
import os

from ..provenance import CHECKOUT_STAMP, PROVENANCE_IGNORED_DIRS, _files_sha256, _git, checkout_root, checkout_state


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


__all__ = ["write_checkout_stamp"]
