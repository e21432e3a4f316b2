"""GPU gates of run 20's version (bench/versions/decode_partial_fp8_tc_ws.py: the FP8 tensor-core partial with V^T
written by a transposer warpgroup, a T.WSSchedule) in place of the library's tensor-core partial: held to the served
kernel's derived bound (`foldkv.lab.gates.fp8_tc`: the same roundings, so the same bound) against
`foldkv.paged_attention_reference` over the same hostile FP8 pool, outputs poisoned first and every element written
(`gates.run_case`), at lengths 1, 63, 65, 10,602 and a ragged batch, planned for its wave of 2 x SMs; a rerun
bit-identical (the schedule's hand-offs leave nothing to chance); and the harness's own check on one case.

    FOLDKV_REQUIRE_GPU=1 python3 -m pytest tests/test_fp8_tc_ws_gpu.py
"""

from __future__ import annotations

import pytest

from foldkv import GEMMA4_31B, KvFormat
from foldkv.fp8 import FP8_DTYPE
from foldkv.lab import gates

from conftest import FP8_TC_IDS, FP8_TC_LENS, bench_version, fp8_tc_launch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ws_kernel():
    return bench_version("decode_partial_fp8_tc_ws").build(GEMMA4_31B)


@pytest.mark.parametrize("lens", FP8_TC_LENS, ids=FP8_TC_IDS)
def test_transposer_version_within_the_tensor_core_bound(cuda_device, ws_kernel, lens):
    inputs = gates.make_inputs(gates.Case("fp8tcws", lens), KvFormat.FOLDED, cuda_device, 4, dtype=FP8_DTYPE)
    res = gates.run_case(inputs, fp8_tc_launch(ws_kernel), extra=gates.fp8_tc_extra)
    assert res["all_written"], gates.summary_row(inputs.case, KvFormat.FOLDED, "fp8 tc ws", res)
    assert res["passed"], gates.summary_row(inputs.case, KvFormat.FOLDED, "fp8 tc ws", res)
    again = gates.run_case(inputs, fp8_tc_launch(ws_kernel))["outputs"]
    for a, b in zip(again, res["outputs"]):
        assert gates.bits(a).equal(gates.bits(b))


def test_harness_check_passes(cuda_device, tmp_path):
    """The harness's arm runs its own check (the float64 reference over the dequantized pool, CHECK_REL_TOL) first:
    one round of one short case through `fp8_harness.main`; its JSON says the check passed."""
    import json
    import os
    import sys

    from foldkv.provenance import checkout_root

    bench_dir = os.path.join(checkout_root(), "bench")
    sys.path.insert(0, bench_dir)
    try:
        import fp8_harness
    finally:
        sys.path.remove(bench_dir)
    out = tmp_path / "fp8_ws.json"
    fp8_harness.main(["--no-flashinfer", "--rounds", "1", "--single", "10602", "--batches", "--arms",
                      "folded_fp8_jit", "fp8_tc_ws", "--json", str(out)])
    (cell,) = json.loads(out.read_text())["cells"]
    arm = cell["arms"]["fp8_tc_ws"]
    assert arm["status"] == "ok" and arm["check"]["ok"], arm.get("check")
