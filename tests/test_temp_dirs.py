"""foldkv's own temporary folders are gone when the work that needed them is done: the AOT build's fixed-name nvcc
source folder and the drift study's synthetic checkpoint. Each test points tempfile at its own tmp_path, so what is
left there is what foldkv left."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest
import torch

from conftest import require_module
from foldkv.aot.build import _locked_fixed_dir, compile_cubin

TINY = dict(hidden_size=64, intermediate_size=128, vocab_size=128)


def _foldkv_left(d) -> list[str]:
    return [n for n in os.listdir(d) if n.startswith("foldkv")]  # torch may keep its own caches there


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_fixed_dir_is_removed_after_use_and_held_by_one_process_at_a_time(private_tmp):
    """The second user waits for the first (the lock), then gets the folder fresh (the first one's file is gone)."""
    path = str(private_tmp / "foldkv_aot_0123")
    events, first_in, release = [], threading.Event(), threading.Event()

    def first():
        with _locked_fixed_dir(path) as d:
            open(os.path.join(d, "tvm_kernels.cu"), "w").close()
            events.append("first in")
            first_in.set()
            release.wait(10)
            events.append("first out")

    def second():
        first_in.wait(10)
        with _locked_fixed_dir(path) as d:
            events.append(("second in", sorted(os.listdir(d))))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # time enough for `second` to enter, were it not locked out
    release.set()
    for t in threads:
        t.join(10)
    assert events == ["first in", "first out", ("second in", [])]
    assert os.listdir(private_tmp) == []


def test_fixed_dir_is_removed_when_the_work_fails(private_tmp):
    path = str(private_tmp / "foldkv_aot_0123")
    with pytest.raises(RuntimeError, match="nvcc said no"):
        with _locked_fixed_dir(path):
            raise RuntimeError("nvcc said no")
    assert os.listdir(private_tmp) == []


def test_compile_cubin_leaves_nothing_and_stays_reproducible(private_tmp):
    """Red twin of the cleanup: the folder's name is what the cubin's line info records, so removing it between
    builds must not change the bytes (two compiles of the same source, each in a folder made anew)."""
    nvcc, cxx = shutil.which("nvcc"), shutil.which("g++") or shutil.which("c++")
    if nvcc is None or cxx is None:
        pytest.skip("needs nvcc and a host C++ compiler")
    from foldkv.aot.build import nvcc_version

    tc = {"nvcc": nvcc, "ccbin": cxx, "nvcc_version": nvcc_version(nvcc)}
    source = 'extern "C" __global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }\n'
    first = compile_cubin(source, "sm_90a", [], tc)
    assert os.listdir(private_tmp) == []
    again = compile_cubin(source, "sm_90a", [], tc)
    assert first[:4] == b"\x7fELF" and again == first
    assert os.listdir(private_tmp) == []


def test_synthetic_checkpoint_of_the_drift_study_is_removed_once_loaded(private_tmp):
    require_module("transformers")
    require_module("safetensors")
    from foldkv.lab.drift import prepare_model

    model, _, info = prepare_model(None, device=torch.device("cpu"), dtype=torch.float32, seed=1, synthetic_config=TINY)
    assert info["kind"] == "synthetic" and _foldkv_left(private_tmp) == []
    with torch.no_grad():  # the weights live in memory, not in the removed files
        logits = model(torch.tensor([[3, 4, 5]])).logits
    assert torch.isfinite(logits).all()


def test_a_synthetic_dir_the_caller_names_is_theirs_to_keep(tmp_path):
    """Red twin: only the folder foldkv made for itself is removed."""
    require_module("transformers")
    require_module("safetensors")
    from foldkv.lab.drift import prepare_model

    keep = tmp_path / "mine"
    prepare_model(None, device=torch.device("cpu"), dtype=torch.float32, seed=1, synthetic_config=TINY,
                  synthetic_dir=str(keep))
    assert (keep / "config.json").exists()
