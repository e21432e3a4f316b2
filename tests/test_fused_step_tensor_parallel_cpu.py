"""The decode step's own forward leaves a tensor-parallel projection to its module: a weight that is a DTensor shard, a
forward another library installed on the instance (transformers' tensor parallelism does, and reduces or gathers
there) or hooks around its forward, is neither merged, branched nor read by foldkv's GEMV; the step calls the module,
so that library's forward runs. Checked on the CPU, where building `StepForward` launches nothing.

Reproduce: python -m pytest -q tests/test_fused_step_tensor_parallel_cpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from conftest import require_module

SMALL = dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=128, intermediate_size=256)


@pytest.fixture()
def model():
    require_module("transformers")
    from foldkv.lab import gemma31b

    return gemma31b.build_gemma4_31b("cpu", num_layers=6, dtype=torch.float32, **SMALL)


@pytest.fixture()
def one_rank_mesh():
    """A one-process gloo group and its CPU mesh, for a real DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def _tp_forward(lin: nn.Module, calls: list, x: torch.Tensor) -> torch.Tensor:
    calls.append(lin)
    return nn.Linear.forward(lin, x)


def test_foreign_projection(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from foldkv.fused_step import foreign_projection

    plain = nn.Linear(8, 4, bias=False)
    assert not foreign_projection(plain)
    sharded = nn.Linear(8, 4, bias=False)
    sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), one_rank_mesh, [Shard(0)]))
    assert foreign_projection(sharded)
    wrapped = nn.Linear(8, 4, bias=False)
    wrapped.forward = functools.partial(_tp_forward, wrapped, [])
    assert foreign_projection(wrapped)
    hooked = nn.Linear(8, 4, bias=False)
    hooked.register_forward_hook(lambda m, i, o: o)
    assert foreign_projection(hooked)
    hooked_before = nn.Linear(8, 4, bias=False)
    hooked_before.register_forward_pre_hook(lambda m, i: None)
    assert foreign_projection(hooked_before)


def test_sharded_projection_is_not_selected(model, one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from foldkv.fused_step import StepForward, _mergeable, merge_projections
    from foldkv.step_options import StepOptions

    attn0 = model.model.layers[0].self_attn
    for lin in (attn0.q_proj, attn0.o_proj):
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), one_rank_mesh, [Shard(0)]))
    assert not _mergeable([attn0.q_proj, attn0.k_proj, attn0.v_proj])
    merge_projections(model)
    step = StepForward(model, StepOptions())
    assert step.qkv[0].merged is None and not step.qkv[0].branch and step.o_proj[0].weight is None
    # red twin: the next layer's plain projections are the step's own
    assert step.qkv[1].merged is not None and step.o_proj[1].weight is model.model.layers[1].self_attn.o_proj.weight


def test_the_step_calls_another_librarys_forward(model):
    from foldkv.fused_step import StepForward
    from foldkv.step_options import StepOptions

    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    calls: list = []
    theirs = {lin: functools.partial(_tp_forward, lin, calls) for lin in (attn0.q_proj, attn0.o_proj, model.lm_head)}
    for lin, fwd in theirs.items():
        lin.forward = fwd
    step = StepForward(model, StepOptions())
    for lin, fwd in theirs.items():
        assert lin.__dict__.get("forward") is fwd, "building the step's forward touched another library's forward"
    assert step.qkv[0].merged is None and not step.qkv[0].branch
    assert step.o_proj[0].weight is None and step.lm_head.weight is None
    assert step.o_proj[1].weight is attn1.o_proj.weight  # red twin: a plain projection is read by the step
    x = torch.randn(1, 1, attn0.o_proj.in_features)
    y, parts = step.o_proj[0].tail(x)
    assert parts is None and calls == [attn0.o_proj]
    step.o_proj[1](x)
    assert calls == [attn0.o_proj]
