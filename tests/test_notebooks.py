"""Every notebook executes headless (papermill, smoke parameters, CPU mode) through the batch driver, into a temp dir.

Committed runs under papermill_runs/ are never touched. Assertions are on what each notebook records in its JSON.
"""

from __future__ import annotations

import functools
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
    fp8 = {r["pool"]: r for r in rec["results"]["fp8_bytes"]["rows"]}
    assert fp8["FP8 folded"]["bytes_per_token_head"] == 644 and fp8["FP8 folded"]["over_bf16_folded"] <= 0.55
    assert fp8["FP8 folded"]["tokens_per_gib"] > 1.9 * fp8["bf16 folded"]["tokens_per_gib"]
    if not pytest.importorskip("torch").cuda.is_available():  # the roof: redrawn from this notebook's run of record
        from foldkv.lab import bench

        source = bench.run_of_record("01_byte_floor")
        assert rec["sections"]["measure_bandwidth"] == f"redrawn from {source}"
        assert rec["results"]["measure_bandwidth"]["path"].endswith(f"papermill_runs/{source}/01_byte_floor.record.json")


def test_fp8_format_error_section_runs_on_the_cpu(batch):
    _, out, _ = batch
    rec = _record(out, "02_correctness_gates")
    assert rec["sections"]["fp8_format_error"] == "ran", rec["sections"]
    rows = rec["results"]["fp8_format_error"]["rows"]
    assert len(rows) == 4 and all(r["rows_passed"] and 0.5 < r["row_max_over_bound"] <= 1 for r in rows)
    assert any(r["out_bound_finite"] == 1.0 for r in rows) and all(r["out_over_bound"] == 0 for r in rows)


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


# --- a run that measured nothing says so; saved notebooks carry no stray warnings ---------------------------------
@functools.lru_cache(maxsize=None)
def _run_batch_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_batch", os.path.join(ROOT, "scripts", "run_batch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed_benchmark_run():
    """The run notebook 04 redraws on a machine without CUDA: its run of record in papermill_runs/README.md."""
    from foldkv.lab import bench

    return bench.run_of_record("04_benchmarks")


def test_generate_records(batch):
    """Notebook 05 on a CPU: the computed bytes and the held-bytes check ran, the GPU sections say why not."""
    _, out, _ = batch
    rec = _record(out, "05_generate")
    rows = rec["results"]["cache_bytes_31b"]["rows"]
    assert [r["context"] for r in rows] == [8192, 32768, 131072, 262144]
    assert all(r["folded_bytes"] * 8 == r["dynamic_bytes"] * 5 == r["split_bytes"] * 5 for r in rows)  # 640 / 1024
    assert rec["sections"]["cache_bytes_check"] == "ran", rec["sections"]
    runs = rec["results"]["cache_bytes_check"]["runs"]
    assert {r["arm"] for r in runs} == {"sdpa", "foldkv-folded", "foldkv-split"}
    assert all(r["cache_bytes"] == r["expected_cache_bytes"] > 0 for r in runs)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():  # the GPU sections: redrawn from this notebook's run of record, labelled
        from foldkv.lab import bench

        shown = bench.notebook_record("05_generate")
        run = shown["run"]
        for section in ("model_31b", "prefill_31b", "decode_31b", "prefill_tail_31b", "largest_batch_31b",
                        "step_kernels", "targets"):
            assert rec["sections"][section] == f"redrawn from {run}", rec["sections"]
        assert rec["sections"]["static_compile_31b"].startswith(f"not run: no CUDA device, and the run of record {run}")
        # the targets computed here from the recorded rows: those the run computed from them
        assert rec["results"]["targets"]["targets"] == shown["record"]["results"]["targets"]
        text = _output_text(out, "05_generate")
        label = f"from the run of record {run}, commit {shown['source']['commit'][:7]}"
        assert f"**Redrawn {label}**" in text and f"targets met** ({label})" in text
        assert _images(out, "05_generate") >= 2  # the cache bytes, and the redrawn TPOT figure


def _output_text(out, stem) -> str:
    nb = json.loads((out / f"{stem}.ipynb").read_text())
    return "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
                     for c in nb["cells"] for o in c.get("outputs", []))


def _images(out, stem) -> int:
    nb = json.loads((out / f"{stem}.ipynb").read_text())
    return sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))


def test_gates_and_drift_redraw_their_gpu_sections(batch):
    """Notebooks 02 and 03 on a CPU: every GPU section is its run of record's, labelled with the run and commit;
    the run's verdict and checks computed again from its numbers equal what it recorded (else a section fails)."""
    if pytest.importorskip("torch").cuda.is_available():
        pytest.skip("a CUDA device is here: the GPU sections are measured")
    from foldkv.lab import bench

    _, out, _ = batch
    for stem, sections in (("02_correctness_gates", ("decode_gates", "prefill_gates", "prefill_last_row_vs_decode",
                                                     "refusals", "graph_walk", "fp8_decode_gates", "fp8_prefill_gates",
                                                     "fp8_needle", "sanitizer", "random_gate", "long_walk")),
                           ("03_drift_study", ("arm:split", "arm:folded", "arm:folded-fp8", "arm:folded-fp8-exact",
                                               "pair:folded-fp8 vs ref-folded-fp8"))):
        rec = _record(out, stem)
        source = bench.results.record_source(stem)
        assert {s: rec["sections"][s] for s in sections} == dict.fromkeys(sections, f"redrawn from {source['run']}")
        assert not any(v.startswith("failed") for v in rec["sections"].values()), rec["sections"]
        assert f"**Redrawn {source['label']}**" in _output_text(out, stem), stem
    assert _record(out, "02_correctness_gates")["results"]["all_run_gates_pass"] is True
    assert _images(out, "02_correctness_gates") >= 2 and _images(out, "03_drift_study") >= 4


def test_time_to_first_token_records(batch):
    """Notebook 07 on a CPU: each cell's FLOPs computed; every GPU section redrawn from its run of record (labelled), the
    floors and targets computed again from its rows and held to the recorded ones, and each verdict whose rule changed
    since the run shown as recorded and under today's rules."""
    _, out, _ = batch
    rec = _record(out, "07_time_to_first_token")
    assert rec["parameters"]["ttft_cells"] == _smoke("07")["ttft_cells"]
    assert rec["sections"]["prefill_flops_31b"] == "ran", rec["sections"]
    rows = rec["results"]["prefill_flops_31b"]["rows"]
    assert [(r["prompt_tokens"], r["batch"]) for r in rows] == [(512, 1), (512, 2)]
    assert rows[1]["total"] == pytest.approx(2 * rows[0]["total"]) and rows[0]["lm_head"] > 0
    assert "ttft_31b" not in _record(out, "05_generate")["sections"], "notebook 05 still measures the first token"
    if not pytest.importorskip("torch").cuda.is_available():
        from foldkv.lab import bench

        source = bench.results.record_source("07_time_to_first_token")
        sections = ("model_31b", "ttft_31b", "first_use_31b", "e2e_31b", "prefill_memory_31b", "ttft_targets")
        assert {s: rec["sections"][s] for s in sections} == dict.fromkeys(sections, f"redrawn from {source['run']}")
        assert not any(v.startswith("failed") for v in rec["sections"].values()), rec["sections"]
        today = rec["results"]["ttft_targets_today"]
        e2e = next(t for t in today if "end-to-end lowest" in t["target"])
        assert (e2e["met_recorded"], e2e["met_now"]) == (False, False)  # recorded under today's rules
        assert all(t["rule"] == "" and t["met_now"] == t["met_recorded"] for t in today)
        assert not (out / "07_time_to_first_token.json").exists()
        text = _output_text(out, "07_time_to_first_token")
        assert f"**Redrawn {source['label']}**" in text and "targets met as recorded; under today's rules" in text
        assert _images(out, "07_time_to_first_token") >= 1


def test_tensor_parallel_records(batch):
    """Notebook 06 on a CPU: what a card holds at TP 1 and 2 computed, TP 2's tokens equal to one process's on the
    synthetic model under torchrun, the 31B's cells not run for want of GPUs."""
    _, out, _ = batch
    rec = _record(out, "06_tensor_parallel")
    rows = {(r["ranks"], r["arm"]): r for r in rec["results"]["capacity"]["rows"]}
    folded1, folded2 = rows[(1, "foldkv-folded")], rows[(2, "foldkv-folded")]
    assert folded2["rank_kv_bytes_per_seq"] * 2 == folded1["rank_kv_bytes_per_seq"]
    assert folded2["rank_weight_bytes"] < folded1["rank_weight_bytes"] and folded2["per_cards"] > folded1["per_cards"]
    assert rows[(1, "foldkv-split")]["largest_batch"] < folded1["largest_batch"] < rows[(1, "foldkv-fp8")]["largest_batch"]
    assert rec["sections"]["tp_cpu_check"] == "ran"
    check = rec["results"]["tp_cpu_check"]["rows"]
    assert [r["pool"] for r in check] == ["folded", "split"] and all(r["tokens_equal"] for r in check)
    assert rec["sections"]["tp_31b"].startswith("not run")


def test_cpu_benchmarks_say_they_are_redrawn(batch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: notebook 04 measures instead of redrawing")
    _, out, _ = batch
    source = _committed_benchmark_run()
    assert source, "no committed H200 results to redraw: the redraw path is not exercised"
    rec = _record(out, "04_benchmarks")
    assert rec["parameters"]["mode"] == "redraw"  # the smoke parameters ({"smoke": True}) resolve to redraw on a CPU
    sections = dict(rec["sections"])
    newer = {s: sections.pop(s) for s in ("hosttime", "drawn")}  # newer than some committed runs: redrawn, or not
    for s, said in newer.items():                                  # run saying why
        assert said == f"redrawn from {source}" or said.startswith(f"not run: no CUDA device, and {source} has no"), s
    assert sections == {s: f"redrawn from {source}" for s in ("single", "sweep", "batch", "prefill")}
    summary = (out / "SUMMARY.md").read_text()
    assert "| notebook | status | seconds | ran | redrawn | not run | failed |" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| 04_benchmarks |"))
    assert row.split(" | ")[1] == f"redrawn from {source}", row
    redrawn = 4 + sum(said.startswith("redrawn") for said in newer.values())
    assert row.endswith(f"| 0 | {redrawn} | {6 - redrawn} | 0 |"), row
    # every plot title carries the mark: the plotting cell hands the run it redraws to the lab's figures
    nb = json.loads((out / "04_benchmarks.ipynb").read_text())
    plot_cells = ["".join(c["source"]) for c in nb["cells"] if "plt.show()" in "".join(c["source"])]
    assert plot_cells and all(src.count("plt.show()") == src.count("plots.figures(results, redrawn_from=redrawn_run)")
                              for src in plot_cells)
    images = sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
    assert images >= 2, "the redrawn plots were not drawn"


def test_saved_notebooks_carry_no_tqdm_warning(batch):
    _, out, summary = batch
    for r in summary:
        nb = json.loads((out / f"{r['notebook']}.ipynb").read_text())
        texts = ["".join(o.get("text", "")) + json.dumps(o.get("data", {})) + "".join(o.get("traceback", []))
                 for c in nb["cells"] for o in c.get("outputs", [])]
        assert not any("TqdmWarning" in t or "IProgress not found" in t for t in texts), r["notebook"]


def test_record_redrawn_and_summary_columns(tmp_path):
    from foldkv.lab.report import REDRAWN_FROM, RunRecord

    run_batch = _run_batch_module()
    assert run_batch.REDRAWN_FROM == REDRAWN_FROM
    rec = RunRecord("04_benchmarks", tmp_path)
    rec.redrawn("single", "h200-x", results_file="papermill_runs/h200-x/04_benchmarks.json")
    rec.not_run("sweep", "no cells")
    with pytest.raises(ValueError, match="redrawn from which run"):
        rec.redrawn("batch", " ")
    assert rec.sections == {"single": "redrawn from h200-x", "sweep": "not run: no cells"}
    entry = {"notebook": "04_benchmarks", "status": "ok", "seconds": 1.0, "sections": rec.sections}
    measured = {"notebook": "01_byte_floor", "status": "ok", "seconds": 1.0,
                "sections": {"a": "ran", "b": "failed: x", "c": "not run: y"}}
    nothing = {"notebook": "05_x", "status": "ok", "seconds": 1.0, "sections": {"a": "not run: no CUDA device"}}
    broke = {"notebook": "06_x", "status": "failed: PapermillExecutionError: x", "seconds": 1.0, "sections": {}}
    text = run_batch.summarize([measured, entry, nothing, broke], str(tmp_path))
    assert "| 01_byte_floor | ok | 1.0 | 1 | 0 | 1 | 1 |" in text
    assert "| 04_benchmarks | redrawn from h200-x | 1.0 | 0 | 1 | 1 | 0 |" in text
    assert "| 05_x | not run: no section ran | 1.0 | 0 | 0 | 1 | 0 |" in text
    assert "| 06_x | failed: PapermillExecutionError: x | 1.0 | 0 | 0 | 0 | 0 |" in text
    assert "- 04_benchmarks / single: redrawn from h200-x" in text and "- 01_byte_floor / b: failed: x" in text
    assert "did not finish" not in text  # red twin of the check below: tmp_path holds no notebook yet
    (tmp_path / "02_stopped.ipynb").write_text("{}")  # papermill's output of a run killed before its entry
    stopped = run_batch.summarize([measured], str(tmp_path))
    assert "| 02_stopped | did not finish: no entry (stopped mid-run) |" in stopped
    assert "none: every section ran" not in stopped
    both = dict(measured, sections={"a": "ran", "b": "redrawn from h200-x"})
    assert "| 01_byte_floor | ok; part redrawn from h200-x |" in run_batch.summarize([both], str(tmp_path))


def test_mark_redrawn_titles_every_axes():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from foldkv.lab import bench

    fig, ax = plt.subplots(1, 2)
    ax[0].set_title("decode, one request")
    bench.plots.mark_redrawn(fig, "h200-x")
    assert [a.get_title() for a in ax] == ["decode, one request\n(redrawn from h200-x, not measured now)",
                                           "(redrawn from h200-x, not measured now)"]
    fig2, ax2 = plt.subplots()
    ax2.set_title("measured now")
    bench.plots.mark_redrawn(fig2, None)  # a measured run's plots carry no mark
    assert ax2.get_title() == "measured now"
    plt.close("all")
    assert bench.run_name("/x/papermill_runs/h200-20261129-s2/04_benchmarks.json") == "h200-20261129-s2"


# --- parameters given as papermill's -p text ----------------------------------------------------------------------
def _papermill_cli(notebook, out_dir, params: dict, timeout=600):
    """Run one notebook as a user would: `python -m papermill IN OUT -p name value ...`, every value as text."""
    kernel = _kernel()
    args = [sys.executable, "-m", "papermill", os.path.join(ROOT, "notebooks", f"{notebook}.ipynb"),
            str(out_dir / f"{notebook}.ipynb"), "-k", kernel, "--cwd", ROOT, "--no-progress-bar",
            "-p", "out_dir", str(out_dir)]
    for name, value in params.items():
        args += ["-p", name, value if isinstance(value, str) else json.dumps(value)]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


@functools.lru_cache(maxsize=None)
def _kernel():
    return _run_batch_module().ensure_kernelspec()  # this interpreter's kernel, found through JUPYTER_PATH


def _smoke(prefix):
    return _run_batch_module().SMOKE_PARAMETERS[prefix]


# The smoke batch's parameters, each passed as text the way `-p` passes it, plus one override per notebook that
# changes what it records.
OVERRIDES = {
    "01_byte_floor": {"bandwidth_gbps": "3000"},
    "02_correctness_gates": {"formats": '["folded"]'},
    "03_drift_study": {"arms": '["ref-split", "ref-folded"]'},
    "04_benchmarks": {"smoke": "true", "sections": '["single", "sweep"]', "decode_arms": "torch,fi_tc"},
    "05_generate": {"contexts": "8192,32768", "arms": '["sdpa", "foldkv-split"]'},
    "06_tensor_parallel": {"capacity_context": "32768", "arms": "foldkv-folded,foldkv-split"},
    "07_time_to_first_token": {"ttft_cells": "1024:1,512:4", "e2e_arms": "foldkv-folded,foldkv-split"},
}


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_text_overrides_take_effect(notebook, tmp_path):
    require_module("papermill")
    params = {**_smoke(notebook[:2]), **OVERRIDES[notebook]}
    proc = _papermill_cli(notebook, tmp_path, params)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = _record(tmp_path, notebook)
    got = rec["parameters"]
    if notebook == "01_byte_floor":
        assert got["context_lengths"] == [97, 16384] and got["bandwidth_gbps"] == 3000.0
        assert [r["context"] for r in rec["results"]["floor_table"]["rows"]] == [97, 97, 16384, 16384]
    elif notebook == "02_correctness_gates":
        assert got["formats"] == ["folded"] and got["case_set"] == "smoke"
    elif notebook == "03_drift_study":
        assert got["arms"] == ["ref-split", "ref-folded"]
        assert sorted(s for s in rec["sections"] if s.startswith("arm:")) == ["arm:ref-folded", "arm:ref-split"]
        study = json.loads((tmp_path / "drift_results.json").read_text())["parameters"]
        assert study["lengths"] == [5, 66] and study["prompts"] == ["ab", "the cat"]
        assert study["synthetic_config"] == _smoke("03")["synthetic_config"]
    elif notebook == "04_benchmarks":
        assert got["smoke"] is True and got["sections"] == ["single", "sweep"]
        assert got["decode_arms"] == ["torch", "fi_tc"]
    elif notebook == "05_generate":
        assert got["contexts"] == [8192, 32768] and got["arms"] == ["sdpa", "foldkv-split"]
        assert [r["context"] for r in rec["results"]["cache_bytes_31b"]["rows"]] == [8192, 32768]
    elif notebook == "07_time_to_first_token":
        assert got["ttft_cells"] == ["1024:1", "512:4"] and got["e2e_arms"] == ["foldkv-folded", "foldkv-split"]
        assert got["first_use_lengths"] == [259, 261]
        assert [r["prompt_tokens"] for r in rec["results"]["prefill_flops_31b"]["rows"]] == [1024, 512]
    else:
        assert got["capacity_context"] == 32768 and got["arms"] == ["foldkv-folded", "foldkv-split"]
        assert {r["arm"] for r in rec["results"]["capacity"]["rows"]} == {"foldkv-folded", "foldkv-split"}


# One out-of-range value per notebook: refused at the cell right after the parameters, before any work.
BAD_OVERRIDES = {
    "01_byte_floor": ("context_lengths", "[2048, 1000000]",
                      "context_lengths: 1000000 is past the model's max_position 262144"),
    "02_correctness_gates": ("formats", '["folded", "paged"]', "formats: unknown value 'paged'"),
    "03_drift_study": ("lengths", "[5, 0]", "lengths: 0 is not positive"),
    "04_benchmarks": ("sections", '["single", "prefil"]', "sections: unknown value 'prefil'"),
    "05_generate": ("arms", '["sdpa", "foldkv-fold"]', "arms: unknown value 'foldkv-fold'"),
    "06_tensor_parallel": ("ranks", "1", "ranks: 1 is below 2"),
    "07_time_to_first_token": ("first_use_lengths", "[4099, 256]", "first_use_lengths: [256] not new to the process"),
}


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_bad_override_is_refused_at_the_setup_cell(notebook, tmp_path):
    require_module("papermill")
    name, value, message = BAD_OVERRIDES[notebook]
    proc = _papermill_cli(notebook, tmp_path, {name: value}, timeout=300)
    assert proc.returncode != 0, f"{notebook} accepted {name}={value}"
    assert "ParameterError" in proc.stderr and message in proc.stderr, proc.stderr[-3000:]
    nb = json.loads((tmp_path / f"{notebook}.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]  # papermill adds markdown banners on a failure
    injected = next(i for i, c in enumerate(code) if "injected-parameters" in c["metadata"].get("tags", []))
    failed = [i for i, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert failed == [injected + 1], f"the error is in code cell(s) {failed}, not the setup cell {injected + 1}"
    assert all(c.get("execution_count") is None for c in code[injected + 2:]), "cells after the setup cell ran"
    assert not list(tmp_path.glob("*.record.json")) and not list(tmp_path.glob("*.json")), "work ran before the refusal"
