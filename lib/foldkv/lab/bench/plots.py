"""What notebook 04 draws from a results document: decode time, % of roof and speedup against context; pool memory
per format and the ragged batches; the decode targets per cell; the drawn cells against their plain read. A figure redrawn from an earlier run says so in every
title (`mark_redrawn`)."""

from __future__ import annotations

from typing import Any

from foldkv import floor
from foldkv.config import GEMMA4_31B, AttentionGeometry

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
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    mark_redrawn(fig, redrawn_from)
    fig.tight_layout()
    return fig


def decode_figure(results: dict, *, redrawn_from: str | None = None) -> Any:
    """Three panels against context, one request: µs per step (median, p10–p90 band), % of the read roof on each
    arm's own format's bytes, and the speedup of the best folded arm over each peer and over generated split."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(18, 5))
    for a in [a for a in arm_names(results, "s") if decode_series(results, a, "us")[0]]:
        xs, ys = decode_series(results, a, "us")
        _, lo = decode_series(results, a, "us", "p10")
        _, hi = decode_series(results, a, "us", "p90")
        ax[0].plot(xs, ys, marker="o", label=a)
        ax[0].fill_between(xs, lo, hi, alpha=0.2)
        xs, ys = decode_series(results, a, "pct_roof")
        if xs:
            ax[1].plot(xs, ys, marker="o", label=a)
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
        ax[2].plot(xs, [d[x] for x in xs], marker="o", label=f"folded vs {other}")
    ax[2].axhline(1.0, color="grey", lw=0.5)
    ax[2].set(xscale="log", xlabel="context (tokens)", ylabel="speedup (peer µs / folded µs)",
              title="speedup of folded over each peer")
    return _finish(fig, ax, redrawn_from)


def memory_and_batch_figure(results: dict, *, geom: AttentionGeometry = GEMMA4_31B,
                            redrawn_from: str | None = None) -> Any:
    """Two panels: the KV pool of one request over the model's global layers per format against context (the byte
    model `foldkv.floor.pool_bytes`, not a measurement), and µs per step of every arm on the ragged batches."""
    import matplotlib.pyplot as plt

    params = results.get("params", {})
    ctx = sorted(set(params.get("sweep_lengths", [])) | set(params.get("single_lengths", [])))
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    for fmt, label in (("split", "split (also FlashInfer's layout)"), ("folded", "folded")):
        gib = [floor.pool_bytes(geom, fmt, n, layers=geom.num_global_layers) / 2**30 for n in ctx]
        ax[0].plot(ctx, gib, marker="o", label=label)
    ax[0].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="GiB",
              title=f"KV pool of one request, {geom.num_global_layers} global layers")
    bcells = cells_of(results, "batch/")
    barms = [a for a in arm_names(results, "batch/") if any(c["arms"].get(a, {}).get("status") == "ok" for c in bcells)]
    width = 0.8 / max(1, len(barms))
    for i, a in enumerate(barms):
        ys = [c["arms"][a]["us"]["median"] if c["arms"].get(a, {}).get("status") == "ok" else 0 for c in bcells]
        ax[1].bar([j + i * width for j in range(len(bcells))], ys, width, label=a)
    ax[1].set_xticks([j + 0.4 - width / 2 for j in range(len(bcells))], [c["cell"] for c in bcells])
    ax[1].set(ylabel="µs per decode step (median)", title="ragged batches")
    return _finish(fig, ax, redrawn_from)


def targets_figure(results: dict, *, redrawn_from: str | None = None) -> Any:
    """The decode targets per cell (`tables.target_rows`): the best folded arm's time over the plain read's (bars,
    the row's bound as a black tick on each), and FlashInfer TC's time over the best folded and the best split arm's
    (bars, the bounds as ticks). A panel with nothing measured says what is missing."""
    import matplotlib.pyplot as plt

    rows = target_rows(results, DECODE_TARGETS)
    fig, ax = plt.subplots(1, 2, figsize=(15, 4.5))
    xs = list(range(len(rows)))
    names = [r["cell"] for r in rows]
    panels = ((ax[0], (("x_read", "folded / plain read"),), "folded µs / plain-read µs (lower is better)",
               "folded vs a plain read of the same bytes"),
              (ax[1], (("folded_x_fi_tc", "FI TC / folded"), ("split_x_fi_tc", "FI TC / split")),
               "FlashInfer TC µs / arm µs (higher is better)", "speed-up over FlashInfer TC"))
    for a, keys, ylabel, title in panels:
        width = 0.8 / len(keys)
        drawn = False
        for i, (key, label) in enumerate(keys):
            pos = [x + (i - (len(keys) - 1) / 2) * width for x in xs]
            vals = [r[key]["value"] for r in rows]
            have = [(p, v) for p, v in zip(pos, vals) if v is not None]
            if have:
                drawn = True
                a.bar([p for p, _ in have], [v for _, v in have], width, label=label)
            a.scatter(pos, [r[key]["bound"] for r in rows], marker="_", s=400, color="black",
                      label="target" if i == 0 else None, zorder=3)
        if not drawn:
            why = sorted({r[k]["why"] for r in rows for k, _ in keys if r[k]["value"] is None}) or ["no target cells"]
            a.text(0.5, 0.5, "\n".join(why)[:300], transform=a.transAxes, ha="center", va="center", fontsize=9,
                   wrap=True)
        a.set_xticks(xs, names, rotation=30, ha="right", fontsize=8)
        a.axhline(1.0, color="grey", lw=0.5)
        a.set(ylabel=ylabel, title=title)
    return _finish(fig, ax, redrawn_from)


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
    fig, ax = plt.subplots(figsize=(12, 4.5))
    xs = list(range(len(rows)))
    have = [(x, r["x_read"]["value"]) for x, r in zip(xs, rows) if r["x_read"]["value"] is not None]
    if have:
        ax.bar([x for x, _ in have], [v for _, v in have], 0.6, label="best folded / plain read")
    else:
        ax.text(0.5, 0.5, "no drawn cell measured", transform=ax.transAxes, ha="center", va="center")
    ax.scatter(xs, [r["x_read"]["bound"] for r in rows], marker="_", s=400, color="black", label="target", zorder=3)
    ax.set_xticks(xs, [f"{r['cell']} ({r['batch']})" for r in rows], rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.5)
    seed = (results.get("draws") or {}).get("seed")
    ax.set(ylabel="folded µs / plain-read µs (lower is better)",
           title=f"drawn cells (seed {seed}): folded against a plain read of the same bytes")
    ax.set_ylim(0.9, max([1.3] + [v * 1.05 for _, v in have]))
    ax.legend(fontsize=8)
    return _finish(fig, [ax], redrawn_from)
