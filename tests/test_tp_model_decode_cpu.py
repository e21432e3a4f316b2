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
    from foldkv.lab.model_decode import parse_cell

    assert parse_cell(text) == cell


@pytest.mark.parametrize("text", ["32768", "0:8", "8:-1", "a:b", "1:2:3", ""])
def test_parse_cell_refuses(text):
    from foldkv.lab.model_decode import parse_cell

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


def test_gpu_steps_parse_and_skip_a_written_checkpoint(tmp_path):
    from foldkv.lab.tp_model_decode import gpu_steps, parser

    kw = dict(ranks=2, cells=[(32768, 8), (131072, 16)], arms=["foldkv-folded", "foldkv-split"], new_tokens=32,
              prompt_tokens=1024, largest_context=131072, seed=0)
    ck = tmp_path / "ck"
    steps = gpu_steps(str(ck), str(tmp_path), **kw)
    assert [s.name for s in steps] == ["checkpoint", "tp1", "tp2"]
    args = [parser().parse_args(list(s.argv[s.argv.index("foldkv.lab.tp_model_decode") + 1:])) for s in steps]
    assert args[0].write_checkpoint == str(ck)
    assert args[1].cells == [] and args[1].largest_context == 0 and steps[1].env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert args[2].cells == [(32768, 8), (131072, 16)] and args[2].arms == ["foldkv-folded", "foldkv-split"]
    assert steps[2].argv[1:6] == ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert steps[2].env == {"NCCL_NVLS_ENABLE": "0"}
    ck.mkdir()
    (ck / "model.safetensors.index.json").write_text("{}")
    assert [s.name for s in gpu_steps(str(ck), str(tmp_path), **kw)] == ["tp1", "tp2"]


def test_run_steps_stops_at_the_first_failure(tmp_path):
    import sys

    from foldkv.lab.tp_model_decode import Step, run_steps

    out = tmp_path / "a.json"
    write = f"import json; json.dump({{'ok': 1}}, open({str(out)!r}, 'w')); print('wrote')"
    steps = [Step("a", (sys.executable, "-c", write), {}, str(out)),
             Step("b", (sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"), {}, None),
             Step("c", (sys.executable, "-c", "print('never')"), {}, None)]
    done = run_steps(steps, str(tmp_path), timeout_s=60, log=lambda _: None)
    assert list(done) == ["a", "b"]
    assert done["a"]["rc"] == 0 and done["a"]["result"] == {"ok": 1} and "wrote" in done["a"]["tail"]
    assert done["b"]["rc"] == 3 and "broken" in done["b"]["tail"] and "result" not in done["b"]


def _rank_row(tpot, floor=10.0, status="ran"):
    return {"status": status, "tpot_ms": tpot, "tpot_p90_ms": tpot + 1, "floor_ms": floor, "host_share": 0.01,
            "weight_bytes": 30e9, "kv_bytes": 8e9, "memory": {"peak": 50 * 2**30}}


def test_decode_rows_take_the_slowest_rank():
    from foldkv.lab.tp_model_decode import decode_table_rows

    result = {"decode": [
        {"arm": "foldkv-folded", "context": 32768, "batch": 8, "status": "ran",
         "ranks": [_rank_row(12.0), _rank_row(12.6)]},
        {"arm": "foldkv-split", "context": 32768, "batch": 8, "status": "ranks differ",
         "ranks": [_rank_row(13.0), _rank_row(0, status="failed: OutOfMemoryError")]}]}
    folded, split = decode_table_rows(result)
    assert folded["tpot_ms"] == 12.6 and folded["tpot_over_floor"] == pytest.approx(1.26)
    assert folded["decode_tokens_per_s"] == pytest.approx(8e3 / 12.6)
    assert "tpot_ms" not in split and split["status"] == "ranks differ"


def test_agreement_rows_beside_the_neutral_figure():
    from foldkv.lab.tp_model_decode import agreement_rows

    def run(world, folded, split, neutral):
        return {"world_size": world, "neutral_agreed_steps": neutral, "prefill": [
            {"arm": "foldkv-folded", "status": "ran", "ranks": [{"tokens": folded}]},
            {"arm": "foldkv-split", "status": "ran", "ranks": [{"tokens": split}]}]}

    rows = agreement_rows(run(1, [1, 2, 3, 4], [1, 2, 3, 5], 3), run(2, [1, 2, 3, 4], [1, 9, 3, 5], 1))
    got = {r["arm"]: r.get("agreed_with_tp1") for r in rows}
    assert got == {"foldkv-folded": 4, "foldkv-split": 1, "neutral: folded vs split (tp1)": 3,
                   "neutral: folded vs split (tp2)": 1}


def test_capacity_rows_a_rank_holds_its_share():
    require_module("transformers")
    from foldkv.lab.gemma31b import PARAMETERS_31B
    from foldkv.lab.tp_model_decode import capacity_rows, rank_weight_bytes

    assert rank_weight_bytes(1) == 2 * PARAMETERS_31B
    half = rank_weight_bytes(2)
    assert PARAMETERS_31B < half < PARAMETERS_31B * 1.001  # the norms stay whole on each rank
    rows = {(r["ranks"], r["arm"]): r for r in capacity_rows([1, 2], 131072, card_bytes=139 * 2**30,
                                                             margin_bytes=6 * 2**30)}
    for arm in ("foldkv-folded", "foldkv-fp8", "foldkv-split"):
        one, two = rows[(1, arm)], rows[(2, arm)]
        assert 2 * two["rank_kv_bytes_per_seq"] == one["rank_kv_bytes_per_seq"]
        assert two["largest_batch"] == (139 * 2**30 - half - 6 * 2**30) // two["rank_kv_bytes_per_seq"]
        assert one["per_cards"] == 2 * one["largest_batch"] and two["per_cards"] == two["largest_batch"]
    # notebook 05 ran 10 folded, 18 FP8, 6 split at 128K on one H200 (from the memory free after loading, a little
    # under card - weights): the arithmetic is within one sequence of that
    computed = [rows[(1, a)]["largest_batch"] for a in ("foldkv-folded", "foldkv-fp8", "foldkv-split")]
    assert all(0 <= c - m <= 1 for c, m in zip(computed, [10, 18, 6])), computed


def _gpu_section(tmp_path, monkeypatch, done):
    """Notebook 06's code cells up to its GPU section, run here with two CUDA devices pretended and `run_steps`
    answering `done`: what the section records from the runs' JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from foldkv.lab import tp_model_decode as tpd

    nb = json.loads(open(os.path.join(os.path.dirname(__file__), "..", "notebooks", "06_tensor_parallel.ipynb")).read())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    gpu = next(c for c in code if "tpd.gpu_steps" in c)
    ns: dict = {}
    exec(code[0], ns)
    ns["out_dir"] = str(tmp_path)
    exec(code[1], ns)
    ns["display"] = lambda *a, **k: None
    monkeypatch.setattr(plt, "show", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(tpd, "run_steps", lambda steps, out_dir, timeout_s: done)
    exec(gpu, ns)
    return ns["record"]


def _fake_runs(arms, contexts, batches):
    def rank(t):
        return {"status": "ran", "tpot_ms": t, "tpot_p90_ms": t + 1, "floor_ms": 9.0, "host_share": 0.01,
                "weight_bytes": 30.7e9, "kv_bytes": 8e9, "memory": {"peak": 60 * 2**30}}

    def prefill(world):
        return [{"arm": a, "status": "ran", "context": 1024, "batch": 1, "ranks": [{"tokens": list(range(16))}] * world}
                for a in arms]

    tp1 = {"world_size": 1, "neutral_agreed_steps": 16, "prefill": prefill(1), "decode": [], "largest": []}
    tp2 = {"world_size": 2, "neutral_agreed_steps": 12, "prefill": prefill(2),
           "decode": [{"arm": a, "context": n, "batch": b, "status": "ran", "ranks": [rank(11.0), rank(11.5)]}
                      for n in contexts for b in batches for a in arms],
           "largest": [{"arm": a, "context": 131072, "batch": 29, "status": "ran",
                        "ranks": [{"status": "ran", "largest_batch": 29, "computed_batch": 30}] * 2} for a in arms]}
    return tp1, tp2


def test_notebook_gpu_section_records_the_runs(tmp_path, monkeypatch):
    require_module("matplotlib")
    tp1, tp2 = _fake_runs(["foldkv-folded", "foldkv-fp8", "foldkv-split"], [32768, 131072], [8, 16])
    record = _gpu_section(tmp_path, monkeypatch, {"tp1": {"rc": 0, "seconds": 1.0, "result": tp1, "tail": ""},
                                                  "tp2": {"rc": 0, "seconds": 2.0, "result": tp2, "tail": ""}})
    assert record.sections["tp_31b"] == "ran"
    res = record.results["tp_31b"]
    assert len(res["decode"]) == 12 and all(r["tpot_ms"] == 11.5 for r in res["decode"])
    assert {r["arm"]: r.get("agreed_with_tp1") for r in res["agreement"]}["foldkv-folded"] == 16
    assert [r["largest_batch"] for r in res["largest"]] == [29, 29, 29]


def test_notebook_gpu_section_red_twin_a_failed_run_fails_it(tmp_path, monkeypatch):
    require_module("matplotlib")
    tp1, _ = _fake_runs(["foldkv-folded"], [32768], [8])
    record = _gpu_section(tmp_path, monkeypatch, {"tp1": {"rc": 0, "seconds": 1.0, "result": tp1, "tail": ""},
                                                  "tp2": {"rc": 1, "seconds": 2.0, "tail": "NCCL error"}})
    assert record.sections["tp_31b"].startswith("failed") and "NCCL error" in record.sections["tp_31b"]


@pytest.mark.parametrize("fits,everywhere,want", [(7, bool, 7), (7, lambda ok: False, None), (2, bool, None)])
def test_largest_batch_run_steps_down_after_out_of_memory(monkeypatch, fits, everywhere, want):
    """One sequence fewer after each out-of-memory from the computed batch (9), at most `tries` (4) batches; a batch
    counts only when `everywhere` says every process ran it (a TP rank out of memory: both step down)."""
    from foldkv.lab import model_decode as md

    tried = []

    def measure(model, arm_name, context, batch, **kw):
        tried.append(batch)
        if batch > fits:
            raise RuntimeError("CUDA out of memory")
        return {"arm": arm_name, "status": "ran", "context": context, "batch": batch, "tpot_ms": 30.0}

    monkeypatch.setattr(md, "largest_batch", lambda *a, **k: 9)
    monkeypatch.setattr(md, "measure_decode", measure)
    row = md.largest_batch_run(None, "foldkv-folded", 131072, free_bytes=1, margin_bytes=0, read_gbps=4000.0,
                               tries=4, everywhere=everywhere, log=lambda _: None)
    assert row["computed_batch"] == 9 and row.get("largest_batch") == want
    assert tried == ([9, 8, 7] if want else [9, 8, 7, 6])
