"""GPU gates of run 21's version (bench/versions/decode_partial_fp8_tc_vrot.py: the FP8 tensor-core partial over a pool
whose V_rot panel is stored pre-transposed) in place of the library's tensor-core partial, over a permuted copy of the
same hostile FP8 pool (`OverVrotPool`; NaN codes past each request's last token, which the copy must write as 0):
V^T holds the served kernel's bytes, so its outputs and LSE are bitwise the served kernel's over the unpermuted pool,
into poisoned outputs with every element written (`gates.run_case`, which also holds it to the served bound), at
lengths 1, 63, 65, 10,602 and a ragged batch, planned for its wave of 2 x SMs. Red twin: the version over the
unpermuted pool (its fourth value panel read as V_rot^T) is not. And the harness's own check on one case.

    FOLDKV_REQUIRE_GPU=1 python3 -m pytest tests/test_fp8_tc_vrot_gpu.py
"""

from __future__ import annotations

import pytest

from foldkv import GEMMA4_31B, KvFormat
from foldkv.fp8 import FP8_DTYPE
from foldkv.lab import gates

from conftest import FP8_TC_IDS, FP8_TC_LENS, bench_script, bench_version, fp8_tc_launch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def vrot():
    return bench_version("decode_partial_fp8_tc_vrot")


@pytest.fixture(scope="module")
def vrot_kernel(vrot):
    return vrot.build(GEMMA4_31B)


@pytest.mark.parametrize("lens", FP8_TC_LENS, ids=FP8_TC_IDS)
def test_bitwise_the_served_partial(cuda_device, vrot, vrot_kernel, lens):
    inputs = gates.make_inputs(gates.Case("fp8tcvrot", lens), KvFormat.FOLDED, cuda_device, 4, dtype=FP8_DTYPE)
    served = gates.run_case(inputs, fp8_tc_launch(), extra=gates.fp8_tc_extra)
    res = gates.run_case(inputs, fp8_tc_launch(vrot.OverVrotPool(vrot_kernel)), extra=gates.fp8_tc_extra)
    row = gates.summary_row(inputs.case, KvFormat.FOLDED, "fp8 tc vrot", res)
    assert res["all_written"] and res["passed"], row
    for a, b in zip(res["outputs"], served["outputs"]):
        assert gates.bits(a).equal(gates.bits(b)), "not bitwise the served partial"
    twin = gates.run_case(inputs, fp8_tc_launch(vrot_kernel), extra=gates.fp8_tc_extra)["outputs"]
    assert not gates.bits(twin[0]).equal(gates.bits(served["outputs"][0])), "red twin: the unpermuted pool read alike"


def test_harness_check_passes(cuda_device, tmp_path):
    """The harness's arm runs its own check (the float64 reference over the dequantized, unpermuted pool,
    CHECK_REL_TOL) first: one round of one short case through `fp8_harness.main`; its JSON says the check passed."""
    import json

    out = tmp_path / "fp8_vrot.json"
    bench_script("fp8_harness").main(["--no-flashinfer", "--rounds", "1", "--single", "10602", "--batches",
                                      "--arms", "folded_fp8_jit", "fp8_tc_vrot", "--json", str(out)])
    (cell,) = json.loads(out.read_text())["cells"]
    arm = cell["arms"]["fp8_tc_vrot"]
    assert arm["status"] == "ok" and arm["check"]["ok"], arm.get("check")
