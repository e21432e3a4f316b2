"""The 31B's tensor-parallel decode runner on the CPU: its checkpoint is the model `build_gemma4_31b` makes (the same
draws, one file or shards with an index, as from_pretrained reads them), its cells parse or are refused, its token
comparison counts the steps before the first difference, and without one GPU a rank it stops before loading anything.

Reproduce: python -m pytest -q tests/test_tp_model_decode_cpu.py
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from conftest import require_module

SMALL = dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=128, intermediate_size=256)


def _written_and_built(tmp_path, *, seed_written: int, shard_bytes: int | None):
    require_module("transformers")
    require_module("safetensors")
    from transformers import AutoModelForCausalLM

    from foldkv.lab import gemma31b
    from foldkv.lab.synthetic import write_drawn_checkpoint

    out = str(tmp_path / "ck")
    cfg = gemma31b.gemma4_31b_config(num_layers=6, dtype="float32", **SMALL)
    if shard_bytes is None:
        gemma31b.write_gemma4_31b_checkpoint(out, seed=seed_written, device="cpu", dtype="float32", num_layers=6,
                                             **SMALL)
    else:
        write_drawn_checkpoint(out, cfg, seed_written, shard_bytes=shard_bytes)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    built = gemma31b.build_gemma4_31b("cpu", seed=4, num_layers=6, dtype=torch.float32, **SMALL)
    return out, dict(loaded.state_dict()), dict(built.state_dict())


@pytest.mark.parametrize("shard_bytes", [None, 200_000], ids=["one_file", "shards"])
def test_written_checkpoint_loads_as_the_built_model(tmp_path, shard_bytes):
    out, loaded, built = _written_and_built(tmp_path, seed_written=4, shard_bytes=shard_bytes)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    if shard_bytes is None:
        assert files == ["model.safetensors"]
    else:
        assert len(files) > 3
        with open(os.path.join(out, "model.safetensors.index.json")) as fh:
            index = json.load(fh)
        assert sorted(set(index["weight_map"].values())) == files
    assert loaded.keys() == built.keys()
    unequal = [k for k in built if not torch.equal(loaded[k], built[k])]
    assert not unequal, f"tensors loaded from the checkpoint differ from the built model's: {unequal[:5]}"


def test_written_checkpoint_red_twin_another_seed_differs(tmp_path):
    _, loaded, built = _written_and_built(tmp_path, seed_written=5, shard_bytes=None)
    assert any(not torch.equal(loaded[k], built[k]) for k in built)


@pytest.mark.parametrize("text,cell", [("32768:8", (32768, 8)), ("1:1", (1, 1)), ("131072:16", (131072, 16))])
def test_parse_cell(text, cell):
    from foldkv.lab.tp_model_decode import parse_cell

    assert parse_cell(text) == cell


@pytest.mark.parametrize("text", ["32768", "0:8", "8:-1", "a:b", "1:2:3", ""])
def test_parse_cell_refuses(text):
    from foldkv.lab.tp_model_decode import parse_cell

    with pytest.raises(argparse.ArgumentTypeError, match="cell"):
        parse_cell(text)


@pytest.mark.parametrize("tokens,base,steps", [
    ([1, 2, 3, 4], [1, 2, 3, 4], 4),
    ([1, 2, 9, 4], [1, 2, 3, 4], 2),  # the equal 4 after the difference is not counted
    ([9, 2, 3, 4], [1, 2, 3, 4], 0),
])
def test_agreed_steps(tokens, base, steps):
    from foldkv.lab.model_decode import agreed_steps

    assert agreed_steps(tokens, base) == steps


def test_runner_without_a_gpu_a_rank_stops_before_loading(tmp_path, monkeypatch):
    from foldkv.lab import tp_model_decode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    monkeypatch.setattr(tp_model_decode, "load_model", lambda *a, **k: loaded.append(a))
    out = tmp_path / "tp.json"
    with pytest.raises(SystemExit, match="one CUDA device a rank: 1 rank"):
        tp_model_decode.main([str(tmp_path / "ck"), "--out", str(out)])
    with pytest.raises(SystemExit, match="one CUDA device a rank"):
        tp_model_decode.main(["--write-checkpoint", str(tmp_path / "ck")])
    assert not loaded and not out.exists() and not (tmp_path / "ck").exists()
