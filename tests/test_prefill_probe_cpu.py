"""bench/prefill_probe.py on the CPU.

- Its cells: ARM:PROMPT[:BATCH[:CHUNK]][@FIELD=0|1,...], the step options after @ an arm of their own in the ttft
  rotation (its label) and a valid `StepOptions` over the served ones. Red twins: a field StepOptions does not have,
  and a value other than 0 or 1, are refused before any model is built.
- Its profile: the ranges it opens around a chunk's forward leave the served prefill in place. The step runs its own
  forward only for a model on which nothing else has set a forward (`fused_step.refusal`), so a chunk's range set on
  the model instance made every "fused" profile time transformers' forward instead (its glue three times the served
  one's). Under `components` the step still takes the model, a generate() opens one chunk range a chunk, and on exit
  every wrapped class is as it was. Red twin: the wrapping of the instance the probe did before is refused by the
  step, so the first check can fail.

Reproduce: pytest tests/test_prefill_probe_cpu.py
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import pytest
import torch

from conftest import bench_script
from foldkv.step_options import StepOptions


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


def test_a_cell_with_step_options_is_an_arm_of_its_own():
    probe = bench_script("prefill_probe")
    plain = probe._cell("foldkv-folded:32768", 4096)
    assert plain == {"arm": "foldkv-folded", "prompt": 32768, "batch": 1, "chunk": 4096, "options": {},
                     "label": "foldkv-folded"}
    ab = probe._cell("foldkv-folded:32768:2:8192@merge_prefill=0,fuse_prefill_norm_rope=1", 4096)
    assert (ab["arm"], ab["prompt"], ab["batch"], ab["chunk"]) == ("foldkv-folded", 32768, 2, 8192)
    assert ab["options"] == {"merge_prefill": False, "fuse_prefill_norm_rope": True}
    assert ab["label"] == "foldkv-folded@merge_prefill=0,fuse_prefill_norm_rope=1" != plain["label"]
    assert dataclasses.replace(StepOptions(), **ab["options"]).merge_prefill is False


@pytest.mark.parametrize("bad", ["foldkv-folded:4096@merge_prefil=0", "foldkv-folded:4096@merge_prefill=2",
                                 "foldkv-folded:4096@merge_prefill"])
def test_a_cell_with_an_unknown_option_or_value_is_refused(bad):
    probe = bench_script("prefill_probe")
    with pytest.raises(argparse.ArgumentTypeError, match="StepOptions field"):
        probe._cell(bad, 4096)
