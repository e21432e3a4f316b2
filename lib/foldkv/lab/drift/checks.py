"""The drift study's checks (see the package docstring): finite logits for every arm, and for the gated arms the gap
against the neutral figure (`GAP_FACTOR`) and the argmax flips against the single pass's (`ARGMAX_ALPHA`); the same
two limits for the gated pairs (an FP8 kernel arm against the float64 reference over the same FP8 pool,
`gated_pairs`); their outcome written into a run record's sections."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..model import MODEL_ARMS
from .summary import gaps_of, is_finite, quantiles

# The gap check. The neutral figure |walk - single pass| is the distance between two orderings of the incumbent's own
# arithmetic. An arm that is "a reordering, no less accurate than the incumbent" sits, like the single pass, one such
# distance from the walk; by the triangle inequality |arm - walk| <= |arm - single| + |single - walk|, i.e. at most two
# neutral distances even in the worst alignment. So each of the arm's gap quantiles (p50, p90, max) must be at most
# GAP_FACTOR x the neutral quantile, plus GAP_SLACK_ULPS ulp of the model dtype at the largest |logit|: gaps are
# differences of logits rounded to that dtype, so two samples' quantiles can differ by one quantum, and a neutral of
# exactly 0 (walk and single pass bit-identical) would otherwise allow no rounding at all. Not fitted to a run; on the
# H200 with the notebook's defaults (bf16, 14 cells x 17 steps; neutral p50/p90/max 0.156/0.188/0.25, |logit| <= 16.5,
# so limits 0.438/0.5/0.625) the kernel arms reach at most 0.188/0.219/0.3125, and the same reference decode with its
# newest key dropped reaches 0.211/0.558/1.75 and fails (p90 and max).
# Gated: the kernel arms (MODEL_ARMS backend "kernel"). The torch reference arms are measured against the same limits
# but not gated: on a CPU the incumbent's walk and single pass are often bit-identical in bf16 (neutral p50 = 0), so
# the neutral does not gauge the bf16 roundings a float64 reference rounded once to bf16 makes elsewhere.
GAP_FACTOR = 2.0
GAP_SLACK_ULPS = 1
GAP_QUANTILES = ("p50", "p90", "max")
# The argmax check: McNemar's exact test, steps where the arm flips the incumbent's argmax and the single pass does
# not (b) against the reverse (c). Under "the arm is another reordering like the single pass" b ~ Binomial(b + c, 1/2);
# the arm fails when P(X >= b) < ARGMAX_ALPHA (one-sided: only more flips are a fault). With b + c = 10 flips all the
# arm's, P = 2^-10 < 1e-3: a handful of near-tie flips, which both orderings make, never fails it.
ARGMAX_ALPHA = 1e-3


def dtype_ulp(dtype: str | torch.dtype, x: float) -> float:
    """The spacing of `dtype` numbers at |x|: eps x 2^floor(log2 |x|) (bf16: 2^-7 at [1, 2)); 0 at x == 0."""
    dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    return torch.finfo(dt).eps * 2.0 ** math.floor(math.log2(abs(x))) if x else 0.0


def binomial_tail(b: int, n: int) -> float:
    """P(X >= b) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(b, n + 1)) / 2**n if n else 1.0


def _where(cell: dict, i: int) -> str:
    return f"cell {i} ({cell.get('group', '?')}, prompt {cell.get('prompt_index', '?')}, length {cell['length']})"


def gated_arms() -> tuple[str, ...]:
    """The arms the gap and argmax checks gate: the generated kernels over bf16 pools. The FP8 kernel arm is measured
    against the same limits but not gated: its pool's format errs ~10x bf16 (bench/FP8_NOTES.md), which the neutral
    figure (two orderings of bf16 arithmetic) does not gauge; its own kernel error is the pair folded-fp8 /
    ref-folded-fp8 (the same FP8 rows, read by the kernels and by the float64 reference)."""
    return tuple(a for a, spec in MODEL_ARMS.items() if spec.backend == "kernel" and spec.pool_dtype is None)


def gated_pairs() -> tuple[tuple[str, str], ...]:
    """The pairs the gap and argmax checks gate, with the limits the bf16 kernel arms are held to against the
    incumbent: each kernel arm over a pool of its own dtype (the FP8 arms: `folded-fp8`, the tensor-core partial, and
    `folded-fp8-exact`) against the reference arm over the same format and pool dtype (`ref-folded-fp8`, float64
    over the same FP8 rows). The pair takes the format's error out (both read the same rows), so what remains is the
    kernel's own, which the neutral figure gauges as it does for a bf16 kernel against the incumbent."""
    refs = {(spec.format, spec.pool_dtype): a for a, spec in MODEL_ARMS.items()
            if spec.backend == "reference" and spec.pool_dtype is not None}
    return tuple((a, refs[(spec.format, spec.pool_dtype)]) for a, spec in MODEL_ARMS.items()
                 if spec.backend == "kernel" and spec.pool_dtype is not None and (spec.format, spec.pool_dtype) in refs)


def pair_name(a: str, b: str) -> str:
    """The key of a pair in a cell's "pairs" (and of its section in the checks): "<a> vs <b>"."""
    return f"{a} vs {b}"


def _judge(series: list[tuple[dict, dict]], neutral: dict, slack: float,
           neutral_argmax: bool) -> tuple[dict, Any, list]:
    """The gap and argmax judgement of one series (an arm against the incumbent, or a pair) over its cells:
    `series` [(cell, {"gap": [...], "argmax_equal": [...]})]. Returns (gap, argmax, findings): each gap quantile
    against GAP_FACTOR x the neutral's + `slack`, McNemar's test of the series' flips against the single pass's, and
    the findings over either limit (failures for a gated series, notes for another)."""
    over = []
    q_arm = quantiles([g for _, rec in series for g in rec["gap"]])
    gap = {}
    for q in GAP_QUANTILES:
        limit = GAP_FACTOR * neutral[q] + slack if math.isfinite(neutral[q]) else slack
        gap[q] = {"arm": q_arm[q], "neutral": neutral[q], "limit": limit}
        if not q_arm[q] <= limit:
            over.append(f"gap {q} {q_arm[q]:.4g} > {GAP_FACTOR:g} x neutral {q} {neutral[q]:.4g}"
                        f" + slack {slack:.3g} = {limit:.4g}")
    if neutral_argmax:
        b = sum(1 for c, rec in series for a, n in zip(rec["argmax_equal"], c["neutral_argmax_equal"]) if n and not a)
        c_ = sum(1 for c, rec in series for a, n in zip(rec["argmax_equal"], c["neutral_argmax_equal"]) if a and not n)
        p = binomial_tail(b, b + c_)
        argmax = {"arm_only_flips": b, "neutral_only_flips": c_, "p": p}
        if p < ARGMAX_ALPHA:
            over.append(f"argmax: {b} steps flipped by the arm alone against {c_} by the single pass alone"
                        f" (P = {p:.2g} < {ARGMAX_ALPHA:g} under 'the arm is another reordering')")
    else:
        argmax = "not checked: the results record no single-pass argmax (neutral_argmax_equal)"
    return gap, argmax, over


def check_study(results: dict, gated: Sequence[str] | None = None,
                pairs: Sequence[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The study's checks, per section: `incumbent` (its logits, margins and neutral gaps finite) and each arm that ran
    (finite; and for the arms in `gated`, default `gated_arms()`, gap and argmax: see the module docstring and
    GAP_FACTOR / ARGMAX_ALPHA; other arms get those figures too, marked not gated), and each pair in `pairs` (default
    `gated_pairs()`) whose two arms the study lists: a section "<a> vs <b>", gap and argmax gated with the same limits
    (the pair's gap in place of the arm's against the incumbent; its NaN steps fail the arms' sections). Returns
    {"sections": {name: {"passed": True | False | None, "failures": [...], ...}}, "passed": ...}; None: the arm never
    ran (its status says why), so nothing was checked. Reads results as run_study returns them or as drift_results.json
    holds them."""
    gated = gated_arms() if gated is None else tuple(gated)
    cells = results["cells"]
    dtype = results["parameters"].get("dtype", "bfloat16")
    sections: dict[str, Any] = {}

    bad_inc = []
    for i, cell in enumerate(cells):
        steps = set(cell.get("incumbent_nonfinite_steps", []))
        steps |= {s for key in ("margin", "neutral") for s, v in enumerate(cell[key]) if not is_finite(v)}
        if "logit_absmax" in cell and not is_finite(cell["logit_absmax"]):
            steps |= set(range(cell["steps"] + 1))
        if steps:
            bad_inc.append(f"NaN/Inf in the incumbent's logits or neutral gap: {_where(cell, i)}, steps {sorted(steps)}")
    sections["incumbent"] = {"passed": not bad_inc, "failures": bad_inc}

    neutral = quantiles(gaps_of(results, "neutral"))
    absmax = [c["logit_absmax"] for c in cells if is_finite(c.get("logit_absmax"))]
    slack = GAP_SLACK_ULPS * dtype_ulp(dtype, max(absmax)) if absmax else 0.0
    slack_note = (f"{GAP_SLACK_ULPS} {dtype} ulp at the largest |logit| {max(absmax):.3g}" if absmax else
                  "0: the results record no logit magnitude (a stricter limit, not a looser one)")
    neutral_argmax = all("neutral_argmax_equal" in c for c in cells)

    for arm in [a for a in results["parameters"]["arms"] if a != "incumbent"]:
        ran = [(i, c, c["arms"][arm]) for i, c in enumerate(cells) if c.get("arms", {}).get(arm, {}).get("status") == "ran"]
        errored = [i for i, c in enumerate(cells) if arm in c.get("arms", {}) and c["arms"][arm].get("status") != "ran"]
        if not ran:
            sections[arm] = {"passed": None if not errored else False,
                             "failures": [f"errored in cells {errored}"] if errored else [],
                             "status": results.get("arm_status", {}).get(arm, "not run")}
            continue
        failures = [f"errored in cells {errored}: {cells[errored[0]]['arms'][arm]['status']}"] if errored else []
        for i, cell, rec in ran:
            steps = set(rec.get("nonfinite_steps", rec.get("nan_steps", [])))
            steps |= {s for s, g in enumerate(rec["gap"]) if not is_finite(g)}
            for name, pair in cell.get("pairs", {}).items():
                if arm in name.split(" vs "):
                    steps |= {s for s, g in enumerate(pair["gap"]) if not is_finite(g)}
            if steps:
                failures.append(f"NaN/Inf logits: {_where(cell, i)}, steps {sorted(steps)}")
        # gap and argmax findings: failures for a gated arm, notes for another
        gap, argmax, over = _judge([(c, rec) for _, c, rec in ran], neutral, slack, neutral_argmax)
        if arm in gated:
            failures += over
        sections[arm] = {"passed": not failures, "failures": failures, "gap": gap, "argmax": argmax,
                         "gated": arm in gated, "not_gated_over": [] if arm in gated else over}
    listed = set(results["parameters"]["arms"])
    for a, b in (gated_pairs() if pairs is None else tuple(pairs)):
        if not {a, b} <= listed:  # a pair of arms the study was not asked for has no section
            continue
        name = pair_name(a, b)
        series = [(c, c["pairs"][name]) for c in cells if name in c.get("pairs", {})]
        if not series:
            not_ran = [x for x in (a, b) if sections.get(x, {}).get("passed") is None]
            sections[name] = {"passed": None if not_ran else False, "pair": True,
                              "failures": [] if not_ran else [f"both arms ran but no cell holds the pair {name}"],
                              "status": "not run: " + "; ".join(
                                  f"arm {x} did not run ({results.get('arm_status', {}).get(x, 'not run')})"
                                  .replace("(not run: ", "(") for x in not_ran)}
            continue
        gap, argmax, over = _judge(series, neutral, slack, neutral_argmax)
        sections[name] = {"passed": not over, "failures": over, "gap": gap, "argmax": argmax, "gated": True,
                          "not_gated_over": [], "pair": True}
    return {"gap_factor": GAP_FACTOR, "slack": slack, "slack_note": slack_note, "argmax_alpha": ARGMAX_ALPHA,
            "neutral": neutral, "sections": sections,
            "passed": all(v["passed"] is not False for v in sections.values())}


def record_sections(record, results: dict) -> dict[str, str]:
    """Write the study's sections into a `foldkv.lab.report.RunRecord`: `incumbent`, `arm:<name>` and each gated pair's
    `pair:<a> vs <b>` "ran", "not run: ..." or "failed: ..." (an arm that errored, or any failed check; the failures
    named). Returns the sections."""
    checks = results.get("checks") or check_study(results)
    inc = checks["sections"]["incumbent"]
    if inc["passed"]:
        record.ran("incumbent")
    else:
        record.failed("incumbent", "; ".join(inc["failures"]))
    for name, sec in checks["sections"].items():  # the gated pairs: "pair:<a> vs <b>"
        if not sec.get("pair"):
            continue
        if sec["passed"] is None:
            record.not_run(f"pair:{name}", sec["status"])
        elif sec["passed"]:
            record.ran(f"pair:{name}", gap=sec["gap"], argmax=sec["argmax"], gated=True)
        else:
            record.failed(f"pair:{name}", "; ".join(sec["failures"]))
    for arm, status in results["arm_status"].items():
        sec = checks["sections"].get(arm, {})
        if status.startswith("not run"):
            record.not_run(f"arm:{arm}", status)
        elif sec.get("passed") is False:
            record.failed(f"arm:{arm}", "; ".join(sec["failures"]))
        elif status == "ran":
            record.ran(f"arm:{arm}", gap=sec.get("gap"), argmax=sec.get("argmax"), gated=sec.get("gated"))
        else:
            record.failed(f"arm:{arm}", status)
    return dict(record.sections)
