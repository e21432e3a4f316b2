"""What notebook 04 draws from a results document: decode time, % of roof and speedup against context; pool memory
per format and the ragged batches; the decode targets per cell; the drawn cells against their plain read. Every arm in
its `foldkv.lab.palette` style; a figure redrawn from an earlier run says so in every title (`mark_redrawn`)."""

from __future__ import annotations

from typing import Any

from foldkv.lab import byte_floor as floor
from foldkv.config import GEMMA4_31B, AttentionGeometry

from ..palette import Styles, legend_beside, legend_right_of
from .drawn import drawn_target_rows
from .tables import DECODE_TARGETS, arm_names, best_folded, cells_of, series, target_rows

DECODE_PREFIXES = ("single/", "sweep/")


def mark_redrawn(fig: Any, source_run: str | None) -> None:
    """Add "(redrawn from <run>, not measured now)" to the title of every axes of a matplotlib figure drawn from an
    earlier run's results; `source_run` None (measured now) leaves the figure as it is."""
    if not source_run:
        return
    mark = f"(redrawn from {source_run}, not measured now)"
    for ax in fig.axes:
        title = ax.get_title()
        ax.set_title(f"{title}\n{mark}" if title else mark)


def decode_series(results: dict, arm: str, field: str, stat: str = "median") -> tuple[list, list]:
    """(contexts, values) of one arm over the single-request and sweep cells together, sorted by context."""
    pts = {}
    for p in DECODE_PREFIXES:
        for x, y in zip(*series(results, p, arm, field, stat)):
            pts[x] = y
    xs = sorted(pts)
    return xs, [pts[x] for x in xs]


def _finish(fig: Any, axes, redrawn_from: str | None) -> Any:
    """Grid on every axes and the redrawn mark; the legends are placed by each figure (outside its data) and the
    figure is laid out by its constrained layout."""
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    mark_redrawn(fig, redrawn_from)
    return fig


def _plain_log_ticks(axis: Any) -> None:
    """Ticks of a log axis at 1, 2 and 5 of each decade, written as plain numbers (a ratio axis of 1-40x shows
    1, 2, 5, 10, 20 rather than only 10^0 and 10^1)."""
    import matplotlib.ticker as mticker

    axis.set_major_locator(mticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(mticker.NullFormatter())


def _bars_only_y_grid(fig: Any, axes) -> Any:
    """A bar chart's categories need no vertical grid lines."""
    for ax in axes:
        ax.grid(False, axis="x")
    return fig


def decode_figure(results: dict, *, redrawn_from: str | None = None) -> Any:
    """Three panels against context, one request: µs per step (median, p10–p90 band), % of the read roof on each
    arm's own format's bytes, and the speedup of the best folded arm over each peer and over generated split."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(18, 6), layout="constrained")
    st = Styles()
    for a in [a for a in arm_names(results, "s") if decode_series(results, a, "us")[0]]:
        xs, ys = decode_series(results, a, "us")
        _, lo = decode_series(results, a, "us", "p10")
        _, hi = decode_series(results, a, "us", "p90")
        ax[0].plot(xs, ys, markersize=4, label=a, **st.line(a))
        ax[0].fill_between(xs, lo, hi, alpha=0.15, color=st.color(a), gid=st.key(a), linewidth=0)
        xs, ys = decode_series(results, a, "pct_roof")
        if xs:
            ax[1].plot(xs, ys, markersize=4, label=a, **st.line(a))
    ax[0].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="µs per decode step (median, p10–p90)",
              title="decode, one request")
    ax[1].set(xscale="log", xlabel="context (tokens)", ylabel="% of read roof (own format's bytes)",
              title=f"read roof {results.get('roof', {}).get('read', {}).get('gbps', float('nan')):.0f} GB/s")
    ax[1].axhline(100, color="grey", lw=0.5)
    speedups: dict[str, dict[int, float]] = {}
    cells = sorted(sum((cells_of(results, p) for p in DECODE_PREFIXES), []), key=lambda c: c["context"])
    for c in cells:
        f = best_folded(c)
        if f is None:
            continue
        for other, r in c["speedup"].get(f, {}).items():
            if c["arms"][other].get("peer") or other.startswith("split"):
                speedups.setdefault(other, {})[c["context"]] = r["ratio_of_medians"]
    for other, d in speedups.items():
        xs = sorted(d)
        ax[2].plot(xs, [d[x] for x in xs], markersize=4, label=f"folded vs {other}", **st.line(other))
    ax[2].axhline(1.0, color="grey", lw=0.5)
    # log: torch's speedup (~40x) would flatten the peers' 1-4x on a linear axis
    ax[2].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="speedup (peer µs / folded µs, log)",
              title="speedup of folded over each peer (colour: the peer)")
    _plain_log_ticks(ax[2].yaxis)
    legend_beside(fig, ax[:2], loc="outside lower center", ncol=7)
    legend_right_of(ax[2])
    return _finish(fig, ax, redrawn_from)


def memory_and_batch_figure(results: dict, *, geom: AttentionGeometry = GEMMA4_31B,
                            redrawn_from: str | None = None) -> Any:
    """Two panels: the KV pool of one request over the model's global layers per format against context (the byte
    model `foldkv.lab.byte_floor.pool_bytes`, not a measurement), and µs per step of every arm on the ragged batches."""
    import matplotlib.pyplot as plt

    params = results.get("params", {})
    ctx = sorted(set(params.get("sweep_lengths", [])) | set(params.get("single_lengths", [])))
    fig, ax = plt.subplots(1, 2, figsize=(17, 5.5), width_ratios=(1, 1.7), layout="constrained")
    st = Styles()
    for fmt, label in (("split", "split (also FlashInfer's layout)"), ("folded", "folded")):
        gib = [floor.pool_bytes(geom, fmt, n, layers=geom.num_global_layers) / 2**30 for n in ctx]
        ax[0].plot(ctx, gib, label=label, **st.line(fmt))
    ax[0].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="GiB",
              title=f"KV pool of one request, {geom.num_global_layers} global layers")
    bcells = cells_of(results, "batch/")
    barms = [a for a in arm_names(results, "batch/") if any(c["arms"].get(a, {}).get("status") == "ok" for c in bcells)]
    width = 0.8 / max(1, len(barms))
    for i, a in enumerate(barms):
        have = [(j + i * width, c["arms"][a]["us"]["median"]) for j, c in enumerate(bcells)
                if c["arms"].get(a, {}).get("status") == "ok"]  # an arm that did not run has no bar (log axis)
        ax[1].bar([x for x, _ in have], [y for _, y in have], width, label=a, **st.bar(a))
    ax[1].set_xticks([j + 0.4 - width / 2 for j in range(len(bcells))], [c["cell"] for c in bcells], rotation=20,
                     ha="right")
    # log: torch's ~10^5 µs would flatten every other arm's 10^3 on a linear axis
    ax[1].set(yscale="log", ylabel="µs per decode step (median, log)", title="ragged batches")
    ax[0].legend(fontsize=8, loc="upper left")  # the lines rise left to right: the upper left holds no data
    legend_right_of(ax[1])
    return _bars_only_y_grid(_finish(fig, ax, redrawn_from), [ax[1]])


def targets_figure(results: dict, *, redrawn_from: str | None = None) -> Any:
    """The decode targets per cell (`tables.target_rows`): the best folded arm's time over the plain read's (bars,
    the row's bound as a black tick on each), and FlashInfer TC's time over the best folded and the best split arm's
    (bars, the bounds as ticks). A panel with nothing measured says what is missing."""
    import matplotlib.pyplot as plt

    rows = target_rows(results, DECODE_TARGETS)
    fig, ax = plt.subplots(1, 2, figsize=(16, 5), layout="constrained")
    st = Styles()
    xs = list(range(len(rows)))
    names = [r["cell"] for r in rows]
    # each bar in the style of the arm it measures (the best folded or the best split)
    panels = ((ax[0], (("x_read", "folded / plain read", "folded"),), "folded µs / plain-read µs (lower is better)",
               "folded vs a plain read of the same bytes"),
              (ax[1], (("folded_x_fi_tc", "FI TC / folded", "folded"), ("split_x_fi_tc", "FI TC / split", "split")),
               "FlashInfer TC µs / arm µs (higher is better)", "speed-up over FlashInfer TC"))
    for a, keys, ylabel, title in panels:
        width = 0.8 / len(keys)
        drawn = False
        for i, (key, label, arm) in enumerate(keys):
            pos = [x + (i - (len(keys) - 1) / 2) * width for x in xs]
            vals = [r[key]["value"] for r in rows]
            have = [(p, v) for p, v in zip(pos, vals) if v is not None]
            if have:
                drawn = True
                a.bar([p for p, _ in have], [v for _, v in have], width, label=label, **st.bar(arm))
            a.scatter(pos, [r[key]["bound"] for r in rows], s=400, label="target" if i == 0 else None, zorder=3,
                      linewidths=2.5, **st.scatter("target"))
        if not drawn:
            why = sorted({r[k]["why"] for r in rows for k, *_ in keys if r[k]["value"] is None}) or ["no target cells"]
            a.text(0.5, 0.5, "\n".join(why)[:300], transform=a.transAxes, ha="center", va="center", fontsize=9,
                   wrap=True)
        a.set_xticks(xs, names, rotation=30, ha="right", fontsize=8)
        a.axhline(1.0, color="grey", lw=0.5)
        a.set(ylabel=ylabel, title=title)
        legend_right_of(a)
    return _bars_only_y_grid(_finish(fig, ax, redrawn_from), ax)


def figures(results: dict, *, redrawn_from: str | None = None) -> list:
    """Every figure of notebook 04, each marked when `redrawn_from` names the run the results came from."""
    figs = [decode_figure(results, redrawn_from=redrawn_from),
            memory_and_batch_figure(results, redrawn_from=redrawn_from),
            targets_figure(results, redrawn_from=redrawn_from)]
    if drawn_target_rows(results):
        figs.append(drawn_figure(results, redrawn_from=redrawn_from))
    return figs


def drawn_figure(results: dict, *, redrawn_from: str | None = None) -> Any:
    """Folded / plain read for every drawn cell of the run (bars), each cell's bound as a black tick."""
    import matplotlib.pyplot as plt

    rows = drawn_target_rows(results)
    fig, ax = plt.subplots(figsize=(13, 5), layout="constrained")
    st = Styles()
    xs = list(range(len(rows)))
    have = [(x, r["x_read"]["value"]) for x, r in zip(xs, rows) if r["x_read"]["value"] is not None]
    if have:
        ax.bar([x for x, _ in have], [v for _, v in have], 0.6, label="best folded / plain read", **st.bar("folded"))
    else:
        ax.text(0.5, 0.5, "no drawn cell measured", transform=ax.transAxes, ha="center", va="center")
    ax.scatter(xs, [r["x_read"]["bound"] for r in rows], s=400, label="target", zorder=3, linewidths=2.5,
               **st.scatter("target"))
    ax.set_xticks(xs, [f"{r['cell']} ({r['batch']})" for r in rows], rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.5)
    seed = (results.get("draws") or {}).get("seed")
    ax.set(ylabel="folded µs / plain-read µs (lower is better)",
           title=f"drawn cells (seed {seed}): folded against a plain read of the same bytes")
    ax.set_ylim(0.9, max([1.3] + [v * 1.05 for _, v in have]))
    legend_right_of(ax)
    return _bars_only_y_grid(_finish(fig, [ax], redrawn_from), [ax])
