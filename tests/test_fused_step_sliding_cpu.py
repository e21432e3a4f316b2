"""The decode step's own forward and where it sends each layer's attention (`foldkv.fused_step`: `refusal`,
`StepForward.route`, StepOptions.fuse_sliding, `DecodeStep.sliding_ring`), on the CPU: which models it describes (the
tiny synthetic Gemma 4; not one whose sliding v_norm has a weight), that it replaces nothing on the model, and where
each attention call of a generate() goes: a decode step of DecodeStep reaches the sliding layers' rings and stops only
at "not on CUDA" (the kernels themselves are tests/test_fused_step_gpu.py's); with the option off it says so. The
model is test_hf_step_cpu's tiny synthetic Gemma 4 (window 8, float32).

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


def test_the_step_forward_describes_the_model_and_replaces_nothing(model):
    from foldkv import fused_step as fs
    from foldkv.step_options import StepOptions

    assert fs.refusal(model) is None
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    forward = fs.StepForward(model, StepOptions())
    assert len(forward.layers) == len(model.model.layers) and forward.lm_head.weight is model.lm_head.weight
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before  # no forward on an instance


def test_a_model_the_formula_does_not_describe_runs_its_own_forward(model):
    """Red twin of the description: a sliding attention whose v_norm has a weight (another formula) is refused by
    name, and the step's forward is not built for it."""
    from foldkv import FoldKvInputError
    from foldkv import fused_step as fs
    from foldkv.step_options import StepOptions

    i = _sliding_indices(model)[0]
    attn = model.model.layers[i].self_attn
    try:
        attn.v_norm.with_scale = True
        attn.v_norm.weight = torch.nn.Parameter(torch.ones(attn.head_dim))
        assert fs.refusal(model).startswith(f"layer {i}: its attention's norms")
        with pytest.raises(FoldKvInputError, match="does not describe"):
            fs.StepForward(model, StepOptions())
    finally:
        attn.v_norm.with_scale = False
        del attn.v_norm.weight
    assert fs.refusal(model) is None


def _generate(model, decode_step, routes=None, monkeypatch=None, options=None):
    from foldkv import fused_step as fs
    from foldkv.hf import FoldKvCache

    if routes is not None:
        own = fs.StepForward.route

        def spy(attn, x, mask, step):
            route = own(attn, x, mask, step)
            routes.append((attn.layer_idx, route))
            return route

        monkeypatch.setattr(fs.StepForward, "route", staticmethod(spy))
    ids, mask = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, scatter_seed=5, decode_step=decode_step,
                        step_options=options)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("decode_step", ["static", "eager"])
def test_route_of_every_attention_call(model, decode_step, monkeypatch):
    """A generate() with every layer's route recorded: the prompt's forward is the model's own on the CPU (the fused
    prefill is CUDA's), each decode step of the static DecodeStep runs the step's forward, whose sliding layers
    reach their ring and stop only at "not on CUDA" and global layers at the reference attention's (no workspace on the
    CPU: tests/test_global_step_cpu.py holds the global route to "not CUDA"); an eager cache
    has no step (no route); the generation is the one without the recording."""
    plain = _generate(model, decode_step)
    routes: list[tuple[int, object]] = []
    spied = _generate(model, decode_step, routes, monkeypatch)
    assert torch.equal(plain[0], spied[0]) and torch.equal(plain[1], spied[1])
    if decode_step == "eager":
        assert routes == []
        return
    sliding = set(_sliding_indices(model))
    assert len(routes) == (NEW - 1) * len(model.model.layers)
    assert all(r == "not on CUDA" for i, r in routes if i in sliding), routes
    assert all(r.startswith("no foldkv DecodeWorkspace") for i, r in routes if i not in sliding), routes  # reference


def test_the_option_turns_the_fused_attention_off(model, monkeypatch):
    from foldkv.step_options import StepOptions

    routes: list[tuple[int, object]] = []
    _generate(model, "static", routes, monkeypatch, StepOptions(fuse_sliding=False, fuse_global_prologue=False))
    sliding = set(_sliding_indices(model))
    assert routes and all(r == ("StepOptions.fuse_sliding is off" if i in sliding else
                                "StepOptions.fuse_global_prologue is off") for i, r in routes), routes


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
