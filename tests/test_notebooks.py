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
    require_module("papermill")
    out_root = tmp_path_factory.mktemp("runs")
    before = sorted(glob.glob(os.path.join(ROOT, "papermill_runs", "**"), recursive=True))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "run_batch.py"), "--smoke", "--no-progress",
                           "--out-root", str(out_root), "--tag", "smoke"], capture_output=True, text=True, timeout=1800)
    after = sorted(glob.glob(os.path.join(ROOT, "papermill_runs", "**"), recursive=True))
    assert before == after, "the smoke batch wrote into papermill_runs/"
    out = out_root / "smoke"
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
