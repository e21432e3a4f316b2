"""Provenance of every record (`foldkv.lab.checkout_stamp.provenance`): the commit and dirty flag of the checkout, on
temporary git repositories (clean, dirty, dirty only under papermill_runs/, not a checkout), and each record writer
stamping it at save time. The kernel hashes it lists are tested with real kernels in test_aot_cpu.py."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from foldkv import provenance
from foldkv.lab import checkout_stamp
from foldkv.lab.checkout_stamp import write_checkout_stamp
from foldkv.kernels import registry
from foldkv.lab.report import RunRecord


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "checkout"
    (r / "lib").mkdir(parents=True)
    (r / "papermill_runs" / "run").mkdir(parents=True)
    (r / "lib" / "code.py").write_text("x = 1\n")
    (r / "papermill_runs" / "run" / "record.json").write_text("{}\n")
    git(tmp_path, "init", "-q", str(r))
    git(r, "add", "-A")
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return r


def test_clean_checkout_names_its_commit(repo):
    state = provenance.checkout_state(repo)
    assert state["git_commit"] == git(repo, "rev-parse", "HEAD") and len(state["git_commit"]) == 40
    assert state["dirty"] is False and state["dirty_paths"] == [] and state["dirty_paths_total"] == 0


@pytest.mark.parametrize("change", ["modified", "staged", "deleted"])
def test_dirty_checkout_says_dirty(repo, change):
    """The red twin of the clean case: a tracked change, staged or not, or a deleted file, makes the record dirty."""
    if change == "deleted":
        (repo / "lib" / "code.py").unlink()
    else:
        (repo / "lib" / "code.py").write_text("x = 2\n")
        if change == "staged":
            git(repo, "add", "lib/code.py")
    state = provenance.checkout_state(repo)
    assert state["dirty"] is True, state
    assert state["dirty_paths"] == ["lib/code.py"] and state["dirty_paths_total"] == 1


def test_run_outputs_and_untracked_files_do_not_make_it_dirty(repo):
    (repo / "papermill_runs" / "run" / "record.json").write_text('{"changed": 1}\n')
    (repo / "papermill_runs" / "run" / "new.json").write_text("{}\n")
    (repo / "scratch.txt").write_text("untracked\n")
    assert provenance.checkout_state(repo)["dirty"] is False


def test_dirty_paths_are_capped_but_counted(repo):
    for i in range(provenance.MAX_DIRTY_PATHS + 5):
        (repo / "lib" / f"m{i:02d}.py").write_text("")
    git(repo, "add", "-A")
    state = provenance.checkout_state(repo)
    assert state["dirty"] and len(state["dirty_paths"]) == provenance.MAX_DIRTY_PATHS
    assert state["dirty_paths_total"] == provenance.MAX_DIRTY_PATHS + 5


def test_not_a_checkout_says_why(tmp_path, repo):
    state = provenance.checkout_state(tmp_path)  # holds a checkout, is none
    assert state["git_commit"] is None and state["dirty"] is None and state["git_reason"]
    sub = provenance.checkout_state(repo / "lib")  # inside a checkout but not its top: not foldkv's checkout
    assert sub["git_commit"] is None and "not the top" in sub["git_reason"]


def _copy_without_git(repo, dest):
    import shutil

    shutil.copytree(repo, dest, ignore=shutil.ignore_patterns(".git"))
    return dest


def test_copy_without_git_takes_the_commit_from_the_stamp(tmp_path, repo):
    """The device machine gets the working tree without .git: the stamp written beforehand names the commit."""
    write_checkout_stamp(repo)
    copy = _copy_without_git(repo, tmp_path / "copy")
    state = checkout_stamp.checkout_state(copy)
    assert state["git_commit"] == git(repo, "rev-parse", "HEAD") and state["dirty"] is False, state
    assert "hash the same" in state["git_reason"]
    assert provenance.checkout_state(copy)["git_commit"] is None  # git's alone (an AOT manifest's): no stamp read


def test_copy_changed_after_the_stamp_says_dirty(tmp_path, repo):
    """Red twin: a listed file edited after the stamp makes the copy dirty, whatever the stamp said."""
    write_checkout_stamp(repo)
    copy = _copy_without_git(repo, tmp_path / "copy")
    (copy / "lib" / "code.py").write_text("x = 3\n")
    state = checkout_stamp.checkout_state(copy)
    assert state["git_commit"] == git(repo, "rev-parse", "HEAD") and state["dirty"] is True, state
    assert "DIFFER" in state["git_reason"]


def test_copy_beside_a_stale_git_takes_the_commit_from_the_stamp(tmp_path, repo):
    """The device machine's copy can carry a .git whose HEAD is an older commit: the files changed against it, but
    they are exactly the stamped commit's, so the stamp names the commit (clean)."""
    import shutil

    stale = tmp_path / "stale"
    shutil.copytree(repo, stale)  # the older commit, with its .git
    (repo / "lib" / "code.py").write_text("x = 5\n")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "newer")
    write_checkout_stamp(repo)
    shutil.rmtree(stale / "lib")
    shutil.copytree(repo / "lib", stale / "lib")
    shutil.copytree(repo / "build", stale / "build")
    state = checkout_stamp.checkout_state(stale)
    assert state["git_commit"] == git(repo, "rev-parse", "HEAD") != git(stale, "rev-parse", "HEAD"), state
    assert state["dirty"] is False and "git here says HEAD" in state["git_reason"], state
    # red twin: one more edit in the copy, and the stale HEAD plus its changed files is what is reported
    (stale / "lib" / "code.py").write_text("x = 6\n")
    state = checkout_stamp.checkout_state(stale)
    assert state["git_commit"] == git(stale, "rev-parse", "HEAD") and state["dirty"] is True, state


def test_copy_without_its_run_folders_matches_the_stamp(tmp_path, repo):
    """A copy sent without what runs wrote (papermill_runs/, bench/*_runs/: the device call's size cap) is still the
    stamped commit, clean; its red twin, a copy without a code file, is dirty."""
    import shutil

    (repo / "bench" / "decode_runs").mkdir(parents=True)
    (repo / "bench" / "decode_runs" / "run1.json").write_text("{}\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a run")
    write_checkout_stamp(repo)
    trimmed = _copy_without_git(repo, tmp_path / "trimmed")
    shutil.rmtree(trimmed / "bench" / "decode_runs")
    shutil.rmtree(trimmed / "papermill_runs")
    state = checkout_stamp.checkout_state(trimmed)
    assert state["git_commit"] == git(repo, "rev-parse", "HEAD") and state["dirty"] is False, state
    (trimmed / "lib" / "code.py").unlink()
    assert checkout_stamp.checkout_state(trimmed)["dirty"] is True


def test_copy_without_git_or_stamp_names_no_commit(tmp_path, repo):
    state = checkout_stamp.checkout_state(_copy_without_git(repo, tmp_path / "copy"))
    assert state["git_commit"] is None and state["dirty"] is None


def test_this_checkout_is_the_default():
    state = provenance.checkout_state()
    assert state["git_commit"] == git(provenance.checkout_root(), "rev-parse", "HEAD")


def test_records_carry_provenance_at_save_time(tmp_path, monkeypatch):
    """RunRecord.save, the benchmark results and the kernels noted by the registry: what was noted before the save
    is in it (and a kernel noted after a save is only in the next one)."""
    from foldkv.lab import bench

    monkeypatch.setattr(registry, "_HANDED_OUT", {})  # this test's fake kernels stay out of other tests' records
    rec = RunRecord("nb", tmp_path)
    registry.note_kernel("test_kernel_a", "jit", "a" * 64)
    with open(rec.save()) as fh:
        saved = json.load(fh)["provenance"]
    assert saved["git_commit"] == git(provenance.checkout_root(), "rev-parse", "HEAD")
    assert isinstance(saved["dirty"], bool)
    names = [k["name"] for k in saved["kernels"]]
    assert "test_kernel_a" in names and "test_kernel_b" not in names
    registry.note_kernel("test_kernel_b", "aot", "b" * 64, cubin_sha256="c" * 64)
    path = bench.save_results({"cells": []}, tmp_path / "bench.json")
    with open(path) as fh:
        kernels = {k["name"]: k for k in json.load(fh)["provenance"]["kernels"]}
    assert kernels["test_kernel_b"] == {"name": "test_kernel_b", "backend": "aot", "source_sha256": "b" * 64,
                                        "cubin_sha256": "c" * 64}


def test_every_registered_builder_notes_what_it_hands_out():
    """Each registered variant's builder is wrapped by registry.hands_out, so every launcher, test and harness that
    builds a kernel puts its hash in the records."""
    for v in registry.all_variants():
        fn = v.build_function()
        assert getattr(fn, "hands_out", None), f"{v.name}: builder {v.builder} does not note its kernels"
