"""The long walk on the GPU: one captured workspace graph replayed for 20,000 steps while requests join, grow page
by page and leave (`foldkv.lab.long_walk`), every 500th step held to an eager step (bit for bit) and to the float64
reference, GPU memory the same at the end as after the first step; the fused one-wave step, the three launches,
and an FP8 pool. FOLDKV_GATE_CASES=smoke (the H200 run's GPU tests) walks SMOKE_STEPS; notebook 02 walks the whole
length in the batch. Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_long_walk_gpu.py -k '<id>'."""

from __future__ import annotations

import os

import pytest

from foldkv import KvFormat
from foldkv.fp8 import FP8_DTYPE
from foldkv.lab.long_walk import WALK_STEPS, long_walk

pytestmark = pytest.mark.gpu

SMOKE_STEPS = 2000
STEPS = SMOKE_STEPS if os.environ.get("FOLDKV_GATE_CASES", "full") == "smoke" else WALK_STEPS

WALKS = {"fused": dict(fused=None), "three-launch": dict(fused=False), "fp8": dict(dtype=FP8_DTYPE),
         "split": dict(fmt=KvFormat.SPLIT)}


@pytest.mark.parametrize("walk", list(WALKS))
def test_long_walk(cuda_device, walk):
    kw = dict(WALKS[walk])
    res = long_walk(kw.pop("fmt", KvFormat.FOLDED), steps=STEPS, seed=7, device=cuda_device, **kw)
    bad = [r for r in res["checks"] if not r["passed"]]
    assert not bad, bad[:3]
    assert res["memory_same"], (res["memory_first"], res["memory_end"])
    assert res["joins"] > STEPS // 1000 and res["leaves"] > STEPS // 1000 and res["advances"] > STEPS // 2
    assert len(res["checks"]) == STEPS // 500 + 1
    assert res["fused"] == (walk == "fused" or walk == "split"), res["fused"]
    assert res["seconds"] - res["check_seconds"] < 60, res["seconds"]


def test_long_walk_catches_misplaced_new_pages(cuda_device):
    """Red twin: a page given between two plans that reaches the workspace as another page must fail a check."""
    res = long_walk(KvFormat.FOLDED, steps=1501, seed=7, device=cuda_device, misplace_new_pages=True)
    assert res["checks"][0]["passed"], "step 0 (a fresh plan) must pass"
    assert not res["passed"] and any(not r["passed"] for r in res["checks"][1:])
