"""bench/versions/gemv_pdl_tc.py (the tensor-core PDL GEMM of 1..16 rows of x: its kernel is foldkv.gemv's; the lab's
options around it) on the GPU.

Bound: every output element against float64 within the float32-accumulation bound the library GEMV and the M-row
version are held to, |y - ref| <= ulp(ref) + K 2^-23 sum_k |x_k w_k| (tests/test_fused_step_gpu.py's
`_gemv_within_bound`: the output poisoned with NaN first, every element must be written; the tensor cores' truncated
float32 sums stay inside it, the module's header says why), at M = 2, 3, 8, 16 over the 31B's projection shapes
(merged q|k|v, global q|k and gate|up; o_proj sliding and global and down_proj, which split K; the narrow global
k_proj, split 6) and awkward ones: N = 4,098 (not a whole number of 64-row tiles: masked rows) with K = 5,888 (46
tiles, split 2), a [6, 256] weight (one program, 58 rows masked) and a [6, 128] one (the prefetched tile only: the
loop runs no step). The configuration variants the probe times (wider K tile, 3 stages, 2 stages, 2 stages where
the last wave is a tail, 128-row tiles, no split, no prefetch), PDL and plain, within the same bound.
Red twins: the kernel told a K range one tile short (with and without a split); told M - 1 rows (one x row dropped,
its output row zero: the bound, not the NaN check, must catch it); split_sum told one partial fewer; each misses the
bound. PDL: the PDL builds bitwise the plain ones (split and not); foldkv.lab.pdl_checks' race check with this kernel
as its consumer (eager: the wait holds; in a graph: the wait holds and the red twin, x's first tile loaded before the
wait, is caught), on a weight that splits K (split_sum in the chain) and one that does not; the PTX scan (the
prefetched weight tile's loads only before the wait, no cp.async; the red twin's x loads visible).

The `_fixup` variant (split_sum folded into the GEMM: the last program of a row tile sums the partials): bitwise the
library's GEMM + split_sum at 1, 3, 8, 16 rows on the split shapes, PDL and plain, every element written, its counters
back at zero after a call and after each of three graph replays; red twin: told one split more, no program is the
last, so nothing is written; its race check (eager, and in a graph with the red twin caught).

`linear_gelu` (the MLP's activation in down_proj's x loads): bitwise fused_step.gelu_mul then the library kernel at
1, 3, 8, 16 rows (with split_sum and with the fixup; the output poisoned first); red twin: gate and up swapped; the
synthetic Gemma 4's generate() with fixup and GELU installed bitwise the library's at batch 1 and 8.

Reproduce: FOLDKV_REQUIRE_GPU=1 PYTHONPATH=$PWD/lib python -m pytest -q tests/test_gemv_tc_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import pdl_bench_version
from test_fused_step_gpu import _gemv_case, _gemv_within_bound

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
MS = (2, 3, 8, 16)
# the 31B's [N, K]: sliding q|k|v merged, global q|k merged, gate|up merged, sliding o_proj, global o_proj, down_proj,
# global k_proj (unmerged: split 6); awkward: masked rows and 46 tiles, one program, one tile
SHAPES = [(16384, 5376), (18432, 5376), (43008, 5376), (5376, 8192), (5376, 16384), (5376, 21504), (2048, 5376),
          (4098, 5888), (6, 256), (6, 128)]
SPLIT_SHAPES = {(5376, 8192), (5376, 16384), (5376, 21504), (2048, 5376), (4098, 5888)}


@pytest.fixture()
def tc():
    return pdl_bench_version("gemv_pdl_tc")


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m", MS)
def test_tc_within_the_gemv_bound(tc, m, shape):
    n, k = shape
    assert tc.shape_refusal(m, n, k, BF16, BF16, True, False) is None
    assert (tc.config(n, k, m)["SPLIT"] > 1) == (shape in SPLIT_SHAPES), tc.config(n, k, m)
    assert _gemv_within_bound(lambda x, w, out: tc.linear(x, w, out=out), shape, m, seed=n + k + m)
    assert tc.report() == {"kernel": 1, "refusals": {}}  # the kernel, not F.linear


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("variant", ["_k256", "_s3", "_s2", "_tailfit", "_n128", "_nosplit", "_nopf"])
@pytest.mark.parametrize("m", [3, 8])
def test_variants_within_the_bound(tc, m, variant, pdl):
    over = tc.VARIANTS.get(variant, dict(prefetch=0))
    # (18432, 5376): the global q|k, the one weight `_tailfit` gives two stages
    for shape in [(16384, 5376), (5376, 21504), (4098, 5888), (18432, 5376)]:
        assert _gemv_within_bound(lambda x, w, out: tc.linear(x, w, pdl=pdl, out=out, **over), shape, m,
                                  seed=shape[1] + m)
    assert tc.report()["refusals"] == {}


@pytest.mark.parametrize("shape", [(16384, 5376), (5376, 21504)], ids=["whole", "split"])
def test_batch_shaped_x_and_pdl_bitwise_plain(tc, shape):
    n, k = shape
    for m in (2, 8, 16):
        x, w, _ = _gemv_case(shape, m, seed=m)
        x3 = x.view(m, 1, k)  # the step's [batch, 1, K]
        y = tc.linear(x3, w)
        assert y.shape == (m, 1, n)
        assert torch.equal(y, tc.linear(x3, w, pdl=False))  # only the ordering differs
        assert torch.equal(y, tc.linear(x3, w))  # and a launch is deterministic (no atomics in the split)


@pytest.mark.parametrize("shape", [(16384, 5376), (5376, 8192)], ids=["whole", "split"])
@pytest.mark.parametrize("m", [2, 8])
def test_red_twin_one_tile_short(tc, m, shape):
    cfg = tc.config(*shape, m)

    def short(x, w, out):
        tc.launch(x, w, out, cfg, True, k_split=shape[1] // cfg["SPLIT"] - cfg["BLOCK_K"])
    assert not _gemv_within_bound(short, shape, m, seed=3)


@pytest.mark.parametrize("shape", [(16384, 5376), (5376, 8192)], ids=["whole", "split"])
@pytest.mark.parametrize("m", [2, 3, 16])
def test_red_twin_one_x_row_dropped(tc, m, shape):
    cfg = tc.config(*shape, m)

    def dropped(x, w, out):
        out[-1].zero_()  # written, so the bound (not the NaN check) must catch it
        tc.launch(x, w, out, cfg, False, m=m - 1)
    assert not _gemv_within_bound(dropped, shape, m, seed=4)


@pytest.mark.parametrize("m", [2, 8])
def test_red_twin_a_split_partial_dropped(tc, m):
    shape = (5376, 21504)
    cfg = tc.config(*shape, m)
    assert cfg["SPLIT"] == 2

    def one_partial(x, w, out):
        tc.launch(x, w, out, cfg, True, reduce_splits=cfg["SPLIT"] - 1)
    assert not _gemv_within_bound(one_partial, shape, m, seed=5)


# --- the `_fixup` variant: split_sum folded into the GEMM (MODEL_DECODE_NOTES run 18) -------------------------------
FIXUP_SHAPES = [(5376, 8192), (5376, 21504), (4098, 5888), (2048, 5376)]


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("shape", FIXUP_SHAPES, ids=[f"{n}x{k}" for n, k in FIXUP_SHAPES])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_fixup_is_bitwise_the_split_sum_and_leaves_its_counters_at_zero(tc, m, shape, pdl):
    n, k = shape
    cfg = tc.config(n, k, m, fixup=True)
    assert cfg["FIXUP"] and cfg["SPLIT"] > 1, cfg
    got = {}

    def fixed(x, w, out):
        got["ref"] = tc.linear(x, w, pdl=pdl)  # the library's kernels: the GEMM and split_sum
        tc.linear(x, w, pdl=pdl, out=out, fixup=True)
        got["y"], got["cnt"] = out.clone(), tc.counters(w, cfg).clone()
    assert _gemv_within_bound(fixed, shape, m, seed=n + m)  # poisoned first: every element written
    assert torch.equal(got["y"], got["ref"].view(m, n))
    assert not got["cnt"].any(), got["cnt"]


@pytest.mark.parametrize("m", [1, 8])
def test_fixup_replayed_in_a_graph(tc, m):
    shape = (5376, 21504)
    x, w, _ = _gemv_case(shape, m, seed=11)
    ref = tc.linear(x, w)
    out = torch.full((m, shape[0]), float("nan"), dtype=BF16, device="cuda")
    tc.linear(x, w, out=out, fixup=True)  # compiled and its counters made before the capture
    torch.cuda.synchronize()
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        tc.linear(x, w, out=out, fixup=True)
    for _ in range(3):
        out.fill_(float("nan"))
        cg.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and not tc.counters(w, tc.config(*shape, m, fixup=True)).any()


@pytest.mark.parametrize("m", [2, 8])
def test_fixup_red_twin_told_one_split_more_never_writes(tc, m):
    """The kernel told SPLIT + 1: no program is the last, so nothing is written (the output stays poisoned) and the
    counters stay at the grid's SPLIT (a fresh buffer, so the variant's own stay clean)."""
    shape = (5376, 21504)
    x, w, _ = _gemv_case(shape, m, seed=12)
    cfg = tc.config(*shape, m, fixup=True)
    cnt = torch.zeros(-(-shape[0] // cfg["BLOCK_N"]), dtype=torch.int32, device="cuda")
    out = torch.full((m, shape[0]), float("nan"), dtype=BF16, device="cuda")
    tc.launch(x, w, out, cfg, True, reduce_splits=cfg["SPLIT"] + 1, cnt=cnt)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()
    assert torch.equal(cnt, torch.full_like(cnt, cfg["SPLIT"]))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_fixup_waits_for_its_producer(tc, graph):
    got = tc.race_check(8, graph=graph, n=4096, fixup=True)
    assert got["split"] == 3 and got["ok"], got
    if graph:
        assert got["red_caught"], got


# --- linear_gelu: the MLP's activation made in down_proj's x loads (MODEL_DECODE_NOTES run 19) ----------------------
def _gate_up(m: int, k: int, seed: int):
    """gate, up: the halves of a merged gate|up output [m, 1, 2k] (one row stride), the 31B's activations' scale."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    both = (torch.randn(m, 1, 2 * k, generator=g, device="cuda") * 2.0).to(BF16)
    return both.split(k, dim=-1)


@pytest.mark.parametrize("fixup", [False, True], ids=["split_sum", "fixup"])
@pytest.mark.parametrize("shape", [(5376, 21504), (4098, 5888), (256, 512)], ids=["down", "awkward", "small"])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_linear_gelu_is_bitwise_gelu_mul_then_the_kernel(tc, m, shape, fixup):
    from foldkv import fused_step, gemv

    n, k = shape
    gate, up = _gate_up(m, k, seed=n + m)
    w = (torch.randn(n, k, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda") * k ** -0.5).to(
        BF16)
    want = gemv.linear(fused_step.gelu_mul(gate, up), w)
    out = torch.full((m, n), float("nan"), dtype=BF16, device="cuda")  # every element must be written
    tc.reset()
    got = tc.linear_gelu(gate, up, w, out=out, fixup=fixup)
    assert tc.report() == {"kernel": 1, "refusals": {}}
    assert got.data_ptr() == out.data_ptr() and bool(torch.isfinite(out).all())
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


def test_linear_gelu_red_twin_gate_and_up_swapped(tc):
    from foldkv import fused_step, gemv

    m, (n, k) = 8, (5376, 21504)
    gate, up = _gate_up(m, k, seed=5)
    w = (torch.randn(n, k, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda") * k ** -0.5).to(
        BF16)
    assert not torch.equal(tc.linear_gelu(up, gate, w), gemv.linear(fused_step.gelu_mul(gate, up), w))


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    from conftest import synthetic_gpu_models

    return synthetic_gpu_models(tmp_path_factory, "foldkv")["foldkv"]


@pytest.mark.parametrize("batch", [1, 8])
def test_the_step_with_the_lab_options_is_bitwise_the_library(tc, synthetic_model, batch):
    """generate() through a FoldKvCache (graph step) with fixup and GELU installed: tokens and logits bitwise the
    library's (both options make the same roundings of the same sums); the GELU route took every MLP."""
    from test_gemv_gpu import _generate

    want = _generate(synthetic_model, batch=batch)
    with tc.installed(fixup=True, gelu=True) as took:
        got = _generate(synthetic_model, batch=batch)
    layers = sum(type(m).__name__ == "Gemma4TextMLP" for m in synthetic_model.modules())
    assert took["gelu"] >= 2 * layers, took  # the warm-up and the capture, every layer
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("n", [4096, 16384], ids=["split", "whole"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("m", [2, 8, 16])
def test_pdl_waits_for_its_producer(tc, m, graph, n):
    """The wait holds (eager and in a graph); in the graph the red twin is caught: the kernel did launch during its
    producer (eagerly the H200 did not overlap, MODEL_DECODE_NOTES run 11: not asserted)."""
    got = tc.race_check(m, graph=graph, n=n)
    assert got["split"] == (3 if n == 4096 else 1), got
    assert got["ok"], got
    if graph:
        assert got["red_caught"], got


@pytest.mark.parametrize("m", [2, 8])
def test_ptx_loads_no_x_before_its_wait(tc, m):
    plain, red = tc.ptx_order(m), tc.ptx_order(m, red_x_early=True)
    assert plain["waits"] == 1 and 0 < plain["loads_before_wait"] <= plain["weight_loads_expected"], plain
    assert plain["cp_async_before_wait"] == 0, plain
    assert red["loads_before_wait"] > plain["loads_before_wait"], red


def test_kernel_stats_are_read(tc):
    got = tc.kernel_stats(5376, 21504, 8)
    assert isinstance(got["n_regs"], int) and got["n_regs"] > 0 and isinstance(got["n_spills"], int), got
    assert isinstance(got["shared"], int) and got["shared"] > 0, got
    assert got["SPLIT"] == 2 and got["programs"] == 168, got
    assert got["wgmma"] or got["mma_sync"], got  # the tensor cores multiply, one way or the other
