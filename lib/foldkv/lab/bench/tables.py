"""Reading a results document: the series of one arm, markdown tables, the prediction written before timing, and
per-cell verdicts and conclusions computed from the data (no typed numbers)."""

from __future__ import annotations

from typing import Any, Sequence

from foldkv import floor
from foldkv.config import GEMMA4_31B, AttentionGeometry


def cells_of(results: dict, prefix: str) -> list[dict]:
    return [c for c in results.get("cells", []) if str(c.get("cell", "")).startswith(prefix)]


def arm_names(results: dict, prefix: str = "") -> list[str]:
    names: list[str] = []
    for c in cells_of(results, prefix):
        for n in c.get("arms", {}):
            if n not in names:
                names.append(n)
    return names


def series(results: dict, prefix: str, arm: str, field: str = "us", stat: str = "median") -> tuple[list, list]:
    """(contexts, values) of one arm across the cells whose name starts with `prefix` (arms that ran only)."""
    xs, ys = [], []
    for c in sorted(cells_of(results, prefix), key=lambda c: c["context"]):
        a = c.get("arms", {}).get(arm, {})
        v = a.get(field)
        if a.get("status") == "ok" and v is not None:
            xs.append(c["context"])
            ys.append(v[stat] if isinstance(v, dict) else v)
    return xs, ys


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def arm_cell_text(arm: dict, kind: str = "decode") -> str:
    """One table cell: 'µs median [p10–p90] · % of roof', or the reason the arm did not run."""
    st = arm.get("status")
    if st != "ok":
        return f"{st}: {str(arm.get('reason', ''))[:90]}"
    us = arm["us"]
    txt = f"{_fmt(us['median'])} µs [{_fmt(us['p10'])}–{_fmt(us['p90'])}]"
    if kind == "prefill" and arm.get("tflops"):
        txt += f" · {_fmt(arm['tflops']['median'])} TFLOP/s"
        if arm.get("pct_matmul_roof") is not None:
            txt += f" ({_fmt(arm['pct_matmul_roof'], '.0f')}% mm)"
    elif arm.get("pct_roof"):
        txt += f" · {_fmt(arm['pct_roof']['median'], '.0f')}% roof"
    if arm.get("timing") and arm["timing"] != "cuda graph":
        txt += f" ({arm['timing']})"
    if arm.get("check") and not arm["check"].get("ok"):
        txt += " ⚠ check failed"
    return txt


def markdown_table(results: dict, prefix: str, arms: Sequence[str] | None = None) -> str:
    """A markdown table of the cells starting with `prefix`: one row per cell, one column per arm."""
    cells = cells_of(results, prefix)
    arms = list(arms or arm_names(results, prefix))
    head = "| cell | context | batch | " + " | ".join(arms) + " |"
    lines = [head, "|" + "---|" * (3 + len(arms))]
    for c in cells:
        kind = c.get("kind", "decode")
        row = [c["cell"], str(c.get("context")), str(c.get("batch"))]
        if c.get("error"):
            row += [f"cell error: {c['error'][:90]}"] + [""] * (len(arms) - 1)
        else:
            row += [arm_cell_text(c["arms"].get(a, {"status": "not run", "reason": "not requested"}), kind)
                    for a in arms]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def prediction_table(seq_lens_list: Sequence[Sequence[int]], roof_gbps: float | None,
                     geom: AttentionGeometry = GEMMA4_31B) -> str:
    """Written before timing: each case's bytes per format and the floor (bytes / roof) they imply, and the most a
    bandwidth-bound folded step can gain over a split one (the byte ratio)."""
    lines = ["| case | split MB | folded MB | split floor µs | folded floor µs | byte ratio split/folded |",
             "|---|---|---|---|---|---|"]
    for lens in seq_lens_list:
        sb, fb = (floor.step_bytes(geom, f, lens)["total"] for f in ("split", "folded"))
        fl = (lambda b: f"{b / (roof_gbps * 1e3):.1f}") if roof_gbps else (lambda b: "–")
        name = str(lens[0]) if len(lens) == 1 else f"{len(lens)} x ~{sum(lens) // len(lens)}"
        lines.append(f"| {name} | {sb / 1e6:.1f} | {fb / 1e6:.1f} | {fl(sb)} | {fl(fb)} | {sb / fb:.3f} |")
    return "\n".join(lines)


def best_folded(cell: dict) -> str | None:
    """The fastest folded generated arm that ran and passed its check."""
    ok = [(a["us"]["median"], n) for n, a in cell.get("arms", {}).items()
          if a.get("status") == "ok" and a.get("generated") and a.get("format") == "folded" and a["check"]["ok"]]
    return min(ok)[1] if ok else None


def verdicts(results: dict) -> list[dict]:
    """Per cell: the best folded arm against every peer that ran, with the ratio and, where folded is not ahead, a
    reason read off the data."""
    out = []
    roof = results.get("roof", {}).get("read", {}).get("gbps")
    for c in results.get("cells", []):
        f = best_folded(c)
        v: dict[str, Any] = {"cell": c["cell"], "kind": c.get("kind"), "context": c.get("context"),
                             "batch": c.get("batch"), "folded": f, "behind": [], "ahead": []}
        if f is None:
            why = c.get("error") or "; ".join(f"{n}: {a.get('status')} ({str(a.get('reason', a.get('warning', '')))[:80]})"
                                              for n, a in c.get("arms", {}).items()
                                              if a.get("generated") and a.get("format") == "folded")
            v["note"] = f"no folded arm ran and passed its check: {why or 'none requested'}"
            out.append(v)
            continue
        fa = c["arms"][f]
        for n, a in c["arms"].items():
            if not a.get("peer") or a.get("status") != "ok":
                continue
            sp = c["speedup"][f][n]
            entry = {"peer": n, "speedup": sp["ratio_of_medians"], "paired_p10": sp["paired"]["p10"],
                     "paired_p90": sp["paired"]["p90"]}
            if sp["ratio_of_medians"] > 1.0 and (sp["paired"]["p10"] or 0) > 1.0:
                v["ahead"].append(entry)
            else:
                reasons = []
                if sp["ratio_of_medians"] > 1.0:
                    reasons.append("ahead on the median but not in every round (p10 of the paired ratio ≤ 1)")
                if fa.get("floor_us") and fa["us"]["median"] > 3 * fa["floor_us"]:
                    reasons.append(f"folded runs at {fa['us']['median'] / fa['floor_us']:.1f}x its byte floor "
                                   f"({fa['floor_us']:.1f} µs): latency/overhead-bound, not bandwidth-bound")
                if a.get("pct_roof") and fa.get("pct_roof") and a["pct_roof"]["median"] > fa["pct_roof"]["median"]:
                    reasons.append(f"{n} reaches {a['pct_roof']['median']:.0f}% of roof on its own bytes vs folded's "
                                   f"{fa['pct_roof']['median']:.0f}%")
                if c.get("kind") == "prefill":
                    reasons.append("prefill is compute-bound: the fold saves bytes, not FLOPs")
                entry["reason"] = "; ".join(reasons) or "no reason visible in the data"
                v["behind"].append(entry)
        out.append(v)
    return out


def conclusions(results: dict) -> list[str]:
    """Sentences computed from a results document (no typed numbers): roof, single-request and batch summaries,
    and every cell where folded is not ahead of every peer, with the reason read off the data."""
    lines = []
    env, roof = results.get("env", {}), results.get("roof", {})
    rd = roof.get("read", {})
    if rd.get("gbps"):
        end = roof.get("read_end", {}).get("gbps")
        lines.append(f"Read roof on {env.get('device_name')}: {rd['gbps']:.0f} GB/s ({rd['method']})"
                     + (f", {end:.0f} GB/s at the end of the run" if end else "") + ".")
    if results.get("mode") != "gpu":
        lines.append(f"These timings come from mode={results.get('mode')!r} on {env.get('device_name')}: they check the "
                      "pipeline, they are not a benchmark.")
    for v in verdicts(results):
        c = next(c for c in results["cells"] if c["cell"] == v["cell"])
        if v["folded"] is None:
            lines.append(f"{v['cell']}: {v['note']}.")
            continue
        fa = c["arms"][v["folded"]]
        if c.get("kind") == "prefill" and fa.get("tflops"):  # compute-bound: against the measured bf16 MMA rate
            pct = f", {fa['tflops']['median']:.0f} TFLOP/s" + (
                f" ({fa['pct_matmul_roof']:.0f}% of the measured bf16 matmul rate)" if fa.get("pct_matmul_roof") else "")
        else:
            pct = f", {fa['pct_roof']['median']:.0f}% of roof" if fa.get("pct_roof") else ""
        head = f"{v['cell']} (context {v['context']}, batch {v['batch']}): {v['folded']} {fa['us']['median']:.1f} µs{pct}"
        if v["ahead"]:
            head += "; ahead of " + ", ".join(f"{e['peer']} {e['speedup']:.2f}x" for e in v["ahead"])
        if v["behind"]:
            head += "; NOT ahead of " + ", ".join(f"{e['peer']} ({e['speedup']:.2f}x: {e['reason']})" for e in v["behind"])
        if not v["ahead"] and not v["behind"]:
            head += "; no peer ran"
        if v["cell"].startswith(("single/", "batch/")):
            head += ". All arms: " + ", ".join(
                f"{n} {a['us']['median']:.1f} µs" + (f" ({a['pct_roof']['median']:.0f}% roof)" if a.get("pct_roof") else "")
                for n, a in c["arms"].items() if a.get("status") == "ok")
        lines.append(head + ".")
    not_run = sorted({f"{n}: {a.get('status')} ({str(a.get('reason'))[:120]})" for c in results.get("cells", [])
                      for n, a in c.get("arms", {}).items() if a.get("status") != "ok"})
    for s in not_run:
        lines.append(f"Arm {s}.")
    return lines
