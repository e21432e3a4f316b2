"""GPU gates of the decode workspace (one CUDA graph for every step): the graph walk (one capture replayed for 64
steps while every length grows, bit-equal to eager steps, checked against the float64 reference), its red twin (a
stale plan is caught), the workspace through the gates' hostile pools on ragged batches of 64 and 128, and refusals
that write nothing. Reproduce one case: FOLDKV_REQUIRE_GPU=1 pytest tests/test_workspace_gpu.py -k '<id>'."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import collecting_at_every_allocation, drop_into_garbage

import foldkv
from foldkv import FoldKvInputError, KvFormat
from foldkv.kernels.workspace import DecodeWorkspace, end_generator_capture
from foldkv.lab import gates

pytestmark = pytest.mark.gpu

FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]


@pytest.mark.parametrize("update", ["advance", "plan"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_graph_walk_64_steps(cuda_device, fmt, update):
    res = gates.graph_walk(fmt, update=update, max_batch=len(gates.WALK_LENGTHS) + 1, device=cuda_device)
    bad = [r for r in res["steps"] if not r["passed"]]
    assert len(res["steps"]) == 64 and not bad, bad[:3]


def test_graph_walk_catches_a_stale_plan(cuda_device):
    res = gates.graph_walk(KvFormat.FOLDED, steps=4, stale=True, check_every=1, device=cuda_device)
    assert res["steps"][0]["passed"], "the first step (fresh plan) must pass"
    assert not any(r["passed"] for r in res["steps"][1:]), "a step over a stale plan must fail the reference check"


def workspace_launch(inputs: gates.GateInputs, out: torch.Tensor, lse: torch.Tensor):
    """A gates arm: the case through a workspace sized to it, its step captured and replayed."""
    lens = list(inputs.case.seq_lens)
    ws = DecodeWorkspace(inputs.pool.layout, max_batch=len(lens), max_len=max(lens), device=inputs.pool.device)
    width = inputs.pool.layout.pages_for(max(lens))
    ws.plan(lens, inputs.table.page_ids[:, :width].contiguous())
    ws.query.copy_(inputs.query)
    ws.capture(inputs.pool).replay()
    o, l = ws.output()
    out.copy_(o)
    lse.copy_(l)
    return out, lse


@pytest.mark.parametrize("case", ["ragged64", "ragged128"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_workspace_on_gate_cases(cuda_device, fmt, case):
    c = next(c for c in gates.decode_cases("full") if c.name == case)  # lengths 1, 63, 64, 65, 262,144 among them
    inputs = gates.make_inputs(c, fmt, cuda_device, 5)
    res = gates.run_case(inputs, workspace_launch)
    assert res["passed"], gates.summary_row(c, fmt, "workspace", res)


@pytest.mark.parametrize("collector", ["paused", "running"])
def test_capture_outlives_a_garbage_graph(cuda_device, collector):
    """A CUDA graph put into a reference cycle and dropped while the step is captured, and the collector's
    threshold making every allocation a collection. `DecodeWorkspace.capture` (`capture_graph`: the collector paused)
    captures a step that replays equal to eager; the same capture with the collector running (the red twin:
    `torch.cuda.graph` alone) is invalidated when the collection destroys that graph mid-capture (notebook 03 of
    h200-20261202-s14 lost a drift arm this way, once)."""
    from foldkv.kernels.decode_partial import build_decode_fused

    inputs = gates.make_inputs(gates.Case("1x8192", (8192,)), KvFormat.FOLDED, cuda_device, 3)
    ws = DecodeWorkspace(inputs.pool.layout, max_batch=1, max_len=8192, device=cuda_device)
    ws.plan([8192], inputs.table.page_ids[:, :inputs.pool.layout.pages_for(8192)].contiguous())
    ws.query.copy_(inputs.query)
    eager = tuple(t.clone() for t in ws.step(inputs.pool))
    old = torch.cuda.CUDAGraph()  # a real graph (captured, instantiated): its destruction calls the CUDA runtime
    x = torch.ones(4, device=cuda_device)
    side = torch.cuda.Stream(device=cuda_device)
    with torch.cuda.stream(side), torch.cuda.graph(old, stream=side):
        x.add_(1)
    held = [old]
    del old
    fused = build_decode_fused(foldkv.GEMMA4_31B, KvFormat.FOLDED)

    def step_dropping_the_graph(*args):  # the library's fused step; inside a capture the graph becomes garbage
        if torch.cuda.is_current_stream_capturing() and held:
            # a fresh cycle: young garbage, which the next collection frees (a cycle made before the capture had
            # reached the oldest generation, whose collections Python throttles: the first H200 run's red twin did
            # not raise)
            drop_into_garbage(held)
        return fused(*args)

    kernels = {"decode_fused_folded": step_dropping_the_graph}
    try:
        with collecting_at_every_allocation():
            if collector == "paused":
                graph = ws.capture(inputs.pool, kernels=kernels)
            else:
                ws.step(inputs.pool, kernels=kernels)
                graph = torch.cuda.CUDAGraph()
                with pytest.raises(RuntimeError, match="capture"):
                    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
                        ws.step(inputs.pool, kernels=kernels, check=False)
                # the bare capture left the device's random generator in capture mode: the library's way out
                with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
                    torch.randn(1, device=cuda_device)
                end_generator_capture(cuda_device)
                torch.randn(1, device=cuda_device)
                return
    finally:
        held.clear()
        gc.collect()
    ws.out.fill_(float("nan"))
    ws.lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ws.out[:1], eager[0]) and torch.equal(ws.lse[:1], eager[1])


@pytest.mark.parametrize("bad", ["batch", "length", "narrow_table", "table_dtype", "pool_format"])
def test_refusals_write_nothing(cuda_device, bad):
    lay = foldkv.PagedKvLayout(foldkv.GEMMA4_31B, KvFormat.FOLDED, 64, 16)
    pool = foldkv.PagedKvPool(lay, device=cuda_device)
    pool.data.normal_()
    ws = DecodeWorkspace(lay, max_batch=4, max_len=512, device=cuda_device)
    table = torch.arange(16, dtype=torch.int32, device=cuda_device).view(2, 8)
    ws.plan([300, 17], table)
    ws.step(pool)
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in (("plan", ws._plan_dev), ("pages", ws.page_ids), ("out", ws.out),
                                        ("lse", ws.lse), ("pool", pool.data))}
    call = {
        "batch": lambda: ws.plan([5] * 5),
        "length": lambda: ws.plan([513, 5]),
        "narrow_table": lambda: ws.plan([300, 17], table[:, :4].contiguous()),
        "table_dtype": lambda: ws.plan([300, 17], table.long()),
        "pool_format": lambda: ws.step(foldkv.PagedKvPool(foldkv.PagedKvLayout(foldkv.GEMMA4_31B, KvFormat.SPLIT,
                                                                               64, 16), device=cuda_device)),
    }[bad]
    with pytest.raises(FoldKvInputError):
        call()
    torch.cuda.synchronize()
    for k, v in before.items():
        now = {"plan": ws._plan_dev, "pages": ws.page_ids, "out": ws.out, "lse": ws.lse, "pool": pool.data}[k]
        assert torch.equal(now.view(torch.uint8) if now.dtype.is_floating_point else now,
                           v.view(torch.uint8) if v.dtype.is_floating_point else v), f"{k} changed"
