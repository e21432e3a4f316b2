"""The random gate's drawer and plumbing on the CPU: cases are a function of (seed, index), cover every axis within
the run's budget, and come back from their reproduce command; a few tiny cases run through the gates' hostile set-up
with the float64 reference standing in for the kernels (which need a GPU), and an arm that misses a key or raises
fails; the workspace's plan-then-advance covers each request's final length."""

from __future__ import annotations

import io

import pytest
import torch

import foldkv as fk
from foldkv.kernels.plan import DEFAULT_SMS, MAX_LEN
from foldkv.lab import gates
from foldkv.lab import random_gate as rg

CASES = rg.draw_cases(0)
TINY = [c for c in CASES if c.tokens <= 400 and len(c.seq_lens) <= 4]


def test_cases_are_a_function_of_seed_and_index():
    assert rg.draw_cases(0) == CASES and rg.draw_case(0, 117) == CASES[117]
    assert rg.draw_cases(1, 20) != CASES[:20]


def test_reproduce_command_gives_back_the_case():
    for c in CASES[::7]:
        assert c.reproduce() == f"python -m foldkv.lab.random_gate --seed 0 --case {c.index}"
        assert rg.case_of_command(c.reproduce()) == c
    with pytest.raises(ValueError):
        rg.case_of_command("python -m foldkv.lab.random_gate --seed 0")


def test_cases_cover_every_axis_within_the_budget():
    cov = rg.coverage(CASES)
    assert cov["cases"] >= 300
    assert set(cov["pool"]) == {"folded", "split", "fp8"}
    assert set(cov["path"]) == {"eager", "workspace-plan", "workspace-advance", "prefill"}
    for path in rg.DECODE_PATHS:
        for step in rg.STEPS:
            assert cov["step"].get(f"{path} {step}", 0) >= 3, (path, step)
    assert {"gather", "in_kernel"} <= set(cov["fp8_rows"])
    assert cov["batch_min"] == 1 and cov["batch_max"] >= 200 and cov["len_min"] == 1 and cov["len_max"] == MAX_LEN
    lens = {n for c in CASES for n in c.seq_lens}
    assert {1, 63, 64, 65, 127, 128, 129} <= lens
    assert cov["page_edges"] > 0.3 * sum(len(c.seq_lens) for c in CASES)
    assert sum(max(c.seq_lens) >= rg.LONG_MIN for c in CASES) >= 10
    assert cov["fixed_chunks"] >= 5 and cov["merge_groups"] >= 5
    assert sum(c.score_scale > 1 for c in CASES) >= 30 and sum(c.score_scale < 1 for c in CASES) >= 30
    assert sum(not c.scattered for c in CASES) >= 10
    # the budget: a few million tokens and a few billion (query, key) pairs for the float64 reference
    assert cov["tokens"] <= 6_000_000 and cov["prefill_pairs"] <= 2_500_000_000
    assert cov["size"]["long"] <= len(CASES) // rg.LONG_EVERY


def test_every_case_is_valid_input():
    wave = DEFAULT_SMS // 4
    for c in CASES:
        assert 1 <= len(c.seq_lens) <= 256 and all(1 <= n <= MAX_LEN for n in c.seq_lens), c
        if c.q_lens is not None:
            assert c.path == "prefill" and all(1 <= m <= n for m, n in zip(c.q_lens, c.seq_lens)), c
        if c.path.startswith("workspace"):
            assert len(c.seq_lens) <= c.max_batch and max(c.seq_lens) <= c.max_len <= MAX_LEN, c
            assert min(c.seq_lens) > c.advance and (c.advance > 0) == (c.path == "workspace-advance"), c
            if c.step == "fused":
                assert c.max_batch <= wave and c.pool != "fp8", c
        if c.path == "eager" and c.step == "fused":
            assert rg._eager_plan_fused(c.pool, c.seq_lens, None, None) and c.chunk_tokens is None, c
        if c.chunk_tokens is not None:
            assert c.chunk_tokens % 64 == 0, c
        assert (c.fp8_rows is not None) == (c.pool == "fp8" and c.path == "prefill"), c


def test_eager_fused_check_tells_one_wave_plans():
    """The drawer's test for a fused eager case: one request is one wave on an H200, a wide batch of long ones not,
    an FP8 pool never (its decode is the three launches)."""
    assert rg._eager_plan_fused("folded", (4096,), None, None)
    assert not rg._eager_plan_fused("folded", (4096,) * 200, None, None)
    assert not rg._eager_plan_fused("fp8", (4096,), None, None)


def stand_in_arm(inputs, out, lse, drop_last_key: bool = False):
    """The float64 reference over the rows run_case holds the kernel to (`gates.attended_rows`), as a kernel would
    write it; `drop_last_key`: each request of two or more tokens attended without its last key (the red twin)."""
    pool, table, _ = gates.attended_rows(inputs, stand_in_arm.fp8_rows)
    if drop_last_key:
        table = fk.BlockTable(table.page_ids, (table.seq_lens - (table.seq_lens > 1).int()).contiguous())
        q_lens = None if inputs.q_lens is None else torch.minimum(inputs.q_lens, table.seq_lens.long())
        assert q_lens is None or torch.equal(q_lens, inputs.q_lens.long()), "a chunk as long as its request"
    ref, ref_lse = fk.paged_attention_reference(pool, inputs.query, table, inputs.q_lens)
    out.copy_(ref.to(out.dtype))
    lse.copy_(ref_lse.to(lse.dtype))
    return out, lse


@pytest.mark.parametrize("case", TINY[:8], ids=lambda c: f"{c.index}-{c.pool}-{c.path}")
def test_tiny_cases_pass_with_the_reference_standing_in(case):
    stand_in_arm.fp8_rows = case.fp8_rows or "gather"
    row = rg.run_random_case(case, "cpu", launch=stand_in_arm)
    assert row["passed"], row


def test_an_arm_missing_a_key_fails_with_its_reproduce_command():
    case = next(c for c in TINY if c.path != "prefill" and max(c.seq_lens) > 1)
    stand_in_arm.fp8_rows = "gather"
    row = rg.run_random_case(case, "cpu", launch=lambda i, o, l: stand_in_arm(i, o, l, drop_last_key=True))
    assert not row["passed"] and row["reproduce"] == case.reproduce()


def test_an_arm_that_raises_is_a_failed_case():
    def broken(inputs, out, lse):
        raise RuntimeError("no kernel")

    row = rg.run_random_case(TINY[0], "cpu", launch=broken)
    assert not row["passed"] and "no kernel" in row["error"]


def test_cpu_kernels_are_refused_as_failed_cases():
    """Without a GPU the real arms refuse (FoldKvInputError): a failed row, its command printed."""
    out = io.StringIO()
    res = rg.random_gate(0, device="cpu", indices=[TINY[0].index], out=out)
    assert not res["passed"] and res["failed"] == [TINY[0].index]
    assert TINY[0].reproduce() in out.getvalue()


@pytest.mark.parametrize("advance", [True, False])
def test_workspace_plan_then_advance_covers_the_final_lengths(advance):
    case = next(c for c in TINY if c.path == "workspace-advance")
    inputs = rg.case_inputs(case, "cpu")
    ws = rg.workspace_for(case, inputs, num_sms=DEFAULT_SMS)
    if advance:
        for _ in range(case.advance):
            ws.advance()
    used = ws.chunks_used
    req, length = ws.chunk_req[:used], ws.chunk_len[:used]
    covered = [int(length[req == r].sum()) for r in range(len(case.seq_lens))]
    want = list(case.seq_lens) if advance else [n - case.advance for n in case.seq_lens]
    assert covered == want  # the red twin (no advance) covers the lengths less `advance`, not the final ones
    assert ws.fused or case.step != "fused"


def test_show_runs_nothing():
    assert rg.main(["--show", "--case", "3", "--case", "4"]) == 0
