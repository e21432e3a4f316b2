"""CPU checks of run 20's version (bench/versions/decode_partial_fp8_tc_ws.py: the FP8 tensor-core partial with V^T
written by a transposer warpgroup, a T.WSSchedule): it compiles for sm_90a, and its emitted CUDA has the design's
structure (`check_emitted`: two CTAs an SM, shared memory under a CTA's share, the transposer's TMA, global loads,
V^T stores, proxy fence and arrive in order; the consumer's waits, release of the stage after V^T is in, no transpose
on its chain), each fact with a red twin (the source edited so that it fails). Its harness arms are registered."""

from __future__ import annotations

import os

import pytest

from foldkv import GEMMA4_31B as G

from conftest import bench_version
from test_aot_cpu import require_tilelang_and_nvcc


@pytest.fixture(scope="module")
def ws_sources():
    require_tilelang_and_nvcc()
    ws = bench_version("decode_partial_fp8_tc_ws")
    kernel = ws.build(G)  # check_emitted runs inside: the green side
    return ws, kernel.get_kernel_source(), kernel.get_host_source()


def test_emitted_cuda_has_the_design(ws_sources):
    ws, src, host = ws_sources
    facts = ws.check_emitted(src, host)
    assert facts["smem_bytes"] <= ws.SMEM_LIMIT_2CTA and facts["launch_bounds"] == ["256, 2"]
    assert facts["nreg"] == ws.NREG and sum(ws.NREG.values()) == 256  # 128 a thread on average: two CTAs an SM
    assert facts["loads"] == facts["stores"] == 4 and facts["consumer_transpose"] == 0


def _edit(src: str, old: str, new: str, count: int = 1) -> str:
    assert old in src, old
    return src.replace(old, new, count)


@pytest.mark.parametrize("twin", ["stage_released_before_vt", "no_fence_before_vt_arrive", "transpose_on_consumer",
                                  "smem_over_two_ctas", "one_cta_an_sm"])
def test_red_twins_fail_the_structure_check(ws_sources, twin):
    ws, src, host = ws_sources
    if twin == "stage_released_before_vt":  # the consumer frees the stage before V^T is in: the parity hazard
        src = _edit(src, "vt_full[0].wait((k_1 & 1));\n      kv_empty[0].arrive();",
                    "kv_empty[0].arrive();\n      vt_full[0].wait((k_1 & 1));")
    elif twin == "no_fence_before_vt_arrive":  # generic-proxy stores the value wgmma might not see
        src = _edit(src, "tl::fence_proxy_async();\n      vt_full[0].arrive();", "vt_full[0].arrive();")
    elif twin == "transpose_on_consumer":  # the transpose back on the consumer's chain
        src = _edit(src, "kv_full[0].wait((k_1 & 1));",
                    "kv_full[0].wait((k_1 & 1));\n      foldkv_vt_store(0, 0, 0);")
    elif twin == "smem_over_two_ctas":
        facts = ws.check_emitted(src, host)
        host = _edit(host, f"((int64_t){facts['smem_bytes']})", f"((int64_t){ws.SMEM_LIMIT_2CTA + 1024})")
    elif twin == "one_cta_an_sm":
        src = _edit(src, "__launch_bounds__(256, 2)", "__launch_bounds__(256, 1)")
    with pytest.raises(AssertionError, match="off the design|missing"):
        ws.check_emitted(src, host)


def test_fp8_harness_has_the_transposer_arms():
    import importlib
    import sys

    from foldkv.provenance import checkout_root

    bench_dir = os.path.join(checkout_root(), "bench")
    sys.path.insert(0, bench_dir)
    try:
        harness = importlib.import_module("fp8_harness")
    finally:
        sys.path.remove(bench_dir)
    names = [a.name for a in harness.ARMS if not isinstance(a, str)]
    assert {"fp8_tc_ws", "fp8_tc_ws_r96"} <= set(names) and len(names) == len(set(names))
