"""Decode cells drawn anew each run: batches of the named shapes a server sees and single requests at random
lengths, the targets every drawn cell is held to (`DRAWN_TARGETS`), and the decode plan's cost model
(`foldkv.kernels.plan`: the cut, the CTA count, the one-wave test, the modelled step) set beside the measured times.

A run draws with a seed it records (`fresh_seed` when none is given), so a drawn cell can be drawn again:
`draw_batches(seed)` and `draw_singles(seed)` depend on the seed only. Cells are named "drawn/<shape>" and
"drawn_single/<length>"; the fixed serving batches ("batch/<case>") stay beside them for comparison across runs."""

from __future__ import annotations

import bisect
import math
import os
import random
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import plan as decode_plan
from foldkv.layout import KvFormat, row_width
from foldkv.pool import PagedKvLayout

from .arms import READ_FOLDED
from .case import draw_shape, scaled
from .cells import (TARGET_PEER, all_met, best_folded, best_split, bound_check, missing_why, ok_us, overall_text,
                    split_vs_peer_check, verdict_text)

DRAWN_SHAPES = ("uniform8", "uniform24", "uniform32", "uniform64", "uniform128", "short_many", "longtail64", "mixed")
DRAWN_SINGLE_RANGES = {"long": (100_000, 262_144), "mid": (40_000, 100_000)}  # tokens, inclusive
DRAWN_BATCH, DRAWN_SINGLE = "drawn/", "drawn_single/"
EAGER_FOLDED, GRAPH_FOLDED = "folded_jit", "folded_graph"
# The plan model leaves out what does not scale with the cut (launch, merges): its measured/predicted ratio is a
# constant of the batch cells within a few percent (0.91-0.95 over the fixed serving batches of three committed
# runs of notebook 04), so a drawn batch outside the run's fixed-batch range widened by PLAN_MODEL_BAND is one the
# model mispredicts.
PLAN_MODEL_BAND = 0.05


def fresh_seed() -> int:
    """A seed for this run's draws, from the OS (recorded in the results and printed, so the draw can be repeated)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFF_FFFF


def draw_batches(seed: int, shapes: Sequence[str] = DRAWN_SHAPES, *, scale: float = 1.0) -> dict[str, list[int]]:
    """One batch per shape (`case.draw_shape`), each from its own stream seeded by (seed, shape): a shape's lengths
    depend on the seed and its name only, whatever else is drawn. `scale` as in `case.scaled`."""
    return {name: scaled(draw_shape(name, random.Random(f"{seed}/{name}")), scale) for name in shapes}


def draw_singles(seed: int, per_range: int = 2, *, scale: float = 1.0) -> list[int]:
    """`per_range` single-request lengths uniform in each of DRAWN_SINGLE_RANGES (longest range first), from a
    stream seeded by the seed."""
    rng = random.Random(f"{seed}/single")
    lens = [rng.randint(*DRAWN_SINGLE_RANGES[r]) for r in DRAWN_SINGLE_RANGES for _ in range(per_range)]
    return scaled(lens, scale)


# --- the targets of drawn cells ------------------------------------------------------------------------------------
# The single-request bounds (best folded / plain read of the same bytes) at the lengths they are set at: notebook 04's
# single cells of 10,602 and 40,002 tokens (`tables.DECODE_TARGETS` reads these two) and the drawn single requests
# of 100K tokens and more (the long range of DRAWN_SINGLE_RANGES). Below the first point the bound is the first;
# from the last on, the last.
SINGLE_REQUEST_BOUNDS: tuple[tuple[int, float], ...] = ((10_602, 1.60), (40_002, 1.20), (100_000, 1.06))
DRAWN_BATCH_MAX_X_READ = 1.08  # every drawn batch: the floor of its bound (`drawn_batch_bound`)


def single_request_bound(tokens: int, points: Sequence[tuple[int, float]] = SINGLE_REQUEST_BOUNDS) -> float:
    """The bound one request of `tokens` tokens is held to, as the single-request targets are stated: `points`' value
    at a point, linear in log(length) between two points, the first point's value below the first, the last's from
    the last on."""
    if tokens < 1:
        raise ValueError(f"tokens {tokens}: a request holds at least 1 token")
    lens = [n for n, _ in points]
    if tokens <= lens[0]:
        return points[0][1]
    if tokens >= lens[-1]:
        return points[-1][1]
    i = bisect.bisect_right(lens, tokens)
    (n0, b0), (n1, b1) = points[i - 1], points[i]
    return b0 + (b1 - b0) * math.log(tokens / n0) / math.log(n1 / n0)


def drawn_batch_bound(total_tokens: int, floor: float = DRAWN_BATCH_MAX_X_READ) -> float:
    """A drawn batch's bound: never more than one request of its total token count is held to
    (`single_request_bound(total_tokens)`), and never under `floor`, the bound of every drawn batch. A batch of a
    few short requests (`mixed`: ~30K tokens in all) is held to what one 30K request is (~1.29x); one of many
    (`short_many`, ~450K tokens) to the floor."""
    return max(floor, single_request_bound(total_tokens))


def total_tokens(cell: dict) -> int:
    """The tokens a decode cell reads: its recorded `tokens`, else the sum of its `seq_lens`, else its context."""
    return int(cell.get("tokens") or sum(cell.get("seq_lens") or []) or cell.get("context") or 0)


@dataclass(frozen=True)
class DrawnTarget:
    """The bounds one kind of drawn cell is held to: best folded time / plain-read time at most `max_x_read` (for
    `by_total_tokens`, at most `drawn_batch_bound` of the cell's total tokens with `max_x_read` as its floor); the
    folded workspace graph's time / eager folded's at most `max_graph_x_eager`; FlashInfer TC's time / best split's
    at least `min_split_x_fi_tc` (a tie at the roof met: `cells.split_vs_peer_check`; None: not held). A row holds
    "drawn/" cells (batches), or "drawn_single/" cells whose length is in [lo, hi]."""

    case: str
    max_x_read: float
    max_graph_x_eager: float | None = None
    min_split_x_fi_tc: float | None = None
    single_range: tuple[int, int] | None = None
    by_total_tokens: bool = False

    def holds(self, cell: dict) -> bool:
        name = str(cell.get("cell", ""))
        if self.single_range is None:
            return name.startswith(DRAWN_BATCH)
        lo, hi = self.single_range
        return name.startswith(DRAWN_SINGLE) and lo <= int(cell.get("context", 0)) <= hi

    def x_read_bound(self, cell: dict) -> float:
        """The folded / plain-read bound of `cell` under this row."""
        return drawn_batch_bound(total_tokens(cell), self.max_x_read) if self.by_total_tokens else self.max_x_read


def _point(tokens: int) -> float:
    return dict(SINGLE_REQUEST_BOUNDS)[tokens]


DRAWN_TARGETS: tuple[DrawnTarget, ...] = (
    DrawnTarget("every drawn batch", DRAWN_BATCH_MAX_X_READ, max_graph_x_eager=1.01, min_split_x_fi_tc=1.0,
                by_total_tokens=True),
    DrawnTarget("drawn single requests of 100K-262K", _point(100_000), single_range=DRAWN_SINGLE_RANGES["long"]),
    DrawnTarget("drawn single requests of 40K-100K", _point(40_002), single_range=DRAWN_SINGLE_RANGES["mid"]),
)


def drawn_target_rows(results: dict, targets: Sequence[DrawnTarget] = DRAWN_TARGETS) -> list[dict]:
    """Per drawn cell a target holds: each bound's value and met (None with `why` when an arm is missing), `met`
    over them as in `tables.target_rows`."""
    rows = []
    for t in targets:
        for c in results.get("cells", []):
            if not t.holds(c):
                continue
            failed = f"the cell failed: {str(c['error'])[:80]}" if c.get("error") else None
            folded, split = best_folded(c), best_split(c)
            f_us, s_us, r_us = ok_us(c, folded), ok_us(c, split), ok_us(c, READ_FOLDED)
            no_folded = failed or "no folded arm ran and passed its check"
            checks = {"x_read": bound_check(f_us / r_us if f_us and r_us else None, t.x_read_bound(c), True,
                                       no_folded if f_us is None else missing_why(c, READ_FOLDED, "plain-read arm"))}
            if t.max_graph_x_eager is not None:
                g_us, e_us = ok_us(c, GRAPH_FOLDED), ok_us(c, EAGER_FOLDED)
                why = failed or (missing_why(c, GRAPH_FOLDED, "folded graph arm") if g_us is None
                                 else missing_why(c, EAGER_FOLDED, "eager folded arm"))
                checks["graph_x_eager"] = bound_check(g_us / e_us if g_us and e_us else None, t.max_graph_x_eager, True, why)
            if t.min_split_x_fi_tc is not None:
                why = (failed or "no split arm ran and passed its check") if s_us is None else \
                    missing_why(c, TARGET_PEER, "FlashInfer TC arm")
                checks["split_x_fi_tc"] = split_vs_peer_check(c, split, TARGET_PEER, READ_FOLDED, t.min_split_x_fi_tc,
                                                              why)
            rows.append({"target": t.case, "cell": c["cell"], "context": c.get("context"), "batch": c.get("batch"),
                         "tokens": total_tokens(c), "folded": folded, "split": split, **checks,
                         "met": all_met(checks)})
    return rows


_CHECK_NAMES = {"x_read": ("folded vs plain read", "≤"), "graph_x_eager": ("folded graph vs eager", "≤"),
                "split_x_fi_tc": ("FlashInfer TC vs split", "≥")}


def drawn_targets_markdown(results: dict, targets: Sequence[DrawnTarget] = DRAWN_TARGETS) -> str:
    """The drawn cells' targets as a markdown table (`drawn_target_rows`; a batch's read bound is its total tokens',
    `drawn_batch_bound`), or a sentence when no cell was drawn."""
    rows = drawn_target_rows(results, targets)
    if not rows:
        return "No drawn cell in this run (the `drawn` section did not run)."
    lines = ["| target | cell | batch | tokens | " + " | ".join(n for n, _ in _CHECK_NAMES.values()) + " | all |",
             "|---|---|---|---|" + "---|" * len(_CHECK_NAMES) + "---|"]
    for r in rows:
        vals = [verdict_text(r[k], "read" if op == "≤" else "fi") if k in r else "–" for k, (_, op) in
                _CHECK_NAMES.items()]
        lines.append(f"| {r['target']} | {r['cell']} | {r['batch']} | {r['tokens']:,} | " + " | ".join(vals) +
                     f" | {overall_text(r['met'])} |")
    return "\n".join(lines)


def drawn_conclusions(results: dict, targets: Sequence[DrawnTarget] = DRAWN_TARGETS) -> list[str]:
    """How many drawn cells meet every bound, each bound not met, and the draw's seed."""
    rows = drawn_target_rows(results, targets)
    if not rows:
        return []
    seed = (results.get("draws") or {}).get("seed")
    out = [f"Drawn cells (seed {seed}): {sum(r['met'] is True for r in rows)} of {len(rows)} meet every bound."]
    for r in rows:
        for key, (what, op) in _CHECK_NAMES.items():
            v = r.get(key)
            if v and v["met"] is False:
                out.append(f"{r['cell']}: {what} {v['value']:.3f}x, target {op} {v['bound']:.2f} ({r['target']}): "
                           "NOT met.")
            elif v and v["met"] is None:
                out.append(f"{r['cell']}: {what} not measured: {v['why']}.")
    return out


# --- the plan's model against the measured times ---------------------------------------------------------------------
def plan_model_row(seq_lens: Sequence[int], read_gbps: float, num_sms: int, *,
                   geom: AttentionGeometry = GEMMA4_31B, page_size: int = 64) -> dict:
    """What `foldkv.kernels.plan` decides and predicts for a folded batch of `seq_lens` on `num_sms` SMs: the piece
    cap (pages), the CTAs, whether they fit one wave, and the modelled step (`plan.estimated_step`, page reads of one
    SM) in µs at `read_gbps` shared by the SMs."""
    layout = PagedKvLayout(geom, KvFormat.FOLDED, page_size, 1)
    pages = [layout.pages_for(n) for n in seq_lens]
    hkv = geom.num_kv_heads
    cap = decode_plan.balanced_chunk_pages(layout, seq_lens, num_sms)
    ctas = decode_plan.cta_count(pages, cap, hkv)
    tile_bytes = page_size * row_width(geom, KvFormat.FOLDED) * 2  # one page of one KV head, bf16
    step = decode_plan.estimated_step(pages, cap, hkv, num_sms)
    return {"cap_pages": cap, "ctas": ctas, "one_wave": ctas <= num_sms,
            "predicted_us": step * tile_bytes / (read_gbps * 1e3 / num_sms)}


def plan_model_rows(results: dict) -> list[dict]:
    """Per batch cell (fixed "batch/" and "drawn/"): the plan's decisions and modelled step (`plan_model_row`, at the
    run's read roof and SM count) beside the measured folded graph step (else the best folded arm), their ratio,
    and `mispredicted` for a drawn batch whose ratio lies outside the fixed batches' range widened by
    PLAN_MODEL_BAND (None when the run has no fixed batch to compare with)."""
    gbps = (results.get("roof", {}).get("read") or {}).get("gbps")
    sms = (results.get("env") or {}).get("sms") or decode_plan.DEFAULT_SMS
    if not gbps:
        return []
    rows = []
    for c in results.get("cells", []):
        name = str(c.get("cell", ""))
        if c.get("kind", "decode") != "decode" or not name.startswith(("batch/", DRAWN_BATCH)):
            continue
        arm = GRAPH_FOLDED if ok_us(c, GRAPH_FOLDED) else best_folded(c)
        measured = ok_us(c, arm)
        row = {"cell": name, "batch": len(c["seq_lens"]), "arm": arm, "measured_us": measured,
               **plan_model_row(c["seq_lens"], gbps, sms)}
        row["ratio"] = measured / row["predicted_us"] if measured else None
        rows.append(row)
    fixed = [r["ratio"] for r in rows if r["cell"].startswith("batch/") and r["ratio"]]
    for r in rows:
        r["mispredicted"] = None
        if fixed and r["ratio"] and r["cell"].startswith(DRAWN_BATCH):
            r["mispredicted"] = not (min(fixed) * (1 - PLAN_MODEL_BAND) <= r["ratio"]
                                     <= max(fixed) * (1 + PLAN_MODEL_BAND))
    return rows


def plan_model_markdown(results: dict) -> str:
    rows = plan_model_rows(results)
    if not rows:
        return "No batch cell with a measured read roof in these results: nothing to set the plan's model against."
    fixed = [r["ratio"] for r in rows if r["cell"].startswith("batch/") and r["ratio"]]
    lines = ["| cell | requests | cap (pages) | CTAs | one wave | predicted µs | measured µs (arm) | measured / "
             "predicted | mispredicted |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mis = {True: "**yes**", False: "no", None: "–"}[r["mispredicted"]]
        meas = f"{r['measured_us']:.1f} ({r['arm']})" if r["measured_us"] else "– (no folded arm ran)"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "–"
        lines.append(f"| {r['cell']} | {r['batch']} | {r['cap_pages']} | {r['ctas']} | {'yes' if r['one_wave'] else 'no'}"
                     f" | {r['predicted_us']:.1f} | {meas} | {ratio} | {mis} |")
    if fixed:
        lines.append(f"\nFixed batches' measured / predicted: {min(fixed):.3f}-{max(fixed):.3f} (median "
                     f"{statistics.median(fixed):.3f}); a drawn batch outside that range by more than "
                     f"{PLAN_MODEL_BAND:.0%} is marked mispredicted.")
    return "\n".join(lines)

