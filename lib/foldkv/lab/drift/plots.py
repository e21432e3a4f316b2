"""The drift study's figures (matplotlib, optional): the gap distribution of every series (histogram and CDF) and
the gap against the decode step and the prompt length, each with the drift line; every series in its
`foldkv.lab.palette` style (the neutral black and thick, the drift line a limit's dark red dashes)."""

from __future__ import annotations

import math

import torch

from ..palette import Styles, legend_beside
from .summary import gaps_of, is_finite


def _plot_series(results: dict) -> tuple[dict[str, list], float, float]:
    """({series: gaps} for every arm that ran and the neutral, the floor zero gaps are drawn at, the drift line)."""
    ran = [a for a in results["parameters"]["arms"] if results["arm_status"].get(a) == "ran"]
    series = {a: gaps_of(results, a) for a in ran}
    series["neutral"] = gaps_of(results, "neutral")
    positive = [g for v in series.values() for g in v if is_finite(g) and g > 0]
    floor = min(positive) / 2 if positive else 1e-8  # a log axis has no 0: exact zeros are drawn at this floor
    return series, floor, results["drift_line"]["value"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"matplotlib is not installed ({exc}): plots skipped, the tables hold every number")
        return None
    return plt


def plot_gap_distribution(results: dict, path: str | None = None):
    """Histogram and CDF (log scale) of every series' gaps, with the drift line; saved to `path` when given. Returns
    the figure, or None when matplotlib is missing or no gap is finite."""
    series, floor, line = _plot_series(results)
    finite = [g for v in series.values() for g in v if is_finite(g)]
    plt = _pyplot() if finite else None
    if plt is None:
        return None
    import matplotlib.ticker

    print(f"zero gaps drawn at {floor:.3g}; drift line {line:.3g}")
    fig, (ax_h, ax_c) = plt.subplots(1, 2, figsize=(14, 4.8), layout="constrained")
    st = Styles()
    lo, hi = math.log10(floor), math.log10(max(max(finite), line)) + 0.1
    bins = torch.logspace(lo, hi, 40).tolist()
    for name, v in series.items():
        xs = sorted(max(g, floor) for g in v if is_finite(g))
        ax_h.hist(xs, bins=bins, histtype="step", label=f"{name} (n={len(v)})", **st.step(name))
        ax_c.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name, **st.step(name))
    for ax in (ax_h, ax_c):
        ax.set_xscale("log")
        ax.axvline(line, label=f"drift line {line:.3g}", **st.line("drift line", marker="None"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("max |Δ logit| vs incumbent (neutral: walk vs single pass)")
    ax_h.set_ylabel("steps")
    ax_c.set_ylabel("fraction of steps ≤ x")
    ax_h.set_title("histogram")
    ax_c.set_title("CDF")
    return _laid_out(fig, path, legend_from=ax_h)


def _laid_out(fig, path: str | None, legend_from):
    """The figure with the legend of the panel `legend_from` beside its panels (outside the data; each series is
    one colour on every panel), saved to `path` when given (the run folder keeps the PNG), returned."""
    legend_beside(fig, [legend_from])
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig


def plot_gap_vs_step_and_length(results: dict, path: str | None = None):
    """Per series: the max (and, dotted, the median over cells) gap at each decode step, and the max gap over the
    steps at each prompt length, with the drift line; saved to `path` when given. Returns the figure, or None when
    matplotlib is missing or no gap is finite."""
    series, floor, line = _plot_series(results)
    steps = results["parameters"]["steps"]
    plt = _pyplot() if any(is_finite(g) for v in series.values() for g in v) else None
    if plt is None:
        return None
    fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(14, 4.8), layout="constrained")
    st = Styles()
    for name in series:
        per_step: list[list[float]] = [[] for _ in range(steps + 1)]
        per_len: dict[int, list[float]] = {}
        for c in results["cells"]:
            v = c["neutral"] if name == "neutral" else (c["arms"].get(name, {}).get("gap") or [])
            for s, g in enumerate(v):
                if is_finite(g):
                    per_step[s].append(max(g, floor))
                    per_len.setdefault(c["length"], []).append(max(g, floor))
        xs = [s for s in range(steps + 1) if per_step[s]]
        ax_s.plot(xs, [max(per_step[s]) for s in xs], markersize=4, label=f"{name} max", **st.line(name))
        ax_s.plot(xs, [sorted(per_step[s])[len(per_step[s]) // 2] for s in xs],
                  **st.line(name, linestyle=":", marker="None", linewidth=1.2))
        lengths = sorted(per_len)
        ax_l.plot(lengths, [max(per_len[n]) for n in lengths], markersize=4, label=f"{name} max over steps",
                  **st.line(name))
    for ax in (ax_s, ax_l):
        ax.set_yscale("log")
        ax.axhline(line, label=f"drift line {line:.3g}", **st.line("drift line", marker="None"))
        ax.set_ylabel("max |Δ logit|")
    ax_s.set_xlabel("step (0 = prefill's last row; dotted = median over cells)")
    ax_l.set_xlabel("prompt length (tokens)")
    ax_l.set_xscale("log")
    return _laid_out(fig, path, legend_from=ax_s)
