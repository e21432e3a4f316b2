"""bench/gemv_probe.py without a GPU: its arm names and --arms parsing, the PDL experiment's chain arms (run 10) and
their norm plan over the 31B's 411 projection shapes, and the chain step's data flow with stand-in kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import bench_script


@pytest.fixture(scope="module")
def probe():
    return bench_script("gemv_probe")


def _model_31b_shapes():
    """A stand-in of the 31B's projections on the meta device (shapes only): 60 layers, five sliding (q 32 x 256,
    k and v 16 x 256) then one global (q 32 x 512, k 4 x 512, no v_proj); hidden 5,376, intermediate 21,504."""
    def lin(k, n):
        return nn.Linear(k, n, bias=False, device="meta")

    layers = []
    for i in range(60):
        glob = i % 6 == 5
        d, kv = (512, 4) if glob else (256, 16)
        attn = SimpleNamespace(q_proj=lin(5376, 32 * d), k_proj=lin(5376, kv * d), o_proj=lin(32 * d, 5376))
        if not glob:
            attn.v_proj = lin(5376, kv * d)
        mlp = SimpleNamespace(gate_proj=lin(5376, 21504), up_proj=lin(5376, 21504), down_proj=lin(21504, 5376))
        layers.append(SimpleNamespace(self_attn=attn, mlp=mlp))
    return SimpleNamespace(model=SimpleNamespace(layers=layers), lm_head=lin(5376, 262144))


def test_existing_arms_keep_their_names_and_the_pdl_arms_are_added(probe):
    assert probe.BASE_ARMS == ("torch", "torch_branches", "stream", "stream_branches", "stream_c2", "stream_c8",
                               "stream_s4", "stream_s2", "stream_w8")
    assert probe.ONE_ROW_ARMS == ("fma_r2", "fma_r4", "fma_r16", "fma_r4_branches")
    assert {"fma_r4_norm", "fma_r4_norm_pdl", "fma_r4_norm_pdl_nopf", "fma_r4_pdl"} <= set(probe.CHAIN_ARMS)
    assert len(set(probe.ARM_NAMES)) == len(probe.ARM_NAMES)
    for name, spec in probe.CHAIN_ARMS.items():
        assert set(spec) == {"rows", "gemv", "prefetch", "pdl", "norm"}, name
        assert name.startswith(f"fma_r{spec['rows']}_")
        assert ("_pdl" in name) == spec["pdl"], name  # a name says whether it launches with PDL
        assert spec["gemv"] == "pdl" or spec["prefetch"] == 0  # gemv_fma's kernel prefetches nothing
        if spec["pdl"] and spec["norm"]:
            plain = f"fma_r{spec['rows']}_norm"
            assert plain in probe.CHAIN_ARMS and not probe.CHAIN_ARMS[plain]["pdl"]  # its baseline is measured too
        if spec["pdl"] and not spec["norm"]:
            assert f"fma_r{spec['rows']}" in probe.ONE_ROW_ARMS  # against the back-to-back arm of run 6


def test_arms_parse_and_a_misspelt_arm_is_refused_before_any_gpu_work(probe, capsys):
    args = probe.parse_args([])
    assert (args.rows, args.arms, args.cells, args.no_arms) == ([1, 8], None, [], False)
    args = probe.parse_args(["--rows", "1", "--arms", "fma_r4", "fma_r4_norm_pdl", "torch_merged"])
    assert args.rows == [1] and args.arms == ["fma_r4", "fma_r4_norm_pdl", "torch_merged"]
    with pytest.raises(SystemExit):
        probe.main(["--rows", "1", "--arms", "fma_r4_norm_pld"])  # parse error: main stops before CUDA
    assert "unknown arms ['fma_r4_norm_pld']" in capsys.readouterr().err


def test_the_norm_plan_covers_the_411_projections_in_whole_head_rows(probe):
    projs = probe.projections(_model_31b_shapes())
    assert len(projs) == 411
    plan = probe.norm_plan([tuple(lin.weight.shape) for _, lin in projs])
    assert len(plan) == 410
    assert {p["programs"] for p in plan} == {21, 32, 64, 84}  # K = 5,376, 8,192, 16,384, 21,504 in rows of 256
    # the norm wraps when the previous output is the shorter: q 8,192 -> k's input 5,376 does not, k 4,096 -> v does
    assert plan[0] == dict(n_prev=8192, k=5376, programs=21, wraps=False)
    assert plan[1] == dict(n_prev=4096, k=5376, programs=21, wraps=True)
    with pytest.raises(ValueError, match="multiples of 256"):
        probe.norm_plan([(4096, 5376), (100, 5000)])


@pytest.mark.parametrize("norm", [True, False])
def test_the_chain_step_feeds_each_projection_the_norm_of_the_last_output(probe, norm):
    lins = [nn.Linear(512, 768, bias=False), nn.Linear(512, 256, bias=False), nn.Linear(256, 512, bias=False)]
    projs = [(f"0.p{i}", lin) for i, lin in enumerate(lins)]
    calls = []

    def gemv_fn(x, w, pdl):
        calls.append(("gemv", tuple(w.shape), pdl))
        return x @ w.T

    def norm_fn(y, k, gamma, pdl):
        calls.append(("norm", y.shape[-1], k, pdl))
        assert gamma.shape == (probe.HEAD_D,)
        return torch.full((1, k), float(y.shape[-1]))

    spec = dict(rows=4, gemv="pdl", prefetch=1, pdl=True, norm=norm)
    with torch.no_grad():
        outs = probe.make_chain_step(projs, spec, torch.device("cpu"), gemv_fn, norm_fn)()
        plain = probe.make_chain_step(projs, spec, torch.device("cpu"), gemv_fn, norm_fn, pdl=False)()
    assert [tuple(o.shape) for o in outs] == [(1, 768), (1, 256), (1, 512)]
    first = calls[:len(calls) // 2]
    if norm:
        assert first == [("gemv", (768, 512), True), ("norm", 768, 512, True), ("gemv", (256, 512), True),
                         ("norm", 256, 256, True), ("gemv", (512, 256), True)]
        assert torch.equal(outs[1], torch.full((1, 512), 768.0) @ lins[1].weight.T)  # the norm's output, not xs
    else:
        assert first == [("gemv", (768, 512), True), ("gemv", (256, 512), True), ("gemv", (512, 256), True)]
    assert all(c[-1] is False for c in calls[len(calls) // 2:])  # pdl=False overrides the spec
    assert all(torch.equal(a, b) for a, b in zip(outs, plain))


def test_the_l2_prefix_probe_plans_whole_blocks_and_refuses_a_prefix_past_the_weight():
    """bench/l2_prefix_probe.py's plan (run 27's first measurement): each prefix in whole stream-read blocks covering
    at least its megabytes, copies past L2; a prefix larger than the weight refused before anything is allocated."""
    from foldkv.lab.bench.roofs import STREAM_BLOCK

    probe = bench_script("l2_prefix_probe")
    n, k = probe.SHAPES["5376x8192"]
    p = probe.plan(n, k, [0, 8, 24, 33])
    assert p["blocks"][0] == 0 and p["copies"] * p["weight_bytes"] >= 700 << 20
    for mb in (8, 24, 33):
        got = p["blocks"][mb] * STREAM_BLOCK * 2
        assert (mb << 20) <= got < (mb << 20) + 2 * STREAM_BLOCK
    with pytest.raises(ValueError, match="prefix of 89 MB"):  # red twin: past the 84 MB weight
        probe.plan(n, k, [89])
    args = probe.parser().parse_args(["--prefix-mb", "0", "24", "--shapes", "5376x16384"])
    assert args.prefix_mb == [0, 24] and args.shapes == ["5376x16384"]
