"""The fused sliding attention's dispatch (`foldkv.fused_step`: StepOptions.fuse_sliding, `sliding_attention_modules`,
`sliding_route`, `DecodeStep.sliding_ring`), on the CPU: which modules the swap takes (the sliding layers', not the
global k_eq_v ones), that the swap is put back, and where each attention call of a generate() goes: prefill and eager
decode keep transformers' forward; a decode step of DecodeStep reaches the ring and stops only at "not on CUDA" (the
kernels themselves are tests/test_fused_step_gpu.py's). The model is test_hf_step_cpu's tiny synthetic Gemma 4
(window 8, float32).

Reproduce: pytest tests/test_fused_step_sliding_cpu.py -k route
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_SYNTHETIC, left_padded_batch, tiny_synthetic_model
from foldkv.lab.model import cache_keyword

LENGTHS = (5, 17, 11)
NEW = 4
WINDOW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_synthetic_model(tmp_path_factory, "sliding", sliding_window=WINDOW)


def _sliding_indices(model):
    from foldkv.hf import text_model_of

    return [i for i, t in enumerate(text_model_of(model).config.layer_types) if t == "sliding_attention"]


def test_the_swap_takes_the_sliding_layers_only(model):
    from foldkv import fused_step as fs
    from foldkv.hf import text_model_of

    layers = text_model_of(model).layers
    sliding = _sliding_indices(model)
    assert sliding and len(sliding) < len(layers)
    assert fs.sliding_attention_modules(model) == [layers[i].self_attn for i in sliding]
    with fs.fused_step(model) as n:
        assert n["sliding_attention"] == len(sliding)
        assert all("forward" in vars(layers[i].self_attn) for i in sliding)
        others = [layers[i].self_attn for i in range(len(layers)) if i not in sliding]  # the global forward's
        assert all(("forward" in vars(m)) == (m in fs.global_attention_modules(model)) for m in others)
        assert not any(getattr(vars(m).get("forward"), "func", None) is fs._sliding_forward for m in others)
    assert not any("forward" in vars(layer.self_attn) for layer in layers)  # put back


def test_the_option_turns_the_swap_off(model):
    from foldkv import fused_step as fs
    from foldkv.step_options import StepOptions, using

    off = StepOptions(fuse_sliding=False)
    with fs.fused_step(model, off) as n:
        assert n["sliding_attention"] == 0
        assert fs.sliding_route(fs.sliding_attention_modules(model)[0], {}) == "StepOptions.fuse_sliding is off"
    with using(off):
        assert fs.sliding_route(fs.sliding_attention_modules(model)[0], {}) == "StepOptions.fuse_sliding is off"
    assert fs.sliding_route(fs.sliding_attention_modules(model)[0], {}).startswith("not a ring step")  # served


def test_a_module_the_formula_does_not_describe_is_left_alone(model):
    """Red twin of the selection: a sliding attention whose v_norm has a weight (another formula) is not taken."""
    from foldkv import fused_step as fs

    attn = fs.sliding_attention_modules(model)[0]
    try:
        attn.v_norm.with_scale = True
        attn.v_norm.weight = torch.nn.Parameter(torch.ones(attn.head_dim))
        assert attn not in fs.sliding_attention_modules(model)
    finally:
        attn.v_norm.with_scale = False
        del attn.v_norm.weight
    assert attn in fs.sliding_attention_modules(model)


@pytest.mark.parametrize("decode_step", ["static", "eager"])
def test_route_of_every_sliding_call(model, decode_step):
    """A generate() with every sliding attention's route recorded: the prompt's forward and eager decode steps keep
    transformers' forward (no RingMask); each decode step of the static DecodeStep reaches the layer's ring and stops
    only at "not on CUDA"; the generation is the one without the recording (the swap is inert on the CPU)."""
    from foldkv import fused_step as fs
    from foldkv.hf import FoldKvCache

    ids, mask = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    routes: list[tuple[int, object]] = []
    mods = fs.sliding_attention_modules(model)

    def run(record: bool):
        cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, scatter_seed=5,
                            decode_step=decode_step)
        if record:
            for attn in mods:
                def spy(*args, _attn=attn, **kwargs):
                    routes.append((_attn.layer_idx, fs.sliding_route(_attn, kwargs)))
                    return fs._sliding_forward(_attn, *args, **kwargs)  # the swapped forward itself: inert here
                attn.forward = spy
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 **{cache_keyword(model): cache})
        finally:
            for attn in mods:
                vars(attn).pop("forward", None)
        return out.sequences, torch.stack(out.logits)

    plain = run(False)
    spied = run(True)
    assert torch.equal(plain[0], spied[0]) and torch.equal(plain[1], spied[1])
    per_forward = len(mods)
    assert len(routes) == NEW * per_forward  # the prompt's forward, then NEW - 1 decode steps
    prompt, steps = routes[:per_forward], routes[per_forward:]
    assert all(r.startswith("not a ring step") for _, r in prompt), prompt
    if decode_step == "static":
        assert all(r == "not on CUDA" for _, r in steps), steps
    else:
        assert all(r.startswith("not a ring step") for _, r in steps), steps


def test_the_ring_seam(model):
    """DecodeStep.sliding_ring: None before the step starts and for a global layer; (ring K, ring V, slot) of a
    sliding layer after; None for a subclass that stores sliding rows another way (its update_sliding)."""
    from foldkv.hf import FoldKvCache
    from foldkv.hf_graph import DecodeStep

    ids, mask = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, scatter_seed=5, decode_step="static")
    step = cache.decode_step
    sliding = _sliding_indices(model)
    assert step.sliding_ring(sliding[0]) is None
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                   **{cache_keyword(model): cache})
    step = cache.decode_step
    ring_k, ring_v, slot = step.sliding_ring(sliding[0])
    assert ring_k is step.rings[sliding[0]][0] and ring_v is step.rings[sliding[0]][1] and slot is step.slot
    assert ring_k.shape[2] == WINDOW and ring_k.is_contiguous() and slot.dtype == torch.long
    glob = next(i for i in range(len(cache.layers)) if not cache.is_sliding_layer(i))
    assert step.sliding_ring(glob) is None

    class Other(DecodeStep):
        def update_sliding(self, layer_idx, key, value):
            return super().update_sliding(layer_idx, key, value)

    step.__class__ = Other
    try:
        assert step.sliding_ring(sliding[0]) is None
    finally:
        step.__class__ = DecodeStep


@pytest.mark.parametrize("bad", ["slot_dtype", "ring_shape", "q_width", None])
def test_the_one_launch_prologue_refuses_before_launching(bad):
    """`fused_step_ops.sliding_prologue` asks both checks (`q_rows_args`, `kv_rows_args`) before its one launch: a bad
    input raises FoldKvInputError on any machine and nothing is written (the rings stay poisoned)."""
    from foldkv import fused_step_ops as ops
    from foldkv.validate import FoldKvInputError

    b, hq, hkv, d, w = 2, 4, 2, 16, 8
    q = torch.randn(b, 1, hq * d + (3 if bad == "q_width" else 0), dtype=torch.bfloat16)
    k, v = torch.randn(b, 1, hkv * d, dtype=torch.bfloat16), torch.randn(b, 1, hkv * d, dtype=torch.bfloat16)
    cos, sin = torch.randn(b, 1, d, dtype=torch.bfloat16), torch.randn(b, 1, d, dtype=torch.bfloat16)
    ring_k = torch.full((b, hkv, w, d), float("nan"), dtype=torch.bfloat16)
    ring_v = torch.full((b, hkv, w + (1 if bad == "ring_shape" else 0), d), float("nan"), dtype=torch.bfloat16)
    slot = torch.tensor([3], dtype=torch.int32 if bad == "slot_dtype" else torch.long)
    attn = torch.nn.Module()
    for name in ("q_norm", "k_norm", "v_norm"):
        norm = torch.nn.Module()
        norm.weight, norm.eps = torch.nn.Parameter(torch.ones(d, dtype=torch.bfloat16)), 1e-6
        setattr(attn, name, norm)
    if bad is None:  # red twin of the refusals: good inputs pass both checks (the launch needs a GPU)
        assert ops.q_rows_args(q, attn.q_norm.weight, 1e-6, cos, sin, hq)[0].shape == (b, hq, d)
        assert ops.kv_rows_args(k, v, attn.k_norm.weight, 1e-6, 1e-6, cos, sin, ring_k, ring_v, slot)[0] == b * hkv
        return
    with pytest.raises(FoldKvInputError):
        ops.sliding_prologue(attn, q, k, v, cos, sin, ring_k, ring_v, slot)
    assert bool(ring_k.isnan().all() and ring_v.isnan().all()), "something was written before the refusal"
