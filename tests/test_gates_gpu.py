"""The correctness gates as GPU tests: the same cases and checks as notebooks/02 (foldkv.lab.gates), one test per case,
format and arm. They skip without a Hopper GPU + TileLang and fail instead under FOLDKV_REQUIRE_GPU=1.

Reproduce one case:  FOLDKV_REQUIRE_GPU=1 python3 -m pytest tests/test_gates_gpu.py -k "len10602 and folded"
"""

from __future__ import annotations

import os

import pytest
import torch

import foldkv as fk
from foldkv.lab import gates

pytestmark = pytest.mark.gpu

CASE_SET = os.environ.get("FOLDKV_GATE_CASES", "full")
DECODE = {c.name: c for c in gates.decode_cases(CASE_SET)}
PREFILL = {c.name: c for c in gates.prefill_cases(CASE_SET)}
FORMATS = list(fk.KvFormat)


def _check(res):
    assert res["passed"], {k: v for k, v in res.items() if k != "outputs"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(DECODE))
def test_decode_gate(cuda_device, name, fmt):
    _check(gates.run_case(gates.make_inputs(DECODE[name], fmt, cuda_device, seed=len(name)), gates.decode_arm("jit")))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_gate(cuda_device, name, fmt):
    _check(gates.run_case(gates.make_inputs(PREFILL[name], fmt, cuda_device, seed=len(name)), gates.prefill_arm("jit")))


@pytest.mark.parametrize("name", ["len65", "ragged4", "mid-page", "ragged"])
def test_folded_no_less_accurate_than_split(cuda_device, name):
    case = {**DECODE, **PREFILL}[name]
    split = gates.make_inputs(case, fk.KvFormat.SPLIT, cuda_device, seed=4)
    folded = gates.make_inputs(case, fk.KvFormat.FOLDED, cuda_device, seed=4, raw=split.raw)
    rs = gates.run_case(split, gates.arm_for(case))
    rf = gates.run_case(folded, gates.arm_for(case))
    res = gates.folded_vs_split(rf["outputs"][0], rs["outputs"][0], gates.unrounded_truth(split))
    assert res["passed"], res  # per case within 2x; the run-wide ratio is notebook 02's gate


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_refusals_on_gpu(cuda_device, kind, fmt):
    case = gates.Case("refuse", (97, 300), q_lens=None if kind == "decode" else (54, 65))
    rows = gates.run_refusals(gates.make_inputs(case, fmt, cuda_device, seed=1))
    failed = [r for r in rows if not r["passed"]]
    assert not failed, failed


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_last_row_equals_decode(cuda_device, fmt):
    case = gates.Case("last-row", (1000, 4097), q_lens=(77, 1))
    inputs = gates.make_inputs(case, fmt, cuda_device, seed=3)
    out_p, _ = gates.prefill_arm()(inputs, *gates.poisoned_outputs(78, inputs.pool.geometry, cuda_device, pad_rows=0))
    last = torch.tensor([76, 77], device=cuda_device)
    dec = gates.GateInputs(gates.Case("d", case.seq_lens), inputs.format, inputs.pool, inputs.table,
                           inputs.query[last].contiguous(), None)
    out_d, _ = gates.decode_arm()(dec, *gates.poisoned_outputs(2, inputs.pool.geometry, cuda_device, pad_rows=0))
    ref, _, pv_abs = gates.reference_with_scales(dec.pool, dec.query, dec.table)
    res = gates.agree(out_p[last], out_d, ref, pv_abs)
    assert res["passed"], res
