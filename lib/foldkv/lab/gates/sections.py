"""Notebook 02's bf16 kernel sections and its verdict: every case in every format into the record (JIT against the
reference, AOT == JIT, folded vs split), a prefill's last row against a decode of that token, the tables and figure
of those rows, and the verdict over every section. `gpu_section`: what every GPU section does without CUDA."""

from __future__ import annotations

import sys

import torch

from ...config import GEMMA4_31B, AttentionGeometry
from ...layout import KvFormat
from ..palette import Styles, legend_beside
from .checks import (ABS_TOL, FRO_TOL, REL_TOL, agree, arm_for, decode_arm, prefill_arm, reference_with_scales,
                     run_case, summary_row)
from .fold import FOLD_CASE_RATIO, FOLD_MEAN_RATIO, folded_vs_split, folded_vs_split_overall, unrounded_truth
from .geometry import gate_geometry
from .inputs import Case, GateInputs, make_inputs, poisoned_outputs


def gpu_section(record, section: str) -> bool:
    """True when a CUDA device is here; otherwise the section is recorded (and printed) as not run."""
    if record.cuda_or_not_run(section):
        return True
    print(record.sections[section])
    return False


def run_kernel_gates(cases: list[Case], formats, backends, seed: int, build_dir: str | None, record,
                     section: str, geom: AttentionGeometry | str = GEMMA4_31B) -> None:
    """GPU gate: every case in every format through the JIT launchers against the float64 reference (`run_case`),
    AOT against JIT bit for bit when "aot" is in `backends` and `build_dir` holds a build, and folded against split
    against the unrounded truth when both formats run. Appends the rows to `record.results["gates"]` and
    `["folded_vs_split"]` (with `["folded_vs_split_overall"]` over every pair so far) and records `section` as ran,
    or as not run without CUDA. `geom`: the pools' geometry (`make_inputs`); `build_dir` must be a build for it."""
    from tqdm import tqdm

    from ...aot import use_build

    geom = gate_geometry(geom)  # an unknown geometry, or one no kernel serves, is refused even where CUDA is not
    if not gpu_section(record, section):
        return
    fmts = [KvFormat.parse(f) for f in formats]
    with_aot = "aot" in backends and build_dir is not None
    if with_aot:
        use_build(build_dir)
    gate_rows, pair_rows = record.results.setdefault("gates", []), []
    for case in tqdm(cases, desc=section, file=sys.stdout):
        outs, raw = {}, None
        for fmt in fmts:
            inputs = make_inputs(case, fmt, "cuda", seed, raw=raw, geom=geom)
            raw = inputs.raw
            res = run_case(inputs, arm_for(case, "jit"))
            row = summary_row(case, fmt, "jit", res)
            if with_aot:
                res_aot = run_case(inputs, arm_for(case, "aot"))
                row["aot_passed"] = res_aot["passed"]
                row["aot_bit_identical"] = (torch.equal(res_aot["outputs"][0], res["outputs"][0])
                                            and torch.equal(res_aot["outputs"][1], res["outputs"][1]))
            gate_rows.append(row)
            outs[fmt] = res["outputs"][0]
            if fmt is fmts[-1] and len(outs) == 2:
                truth = unrounded_truth(inputs)
                pair = folded_vs_split(outs[KvFormat.FOLDED], outs[KvFormat.SPLIT], truth)
                pair_rows.append({"case": case.name, "kind": case.kind, "tokens": case.tokens, **pair})
                del truth
            del inputs, res
            torch.cuda.empty_cache()
    if pair_rows:
        pairs = record.results.setdefault("folded_vs_split", [])
        pairs += pair_rows
        record.results["folded_vs_split_overall"] = folded_vs_split_overall(pairs)
    record.ran(section)


def gates_tables(results: dict, backends) -> str:
    """Markdown of what `run_kernel_gates` recorded: one row per case and format, then folded vs split with the
    overall rule; "" when no GPU gate ran."""
    from ..report import markdown_table

    parts = []
    if results.get("gates"):
        cols = {"case": "case", "kind": "kind", "format": "format", "tokens": "tokens", "batch": "batch",
                "max_abs": "max abs", "rel_fro": "rel err", "lse_max_abs": "lse abs",
                "over_specified_bound": f"elements over {ABS_TOL:g}+{REL_TOL:g}|ref|", "all_written": "written",
                "past_plan_untouched": "past plan untouched", "passed": "pass"}
        if "aot" in backends:
            cols["aot_bit_identical"] = "AOT == JIT"
        parts.append(markdown_table(results["gates"], cols, {"max_abs": ".2e", "rel_fro": ".2e", "lse_max_abs": ".1e"}))
    if results.get("folded_vs_split"):
        overall = results["folded_vs_split_overall"]
        parts += ["**folded vs split** (each against the unrounded truth)",
                  markdown_table(results["folded_vs_split"], ["case", "kind", "tokens", "rel_split_vs_truth",
                                 "rel_folded_vs_truth", "ratio", "max_abs_folded_minus_split", "passed"],
                                 {"rel_split_vs_truth": ".2e", "rel_folded_vs_truth": ".2e", "ratio": ".3f",
                                  "max_abs_folded_minus_split": ".2e"}),
                  f"Over {overall['cases']} cases the folded/split error ratio has geometric mean "
                  f"{overall['geomean_ratio']:.3f} (range {overall['min_ratio']:.2f} to {overall['max_ratio']:.2f}); "
                  f"the gate asks <= {FOLD_MEAN_RATIO} overall and <= {FOLD_CASE_RATIO} per case: "
                  f"{'pass' if overall['passed'] else 'FAIL'}"]
    return "\n\n".join(parts)


def plot_errors(gate_rows: list[dict]):
    """Relative Frobenius error and max |d| of every gate row against the tokens in its batch, per format and kind,
    with the Frobenius bound (a format in its palette colour, decode dots and prefill squares): the matplotlib figure,
    or None when no row is given."""
    if not gate_rows:
        return None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.3), layout="constrained")
    st = Styles()
    for fmt in dict.fromkeys(r["format"] for r in gate_rows):
        for kind, marker in (("decode", "o"), ("prefill", "s")):
            rs = [r for r in gate_rows if r["format"] == fmt and r["kind"] == kind]
            for ax, key in zip(axes, ("rel_fro", "max_abs")):
                ax.scatter([r["tokens"] for r in rs], [r[key] for r in rs], alpha=0.8, label=f"{fmt} {kind}",
                           **st.scatter(fmt, marker=marker))
    axes[0].axhline(FRO_TOL, label="bound", **st.line("bound", marker="None"))
    for ax, title in zip(axes, ["relative Frobenius error", "max |Δ|"]):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens in the batch")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    legend_beside(fig, axes)
    return fig


def last_row_gate(formats, seed: int, record, geom: AttentionGeometry | str = GEMMA4_31B) -> list[dict]:
    """GPU gate: the last row of a prefill and a decode of the same token agree (`agree`), per format. Records
    `prefill_last_row_vs_decode` (not run without CUDA) and returns its rows."""
    geom = gate_geometry(geom)
    if not gpu_section(record, "prefill_last_row_vs_decode"):
        return []
    rows = []
    for fmt in map(KvFormat.parse, formats):
        case = Case("last-row", (1000, 4097), q_lens=(77, 1))
        inputs = make_inputs(case, fmt, "cuda", seed, geom=geom)
        out_p, _ = prefill_arm("jit")(inputs, *poisoned_outputs(78, geom, "cuda", pad_rows=0))
        last = torch.tensor([76, 77], device="cuda")
        dec = GateInputs(Case("last-row-decode", case.seq_lens), inputs.format, inputs.pool, inputs.table,
                         inputs.query[last].contiguous(), None)
        out_d, _ = decode_arm("jit")(dec, *poisoned_outputs(2, geom, "cuda", pad_rows=0))
        ref, _, pv_abs = reference_with_scales(dec.pool, dec.query, dec.table)
        rows.append({"format": fmt.value, **agree(out_p[last], out_d, ref, pv_abs)})
    record.ran("prefill_last_row_vs_decode", rows=rows, passed=all(r["passed"] for r in rows))
    return rows


def record_verdict(record) -> list[dict]:
    """The verdict over every section of the record: "pass" / "FAIL" per gate that ran (the kernel gates from their
    rows, folded vs split included; the others from their `passed`), "FAIL" for a failed section, the status for one
    not run or redrawn from an earlier run (judged by that run: its verdict is computed again from its rows where it is
    shown). A gate that ran and failed becomes a failed section; `results["verdict"]` and
    `results["all_run_gates_pass"]` (over the gates that ran here) are set. Returns the verdict rows."""
    from ..report import REDRAWN_FROM

    gate_rows = record.results.get("gates", [])
    pair_rows = record.results.get("folded_vs_split", [])
    verdict = []
    for section, status in record.sections.items():
        res = record.results.get(section, {})
        if status == "ran" and section in ("decode_gates", "prefill_gates"):
            kind = section.split("_")[0]
            rs = [r for r in gate_rows if r["kind"] == kind]
            ok = all(r["passed"] for r in rs) and all(r.get("aot_bit_identical", True) for r in rs)
            ok = ok and all(p["passed"] for p in pair_rows if p["kind"] == kind)
            ok = ok and (not pair_rows or folded_vs_split_overall(pair_rows)["passed"])
            over = sum(r["over_specified_bound"] for r in rs)
            verdict.append({"gate": section, "status": "pass" if ok else "FAIL", "cases": len(rs),
                            "note": f"{over} of {sum(r['elements'] for r in rs)} elements over the specified bound alone"})
        elif status.startswith("failed"):
            verdict.append({"gate": section, "status": "FAIL", "cases": ""})
        elif status == "ran":
            verdict.append({"gate": section, "status": "pass" if res.get("passed", True) else "FAIL", "cases": ""})
        else:
            verdict.append({"gate": section, "status": status, "cases": ""})
    for v in verdict:  # a gate that ran and failed is a failed section in the batch summary
        if v["status"] == "FAIL" and record.sections.get(v["gate"]) == "ran":
            record.failed(v["gate"], "the gate ran and failed: see its table")
    record.results["verdict"] = verdict
    record.results["all_run_gates_pass"] = all(v["status"] == "pass" for v in verdict
                                               if not v["status"].startswith(("not run", REDRAWN_FROM)))
    return verdict
