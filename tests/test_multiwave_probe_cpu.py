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


# --- the tile sweep (--tile-sweep, DECODE_NOTES run 24) -------------------------------------------------------------
KB = 1024


def test_todays_cells_are_the_pools_tiles(probe):
    """The sweep's today cells are run 23's tiles: a folded (page, KV head) tile is 64 rows x 640 bf16 = 80 KB with a
    page's four heads side by side (the next page of a head 320 KB on), split's 64 x 1,024 = 128 KB (512 KB); and the
    today-folded slots are the pool's tile index page * 4 + head of a head's pages in order, 16 pages a program."""
    import foldkv
    from foldkv import KvFormat, PagedKvLayout

    for fmt, lay, tile_kb in ((KvFormat.FOLDED, probe.TODAY_FOLDED, 80), (KvFormat.SPLIT, probe.TODAY_SPLIT, 128)):
        pool = PagedKvLayout(foldkv.GEMMA4_31B, fmt, 64, 3)
        assert pool.shape[1:] == (4, 64, {80: 640, 128: 1024}[tile_kb])
        assert lay == probe.TileLayout(tile_kb * KB, tile_kb * KB, 4, 1) and lay.stride == 4 * tile_kb * KB
        assert lay in probe.SWEEP_LAYOUTS
    slots = probe.sweep_slots(probe.TODAY_FOLDED)
    chunks = slots.shape[0] // 4
    for row in (0, 1, chunks + 5, 3 * chunks + 7):
        h, c = divmod(row, chunks)
        assert slots[row].tolist() == [(c * 16 + k) * 4 + h for k in range(16)], row


def _byte_counts(slots, lay, nbytes):
    counts = torch.zeros(nbytes, dtype=torch.int32)
    for s in slots.reshape(-1).tolist():
        counts[s * lay.pitch:s * lay.pitch + lay.tile] += 1
    return counts


@pytest.mark.parametrize("lay", [(8, 8, 2, 1), (8, 12, 2, 1), (8, 8, 2, 2), (4, 4, 1, 1), (8, 16, 3, 2)])
def test_tiles_cover_exactly_the_bytes_claimed(probe, lay):
    """Byte by byte on small layouts: every tile of the slots is read once, none overlaps another, the bytes covered
    are the bytes the read claims, and each program reads one stream's consecutive pages."""
    lay = probe.TileLayout(*(v * KB if i < 2 else v for i, v in enumerate(lay)))
    read = 8 * lay.streams * lay.tile  # 8 pages
    slots = probe.sweep_slots(lay, read, program_pages=2)
    cov = probe.tile_coverage(slots, lay)
    counts = _byte_counts(slots, lay, cov["buffer_bytes"])
    assert int(counts.max()) == 1 and int(counts.sum()) == read == cov["bytes"]
    for row in range(slots.shape[0]):  # the slot formula inverted: (page, stream) of each tile
        pages, streams = [], set()
        for s in slots[row].tolist():
            g, rest = divmod(s, lay.streams * lay.group)
            h, j = divmod(rest, lay.group)
            pages.append(g * lay.group + j)
            streams.add(h)
        assert len(streams) == 1 and pages == list(range(pages[0], pages[0] + len(pages))), (row, pages)
    # red twin: a slot read twice is an overlap the check refuses, and the byte count sees it
    twin = slots.clone()
    twin[0, 1] = twin[0, 0]
    assert int(_byte_counts(twin, lay, cov["buffer_bytes"]).max()) == 2
    with pytest.raises(ValueError, match="overlap"):
        probe.tile_coverage(twin, lay)


def test_every_sweep_cell_reads_the_denominators_bytes(probe):
    """Each layout of the sweep covers exactly the bytes the denominator (`read_folded` of the sweep's case) streams,
    tiles disjoint, inside the one buffer the cells share; red twin: a case one page longer streams other bytes."""
    want = probe.sweep_read_bytes()
    assert want == 10_240 * 4 * 80 * KB
    assert probe.denominator_bytes(probe.sweep_case("cpu")) == want
    buffer = probe.sweep_buffer_bytes()
    names = set()
    for lay in probe.SWEEP_LAYOUTS:
        slots = probe.sweep_slots(lay)
        cov = probe.tile_coverage(slots, lay)
        assert cov["bytes"] == want and cov["buffer_bytes"] <= buffer, lay
        assert slots.shape[1] == probe.SWEEP_PROGRAM_PAGES and slots.dtype == torch.int32
        names.add(lay.name)
    assert len(names) == len(probe.SWEEP_LAYOUTS)  # results are keyed by the name
    longer = probe.AttentionCase([probe.SWEEP_TOKENS + 64], device="cpu", min_copies=1)
    assert probe.denominator_bytes(longer) != want


def test_bad_layouts_are_refused_before_anything_is_made(probe):
    with pytest.raises(ValueError, match="pitch"):
        probe.sweep_slots(probe.TileLayout(80 * KB, 64 * KB, 4))  # tiles would overlap
    with pytest.raises(ValueError, match="whole 4 KB"):
        probe.sweep_slots(probe.TileLayout(81 * KB + 10, 96 * KB, 4))
    with pytest.raises(ValueError, match="whole pages"):
        probe.sweep_slots(probe.TileLayout(96 * KB, 96 * KB, 4))  # 3.36 GB is not whole 384 KB pages
    with pytest.raises(ValueError, match="whole groups"):
        probe.sweep_slots(probe.TileLayout(8 * KB, 8 * KB, 1, 3), read_bytes=32 * KB, program_pages=2)
    with pytest.raises(ValueError, match="past the sweep's buffer"):
        probe.tile_read_arm(probe.TileLayout(80 * KB, 128 * KB, 4), buffer_bytes=probe.sweep_read_bytes())


def test_lockstep_phases_tell_todays_tiles_apart(probe):
    """Hypothesis C's measure, derived from the slots: today's folded tiles all start at one place in any period of
    5 x 2^k KB (80 KB = 5 x 16 KB), split's at five; the 8 KB pad spreads folded's."""
    rows = {r["cell"]: r for r in probe.sweep_rows()}
    assert rows[probe.TODAY_FOLDED.name]["phases"] == 1
    assert rows[probe.TODAY_SPLIT.name]["phases"] == 5
    assert rows["t80_p88_k4_g1"]["phases"] >= 5 and rows["t80_p128_k4_g1"]["phases"] == 5
    assert rows["t128_p160_k2_g1"]["phases"] == 1  # split's tile at folded's stride camps as folded's


INTERPRETED = r'''
import sys, torch
sys.path[:0] = ["bench", "lib"]
import multiwave_probe as p
KB = 1024
lay = p.TileLayout(4 * KB, 6 * KB, 2, 2)
slots = p.sweep_slots(lay, read_bytes=8 * 2 * 4 * KB, program_pages=2)
cov = p.tile_coverage(slots, lay)
g = torch.Generator().manual_seed(0)
flat = torch.rand(cov["buffer_bytes"] // 2, generator=g).to(torch.bfloat16)
n, k = slots.shape
req, start = torch.arange(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
lens = torch.full((n,), k * p.PAGE, dtype=torch.int32)
def err(pitch):
    out = torch.full((n,), float("nan"))
    p.launch_tile_sum(flat, slots, req, start, lens, out, hkv=1, page=p.PAGE, tile=lay.tile // 2, pitch=pitch)
    total, absolute = p.expected_tile_sums(flat, slots, lay.tile // 2, lay.pitch // 2)
    return abs(float(out.double().sum()) - total) / max(1.0, absolute) if bool(torch.isfinite(out).all()) else 1.0
good, twin = err(lay.pitch // 2), err(lay.tile // 2)  # the twin: slots read at the tile's own pitch
pool = torch.rand(5, 2, 64, 32, generator=g).to(torch.bfloat16)  # the pool path: tiles of 64 x 32, 2 heads
ids = torch.tensor([[3, 0, 4], [1, 2, 0]], dtype=torch.int32)
cr, cs, cl = (torch.tensor(v, dtype=torch.int32) for v in ([0, 0, 1], [0, 128, 0], [128, 10, 100]))
out = torch.full((3, 2), float("nan"))
p.paged_read_kernel()(pool, ids, cr, cs, cl, out)
total, absolute = p.expected_page_sums(pool, ids, [(0, 0, 128), (0, 128, 10), (1, 0, 100)])
pool_err = abs(float(out.double().sum()) - total) / absolute
print("RESULT", good, twin, pool_err, p.PAGED_READ_TOL)
'''


def test_the_sweep_read_in_the_interpreter():
    """The sweep's read (the paged read's kernel over a table of slots at a pitch) in Triton's interpreter on a tiny
    padded, head-major buffer: its program sums add up to the float64 sum of exactly the slots' tiles, and the pool's
    paged read through the same kernel still does; red twin: the slots read at the tile's own pitch (no pad) do not."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    import numpy

    if tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton 3.6's interpreter needs NumPy < 2.4 (range over a runtime bound)")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    good, twin, pool_err, tol = map(float, line[0].split()[1:])
    assert good <= tol and pool_err <= tol, (good, pool_err)
    assert twin > tol, twin


def test_every_sweep_kernel_compiles_for_the_h100_without_spills(probe):
    """Each (tile, pitch) the sweep launches compiled for sm_90a here (conftest.triton_sm90: Triton's backend and its
    ptxas), as the device's JIT specialises it: no spills, and at most 64 registers, so at least 4 programs of 8 warps
    fit an SM (65,536 / (256 x 64)); the sweep records the device's own count beside each cell."""
    from conftest import triton_sm90

    pytest.importorskip("triton")
    fn = probe.paged_tile_sum_kernel()
    sig = {"pool_ptr": "*bf16", "ids_ptr": "*i32", "req_ptr": "*i32", "start_ptr": "*i32", "len_ptr": "*i32",
           "out_ptr": "*fp32", "max_pages": "i32"}
    pointers = tuple(n for n, k in sig.items() if k.startswith("*"))
    for tile, pitch in sorted({(lay.tile // 2, lay.pitch // 2) for lay in probe.SWEEP_LAYOUTS}):
        got = triton_sm90(fn, sig, dict(HKV=1, PAGE_=probe.PAGE, TILE=tile, PITCH=pitch, BLOCK=probe.tile_block(tile)),
                          pointers, num_warps=8)
        assert got["spill_bytes"] == 0 and got["registers"] <= 64, (tile, pitch, got["registers"])


def test_the_sweep_table_divides_by_the_read_of_the_same_bytes(probe):
    """Each cell's ratio is its median over the denominator's (the streaming read of the same bytes) and over the
    one-stream layout of its own tile; red twin: a cell whose denominator did not run has no ratio to the read."""
    today, one = probe.TODAY_FOLDED.name, probe.TileLayout(80 * KB, 80 * KB, 1).name
    info = {"tile_kb": 80.0, "pitch_kb": 80.0, "streams": 4, "group": 1, "stride_kb": 320.0, "phases": 1,
            "registers": 48, "spills": 0}
    arm = lambda us: {"status": "ok", "us": {"median": us}, "check": {"ok": True}, "info": info}  # noqa: E731
    cell = {"arms": {probe.SWEEP_DENOMINATOR: arm(1000.0), today: arm(1220.0), one: arm(1100.0)},
            "speedup": {probe.SWEEP_DENOMINATOR: {today: {"paired": {"median": 1.21}}}}}
    rows = {r["cell"]: r for r in probe.sweep_table(cell)}
    assert rows[today]["x_read"] == pytest.approx(1.22) and rows[today]["x_read_paired"] == 1.21
    assert rows[today]["x_one_stream"] == pytest.approx(1220 / 1100) and rows[one]["x_one_stream"] == 1.0
    assert rows[probe.TODAY_SPLIT.name]["status"] == "absent" and len(rows) == len(probe.SWEEP_LAYOUTS)
    lines = probe.sweep_lines(probe.sweep_table(cell))
    assert len(lines) == 1 + len(probe.SWEEP_LAYOUTS) and "1.220" in lines[2] and lines[3].endswith("absent")
    del cell["arms"][probe.SWEEP_DENOMINATOR]
    assert probe.sweep_table(cell)[1]["x_read"] is None and "n/a" in probe.sweep_lines(probe.sweep_table(cell))[2]
