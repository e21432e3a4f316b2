"""A sliding layer's prologue in one launch (`fused_step_ops.sliding_prologue`, its kernel
`fused_step_kernels.sliding_prologue_rows`) on the GPU, against the library's two launches (`q_norm_rope` then
`kv_to_ring`: conftest.two_launch_prologue), then in the whole step.

Bounds: the one kernel runs the two kernels' own row bodies (`fused_step_kernels._q_row`, `_kv_row`), so its outputs
are bitwise theirs: the query rows, the rings' slot, every other slot unchanged (the slot poisoned with NaN first),
with PDL as without; in the synthetic model's graph generate() the greedy tokens and logits are torch.equal with the
one launch and with the two. Red twin: the grid holding the query rows only (the rings' slot never written), in a
kernel test and in the whole step.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_sliding_prologue_gpu.py -k "31b and 8"
"""

from __future__ import annotations

import pytest
import torch

from conftest import attention_norms, graph_generate, require_module, synthetic_gpu_models, two_launch_prologue

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
GEOMETRIES = {"31b": (32, 16, 256, 1024), "synthetic": (32, 4, 32, 128)}  # Hq, Hkv, head_dim, window


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_one_launch_is_the_two_launches(batch, geometry, pdl, monkeypatch):
    require_module("triton")
    from foldkv import fused_step_ops as ops, gemv

    monkeypatch.setattr(gemv, "PDL_GEMV", pdl)  # pdl_kw: both sides launched alike
    hq, hkv, d, window = GEOMETRIES[geometry]
    g = _gen(batch)
    rms = torch.exp(torch.randn(batch, 1, 1, generator=g, device="cuda"))
    full = (torch.randn(batch, 1, (hq + 2 * hkv) * d, generator=g, device="cuda") * rms).to(BF16)
    q, k, v = full.split([hq * d, hkv * d, hkv * d], dim=-1)
    ang = torch.rand(batch, 1, d, generator=g, device="cuda") * 40.0
    cos, sin = ang.cos().to(BF16), ang.sin().to(BF16)
    attn = attention_norms(d, "cuda")
    slot = torch.tensor([(37 * batch + 5) % window], device="cuda")

    def rings():
        r = torch.randn(2, batch, hkv, window, d, generator=_gen(50 + batch), device="cuda").to(BF16)
        r[:, :, :, slot.item()] = float("nan")  # the slot to write: poisoned
        return r[0], r[1]

    want_k, want_v = rings()
    want_q = two_launch_prologue(attn, q, k, v, cos, sin, want_k, want_v, slot)
    got_k, got_v = rings()
    got_q = ops.sliding_prologue(attn, q, k, v, cos, sin, got_k, got_v, slot)
    assert bool(torch.isfinite(got_q).all() and torch.isfinite(got_k).all() and torch.isfinite(got_v).all())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    twin_k, twin_v = rings()  # red twin: the KV rows left out of the grid
    ops.sliding_prologue(attn, q, k, v, cos, sin, twin_k, twin_v, slot, _red_skip_kv=True)
    assert not torch.equal(twin_k, want_k)


LENGTHS = (97, 300, 1000)  # the synthetic model's rings of 128 slots: partly filled, wrapped
NEW = 12


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


def _generate(model):
    return graph_generate(model, LENGTHS, NEW)


def test_the_step_with_the_one_launch_prologue(synthetic_model, monkeypatch):
    from foldkv import fused_step, fused_step_ops as ops
    from foldkv.fused_step import sliding_attention_modules

    calls = []
    own = ops.sliding_prologue
    monkeypatch.setattr(fused_step, "sliding_prologue", lambda *a, **kw: calls.append(1) or own(*a, **kw))
    one = _generate(synthetic_model)
    layers = len(sliding_attention_modules(synthetic_model))
    assert layers and len(calls) >= layers and len(calls) % layers == 0, calls  # every sliding layer's step
    monkeypatch.setattr(fused_step, "sliding_prologue", two_launch_prologue)
    two = _generate(synthetic_model)
    assert bool(torch.isfinite(one[1]).all())
    assert torch.equal(one[0], two[0]), "greedy tokens differ"
    assert torch.equal(one[1], two[1]), f"logits differ (max |gap| {(one[1] - two[1]).abs().max().item():.3g})"
    # red twin: the step's K/V rows never reach the rings
    monkeypatch.setattr(fused_step, "sliding_prologue", lambda *a, **kw: own(*a, _red_skip_kv=True, **kw))
    twin = _generate(synthetic_model)
    assert not torch.equal(twin[1], two[1]), "rings never written changed nothing"
