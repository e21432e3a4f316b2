"""The gate machinery itself, on the CPU: a correct arm passes, and each way an arm can be wrong is caught."""

import pytest
import torch

import foldkv as fk
from foldkv import gates

CASES = {c.name: c for c in gates.decode_cases("smoke") + gates.prefill_cases("smoke")}


def reference_arm(inputs, out, lse):
    ref, ref_lse = fk.paged_attention_reference(inputs.pool, inputs.query, inputs.table, inputs.q_lens)
    out.copy_(ref.to(out.dtype))
    lse.copy_(ref_lse.to(lse.dtype))
    return out, lse


def test_case_lists_cover_the_issue():
    dec, pre = gates.decode_cases("full"), gates.prefill_cases("full")
    assert len(dec) >= 8 and len(pre) >= 6
    lens = {n for c in dec for n in c.seq_lens}
    assert {1, 63, 64, 65, 10602, 163336} <= lens
    assert max(len(c.seq_lens) for c in dec) == 32
    assert any(c.q_lens == (8192,) and c.seq_lens == (163336,) for c in pre)
    assert any(c.q_lens == (1,) for c in pre)


@pytest.mark.parametrize("name", ["len65", "ragged4", "mid-page", "ragged"])
@pytest.mark.parametrize("fmt", list(fk.KvFormat))
def test_reference_arm_passes_on_hostile_inputs(name, fmt):
    inputs = gates.make_inputs(CASES[name], fmt, "cpu", seed=3)
    # the padding really is poison and the unused pages really are NaN/Inf
    assert (inputs.table.page_ids < 0).any()
    unused = inputs.pool.unused_page_ids()
    assert torch.isnan(inputs.pool.data[unused[0]]).all() and torch.isinf(inputs.pool.data[unused[-1]]).all()
    res = gates.run_case(inputs, reference_arm)
    assert res["passed"], {k: v for k, v in res.items() if k != "outputs"}


BROKEN = {
    "skips-a-row": lambda i, o, l: (reference_arm(i, o, l), o[-1].fill_(float("nan")))[0],
    "writes-past-plan": lambda i, o, l: (reference_arm(i, o, l),
                                         o.as_strided((o.shape[0] + 1,) + o.shape[1:], o.stride()).fill_(1.0))[0],
    "wrong-values": lambda i, o, l: (reference_arm(i, o, l), o.mul_(1.01))[0],
    "writes-pool": lambda i, o, l: (reference_arm(i, o, l), i.pool.data[0, 0, 0, 0].fill_(0.0))[0],
    "wrong-lse": lambda i, o, l: (reference_arm(i, o, l), l.add_(0.1))[0],
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_broken_arms_fail(how):
    inputs = gates.make_inputs(CASES["ragged4"], "folded", "cpu", seed=5)
    res = gates.run_case(inputs, BROKEN[how])
    assert not res["passed"], how


@pytest.mark.parametrize("name", ["len65", "mid-page"])
def test_folded_and_split_share_raw_inputs(name):
    case = CASES[name]
    split = gates.make_inputs(case, "split", "cpu", seed=9)
    folded = gates.make_inputs(case, "folded", "cpu", seed=9, raw=split.raw)
    rs, _ = fk.paged_attention_reference(split.pool, split.query, split.table, split.q_lens)
    rf, _ = fk.paged_attention_reference(folded.pool, folded.query, folded.table, folded.q_lens)
    truth = gates.unrounded_truth(split)
    res = gates.folded_vs_split(rf.to(torch.bfloat16), rs.to(torch.bfloat16), truth)
    assert res["passed"], res
    assert res["rel_split_vs_truth"] > 0  # the bf16 pool really rounds
    # and the check can fail: an arm that is off by 3% is caught per case, and over a run
    bad = gates.folded_vs_split((rf * 1.03).to(torch.bfloat16), rs.to(torch.bfloat16), truth)
    assert not bad["passed"]
    assert not gates.folded_vs_split_overall([bad, bad])["passed"]
    assert gates.folded_vs_split_overall([res, res])["passed"]


@pytest.mark.parametrize("name", ["ragged4", "ragged"])
def test_refusal_table_on_cpu(name):
    # The launchers check everything before looking at the device, so the whole refusal table runs here: each
    # invalid input is refused with its own message and nothing is written.
    inputs = gates.make_inputs(CASES[name], "split", "cpu", seed=2)
    rows = gates.run_refusals(inputs)
    assert len(rows) >= 9
    failed = [r for r in rows if not r["passed"]]
    assert not failed, failed


def test_bf16_ulp_and_the_derived_bound():
    x = torch.tensor([1.0, 1.2, 1.99, 2.0, 3.0, 0.5, 0.0, -1.5], dtype=torch.float64)
    assert gates.bf16_ulp(x).tolist() == [2**-7, 2**-7, 2**-7, 2**-6, 2**-6, 2**-8, 0.0, 2**-7]
    ref = torch.full((4,), 1.2, dtype=torch.float64)
    one_ulp_off = ref + 2**-7
    assert not gates.compare(one_ulp_off, ref)["issue_bound_ok"]  # 0.0078 > 0.002 + 0.0048
    assert gates.compare(one_ulp_off, ref, pv_abs=torch.zeros_like(ref))["elementwise_ok"]
    assert not gates.compare(ref + 3 * 2**-7, ref, pv_abs=torch.zeros_like(ref))["elementwise_ok"]


def test_agree_allows_one_rounding_each_side_and_no_more():
    ref = torch.full((1000,), 1.2, dtype=torch.float64)
    pv = torch.zeros_like(ref)
    up, down = ref.clone(), ref.clone()
    up[0], down[0] = 1.2 + 2**-7, 1.2 - 2**-7  # each one ulp off, on opposite sides: two ulps apart
    assert not gates.compare(up, down, pv)["elementwise_ok"]  # one bound for two roundings would refuse them
    assert gates.agree(up, down, ref, pv)["passed"]
    far = ref.clone()
    far[0] = 1.2 + 4 * 2**-7
    assert not gates.agree(far, down, ref, pv)["passed"]
