"""Notebook 05's targets, computed from its rows (measured now, or the run of record's numbers on a machine without a
GPU): each target a row {"target", "value", "met"}, every bound the one the notebook's Targets section states."""

from __future__ import annotations

from typing import Sequence

TPOT_OVER_FLOOR = 1.15  # foldkv folded TPOT within this of its byte floor, every decode cell
HOST_SHARE = 0.02  # the host's share of a graph step
PEER_MARGIN = 0.98  # no peer faster than folded by more than 2%: peer TPOT >= 0.98 x folded's
BOTH_FIT_OVER_FLASHINFER = 0.90  # folded TPOT at the largest 128K batch both hold, against FlashInfer's
LARGEST_OVER_SPLIT = {"foldkv-folded": 1.4, "foldkv-fp8": 2.5}  # the largest 128K batch against split's
PEER_ARMS = ("sdpa", "flashinfer")


def targets(decode_rows: Sequence[dict], tail_rows: Sequence[dict] = (), largest_rows: Sequence[dict] = (),
            both_fit_rows: Sequence[dict] = (), compile_rows: Sequence[dict] = ()) -> list[dict]:
    """The targets of the cells that ran, in the notebook's order: per folded decode cell its TPOT / floor, its
    host share and each peer's TPOT against it; folded against FlashInfer at the largest 128K batch both hold; each
    foldkv arm's peak memory against sdpa's at a cell both ran (decode and the last prefill chunk); the largest 128K
    batch of folded and FP8 folded against split's. A row's "met" is a bool."""
    out = []
    ran = {(r["arm"], r["context"], r["batch"]): r for r in decode_rows if r["status"] == "ran"}
    for (arm, n, b), r in sorted(ran.items()):
        if arm != "foldkv-folded":
            continue
        out.append({"target": f"folded TPOT / floor <= {TPOT_OVER_FLOOR} at {n:,} x {b}", "value": r["tpot_over_floor"],
                    "met": r["tpot_over_floor"] <= TPOT_OVER_FLOOR})
        out.append({"target": f"host share of a step <= {HOST_SHARE:.0%} at {n:,} x {b}", "value": r["host_share"],
                    "met": r["host_share"] is not None and r["host_share"] <= HOST_SHARE})
        peers = [p for (a, m, c), p in ran.items() if (m, c) == (n, b) and a in PEER_ARMS]
        peers += [p for p in compile_rows if p["status"] == "ran" and (p["context"], p["batch"]) == (n, b)]
        for p in peers:
            out.append({"target": f"{p['arm']} not faster than folded by > {1 - PEER_MARGIN:.0%} at {n:,} x {b}",
                        "value": p["tpot_ms"] / r["tpot_ms"], "met": p["tpot_ms"] >= PEER_MARGIN * r["tpot_ms"]})
    fit = {r["arm"]: r for r in both_fit_rows if r["status"] == "ran"}
    if len(fit) == 2:
        f, p = fit["foldkv-folded"], fit["flashinfer"]
        out.append({"target": f"folded TPOT <= {BOTH_FIT_OVER_FLASHINFER:.2f}x FlashInfer's at {f['context']:,} x "
                              f"{f['batch']} (the largest 128K batch both hold)", "value": f["tpot_ms"] / p["tpot_ms"],
                    "met": f["tpot_ms"] <= BOTH_FIT_OVER_FLASHINFER * p["tpot_ms"]})
    for rows in (decode_rows, tail_rows):
        cells = {(r["arm"], r["context"], r["batch"]): r for r in rows if r["status"] == "ran"}
        for (arm, n, b), r in sorted(cells.items()):
            s = cells.get(("sdpa", n, b))
            if arm.startswith("foldkv") and s is not None:
                kind = "last prefill chunk" if "chunk_s" in r else "decode"
                out.append({"target": f"{arm} peak <= sdpa's ({kind}, {n:,} x {b})",
                            "value": r["memory"]["peak"] / s["memory"]["peak"],
                            "met": r["memory"]["peak"] <= s["memory"]["peak"]})
    for r in largest_rows:
        need = LARGEST_OVER_SPLIT.get(r["arm"])
        if need is not None:
            out.append({"target": f"{r['arm']} largest 128K batch >= {need}x split's", "value": r.get("over_split"),
                        "met": r.get("over_split") is not None and r["over_split"] >= need})
    return out


def targets_markdown(rows: Sequence[dict], shown_from: str = "") -> str:
    """The targets as a table under one line of how many are met (and whose numbers they are: `shown_from`, e.g.
    "from the run of record h200-..., commit ...", or "" for this run)."""
    from .report import markdown_table

    head = f"**{sum(t['met'] is True for t in rows)} of {len(rows)} targets met**" + (f" ({shown_from})" if shown_from
                                                                                      else "") + "."
    return head + "\n\n" + markdown_table(rows, {"target": "target", "value": "measured", "met": "met"},
                                          {"value": ".3f"})
