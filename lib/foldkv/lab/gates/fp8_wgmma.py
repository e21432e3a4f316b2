"""Notebook 02's FP8 wgmma accumulation section: the lab's characterisation (`foldkv.lab.fp8_accumulation`, what
bench/fp8_accumulation_probe.py runs) measured on the GPU, with its fitted rule, where promotion to float32 is needed
and the accumulation bound (`accumulation_bound`, the bound `fp8_tc` holds the FP8 tensor-core decode to) checked
against every cell, into the record; and, on any machine, the committed H200 characterisation read again: its rule,
the bound against every cell's measured max, and a figure of both over the reduction lengths."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import fp8_accumulation as fa
from ..palette import Styles, legend_beside
from .sections import gpu_section

SECTION = "fp8_wgmma_accumulation"  # measured now (GPU)
COMMITTED_SECTION = "fp8_wgmma_accumulation_h200"  # the committed H200 data, the bound computed again here (CPU)
COMMITTED_RUN = "papermill_runs/h200-20261204-s21/fp8_accumulation.json"  # relative to the checkout
SMOKE_GRID = dict(steps=(1, 4, 16), spreads=(0, 8), fresh_every=(1,), trials=4)  # case_set="smoke"


def committed_path(root: str | Path | None = None) -> Path:
    """The committed characterisation's JSON (`COMMITTED_RUN` under `root`, default the checkout holding this file)."""
    base = Path(root) if root is not None else Path(__file__).resolve().parents[4]
    return base / COMMITTED_RUN


def promotion(result: dict) -> dict:
    """Where promotion to float32 is needed, from the error-against-steps table (`fa.steps_table`): per signs, at the
    most steps measured, the median error of one accumulator over a fresh one per k32 step (over the spreads where
    both are nonzero), and whether one accumulator's median grows with the steps where a fresh one's does not."""
    table = fa.steps_table(result)
    most = max(r["steps"] for r in table)
    out = {"steps": most}
    for signs in fa.SIGNS:
        rows = [r for r in table if r["signs"] == signs and r["steps"] == most]
        ratios = [r["ratio_q50"] for r in rows if r["fresh1_q50"] > 0 and math.isfinite(r["ratio_q50"])]
        one_grows = [r for r in rows if r["one_q50"] > r["fresh1_q50"]]
        out[signs] = {"one_over_fresh_q50_min": min(ratios) if ratios else None,
                      "one_over_fresh_q50_max": max(ratios) if ratios else None,
                      "spreads_where_one_errs_more": sorted(r["spread"] for r in one_grows),
                      "spreads": sorted(r["spread"] for r in rows)}
    return out


def rule(result: dict) -> dict:
    """The fitted rule (the least distance over (mode, b): `fa.fit`) beside the rule the bound uses (truncate,
    `fa.BITS_KEPT` bits kept per addend, read cell by cell from the H200's data: fp8_accumulation's docstring), with
    each one's summed distance over the cells, so a run that fits the bound's rule better or worse says so."""
    f = result["fit"]
    grid = {(g["mode"], g["bits"]): g["distance"] for g in f.get("grid", [])}
    return {"fitted": {"mode": f["mode"], "bits_kept": f["bits"], "distance": f["distance"]},
            "by_mode": {m: {"bits_kept": v["bits"], "distance": v["distance"]} for m, v in f["by_mode"].items()},
            "bound_rule": {"mode": "truncate", "bits_kept": fa.BITS_KEPT, "counted": "per addend (the accumulator "
                           "and each of a k32 step's 32 products), below the add's largest addend; the add's result "
                           "stored as float32", "distance": grid.get(("truncate", fa.BITS_KEPT))}}


def bound_rows(result: dict) -> list[dict]:
    """Per cell: `fa.bound_table` (the bound relative to sum|a b| over the cell's outputs, operands drawn again, against
    the measured max), with the output-by-output check (`fa.output_bound_check`) where the run recorded it."""
    rows = fa.bound_table(result, result.get("bound_bits") or fa.BITS_KEPT)
    for row, cell in zip(rows, result["cells"]):
        for k in ("bound_over_max", "bound_outputs_over"):
            if k in cell:
                row[k] = cell[k]
    return rows


def bound_verdict(rows: list[dict]) -> dict:
    """The bound's check over every cell. With each output's error (a run of `characterise` with `bound_bits`): every
    output within its bound. Without (a characterisation that kept quantiles only): every cell's measured max below
    the bound's 1st percentile over its outputs (the check tests/test_fp8_accumulation_cpu.py holds the committed data
    to). Returns {"check", "cells", "cells_failing", "worst", "passed"}."""
    per_output = all("bound_over_max" in r for r in rows)
    if per_output:
        failing = [r for r in rows if not r["bound_over_max"] <= 1]
        worst = max(rows, key=lambda r: r["bound_over_max"])
        check = "every output's |error| <= its bound"
    else:
        failing = [r for r in rows if not r["margin_q01"] >= 1]
        worst = min(rows, key=lambda r: r["margin_q01"])
        check = "every cell's measured max <= the bound's 1st percentile over its outputs"
    key = ("spread", "signs", "steps", "fresh_every")
    return {"check": check, "cells": len(rows), "cells_failing": [{k: r[k] for k in key} for r in failing],
            "worst": worst, "passed": not failing}


def summarise(result: dict, source: str) -> dict:
    """What the record keeps of one characterisation: its source, the rule, promotion, the bound per cell and its
    verdict."""
    rows = bound_rows(result)
    return {"source": source, "all_written": result["all_written"], "trials": result["trials"], "n": result["n"],
            "seed": result["seed"], "rule": rule(result), "promotion": promotion(result), "bound_bits":
            result.get("bound_bits") or fa.BITS_KEPT, "bound_cells": rows, "bound": bound_verdict(rows),
            "passed": result["all_written"] and bound_verdict(rows)["passed"]}


def rule_text(summary: dict) -> str:
    """Markdown: the fitted rule, the bound's rule, promotion and the bound's verdict, computed from `summary`."""
    r, p, b = summary["rule"], summary["promotion"], summary["bound"]
    fitted, used = r["fitted"], r["bound_rule"]
    lines = [f"Source: `{summary['source']}` ({summary['trials']} trials a cell, seed {summary['seed']}).",
             f"- Fitted (least distance): **{fitted['mode']}, b = {fitted['bits_kept']}** (distance "
             f"{fitted['distance']:.3g}); by mode: " + "; ".join(f"{m} b = {v['bits_kept']} ({v['distance']:.3g})"
                                                                 for m, v in r["by_mode"].items()) + ".",
             f"- The bound's rule: **{used['mode']}, b = {used['bits_kept']} bits kept {used['counted']}** "
             f"(summed distance {used['distance']:.3g})." if used["distance"] is not None else
             f"- The bound's rule: **{used['mode']}, b = {used['bits_kept']}** (not in this fit's grid).",
             ]
    for signs in fa.SIGNS:
        s = p.get(signs, {})
        if s.get("one_over_fresh_q50_min") is not None:
            lines.append(f"- Promotion, {signs} signs: one accumulator over {p['steps']} k32 steps errs "
                         f"{s['one_over_fresh_q50_min']:.3g}-{s['one_over_fresh_q50_max']:.3g}x a fresh one per step "
                         f"added in float32 (median; spreads {s['spreads_where_one_errs_more']} of {s['spreads']} "
                         f"where one errs more).")
    w = b["worst"]
    worst = (f"bound_over_max {w['bound_over_max']:.3g}" if "bound_over_max" in w else
             f"1st percentile / measured max {w['margin_q01']:.3g}")
    lines.append(f"- The bound at b = {summary['bound_bits']} ({b['check']}): **{'holds' if b['passed'] else 'FAILS'}"
                 f"** over {b['cells'] - len(b['cells_failing'])} of {b['cells']} cells; tightest cell spread "
                 f"{w['spread']}, {w['signs']}, {w['steps']} steps, fresh every {w['fresh_every']}: {worst}.")
    return "\n".join(lines)


def accumulation_gate(record, case_set: str = "full", seed: int = 0) -> dict | None:
    """GPU gate: `fa.characterise` on this machine's GPU (the probe's full grid; `case_set="smoke"`: SMOKE_GRID),
    each output checked against the bound; records SECTION with `summarise`'s fields (not run without CUDA or off
    sm_90, with the reason) and returns them."""
    from ..arms import ArmUnavailable

    if not gpu_section(record, SECTION):
        return None
    grid = {} if case_set == "full" else SMOKE_GRID
    try:
        result = fa.characterise("cuda", seed=seed, **grid)
    except ArmUnavailable as exc:
        record.not_run(SECTION, str(exc))
        print(record.sections[SECTION])
        return None
    summary = summarise(result, "measured now")
    record.ran(SECTION, **summary)
    return summary


def committed_section(record, path: str | Path | None = None) -> dict:
    """CPU gate over the committed H200 characterisation (`COMMITTED_RUN`): its rule, promotion and the bound against
    every cell's measured max, the operands drawn again and the bound computed here; records COMMITTED_SECTION
    (labelled by its source path) and returns `summarise`'s fields."""
    path = Path(path) if path is not None else committed_path()
    result = json.loads(path.read_text())
    summary = summarise(result, f"committed H200 data, {COMMITTED_RUN if path == committed_path() else path}")
    summary["device"] = result.get("environment", {}).get("device_name")
    summary["commit"] = result.get("provenance", {}).get("git_commit")
    record.ran(COMMITTED_SECTION, **summary)
    return summary


def plot_bound(summary: dict, title: str):
    """Measured max relative error (|C - ref| / sum|a b|) against the bound's smallest value and median over the
    outputs, by k32 steps (K = 32 x steps), one accumulator, one panel per signs, a colour per spread (no arm: the
    palette's fallback colours; measured solid, bound dashed, bound median dotted)."""
    import matplotlib.pyplot as plt

    rows = [r for r in summary["bound_cells"] if r["fresh_every"] is None]
    fig, axes = plt.subplots(1, len(fa.SIGNS), figsize=(13, 4.3), sharey=True, layout="constrained")
    st = Styles()
    floor = 2.0**-30  # an exact cell (error 0) drawn at the floor of the log axis
    for ax, signs in zip(axes, fa.SIGNS):
        for spread in sorted({r["spread"] for r in rows}):
            cell = sorted((r for r in rows if r["signs"] == signs and r["spread"] == spread), key=lambda r: r["steps"])
            k = [32 * r["steps"] for r in cell]
            name = f"spread {spread}"
            ax.plot(k, [max(r["measured_max"], floor) for r in cell], label=f"{name}: measured max",
                    **st.line(name, marker="o", linestyle="-"))
            ax.plot(k, [r["bound_min"] for r in cell], label=f"{name}: bound, smallest",
                    **st.line(name, marker="v", linestyle="--"))
            ax.plot(k, [r["bound_q50"] for r in cell], alpha=0.6, **st.line(name, marker="None", linestyle=":"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("reduction length K (32 x k32 steps), one accumulator")
        ax.set_title(f"{signs} signs")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("|error| / sum|a b|  (dotted: bound median; exact: at 2^-30)")
    legend_beside(fig, axes[-1:])
    fig.suptitle(title, fontsize=10)
    return fig


__all__ = ["SECTION", "COMMITTED_SECTION", "COMMITTED_RUN", "SMOKE_GRID", "committed_path", "promotion", "rule",
           "bound_rows", "bound_verdict", "summarise", "rule_text", "accumulation_gate", "committed_section",
           "plot_bound"]
