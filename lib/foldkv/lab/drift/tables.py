"""The drift study's markdown: the model and arms that ran, one cell step by step, the summary per series, argmax
agreement per cell, the drift line with its reasoning, and the checks against their limits."""

from __future__ import annotations


def checks_table(checks: dict) -> str:
    """Markdown: per section pass / FAIL / not checked, the gap quantiles against their limits, the argmax test."""
    rows = ["| section | result | gap p50 / p90 / max (limit) | argmax: arm-only vs neutral-only flips (P) | failures |",
            "|---|---|---|---|---|"]
    for name, sec in checks["sections"].items():
        result = {True: "pass", False: "FAIL", None: "not checked"}[sec["passed"]]
        gap = " / ".join(f"{v['arm']:.3g} ({v['limit']:.3g})" for v in sec["gap"].values()) if "gap" in sec else ""
        am = sec.get("argmax", "")
        am = f"{am['arm_only_flips']} vs {am['neutral_only_flips']} (P {am['p']:.2g})" if isinstance(am, dict) else am
        why = "; ".join(sec["failures"]) or sec.get("status", "")
        if "gated" in sec and not sec["gated"]:
            result += " (gap, argmax not gated)"
            why = "; ".join([why] * bool(why) + [f"not gated: {x}" for x in sec["not_gated_over"]])
        rows.append(f"| {name} | {result} | {gap} | {am} | {why} |")
    return "\n".join(rows)


def cell_table(results: dict, index: int) -> str:
    """A markdown table of one cell: per step the incumbent's margin, the neutral gap, each arm's gap (with '✗' when
    its argmax differs from the incumbent's)."""
    cell = results["cells"][index]
    ran = [a for a, r in cell["arms"].items() if r.get("status") == "ran"]
    head = ["step", "margin", "neutral"] + ran + list(cell.get("pairs", {}))
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in range(cell["steps"] + 1):
        vals = [str(s) if s else "0 (prefill)", f"{cell['margin'][s]:.3g}", f"{cell['neutral'][s]:.3g}"]
        for a in ran:
            r = cell["arms"][a]
            vals.append(f"{r['gap'][s]:.3g}" + ("" if r["argmax_equal"][s] else " ✗"))
        for p, r in cell.get("pairs", {}).items():
            vals.append(f"{r['gap'][s]:.3g}" + ("" if r["argmax_equal"][s] else " ✗"))
        rows.append("| " + " | ".join(vals) + " |")
    not_ran = {a: r["status"] for a, r in cell["arms"].items() if r.get("status") != "ran"}
    title = (f"**cell {index}** ({cell['group']}): prompt {cell['prompt_index']}, length {cell['length']}, "
             f"{cell['steps']} decode steps" + (f"; failed: {not_ran}" if not_ran else ""))
    return title + "\n\n" + "\n".join(rows)


def summary_table(results: dict) -> str:
    """Markdown: per series the gap quantiles and argmax agreement (arms, pairs, neutral)."""
    rows = ["| series | status | argmax agree | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|---|"]
    for name, rec in results["summary"].items():
        if "gap" not in rec:
            rows.append(f"| {name} | {rec.get('status', '')} | | | | | |")
            continue
        q = rec["gap"]
        agree = f"{rec['argmax_equal']}/{rec['argmax_of']}" if "argmax_equal" in rec else "-"
        status = rec.get("status", "") if name != "neutral" else "incumbent walk vs single pass"
        rows.append(f"| {name} | {status} | {agree} | {q['p50']:.3g} | {q['p90']:.3g} | {q['p99']:.3g} | {q['max']:.3g} |")
    return "\n".join(rows)


def model_summary(results: dict) -> str:
    """Markdown: which model ran (a synthetic checkpoint says so), its geometry and software, each arm's status and
    the cells."""
    from ... import __version__

    info, p = results["model"], results["parameters"]
    kind = (f"a SYNTHETIC checkpoint (seed {info['seed']}; random weights, 31B global-attention geometry)"
            if info["kind"] == "synthetic" else "the checkpoint at " + info["path"])
    lines = [f"**Model:** {kind}", "",
             f"`{info['class']}` from `{info['path']}`: {info['num_hidden_layers']} layers ({len(info['global_layers'])}"
             f" global: {info['global_layers']}), hidden {info['hidden_size']}, vocab {info['vocab_size']}; global"
             f" geometry {info['geometry']}",
             f"dtype {info['dtype']} on {info['device']} ({info['device_name']}); transformers {info['transformers']},"
             f" torch {info['torch']}, foldkv {__version__}, incumbent attention `{info['attn_implementation']}`", "",
             "**Arms:**"]
    lines += [f"- `{arm}`: {status}" for arm, status in results["arm_status"].items()]
    not_run = [a for a, s in results["arm_status"].items() if s != "ran"]
    lines += ["", f"Arms that did not run here: {not_run if not_run else 'none'}"]
    lines += ["", f"Cells: {len(results['cells'])} (grid {len(p['prompts'])} prompts x lengths {p['lengths']};"
              f" sweep of prompt {p['sweep_prompt']} at {p['sweep_lengths']}), {p['steps']} decode steps each."]
    return "\n".join(lines)


def agreement_per_cell(results: dict) -> str:
    """One line per series: its argmax agreement with the incumbent in every cell, and the cells where it failed."""
    lines = []
    for name, rec in results["summary"].items():
        if "per_cell" in rec:
            failed = f"  failed cells: {rec['failed_cells']}" if rec.get("failed_cells") else ""
            lines.append(f"{name:28s} argmax agreement per cell: "
                         + " ".join(f"{c['cell']}:{c['equal']}/{c['of']}" for c in rec["per_cell"]) + failed)
    return "\n".join(lines)


def drift_line_text(results: dict) -> str:
    """Markdown: the drift line, its reasoning, and a table of every argmax flip."""
    dl = results["drift_line"]
    text = f"**Drift line: max |Δ logit| ≤ {dl['value']:.3g}**\n\n" + "\n".join(f"- {r}" for r in dl["reasoning"])
    if dl["flips"]:
        text += "\n\n" + "\n".join(["| cell | arm | step | margin | gap |", "|---|---|---|---|---|"] +
                                   [f"| {f['cell']} | {f['arm']} | {f['step']} | {f['margin']:.3g} | {f['gap']:.3g} |"
                                    for f in dl["flips"]])
    return text


def checks_text(checks: dict) -> str:
    """Markdown: the neutral quantiles and slack the limits are built from, then `checks_table`."""
    n = checks["neutral"]
    return (f"neutral gap p50 / p90 / max: {n['p50']:.3g} / {n['p90']:.3g} / {n['max']:.3g}; slack {checks['slack']:.3g}"
            f" ({checks['slack_note']})\n\n" + checks_table(checks))
