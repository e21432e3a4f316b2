"""The random gate on the GPU: DEFAULT_CASES seeded random cases (foldkv.lab.random_gate) through every decode path
(eager, the workspace's plan() and advance(); fused and three launches) and random prefill chunks, over folded,
split and FP8 pools, each against the float64 reference. A failure prints its one-line reproduce command:
python -m foldkv.lab.random_gate --seed S --case I. FOLDKV_GATE_CASES=smoke (the H200 run's GPU tests, whose phase
is already near its time cap) runs the first SMOKE_CASES; notebook 02 runs the whole set in the batch."""

from __future__ import annotations

import os

import pytest

from foldkv.lab import random_gate as rg

pytestmark = pytest.mark.gpu

SEED = 0
SMOKE_CASES = 30
COUNT = SMOKE_CASES if os.environ.get("FOLDKV_GATE_CASES", "full") == "smoke" else rg.DEFAULT_CASES


def test_random_gate(cuda_device, capsys):
    res = rg.random_gate(SEED, COUNT, device=cuda_device)
    failed = [r for r in res["rows"] if not r["passed"]]
    assert not failed, "\n".join(f"{r['reproduce']}  # {r.get('error') or r['path']}" for r in failed[:20])
    cov = res["coverage"]
    assert cov["cases"] == COUNT and set(cov["pool"]) == set(rg.POOLS), cov
    print(f"random gate: {cov['cases']} cases in {res['seconds']:.0f} s")
