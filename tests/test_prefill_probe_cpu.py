"""bench/prefill_probe.py's profile on the CPU: the ranges it opens around a chunk's forward leave the served prefill
in place. The step runs its own forward only for a model on which nothing else has set a forward
(`fused_step.refusal`), so a chunk's range set on the model instance made every "fused" profile time transformers'
forward instead (its glue three times the served one's). Under `components` the step still takes the model, a
generate() opens one chunk range a chunk, and on exit every wrapped class is as it was. Red twin: the wrapping of
the instance the probe did before is refused by the step, so the first check can fail."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import bench_script


@pytest.fixture(scope="module")
def probe():
    return bench_script("prefill_probe")


@pytest.fixture(scope="module")
def model(checkpoint):
    import foldkv.hf  # noqa: F401  (registers "foldkv")
    from foldkv.lab.model import load_model

    return load_model(checkpoint, dtype=torch.float32, attn_implementation="foldkv")


def test_profile_ranges_leave_the_step_its_model(probe, model):
    from foldkv import fused_step
    from foldkv.hf import FoldKvCache, text_model_of
    from foldkv.transformers_compat import cache_keyword

    text_cls = type(text_model_of(model))
    before = (dict(vars(text_cls)), dict(vars(fused_step.StepForward)))
    assert fused_step.refusal(model) is None
    entered: dict = {}
    with probe.components(model, entered):
        assert fused_step.refusal(model) is None
        cache = FoldKvCache(model, max_batch=1, max_tokens=64, attention="reference")
        ids = torch.randint(1, model.config.get_text_config().vocab_size, (1, 13))
        model.generate(ids, **{cache_keyword(model): cache}, max_new_tokens=1, do_sample=False, prefill_chunk_size=8)
    assert entered.get("model", 0) + entered.get("step", 0) >= 2  # two chunks of 8: a range each
    assert (dict(vars(text_cls)), dict(vars(fused_step.StepForward))) == before
    assert "forward" not in vars(text_model_of(model))


def test_red_twin_a_forward_set_on_the_instance_is_refused(model):
    from foldkv import fused_step
    from foldkv.hf import text_model_of

    text = text_model_of(model)
    fwd = text.forward
    text.forward = functools.wraps(fwd)(lambda *a, **k: fwd(*a, **k))  # the probe's old chunk range
    try:
        assert fused_step.refusal(model) is not None
    finally:
        del text.forward
    assert fused_step.refusal(model) is None
