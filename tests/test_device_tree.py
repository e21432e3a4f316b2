"""scripts/device_tree.sh on a scratch checkout: `hold` moves what earlier runs wrote (every papermill_runs/h200-*
folder but the newest, bench/*_runs/) into the ignored .device_hold/, the checkout stays clean for provenance, and
`restore` puts every file back as it was; `restore` refuses to overwrite a folder that came back some other way."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from foldkv import provenance

ROOT = Path(__file__).resolve().parents[1]
RUNS = ["papermill_runs/h200-20261201-s1", "papermill_runs/h200-20261202-s2", "bench/decode_runs", "bench/fp8_runs"]


def sh(repo: Path, *args: str) -> str:
    return subprocess.run(["bash", "scripts/device_tree.sh", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "device_tree.sh", repo / "scripts")
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    (repo / "lib").mkdir()
    (repo / "lib" / "code.py").write_text("x = 1\n")
    for d in RUNS:
        (repo / d).mkdir(parents=True)
        (repo / d / "record.json").write_text(f'{{"run": "{d}"}}\n')
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True, check=True)  # noqa: E731
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return repo


def test_hold_then_restore(checkout):
    before = {p: p.read_text() for p in checkout.rglob("*.json")}
    said = sh(checkout, "hold")
    assert "kept here: papermill_runs/h200-20261202-s2" in said and "travels:" in said
    assert (checkout / "papermill_runs/h200-20261202-s2").is_dir()  # the newest run stays
    for d in ("papermill_runs/h200-20261201-s1", "bench/decode_runs", "bench/fp8_runs"):
        assert not (checkout / d).exists() and (checkout / ".device_hold" / d / "record.json").is_file()
    state = provenance.checkout_state(checkout)
    assert state["dirty"] is False, state  # what runs wrote is not code
    sh(checkout, "restore")
    assert not (checkout / ".device_hold").exists()
    assert {p: p.read_text() for p in checkout.rglob("*.json")} == before


def test_restore_refuses_to_overwrite(checkout):
    sh(checkout, "hold")
    (checkout / "bench/fp8_runs").mkdir()  # came back some other way
    with pytest.raises(subprocess.CalledProcessError) as exc:
        sh(checkout, "restore")
    assert "refusing: bench/fp8_runs exists" in exc.value.stderr
    assert (checkout / ".device_hold" / "bench/fp8_runs" / "record.json").is_file()  # nothing lost
