"""The fused decode step leaves a tensor-parallel projection to its own forward: a weight that is a DTensor shard, a
forward another library installed on the instance (transformers' tensor parallelism does, and reduces or gathers
there) or hooks around its forward, is neither merged, branched nor swapped for foldkv's GEMV, and that forward is still the instance's after the
step. Checked on the CPU, where entering `fused_step` launches nothing.

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

    from foldkv.fused_step import _mergeable, branched_attention_modules, projection_modules

    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert attn0 in branched_attention_modules(model) and attn0.o_proj in projection_modules(model)  # red twin
    for lin in (attn0.q_proj, attn0.o_proj):
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), one_rank_mesh, [Shard(0)]))
    assert attn0 not in branched_attention_modules(model)
    assert attn0.o_proj not in projection_modules(model)
    assert not _mergeable([attn0.q_proj, attn0.k_proj, attn0.v_proj])
    assert attn1 in branched_attention_modules(model) and attn1.o_proj in projection_modules(model)


def test_fused_step_keeps_another_librarys_forward(model):
    from foldkv.fused_step import _merged_weight, _projection_forward, fused_step

    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    calls: list = []
    theirs = {lin: functools.partial(_tp_forward, lin, calls) for lin in (attn0.q_proj, attn0.o_proj, model.lm_head)}
    for lin, fwd in theirs.items():
        lin.forward = fwd
    with fused_step(model) as counts:
        for lin, fwd in theirs.items():
            assert lin.forward is fwd, "fused_step replaced another library's forward"
        assert _merged_weight(attn0) is None and not hasattr(attn0, "_foldkv_branches")
        # red twin: a plain projection of the next layer is fused_step's inside the block
        assert getattr(attn1.o_proj.forward, "func", None) is _projection_forward
        assert counts["projections"] == len(model.model.layers) * 2 - 1  # every o_proj and down_proj but attn0's
    for lin, fwd in theirs.items():
        assert lin.__dict__.get("forward") is fwd, "fused_step removed another library's forward on exit"
    assert "forward" not in attn1.o_proj.__dict__
    x = torch.randn(1, 1, attn0.o_proj.in_features)
    attn0.o_proj(x)
    assert calls == [attn0.o_proj]
