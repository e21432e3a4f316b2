"""Reading one cell of a results document: an arm's median when it ran and passed, the best folded and split arms,
and one bound's verdict (met, not met, or why it could not be measured; "split >= FlashInfer TC" with its tie at the
roof, `split_vs_peer_check`), shared by every table of targets."""

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


# "split >= FlashInfer TC" where both read at the roof: a ratio within TIE of 1 is the run-to-run spread of a ratio of
# two medians (~1%: notebook 05's 4K x 1 cell gave 1.155 and 1.161 in two runs of one library), not an order; it
# counts as met only where both arms are within AT_ROOF of the plain read of their own bytes, i.e. neither can be
# faster by much. The plain read is measured on the folded pool's bytes (`read_folded`) and scaled to the split
# pool's by bytes (a streaming read's time is its bytes over one rate at these sizes).
TIE = 0.01
AT_ROOF = 0.03


def read_us_for(cell: dict, arm: str | None, read_arm: str) -> float | None:
    """The plain read's time (`read_arm`, when it ran and passed) scaled to the bytes `arm` reads, or None."""
    r_us = ok_us(cell, read_arm)
    arms = cell.get("arms", {})
    a_bytes, r_bytes = (arms.get(arm or "") or {}).get("bytes"), (arms.get(read_arm) or {}).get("bytes")
    if r_us is None or not a_bytes or not r_bytes:
        return None
    return r_us * a_bytes / r_bytes


def split_vs_peer_check(cell: dict, split: str | None, peer: str, read_arm: str, bound: float, missing: str) -> dict:
    """`bound_check` of the peer's time over the split arm's (at least `bound`), where a shortfall within TIE
    counts as met when both the split arm and the peer are within AT_ROOF of the plain read of their bytes
    (`read_us_for`): then `tie` is True and `at_roof` gives both ratios to the read."""
    s_us, p_us = ok_us(cell, split), ok_us(cell, peer)
    check = bound_check(p_us / s_us if s_us and p_us else None, bound, False, missing)
    if check["met"] is False and check["value"] >= bound * (1 - TIE):
        rs, rp = read_us_for(cell, split, read_arm), read_us_for(cell, peer, read_arm)
        if rs and rp and s_us / rs <= 1 + AT_ROOF and p_us / rp <= 1 + AT_ROOF:
            check.update(met=True, tie=True, at_roof={"split": s_us / rs, peer: p_us / rp})
    return check


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
    said = "met" if v["met"] else "NOT met"
    if v.get("tie"):
        said += f", a tie at the roof (both within {AT_ROOF:.0%} of the read)"
    return f"{v['value']:.2f}x ({op} {v['bound']:.2f}: {said})"
