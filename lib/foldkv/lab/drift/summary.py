"""The drift study's figures from its results: every series' gaps (arms, pairs, the neutral), their quantiles, argmax
agreement per arm and cell, and the drift line placed above what was measured (descriptive: no check)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
QUANTILES = (0.5, 0.9, 0.99, 1.0)


def is_finite(x) -> bool:
    return x is not None and math.isfinite(x)


def finite_max(values: Sequence[float | None]) -> float:
    """The max of `values`, NaN when any is NaN or None (a NaN written to JSON reads back as None). Python's max()
    keeps a NaN only when it comes first, so a NaN at any later step would otherwise vanish from a maximum."""
    vals = [math.nan if v is None else float(v) for v in values]
    if any(math.isnan(v) for v in vals):
        return math.nan
    return max(vals, default=math.nan)


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """Quantiles of the finite values; `nonfinite` counts the rest (NaN, Inf, None), which the checks fail on."""
    vals = torch.tensor([v for v in values if is_finite(v)], dtype=torch.float64)
    out = {"n": len(values), "nonfinite": sum(1 for v in values if not is_finite(v))}
    for q in QUANTILES:
        key = "max" if q == 1.0 else f"p{q * 100:g}"
        out[key] = float(torch.quantile(vals, q)) if vals.numel() else float("nan")
    return out


def gaps_of(results: dict, series: str) -> list[float]:
    """Every step's gap of one series over all cells: an arm name, a pair name ('a vs b'), or 'neutral'."""
    out: list[float] = []
    for cell in results["cells"]:
        if series == "neutral":
            out += cell["neutral"]
        elif series in cell.get("arms", {}) and cell["arms"][series]["status"] == "ran":
            out += cell["arms"][series]["gap"]
        elif series in cell.get("pairs", {}):
            out += cell["pairs"][series]["gap"]
    return out


def summarize(results: dict) -> dict[str, Any]:
    """Per arm (and pair, and neutral): gap quantiles over every cell and step, argmax agreement overall and per cell."""
    arms = [a for a in results["parameters"]["arms"] if a != "incumbent"]
    pairs = sorted({p for c in results["cells"] for p in c.get("pairs", {})})
    summary: dict[str, Any] = {"neutral": {"gap": quantiles(gaps_of(results, "neutral"))}}
    for name in arms + pairs:
        eq, per_cell, failed = [], [], []
        for i, cell in enumerate(results["cells"]):
            rec = cell.get("arms", {}).get(name) or cell.get("pairs", {}).get(name)
            if rec is not None and rec.get("status", "ran") != "ran":
                failed.append(i)
            if rec is None or rec.get("status", "ran") != "ran":
                continue
            eq += rec["argmax_equal"]
            per_cell.append({"cell": i, "equal": int(sum(rec["argmax_equal"])), "of": len(rec["argmax_equal"])})
        if not eq:
            summary[name] = {"status": results["arm_status"].get(name, "not run")}
            continue
        summary[name] = {
            "status": results["arm_status"].get(name, "ran"),
            "gap": quantiles(gaps_of(results, name)),
            "argmax_equal": int(sum(eq)),
            "argmax_of": len(eq),
            "argmax_agreement": sum(eq) / len(eq),
            "per_cell": per_cell,
            "failed_cells": failed,
        }
    return summary


def _nice_ceil(x: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is >= x."""
    if not x > 0 or math.isinf(x):
        return x
    e = math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if m * 10**e >= x * (1 - 1e-12):
            return float(m * 10**e)
    return float(10 ** (e + 1))


def drift_line(results: dict, headroom: float = 2.0) -> dict[str, Any]:
    """A drift line placed above everything measured, with the reasoning computed from the data. It describes the
    run; it is no check (it sits above every finite gap by construction): `check_study` is.

    line = the 1-2-5 value at or above `headroom` x the largest gap of any arm against the incumbent (and of the
    neutral figure). The headroom is the margin for cells not run; the reasoning compares the line with the neutral
    spread and with the incumbent's top-1/top-2 margins (a step whose margin is below 2 x line could flip argmax
    under a drift of the line's size), and explains every argmax flip observed by its margin."""
    arms = [a for a in results["parameters"]["arms"] if a != "incumbent"]
    worst = {a: finite_max(gaps_of(results, a)) for a in arms if gaps_of(results, a)}
    nan_arms = [a for a in worst if not math.isfinite(worst[a])]
    finite = {a: g for a, g in worst.items() if math.isfinite(g)}
    neutral = [g for g in gaps_of(results, "neutral") if is_finite(g)]
    neutral_max = max(neutral) if neutral else float("nan")
    top = max(list(finite.values()) + ([neutral_max] if neutral else []), default=float("nan"))
    line = _nice_ceil(headroom * top)
    margins = [m for c in results["cells"] for m in c["margin"]]
    near = sum(1 for m in margins if m < 2 * line)
    flips = []
    for i, cell in enumerate(results["cells"]):
        for arm, rec in cell.get("arms", {}).items():
            if rec.get("status") != "ran":
                continue
            for s, ok in enumerate(rec["argmax_equal"]):
                if not ok:
                    flips.append({"cell": i, "arm": arm, "step": s, "margin": cell["margin"][s], "gap": rec["gap"][s],
                                  "explained": cell["margin"][s] <= 2 * rec["gap"][s] + 1e-6})
    lines = []
    if finite:
        a_max = max(finite, key=finite.get)
        lines.append(f"largest gap of any arm vs the incumbent: {finite[a_max]:.3g} ({a_max}); per arm: "
                     + ", ".join(f"{a} {g:.3g}" for a, g in finite.items()))
    if neutral:
        neutral_med = float(torch.tensor(neutral).median())
        lines.append(f"neutral (incumbent walk vs its own single pass): median {neutral_med:.3g}, max {neutral_max:.3g}"
                     + (" (bit-identical here: this model's walk and single pass round the same way)"
                        if neutral_max == 0 else ""))
        for a, g in finite.items():
            med = float(torch.tensor([x for x in gaps_of(results, a) if is_finite(x)]).median())
            if neutral_max > 0 and neutral_med > 0:
                lines.append(f"{a}: median gap {med:.3g} = {med / neutral_med:.3g} x the neutral median;"
                             f" max {g:.3g} = {g / neutral_max:.3g} x the neutral max")
            else:
                lines.append(f"{a}: median gap {med:.3g}, max {g:.3g} (no neutral spread to scale by)")
    lines.append(f"line = 1-2-5 ceiling of {headroom:g} x {top:.3g} = {line:.3g}: above every measured gap")
    if margins:
        lines.append(f"{near} of {len(margins)} steps ({100 * near / len(margins):.1f}%) have an incumbent top-1/top-2"
                     f" margin below 2 x line = {2 * line:.3g}: only there could a drift of the line's size flip argmax"
                     f" (smallest margin {min(margins):.3g})")
    if flips:
        unexplained = [f for f in flips if not f["explained"]]
        lines.append(f"{len(flips)} argmax flips, every one at a margin <= 2 x its gap" if not unexplained else
                     f"{len(flips)} argmax flips, {len(unexplained)} at a margin above 2 x the gap (inconsistent: check)")
    else:
        lines.append("no argmax flip in any arm that ran")
    if nan_arms:
        lines.append(f"NaN/Inf logits in {nan_arms}: those arms read unwritten (poisoned) rows or produced NaN;"
                     " not bounded (the finite check fails them)")
    return {"value": line, "headroom": headroom, "largest_gap": top, "per_arm_max": worst, "neutral_max": neutral_max,
            "steps_with_margin_below_2x_line": near, "flips": flips, "reasoning": lines}
