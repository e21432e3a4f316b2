"""Time to first token of a whole model through `generate()` against its compute floor (notebook 07): the cells,
what a first use costs, a long prompt's end-to-end latency, a long prefill's peak memory, and the verdicts.

Every measurement is `model_decode.measure_prefill`: `batch` real random prompts through the arm's attention and
cache, prefilled in chunks, timed from the call to the first token (one new token for a TTFT cell).
- `ttft_cells`: every arm at each (prompt, batch) cell. One untimed call of each arm first, at a short prompt
  (`WARMUP_CELL`): what a process pays once per arm (kernel builds, compiles, the pool's first allocation) is paid
  there and recorded as the arm's `warmup_s`, apart from the steady state. The library keeps no per-length state
  (kernels are built per arm, not per prompt length; `first_use_rows` measures that claim), so the cells need no
  first call of their own. Then `rounds` rounds (a cell may have its own count, "PROMPT:BATCH:ROUNDS": a 4K prompt's
  0.4 s takes five where a 32K x 4 prompt's 16 s takes one), the arms in rotated order (round r starts at arm r mod
  n, so no arm always runs first or after the same arm), the median over rounds. A cell that runs out of memory "does
  not fit" (its later rounds are skipped). The floor: the prompt's FLOPs from the model's own shapes
  (`prefill_floor.prefill_flops`) at the dense bf16 matmul rate measured in the same process
  (`bench.roofs.measure_matmul_roof`); each cell's TTFT / floor.
- `first_use_rows`: prompts of lengths this process has not run, each timed at its first call and again (steady):
  first / steady per prompt, within `FIRST_USE_LIMIT`.
- `e2e_rows`: one long prompt plus many new tokens a sequence: TTFT, the call to the last token, the decode between.
  Its TTFT is that prompt's TTFT cell (`with_e2e_ttft`): a long prompt is prefilled once, not once a section. Each
  arm decodes a few tokens untimed first (`E2E_WARMUP_TOKENS`): its first decode step in the process is recorded
  apart (`first_decode_step_ms`).
- `prefill_memory_rows`: the peak of a long prefill by component at each batch (`model_decode.measure_prefill_tail`:
  the last chunk over a nearly full cache is the prefill's peak).
- `targets`: the verdicts, computed from the rows (`floor_targets`, `peer_targets`, `first_use_targets`,
  `e2e_targets`, `memory_targets`).
- `against_record`: the verdicts computed again from a run of record's rows, beside what that run recorded, each
  difference either explained by a rule that changed since (`RULE_CHANGES`) or left to fail the redraw.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Callable, Mapping, Sequence

from . import model_decode as md
from .prefill_floor import floor_seconds, model_shapes, prefill_flops

# TTFT / floor bounds of foldkv folded, by prompt: (from this many tokens on, bound), longest first. A short prompt's
# fixed costs (the LM head, the first chunk's launches, the host between chunks) are a larger share of its floor.
FLOOR_BOUNDS: tuple[tuple[int, float], ...] = ((32_768, 1.35), (0, 1.6))
FIRST_USE_LIMIT = 1.05  # a prompt of a new length within 5% of the steady state for its length
FOLDED_ARMS = ("foldkv-folded", "foldkv-fp8")  # the arms held to their peers
PEER_ARMS = ("foldkv-split", "flashinfer")  # the peers folded TTFT must not be above
FIRST_USE_STEADY_CALLS = 3  # calls after the first at a new length: their median is its steady state
BOUNDED_ARM = "foldkv-folded"  # the arm held to FLOOR_BOUNDS and to the lowest end-to-end latency
MEMORY_BASE_ARM = "foldkv-split"  # foldkv's prefill peak is held to this arm's at the same cell
DOES_NOT_FIT = "does not fit"
WARMUP_CELL = (256, 1)  # each arm's untimed first call: a short prompt (one chunk), batch 1
# the end to end's warm-up decodes (a TTFT cell's warm-up does not): the arm's first decode step in the process (its
# kernels loaded, its graph captured) is paid there, not inside the timed decode of the arm that happens to run first
E2E_WARMUP_TOKENS = 8

Cell = tuple[int, int]  # (prompt tokens, batch)


def floor_bound(prompt_tokens: int) -> float:
    """foldkv folded's TTFT / floor bound at a prompt of `prompt_tokens` (`FLOOR_BOUNDS`)."""
    return next(bound for start, bound in FLOOR_BOUNDS if prompt_tokens >= start)


def rotated(arms: Sequence[str], round_: int) -> list[str]:
    """The arms in round `round_`'s order: starting at arm round_ mod n, in the given cyclic order."""
    k = round_ % len(arms)
    return list(arms[k:]) + list(arms[:k])


def parse_cells(texts: Sequence[str], rounds: int) -> tuple[list[Cell], dict[Cell, int]]:
    """Notebook 07's `ttft_cells`, each "PROMPT:BATCH" or "PROMPT:BATCH:ROUNDS" (a cell's own count of timed rounds;
    else `rounds`) -> (the cells, each cell's rounds). Raises argparse.ArgumentTypeError naming the cell."""
    import argparse

    cells, per = [], {}
    for text in texts:
        head, sep, own = text.rpartition(":") if text.count(":") == 2 else (text, "", "")
        cell = md.parse_cell(head)
        try:
            n = int(own) if sep else rounds
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"cell {text!r}: its rounds must be a positive whole number")
        if cell in per:
            raise argparse.ArgumentTypeError(f"cell {text!r}: {head} is given twice")
        cells.append(cell)
        per[cell] = n
    return cells, per


def cell_rounds(cells: Sequence[Cell], rounds: int | Mapping[Cell, int]) -> dict[Cell, int]:
    """Each cell's timed rounds: `rounds` for every cell, or a mapping that names each cell's own (refused: a cell it
    does not name, a cell that is not one of `cells`, a count below one)."""
    per = dict(rounds) if isinstance(rounds, Mapping) else {cell: rounds for cell in cells}
    if set(per) != set(cells) or any(not isinstance(n, int) or n < 1 for n in per.values()):
        raise ValueError(f"rounds={rounds!r} for cells {list(cells)}: need a count >= 1 for each cell, and no other")
    return per


def schedule(arms: Sequence[str], cells: Sequence[Cell],
             rounds: int | Mapping[Cell, int]) -> list[tuple[int, Cell, str]]:
    """The timed calls in order: (round, cell, arm), each round every cell that has that many rounds
    (`cell_rounds`), with the arms rotated (`rotated`)."""
    per = cell_rounds(cells, rounds)
    return [(r, cell, arm) for r in range(max(per.values())) for cell in cells if r < per[cell]
            for arm in rotated(arms, r)]


def _status(row: dict) -> str:
    """A measurement's status, an out-of-memory said as "does not fit" (the card's size, not a failure)."""
    status = row.get("status", "failed: no status")
    if status.startswith("failed") and "OutOfMemoryError" in status:
        return f"{DOES_NOT_FIT}: {status[len('failed: '):]}"
    return status


def _call(measure: Callable[..., dict], log, **cell) -> dict:
    [row] = md.run_cells(measure, [cell], log=log)
    row["status"] = _status(row)
    return row


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def timed_cells(measure: Callable[..., dict], arms: Sequence[str], cells: Sequence[Cell], *,
                rounds: int | Mapping[Cell, int],
                seed: int = 0, warmup: Cell | None = WARMUP_CELL, warmup_measure: Callable[..., dict] | None = None,
                log: Callable[[str], None] = print) -> list[dict]:
    """`measure(arm_name=, prompt_tokens=, batch=, seed=)` (a row with "status", "ttft_s", and "generate_s" where it
    has it) at every (cell, arm): one untimed call of each arm at `warmup` first (through `warmup_measure`, default
    `measure`; None: the caller ran every arm in this process already), then `schedule`'s rounds, each round's prompts
    drawn anew; a (cell, arm) that did not run in a round (out of memory, failed) is not called again. One row per
    (cell, arm), in cell then arm order: the medians over rounds, each round's TTFT, the arm's warm-up time (and its
    decode's gaps where it decoded), the last round's peak memory and decode gaps."""
    if not arms or not cells:
        raise ValueError(f"arms={list(arms)}, cells={list(cells)}: need arms and cells")
    calls = schedule(arms, cells, rounds)  # refuses a bad `rounds` before any call
    runs: dict[tuple[Cell, str], list[dict]] = {(c, a): [] for c in cells for a in arms}
    warm: dict[str, dict] = {}
    if warmup is not None:
        for arm in arms:
            warm[arm] = _call(warmup_measure or measure, log, arm_name=arm, prompt_tokens=warmup[0],
                              batch=warmup[1], seed=seed)
    for r, cell, arm in calls:
        done = runs[cell, arm]
        if any(x["status"] != "ran" for x in done) or warm.get(arm, {}).get("status", "ran") != "ran":
            continue  # did not fit (or failed) before: the next rounds would say the same
        done.append(_call(measure, log, arm_name=arm, prompt_tokens=cell[0], batch=cell[1], seed=seed + 1 + r))
    rows = []
    for cell in cells:
        for arm in arms:
            done = runs[cell, arm]
            ran = [x for x in done if x["status"] == "ran"]
            pre = warm.get(arm)
            bad = [x["status"] for x in ([pre] if pre else []) + done if x["status"] != "ran"]
            row: dict[str, Any] = {"arm": arm, "prompt_tokens": cell[0], "batch": cell[1],
                                   "status": bad[0] if bad else "ran", "rounds_run": len(ran),
                                   "ttft_rounds_s": [x["ttft_s"] for x in ran],
                                   "ttft_s": _median([x["ttft_s"] for x in ran]),
                                   "warmup_s": pre.get("ttft_s") if pre else None}
            if pre and pre.get("token_gaps"):
                row["warmup_token_gaps"] = pre["token_gaps"]
            if ran and all("generate_s" in x for x in ran):
                row["generate_s"] = _median([x["generate_s"] for x in ran])
            if ran:
                row.update({k: ran[-1][k] for k in ("peak_bytes", "memory", "tokens", "new_tokens", "token_gaps")
                            if ran[-1].get(k) is not None})  # a one-token call has no gaps: no column
            rows.append(row)
    return rows


def with_floor(rows: Sequence[dict], model_or_shapes, matmul_tflops: float, prefill_chunk: int) -> list[dict]:
    """Each row with its prompt's FLOPs (`prefill_flops` of the model's shapes at its prompt, batch and chunk), the
    floor at `matmul_tflops`, and TTFT / floor where it ran."""
    shapes = model_shapes(model_or_shapes)
    out = []
    for r in rows:
        flops = prefill_flops(shapes, r["prompt_tokens"], r["batch"], prefill_chunk).total
        floor = floor_seconds(flops, matmul_tflops)
        r = {**r, "flops": flops, "floor_s": floor, "matmul_tflops": matmul_tflops}
        r["ttft_over_floor"] = r["ttft_s"] / floor if r.get("ttft_s") is not None else None
        out.append(r)
    return out


E2E_CALL = "end-to-end call"  # a TTFT row taken from the end-to-end call (its "from")


def with_e2e_ttft(rows: Sequence[dict], e2e: Sequence[dict], model_or_shapes, matmul_tflops: float,
                  prefill_chunk: int) -> list[dict]:
    """`rows` (TTFT cells, with their floor) and, for each end-to-end row whose (arm, prompt, batch 1) no TTFT cell
    has, its TTFT as that cell's row (`with_floor`, "from": `E2E_CALL`): the end-to-end call's first token is the same
    measurement as a TTFT cell of its prompt (the same `measure_prefill`, timed from the call to the first token, after
    the arm's warm-up), so a long prompt runs once for both. Its peak memory is the whole call's (the decode's too), so
    it is not taken. A cell measured both ways keeps the TTFT cell's row."""
    have = {(r["arm"], r["prompt_tokens"], r["batch"]) for r in rows}
    taken = []
    for r in e2e:
        if (r["arm"], r["prompt_tokens"], r.get("batch", 1)) in have:
            continue
        taken.append({k: r[k] for k in ("arm", "prompt_tokens", "batch", "status", "rounds_run", "ttft_rounds_s",
                                        "ttft_s", "warmup_s") if k in r} | {"from": E2E_CALL})
    return list(rows) + with_floor(taken, model_or_shapes, matmul_tflops, prefill_chunk)


def _prefill(model, new_tokens: int, prefill_chunk: int) -> Callable[..., dict]:
    return functools.partial(md.measure_prefill, model, new_tokens=new_tokens, prefill_chunk=prefill_chunk)


def ttft_cells(model, arms: Sequence[str], cells: Sequence[Cell], *, rounds: int | Mapping[Cell, int],
               prefill_chunk: int, seed: int = 0,
               warmup: Cell | None = WARMUP_CELL, matmul_tflops: float | None = None,
               measure: Callable[..., dict] | None = None, log: Callable[[str], None] = print) -> dict:
    """TTFT at every (cell, arm) (module docstring) with its floor: {"matmul": the rate's measurement, "rows"}.
    `warmup`: `timed_cells`'s; `matmul_tflops`: a rate already measured in this process (else measured here); `measure`: replaces
    `measure_prefill` of one new token (the CPU tests' fake; `model` may then be a `prefill_floor.ModelShapes`)."""
    roof = None
    if matmul_tflops is None:
        from .bench.roofs import measure_matmul_roof

        roof = measure_matmul_roof(next(model.parameters()).device)
        matmul_tflops = roof["tflops"]
    measure = measure or _prefill(model, 1, prefill_chunk)
    rows = timed_cells(measure, arms, cells, rounds=rounds, seed=seed, warmup=warmup, log=log)
    return {"matmul": roof or {"tflops": matmul_tflops}, "rows": with_floor(rows, model, matmul_tflops, prefill_chunk)}


def first_use_rows(model, arms: Sequence[str], lengths: Sequence[int], *, prefill_chunk: int, seed: int = 0,
                   seen: Sequence[int] = (), steady_calls: int = FIRST_USE_STEADY_CALLS,
                   measure: Callable[..., dict] | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Prompts (batch 1) of `lengths`, none run before in this process (`seen`: the lengths that were; refused
    before anything runs), each through every arm (the arms rotated per length, so each arm meets some lengths
    first): the first call timed, then `steady_calls` more prompts of the same length, whose median is the steady
    state (one call's spread at 4K is ~10% on a loaded host: a single steady call would judge the spread, not first
    use). Per (length, arm): first / steady and whether the length was new to the process at that call (the first
    arm at it)."""
    repeated = sorted({n for n in lengths if list(lengths).count(n) > 1} | (set(lengths) & set(seen)))
    if repeated:
        raise ValueError(f"first_use lengths {repeated} are not new to this process (repeated or already run)")
    if not arms or not lengths:
        raise ValueError("first_use_rows needs arms and lengths")
    if steady_calls < 1:
        raise ValueError(f"steady_calls={steady_calls}: the steady state needs at least one call")
    measure = measure or _prefill(model, 1, prefill_chunk)
    rows = []
    for i, n in enumerate(lengths):
        for j, arm in enumerate(rotated(arms, i)):
            first = _call(measure, log, arm_name=arm, prompt_tokens=n, batch=1, seed=seed)
            steady = [_call(measure, log, arm_name=arm, prompt_tokens=n, batch=1, seed=seed + 1 + k)
                      for k in range(steady_calls)]
            row = {"arm": arm, "prompt_tokens": n, "new_to_process": j == 0,
                   "status": next((x["status"] for x in (first, *steady) if x["status"] != "ran"), "ran")}
            if row["status"] == "ran":
                steady_s = _median([x["ttft_s"] for x in steady])
                row.update(first_s=first["ttft_s"], steady_s=steady_s, steady_calls_s=[x["ttft_s"] for x in steady],
                           first_over_steady=first["ttft_s"] / steady_s)
            rows.append(row)
    return rows


def e2e_rows(model, arms: Sequence[str], *, prompt_tokens: int, new_tokens: int, prefill_chunk: int, seed: int = 0,
             warmup: Cell | None = WARMUP_CELL, measure: Callable[..., dict] | None = None,
             warmup_measure: Callable[..., dict] | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """One prompt of `prompt_tokens` plus `new_tokens` greedy tokens (batch 1) per arm, once each after the arm's
    untimed warm-up at `warmup` with `E2E_WARMUP_TOKENS` new tokens (None: every arm decoded in this process
    already): TTFT, end-to-end (the call to the last token), the decode between them, its time per token and its
    gaps, and the warm-up's first decode step (what the first decode in a process costs, kept out of the timed
    decode). `measure` / `warmup_measure` replace `measure_prefill` (the CPU tests' fakes)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens}: the end-to-end row needs a decode (>= 2 new tokens)")
    warmup_measure = warmup_measure or measure or _prefill(model, E2E_WARMUP_TOKENS, prefill_chunk)
    measure = measure or _prefill(model, new_tokens, prefill_chunk)
    rows = timed_cells(measure, arms, [(prompt_tokens, 1)], rounds=1, seed=seed, warmup=warmup,
                       warmup_measure=warmup_measure, log=log)
    for r in rows:
        r["new_tokens"] = new_tokens
        if r["status"] == "ran":
            r["e2e_s"] = r["generate_s"]
            r["decode_s"] = r["generate_s"] - r["ttft_s"]
            r["decode_ms_per_token"] = 1e3 * r["decode_s"] / (new_tokens - 1)
            gaps = r.get("token_gaps")
            if gaps:  # where the decode's time goes: its steady step and its spikes (model_decode.token_gaps)
                r["gap_median_ms"], r["gap_spikes"] = gaps["median_ms"], gaps["spikes"]
        warm_gaps = r.get("warmup_token_gaps")
        if warm_gaps:
            r["first_decode_step_ms"] = warm_gaps["first_ms"]
    return rows


def prefill_memory_rows(model, arms: Sequence[str], *, context: int, batches: Sequence[int], chunk: int,
                        seed: int = 0, log: Callable[[str], None] = print) -> list[dict]:
    """The peak of a `context`-token prefill at each batch per arm, by component (weights, cache, workspace,
    activations): `measure_prefill_tail`'s last chunk over a cache filled to `context - chunk` tokens a sequence."""
    rows = md.run_cells(md.measure_prefill_tail, [dict(model=model, arm_name=a, context=context, batch=b, chunk=chunk,
                                                       seed=seed) for b in batches for a in arms], log=log)
    for r in rows:
        r["status"] = _status(r)
    return rows


# --- verdicts ---------------------------------------------------------------------------------------------------------

def _target(text: str, value, met: bool) -> dict:
    return {"target": text, "value": value, "met": bool(met)}


def _cell_name(r: dict) -> str:
    return f"{r['prompt_tokens']:,} x {r['batch']}"


def floor_targets(rows: Sequence[dict]) -> list[dict]:
    """foldkv folded's TTFT / floor within `floor_bound` of its prompt at every cell (a cell it did not run: not
    met)."""
    out = []
    for r in rows:
        if r["arm"] != BOUNDED_ARM:
            continue
        bound = floor_bound(r["prompt_tokens"])
        value = r.get("ttft_over_floor") if r["status"] == "ran" else None
        out.append(_target(f"{r['arm']} TTFT / floor <= {bound} at {_cell_name(r)}", value,
                           value is not None and value <= bound))
    return out


def peer_targets(rows: Sequence[dict]) -> list[dict]:
    """foldkv folded and FP8 folded TTFT <= each peer's (`PEER_ARMS`) at every cell both have. A peer that does not
    fit where the folded arm ran is beaten; a peer that failed is not (nothing was compared: not met), nor is a
    folded arm that did not run where the peer did."""
    cells = {(r["arm"], r["prompt_tokens"], r["batch"]): r for r in rows}
    out = []
    for r in rows:
        if r["arm"] not in FOLDED_ARMS:
            continue
        for peer in PEER_ARMS:
            p = cells.get((peer, r["prompt_tokens"], r["batch"]))
            if p is None:
                continue
            text = f"{r['arm']} TTFT <= {peer}'s at {_cell_name(r)}"
            if r["status"] != "ran":
                out.append(_target(text, None, False))
            elif p["status"] != "ran":
                beaten = p["status"].startswith(DOES_NOT_FIT)
                out.append(_target(text + f" ({peer}: {p['status'].split(':')[0]})", None, beaten))
            else:
                out.append(_target(text, r["ttft_s"] / p["ttft_s"], r["ttft_s"] <= p["ttft_s"]))
    return out


def first_use_targets(rows: Sequence[dict], limit: float = FIRST_USE_LIMIT) -> list[dict]:
    """Every prompt of a new length within `limit` x the steady state of its length (its first / steady)."""
    return [_target(f"{r['arm']} first call at {r['prompt_tokens']:,} tokens <= {limit} x steady",
                    r.get("first_over_steady"), r["status"] == "ran" and r["first_over_steady"] <= limit)
            for r in rows]


E2E_ALONE = " (no other arm ran: nothing to be lowest against)"  # the end-to-end verdict's text with one arm


def e2e_targets(rows: Sequence[dict]) -> list[dict]:
    """foldkv folded's end-to-end latency the lowest of the arms that ran (value: folded over the lowest other); with
    no other arm run it is not met: one arm alone is not the lowest of anything."""
    folded = next((r for r in rows if r["arm"] == BOUNDED_ARM), None)
    if folded is None:
        return []
    others = [r["e2e_s"] for r in rows if r["arm"] != BOUNDED_ARM and r["status"] == "ran"]
    text = (f"{BOUNDED_ARM} end-to-end lowest ({folded['prompt_tokens']:,} prompt + {folded['new_tokens']:,} tokens,"
            " batch 1)")
    if folded["status"] != "ran":
        return [_target(text, None, False)]
    if not others:
        return [_target(text + E2E_ALONE, None, False)]
    return [_target(text, folded["e2e_s"] / min(others), folded["e2e_s"] <= min(others))]


def memory_targets(rows: Sequence[dict]) -> list[dict]:
    """Each foldkv arm's prefill peak <= `MEMORY_BASE_ARM`'s at the same cell, where both ran."""
    ran = {(r["arm"], r["context"], r["batch"]): r for r in rows if r["status"] == "ran"}
    out = []
    for (arm, n, b), r in ran.items():
        base = ran.get((MEMORY_BASE_ARM, n, b))
        if arm.startswith("foldkv") and arm != MEMORY_BASE_ARM and base is not None:
            out.append(_target(f"{arm} prefill peak <= {MEMORY_BASE_ARM}'s at {n:,} x {b}",
                               r["memory"]["peak"] / base["memory"]["peak"],
                               r["memory"]["peak"] <= base["memory"]["peak"]))
    return out


def targets(ttft: Sequence[dict] = (), first_use: Sequence[dict] = (), e2e: Sequence[dict] = (),
            memory: Sequence[dict] = ()) -> list[dict]:
    """Every verdict of the section, in order: floor, peers, first use, end-to-end, memory."""
    return (floor_targets(ttft) + peer_targets(ttft) + first_use_targets(first_use) + e2e_targets(e2e)
            + memory_targets(memory))


# --- verdicts of a run of record under the rules of today -------------------------------------------------------------

# The rules that changed after a run recorded its verdicts. Each: what changed, and what the rule before the change
# said of a verdict today's rule gives (`earlier(target)`: the recorded form, None where the change does not touch
# it). A recorded verdict that differs from today's is taken as the run's only when a change gives exactly it.
RULE_CHANGES: dict[str, dict] = {
    "end-to-end alone": {
        "short": "end-to-end with one arm: met then, not met now",
        "what": "the end-to-end verdict with no other arm run was met under the earlier rule and is not met now (one "
                "arm alone is not the lowest of anything)",
        "earlier": lambda t: ({"target": t["target"][:-len(E2E_ALONE)] + " (no other arm ran)", "value": None,
                               "met": True}
                              if t["target"].endswith(E2E_ALONE) and t["value"] is None and not t["met"] else None),
    },
    "failed peer": {
        "short": "a peer that failed: met then, not met now",
        "what": "a peer verdict where the peer failed (an error, not an out of memory) was met under the earlier rule "
                "and is not met now (nothing was compared)",
        "earlier": lambda t: ({**t, "met": True} if t["value"] is None and not t["met"]
                              and t["target"].endswith(": failed)") else None),
    },
}
ONE_STEADY_CALL = {
    "short": "steady state of {n} call(s), the rule now: the median of " + str(FIRST_USE_STEADY_CALLS),
    "what": "a first-use row's steady state is now the median of " + str(FIRST_USE_STEADY_CALLS) + " calls at its "
            "length (one 4K call spreads ~10%); a row of fewer calls cannot be judged by today's rule, so its verdict "
            "is the recorded one and today's is 'cannot tell'",
}


def steady_calls(row: dict) -> int:
    """How many calls a first-use row's steady state is the median of (a row without `steady_calls_s`: one)."""
    return len(row["steady_calls_s"]) if "steady_calls_s" in row else (1 if row.get("steady_s") is not None else 0)


def against_record(now: Sequence[dict], recorded: Sequence[dict], first_use: Sequence[dict] = ()
                   ) -> tuple[list[dict], list[dict]]:
    """Today's verdicts `now` (`targets` of a run of record's rows) beside the ones that run recorded.

    Returns (as_recorded, side_by_side). `as_recorded`: `now` with each verdict a changed rule explains (`RULE_CHANGES`:
    its earlier form equals the recorded one exactly) put in that recorded form: hold it to the recorded verdicts (it
    equals them unless a number or a verdict differs for a reason no rule change gives; the caller fails the section
    then). `side_by_side`: one row a verdict: target, value, `met_recorded`, `met_now` (None where today's rule cannot be
    computed from the run's data: a first-use row with fewer than `FIRST_USE_STEADY_CALLS` steady calls), and `rule`
    (which rule changed, "" where none did)."""
    short = {f"{r['arm']} first call at {r['prompt_tokens']:,} tokens": steady_calls(r) for r in first_use
             if r.get("status") == "ran" and steady_calls(r) < FIRST_USE_STEADY_CALLS}
    aligned = len(now) == len(recorded)
    as_recorded, side = [], []
    for i, t in enumerate(now):
        rec = recorded[i] if aligned else None
        rule, shown = "", t
        if rec is not None and rec != t:
            for name, change in RULE_CHANGES.items():
                if change["earlier"](t) == rec:
                    rule, shown = change["short"], rec
                    break
        as_recorded.append(shown)
        met_now = t["met"]
        prefix = t["target"].split(" <= ")[0]
        if prefix in short:
            met_now, rule = None, ONE_STEADY_CALL["short"].format(n=short[prefix])
        side.append({"target": t["target"], "value": t["value"], "met_recorded": rec["met"] if rec else None,
                     "met_now": met_now, "rule": rule})
    return as_recorded, side


def _met_text(met) -> str:
    return {True: "met", False: "not met", None: "cannot tell"}[met]


def side_by_side_markdown(side: Sequence[dict], label: str = "") -> str:
    """The verdicts as recorded and under today's rules, one row each, with a count line first; `label`: whose numbers
    (e.g. "from the run of record <run>, commit <hash>")."""
    from .report import markdown_table

    n = len(side)
    rec = sum(1 for s in side if s["met_recorded"])
    now = [s["met_now"] for s in side]
    head = (f"**{rec} of {n} targets met as recorded; under today's rules {now.count(True)} met, {now.count(False)} "
            f"not met, {now.count(None)} cannot be told from the run's data**" + (f" ({label})" if label else "") + ".")
    rows = [{**s, "met_recorded": _met_text(s["met_recorded"]), "met_now": _met_text(s["met_now"])} for s in side]
    said = {s["rule"] for s in side}
    notes = [c["what"] for c in RULE_CHANGES.values() if c["short"] in said]
    if any(r.startswith(ONE_STEADY_CALL["short"].split("{")[0]) for r in said):
        notes.append(ONE_STEADY_CALL["what"])
    return (head + "\n\n" + markdown_table(rows, {"target": "target", "value": "value", "met_recorded": "as recorded",
                                                   "met_now": "today's rules", "rule": "rule changed since the run"},
                                            {"value": ".3f"})
            + "".join(f"\n\n*Rule changed since the run:* {n}." for n in notes))


# --- tables and the figure ----------------------------------------------------------------------------------------

def ttft_table(rows: Sequence[dict]) -> str:
    from .report import markdown_table

    return markdown_table(rows, {"arm": "arm", "prompt_tokens": "prompt", "batch": "batch", "ttft_s": "TTFT s",
                                 "floor_s": "floor s", "ttft_over_floor": "TTFT / floor",
                                 "warmup_s": "arm's warm-up s", "rounds_run": "rounds", "from": "timed in", "status": "status"},
                          {"prompt_tokens": ",d", "ttft_s": ".3f", "floor_s": ".3f", "ttft_over_floor": ".2f",
                           "warmup_s": ".3f"})


def first_use_table(rows: Sequence[dict]) -> str:
    from .report import markdown_table

    return markdown_table(rows, {"arm": "arm", "prompt_tokens": "prompt", "new_to_process": "new to the process",
                                 "first_s": "first call s", "steady_s": "steady s",
                                 "first_over_steady": "first / steady", "status": "status"},
                          {"prompt_tokens": ",d", "first_s": ".3f", "steady_s": ".3f", "first_over_steady": ".3f"})


def e2e_table(rows: Sequence[dict]) -> str:
    from .report import markdown_table

    return markdown_table(rows, {"arm": "arm", "prompt_tokens": "prompt", "new_tokens": "new tokens",
                                 "ttft_s": "TTFT s", "decode_s": "decode s", "decode_ms_per_token": "ms / token",
                                 "gap_median_ms": "median gap ms", "gap_spikes": "gaps > 2x median",
                                 "e2e_s": "end-to-end s", "first_decode_step_ms": "warm-up's first decode step ms",
                                 "status": "status"},
                          {"prompt_tokens": ",d", "new_tokens": ",d", "ttft_s": ".2f", "decode_s": ".2f",
                           "decode_ms_per_token": ".2f", "gap_median_ms": ".2f", "e2e_s": ".2f",
                           "first_decode_step_ms": ".1f"})


def plot_ttft_over_floor(rows: Sequence[dict], path: str | None = None):
    """TTFT / floor against prompt length per arm (one panel per batch, log x), foldkv folded's bounds dashed. Each arm
    in its palette style (`palette.Styles`), the bound a limit's dashes, TTFT = floor a floor's, one legend beside the
    panels; constrained layout, so a redraw's title (`RecordRedraw.mark`) sits apart from the panels' titles."""
    import matplotlib.pyplot as plt

    from .palette import Styles, finish_batch_panels

    ran = [r for r in rows if r["status"] == "ran" and r.get("ttft_over_floor") is not None]
    batches = sorted({r["batch"] for r in ran}) or [1]
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches) + 2, 4), squeeze=False,
                             layout="constrained")
    st = Styles()
    for ax, b in zip(axes[0], batches):
        prompts = sorted({r["prompt_tokens"] for r in ran if r["batch"] == b})
        for arm in dict.fromkeys(r["arm"] for r in ran):
            pts = sorted((r["prompt_tokens"], r["ttft_over_floor"]) for r in ran
                         if r["arm"] == arm and r["batch"] == b)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=arm, **st.line(arm))
        if prompts:
            ax.plot(prompts, [floor_bound(p) for p in prompts], label=f"{BOUNDED_ARM} bound",
                    **st.line("limit", drawstyle="steps-post",  # one prompt: the bound a mark, not a line
                              **({"markersize": 20} if len(prompts) == 1 else {"marker": None})))
            ax.plot([prompts[0], prompts[-1]], [1.0, 1.0], label="TTFT = floor", **st.line("floor", marker=None))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt (tokens)")
        ax.set_ylabel("TTFT / compute floor")
    return finish_batch_panels(fig, axes[0], batches, path)


__all__ = ["BOUNDED_ARM", "DOES_NOT_FIT", "E2E_ALONE", "E2E_CALL", "ONE_STEADY_CALL", "RULE_CHANGES", "against_record",
           "side_by_side_markdown", "steady_calls", "with_e2e_ttft", "FIRST_USE_LIMIT", "FLOOR_BOUNDS", "FOLDED_ARMS", "MEMORY_BASE_ARM",
           "FIRST_USE_STEADY_CALLS", "PEER_ARMS", "WARMUP_CELL", "e2e_rows", "e2e_table", "e2e_targets", "first_use_rows", "first_use_table",
           "first_use_targets", "floor_bound", "floor_targets", "memory_targets", "parse_cells", "peer_targets",
           "plot_ttft_over_floor", "prefill_memory_rows", "rotated", "schedule", "targets", "timed_cells",
           "ttft_cells", "ttft_table", "with_floor"]
