"""CPU tests of the FP8 wgmma accumulation characterisation (foldkv.lab.fp8_accumulation): the model and its fit
give back the rule synthetic data was made with (b = 13, b = 23; truncation against round-to-nearest), each with a
red twin that shows the check can fail; and the kernel factory emits FP8 wgmma (e4m3 operands) for sm_90a."""

from __future__ import annotations

import pytest
import torch
from conftest import require_tilelang

from foldkv.lab import fp8_accumulation as fa

# a few bits around each rule the tests make: the fit's cost is one simulation per (mode, b) and cell
BITS = (12, 13, 14, 22, 23, 24)
CELLS = dict(trials=1, steps=(4, 16), spreads=(0, 6), n=8)


@pytest.fixture(scope="module")
def fits() -> dict:
    return {(b, m): fa.fit(fa.synthetic_cells(b, m, **CELLS), BITS) for b, m in
            [(13, "truncate"), (13, "nearest"), (23, "nearest")]}


@pytest.mark.parametrize("bits,mode", [(13, "truncate"), (13, "nearest"), (23, "nearest")])
def test_fit_recovers_the_rule_the_data_was_made_with(fits, bits, mode):
    res = fits[(bits, mode)]
    assert (res["mode"], res["bits"]) == (mode, bits), res["by_mode"]
    assert res["distance"] == 0.0  # the model on the same inputs gives the same statistics


def test_red_twin_13_bits_is_not_fit_as_float32_like(fits):
    grid = {(g["mode"], g["bits"]): g["distance"] for g in fits[(13, "nearest")]["grid"]}
    assert fits[(13, "nearest")]["bits"] != 23
    # the check can fail: a 23-bit rule is far from data made with 13 bits, and the reverse
    assert grid[("nearest", 23)] > 100 * max(grid[("nearest", 13)], 1e-3)
    grid23 = {(g["mode"], g["bits"]): g["distance"] for g in fits[(23, "nearest")]["grid"]}
    assert grid23[("nearest", 13)] > 100


@pytest.mark.parametrize("bits,mode,other", [(13, "truncate", "nearest"), (13, "nearest", "truncate")])
def test_truncation_is_told_from_rounding(fits, bits, mode, other):
    res = fits[(bits, mode)]
    assert res["mode"] == mode
    # the other mode's best is clearly worse (its sign bias on positive sums differs), not a near tie
    assert res["by_mode"][other]["distance"] > 10 * max(res["by_mode"][mode]["distance"], 1.0)


def test_model_is_exact_at_float64_width_and_loses_bits_below_it():
    g = torch.Generator().manual_seed(1)
    a, b = fa.draw_operands(1, 16, 6, "positive", generator=g)
    ref, abs_sum = fa.reference(a, b)
    prods = fa.products(a, b)
    wide = fa.error_stats(fa.simulate(prods, 53, "nearest"), ref, abs_sum)
    assert wide["max"] <= 16 * 2.0**-24  # only the accumulator's float32 roundings, one a step
    narrow = fa.error_stats(fa.simulate(prods, 13, "truncate"), ref, abs_sum)
    assert narrow["bias"] == -1.0 and narrow["q50"] > 2.0**-14  # truncation of positive sums is always low
    # one accumulator over 16 steps loses more than a fresh one per step added in float32
    fresh = fa.error_stats(fa.simulate(prods, 13, "truncate", fresh_every=1), ref, abs_sum)
    assert narrow["q50"] > 2 * fresh["q50"]


def test_operands_are_never_zero_and_spread_as_asked():
    g = torch.Generator().manual_seed(2)
    a, b = fa.draw_operands(2, 4, 8, "mixed", generator=g)
    assert a.dtype == torch.float8_e4m3fn and a.shape == (2, 64, 128) and b.shape == (2, 16, 128)
    mag = torch.cat([a.double().flatten(), b.double().flatten()]).abs()
    assert mag.min() >= 2.0**-4 and mag.max() <= 2.0**5
    with pytest.raises(ValueError, match="spread"):
        fa.draw_operands(1, 1, 13, generator=g)


def test_steps_table_and_markdown():
    cells = fa.synthetic_cells(13, "truncate", trials=1, steps=(1, 4), spreads=(6,), signs=("positive",),
                               fresh_every=(None, 1))
    res = fa.fit(cells, (13, 14))
    rows = [{**{k: c[k] for k in ("spread", "signs", "steps", "fresh_every")},
             **{f"measured_{k}": v for k, v in m.items()}, **{f"model_{k}": v for k, v in s.items()}}
            for c, m, s in zip(cells, res.pop("measured"), res.pop("simulated"))]
    result = {"cells": rows, "fit": res, "all_written": True}
    table = fa.steps_table(result)
    assert [r["steps"] for r in table] == [1, 4]
    assert table[1]["ratio_q50"] > 1  # the one accumulator loses more than a fresh one per step
    text = fa.markdown(result)
    assert "truncate, b = 13 bits kept per add" in text and "| k32 steps |" in text


def test_characterise_without_hopper_is_not_run():
    from foldkv.lab.arms import ArmUnavailable

    with pytest.raises(ArmUnavailable, match="CUDA device"):
        fa.characterise("cpu")


@pytest.mark.parametrize("fresh_every", [None, 4])
def test_kernel_emits_fp8_wgmma_for_sm90a(fresh_every):
    require_tilelang()
    source = fa.build(16, fresh_every=fresh_every).get_kernel_source()
    calls = [line for line in source.splitlines() if "wgmma" in line and "e4m3" in line]
    assert len(calls) == 16  # one m64n16k32 e4m3 wgmma per k32 step
    assert all("64, 16, 32" in line for line in calls)
    # one accumulator: every step after the first accumulates; a fresh one every 4 steps: 4 restarts
    restarts = sum(line.rstrip().endswith(", 0);") for line in calls)
    assert restarts == (1 if fresh_every is None else 4)


def test_kernel_refuses_a_grouping_that_does_not_divide_the_steps():
    require_tilelang()
    with pytest.raises(ValueError, match="divide"):
        fa.program(16, fresh_every=3)
