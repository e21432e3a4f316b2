"""GPU test of the FP8 wgmma accumulation characterisation on the H200 (foldkv.lab.fp8_accumulation), small: every
output written (NaN first), the fitted bits per add in [8, 24], and one accumulator over 16 k32 steps erring at least
as much as a fresh one per step added in float32 (it would not if the promotion did nothing); notebook 02's section
on the smoke grid, every output within the accumulation bound. The full grid:
python3 bench/fp8_accumulation_probe.py."""

from __future__ import annotations

import math

import pytest

from foldkv.lab import fp8_accumulation as fa

pytestmark = pytest.mark.gpu


def test_fp8_wgmma_accumulation_characterised(cuda_device):
    res = fa.characterise(cuda_device, steps=(1, 4, 16), spreads=(0, 6), fresh_every=(1,), trials=4, seed=1)
    assert res["status"] == "ran" and res["all_written"]
    for row in res["cells"]:
        assert all(math.isfinite(row[k]) for k in ("measured_q50", "measured_q99", "measured_max")), row
    assert 8 <= res["fit"]["bits"] <= 24, res["fit"]["by_mode"]
    table = {(r["spread"], r["signs"], r["steps"]): r for r in fa.steps_table(res)}
    for spread in (0, 6):
        for signs in fa.SIGNS:
            row = table[(spread, signs, 16)]
            assert row["one_q50"] >= row["fresh1_q50"], row
    print(fa.markdown(res))


def test_notebook_section_records_the_rule_and_every_outputs_bound(cuda_device, tmp_path):
    """Notebook 02's section on this GPU (smoke grid): the record holds the fitted rule, promotion and each cell's
    output-by-output check against `accumulation_bound` (truncation at BITS_KEPT), which must hold."""
    from foldkv.lab import gates
    from foldkv.lab.gates import fp8_wgmma
    from foldkv.lab.report import RunRecord

    record = RunRecord("02_correctness_gates", tmp_path)
    summary = gates.accumulation_gate(record, "smoke", seed=1)
    assert record.sections[fp8_wgmma.SECTION] == "ran"
    assert summary["bound"]["check"].startswith("every output")
    assert all("bound_over_max" in r for r in summary["bound_cells"])
    assert summary["passed"], summary["bound"]
    print(gates.fp8_wgmma_rule_text(summary))
