"""Reading one cell of a results document: an arm's median when it ran and passed, the best folded and split arms,
and one bound's verdict (met, not met, or why it could not be measured), shared by every table of targets."""

from __future__ import annotations

TARGET_PEER = "fi_tc"  # the strongest peer measured: the decode targets are set against it


def cells_of(results: dict, prefix: str) -> list[dict]:
    return [c for c in results.get("cells", []) if str(c.get("cell", "")).startswith(prefix)]


def fmt_value(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def best_folded(cell: dict) -> str | None:
    """The fastest folded generated arm that ran and passed its check."""
    ok = [(a["us"]["median"], n) for n, a in cell.get("arms", {}).items()
          if a.get("status") == "ok" and a.get("generated") and a.get("format") == "folded" and a["check"]["ok"]]
    return min(ok)[1] if ok else None


def ok_us(cell: dict, arm: str | None) -> float | None:
    a = cell.get("arms", {}).get(arm or "", {})
    if a.get("status") != "ok" or not (a.get("check") or {}).get("ok"):
        return None
    return a["us"]["median"]


def best_split(cell: dict) -> str | None:
    """The fastest split generated arm that ran and passed its check."""
    ok = [(a["us"]["median"], n) for n, a in cell.get("arms", {}).items()
          if a.get("status") == "ok" and a.get("generated") and a.get("format") == "split" and a["check"]["ok"]]
    return min(ok)[1] if ok else None


def missing_why(cell: dict, arm: str, what: str) -> str:
    a = cell.get("arms", {}).get(arm)
    if a is None:
        return f"no {what} in this run"
    if a.get("status") != "ok":
        return f"{what} {a.get('status')}: {str(a.get('reason', ''))[:80]}"
    return f"{what} failed its check"


def bound_check(value: float | None, bound: float, at_most: bool, missing: str) -> dict:
    if value is None:
        return {"value": None, "bound": bound, "met": None, "why": missing}
    return {"value": value, "bound": bound, "met": value <= bound if at_most else value >= bound}


def all_met(checks: dict) -> bool | None:
    """A row's verdict over its `bound_check`s: False when any measured one is not met, True when all are, else None."""
    mets = [v["met"] for v in checks.values()]
    return False if False in mets else (True if all(mets) else None)


def overall_text(met: bool | None) -> str:
    """A row's overall verdict (`all_met`, or one check's `met`) in words."""
    return {True: "met", False: "NOT met", None: "incomplete"}[met]


def verdict_text(v: dict, fmt: str) -> str:
    if v["met"] is None:
        return f"– ({v['why']})"
    op = "≤" if fmt == "read" else "≥"
    return f"{v['value']:.2f}x ({op} {v['bound']:.2f}: {'met' if v['met'] else 'NOT met'})"
