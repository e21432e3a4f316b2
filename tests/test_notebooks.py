"""Every notebook executes headless (papermill, smoke parameters, CPU mode) through the batch driver, into a temp dir.

Committed runs under papermill_runs/ are never touched. Assertions are on what each notebook records in its JSON.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import require_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(os.path.basename(p)[:-6] for p in glob.glob(os.path.join(ROOT, "notebooks", "[0-9][0-9]_*.ipynb")))


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The smoke batch as a fresh clone runs it: TileLang's cache is an empty temporary folder (TILELANG_CACHE_DIR;
    its default ~/.tilelang/cache is then unused), so nothing passes thanks to kernels compiled before, and the temp
    dir is a private one, so what the notebooks leave behind in it can be checked."""
    require_module("papermill")
    out_root = tmp_path_factory.mktemp("runs")
    tilelang_cache, tmp = tmp_path_factory.mktemp("tilelang_cache"), tmp_path_factory.mktemp("tmp")
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tilelang_cache), TMPDIR=str(tmp))
    env.pop("FOLDKV_JIT_BUILD_RECORD", None)
    before = sorted(glob.glob(os.path.join(ROOT, "papermill_runs", "**"), recursive=True))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "run_batch.py"), "--smoke", "--no-progress",
                           "--out-root", str(out_root), "--tag", "smoke"], capture_output=True, text=True, timeout=1800,
                          env=env)
    after = sorted(glob.glob(os.path.join(ROOT, "papermill_runs", "**"), recursive=True))
    assert before == after, "the smoke batch wrote into papermill_runs/"
    out = out_root / "smoke"
    proc.tilelang_cache, proc.tmp = tilelang_cache, tmp
    return proc, out, json.loads((out / "summary.json").read_text())


def test_batch_runs_every_notebook(batch):
    proc, out, summary = batch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["notebook"] for r in summary] == NOTEBOOKS
    for r in summary:
        assert r["status"] == "ok"
        assert (out / f"{r['notebook']}.ipynb").exists() and (out / f"{r['notebook']}.record.json").exists()
        assert r["sections"], f"{r['notebook']} recorded no sections"
        assert not any(v.startswith("failed") for v in r["sections"].values()), r["sections"]
    assert "Sections that did not run" in (out / "SUMMARY.md").read_text()


def _record(out, stem):
    return json.loads((out / f"{stem}.record.json").read_text())


def test_byte_floor_records(batch):
    _, out, _ = batch
    rec = _record(out, "01_byte_floor")
    rows = rec["results"]["floor_table"]["rows"]
    assert [r["context"] for r in rows] == [97, 97, 16384, 16384]
    for split, folded in zip(rows[::2], rows[1::2]):
        assert (split["format"], folded["format"]) == ("split", "folded")
        assert folded["bytes_per_layer"] < split["bytes_per_layer"]
        assert folded["pool_bytes_per_layer"] * 8 == split["pool_bytes_per_layer"] * 5  # 640 / 1024 columns
        assert folded["floor_us_per_step"] == pytest.approx(10 * folded["floor_us_per_layer"])
    tokens = rec["results"]["budget"]["tokens"]
    assert tokens["folded"] > tokens["split"] > 0
    assert "62.5%" in rec["results"]["conclusion"]


def test_aot_gate_builds_from_an_empty_tilelang_cache(batch):
    """Notebook 02's AOT gate in the batch, from an empty TileLang cache: it builds every registered kernel here
    (its time recorded), after the barrier check cell has JIT-built merge_groups in the same process, verifies the
    build, and leaves no foldkv_aot_ folder in the temp dir. The record carries the commit and each kernel's hash."""
    proc, out, summary = batch
    (row,) = [r for r in summary if r["notebook"] == "02_correctness_gates"]
    assert row["status"] == "ok", proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = _record(out, "02_correctness_gates")
    assert rec["sections"]["aot_build_verify"] == "ran", rec["sections"]
    res = rec["results"]["aot_build_verify"]
    from foldkv.kernels import registry

    assert res["built_here"] and res["build_seconds"] > 0 and res["passed"]
    assert res["kernels"] == sorted(v.name for v in registry.all_variants())
    assert res["jit_cache"]["tilelang_cache_dir"] == str(proc.tilelang_cache)
    assert os.listdir(proc.tilelang_cache), "the run did not use the empty cache it was given"
    assert [p for p in os.listdir(proc.tmp) if p.startswith("foldkv_aot_")] == [], "notebook 02 left its AOT folder"
    prov = rec["provenance"]
    assert len(prov["git_commit"]) == 40 and isinstance(prov["dirty"], bool)
    assert {k["name"] for k in prov["kernels"]} >= {"merge_groups"}
    assert all(len(k["source_sha256"]) == 64 for k in prov["kernels"])
