"""CPU tests of the FP8 wgmma accumulation characterisation (foldkv.lab.fp8_accumulation): the model and its fit
give back the rule synthetic data was made with (b = 13, b = 23; truncation against round-to-nearest), each with a
red twin that shows the check can fail; the kernel factory emits FP8 wgmma (e4m3 operands) for sm_90a; and against
the H200's committed characterisation (papermill_runs/h200-20261204-s21/fp8_accumulation.json, operands drawn again):
truncation at b = 14 reproduces every cell, and the derived `accumulation_bound` holds over every cell's measured max
while its red twins (b + 4, no per-addend count, the earlier running-sum term) fail on the positive cells; notebook
02's section over that data (`gates.fp8_wgmma`): the record's fields, the per-output check a GPU run records, each
with a red twin."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import require_tilelang

from foldkv.lab import fp8_accumulation as fa

# a few bits around each rule the tests make: the fit's cost is one simulation per (mode, b) and cell
BITS = (12, 13, 14, 22, 23, 24)
CELLS = dict(trials=1, steps=(4, 16), spreads=(0, 6), n=8)


@pytest.fixture(scope="module")
def fits() -> dict:
    return {(b, m): fa.fit(fa.synthetic_cells(b, m, **CELLS), BITS) for b, m in
            [(13, "truncate"), (13, "nearest"), (23, "nearest")]}


@pytest.mark.parametrize("bits,mode", [(13, "truncate"), (13, "nearest"), (23, "nearest")])
def test_fit_recovers_the_rule_the_data_was_made_with(fits, bits, mode):
    res = fits[(bits, mode)]
    assert (res["mode"], res["bits"]) == (mode, bits), res["by_mode"]
    assert res["distance"] == 0.0  # the model on the same inputs gives the same statistics


def test_red_twin_13_bits_is_not_fit_as_float32_like(fits):
    grid = {(g["mode"], g["bits"]): g["distance"] for g in fits[(13, "nearest")]["grid"]}
    assert fits[(13, "nearest")]["bits"] != 23
    # the check can fail: a 23-bit rule is far from data made with 13 bits, and the reverse
    assert grid[("nearest", 23)] > 100 * max(grid[("nearest", 13)], 1e-3)
    grid23 = {(g["mode"], g["bits"]): g["distance"] for g in fits[(23, "nearest")]["grid"]}
    assert grid23[("nearest", 13)] > 100


@pytest.mark.parametrize("bits,mode,other", [(13, "truncate", "nearest"), (13, "nearest", "truncate")])
def test_truncation_is_told_from_rounding(fits, bits, mode, other):
    res = fits[(bits, mode)]
    assert res["mode"] == mode
    # the other mode's best is clearly worse (its sign bias on positive sums differs), not a near tie
    assert res["by_mode"][other]["distance"] > 10 * max(res["by_mode"][mode]["distance"], 1.0)


def test_model_is_exact_at_float64_width_and_loses_bits_below_it():
    g = torch.Generator().manual_seed(1)
    a, b = fa.draw_operands(1, 16, 6, "positive", generator=g)
    ref, abs_sum = fa.reference(a, b)
    prods = fa.products(a, b)
    wide = fa.error_stats(fa.simulate(prods, 53, "nearest"), ref, abs_sum)
    assert wide["max"] <= 16 * 2.0**-24  # only the accumulator's float32 roundings, one a step
    narrow = fa.error_stats(fa.simulate(prods, 13, "truncate"), ref, abs_sum)
    assert narrow["bias"] == -1.0 and narrow["q50"] > 2.0**-14  # truncation of positive sums is always low
    # one accumulator over 16 steps loses more than a fresh one per step added in float32
    fresh = fa.error_stats(fa.simulate(prods, 13, "truncate", fresh_every=1), ref, abs_sum)
    assert narrow["q50"] > 2 * fresh["q50"]


def test_operands_are_never_zero_and_spread_as_asked():
    g = torch.Generator().manual_seed(2)
    a, b = fa.draw_operands(2, 4, 8, "mixed", generator=g)
    assert a.dtype == torch.float8_e4m3fn and a.shape == (2, 64, 128) and b.shape == (2, 16, 128)
    mag = torch.cat([a.double().flatten(), b.double().flatten()]).abs()
    assert mag.min() >= 2.0**-4 and mag.max() <= 2.0**5
    with pytest.raises(ValueError, match="spread"):
        fa.draw_operands(1, 1, 13, generator=g)


def test_steps_table_and_markdown():
    cells = fa.synthetic_cells(13, "truncate", trials=1, steps=(1, 4), spreads=(6,), signs=("positive",),
                               fresh_every=(None, 1))
    res = fa.fit(cells, (13, 14))
    rows = [{**{k: c[k] for k in ("spread", "signs", "steps", "fresh_every")},
             **{f"measured_{k}": v for k, v in m.items()}, **{f"model_{k}": v for k, v in s.items()}}
            for c, m, s in zip(cells, res.pop("measured"), res.pop("simulated"))]
    result = {"cells": rows, "fit": res, "all_written": True}
    table = fa.steps_table(result)
    assert [r["steps"] for r in table] == [1, 4]
    assert table[1]["ratio_q50"] > 1  # the one accumulator loses more than a fresh one per step
    text = fa.markdown(result)
    assert "truncate, b = 13 bits kept per add" in text and "| k32 steps |" in text


def test_characterise_without_hopper_is_not_run():
    from foldkv.lab.arms import ArmUnavailable

    with pytest.raises(ArmUnavailable, match="CUDA device"):
        fa.characterise("cpu")


@pytest.mark.parametrize("fresh_every", [None, 4])
def test_kernel_emits_fp8_wgmma_for_sm90a(fresh_every):
    require_tilelang()
    source = fa.build(16, fresh_every=fresh_every).get_kernel_source()
    calls = [line for line in source.splitlines() if "wgmma" in line and "e4m3" in line]
    assert len(calls) == 16  # one m64n16k32 e4m3 wgmma per k32 step
    assert all("64, 16, 32" in line for line in calls)
    # one accumulator: every step after the first accumulates; a fresh one every 4 steps: 4 restarts
    restarts = sum(line.rstrip().endswith(", 0);") for line in calls)
    assert restarts == (1 if fresh_every is None else 4)


def test_kernel_refuses_a_grouping_that_does_not_divide_the_steps():
    require_tilelang()
    with pytest.raises(ValueError, match="divide"):
        fa.program(16, fresh_every=3)


# --- the H200's characterisation (committed) and the bound derived from its rule ------------------------------------
H200_RUN = Path(__file__).resolve().parents[1] / "papermill_runs" / "h200-20261204-s21" / "fp8_accumulation.json"


@pytest.fixture(scope="module")
def h200() -> dict:
    """The committed characterisation and, per cell, its operands drawn again (same trials, n, seed) with the exact
    reference, the rule's model (truncate, b = BITS_KEPT) and the bound's per-step inputs."""
    result = json.loads(H200_RUN.read_text())
    assert result["fit"]["bits"] == 13 and result["all_written"]  # what the probe's distance picked, on the H200
    steps = sorted({r["steps"] for r in result["cells"]})
    fresh = sorted({r["fresh_every"] for r in result["cells"] if r["fresh_every"] is not None})
    cells = fa.grid_cells(result["trials"], steps, fa.SPREADS, fa.SIGNS, [None, *fresh], result["n"], result["seed"])
    model = []
    for cell, row in zip(cells, result["cells"]):
        assert [cell[k] for k in ("spread", "signs", "steps", "fresh_every")] == \
            [row[k] for k in ("spread", "signs", "steps", "fresh_every")]
        ref, abs_sum = fa.reference(cell["a"], cell["b"])
        prods = fa.products(cell["a"], cell["b"])
        at_fit = fa.error_stats(fa.simulate(prods, 13, "nearest", cell["fresh_every"]), ref, abs_sum)
        sim = fa.simulate(prods, fa.BITS_KEPT, "truncate", cell["fresh_every"])
        del prods
        err = (sim - ref).abs()
        bound = fa.accumulation_bound(*fa.step_sums(cell["a"], cell["b"]), fa.BITS_KEPT, cell["fresh_every"])
        model.append(dict(stats=fa.error_stats(sim, ref, abs_sum), at_fit=at_fit,
                          over_bound=float((err / bound).max())))
    return {"result": result, "model": model}


def test_the_committed_cells_are_drawn_again_exactly(h200):
    """The operands drawn again on the CPU are the H200's: the JSON's model statistics (nearest, b = 13, the probe's
    fit) come back to the last digit."""
    for row, m in zip(h200["result"]["cells"], h200["model"]):
        for k in ("q50", "q99", "max"):
            assert m["at_fit"][k] == pytest.approx(row[f"model_{k}"], rel=1e-6, abs=1e-12), (row, k)


def test_truncation_at_14_bits_reproduces_the_positive_cells_the_fit_under_reads(h200):
    """Cell by cell the rule is truncate, b = 14: the all-positive one-accumulator cells of 2 steps or more (where the
    running sum is the largest addend) match in median, p99 and max within 10% (20% at 2 steps), and the mixed cells
    within a summed distance of 5. The red twin: the probe's fit (nearest, b = 13) is 2.5x or more low on the
    positive cells of 8 and 16 steps."""
    mixed = 0.0
    for row, m in zip(h200["result"]["cells"], h200["model"]):
        meas = {k: row[f"measured_{k}"] for k in ("q50", "q99", "max", "bias")}
        if row["signs"] == "mixed":
            mixed += fa.distance(m["stats"], meas)
        elif row["fresh_every"] is None and row["steps"] >= 2 and meas["q50"] > 0:
            for k in ("q50", "q99", "max"):
                assert m["stats"][k] == pytest.approx(meas[k], rel=0.2 if row["steps"] == 2 else 0.1), (row, k)
            assert m["stats"]["bias"] == meas["bias"] == -1.0  # always low: truncation
            if row["steps"] >= 8:  # red twin: the probe's fit under-reads the accumulator's growth
                assert meas["q50"] > 2.5 * m["at_fit"]["q50"], row
    assert mixed < 5.0, mixed


def test_the_accumulation_bound_holds_over_every_measured_cell(h200):
    """`accumulation_bound` at b = 14 against every cell of the H200's run: the rule's model stays within 0.5 of the
    bound on every output of every cell; the measured max is below the bound's 1st percentile over the cell's
    outputs by 1.25x or more everywhere, and below its smallest value in all cells but two (spread 8, positive, 1 and
    2 steps: >= 0.8 of it), which the model reproduces and the bound holds output by output."""
    assert max(m["over_bound"] for m in h200["model"]) <= 0.5
    rows = fa.bound_table(h200["result"])
    assert len(rows) == 66
    assert min(r["margin_q01"] for r in rows) >= 1.25, min(rows, key=lambda r: r["margin_q01"])
    below_min = [r for r in rows if r["margin_min"] < 1]
    assert [(r["spread"], r["signs"], r["steps"], r["fresh_every"]) for r in below_min] == \
        [(8, "positive", 1, None), (8, "positive", 2, None)]
    assert min(r["margin_min"] for r in rows) >= 0.8
    worst = next(r for r in rows
                 if (r["spread"], r["signs"], r["steps"], r["fresh_every"]) == (8, "positive", 16, None))
    assert worst["measured_max"] == pytest.approx(9.55e-3, rel=1e-2) and worst["margin_min"] > 2


@pytest.mark.parametrize("twin", ["b + 4", "one loss per add", "running sum per add"])
def test_red_twins_fail_on_the_positive_cells(h200, twin):
    """The check can fail: the same bound at b + 4 = 18, the bound without the per-addend count (lanes=1: one grid
    step lost per add), and the earlier term 2^-13 x the running sum of |products| per add (FP8_MMA_BITS_KEPT's
    placeholder) each fall below the measured max on positive cells, where the bound at b = 14 holds."""
    result = h200["result"]
    if twin == "running sum per add":
        rows = []
        cells = fa.grid_cells(result["trials"], fa.STEPS, fa.SPREADS, fa.SIGNS, [None, 1, 4], result["n"],
                              result["seed"])
        for cell, row in zip(cells, result["cells"]):
            _, abs_sums, _ = fa.step_sums(cell["a"], cell["b"])
            f = cell["fresh_every"] or cell["steps"]
            groups = abs_sums.view(*abs_sums.shape[:-1], -1, f)
            rel = 2.0**-13 * groups.cumsum(-1).sum((-1, -2)) / abs_sums.sum(-1)
            rows.append(dict(row, margin_q01=float(torch.quantile(rel.flatten(), 0.01)) / row["measured_max"]
                             if row["measured_max"] > 0 else math.inf))
    else:
        rows = fa.bound_table(result, fa.BITS_KEPT + 4) if twin == "b + 4" else fa.bound_table(result, lanes=1)
    failing = [r for r in rows if r["margin_q01"] < 1]
    assert any(r["signs"] == "positive" and r["steps"] == 16 for r in failing), twin
    assert min(r["margin_q01"] for r in rows if r["signs"] == "positive") < 0.35, twin


# --- notebook 02's section (gates.fp8_wgmma): the record's fields, each check with its red twin ---------------------

@pytest.fixture(scope="module")
def committed_record(tmp_path_factory):
    from foldkv.lab import gates
    from foldkv.lab.report import RunRecord

    record = RunRecord("02_correctness_gates", tmp_path_factory.mktemp("rec"))
    return record, gates.fp8_wgmma_committed(record)


def test_section_records_the_committed_rule_and_the_bound_over_every_cell(committed_record):
    """The committed H200 data, labelled with its path: the fitted rule as the probe printed it, the bound's rule
    (truncate, b = 14 per addend), promotion (one accumulator over 16 k32 steps against a fresh one per step) and the
    bound against all 66 cells, computed from the data."""
    from foldkv.lab.gates import fp8_wgmma

    record, summary = committed_record
    assert record.sections[fp8_wgmma.COMMITTED_SECTION] == "ran"
    assert record.results[fp8_wgmma.COMMITTED_SECTION]["source"].endswith(fp8_wgmma.COMMITTED_RUN)
    assert summary["device"] == "NVIDIA H200" and summary["commit"]
    assert summary["rule"]["fitted"] == {"mode": "nearest", "bits_kept": 13, "distance": pytest.approx(769.7, 1e-3)}
    assert (summary["rule"]["bound_rule"]["mode"], summary["rule"]["bound_rule"]["bits_kept"]) == ("truncate", 14)
    pos = summary["promotion"]["positive"]
    assert summary["promotion"]["steps"] == 16 and 40 < pos["one_over_fresh_q50_min"] < pos["one_over_fresh_q50_max"]
    assert summary["bound"]["passed"] and summary["bound"]["cells"] == 66 and not summary["bound"]["cells_failing"]
    assert summary["bound"]["check"].startswith("every cell's measured max")  # quantiles only: no per-output errors
    assert summary["passed"] and len(summary["bound_cells"]) == 66
    text = fp8_wgmma.rule_text(summary)
    assert "nearest, b = 13" in text and "truncate, b = 14" in text and "**holds** over 66 of 66" in text


def test_section_red_twin_a_bound_at_b_plus_4_fails_the_committed_cells(committed_record):
    from foldkv.lab.gates import fp8_wgmma

    _, summary = committed_record
    result = json.loads(H200_RUN.read_text())
    twin = fp8_wgmma.bound_verdict(fa.bound_table(result, fa.BITS_KEPT + 4))
    assert not twin["passed"] and any(c["signs"] == "positive" for c in twin["cells_failing"])
    assert fp8_wgmma.bound_verdict(summary["bound_cells"])["passed"]


def test_section_plot_draws_measured_and_bound(committed_record):
    from foldkv.lab import gates

    fig = gates.plot_fp8_wgmma_bound(committed_record[1], "committed")
    lines = [ln for ax in fig.axes for ln in ax.get_lines()]
    assert len(fig.axes) == 2 and len(lines) == 2 * 3 * 3  # signs x spreads x (measured, smallest, median)


def test_output_bound_check_holds_on_the_rule_and_fails_past_it():
    """Output by output (what a GPU run records): C made by the bound's own rule stays within the bound; the red twin,
    C made with 4 bits fewer kept, exceeds it on all-positive operands."""
    g = torch.Generator().manual_seed(3)
    a, b = fa.draw_operands(2, 16, 8, "positive", generator=g)
    prods = fa.products(a, b)
    ok = fa.output_bound_check(a, b, fa.simulate(prods, fa.BITS_KEPT, "truncate").float(), None)
    assert ok["bound_over_max"] <= 1 and ok["bound_outputs_over"] == 0
    bad = fa.output_bound_check(a, b, fa.simulate(prods, fa.BITS_KEPT - 4, "truncate").float(), None)
    assert bad["bound_over_max"] > 1 and bad["bound_outputs_over"] > 0
    nan = fa.output_bound_check(a, b, torch.full((2, 64, 16), float("nan")), None)
    assert nan["bound_outputs_over"] == 2 * 64 * 16  # an unwritten output counts as over


def test_bound_verdict_uses_each_outputs_check_when_recorded():
    from foldkv.lab.gates import fp8_wgmma

    rows = [{"spread": 0, "signs": "mixed", "steps": 1, "fresh_every": None, "margin_q01": 0.5, "bound_over_max": 0.9},
            {"spread": 8, "signs": "positive", "steps": 16, "fresh_every": None, "margin_q01": 2.0,
             "bound_over_max": 0.4}]
    v = fp8_wgmma.bound_verdict(rows)
    assert v["passed"] and v["check"].startswith("every output")  # the per-output check decides, not the quantile
    rows[1]["bound_over_max"] = 1.01  # red twin: one output past its bound
    v = fp8_wgmma.bound_verdict(rows)
    assert not v["passed"] and v["cells_failing"] == [{"spread": 8, "signs": "positive", "steps": 16,
                                                       "fresh_every": None}]


def test_section_without_cuda_is_not_run(tmp_path):
    from foldkv.lab import gates
    from foldkv.lab.gates import fp8_wgmma
    from foldkv.lab.report import RunRecord

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the section runs (notebook 02, tests/test_fp8_accumulation_gpu.py)")
    record = RunRecord("02_correctness_gates", tmp_path)
    assert gates.accumulation_gate(record, "smoke") is None
    assert record.sections[fp8_wgmma.SECTION] == "not run: no CUDA device"
