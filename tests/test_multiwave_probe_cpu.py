"""bench/multiwave_probe.py without a GPU: its cells and arms build (every arm named by a cell is one the probe can
make, the drawn batches are the shapes they claim), unknown names are refused before any GPU work, and the paged
read's expected sum counts exactly the tiles its chunks cover (each check with its red twin)."""

from __future__ import annotations

import pytest
import torch

from conftest import bench_script


@pytest.fixture(scope="module")
def probe():
    return bench_script("multiwave_probe")


def test_every_cell_and_arm_builds(probe):
    from foldkv.lab.bench.arms import DECODE_ARMS
    from foldkv.lab.bench.spec import ArmSpec

    plans = probe.probe_plan()
    assert [p.name for p in plans] == list(probe.CELLS)
    for p in plans:
        for arm in p.arms:
            spec = probe.arm_spec(arm)  # builds the ArmSpec only: nothing compiled, nothing launched
            assert isinstance(spec, ArmSpec) or spec in DECODE_ARMS, (p.name, arm)
            assert (spec.name if isinstance(spec, ArmSpec) else spec) == arm  # results are keyed by the arm's name
    rows = probe.plan_rows(plans)
    by = {r["cell"]: r for r in rows}
    assert by["single262144"]["fused"] and by["resident"]["fused"]  # one wave: the library's fused step
    for name in probe.BATCH_SHAPES:  # the batches are multi-wave plans
        assert not by[name]["fused"] and by[name]["ctas_per_sm"] > 2, by[name]


def test_unknown_cells_and_arms_are_refused(probe):
    with pytest.raises(ValueError, match="unknown cells"):
        probe.probe_plan(["short256", "no_such_cell"])
    with pytest.raises(ValueError, match="unknown arms"):
        probe.probe_plan(drop=["no_such_arm"])


def test_a_cell_naming_an_arm_no_variant_builds_is_refused(probe, monkeypatch):  # red twin of the first test
    monkeypatch.setitem(probe.CELL_ARMS, "short256", ("folded_jit", "folded_typo"))
    with pytest.raises(ValueError, match="folded_typo"):
        probe.probe_plan(["short256"])


def test_batches_are_the_shapes_they_name(probe):
    drawn = probe.batches(7)
    assert drawn == probe.batches(7) and drawn != probe.batches(8)  # the seed alone re-creates them
    for name, (n, ranges) in probe.BATCH_SHAPES.items():
        lens = drawn[name]
        assert len(lens) == n
        for i, x in enumerate(lens):
            lo, hi = ranges[i % len(ranges)]
            assert lo <= x <= hi, (name, i, x)
    tail = drawn["longtail100"]
    assert all(x >= 65_536 for x in tail[::10]) and max(tail) <= 212_000


def _tiny_pool(pages=7, hkv=2, page=4, width=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(pages, hkv, page, width, generator=g).to(torch.bfloat16)


def test_expected_page_sums_counts_the_covered_tiles(probe):
    data = _tiny_pool()
    ids = torch.tensor([[5, 2, 6, 0], [1, 3, 0, 0]], dtype=torch.int32)
    chunks = [(0, 0, 8), (0, 8, 3), (1, 0, 6)]  # request 0: pages 5, 2 then 6 (3 tokens); request 1: pages 1, 3
    total, absolute = probe.expected_page_sums(data, ids, chunks, page=4)
    want = sum(float(data[p].double().sum()) for p in (5, 2, 6, 1, 3))
    assert total == pytest.approx(want, rel=1e-12)
    assert absolute == pytest.approx(sum(float(data[p].double().abs().sum()) for p in (5, 2, 6, 1, 3)), rel=1e-12)
    # red twin: a chunk left out (or a page read twice) moves the sum by a whole tile, far past PAGED_READ_TOL
    short, _ = probe.expected_page_sums(data, ids, chunks[:2], page=4)
    assert abs(short - want) / absolute > probe.PAGED_READ_TOL


def test_in_order_ids_give_each_request_its_own_pages_in_order(probe):
    ids = probe.in_order_ids([1, 64, 65, 200], width=5, page=64)
    assert ids[0, :1].tolist() == [0] and ids[1, :1].tolist() == [1]
    assert ids[2, :2].tolist() == [2, 3] and ids[3, :4].tolist() == [4, 5, 6, 7]
    listed = [int(ids[r, j]) for r, n in enumerate([1, 64, 65, 200]) for j in range(-(-n // 64))]
    assert sorted(listed) == list(range(8))  # every pool page once


def test_scaled_cap_scales_the_plans_cap_and_restores_it(probe):
    import foldkv
    from foldkv import KvFormat, PagedKvLayout
    from foldkv.kernels import plan as plan_mod

    lay = PagedKvLayout(foldkv.GEMMA4_31B, KvFormat.FOLDED, 64, 0)
    lens = probe.batches()["uniform24"]
    base = plan_mod.plan_decode(lay, lens, device="cpu", num_sms=132)
    with probe.scaled_cap(4):
        big = plan_mod.plan_decode(lay, lens, device="cpu", num_sms=132)
    again = plan_mod.plan_decode(lay, lens, device="cpu", num_sms=132)
    assert big.chunk_tokens > base.chunk_tokens and big.num_chunks < base.num_chunks / 2
    assert again.chunks == base.chunks  # the library's cap is back
