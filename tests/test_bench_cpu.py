"""The benchmark harness on the CPU: byte and FLOP model, statistics, arm interleaving and failure recording, the
accuracy check, JSON round trip, redraw selection, and notebooks/04_benchmarks.ipynb executed headless (cpu and
redraw modes) into a temp dir. No timing is asserted: CPU timings here only exercise the pipeline."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess

import pytest
import torch

from conftest import require_module
from foldkv import GEMMA4_31B
from foldkv.lab import byte_floor as floor
from foldkv.lab import bench
from foldkv.lab.arms import ArmUnavailable
from foldkv.lab.bench import ArmImpl
from foldkv.lab.jsonsafe import jsonable
from foldkv.layout import KvFormat
from foldkv.provenance import checkout_root

NOTEBOOK = os.path.join(checkout_root(), "notebooks", "04_benchmarks.ipynb")
HQ, HKV, D, R = 32, 4, 512, 128  # the 31B global layer, written out so the model is checked from first principles


# --- byte / FLOP model --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context", [1, 54, 10_602, 163_336])
def test_step_bytes_counts_pool_rows_query_and_outputs(context):
    folded = floor.step_bytes(GEMMA4_31B, "folded", [context])
    split = floor.step_bytes(GEMMA4_31B, "split", [context])
    assert folded["kv"] == context * HKV * (D + R) * 2
    assert split["kv"] == context * HKV * (2 * D) * 2
    assert folded["query"] == folded["out"] == HQ * D * 2 and folded["lse"] == HQ * 4
    assert folded["total"] == folded["kv"] + 2 * HQ * D * 2 + HQ * 4
    assert folded["kv"] * 8 == split["kv"] * 5  # 640 / 1024 columns


def test_step_bytes_of_a_ragged_batch_and_a_prefill_chunk():
    lens = [97, 16384, 54]
    b = floor.step_bytes(GEMMA4_31B, "folded", lens)
    assert b["kv"] == sum(lens) * HKV * 640 * 2 and b["query"] == 3 * HQ * D * 2
    p = floor.step_bytes(GEMMA4_31B, "split", [40_002], q_lens=[8192])
    assert p["query"] == p["out"] == 8192 * HQ * D * 2 and p["lse"] == 8192 * HQ * 4


@pytest.mark.parametrize("q_lens", [None, [0], [55]])
def test_step_bytes_refuses_queries_outside_their_request(q_lens):
    with pytest.raises(ValueError, match="q_len"):
        floor.step_bytes(GEMMA4_31B, "folded", [54] if q_lens else [], q_lens=q_lens)


@pytest.mark.parametrize("fmt", ["split", "folded"])
@pytest.mark.parametrize("context,batch", [(1, 1), (97, 3), (163_336, 1), (16_384, 32)])
def test_the_floor_and_the_benchmarks_count_the_same_bytes(fmt, context, batch):
    # One byte model: notebook 01's floor table, a benchmark cell's bytes and its % of roof are the same numbers.
    row = floor.decode_bytes(GEMMA4_31B, fmt, context, batch=batch, bandwidth_gbps=4000.0)
    parts = floor.step_bytes(GEMMA4_31B, fmt, [context] * batch)
    case = bench.AttentionCase([context] * batch, device="cpu", rotate_bytes=0, min_copies=1, max_copies=1)
    assert row.bytes_per_layer == parts["total"] == case.step_bytes(fmt)
    assert row.pool_bytes_per_layer == parts["kv"]
    assert row.io_bytes_per_layer == parts["query"] + parts["out"] + parts["lse"] == batch * HQ * (2 * D * 2 + 4)
    assert row.floor_us_per_layer == pytest.approx(parts["total"] / 4000e3)


@pytest.mark.parametrize("chunk,context", [(8192, 8192), (8192, 131_072), (97, 16384), (1, 54)])
def test_prefill_flops_matches_the_causal_count(chunk, context):
    # query i of the chunk sits at position context - chunk + i and attends to that many keys + 1
    keys = sum(context - chunk + i + 1 for i in range(chunk))
    exact = 4 * keys * HQ * D  # two matmuls x 2 FLOPs per multiply-add
    model = bench.prefill_flops(chunk, context)
    assert model == int(4 * chunk * (context - chunk / 2) * HQ * D)
    assert abs(model - exact) <= 4 * HQ * D * chunk / 2 + 1  # the formula drops the diagonal's half row


def test_prefill_flops_refuses_a_chunk_longer_than_its_context():
    with pytest.raises(ValueError):
        bench.prefill_flops(100, 54)


@pytest.mark.parametrize("context", [1, 64, 65, 163_336])
def test_pool_bytes_counts_whole_pages_per_layer(context):
    pages = -(-context // 64)
    assert floor.pool_bytes(GEMMA4_31B, "folded", context) == pages * 64 * HKV * 640 * 2
    assert floor.pool_bytes(GEMMA4_31B, "split", context, layers=10) == 10 * pages * 64 * HKV * 1024 * 2


def test_ragged_lengths_are_seeded_odd_and_within_the_spread():
    a = bench.ragged_lengths(32, 16384, seed=3)
    assert a == bench.ragged_lengths(32, 16384, seed=3) and a != bench.ragged_lengths(32, 16384, seed=4)
    assert len(a) == 32 and all(n % 2 == 1 and 4096 <= n <= 28673 for n in a)
    assert len(set(a)) > 16


# --- statistics ---------------------------------------------------------------------------------------------------
def test_summarize_median_percentiles_and_iqr():
    s = bench.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["n"] == 5 and s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 5.0 and s["mean"] == 3.0
    assert s["q1"] == 2.0 and s["q3"] == 4.0 and s["iqr"] == 2.0
    assert s["p10"] == pytest.approx(1.4) and s["p90"] == pytest.approx(4.6)
    assert bench.summarize([])["median"] is None


def test_paired_ratios_and_pct_of_roof():
    r = bench.paired_ratios([1.0, 2.0, 4.0], [2.0, 2.0, 12.0])
    assert r["median"] == 2.0 and r["min"] == 1.0 and r["max"] == 3.0
    assert bench.pct_of_roof(10**9, 1e6, 1.0) == pytest.approx(100.0)  # 1 GB in 1 s at a 1 GB/s roof
    assert bench.pct_of_roof(4_469 * 10**6, 2000.0, 4469.0) == pytest.approx(50.0)
    assert bench.pct_of_roof(1, None, 1.0) is None


# --- run_cell on the CPU: interleaving, failures, checks -----------------------------------------------------------
def _register(monkeypatch, name, build, *, fmt="folded", peer=False, generated=False):
    spec = bench.ArmSpec(name, name, fmt, peer, build, cpu_ok=True, generated=generated)
    monkeypatch.setitem(bench.DECODE_ARMS, name, spec)


def _torch_like(log, tag, scale=1.0):
    """An arm that computes the right answer (through the torch peer) and logs each call."""
    def build(case):
        inner = bench.torch_decode_arm(case.pools(KvFormat.SPLIT), case.query(KvFormat.SPLIT), case.table_cpu)

        def call(c):
            log.append(tag)
            c()
            if scale != 1.0:
                inner.out.mul_(scale)

        return ArmImpl([lambda c=c: call(c) for c in inner.calls], inner.out, graph=False)

    return build


def test_rounds_interleave_arms_with_alternating_order(monkeypatch):
    log: list[str] = []
    _register(monkeypatch, "a", _torch_like(log, "a"))
    _register(monkeypatch, "b", _torch_like(log, "b"))
    case = bench.AttentionCase([97], device="cpu", rotate_bytes=0, min_copies=1, max_copies=1)
    res = bench.run_cell("t", "decode", case, ["a", "b"], rounds=4, warmup=0, log=lambda s: None)
    # build-time: a's check call, then b's; then rounds a b | b a | a b | b a
    assert log == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    for n in ("a", "b"):
        assert res["arms"][n]["status"] == "ok" and res["arms"][n]["us"]["n"] == 4
        assert len(res["arms"][n]["samples_us"]) == 4
    assert set(res["speedup"]["a"]) == {"b"} and res["speedup"]["a"]["b"]["paired"]["n"] == 4


def test_failing_arms_are_recorded_and_the_others_still_run(monkeypatch):
    def missing(case):
        raise ArmUnavailable("flashinfer is not importable (test)")

    def broken(case):
        raise RuntimeError("kernel exploded")

    def import_error(case):
        raise ImportError("no module named foldkv.kernels.decode (test)")

    _register(monkeypatch, "missing", missing)
    _register(monkeypatch, "broken", broken)
    _register(monkeypatch, "importerr", import_error)
    case = bench.AttentionCase([54], device="cpu", rotate_bytes=0, min_copies=1, max_copies=1)
    res = bench.run_cell("t", "decode", case, ["missing", "broken", "importerr", "torch", "fi_tc", "nope"],
                         rounds=2, warmup=0, log=lambda s: None)
    arms = res["arms"]
    assert arms["missing"]["status"] == "not run" and "flashinfer is not importable" in arms["missing"]["reason"]
    assert arms["broken"]["status"] == "error" and "RuntimeError: kernel exploded" in arms["broken"]["reason"]
    assert arms["importerr"]["status"] == "not run"
    assert arms["fi_tc"]["status"] == "not run" and "CUDA" in arms["fi_tc"]["reason"]
    assert arms["nope"]["status"] == "not run" and "no decode arm named" in arms["nope"]["reason"]
    assert arms["torch"]["status"] == "ok" and arms["torch"]["check"]["ok"]
    table = bench.markdown_table({"cells": [res]}, "t")
    assert "kernel exploded" in table and "not run: flashinfer is not importable" in table


@pytest.mark.parametrize("seq_lens", [[54], [97, 130, 1]])
def test_torch_arms_on_split_and_folded_pools_agree_with_the_float32_reference(seq_lens):
    # Both pools are prepped from the same raw projections: a format mix-up or a wrong column map shows here.
    case = bench.AttentionCase(seq_lens, device="cpu", rotate_bytes=0, min_copies=1, max_copies=2)
    res = bench.run_cell("t", "decode", case, ["torch", "torch_folded"], rounds=1, warmup=0, log=lambda s: None)
    for n in ("torch", "torch_folded"):
        chk = res["arms"][n]["check"]
        assert chk["written"] and chk["ok"] and chk["rel_err"] < 2e-2, (n, chk)
        assert chk["rows_checked"] == len(seq_lens)
        assert chk["lse_written"] is None or chk["lse_max_abs_err"] < 1e-2, (n, chk)  # reported beside the output


def test_the_check_catches_unwritten_and_wrong_outputs(monkeypatch):
    log: list[str] = []
    _register(monkeypatch, "wrong", _torch_like(log, "w", scale=1.5))

    def lazy(case):
        out = torch.empty(len(case.seq_lens), HQ, D, dtype=torch.bfloat16)
        return ArmImpl([lambda: out[:, :, :8].zero_()], out, graph=False)  # writes only part of its output

    _register(monkeypatch, "lazy", lazy)
    case = bench.AttentionCase([97], device="cpu", rotate_bytes=0, min_copies=1, max_copies=1)
    res = bench.run_cell("t", "decode", case, ["wrong", "lazy"], rounds=1, warmup=0, log=lambda s: None)
    assert not res["arms"]["wrong"]["check"]["ok"] and res["arms"]["wrong"]["check"]["rel_err"] > 0.3
    assert not res["arms"]["lazy"]["check"]["written"] and not res["arms"]["lazy"]["check"]["ok"]
    assert "check failed" in res["arms"]["lazy"]["warning"]


def test_copies_rotate_past_the_l2():
    case = bench.AttentionCase([1024], device="cpu")  # default: 4 x 60 MB across the copies
    one = case.layout(KvFormat.FOLDED).nbytes
    n = case.copies_for(KvFormat.FOLDED)
    assert n * one >= bench.DEFAULT_ROTATE_BYTES and (n - 1) * one < bench.DEFAULT_ROTATE_BYTES
    big = bench.AttentionCase([163_336], device="cpu")
    # one copy is far past L2; still two, so no call re-reads the last one's pages
    assert big.copies_for(KvFormat.SPLIT) == 2


# --- JSON, verdicts, redraw ----------------------------------------------------------------------------------------
def _cell(name, context, arms: dict[str, tuple[list[float], dict]], kind="decode"):
    """A cell as run_cell writes it, from given samples (for the reading functions)."""
    cell = {"cell": name, "kind": kind, "context": context, "batch": 1, "seq_lens": [context], "arms": {},
            "speedup": {}}
    for n, (samples, meta) in arms.items():
        b = floor.step_bytes(GEMMA4_31B, meta["format"], [context])["total"]
        cell["arms"][n] = {"name": n, "status": "ok", "samples_us": samples, "us": bench.summarize(samples),
                           "bytes": b, "floor_us": b / 4000e3, "check": {"ok": True},
                           "pct_roof": bench.summarize([bench.pct_of_roof(b, s, 4000.0) for s in samples]), **meta}
    for a in arms:
        cell["speedup"][a] = {b: {"ratio_of_medians": cell["arms"][b]["us"]["median"] / cell["arms"][a]["us"]["median"],
                                  "paired": bench.paired_ratios(arms[a][0], arms[b][0])} for b in arms if b != a}
    return cell


def _doc(cells, *, device="NVIDIA H200", mode="gpu", created="2026-11-29T10:00:00+00:00", smoke=False):
    return {"schema": bench.SCHEMA, "created": created, "mode": mode, "params": {"smoke": smoke},
            "env": {"device_name": device}, "roof": {"read": {"gbps": 4000.0, "method": "triton_stream_sum"}},
            "cells": cells}


FOLDED = {"format": "folded", "generated": True, "peer": False}
PEER = {"format": "split", "generated": False, "peer": True}


def test_verdicts_and_conclusions_name_cells_where_folded_is_not_ahead():
    ahead = _cell("single/40002", 40_002, {"folded_jit": ([60.0, 61.0, 59.0], FOLDED), "fi_tc": ([90.0, 92.0, 91.0], PEER)})
    behind = _cell("sweep/1024", 1024, {"folded_jit": ([12.0, 12.5, 11.8], FOLDED), "fi_tc": ([9.0, 9.1, 9.2], PEER)})
    doc = _doc([ahead, behind])
    v = {x["cell"]: x for x in bench.verdicts(doc)}
    assert [e["peer"] for e in v["single/40002"]["ahead"]] == ["fi_tc"] and not v["single/40002"]["behind"]
    (e,) = v["sweep/1024"]["behind"]
    assert e["peer"] == "fi_tc" and e["speedup"] < 1 and "byte floor" in e["reason"]
    text = "\n".join(bench.conclusions(doc))
    assert "single/40002" in text and "ahead of fi_tc 1.5" in text
    assert "sweep/1024" in text and "NOT ahead of fi_tc" in text


def test_results_round_trip_through_strict_json(tmp_path):
    doc = _doc([_cell("single/54", 54, {"folded_jit": ([3.0, 3.5], FOLDED)})])
    doc["cells"][0]["arms"]["folded_jit"]["check"]["rel_err"] = float("nan")  # NaN must become null, not 'NaN'
    path = bench.save_results(doc, tmp_path / "r" / bench.RESULTS_NAME)
    text = open(path).read()
    assert "NaN" not in text
    back = bench.load_results(path)
    assert back["cells"][0]["arms"]["folded_jit"]["check"]["rel_err"] is None
    assert back["cells"][0]["arms"]["folded_jit"]["us"] == doc["cells"][0]["arms"]["folded_jit"]["us"]
    with pytest.raises(ValueError):
        bench.load_results(bench.save_results({"schema": "other"}, tmp_path / "x.json"))


def test_find_results_picks_the_newest_full_h200_gpu_run(tmp_path):
    cell = [_cell("single/54", 54, {"folded_jit": ([3.0], FOLDED)})]
    for tag, kw in {"a": {}, "b": {"created": "2026-11-29T12:00:00+00:00"},
                    "c": {"created": "2026-11-30T00:00:00+00:00", "smoke": True},
                    "d": {"created": "2026-11-30T00:00:00+00:00", "mode": "cpu", "device": "CPU"},
                    "e": {"created": "2026-11-30T00:00:00+00:00", "device": "NVIDIA H100"}}.items():
        bench.save_results(_doc(cell, **kw), tmp_path / tag / bench.RESULTS_NAME)
    found = bench.find_results("*/04_benchmarks.json", root=str(tmp_path))
    assert found["path"].endswith(os.path.join("b", bench.RESULTS_NAME)) and not found["committed"]
    assert bench.find_results("nothing/*.json", root=str(tmp_path)) is None
    assert "nothing to redraw" in bench.redraw_banner(None, "nothing/*.json")
    assert "REDRAWING" in bench.redraw_banner(found, "x") and "NOT committed" in bench.redraw_banner(found, "x")


def test_committed_runs_win_and_are_never_overwritten(tmp_path):
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git is not installed")
    root = str(tmp_path)
    subprocess.run(["git", "init", "-q", root], check=True)
    cell = [_cell("single/54", 54, {"folded_jit": ([3.0], FOLDED)})]
    bench.save_results(_doc(cell, created="2026-11-01T00:00:00+00:00"), tmp_path / "old" / bench.RESULTS_NAME)
    bench.save_results(_doc(cell, created="2026-11-29T00:00:00+00:00"), tmp_path / "new" / bench.RESULTS_NAME)
    subprocess.run(["git", "-C", root, "add", "old"], check=True)  # tracked in this temp repo only
    found = bench.find_results("*/04_benchmarks.json", root=root)
    assert found["committed"] and found["path"].endswith(os.path.join("old", bench.RESULTS_NAME))
    path, why = bench.results_path("old", root=root)
    assert "_scratch" in path and "never overwritten" in why
    path, why = bench.results_path("new", root=root)
    assert path == os.path.join(root, "new", bench.RESULTS_NAME)


# --- the notebook, headless -----------------------------------------------------------------------------------------
SMALL = {"single_lengths": [97], "sweep_lengths": [54, 130], "batch_cases": ["uniform8"],
         "drawn_shapes": ["mixed"], "drawn_singles": 1, "draw_seed": 5,
         "prefill_chunk": 16, "prefill_contexts": [70], "rounds": 2, "prefill_rounds": 1, "warmup": 0,
         "decode_arms": ["fi_cuda", "torch", "torch_folded", "folded_jit", "read_folded"]}


def _papermill(out_nb, params):
    require_module("papermill")
    require_module("ipykernel")
    require_module("matplotlib")
    import papermill

    papermill.execute_notebook(NOTEBOOK, str(out_nb), parameters=params, kernel_name="python3",
                               cwd=os.path.dirname(NOTEBOOK), progress_bar=False)
    nb = json.load(open(out_nb))
    return "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                     + "".join(o.get("data", {}).get("text/markdown", ""))
                     for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("nb04")
    text = _papermill(d / "cpu.ipynb", {"mode": "cpu", "out_dir": str(d / "run"), **SMALL})
    return d, text, bench.load_results(d / "run" / bench.RESULTS_NAME)


@pytest.mark.slow
def test_notebook_cpu_mode_records_every_cell_and_arm(cpu_run):
    _, text, doc = cpu_run
    assert "NOT a benchmark" in text and doc["mode"] == "cpu"
    names = [c["cell"] for c in doc["cells"]]
    assert names[:4] == ["single/97", "sweep/54", "sweep/130", "batch/uniform8"]
    assert doc["cells"][3]["seq_lens"] == bench.serving_cases(0, ["uniform8"], scale=1 / 128)["uniform8"]
    # the drawn cells, as `draw_seed` draws them (shrunk like the serving cases), and the seed recorded
    mixed, singles = bench.draw_batches(5, ["mixed"], scale=1 / 128)["mixed"], bench.draw_singles(5, 1, scale=1 / 128)
    assert names[4:7] == ["drawn/mixed"] + [f"drawn_single/{n}" for n in singles]
    assert doc["cells"][4]["seq_lens"] == mixed and doc["draws"]["seed"] == 5 and doc["params"]["draw_seed"] == 5
    assert "drawn cells: seed 5" in text and "| every drawn batch | drawn/mixed |" in text
    assert "| batch/uniform8 | 8 |" in text  # the plan model's table
    assert names[7] == "prefill/16@70"
    for c in doc["cells"][:4]:
        assert c["arms"]["torch"]["status"] == "ok" and c["arms"]["torch"]["check"]["ok"], c["arms"]["torch"]
        assert c["arms"]["torch_folded"]["check"]["ok"]
        assert c["arms"]["fi_cuda"]["status"] == "not run" and c["arms"]["folded_jit"]["status"] == "not run"
        assert c["arms"]["read_folded"]["status"] == "not run" and "CUDA" in c["arms"]["read_folded"]["reason"]
        assert c["arms"]["torch"]["us"]["n"] == 2
        assert c["bytes"]["folded"] == floor.step_bytes(GEMMA4_31B, "folded", c["seq_lens"])["total"]
        assert c["arms"]["torch_folded"]["bytes"] == c["bytes"]["folded"]
    prefill = doc["cells"][7]
    assert prefill["flops"] == bench.prefill_flops(16, 70) and prefill["q_lens"] == [16]
    assert doc["roof"]["read"]["gbps"] > 0 and "read_end" in doc["roof"]
    assert doc["conclusions"] == bench.conclusions(doc)  # computed from the data, not typed
    assert any("fi_cuda: not run" in s for s in doc["conclusions"])
    # the targets table: the batch case is a target row; no generated arm runs on the CPU, and the table says so
    assert "| target case | cell |" in text and "| batch/uniform8 | – (no folded arm ran and passed its check)" in text
    assert ("batch/uniform8: folded vs plain read, folded vs FlashInfer TC not measured: no folded arm ran and passed"
            " its check.") in doc["conclusions"]


@pytest.mark.slow
def test_notebook_redraws_without_a_gpu_and_says_so(cpu_run, tmp_path):
    d, _, doc = cpu_run
    # an H200-looking copy of the CPU run in a runs folder: auto mode on this CPU machine must pick it and say so
    fake = dict(doc, mode="gpu", env=dict(doc["env"], device_name="NVIDIA H200 (test copy)"))
    bench.save_results(fake, tmp_path / "runs" / "t1" / bench.RESULTS_NAME)
    if torch.cuda.is_available():
        pytest.skip("auto mode measures on a machine with CUDA")
    text = _papermill(tmp_path / "redraw.ipynb", {"mode": "auto", "results_glob": str(tmp_path / "runs" / "*" / bench.RESULTS_NAME),
                                                  "out_dir": str(tmp_path / "out"), **SMALL})
    assert "REDRAWING" in text and "H200 results" in text and "NOT committed" in text
    assert "MEASURING" not in text
    record = json.load(open(tmp_path / "out" / "04_benchmarks.redraw.json"))
    assert record["mode"] == "redraw" and record["source"].endswith(os.path.join("t1", bench.RESULTS_NAME))
    assert record["conclusions"] == bench.conclusions(bench.load_results(record["source"]))
    empty = _papermill(tmp_path / "none.ipynb", {"mode": "redraw", "results_glob": str(tmp_path / "nothing" / "*.json")})
    assert "nothing to redraw" in empty and "no results to plot" in empty


def test_a_run_resumes_the_cells_of_an_earlier_one(tmp_path):
    earlier = _doc([_cell("single/54", 54, {"folded_jit": ([3.0], FOLDED)}),
                    _cell("sweep/97", 97, {"folded_jit": ([4.0], FOLDED)})])
    path = bench.save_results(earlier, tmp_path / bench.RESULTS_NAME)
    run = bench.BenchRun("cpu", mode="cpu", params={})
    assert run.resume(path) == 2
    run.cell("sweep/97", "decode", [97], ["torch"], rounds=1, warmup=0, case_kw=dict(rotate_bytes=0, min_copies=1))
    assert [c["cell"] for c in run.cells] == ["single/54", "sweep/97"]
    assert run.cells[0]["from_run"] == earlier["created"] and "from_run" not in run.cells[1]
    assert run.cells[1]["arms"]["torch"]["status"] == "ok"
    assert run.results["resumed_from"][0]["cells"] == 2


@pytest.mark.parametrize("kind,arm", [("decode", "folded_jit"), ("decode", "split_jit"), ("prefill", "folded_jit"),
                                      ("prefill", "split_jit")])
def test_generated_arms_pass_the_launchers_checks_up_to_the_device(kind, arm):
    # On the CPU the launchers refuse only at their last check, the device: every argument the harness builds
    # (pool copies, query, table, plan, guarded out/lse views, check=False calls) got past all the others.
    from foldkv import FoldKvInputError

    lens, q_lens = ([97, 130, 1000], None) if kind == "decode" else ([500], [64])
    case = bench.AttentionCase(lens, q_lens=q_lens, device="cpu", rotate_bytes=0, min_copies=1, max_copies=1)
    registry = bench.DECODE_ARMS if kind == "decode" else bench.PREFILL_ARMS
    try:
        impl = registry[arm].build(case)
    except ArmUnavailable as exc:
        pytest.skip(str(exc))
    for call in impl.calls + (impl.timed_calls or []):
        with pytest.raises(FoldKvInputError, match="CUDA"):
            call()


def test_an_arm_failing_mid_rounds_is_recorded_and_dropped(monkeypatch):
    log: list[str] = []
    good = _torch_like(log, "g")

    def flaky(case):
        impl = good(case)
        calls = {"n": 0}
        inner = impl.calls[0]

        def call():
            calls["n"] += 1
            if calls["n"] > 2:  # the check and the first round pass, then it fails
                raise RuntimeError("launch failed (test)")
            inner()

        return ArmImpl([call], impl.out, graph=False)

    _register(monkeypatch, "flaky", flaky)
    case = bench.AttentionCase([54], device="cpu", rotate_bytes=0, min_copies=1, max_copies=1)
    res = bench.run_cell("t", "decode", case, ["flaky", "torch"], rounds=3, warmup=0, log=lambda s: None)
    assert res["arms"]["flaky"]["status"] == "error" and "failed while timing" in res["arms"]["flaky"]["reason"]
    assert res["arms"]["torch"]["status"] == "ok" and res["arms"]["torch"]["us"]["n"] == 3
    assert "flaky" not in res["speedup"] and res["speedup"]["torch"] == {}


# --- the float64 reference rows, JSON, roofs without a GPU -----------------------------------------------------------
def test_reference_rows_are_the_full_paged_reference_at_those_rows():
    # A sampled row is asked as a one-query request over its prefix: it must be the chunk's own causal answer.
    from foldkv import paged_attention_reference

    case = bench.AttentionCase([130, 300], q_lens=[70, 150], device="cpu", rotate_bytes=0, min_copies=1,
                               max_copies=1)
    ref = case.reference()
    assert ref["rows"].numel() == bench.case.CHECK_ROWS and ref["out"].dtype == torch.float64
    full, _ = paged_attention_reference(case.pools(KvFormat.SPLIT)[0], case.query(KvFormat.SPLIT), case.table_cpu,
                                        torch.tensor(case.q_lens))
    torch.testing.assert_close(ref["out"], full[ref["rows"]], rtol=1e-12, atol=1e-12)  # float64: summation order only
    assert not torch.allclose(ref["out"], full[ref["rows"].roll(1)], rtol=1e-3)  # the rows are not interchangeable


def test_jsonable_makes_strict_json():
    import enum

    import numpy as np

    from foldkv import KvFormat

    class Color(enum.Enum):
        RED = "red"

    doc = {"nan": float("nan"), "inf": [float("-inf"), 1.5], "t": torch.tensor([[1.0, float("nan")]]),
           "scalar": torch.tensor(3), "np": np.float32(2.5), "arr": np.arange(3), "fmt": KvFormat.FOLDED,
           Color.RED: (1, "a"), 7: None, "dtype": torch.bfloat16}
    got = jsonable(doc)
    assert got == {"nan": None, "inf": [None, 1.5], "t": [[1.0, None]], "scalar": 3, "np": 2.5, "arr": [0, 1, 2],
                   "fmt": "folded", "red": [1, "a"], "7": None, "dtype": "torch.bfloat16"}
    json.dumps(got, allow_nan=False)
    with pytest.raises(ValueError):
        json.dumps(doc["inf"], allow_nan=False)  # what jsonable is for: the raw document is not strict JSON


def test_committed_read_roof_names_the_run_it_came_from(tmp_path):
    with pytest.raises(LookupError, match="no full H200"):
        bench.committed_read_roof("runs/*/04_benchmarks.json", root=str(tmp_path))
    doc = _doc([])
    doc["roof"]["read"]["gbps"] = 4321.0
    bench.save_results(doc, tmp_path / "runs" / "h200-x" / bench.RESULTS_NAME)
    smoke = dict(_doc([], created="2026-12-01T00:00:00+00:00", smoke=True))
    smoke["roof"] = {"read": {"gbps": 1.0, "method": "torch_sum"}}
    bench.save_results(smoke, tmp_path / "runs" / "h200-smoke" / bench.RESULTS_NAME)  # never a smoke run's roof
    roof = bench.committed_read_roof("runs/*/04_benchmarks.json", root=str(tmp_path))
    assert roof["gbps"] == 4321.0 and roof["run"] == "h200-x" and "h200-x" in roof["said"]
    assert "4,321 GB/s" in roof["said"] and "NOT committed" in roof["said"]


def test_committed_read_roof_is_notebook_01s_run_of_record_by_the_index(tmp_path):
    runs = tmp_path / "papermill_runs"
    (runs / "h200-a").mkdir(parents=True)
    path = runs / "h200-a" / "01_byte_floor.record.json"

    def index(record: dict, commit: str = "abc1234") -> None:  # the record, and the index naming its commit and bytes
        path.write_text(json.dumps(record))
        digest = bench.results.files_digest(str(runs / "h200-a"), ("01_byte_floor.record.json",))[:16]
        (runs / "README.md").write_text("# runs\n\n## Runs of record\n\n| notebook | run of record | commit | sha256 | what |\n"
                                        f"| --- | --- | --- | --- | --- |\n| 01_byte_floor | h200-a | {commit} | {digest} | the roof |\n")

    made_at = {"provenance": {"git_commit": "abc1234" + "0" * 33, "dirty": False}}
    index({"results": {"measure_bandwidth": {"gbps": 4444.0, "method": "triton_stream_sum"}}, **made_at})
    roof = bench.committed_read_roof(root=str(tmp_path))
    assert roof["gbps"] == 4444.0 and roof["run"] == "h200-a" and "measured by run h200-a" in roof["said"]
    index({"results": {}, **made_at})  # red twin: no roof
    with pytest.raises(LookupError, match="no read roof"):
        bench.committed_read_roof(root=str(tmp_path))
    index({"results": {"measure_bandwidth": {"gbps": 4444.0}}, **made_at}, commit="def5678")  # red twin: not its commit
    with pytest.raises(bench.results.RecordMismatchError, match="made at commit abc1234"):
        bench.committed_read_roof(root=str(tmp_path))


def test_the_stream_read_arm_needs_cuda():
    with pytest.raises(ArmUnavailable, match="CUDA"):
        bench.stream_read_arm(1 << 20, "cpu", copies=2)


# --- the serving cases, the plain-read arm's memory, the decode targets --------------------------------------------
def test_serving_cases_are_seeded_and_hold_their_sizes_and_ranges():
    cases = bench.serving_cases(0)
    assert list(cases) == list(bench.SERVING_CASES)
    assert {n: len(v) for n, v in cases.items()} == {"uniform8": 8, "uniform32": 32, "uniform64": 64,
                                                       "uniform128": 128, "longtail64": 64}
    for n in ("uniform8", "uniform32", "uniform64", "uniform128"):
        assert all(1024 <= x <= 48 * 1024 for x in cases[n]), n
        assert len(set(cases[n])) > len(cases[n]) // 2, f"{n}: lengths are not spread"
    tail = cases["longtail64"]
    long_ = [x for x in tail if x >= 65536]
    assert len(long_) == 64 // 10 + 1 and all(x <= 200_000 for x in long_)  # one in ten (requests 0, 10, ..., 60)
    assert all(1 <= x <= 4096 for x in tail if x < 65536)
    assert cases == bench.serving_cases(0) and cases != bench.serving_cases(1)
    # a case's lengths depend on the seed only, not on which other cases are asked for
    assert bench.serving_cases(0, ["longtail64"]) == {"longtail64": tail}


def test_serving_cases_shrink_for_the_cpu_and_refuse_unknown_names():
    small = bench.serving_cases(0, ["uniform128", "longtail64"], scale=1 / 128)
    full = bench.serving_cases(0, ["uniform128", "longtail64"])
    assert all(len(small[n]) == len(full[n]) for n in small)
    assert max(max(v) for v in small.values()) <= 200_000 // 128 and min(min(v) for v in small.values()) >= 1
    with pytest.raises(ValueError, match="unknown serving case.*'uniform7'.*uniform8"):
        bench.serving_cases(0, ["uniform7"])
    with pytest.raises(ValueError, match="scale"):
        bench.serving_cases(0, scale=0)


def test_plan_harness_measures_the_lab_serving_cases():
    import importlib.util
    import sys

    bench_dir = os.path.join(checkout_root(), "bench")
    sys.path.insert(0, bench_dir)  # the harness imports bench/versions/
    try:
        spec = importlib.util.spec_from_file_location("plan_harness", os.path.join(bench_dir, "plan_harness.py"))
        harness = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(harness)
    finally:
        sys.path.remove(bench_dir)
    cases = harness.cases()
    assert {n: cases[n] for n in bench.SERVING_CASES} == bench.serving_cases(0)
    # a drawn batch of notebook 04 comes back from its seed (s20's short_many: 171 requests of 67-8,178 tokens)
    drawn = harness.cases(draw_seeds=[920385503], draw_shapes=["short_many"])
    many = drawn["drawn920385503/short_many"]
    assert (len(many), min(many), max(many)) == (171, 67, 8178)
    assert drawn["drawn920385503/short_many"] == bench.draw_batches(920385503, ["short_many"])["short_many"]
    assert harness.cap_arm(KvFormat.FOLDED, 32).name == "folded_cap32"
    sys.path.insert(0, bench_dir)  # --two-ctas takes fp8_harness's arm (bench/)
    try:
        two = harness.two_cta_arm()
    finally:
        sys.path.remove(bench_dir)
    assert two.name == "folded_2cta_w264" and two.format == "folded"
    # the 31B step's global-layer shapes: notebook 05's 4K and 32K contexts and a few generated tokens
    assert {n: cases[n] for n in ("step4k_x1", "step4k_x8", "step32k_x1")} == {
        "step4k_x1": [4100], "step4k_x8": [4100] * 8, "step32k_x1": [32772]}
    # runs 22 and 22b's commands (DECODE_NOTES) name cases the harness has, with the flag it parses
    notes = open(os.path.join(checkout_root(), "bench", "DECODE_NOTES.md")).read()
    for run in ("22", "22b"):
        section = notes[notes.index(f"## Run {run}: prediction"):]
        cmd = re.search(r"python plan_harness\.py (.*)", section).group(1).split()
        only = cmd[cmd.index("--only") + 1:cmd.index("--two-ctas")]
        assert set(only) <= set(harness.cases(draw_seeds=[920385503])), (run, only)
    assert "step4k_x8" in only
    with pytest.raises(SystemExit, match="unknown cases"):  # a case the harness lacks stops it before the GPU
        harness.bench(1, None, ["step4k_x9"])


@pytest.mark.parametrize("nbytes, copies, cap, want_buffers, want_buffer_bytes", [
    (10 * 8192, 3, 1 << 20, 3, 10 * 8192),  # every copy fits: rotated as asked
    (10 * 8192, 3, 25 * 8192, 2, 10 * 8192),  # two whole copies fit
    (10 * 8192 + 5, 3, 4 * 8192, 1, 4 * 8192),  # not one copy fits: one capped buffer, read around
])
def test_stream_read_buffers_stay_within_their_cap(nbytes, copies, cap, want_buffers, want_buffer_bytes):
    bufs, n_blocks = bench.stream_read_buffers(nbytes, "cpu", copies, max_bytes=cap)
    held = sum(b.numel() * b.element_size() for b in bufs)
    assert held <= cap, f"{held} bytes of buffers past the cap {cap}"
    assert (len(bufs), bufs[0].numel() * 2) == (want_buffers, want_buffer_bytes)
    assert all(b.dtype == torch.bfloat16 for b in bufs)  # drawn in bf16: no float32 draft twice the size
    assert n_blocks * 8192 >= nbytes > (n_blocks - 1) * 8192  # a call still reads the whole byte count
    assert bool(bufs[0].float().abs().sum() > 0)


def test_stream_read_buffers_refuse_a_cap_below_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        bench.stream_read_buffers(1 << 20, "cpu", 2, max_bytes=8191)
    with pytest.raises(ValueError, match="bytes > 0"):
        bench.stream_read_buffers(0, "cpu", 2)


READ = {"format": "folded", "generated": False, "peer": False}
SPLIT = {"format": "split", "generated": True, "peer": False}


def _target_cell(name, context, folded, read, fi_tc, split, batch=1):
    arms = {"folded_jit": ([folded] * 3, FOLDED), "fi_tc": ([fi_tc] * 3, PEER), "split_jit": ([split] * 3, SPLIT)}
    if read is not None:
        arms["read_folded"] = ([read] * 3, READ)
    return dict(_cell(name, context, arms), batch=batch)


def test_decode_targets_are_computed_per_cell_met_and_not_met():
    doc = _doc([
        _target_cell("batch/uniform64", 48_000, folded=105.0, read=100.0, fi_tc=160.0, split=150.0, batch=64),  # met
        _target_cell("batch/longtail64", 200_000, folded=112.0, read=100.0, fi_tc=160.0, split=150.0, batch=64),
        _target_cell("single/131072", 131_072, folded=104.0, read=100.0, fi_tc=150.0, split=160.0),  # FI TC 1.44x
        _target_cell("single/40002", 40_002, folded=55.0, read=50.0, fi_tc=95.0, split=96.0),  # split 0.99x FI TC
        _target_cell("sweep/65536", 65_536, folded=60.0, read=50.0, fi_tc=95.0, split=94.0),  # no target: no row
        _target_cell("batch/4x28000", 28_000, folded=60.0, read=50.0, fi_tc=95.0, split=94.0, batch=4),  # old case
    ])
    rows = {r["cell"]: r for r in bench.target_rows(doc)}
    assert list(rows) == ["batch/uniform64", "batch/longtail64", "single/131072", "single/40002"]
    assert rows["batch/uniform64"]["met"] is True and rows["batch/uniform64"]["x_read"]["value"] == pytest.approx(1.05)
    bad = rows["batch/longtail64"]  # red twins: each bound missed by one cell
    assert bad["met"] is False and bad["x_read"]["met"] is False and bad["x_read"]["bound"] == 1.10
    assert rows["single/131072"]["folded_x_fi_tc"]["met"] is False and rows["single/131072"]["x_read"]["met"] is True
    assert rows["single/40002"]["split_x_fi_tc"]["met"] is False and rows["single/40002"]["x_read"]["bound"] == 1.20
    table = bench.targets_markdown(doc)
    assert "| batch/uniform64 | 1.05x (≤ 1.10: met)" in table and "1.12x (≤ 1.10: NOT met)" in table
    assert "no cell of this case in this run" in table and "one request at 10.6K" in table
    text = "\n".join(bench.conclusions(doc))
    assert "Decode targets: 1 of 4 decode cells meet all three" in text
    assert "single/131072: folded vs FlashInfer TC 1.44x, target ≥ 1.55" in text


def test_decode_targets_say_when_a_run_has_no_plain_read_arm():
    doc = _doc([_target_cell("single/10602", 10_602, folded=25.0, read=None, fi_tc=36.0, split=31.0)])
    (row,) = bench.target_rows(doc)
    assert row["x_read"]["met"] is None and row["x_read"]["why"] == "no plain-read arm in this run"
    assert row["met"] is None and row["folded_x_fi_tc"]["met"] is True  # 1.44x >= 1.4
    assert "– (no plain-read arm in this run)" in bench.targets_markdown(doc)
    assert "No cell of the decode targets' cases" in bench.targets_markdown(_doc([]))
    failed = _doc([{"cell": "batch/uniform128", "kind": "decode", "batch": 128, "context": 49_000, "arms": {},
                    "speedup": {}, "error": "OutOfMemoryError: CUDA out of memory"}])
    (row,) = bench.target_rows(failed)
    assert row["met"] is None and all("the cell failed: OutOfMemoryError" in row[k]["why"]
                                      for k in ("x_read", "folded_x_fi_tc", "split_x_fi_tc"))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_flashinfer_e4m3_pool_and_its_reference(kv_layout, monkeypatch):
    """FlashInfer's e4m3 split pool (per-tensor scales) dequantizes back to the bf16 truth within e4m3's error with
    per-tensor scales (measured 4.6% relative here; the arm's check tolerance is CHECK_REL_TOL on its own reference),
    the same for both FlashInfer layouts; swapped K / V scales (the red twin) move it far off."""
    from foldkv.lab.bench.case import AttentionCase

    case = AttentionCase([100, 37], device="cpu", fi_kv_layout=kv_layout)
    truth = case.reference("split")["out"]
    got = case.reference("split_fp8")["out"]
    assert float((got - truth).norm() / truth.norm()) < 0.1
    copies, ks, vs = case.flashinfer_kv_fp8()
    assert copies[0].dtype == torch.float8_e4m3fn and ks > 0 and vs > 0
    swapped = AttentionCase([100, 37], device="cpu", fi_kv_layout=kv_layout)
    swapped._fi_fp8 = (copies, vs * 8, ks)
    bad = swapped.reference("split_fp8")["out"]
    assert float((bad - truth).norm() / truth.norm()) > 0.3


def _fp8_decode_cell(name, context, fp8_us, *, batch=1, read_us=None, fi_us=None):
    """A decode cell with bf16 folded at 1,000 us, the FP8 folded arm at `fp8_us`, its plain read at `read_us` (by
    default fp8_us / 1.3) and FlashInfer's e4m3 decode at `fi_us` (by default 2.1 x fp8_us)."""
    cell = _cell(name, context, {"folded_jit": ([1000.0] * 3, FOLDED), "folded_fp8_jit": ([fp8_us] * 3, FOLDED),
                                 "read_folded_fp8": ([read_us or fp8_us / 1.3] * 3, FOLDED),
                                 "fi_tc_fp8": ([fi_us or 2.1 * fp8_us] * 3, PEER)})
    for arm in ("folded_fp8_jit", "read_folded_fp8"):
        cell["arms"][arm]["format"] = "folded_fp8"
    cell["batch"] = batch
    return cell


@pytest.mark.parametrize("name, context, batch, bound, fi_bound", [
    ("single/163336", 163_336, 1, 0.66, 2.0), ("sweep/131072", 131_072, 1, 0.66, 2.0),
    ("batch/uniform8", 34_530, 8, 0.68, 2.0), ("drawn/short_many", 8_178, 171, 0.68, 2.0),
    ("single/40002", 40_002, 1, 0.78, 1.8), ("drawn_single/65499", 65_499, 1, 0.78, 1.8)],
    ids=["163336", "131072", "uniform8", "drawn-batch", "40002", "drawn-65499"])
def test_fp8_decode_targets_by_case(name, context, batch, bound, fi_bound):
    """Each cell takes its case's bounds (the FP8 tensor-core decode's targets): met just under the FP8 / bf16 bound
    with FlashInfer just over its bound; red twins: 1% over the bf16 bound, and FlashInfer 1% under its bound."""
    def row(**kw):
        (r,) = bench.fp8_target_rows(_doc([_fp8_decode_cell(name, context, batch=batch, **kw)]))
        return r
    good = row(fp8_us=1000.0 * bound * 0.99, fi_us=1000.0 * bound * 0.99 * fi_bound * 1.01)
    assert good["met"] is True and good["x_bf16"]["bound"] == bound and good["fi_fp8_x"]["bound"] == fi_bound
    assert row(fp8_us=1000.0 * bound * 1.01)["met"] is False
    assert row(fp8_us=1000.0 * bound * 0.99, fi_us=1000.0 * bound * 0.99 * fi_bound * 0.99)["met"] is False
    assert ("x_read" in good) is (context >= 81_000 and batch == 1)  # the read bound: single requests of 81K+ only


def test_fp8_decode_targets_hold_the_read_at_81k_and_skip_small_cells():
    """At 81K and more FP8 / its plain read is a target (at most 1.40x; red twin 1.45x); a 40K request reports it; a
    batch of 4 and a 10,602-token request are no FP8 target's cells."""
    (r,) = bench.fp8_target_rows(_doc([_fp8_decode_cell("single/81653", 81_653, 600.0, read_us=600.0 / 1.39)]))
    assert r["met"] is True and r["x_read"]["bound"] == 1.40
    (r,) = bench.fp8_target_rows(_doc([_fp8_decode_cell("single/81653", 81_653, 600.0, read_us=600.0 / 1.45)]))
    assert r["met"] is False
    (r,) = bench.fp8_target_rows(_doc([_fp8_decode_cell("single/40002", 40_002, 700.0, read_us=700.0 / 1.9)]))
    assert "x_read" not in r and r["x_read_reported"] == pytest.approx(1.9) and r["met"] is True
    assert "(reported)" in bench.fp8_targets_markdown(_doc([_fp8_decode_cell("single/40002", 40_002, 700.0)]))
    small = [_fp8_decode_cell("batch/four", 8_000, 600.0, batch=4), _fp8_decode_cell("single/10602", 10_602, 600.0)]
    assert bench.fp8_target_rows(_doc(small)) == []


@pytest.mark.parametrize("fp8_us", [900.0, 1100.0], ids=["faster", "slower"])
def test_fp8_prefill_target(fp8_us):
    """The FP8 prefill target's row: the FP8 folded prefill against the best bf16 folded prefill arm (never against
    itself: its format is folded_fp8), met only when it is no slower; the slower case is the red twin."""
    cell = _cell("prefill/8192@32768", 32768, {"folded_jit": ([1000.0] * 3, FOLDED),
                                               "folded_fp8_jit": ([fp8_us] * 3, FOLDED)}, kind="prefill")
    cell["arms"]["folded_fp8_jit"]["format"] = "folded_fp8"
    rows = bench.fp8_prefill_rows(_doc([cell]))
    assert len(rows) == 1 and rows[0]["us"] == {"fp8": fp8_us, "bf16_folded": 1000.0, "fp8_in_kernel": None}
    assert rows[0]["met"] is (fp8_us <= 1000.0) and rows[0]["in_kernel_x_bf16"] is None
    assert ("NOT met" in bench.fp8_targets_markdown(_doc([cell]))) is (fp8_us > 1000.0)


def test_fp8_prefill_target_is_best_build_against_best_build():
    """Both sides take their best build (JIT, AOT) that ran and passed: the FP8 AOT build at 990 us against the bf16
    AOT build at 995 is met though the FP8 JIT build (1,010 us) is slower than either bf16 build. Red twin: with the
    FP8 AOT build failing its check, the row is its JIT build's, 1,010 / 995: NOT met."""
    arms = {"folded_jit": ([1000.0] * 3, FOLDED), "folded_aot": ([995.0] * 3, FOLDED),
            "folded_fp8_jit": ([1010.0] * 3, FOLDED), "folded_fp8_aot": ([990.0] * 3, FOLDED)}
    cell = _cell("prefill/8192@32768", 32768, arms, kind="prefill")
    for arm in ("folded_fp8_jit", "folded_fp8_aot"):
        cell["arms"][arm]["format"] = "folded_fp8"
    (row,) = bench.fp8_prefill_rows(_doc([cell]))
    assert (row["fp8_arm"], row["bf16_arm"], row["met"]) == ("folded_fp8_aot", "folded_aot", True)
    assert row["x_bf16"]["value"] == pytest.approx(990 / 995)
    cell["arms"]["folded_fp8_aot"]["check"]["ok"] = False
    (row,) = bench.fp8_prefill_rows(_doc([cell]))
    assert (row["fp8_arm"], row["met"]) == ("folded_fp8_jit", False)
    assert row["x_bf16"]["value"] == pytest.approx(1010 / 995)


def test_fp8_prefill_in_kernel_arm_is_reported_not_gated():
    """The in-kernel FP8 prefill's ratio sits beside the target row; a slow one does not fail a met target, and the
    target is never taken from it (its red twin: with the default FP8 arm missing the row is not met)."""
    arms = {"folded_jit": ([1000.0] * 3, FOLDED), "folded_fp8_jit": ([999.0] * 3, FOLDED),
            "folded_fp8_in_kernel_jit": ([1400.0] * 3, FOLDED)}
    cell = _cell("prefill/8192@32768", 32768, arms, kind="prefill")
    for arm in ("folded_fp8_jit", "folded_fp8_in_kernel_jit"):
        cell["arms"][arm]["format"] = "folded_fp8"
    (row,) = bench.fp8_prefill_rows(_doc([cell]))
    assert row["met"] is True and row["in_kernel_x_bf16"] == pytest.approx(1.4)
    assert "| 1.400 |" in bench.fp8_targets_markdown(_doc([cell]))
    del cell["arms"]["folded_fp8_jit"]
    (row,) = bench.fp8_prefill_rows(_doc([cell]))
    assert row["met"] is None and row["in_kernel_x_bf16"] == pytest.approx(1.4)


# --- drawn cells: shapes, seeds, their targets, the plan's model ------------------------------------------------------
def _spans_log_strata(lens, hi) -> bool:
    """A batch of k lengths in [1, hi] with one length in each of k equal strata of log [1, hi]."""
    k = len(lens)
    return sorted(min(k - 1, int(k * math.log(n) / math.log(hi))) for n in lens) == list(range(k))


@pytest.mark.parametrize("shape", list(bench.DRAWN_SHAPES))
def test_drawn_shapes_hold_their_sizes_and_ranges(shape):
    from foldkv.lab.bench import case

    (lens,) = bench.draw_batches(7, [shape]).values()
    lo, hi = {"short_many": case.SHORT_MANY_TOKENS, "mixed": case.MIXED_TOKENS,
              "longtail64": (1, case.LONGTAIL_LONG[1])}.get(shape, case.UNIFORM_TOKENS)
    assert all(lo <= n <= hi for n in lens), (shape, min(lens), max(lens))
    want = {"short_many": case.SHORT_MANY_BATCH, "mixed": case.MIXED_BATCH}.get(shape)
    if want:
        assert want[0] <= len(lens) <= want[1]
    else:
        assert len(lens) == int(shape.rstrip("0123456789") and shape[len(shape.rstrip("0123456789")):])
    if shape == "mixed":  # one length in each log stratum: the handful spans the range (its longest in the top one)
        assert _spans_log_strata(lens, hi)
        assert not _spans_log_strata([464, 30, 7, 2], hi)  # red twin: s21b's independent draw, all short
    # a shape's draw depends on the seed and its name only (red twin: another seed draws other lengths)
    assert bench.draw_batches(7, [shape]) == {shape: bench.draw_batches(7)[shape]}
    assert bench.draw_batches(8, [shape]) != bench.draw_batches(7, [shape])


def test_drawn_singles_fall_in_their_ranges_and_a_fresh_seed_is_new():
    from foldkv.lab.bench.drawn import DRAWN_SINGLE_RANGES

    lens = bench.draw_singles(3, 4)
    (llo, lhi), (mlo, mhi) = DRAWN_SINGLE_RANGES["long"], DRAWN_SINGLE_RANGES["mid"]
    assert all(llo <= n <= lhi for n in lens[:4]) and all(mlo <= n <= mhi for n in lens[4:])
    assert lens == bench.draw_singles(3, 4) and lens != bench.draw_singles(4, 4)
    assert max(bench.draw_singles(3, 4, scale=1 / 128)) <= lhi // 128
    assert len({bench.fresh_seed() for _ in range(8)}) > 1


def _drawn_cell(name, lens, folded, read, graph=None, fi_tc=None, split=None):
    arms = {"folded_jit": ([folded] * 3, FOLDED), "read_folded": ([read] * 3, READ)}
    if graph is not None:
        arms["folded_graph"] = ([graph] * 3, FOLDED)
    if fi_tc is not None:
        arms["fi_tc"], arms["split_jit"] = ([fi_tc] * 3, PEER), ([split] * 3, SPLIT)
    return dict(_cell(name, max(lens), arms), batch=len(lens), seq_lens=list(lens))


def test_drawn_targets_hold_every_drawn_cell_with_red_twins():
    doc = _doc([
        _drawn_cell("drawn/uniform24", [30_000] * 24, folded=106.0, read=100.0, graph=106.5, fi_tc=150.0, split=140.0),
        _drawn_cell("drawn/mixed", [1, 150_000, 700], folded=109.0, read=100.0, graph=112.0, fi_tc=130.0, split=135.0),
        _drawn_cell("drawn_single/200001", [200_001], folded=107.0, read=100.0),
        _drawn_cell("drawn_single/57777", [57_777], folded=115.0, read=100.0),
        _drawn_cell("single/57777", [57_777], folded=150.0, read=100.0),  # not drawn: no drawn row
    ])
    doc["draws"] = {"seed": 1234}
    rows = {r["cell"]: r for r in bench.drawn.drawn_target_rows(doc)}
    assert list(rows) == ["drawn/uniform24", "drawn/mixed", "drawn_single/200001", "drawn_single/57777"]
    assert rows["drawn/uniform24"]["met"] is True
    bad = rows["drawn/mixed"]  # red twins: 1.09x the read, the graph 2.8% slower than eager, split behind FI TC
    assert bad["x_read"]["met"] is False and bad["graph_x_eager"]["met"] is False
    assert bad["split_x_fi_tc"]["met"] is False and bad["met"] is False
    assert rows["drawn_single/200001"]["x_read"]["bound"] == 1.06 and rows["drawn_single/200001"]["met"] is False
    assert rows["drawn_single/57777"]["x_read"]["bound"] == 1.20 and rows["drawn_single/57777"]["met"] is True
    text = "\n".join(bench.conclusions(doc))
    assert "Drawn cells (seed 1234): 2 of 4 meet every bound." in text
    assert "drawn/mixed: folded graph vs eager 1.028x, target ≤ 1.01" in text
    assert "| drawn/mixed | 3 | 150,701 | 1.09x (≤ 1.08: NOT met)" in bench.drawn_targets_markdown(doc)
    assert "No drawn cell" in bench.drawn_targets_markdown(_doc([]))


def _log_interp(n, n0, b0, n1, b1):
    return b0 + (b1 - b0) * math.log(n / n0) / math.log(n1 / n0)


@pytest.mark.parametrize("tokens, want", [
    (1, 1.60), (10_602, 1.60), (30_000, _log_interp(30_000, 10_602, 1.60, 40_002, 1.20)), (40_002, 1.20),
    (65_000, _log_interp(65_000, 40_002, 1.20, 100_000, 1.06)), (100_000, 1.06), (450_000, 1.06)])
def test_single_request_bound_at_its_points_and_between(tokens, want):
    from foldkv.lab.bench import drawn

    assert drawn.single_request_bound(tokens) == pytest.approx(want, abs=1e-12)
    assert drawn.drawn_batch_bound(tokens) == pytest.approx(max(1.08, want), abs=1e-12)


def test_single_request_bound_is_one_table_read_by_every_target():
    from foldkv.lab.bench import drawn

    assert drawn.single_request_bound(30_000) == pytest.approx(1.2867, abs=1e-4)  # `mixed`'s ~30K: ~1.3x
    assert drawn.single_request_bound(65_000) == pytest.approx(1.1258, abs=1e-4)
    b = [drawn.single_request_bound(n) for n in (1, 5_000, 10_602, 20_000, 40_002, 70_000, 100_000, 10**6)]
    assert b == sorted(b, reverse=True)  # never looser for a longer request
    points = dict(drawn.SINGLE_REQUEST_BOUNDS)
    by_case = {t.case: t.max_x_read for t in bench.DECODE_TARGETS}
    assert by_case["one request at 40K"] == points[40_002] and by_case["one request at 10.6K"] == points[10_602]
    singles = {t.single_range: t.max_x_read for t in bench.DRAWN_TARGETS if t.single_range}
    assert singles[drawn.DRAWN_SINGLE_RANGES["long"]] == points[100_000]
    assert singles[drawn.DRAWN_SINGLE_RANGES["mid"]] == points[40_002]
    with pytest.raises(ValueError, match="at least 1 token"):
        drawn.single_request_bound(0)


def _batch_verdicts(targets) -> dict:
    """folded / read verdicts of three drawn batches under `targets`: a few short requests (35,191 tokens, as s22b's
    `mixed`) at 1.23x and at 1.30x the read, and 112 requests of ~3.9K (435,963 tokens, as `short_many`) at 1.127x."""
    mixed = [28_159, 5_941, 789, 292, 9, 1]
    many = [3_892] * 111 + [435_963 - 3_892 * 111]
    doc = _doc([_drawn_cell("drawn/mixed", mixed, folded=123.0, read=100.0),
                _drawn_cell("drawn/mixed_slow", mixed, folded=130.0, read=100.0),
                _drawn_cell("drawn/short_many", many, folded=112.7, read=100.0)])
    return {r["cell"]: r["x_read"] for r in bench.drawn.drawn_target_rows(doc, targets)}


def _holds_the_total_token_rule(v: dict) -> bool:
    return (v["drawn/mixed"]["met"] is True and v["drawn/mixed_slow"]["met"] is False
            and v["drawn/short_many"]["met"] is False and v["drawn/short_many"]["bound"] == 1.08)


def test_a_drawn_batch_is_held_to_one_request_of_its_total_tokens_with_red_twin():
    from dataclasses import replace

    from foldkv.lab.bench import drawn

    v = _batch_verdicts(bench.DRAWN_TARGETS)
    assert _holds_the_total_token_rule(v)
    assert v["drawn/mixed"]["bound"] == pytest.approx(drawn.single_request_bound(35_191))  # 1.239

    class PerRequestLength(drawn.DrawnTarget):  # red twin: the longest request's length instead of the total
        def x_read_bound(self, cell):
            return drawn.drawn_batch_bound(max(cell["seq_lens"]), self.max_x_read)

    twin = tuple(PerRequestLength(**{f: getattr(t, f) for f in t.__dataclass_fields__}) for t in bench.DRAWN_TARGETS)
    assert not _holds_the_total_token_rule(_batch_verdicts(twin))
    flat = tuple(replace(t, by_total_tokens=False) for t in bench.DRAWN_TARGETS)  # red twin: 1.08x for every batch
    assert not _holds_the_total_token_rule(_batch_verdicts(flat))


def _tie_cell(name, split_x_read, fi_x_read):
    """A drawn batch whose split arm and FlashInfer TC take the given multiples of the plain read of the split pool's
    bytes (the folded read scaled by bytes)."""
    lens = [30_000] * 24
    r = floor.step_bytes(GEMMA4_31B, "split", [max(lens)])["total"] / floor.step_bytes(
        GEMMA4_31B, "folded", [max(lens)])["total"]
    return _drawn_cell(name, lens, folded=101.0, read=100.0, graph=101.0, fi_tc=100.0 * r * fi_x_read,
                       split=100.0 * r * split_x_read)


def test_split_vs_fi_tc_counts_a_tie_at_the_roof_with_red_twins():
    doc = _doc([_tie_cell("drawn/tie", 1.010, 1.005),  # FI TC 0.5% ahead of split, both within 3% of the read
                _tie_cell("drawn/off_roof", 1.050, 1.045),  # red twin: the same tie with split 5% off the read
                _tie_cell("drawn/fi_off_roof", 1.032, 1.027),  # red twin: FI TC at the roof, split 3.2% off
                _tie_cell("drawn/not_a_tie", 1.020, 1.000),  # red twin: FI TC 2% ahead: beyond a tie
                _tie_cell("drawn/fi_behind", 1.010, 1.050)])  # FI TC behind split: met with no tie
    rows = {r["cell"]: r["split_x_fi_tc"] for r in bench.drawn.drawn_target_rows(doc)}
    assert rows["drawn/tie"]["met"] is True and rows["drawn/tie"]["tie"] is True
    assert rows["drawn/tie"]["at_roof"]["split"] == pytest.approx(1.010)
    assert rows["drawn/off_roof"]["met"] is False and rows["drawn/off_roof"]["value"] == pytest.approx(1.045 / 1.050)
    assert rows["drawn/fi_off_roof"]["met"] is False and "tie" not in rows["drawn/fi_off_roof"]
    assert rows["drawn/not_a_tie"]["met"] is False
    assert rows["drawn/fi_behind"]["met"] is True and "tie" not in rows["drawn/fi_behind"]
    assert "a tie at the roof" in bench.drawn_targets_markdown(doc)
    fixed = _doc([dict(_tie_cell("batch/uniform8", 1.010, 1.005), batch=24)])  # the fixed targets' rule is the same
    (row,) = bench.tables.target_rows(fixed)
    assert row["split_x_fi_tc"]["met"] is True and row["split_x_fi_tc"]["tie"] is True


def test_plan_model_sets_the_plans_prediction_beside_the_measured_step():
    from foldkv.kernels import plan as decode_plan
    from foldkv.pool import PagedKvLayout

    assert bench.drawn.plan_model_row([30_001] * 32, 4000.0, 132)["one_wave"] is True  # 128 CTAs: one each
    lens = [30_001] * 64
    row = bench.drawn.plan_model_row(lens, 4000.0, 132)
    pages = -(-30_001 // 64)
    assert row["cap_pages"] == decode_plan.balanced_chunk_pages(
        PagedKvLayout(GEMMA4_31B, KvFormat.FOLDED, 64, 1), lens, 132)
    assert row["ctas"] == 64 * 4 * -(-pages // row["cap_pages"]) and row["one_wave"] is False
    # the model's step is at least the bytes of the batch spread over every SM at the read roof
    assert row["predicted_us"] >= 64 * 4 * pages * 64 * 640 * 2 / 4000e3
    fixed = [_drawn_cell(f"batch/uniform{n}", [20_000 + n] * n, folded=1.0, read=1.0) for n in (8, 32)]
    for c in fixed:
        c["arms"]["folded_jit"]["us"]["median"] = 0.93 * bench.drawn.plan_model_row(c["seq_lens"], 4000.0, 132)[
            "predicted_us"]
    near = _drawn_cell("drawn/uniform24", [25_000] * 24, folded=1.0, read=1.0)
    far = _drawn_cell("drawn/short_many", [3000] * 200, folded=1.0, read=1.0)
    near["arms"]["folded_jit"]["us"]["median"] = 0.95 * bench.drawn.plan_model_row(near["seq_lens"], 4000.0, 132)[
        "predicted_us"]
    far["arms"]["folded_jit"]["us"]["median"] = 1.30 * bench.drawn.plan_model_row(far["seq_lens"], 4000.0, 132)[
        "predicted_us"]
    doc = _doc(fixed + [near, far])
    doc["env"]["sms"] = 132
    rows = {r["cell"]: r for r in bench.plan_model_rows(doc)}
    assert rows["batch/uniform8"]["mispredicted"] is None and rows["drawn/uniform24"]["mispredicted"] is False
    assert rows["drawn/short_many"]["mispredicted"] is True  # red twin: 1.30 against the fixed batches' 0.93
    assert rows["drawn/short_many"]["ratio"] == pytest.approx(1.30)
    assert "**yes**" in bench.plan_model_markdown(doc) and "0.930-0.930" in bench.plan_model_markdown(doc)


@pytest.mark.parametrize("fp8_math", [None, "tensor_cores", "exact"])
def test_decode_arms_plan_the_partials_wave(fp8_math):
    """A decode arm's plan balances the wave of the partial it launches (decode.partial_wave), as decode() plans
    without a plan: 2 x SMs CTAs for the FP8 tensor-core partial (the FP8 default), one a SM otherwise; an arm's own
    num_sms is kept. Red twin: a bf16 pool or the exact FP8 partial keeps one CTA a SM."""
    from foldkv import KvFormat, PagedKvLayout
    from foldkv.kernels.plan import DEFAULT_SMS
    from foldkv.lab.bench.arms import decode_plan_kwargs

    fp8 = PagedKvLayout(GEMMA4_31B, KvFormat.FOLDED, 64, 0, torch.float8_e4m3fn)
    bf16 = PagedKvLayout(GEMMA4_31B, KvFormat.FOLDED, 64, 0, torch.bfloat16)
    cpu = torch.device("cpu")
    want = DEFAULT_SMS * (1 if fp8_math == "exact" else 2)
    assert decode_plan_kwargs(fp8, cpu, fp8_math, {})["num_sms"] == want
    assert decode_plan_kwargs(fp8, cpu, fp8_math, {"num_sms": 7, "chunk_tokens": 64}) == {"num_sms": 7,
                                                                                          "chunk_tokens": 64}
    if fp8_math != "tensor_cores":
        assert decode_plan_kwargs(bf16, cpu, fp8_math, {})["num_sms"] == DEFAULT_SMS


def test_fp8_harness_has_the_32_token_tensor_core_arms():
    """Run 19's arms (bench/versions/decode_partial_fp8_tc_t32.py) stand in for the library's tensor-core partial,
    and the version's shared-memory reader finds the launch's dynamic shared memory."""
    import importlib
    import sys

    bench_dir = os.path.join(checkout_root(), "bench")
    sys.path.insert(0, bench_dir)  # the harness imports bench/versions/
    try:
        harness = importlib.import_module("fp8_harness")
        t32 = importlib.import_module("versions.decode_partial_fp8_tc_t32")
    finally:
        sys.path.remove(bench_dir)
    names = [a.name for a in harness.ARMS if not isinstance(a, str)]
    assert {"fp8_tc_t32s3", "fp8_tc_t32s2"} <= set(names) and len(names) == len(set(names))
    assert t32.PARAMS["block_n"] == 32 and t32.PARAMS["num_stages"] == 3 and t32.PARAMS["ctas_per_sm"] == 2
    host = "".join(f"  (((TVMFFIAny*)stack_ffi_any)[{i}].v_int64) = ((int64_t){n});\n"
                   for i, n in enumerate([4, 256, 1, 1, 91648]))
    assert t32.smem_bytes(host) == 91648 <= t32.SMEM_LIMIT_2CTA


def test_serve_version_builds_the_registered_variant_from_the_version(monkeypatch):
    """bench/serve_version.py (the lab's A/B of a kernel version through the runtime): after `serve`, resolving the
    registered variant builds the version's kernel with the registered params; red twin: without it, the library's
    builder is called."""
    import importlib.util
    import sys
    from pathlib import Path

    from foldkv.kernels import registry

    monkeypatch.setattr(registry, "_BY_NAME", dict(registry._BY_NAME))  # the swap ends with the test
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "bench"))
    spec = importlib.util.spec_from_file_location("serve_version", root / "bench" / "serve_version.py")
    serve_version = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_version)
    version = importlib.import_module("versions.prefill_folded_seesaw_async")
    calls = []
    monkeypatch.setattr(version, "build", lambda geom, **params: calls.append(("version", params)) or "version kernel")
    library = registry.get("prefill_folded")
    monkeypatch.setattr(importlib.import_module("foldkv.kernels.prefill_folded"), "build",
                        lambda geom, **params: calls.append(("library", params)) or "library kernel")
    assert registry.get("prefill_folded").build(GEMMA4_31B) == "library kernel"  # red twin: not served
    serve_version.serve("prefill_folded", "prefill_folded_seesaw_async")
    served = registry.get("prefill_folded")
    assert served.params == library.params and served.format is library.format
    assert served.build(GEMMA4_31B) == "version kernel"
    assert calls[-1] == ("version", {**library.params, "fmt": library.format})
    assert "versions.prefill_folded_seesaw_async" in sys.modules
