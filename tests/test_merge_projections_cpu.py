"""Merged projections (`foldkv.fused_step.merge_projections`) on the CPU: a layer's q|k(|v) and gate|up weights laid
out as row blocks of one tensor, the modules' weights its views; what the decode step reads through them
(its merged GEMV, `fused_step._Group`: conftest.merged_linear; the branched attention's q/k/v); and the packed-rows
layout the fused norm reads in place.

The model is the 31B architecture shrunk (6 layers, hidden 128) in float32. A merged weight's views are the same
values at the same shapes, so every forward of the model computes bit for bit what it did (same CPU kernels). The
merged GEMV reduces each output over the same K in another GEMM, so its outputs are held to the float32 GEMV bound
against the separate projections (K * 2^-23 * sum |x w| per element), with a red twin (a weight replaced after the
merge is noticed, and a slice of the wrong rows differs by more than the bound).

Reproduce: pytest tests/test_merge_projections_cpu.py -k merged_linear
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import merged_linear, require_module

SMALL = dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=128, intermediate_size=256)


@pytest.fixture()
def model():
    require_module("transformers")
    from foldkv.lab import gemma31b

    return gemma31b.build_gemma4_31b("cpu", num_layers=6, dtype=torch.float32, **SMALL)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.shape[-1] * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-30


def test_merge_keeps_every_parameter_and_every_forward(model):
    from foldkv import fused_step as fs

    ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert fs.merged_groups(model) == 0
    assert fs.merge_projections(model) == 12  # 6 attentions + 6 MLPs
    assert fs.merged_groups(model) == 12
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert all(isinstance(p, nn.Parameter) for p in after.values())
    # 6 layers: q|k|v (or q|k) -> 1 storage, gate|up -> 1: 18 - 6 (global layers have no v) ... counted exactly:
    attn = fs.branched_attention_modules(model)
    saved = sum(len(fs._attention_names(a)) - 1 for a in attn) + len(fs.mlp_modules(model))
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(storages) - saved
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)
    pointers = [p.data_ptr() for p in model.parameters()]
    assert fs.merge_projections(model) == 12  # idempotent: nothing re-laid
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_split_gives_each_weight_its_own_tensor_again(model):
    from foldkv import fused_step as fs

    storages = len({p.untyped_storage().data_ptr() for p in model.parameters()})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fs.merge_projections(model)
    assert fs.split_projections(model) == 12
    assert fs.merged_groups(model) == 0
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == storages
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(hasattr(m, fs._MERGED) for m in model.modules())
    assert merged_linear(model.model.layers[0].self_attn, torch.ones(1, 128)) is None


@pytest.mark.parametrize("rows", [1, 3])
def test_merged_linear_within_the_gemv_bound_of_the_separate_projections(model, rows):
    from foldkv import fused_step as fs

    fs.merge_projections(model)
    x = torch.randn(rows, 1, 128, generator=torch.Generator().manual_seed(rows))
    for owner in [*fs.branched_attention_modules(model), *fs.mlp_modules(model)]:
        names = owner._foldkv_merged[1]
        outs = merged_linear(owner, x)
        assert len(outs) == len(names)
        for name, y in zip(names, outs):
            w = getattr(owner, name).weight
            ref = x.double() @ w.double().T
            assert y.shape == (rows, 1, w.shape[0])
            assert bool(((y.double() - ref).abs() <= _bound(x, w)).all()), name
        # red twin: the next projection's rows are not this one's (they differ by far more than the bound)
        if len(outs) > 1:
            w0 = getattr(owner, names[0]).weight
            n = min(outs[0].shape[-1], outs[1].shape[-1])
            ref = (x.double() @ w0.double().T)[..., :n]
            assert not bool(((outs[1][..., :n].double() - ref).abs() <= _bound(x, w0)[..., :n]).all())


def test_a_weight_replaced_after_the_merge_is_not_read_through_the_merged_tensor(model):
    from foldkv import fused_step as fs

    fs.merge_projections(model)
    attn = model.model.layers[0].self_attn
    assert merged_linear(attn, torch.ones(1, 128)) is not None
    attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.detach().clone() * 2)
    assert merged_linear(attn, torch.ones(1, 128)) is None  # the step falls back to the module's own weight
    assert fs.merged_groups(model) == 11  # the replaced group no longer counts
    assert fs.merge_projections(model) == 12  # merging again takes the new weight
    outs = merged_linear(attn, torch.ones(1, 128))
    assert outs is not None and torch.allclose(outs[1], attn.k_proj(torch.ones(1, 128)), rtol=0, atol=1e-4)


def test_unmergeable_groups_are_left_as_they_are(model):
    from foldkv import fused_step as fs

    attn = model.model.layers[0].self_attn
    attn.k_proj.bias = nn.Parameter(torch.zeros(attn.k_proj.out_features))  # a bias: not a plain projection
    mlp = model.model.layers[1].mlp
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.detach().double())  # another dtype
    assert fs.merge_projections(model) == 10
    assert not hasattr(attn, fs._MERGED) and not hasattr(mlp, fs._MERGED)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_step_forward_over_the_merged_weights_is_the_models_forward(model, impl):
    """The step's own forward (`StepForward.prefill`, the CPU's formulas: the modules' own) over the merged q|k|v and
    gate|up weights (column slices of one output, read by the norms as strided views), with transformers' cache and
    masks, against the model's own forward unmerged; float32 bound of the projections' reduction order carried
    through: measured here ~1e-6, held at 1e-4 relative. Red twin: the same forward with layer 0's q rows read in
    reverse order is far off."""
    from transformers import DynamicCache

    from foldkv import fused_step as fs
    from foldkv.step_options import StepOptions

    model.config._attn_implementation = impl
    ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        fs.merge_projections(model)
        step = fs.StepForward(model, StepOptions())
        assert step.qkv[0].merged is not None
        got = step.prefill(DynamicCache(config=model.config), ids, None, None, 0).logits
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
        merged, q_rows = step.qkv[0].merged, step.qkv[0].rows[0]
        step.qkv[0].merged = torch.cat([merged[:q_rows].flip(0), merged[q_rows:]])  # red twin
        bad = step.prefill(DynamicCache(config=model.config), ids, None, None, 0).logits
        assert not torch.allclose(bad, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(2, 1, 4, 8), (3, 1, 2, 16), (1, 1, 4, 8)])
def test_packed_rows_reads_a_head_split_slice(shape):
    from foldkv.fused_step_ops import _packed_rows

    b, t, h, d = shape
    full = torch.randn(b, t, 3 * h * d)
    view = full[..., h * d:2 * h * d].view(b, t, h, d)
    inner, outer = _packed_rows(view)
    assert inner == h
    flat = full.reshape(-1)
    rows = torch.stack([flat[(r // h) * outer + (r % h) * d + h * d:][:d] for r in range(b * t * h)])
    assert torch.equal(rows, view.reshape(-1, d))
    # red twins: a transposed view, a column-strided one, leading dims of two strides are not packed rows
    assert _packed_rows(view.transpose(-1, -2)) is None
    assert _packed_rows(full[..., ::2]) is None
    three = torch.randn(b, 3, 3 * h * d)[:, :2, h * d:2 * h * d].unflatten(-1, (h, d))
    assert (_packed_rows(three) is None) == (b > 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_splits_its_merged_groups_into_one_gemm_a_projection_over_views(dtype):
    """`StepOptions.merge_prefill` off: inside a prefill each merged group runs one GEMM a projection over its row block
    of the merged weight (a view of it: nothing copied), the values the merged GEMM's on the CPU (each output column
    is the same dot product over the same K: bitwise here; on CUDA another cuBLAS kernel may reduce in another order).
    Red twin: the split outputs of gate|up handed on in the wrong order is not the same."""
    from transformers import DynamicCache

    from foldkv import fused_step as fs
    from foldkv.lab import gemma31b
    from foldkv.step_options import StepOptions, using

    model = gemma31b.build_gemma4_31b("cpu", num_layers=6, dtype=dtype, **SMALL)
    fs.merge_projections(model)
    step = fs.StepForward(model, StepOptions())
    ids = torch.randint(3, 512, (2, 23), generator=torch.Generator().manual_seed(2))
    storages = {w.untyped_storage().data_ptr() for g in step.qkv + step.gate_up for w in [g.merged]}
    linear, weights = torch.nn.functional.linear, []

    def prefill(merge_prefill: bool):
        weights.clear()
        with torch.no_grad(), using(StepOptions(pdl=False, merge_prefill=merge_prefill)):
            return step.prefill(DynamicCache(config=model.config), ids, None, None, 0).logits

    def recorded(x, weight, bias=None):
        weights.append(weight)
        return linear(x, weight, bias)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.nn.functional, "linear", recorded)
        merged = prefill(True)
        gemms_merged = len(weights)
        split = prefill(False)
        grouped = [w for w in weights if w.untyped_storage().data_ptr() in storages]
    groups = step.qkv + step.gate_up
    assert len(weights) - gemms_merged == sum(len(g.rows) - 1 for g in groups)  # one GEMM a projection
    assert len(grouped) == sum(len(g.rows) for g in groups)
    assert all(w.is_contiguous() for w in grouped)
    assert {w.data_ptr() for w in grouped} == {lin.weight.data_ptr() for g in groups for lin in g.linears}  # views
    assert torch.equal(split, merged)
    call = fs._Group.__call__

    def exchanged(self, x, merged=True):  # red twin: gate and up (blocks of one size) exchanged when split
        out = call(self, x, merged)
        return out[::-1] if not merged and len(set(self.rows)) == 1 else out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(fs._Group, "__call__", exchanged)
        assert not torch.equal(prefill(False), merged)
        assert torch.equal(prefill(True), merged)
