"""Notebook 07's time to first token (`foldkv.lab.ttft`) on the CPU, with a fake measurement in place of
generate(): the arms' rotated order, each arm's untimed warm-up kept apart from the steady state, a cell that runs out of
memory recorded as not fitting, the floor from the model's shapes, the first-use and end-to-end rows, and every
verdict on made-up rows. Red twins: a schedule that never rotates, a median that keeps the warm-up, a floor verdict
that ignores the floor (TTFT in seconds held to the bound), one bound for every prompt, a peer verdict that lets a
folded arm that did not fit pass; each is caught by the check the real function passes.

The notebook's GPU sections wait for CUDA (checked statically here on the notebook); without it they are redrawn from
its run of record (tests/test_redraw_cpu.py, and by running it in tests/test_notebooks.py).
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from foldkv.lab import prefill_floor as pf
from foldkv.lab import ttft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = "07_time_to_first_token.ipynb"
ARMS = ["foldkv-folded", "foldkv-fp8", "foldkv-split", "flashinfer", "sdpa"]
SHAPES = pf.ModelShapes(linear_weights=10_000, lm_head_weights=500,
                        attention=(pf.AttentionShape(4, 8, 16), pf.AttentionShape(4, 32, None)))


class FakeMeasure:
    """measure_prefill's stand-in: records each call; an arm's first call in the process takes FIRST_S (what a first
    use pays; `per_length`: the first call of each (cell, arm), a library with per-length state), later calls
    STEADY_S[arm] + a small per-seed spread; `oom` cells raise CUDA's out-of-memory error."""

    FIRST_S = 9.0
    STEADY_S = {a: 1.0 + 0.1 * i for i, a in enumerate(ARMS)}

    def __init__(self, oom=(), fail=(), per_length=False):
        self.calls, self.oom, self.fail, self.seen = [], set(oom), set(fail), set()
        self.per_length = per_length

    def __call__(self, *, arm_name, prompt_tokens, batch, seed):
        key = (prompt_tokens, batch, arm_name)
        self.calls.append((arm_name, prompt_tokens, batch, seed))
        if key in self.oom:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        if key in self.fail:
            raise RuntimeError("a kernel refused")
        first_key = key if self.per_length else arm_name
        first = first_key not in self.seen
        self.seen.add(first_key)
        t = self.FIRST_S if first else self.STEADY_S[arm_name] + 0.01 * (seed % 3)
        return {"arm": arm_name, "status": "ran", "prompt_tokens": prompt_tokens, "batch": batch, "ttft_s": t,
                "generate_s": t + 2.0, "peak_bytes": 1, "memory": {"peak": 1}}


def quiet(_):
    pass


# --- rotation -------------------------------------------------------------------------------------------------------

def check_rotation(schedule_fn) -> None:
    """Round r starts at arm r mod n and keeps the cyclic order; every arm runs first in some round."""
    arms, cells = ["a", "b", "c"], [(4096, 1), (32768, 4)]
    got = schedule_fn(arms, cells, 4)
    assert len(got) == 4 * len(cells) * len(arms)
    for r in range(4):
        for cell in cells:
            order = [a for rr, c, a in got if rr == r and c == cell]
            k = r % 3
            assert order == arms[k:] + arms[:k], (r, cell, order)
    assert {next(a for rr, _, a in got if rr == r) for r in range(3)} == set(arms)


def test_rotation_order():
    assert ttft.rotated(ARMS, 0) == ARMS and ttft.rotated(ARMS, 7) == ARMS[2:] + ARMS[:2]
    check_rotation(ttft.schedule)


def test_rotation_red_twin_never_rotates():
    def never(arms, cells, rounds):
        return [(r, c, a) for r in range(rounds) for c in cells for a in arms]

    with pytest.raises(AssertionError):
        check_rotation(never)


def check_cell_rounds(schedule_fn) -> None:
    """A cell with rounds of its own gets that many (every one rotated), the others `rounds`; no call more."""
    arms, cells = ["a", "b", "c"], [(4096, 1), (32768, 4)]
    got = schedule_fn(arms, cells, {(4096, 1): 5, (32768, 4): 1})
    for cell, n in ((4096, 1), 5), ((32768, 4), 1):
        mine = [(r, a) for r, c, a in got if c == cell]
        assert len(mine) == n * len(arms), (cell, mine)
        for r in range(n):
            assert [a for rr, a in mine if rr == r] == arms[r % 3:] + arms[:r % 3], (cell, r, mine)


def test_a_cell_with_rounds_of_its_own():
    check_cell_rounds(ttft.schedule)
    rows = ttft.timed_cells(FakeMeasure(), ARMS, [(4096, 1), (32768, 4)], rounds={(4096, 1): 3, (32768, 4): 1},
                            log=quiet)
    assert {(r["prompt_tokens"], r["rounds_run"]) for r in rows} == {(4096, 3), (32768, 1)}


def test_cell_rounds_red_twin_every_cell_the_most_rounds():
    def most(arms, cells, rounds):
        return ttft.schedule(arms, cells, max(rounds.values()))

    with pytest.raises(AssertionError):
        check_cell_rounds(most)


def test_a_cell_names_its_own_rounds():
    cells, rounds = ttft.parse_cells(["4096:1:5", "32768:4"], 2)
    assert cells == [(4096, 1), (32768, 4)] and rounds == {(4096, 1): 5, (32768, 4): 2}


@pytest.mark.parametrize("text", ["4096:1:0", "4096:1:x", "4096:1:-2", "4096:1:5:1", "4096"])
def test_a_bad_cell_is_refused(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=f"cell '{text}'"):
        ttft.parse_cells([text], 1)


@pytest.mark.parametrize("rounds", [0, {(4096, 1): 2}, {(4096, 1): 2, (32768, 4): 0},
                                    {(4096, 1): 2, (32768, 4): 1, (512, 1): 1}])
def test_bad_rounds_are_refused_before_any_call(rounds):
    fake = FakeMeasure()
    with pytest.raises(ValueError, match="need a count >= 1 for each cell"):
        ttft.timed_cells(fake, ARMS, [(4096, 1), (32768, 4)], rounds=rounds, log=quiet)
    assert fake.calls == []


def test_timed_calls_follow_the_schedule():
    fake = FakeMeasure()
    cells = [(4096, 1), (32768, 4)]
    ttft.timed_cells(fake, ARMS, cells, rounds=3, log=quiet)
    timed = [(a, (n, b)) for a, n, b, _ in fake.calls[len(ARMS):]]
    assert timed == [(a, c) for _, c, a in ttft.schedule(ARMS, cells, 3)]


# --- each arm's untimed warm-up -------------------------------------------------------------------------------------

def check_steady(rows, rounds: int) -> None:
    """Each row's TTFT is the median of `rounds` steady calls (none of them an arm's first call), the warm-up apart."""
    for r in rows:
        assert r["status"] == "ran" and r["rounds_run"] == rounds
        assert FakeMeasure.FIRST_S not in r["ttft_rounds_s"], r
        assert r["ttft_s"] == pytest.approx(statistics.median(r["ttft_rounds_s"]))
        assert r["ttft_s"] < 2.0 and r["warmup_s"] == FakeMeasure.FIRST_S


def test_one_untimed_warmup_an_arm_precedes_the_rounds():
    fake = FakeMeasure()
    cells = [(4096, 1), (131072, 1)]
    rows = ttft.timed_cells(fake, ARMS, cells, rounds=2, log=quiet)
    first = fake.calls[:len(ARMS)]
    assert [(a, (n, b)) for a, n, b, _ in first] == [(a, ttft.WARMUP_CELL) for a in ARMS]
    assert len(fake.calls) == len(ARMS) + len(cells) * len(ARMS) * 2
    check_steady(rows, 2)
    seeds = {s for _, _, _, s in fake.calls[len(first):]}
    assert seeds == {1, 2}, "each round draws its own prompts"


def test_a_one_token_cell_carries_no_empty_gaps():
    """measure_prefill's one-token call has token_gaps None: the row has no such key (not a null column)."""
    def one_token(**cell):
        return {**FakeMeasure()(**cell), "token_gaps": None, "new_tokens": 1}

    [row] = ttft.timed_cells(one_token, ARMS[:1], [(4096, 1)], rounds=1, warmup=None, log=quiet)
    assert "token_gaps" not in row and row["new_tokens"] == 1


def test_untimed_warmup_red_twin_a_median_that_keeps_it():
    rows = ttft.timed_cells(FakeMeasure(), ARMS, [(4096, 1)], rounds=1, warmup=None, log=quiet)
    with pytest.raises(AssertionError):
        check_steady(rows, 1)


def test_a_cell_that_runs_out_of_memory_does_not_fit():
    fake = FakeMeasure(oom={(131072, 1, "sdpa")}, fail={(4096, 1, "flashinfer")})
    rows = ttft.timed_cells(fake, ARMS, [(4096, 1), (131072, 1)], rounds=3, log=quiet)
    by = {(r["arm"], r["prompt_tokens"]): r for r in rows}
    oom = by["sdpa", 131072]
    assert oom["status"].startswith(ttft.DOES_NOT_FIT) and "OutOfMemoryError" in oom["status"]
    assert oom["ttft_s"] is None and oom["rounds_run"] == 0
    assert sum(1 for a, n, _, _ in fake.calls if (a, n) == ("sdpa", 131072)) == 1, "its rounds were run anyway"
    assert by["flashinfer", 4096]["status"].startswith("failed: RuntimeError")
    assert all(r["status"] == "ran" for k, r in by.items() if k not in {("sdpa", 131072), ("flashinfer", 4096)})


def test_ttft_cells_floor_from_the_shapes():
    fake = FakeMeasure()
    out = ttft.ttft_cells(SHAPES, ARMS[:2], [(64, 1), (200, 2)], rounds=2, prefill_chunk=32, matmul_tflops=2e-6,
                          measure=fake, log=quiet)
    assert out["matmul"] == {"tflops": 2e-6}
    for r in out["rows"]:
        flops = pf.prefill_flops(SHAPES, r["prompt_tokens"], r["batch"], 32).total
        assert r["flops"] == flops and r["floor_s"] == pytest.approx(flops / 2e6)
        assert r["ttft_over_floor"] == pytest.approx(r["ttft_s"] / r["floor_s"])
    a, b = (r for r in out["rows"] if r["arm"] == ARMS[0])
    assert b["flops"] > 2 * a["flops"], "a longer prompt at batch 2 needs more than twice the FLOPs"


# --- first use and end to end ---------------------------------------------------------------------------------------

def test_first_use_rows():
    fake = FakeMeasure(per_length=True)  # a library whose first call at each length costs more: first / steady > 1
    rows = ttft.first_use_rows(None, ARMS[:2], [4099, 4101, 4103], prefill_chunk=4096, seen=[4096], measure=fake,
                               log=quiet)
    assert [(r["prompt_tokens"], r["arm"], r["new_to_process"]) for r in rows] == [
        (4099, ARMS[0], True), (4099, ARMS[1], False), (4101, ARMS[1], True), (4101, ARMS[0], False),
        (4103, ARMS[0], True), (4103, ARMS[1], False)]
    for r in rows:
        assert r["first_over_steady"] == pytest.approx(r["first_s"] / r["steady_s"]) and r["first_over_steady"] > 1
    assert [a for a, *_ in fake.calls[:4]] == [ARMS[0]] * 4, "first, then steady, of the same arm and length"
    assert len(fake.calls) == 3 * 2 * (1 + ttft.FIRST_USE_STEADY_CALLS)
    assert all(len(r["steady_calls_s"]) == ttft.FIRST_USE_STEADY_CALLS for r in rows)


def test_first_use_steady_is_a_median():
    """One slow steady call (the host's spread) moves the mean, not the median: first / steady stays 1."""
    times = iter([1.0, 1.0, 1.5, 1.0])  # first, then three steady calls, one of them slow

    def measure(*, arm_name, prompt_tokens, batch, seed):
        t = next(times)
        return {"arm": arm_name, "status": "ran", "ttft_s": t, "generate_s": t}
    [row] = ttft.first_use_rows(None, ARMS[:1], [4099], prefill_chunk=4096, measure=measure, log=quiet)
    assert row["steady_s"] == 1.0 and row["first_over_steady"] == 1.0
    with pytest.raises(ValueError, match="steady_calls"):
        ttft.first_use_rows(None, ARMS[:1], [4099], prefill_chunk=4096, steady_calls=0, measure=measure, log=quiet)


@pytest.mark.parametrize("lengths,seen", [([4099, 4099], []), ([4099, 4101], [4101])])
def test_first_use_refuses_a_length_not_new(lengths, seen):
    fake = FakeMeasure()
    with pytest.raises(ValueError, match="not new to this process"):
        ttft.first_use_rows(None, ARMS[:1], lengths, prefill_chunk=4096, seen=seen, measure=fake, log=quiet)
    assert fake.calls == [], "something ran before the refusal"


class FakeDecode:
    """measure_prefill's stand-in with a decode: `new_tokens` stamps, a prompt of TTFT_S, each step STEP_MS[arm],
    and an arm's first decode step in the process FIRST_STEP_MS more (its kernels loaded, its graph captured)."""

    TTFT_S, FIRST_STEP_MS = 1.0, 3400.0
    STEP_MS = {"foldkv-folded": 17.7, "foldkv-fp8": 17.8, "foldkv-split": 18.7}

    def __init__(self, new_tokens: int):
        self.new_tokens, self.calls, self.decoded = new_tokens, [], set()

    def __call__(self, *, arm_name, prompt_tokens, batch, seed):
        from foldkv.lab import model_decode as md

        self.calls.append((arm_name, prompt_tokens, self.new_tokens))
        stamps = [self.TTFT_S]
        for _ in range(self.new_tokens - 1):
            first = arm_name not in self.decoded
            self.decoded.add(arm_name)
            stamps.append(stamps[-1] + (self.STEP_MS[arm_name] + (self.FIRST_STEP_MS if first else 0.0)) / 1e3)
        return {"arm": arm_name, "status": "ran", "prompt_tokens": prompt_tokens, "batch": batch,
                "new_tokens": self.new_tokens, "ttft_s": stamps[0], "generate_s": stamps[-1],
                "token_gaps": md.token_gaps(stamps), "peak_bytes": 1, "memory": {"peak": 1}}


def check_e2e_steady(rows) -> None:
    """Every arm's decode per token within 1% of its step: no first decode step inside a timed decode."""
    for r in rows:
        assert r["decode_ms_per_token"] == pytest.approx(FakeDecode.STEP_MS[r["arm"]], rel=0.01), r
        assert r["gap_median_ms"] == pytest.approx(FakeDecode.STEP_MS[r["arm"]]), r


def test_e2e_rows():
    """Each arm decodes `E2E_WARMUP_TOKENS` untimed first: its timed decode is the steady step, its first decode
    step is recorded apart, and the row carries the decode's gaps."""
    arms = list(FakeDecode.STEP_MS)
    timed, warm = FakeDecode(1024), FakeDecode(ttft.E2E_WARMUP_TOKENS)
    warm.decoded = timed.decoded  # one process: what the warm-up decoded is decoded for the timed call too
    rows = ttft.e2e_rows(None, arms, prompt_tokens=131072, new_tokens=1024, prefill_chunk=4096, measure=timed,
                         warmup_measure=warm, log=quiet)
    assert [c[0] for c in warm.calls] == arms and [c[0] for c in timed.calls] == arms
    check_e2e_steady(rows)
    for r in rows:
        assert r["first_decode_step_ms"] == pytest.approx(FakeDecode.FIRST_STEP_MS + FakeDecode.STEP_MS[r["arm"]])
        assert r["e2e_s"] == pytest.approx(r["ttft_s"] + r["decode_s"]) and r["gap_spikes"] == 0
    fake = FakeMeasure()
    ttft.e2e_rows(None, ARMS[:3], prompt_tokens=1024, new_tokens=11, prefill_chunk=256, warmup=None,
                  measure=fake, log=quiet)
    assert len(fake.calls) == 3
    with pytest.raises(ValueError, match="needs a decode"):
        ttft.e2e_rows(None, ARMS[:1], prompt_tokens=1024, new_tokens=1, prefill_chunk=256, measure=fake)


def test_e2e_rows_red_twin_a_warmup_without_decode():
    """Red twin: warmed up as a TTFT cell is (one new token, no decode), each arm's timed decode carries its first
    decode step, 3.4 ms a token here (the record h200-20261206's folded row, the first arm: 21.7 ms a token against
    notebook 05's 17.7 ms TPOT)."""
    arms = list(FakeDecode.STEP_MS)
    timed, warm = FakeDecode(1024), FakeDecode(1)
    warm.decoded = timed.decoded
    rows = ttft.e2e_rows(None, arms, prompt_tokens=131072, new_tokens=1024, prefill_chunk=4096, measure=timed,
                         warmup_measure=warm, log=quiet)
    with pytest.raises(AssertionError):
        check_e2e_steady(rows)
    assert rows[0]["decode_ms_per_token"] == pytest.approx(17.7 + 3400.0 / 1023)
    assert "first_decode_step_ms" not in rows[0]


# --- verdicts on made-up rows ---------------------------------------------------------------------------------------

def row(arm, prompt, batch=1, ttft_s=1.0, floor_s=1.0, status="ran"):
    ran = status == "ran"
    return {"arm": arm, "prompt_tokens": prompt, "batch": batch, "status": status, "ttft_s": ttft_s if ran else None,
            "floor_s": floor_s, "ttft_over_floor": ttft_s / floor_s if ran else None}


def check_floor_verdicts(fn) -> None:
    rows = [row("foldkv-folded", 4096, ttft_s=0.75, floor_s=0.5),      # 1.5x: within 1.6 at 4K
            row("foldkv-folded", 32768, ttft_s=1.0, floor_s=0.5),      # 2.0x in 1.0 s: not met
            row("foldkv-folded", 32768, 4, ttft_s=13.0, floor_s=10.0),  # 1.3x in 13 s: met
            row("foldkv-folded", 131072, ttft_s=15.0, floor_s=10.0),    # 1.5x: within 1.6 but not 1.35
            row("foldkv-folded", 262144, status="does not fit: OutOfMemoryError"),
            row("foldkv-split", 32768, ttft_s=0.1, floor_s=1.0)]        # not held to the floor
    got = [t["met"] for t in fn(rows)]
    assert got == [True, False, True, False, False], got


def test_floor_verdicts():
    check_floor_verdicts(ttft.floor_targets)
    assert ttft.floor_bound(4096) == 1.6 and ttft.floor_bound(32768) == ttft.floor_bound(131072) == 1.35


def test_floor_verdict_red_twin_ignores_the_floor(monkeypatch):
    def seconds(rows):  # TTFT in seconds held to the bound: the floor never read
        return [{"met": r["status"] == "ran" and r["ttft_s"] <= ttft.floor_bound(r["prompt_tokens"])}
                for r in rows if r["arm"] == ttft.BOUNDED_ARM]

    with pytest.raises(AssertionError):
        check_floor_verdicts(seconds)
    monkeypatch.setattr(ttft, "FLOOR_BOUNDS", ((0, 1.6),))  # one bound for every prompt
    with pytest.raises(AssertionError):
        check_floor_verdicts(ttft.floor_targets)


def check_peer_verdicts(fn) -> None:
    rows = [row("foldkv-folded", 4096, ttft_s=1.0), row("foldkv-fp8", 4096, ttft_s=1.2),
            row("foldkv-split", 4096, ttft_s=1.1), row("flashinfer", 4096, ttft_s=1.05),
            row("foldkv-folded", 131072, status="does not fit: OutOfMemoryError"), row("foldkv-fp8", 131072, ttft_s=5),
            row("foldkv-split", 131072, ttft_s=6.0), row("flashinfer", 131072, status="does not fit: OutOfMemoryError"),
            row("foldkv-folded", 32768, ttft_s=4.0), row("foldkv-split", 32768, ttft_s=4.2),
            row("flashinfer", 32768, status="failed: AttributeError: x"),  # an error compares nothing
            row("sdpa", 4096, ttft_s=0.5)]  # not a peer of this target
    got = {t["target"]: t["met"] for t in fn(rows)}
    assert got == {"foldkv-folded TTFT <= foldkv-split's at 4,096 x 1": True,
                   "foldkv-folded TTFT <= flashinfer's at 4,096 x 1": True,
                   "foldkv-fp8 TTFT <= foldkv-split's at 4,096 x 1": False,
                   "foldkv-fp8 TTFT <= flashinfer's at 4,096 x 1": False,
                   "foldkv-folded TTFT <= foldkv-split's at 131,072 x 1": False,
                   "foldkv-folded TTFT <= flashinfer's at 131,072 x 1": False,
                   "foldkv-fp8 TTFT <= foldkv-split's at 131,072 x 1": True,
                   "foldkv-fp8 TTFT <= flashinfer's at 131,072 x 1 (flashinfer: does not fit)": True,
                   "foldkv-folded TTFT <= foldkv-split's at 32,768 x 1": True,
                   "foldkv-folded TTFT <= flashinfer's at 32,768 x 1 (flashinfer: failed)": False}, got


def test_peer_verdicts():
    check_peer_verdicts(ttft.peer_targets)


def test_peer_verdict_red_twin_a_folded_arm_that_did_not_fit_passes():
    def lenient(rows):
        return [t if t["value"] is not None else {**t, "met": True} for t in ttft.peer_targets(rows)]

    with pytest.raises(AssertionError):
        check_peer_verdicts(lenient)


def test_peer_verdict_red_twin_a_failed_peer_is_beaten():
    def any_status(rows):  # every peer that did not run counted as beaten (the rule before): an error too
        return [{**t, "met": True} if t["value"] is None and t["target"].endswith(")") else t
                for t in ttft.peer_targets(rows)]

    with pytest.raises(AssertionError):
        check_peer_verdicts(any_status)


def test_first_use_e2e_and_memory_verdicts():
    fu = [{"arm": "foldkv-folded", "prompt_tokens": 4099, "status": "ran", "first_over_steady": 1.04},
          {"arm": "foldkv-folded", "prompt_tokens": 4101, "status": "ran", "first_over_steady": 1.06},
          {"arm": "foldkv-folded", "prompt_tokens": 4103, "status": "failed: x"}]
    assert [t["met"] for t in ttft.first_use_targets(fu)] == [True, False, False]
    e2e = [{"arm": a, "prompt_tokens": 131072, "new_tokens": 1024, "status": "ran", "e2e_s": s}
           for a, s in (("foldkv-folded", 30.0), ("foldkv-split", 31.0), ("flashinfer", 29.0))]
    [t] = ttft.e2e_targets(e2e)
    assert not t["met"] and t["value"] == pytest.approx(30 / 29)
    [t] = ttft.e2e_targets([r for r in e2e if r["arm"] != "flashinfer"])
    assert t["met"]
    [t] = ttft.e2e_targets([{**e2e[0], "status": "does not fit: OutOfMemoryError"}] + e2e[1:])
    assert not t["met"]
    [t] = ttft.e2e_targets(e2e[:1])  # folded alone: nothing compared, so not met
    assert not t["met"] and t["value"] is None and "no other arm ran" in t["target"]
    mem = [{"arm": a, "context": 131072, "batch": b, "status": "ran", "memory": {"peak": p}}
           for a, b, p in (("foldkv-folded", 1, 90), ("foldkv-split", 1, 95), ("foldkv-fp8", 4, 99),
                           ("foldkv-split", 4, 98), ("sdpa", 4, 50))]
    assert {t["target"]: t["met"] for t in ttft.memory_targets(mem)} == {
        "foldkv-folded prefill peak <= foldkv-split's at 131,072 x 1": True,
        "foldkv-fp8 prefill peak <= foldkv-split's at 131,072 x 4": False}
    assert len(ttft.targets(ttft=[], first_use=fu, e2e=e2e, memory=mem)) == 3 + 1 + 2


def test_plot_runs_headless(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    rows = [row(a, n, ttft_s=1.0 + i, floor_s=1.0) for i, a in enumerate(ARMS[:2]) for n in (4096, 32768)]
    ttft.plot_ttft_over_floor(rows + [row("sdpa", 131072, status="does not fit")], str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 0


# --- the notebook records the section "not run" on a CPU --------------------------------------------------------------

def test_notebook_sections_wait_for_cuda():
    """Every section the TTFT cells record is in the list the model cell hands `cuda_or_not_run`, so a CPU records each
    as "not run: no CUDA device" before any cell could measure."""
    with open(os.path.join(ROOT, "notebooks", NOTEBOOK)) as fh:
        code = ["".join(c["source"]) for c in json.load(fh)["cells"] if c["cell_type"] == "code"]
    gate = next(c for c in code if "cuda_or_not_run" in c)
    for section in ("ttft_31b", "first_use_31b", "e2e_31b", "prefill_memory_31b"):
        assert f'"{section}"' in gate, section
        assert any(f'record.ran("{section}"' in c for c in code), section


def _ttft_cells_of_the_notebook() -> list[str]:
    """The code cells of notebook 07's measuring sections, from the TTFT cells' markdown to its targets."""
    with open(os.path.join(ROOT, "notebooks", NOTEBOOK)) as fh:
        cells = json.load(fh)["cells"]
    start = next(i for i, c in enumerate(cells) if "".join(c["source"]).startswith("## Time to first token against"))
    end = next(i for i, c in enumerate(cells) if "".join(c["source"]).startswith("## Targets"))
    return ["".join(c["source"]) for c in cells[start:end + 2] if c["cell_type"] == "code"]


def test_notebook_cells_on_fake_measurements(tmp_path, monkeypatch):
    """The section's cells as a GPU runs them, on a tiny model with generate() replaced by fakes: every section
    records "ran", the rows carry the floor, the first use and end-to-end rows exist, and the targets are computed."""
    pytest.importorskip("transformers")
    import matplotlib

    matplotlib.use("Agg")
    from transformers import Gemma4ForCausalLM

    from foldkv.lab import model_decode as md
    from foldkv.lab.bench import roofs
    from foldkv.lab.gemma31b import _text_config
    from foldkv.lab.report import RunRecord
    from foldkv.lab.synthetic import synthetic_config

    cfg = synthetic_config(vocab_size=160, hidden_size=64, intermediate_size=96,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=64, sliding_head_dim=16,
                           sliding_kv_heads=2, num_q_heads=4, global_kv_heads=1, global_head_dim=512, dtype="float32")
    cfg.pop("foldkv_synthetic", None)
    tiny = Gemma4ForCausalLM(_text_config(cfg, "eager"))
    steady = FakeMeasure()

    decoded = []  # (arm, prompt tokens) of each call that decodes (more than one new token)

    def prefill(model, arm_name, *, prompt_tokens, new_tokens, prefill_chunk, seed=0, batch=1):
        if new_tokens > 1:
            decoded.append((arm_name, prompt_tokens, new_tokens))
        r = steady(arm_name=arm_name, prompt_tokens=prompt_tokens, batch=batch, seed=seed)
        return {**r, "new_tokens": new_tokens, "tokens": [1] * new_tokens}

    def tail(model, arm_name, *, context, batch, chunk, seed=0):
        m = {"weights": 10, "cache": 5 * batch, "workspace": 1, "activations": 2, "peak": 18 + 5 * batch}
        return {"arm": arm_name, "status": "ran", "context": context, "batch": batch, "chunk": chunk, "chunk_s": 0.5,
                "peak_bytes": m["peak"] - 10, "memory": m}

    monkeypatch.setattr(md, "measure_prefill", prefill)
    monkeypatch.setattr(md, "measure_prefill_tail", tail)
    monkeypatch.setattr(roofs, "measure_matmul_roof", lambda dev: {"tflops": 1e-6, "n": 8, "us": {}})
    from foldkv.lab.report import RecordRedraw

    record = RunRecord("07_time_to_first_token", tmp_path)
    ns = dict(model31=tiny, record=record, redraw=RecordRedraw(record, cuda=True), out_dir=str(tmp_path), seed=0, prefill_chunk=256, os=os, json=json,
              ttft_cells=["256:1:3", "512:2"], ttft_arms=ARMS[:3], ttft_rounds=2,
              first_use_lengths=[259, 261], first_use_arms=["foldkv-folded"], e2e_prompt=1024, e2e_new_tokens=4,
              e2e_arms=ARMS[:2],
              prefill_memory_context=1024, prefill_memory_batches=[1, 2],
              display=lambda *a: None, Markdown=str)
    import matplotlib.pyplot as plt

    from foldkv.lab.jsonsafe import jsonable

    ns.update(plt=plt, jsonable=jsonable)
    # the intro's FLOPs cell parses ttft_cells (before the measuring sections run)
    ns["ttft_cell_list"], ns["ttft_cell_rounds"] = ttft.parse_cells(ns["ttft_cells"], ns["ttft_rounds"])
    for source in _ttft_cells_of_the_notebook():
        exec(source, ns)
    sections = ("ttft_31b", "first_use_31b", "e2e_31b", "prefill_memory_31b")
    assert {s: record.sections[s] for s in sections} == dict.fromkeys(sections, "ran")
    rows = record.results["ttft_31b"]["rows"]
    assert len(rows) == 2 * 3 + 2 and all(r["floor_s"] > 0 and r["ttft_over_floor"] > 0 for r in rows)
    taken = [r for r in rows if r.get("from") == ttft.E2E_CALL]  # the 1,024-token prompt's TTFT: its end-to-end call's
    assert [(r["arm"], r["prompt_tokens"], r["batch"]) for r in taken] == [(a, 1024, 1) for a in ARMS[:2]]
    assert len(record.results["first_use_31b"]["rows"]) == 2 and (tmp_path / "07_ttft_over_floor.png").exists()
    verdicts = record.results["ttft_targets"]
    assert any(t["target"].startswith("foldkv-folded TTFT / floor") for t in verdicts)
    assert any("end-to-end lowest" in t["target"] for t in verdicts)
    assert any("prefill peak" in t["target"] for t in verdicts)
    with open(tmp_path / "07_time_to_first_token.json") as fh:
        written = json.load(fh)
    assert [r["arm"] for r in written["e2e"]] == ARMS[:2] and len(written["ttft"]) == len(rows)
    assert {(r["prompt_tokens"], r["rounds_run"]) for r in rows if "from" not in r} == {(256, 3), (512, 2)}
    assert len(steady.calls) == 3 + (3 + 2) * 3 + 2 * (1 + ttft.FIRST_USE_STEADY_CALLS) + 2 + 2, \
        "warm-ups, rounds, first use, the end to end's warm-ups and calls: no call more"
    warm = ttft.WARMUP_CELL[0]
    assert decoded == [(a, warm, ttft.E2E_WARMUP_TOKENS) for a in ARMS[:2]] + [(a, 1024, 4) for a in ARMS[:2]], \
        "each end-to-end arm decodes untimed before its timed call; nothing else decodes"
    assert sum(1 for c in steady.calls if c[1] == 1024) == 2, "the long prompt runs once an arm, in its end-to-end call"


# --- the end to end's TTFT as its prompt's cell, and a run of record's verdicts under today's rules ------------------

def _e2e(arm, prompt, ttft_s=10.0, status="ran"):
    return {"arm": arm, "prompt_tokens": prompt, "batch": 1, "status": status, "rounds_run": 1,
            "ttft_rounds_s": [ttft_s], "ttft_s": ttft_s, "warmup_s": None, "generate_s": ttft_s + 5, "e2e_s": ttft_s + 5,
            "new_tokens": 8, "peak_bytes": 9, "memory": {"peak": 9}}


def test_the_end_to_end_ttft_joins_the_cells_once_with_its_floor():
    cells = ttft.with_floor([{"arm": "foldkv-folded", "prompt_tokens": 4096, "batch": 1, "status": "ran",
                              "ttft_s": 1.0}], SHAPES, 100.0, 256)
    e2e = [_e2e("foldkv-folded", 4096, 7.0), _e2e("foldkv-folded", 8192), _e2e("foldkv-split", 8192, 12.0)]
    rows = ttft.with_e2e_ttft(cells, e2e, SHAPES, 100.0, 256)
    assert rows[0] == cells[0], "a cell measured both ways keeps the TTFT cell's row"
    added = rows[1:]
    assert [(r["arm"], r["prompt_tokens"]) for r in added] == [("foldkv-folded", 8192), ("foldkv-split", 8192)]
    floor = pf.floor_seconds(pf.prefill_flops(SHAPES, 8192, 1, 256).total, 100.0)
    assert added[1]["floor_s"] == floor and added[1]["ttft_over_floor"] == 12.0 / floor
    assert all(r["from"] == ttft.E2E_CALL and "memory" not in r and "e2e_s" not in r for r in added)
    assert ttft.with_e2e_ttft(rows, e2e, SHAPES, 100.0, 256) == rows, "taking it twice adds nothing"


def _first_use(n, calls):
    row = {"arm": "foldkv-folded", "prompt_tokens": n, "new_to_process": True, "status": "ran", "first_s": 1.0,
           "steady_s": 1.0, "first_over_steady": 1.0}
    return row if calls == 1 else {**row, "steady_calls_s": [1.0] * calls}


def test_against_record_explains_only_the_rule_changes():
    first_use = [_first_use(4099, 1), _first_use(4101, ttft.FIRST_USE_STEADY_CALLS)]
    e2e = [_e2e("foldkv-folded", 8192)]
    now = ttft.targets((), first_use, e2e)
    earlier = ttft.RULE_CHANGES["end-to-end alone"]["earlier"](now[-1])
    assert earlier["met"] is True and earlier["target"].endswith(" (no other arm ran)")
    as_recorded, side = ttft.against_record(now, now[:-1] + [earlier], first_use)
    assert as_recorded == now[:-1] + [earlier]
    assert [s["met_now"] for s in side] == [None, True, False] and [s["met_recorded"] for s in side] == [True] * 3
    assert side[0]["rule"].startswith("steady state of 1 call") and side[1]["rule"] == ""
    assert side[2]["rule"] == ttft.RULE_CHANGES["end-to-end alone"]["short"]
    # red twins: a recorded verdict the earlier rule never gave stays as today's (the caller's check then fails)
    for bad in ({**earlier, "value": 0.5}, {**now[1], "met": False}):
        i = 2 if "end-to-end" in bad["target"] else 1
        recorded = list(now[:-1] + [earlier])
        recorded[i] = bad
        as_recorded, _ = ttft.against_record(now, recorded, first_use)
        assert as_recorded[i] == now[i] != recorded[i]
    # another arm ran: the end-to-end verdict has a value, no rule change applies
    two = ttft.targets((), (), e2e + [_e2e("foldkv-split", 8192, 11.0)])
    assert ttft.RULE_CHANGES["end-to-end alone"]["earlier"](two[0]) is None
    text = ttft.side_by_side_markdown(side, "from x")
    assert text.startswith("**3 of 3 targets met as recorded; under today's rules 1 met, 1 not met, 1 cannot be told")


def _h100_run():
    from foldkv.lab.bench.results import RUNS_DIR

    with open(os.path.join(ROOT, RUNS_DIR, "h100-20261206", "07_time_to_first_token.record.json")) as fh:
        res = json.load(fh)["results"]
    rows = (res["ttft_31b"]["rows"], res["first_use_31b"]["rows"], res["e2e_31b"]["rows"],
            res["prefill_memory_31b"]["rows"])
    return rows, res["ttft_targets"]


def test_a_failed_peer_recorded_as_met_is_the_changed_rule():
    """papermill_runs/h100-20261206 (FlashInfer's arm failed there) recorded its FlashInfer verdicts as met; today's
    rule says not met, and `against_record` explains exactly those by the "failed peer" change."""
    rows, recorded = _h100_run()
    now = ttft.targets(*rows)
    as_recorded, side = ttft.against_record(now, recorded, rows[1])
    assert as_recorded == recorded
    changed = [s for s in side if s["rule"]]
    assert len(changed) == 8 and all("(flashinfer: failed)" in s["target"] and s["met_recorded"] and
                                     s["met_now"] is False for s in changed)
    assert all(s["rule"] == ttft.RULE_CHANGES["failed peer"]["short"] for s in changed)


def test_a_failed_peer_rule_change_red_twin_explains_nothing_else():
    rows, recorded = _h100_run()
    now = ttft.targets(*rows)
    bad = list(recorded)
    i = next(i for i, t in enumerate(bad) if "foldkv-split's at 32,768 x 1" in t["target"])
    bad[i] = {**bad[i], "met": not bad[i]["met"]}  # a verdict no rule change gives
    as_recorded, _ = ttft.against_record(now, bad, rows[1])
    assert as_recorded != bad and as_recorded[i] == now[i]


def test_token_gaps_find_a_periodic_wait():
    """`model_decode.token_gaps` (the end-to-end row's decode, gap by gap): 1,024 tokens at 17.7 ms with a 60 ms wait
    every 64th token show 15 spikes at multiples of 64 and the median of the steady steps; red twin: the same total
    spread evenly over every gap shows none, though its mean is the same."""
    from foldkv.lab import model_decode as md

    gaps = [17.7 + (60.0 if i % 64 == 0 else 0.0) for i in range(1, 1024)]
    stamps = [0.0]
    for g in gaps:
        stamps.append(stamps[-1] + g / 1e3)
    got = md.token_gaps(stamps)
    assert got["spikes"] == 15 and abs(got["median_ms"] - 17.7) < 1e-9 and abs(got["max_ms"] - 77.7) < 1e-9
    assert all(i % 64 == 0 for i, _ in got["largest"])
    even = [0.0]
    for _ in gaps:
        even.append(even[-1] + sum(gaps) / len(gaps) / 1e3)
    assert md.token_gaps(even)["spikes"] == 0
    assert md.token_gaps([0.0]) is None
