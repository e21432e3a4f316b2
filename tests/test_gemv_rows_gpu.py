"""bench/versions/gemv_pdl_rows.py (the PDL GEMV of 1..8 rows of x: lost to cuBLAS 2.9x at 8 rows) on the GPU.

Bound: every output element against float64 within the float32-accumulation bound the one-row kernels are held to,
|y - ref| <= ulp(ref) + K 2^-23 sum_k |x_k w_k| (tests/test_fused_step_gpu.py's `_gemv_within_bound`: the output
poisoned with NaN first, every element must be written), at M = 1, 2, 3, 7, 8 over the 31B's projection shapes
(merged q|k|v and gate|up, o_proj sliding and global, down_proj) and two awkward ones: N = 4,098 (2 x 2,049 rows) with
K = 5,888 (23 x 256: no 512 divides it), and a [6, 256] weight (three one-warp programs of one tile, no loop).
Red twins: the kernel told a reduction one K block short; the kernel told M - 1 rows (one x row dropped, its output row
zero); each misses the bound. PDL: the PDL build bitwise the plain one; foldkv.lab.pdl_checks' race check with this
kernel as its consumer (eager: the wait holds; in a graph: the wait holds and the red twin, x's first tile of row 0
loaded before the wait, is caught) and the PTX scan (no x load before the wait; the red twin's visible).

Reproduce: FOLDKV_REQUIRE_GPU=1 PYTHONPATH=$PWD/lib python -m pytest -q tests/test_gemv_rows_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import pdl_bench_version
from test_fused_step_gpu import _gemv_case, _gemv_within_bound

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
MS = (1, 2, 3, 7, 8)
# the 31B's [N, K]: sliding q|k|v merged, gate|up merged, sliding o_proj, global o_proj, down_proj; awkward: N odd
# halves, K = 22 x 256 (no 512 divides it), a weight of one tile
SHAPES = [(16384, 5376), (43008, 5376), (5376, 8192), (5376, 16384), (5376, 21504), (4098, 5888), (6, 256)]


@pytest.fixture()
def gr():
    return pdl_bench_version("gemv_pdl_rows")


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m", MS)
def test_m_rows_within_the_gemv_bound(gr, m, shape):
    n, k = shape
    assert gr.shape_refusal(m, n, k, BF16, BF16, True, False) is None
    assert _gemv_within_bound(lambda x, w, out: gr.linear(x, w, out=out), shape, m, seed=n + k + m)
    assert gr.report() == {"kernel": 1, "refusals": {}}  # the kernel, not F.linear


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("prefetch", [1, 0])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("m", [2, 8])
def test_other_rows_a_program_and_prefetch_within_the_bound(gr, m, rows, prefetch, pdl):
    for shape in [(16384, 5376), (5376, 21504)]:
        assert _gemv_within_bound(lambda x, w, out: gr.linear(x, w, rows=rows, prefetch=prefetch, pdl=pdl, out=out),
                                  shape, m, seed=shape[1] + rows + prefetch)
    assert gr.report()["refusals"] == {}


def test_batch_shaped_x_and_pdl_bitwise_plain(gr):
    for m in (2, 8):
        x, w, _ = _gemv_case((5376, 21504), m, seed=m)
        x3 = x.view(m, 1, -1)  # the step's [batch, 1, K]
        y = gr.linear(x3, w)
        assert y.shape == (m, 1, 5376)
        assert torch.equal(y, gr.linear(x3, w, pdl=False))  # only the ordering differs


@pytest.mark.parametrize("m", [2, 8])
def test_red_twin_one_block_short(gr, m):
    shape = (16384, 5376)
    cfg = gr.config(*shape, m)

    def short(x, w, out):
        gr.gemv_m_rows[(shape[0] // cfg["ROWS"],)](x, w, out, shape[0], shape[1] - cfg["BLOCK_K"], GDC=True,
                                                   launch_pdl=True, **cfg)
    assert not _gemv_within_bound(short, shape, m, seed=3)


@pytest.mark.parametrize("m", [2, 3, 8])
def test_red_twin_one_x_row_dropped(gr, m):
    shape = (5376, 8192)
    cfg = dict(gr.config(*shape, m), M=m - 1)

    def dropped(x, w, out):
        out[-1].zero_()  # written, so the bound (not the NaN check) must catch it
        gr.gemv_m_rows[(shape[0] // cfg["ROWS"],)](x, w, out, shape[0], shape[1], GDC=False, **cfg)
    assert not _gemv_within_bound(dropped, shape, m, seed=4)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("m", [2, 8])
def test_pdl_waits_for_its_producer(gr, m, graph):
    """The wait holds (eager and in a graph); in the graph the red twin is caught: the kernel did launch during its
    producer (eagerly the H200 did not overlap, MODEL_DECODE_NOTES run 11: not asserted)."""
    got = gr.race_check(m, graph=graph)
    assert got["ok"], got
    if graph:
        assert got["red_caught"], got


@pytest.mark.parametrize("m", [2, 8])
def test_ptx_loads_no_x_before_its_wait(gr, m):
    plain, red = gr.ptx_order(m), gr.ptx_order(m, red_x_early=True)
    assert plain["waits"] == 1 and 0 < plain["loads_before_wait"] <= plain["weight_loads_expected"], plain
    assert red["loads_before_wait"] > plain["loads_before_wait"], red


def test_kernel_stats_are_read(gr):
    got = gr.kernel_stats(5376, 8, 2)
    assert isinstance(got["n_regs"], int) and got["n_regs"] > 0 and isinstance(got["n_spills"], int), got
    assert got["accumulators"] == 128
