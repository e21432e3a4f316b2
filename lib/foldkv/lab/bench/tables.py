"""Reading a results document: the series of one arm, markdown tables, the prediction written before timing,
per-cell verdicts and conclusions, and the decode targets (`DECODE_TARGETS`, the one place they are written) and the
FP8 targets met or not, all computed from the data (no typed numbers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from foldkv.lab import byte_floor as floor
from foldkv.config import GEMMA4_31B, AttentionGeometry

from .arms import READ_FOLDED
from .case import SERVING_CASES
from .cells import (TARGET_PEER, all_met, best_folded, best_split, bound_check, cells_of, fmt_value, missing_why,
                    ok_us, overall_text, split_vs_peer_check, verdict_text)
from .drawn import SINGLE_REQUEST_BOUNDS, drawn_conclusions


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


def arm_cell_text(arm: dict, kind: str = "decode") -> str:
    """One table cell: 'µs median [p10–p90] · % of roof', or the reason the arm did not run."""
    st = arm.get("status")
    if st != "ok":
        return f"{st}: {str(arm.get('reason', ''))[:90]}"
    us = arm["us"]
    txt = f"{fmt_value(us['median'])} µs [{fmt_value(us['p10'])}–{fmt_value(us['p90'])}]"
    if kind == "prefill" and arm.get("tflops"):
        txt += f" · {fmt_value(arm['tflops']['median'])} TFLOP/s"
        if arm.get("pct_matmul_roof") is not None:
            txt += f" ({fmt_value(arm['pct_matmul_roof'], '.0f')}% mm)"
    elif arm.get("pct_roof"):
        txt += f" · {fmt_value(arm['pct_roof']['median'], '.0f')}% roof"
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
    every cell where folded is not ahead of every peer, with the reason read off the data, and the decode targets
    (`target_conclusions`)."""
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
    lines += target_conclusions(results)
    lines += drawn_conclusions(results)
    not_run = sorted({f"{n}: {a.get('status')} ({str(a.get('reason'))[:120]})" for c in results.get("cells", [])
                      for n, a in c.get("arms", {}).items() if a.get("status") != "ok"})
    for s in not_run:
        lines.append(f"Arm {s}.")
    return lines


# --------------------------------------------------------------------------------------------------------------------
# The decode targets: each decode cell against a plain read of the same bytes and FlashInfer TC, in the same run
# --------------------------------------------------------------------------------------------------------------------
NEAR = 0.05  # "one request at 40K": a single request within 5% of the row's length


@dataclass(frozen=True)
class DecodeTarget:
    """One row of the targets: which cells it holds ("batch/<case>" cells of `batch_cases`, or single-request cells
    (single/, sweep/) of at least `min_context` tokens or within NEAR of `near`), and its bounds: folded time /
    plain-read time at most `max_x_read`, FlashInfer TC time / folded time at least `min_folded_x_fi_tc`, FlashInfer
    TC time / split time at least `min_split_x_fi_tc` (a tie at the roof met: `cells.split_vs_peer_check`)."""

    case: str
    max_x_read: float
    min_folded_x_fi_tc: float
    min_split_x_fi_tc: float
    batch_cases: tuple[str, ...] = ()
    min_context: int | None = None
    near: int | None = None

    def holds(self, cell: dict) -> bool:
        name = str(cell.get("cell", ""))
        if self.batch_cases:
            return name.startswith("batch/") and name[len("batch/"):] in self.batch_cases
        if cell.get("kind", "decode") != "decode" or cell.get("batch") != 1:
            return False
        if not name.startswith(("single/", "sweep/")):
            return False
        n = int(cell.get("context", 0))
        if self.min_context is not None:
            return n >= self.min_context
        return self.near is not None and abs(n - self.near) <= NEAR * self.near


_SINGLE = dict(SINGLE_REQUEST_BOUNDS)  # the single-request read bounds, written once (drawn.SINGLE_REQUEST_BOUNDS)
DECODE_TARGETS: tuple[DecodeTarget, ...] = (
    DecodeTarget("ragged batches of 8-128 (1K-48K) and the long-tail mix of 64", 1.10, 1.5, 1.0,
                 batch_cases=SERVING_CASES),
    DecodeTarget("one request >= 131K", 1.05, 1.55, 1.0, min_context=131_072),
    DecodeTarget("one request at 40K", _SINGLE[40_002], 1.5, 1.0, near=40_000),
    DecodeTarget("one request at 10.6K", _SINGLE[10_602], 1.4, 1.0, near=10_600),
)


def target_rows(results: dict, targets: Sequence[DecodeTarget] = DECODE_TARGETS) -> list[dict]:
    """Per decode cell that a target row holds (in the targets' order, then the cells'): the best folded arm's median
    over the plain read's (`read_folded`), FlashInfer TC's median over the best folded's and over the best split's,
    each against its bound with met True / False, or None and `why` when an arm is missing; `met` is True when all
    three are met, False when any measured one is not, None otherwise."""
    rows = []
    for t in targets:
        for c in results.get("cells", []):
            if not t.holds(c):
                continue
            folded, split = best_folded(c), best_split(c)
            f_us, s_us = ok_us(c, folded), ok_us(c, split)
            r_us, fi_us = ok_us(c, READ_FOLDED), ok_us(c, TARGET_PEER)
            failed = f"the cell failed: {str(c['error'])[:80]}" if c.get("error") else None
            no_folded = failed or "no folded arm ran and passed its check"
            read_missing = no_folded if f_us is None else missing_why(c, READ_FOLDED, "plain-read arm")
            fi_missing = missing_why(c, TARGET_PEER, "FlashInfer TC arm")
            checks = {
                "x_read": bound_check(f_us / r_us if f_us and r_us else None, t.max_x_read, True, read_missing),
                "folded_x_fi_tc": bound_check(fi_us / f_us if f_us and fi_us else None, t.min_folded_x_fi_tc, False,
                                         no_folded if f_us is None else fi_missing),
                "split_x_fi_tc": split_vs_peer_check(c, split, TARGET_PEER, READ_FOLDED, t.min_split_x_fi_tc,
                                                     (failed or "no split arm ran and passed its check") if s_us is None
                                                     else fi_missing),
            }
            rows.append({"target": t.case, "cell": c["cell"], "context": c.get("context"), "batch": c.get("batch"),
                         "folded": folded, "split": split, "us": {"folded": f_us, "split": s_us, "read": r_us,
                                                                 TARGET_PEER: fi_us},
                         **checks, "met": all_met(checks)})
    return rows


def targets_markdown(results: dict, targets: Sequence[DecodeTarget] = DECODE_TARGETS) -> str:
    """The decode targets as a markdown table computed from `results` (`target_rows`; a target with no cell in this
    run says so), or a sentence saying there is nothing to compare (no cell of any target in this run)."""
    rows = target_rows(results, targets)
    if not rows:
        return f"No cell of the decode targets' cases in this run ({'; '.join(t.case for t in targets)})."
    lines = ["| target case | cell | folded vs plain read | folded vs FlashInfer TC | split vs FlashInfer TC | all |",
             "|---|---|---|---|---|---|"]
    for t in targets:
        mine = [r for r in rows if r["target"] == t.case]
        if not mine:
            lines.append(f"| {t.case} | – | no cell of this case in this run | | | |")
        for r in mine:
            overall = overall_text(r["met"])
            lines.append(f"| {r['target']} | {r['cell']} | {verdict_text(r['x_read'], 'read')} | "
                         f"{verdict_text(r['folded_x_fi_tc'], 'fi')} | {verdict_text(r['split_x_fi_tc'], 'fi')} | "
                         f"{overall} |")
    return "\n".join(lines)


def target_conclusions(results: dict, targets: Sequence[DecodeTarget] = DECODE_TARGETS) -> list[str]:
    """One sentence on the decode targets: how many cells meet all three, and each bound that is not met or could
    not be measured."""
    rows = target_rows(results, targets)
    if not rows:
        return []
    met = sum(r["met"] is True for r in rows)
    out = [f"Decode targets: {met} of {len(rows)} decode cells meet all three (plain read, FlashInfer TC, split)."]
    names = {"x_read": "folded vs plain read", "folded_x_fi_tc": "folded vs FlashInfer TC",
             "split_x_fi_tc": "split vs FlashInfer TC"}
    for r in rows:
        unmeasured: dict[str, list[str]] = {}  # why -> what (one reason often stands for all three)
        for key, what in names.items():
            v = r[key]
            if v["met"] is False:
                out.append(f"{r['cell']}: {what} {v['value']:.2f}x, target {'≤' if key == 'x_read' else '≥'} "
                           f"{v['bound']:.2f} ({r['target']}): NOT met.")
            elif v["met"] is None:
                unmeasured.setdefault(v["why"], []).append(what)
        for why, whats in unmeasured.items():
            out.append(f"{r['cell']}: {', '.join(whats)} not measured: {why}.")
    return out


# --- the FP8 targets: the FP8 folded decode against bf16, its plain read and FlashInfer's e4m3 decode; its prefill --
FP8_ARM = "folded_fp8_jit"
FP8_PEER = "fi_tc_fp8"


@dataclass(frozen=True)
class Fp8Target:
    """One case of the FP8 folded decode's targets: in the cells it `holds` for (ragged batches of at least
    `min_batch` requests, or single requests of `min_context` <= tokens < `max_context`), FP8 folded time / best bf16
    folded time at most `max_x_bf16`, FlashInfer's e4m3 decode time / FP8 folded time at least `min_x_fi_fp8`, and
    FP8 folded time / the plain read of its own bytes at most `max_x_read` (None: reported, not a target)."""

    case: str
    max_x_bf16: float
    min_x_fi_fp8: float
    max_x_read: float | None = None
    min_context: int = 0
    max_context: int | None = None
    min_batch: int | None = None  # set: the target of ragged batches (the fixed and the drawn ones)

    def holds(self, cell: dict) -> bool:
        if cell.get("kind") != "decode":
            return False
        batch, context = cell.get("batch") or 1, cell.get("context") or 0
        if self.min_batch is not None:
            return str(cell.get("cell", "")).startswith(("batch/", "drawn/")) and batch >= self.min_batch
        return batch == 1 and context >= self.min_context and (self.max_context is None or context < self.max_context)


# The FP8 decode on FP8 tensor cores is held to these (its speed targets; the exact-conversion partial is slower).
FP8_DECODE_TARGETS: tuple[Fp8Target, ...] = (
    Fp8Target("single requests of 81K tokens and more", 0.66, 2.0, max_x_read=1.40, min_context=81_000),
    Fp8Target("ragged batches of 8 requests or more", 0.68, 2.0, min_batch=8),
    Fp8Target("single requests of 40K-81K tokens", 0.78, 1.8, min_context=40_000, max_context=81_000),
)


def fp8_target_rows(results: dict, targets: tuple[Fp8Target, ...] = FP8_DECODE_TARGETS) -> list[dict]:
    """Per decode cell a target holds for (the first that does): the three ratios against their bounds (None with
    `why` when an arm is missing; the read ratio reported without a bound where the case has none), `met` as in
    `target_rows`."""
    from .arms import READ_FOLDED_FP8

    rows = []
    for c in results.get("cells", []):
        target = next((t for t in targets if t.holds(c)), None)
        if target is None:
            continue
        f8, f16 = ok_us(c, FP8_ARM), ok_us(c, best_folded(c))
        r8, fi8 = ok_us(c, READ_FOLDED_FP8), ok_us(c, FP8_PEER)
        no_f8 = missing_why(c, FP8_ARM, "FP8 folded arm")
        checks = {
            "x_bf16": bound_check(f8 / f16 if f8 and f16 else None, target.max_x_bf16, True,
                                  no_f8 if f8 is None else "no bf16 folded arm ran and passed its check"),
            "fi_fp8_x": bound_check(fi8 / f8 if f8 and fi8 else None, target.min_x_fi_fp8, False,
                                    no_f8 if f8 is None else missing_why(c, FP8_PEER, "FlashInfer e4m3 arm")),
        }
        x_read = f8 / r8 if f8 and r8 else None
        if target.max_x_read is not None:
            checks["x_read"] = bound_check(x_read, target.max_x_read, True, no_f8 if f8 is None
                                           else missing_why(c, READ_FOLDED_FP8, "FP8 plain-read arm"))
        rows.append({"cell": c["cell"], "target": target.case, "context": c.get("context"), "batch": c.get("batch"),
                     "us": {"fp8": f8, "bf16_folded": f16, "read_fp8": r8, FP8_PEER: fi8}, **checks,
                     "x_read_reported": x_read, "met": all_met(checks)})
    return rows


FP8_PREFILL_MAX_X_BF16 = 1.0  # the FP8 prefill target: no slower than over bf16
FP8_PREFILL_ARMS = ("folded_fp8_jit", "folded_fp8_aot")  # the launcher's default FP8 rows (the page gather), each build
FP8_PREFILL_IN_KERNEL_ARM = "folded_fp8_in_kernel_jit"  # the FP8 rows converted in the attention kernel: reported


def fp8_prefill_rows(results: dict, max_x_bf16: float = FP8_PREFILL_MAX_X_BF16) -> list[dict]:
    """Per prefill cell: the best FP8 folded prefill arm (the launcher's default rows, over the builds in
    FP8_PREFILL_ARMS that ran and passed) over the best bf16 folded prefill arm (over its builds), against
    `max_x_bf16` (None with `why` when an arm is missing), and the in-kernel conversion's ratio beside it
    (`in_kernel_x_bf16`, reported, not a target; None when that arm did not run). Best against best: the JIT and AOT
    builds of one source can differ by a few percent in a run, so the best of two builds on one side only would
    favour that side."""
    rows = []
    for c in results.get("cells", []):
        if c.get("kind") != "prefill":
            continue
        ok8 = [(us, n) for n in FP8_PREFILL_ARMS if (us := ok_us(c, n)) is not None]
        f8, f8_arm = min(ok8) if ok8 else (None, None)
        bf16_arm = best_folded(c)
        f16, f8k = ok_us(c, bf16_arm), ok_us(c, FP8_PREFILL_IN_KERNEL_ARM)
        check = bound_check(f8 / f16 if f8 and f16 else None, max_x_bf16, True,
                       missing_why(c, FP8_PREFILL_ARMS[0], "FP8 folded prefill arm") if f8 is None
                       else "no bf16 folded prefill arm ran and passed its check")
        rows.append({"cell": c["cell"], "us": {"fp8": f8, "bf16_folded": f16, "fp8_in_kernel": f8k},
                     "fp8_arm": f8_arm, "bf16_arm": bf16_arm, "x_bf16": check,
                     "in_kernel_x_bf16": f8k / f16 if f8k and f16 else None, "met": check["met"]})
    return rows


def fp8_targets_markdown(results: dict, targets: tuple[Fp8Target, ...] = FP8_DECODE_TARGETS) -> str:
    rows, prefill = fp8_target_rows(results, targets), fp8_prefill_rows(results)
    if not rows and not prefill:
        return ("No cell of the FP8 targets' cases in this run (ragged batches of 8 or more; one request of >= 40K "
                "tokens; prefill cells).")
    lines = ["| target case | cell | FP8 / bf16 folded | FP8 / plain read of its bytes | FlashInfer e4m3 / FP8 folded "
             "| all |", "|---|---|---|---|---|---|"] if rows else []
    for r in rows:
        overall = overall_text(r["met"])
        read = (verdict_text(r["x_read"], "read") if "x_read" in r
                else f"{fmt_value(r['x_read_reported'], '.2f')}x (reported)")
        lines.append(f"| {r['target']} | {r['cell']} | {verdict_text(r['x_bf16'], 'read')} | {read} | "
                     f"{verdict_text(r['fi_fp8_x'], 'fi')} | {overall} |")
    if prefill:
        lines += ["", "| prefill cell | best FP8 (page gather) / best bf16 folded prefill (target <= "
                  f"{FP8_PREFILL_MAX_X_BF16:.2f}) | arms | met | FP8 converted in the kernel / bf16 (x, reported) |",
                  "|---|---|---|---|---|"]
        for r in prefill:
            lines.append(f"| {r['cell']} | {verdict_text(r['x_bf16'], 'read')} | {r['fp8_arm']} / {r['bf16_arm']} | "
                         f"{overall_text(r['met'])} | {fmt_value(r['in_kernel_x_bf16'], '.3f')} |")
    return "\n".join(lines)
