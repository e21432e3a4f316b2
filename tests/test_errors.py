"""Errors a user meets first, each in foldkv's words and each with its red twin: a preset typo, a CUDA device on a torch
that has none, command-line misuse (exit 2, no traceback) against a real bug (traceback kept)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch

from conftest import require_cuda

import foldkv as fk
from foldkv.__main__ import main as cli_main
from foldkv.validate import FoldKvInputError, check_device

from test_config import GEMMA4_31B_TEXT


# --- a preset typo -------------------------------------------------------------------------------------------------

def test_preset_typo_lists_the_presets_and_says_a_path_is_accepted():
    with pytest.raises(fk.ConfigError) as err:
        fk.resolve_geometry("gemma-4-13b")
    msg = str(err.value)
    for preset in fk.PRESETS:
        assert repr(preset) in msg or preset in msg, msg
    assert "did you mean 'gemma-4-31b'" in msg.lower() and "config.json" in msg, msg


@pytest.mark.parametrize("spec", ["gemma-4-31b", "config-dir", "config-file"])
def test_presets_and_paths_still_resolve(tmp_path, spec):
    """Red twin: what the typo check must let through (the preset itself and a path that exists)."""
    (tmp_path / "config.json").write_text(json.dumps(GEMMA4_31B_TEXT))
    arg = {"gemma-4-31b": "gemma-4-31b", "config-dir": str(tmp_path), "config-file": str(tmp_path / "config.json")}[spec]
    assert fk.resolve_geometry(arg) == fk.GEMMA4_31B


def test_a_path_that_is_a_folder_without_config_still_says_so(tmp_path):
    with pytest.raises(fk.ConfigError, match="no config.json at"):
        fk.resolve_geometry(str(tmp_path))


# --- CUDA on a torch without it ------------------------------------------------------------------------------------

def _no_cuda(monkeypatch, built_for: str | None) -> None:
    """This torch as a CPU-only build (built_for None) or a CUDA build that sees no device, on any machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", built_for)


def _pool_on(device):
    return fk.PagedKvPool(fk.PagedKvLayout.for_tokens(128), device=device)


def _block_table_to(device):
    _pool_on("cpu").allocate([100]).to(device)


def _plan_decode(device):
    from foldkv.kernels.plan import plan_decode

    plan_decode(fk.PagedKvLayout.for_tokens(128), [100], device=device)


def _load_model(device):
    from foldkv.lab.model import load_model

    load_model("/nonexistent/checkpoint", device=device)  # refused before any file is read


def _drift_device(device):
    from foldkv.lab.drift import resolve_device

    resolve_device(device)


ENTRY_POINTS = {"PagedKvPool": _pool_on, "BlockTable.to": _block_table_to, "plan_decode": _plan_decode,
                "load_model": _load_model, "drift.resolve_device": _drift_device}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_cuda_on_a_cpu_only_torch_is_refused_in_foldkvs_words(monkeypatch, entry):
    if entry == "load_model":
        pytest.importorskip("transformers")
    _no_cuda(monkeypatch, built_for=None)
    with pytest.raises(FoldKvInputError) as err:
        ENTRY_POINTS[entry]("cuda")
    msg = str(err.value)
    assert "CUDA is not available in this torch build" in msg and f"torch {torch.__version__}" in msg, msg
    assert "device='cpu'" in msg, msg


def test_cuda_build_without_a_device_says_so(monkeypatch):
    _no_cuda(monkeypatch, built_for="13.0")
    with pytest.raises(FoldKvInputError, match=r"built for CUDA 13\.0 but sees no CUDA device"):
        _pool_on("cuda:0")


def test_a_device_index_past_the_last_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(FoldKvInputError, match=r"'cuda:1' does not exist: torch sees 1 CUDA device"):
        check_device("cuda:1")


@pytest.mark.parametrize("bad", ["cdua", 3.5])
def test_a_device_torch_does_not_know_is_refused(bad):
    with pytest.raises(FoldKvInputError, match="is not a torch device"):
        check_device(bad)


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e != "load_model"])  # load_model on the CPU: test_drift_cpu
def test_cpu_passes_every_device_check(monkeypatch, entry):
    """Red twin: the same entry points on device='cpu', with CUDA just as absent, are not refused by the check."""
    _no_cuda(monkeypatch, built_for=None)
    ENTRY_POINTS[entry]("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")


def test_cuda_passes_where_there_is_a_gpu():
    require_cuda()
    assert _pool_on("cuda").device.type == "cuda"


# --- the command line ----------------------------------------------------------------------------------------------

MISUSE = {
    "no arguments": [],
    "unknown subcommand": ["frob"],
    "aot without its subcommand": ["aot"],
    "verify a missing folder": ["aot", "verify", "/nonexistent/build"],
    "arch that is no SM token": ["aot", "build", "--arch", "sm_xx", "--out", "OUT"],
    "arch the builders do not generate for": ["aot", "build", "--arch", "sm_80", "--out", "OUT"],
    "preset typo": ["aot", "build", "--geometry", "gemma-4-13b", "--out", "OUT"],
    "unknown kernel": ["aot", "build", "--only", "no_such_kernel", "--out", "OUT"],
}
EXPECTED = {
    "no arguments": "the following arguments are required",
    "unknown subcommand": "invalid choice: 'frob'",
    "aot without its subcommand": "the following arguments are required",
    "verify a missing folder": "is not a build folder (no such path)",
    "arch that is no SM token": "'sm_xx' is not an SM token",
    "arch the builders do not generate for": "set FOLDKV_CUDA_ARCH=sm_80",
    "preset typo": "did you mean 'gemma-4-31b'",
    "unknown kernel": "no kernel variant 'no_such_kernel'",
}


@pytest.mark.parametrize("case", MISUSE)
def test_cli_misuse_exits_2_with_a_short_error_before_building(case, tmp_path, capsys, monkeypatch):
    aot_build = importlib.import_module("foldkv.aot.build")  # the module (foldkv.aot.build is also the function)

    def no_build(*a, **k):
        raise AssertionError("misuse reached the build")

    monkeypatch.setattr(aot_build, "build", no_build)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in MISUSE[case]]
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m foldkv") and "error:" in last and EXPECTED[case].lower() in last.lower(), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_cli_misuse_has_no_traceback_in_a_real_process():
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "verify", "/nonexistent/build"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 2, res.stderr  # usage line + error line


def test_cli_build_failure_is_one_message_and_exit_1(tmp_path, capsys, monkeypatch):
    aot_build = importlib.import_module("foldkv.aot.build")  # the module (foldkv.aot.build is also the function)

    def failing_build(*a, **k):
        raise aot_build.AotBuildError("nvcc failed (1): a known way to fail")

    monkeypatch.setattr(aot_build, "build", failing_build)
    assert cli_main(["aot", "build", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "aot build failed: nvcc failed (1): a known way to fail"


def test_cli_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """Red twin: an exception that is no known foldkv error is not turned into a message."""
    aot_build = importlib.import_module("foldkv.aot.build")  # the module (foldkv.aot.build is also the function)

    def buggy_build(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(aot_build, "build", buggy_build)
    with pytest.raises(ZeroDivisionError):
        cli_main(["aot", "build", "--out", str(tmp_path / "out")])
