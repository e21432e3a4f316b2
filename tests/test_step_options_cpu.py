"""The decode step's options (`foldkv.step_options.StepOptions`) on the CPU: the served defaults, frozen; in force only
inside `using` (nested blocks restore what was before, an exception too); a FoldKvCache takes those in force where it
is made, or the ones passed, and hands them to its DecodeStep, which puts them in force while its forward runs; what
is not a StepOptions is refused before any pool is made. Red twins: a refusal of a plain dict, and a removed module
switch that says where it went rather than being set silently through monkeypatch.

Reproduce: pytest tests/test_step_options_cpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY_SYNTHETIC, left_padded_batch, tiny_synthetic_model
from foldkv.step_options import SERVED, StepOptions, in_force, using
from foldkv.validate import FoldKvInputError


OFF_UNTIL_MEASURED: set[str] = set()  # a served path changes only on a measured gain: a new choice starts here


def test_the_served_options_are_every_choice_on_but_the_unmeasured_and_frozen():
    assert SERVED == StepOptions()
    assert {f.name for f in dataclasses.fields(StepOptions) if getattr(SERVED, f.name) is not True} == OFF_UNTIL_MEASURED
    with pytest.raises(dataclasses.FrozenInstanceError):
        SERVED.merge = False  # type: ignore[misc]
    assert in_force() is SERVED


def test_using_scopes_the_options_and_restores_them():
    off = StepOptions(pdl=False)
    with using(off):
        assert in_force() is off
        with using(StepOptions(merge=False)) as inner:
            assert in_force() is inner
        assert in_force() is off
    assert in_force() is SERVED
    with pytest.raises(RuntimeError), using(off):
        raise RuntimeError("inside")
    assert in_force() is SERVED
    with pytest.raises(FoldKvInputError, match="StepOptions"), using({"pdl": False}):  # red twin: not the object
        pass
    assert in_force() is SERVED


@pytest.mark.parametrize("module,name", [("fused_step", "MERGE"), ("fused_step", "FUSE_SLIDING"),
                                         ("global_step", "FUSE_GLOBAL"), ("gemv", "PDL_GEMV")])
def test_a_removed_switch_says_where_it_went(module, name, monkeypatch):
    import importlib

    mod = importlib.import_module(f"foldkv.{module}")
    with pytest.raises(AttributeError, match="StepOptions"):
        getattr(mod, name)
    with pytest.raises(AttributeError):  # monkeypatch finds nothing to flip
        monkeypatch.setattr(mod, name, False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_synthetic_model(tmp_path_factory, "options", sliding_window=8)


def test_the_cache_hands_its_options_to_the_step_and_the_step_puts_them_in_force(model, monkeypatch):
    from foldkv import fused_step as fs
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    def cache(**kw):
        return FoldKvCache(model, max_batch=3, max_tokens=24, scatter_seed=5, decode_step="static", **kw)

    assert cache().decode_step.options == SERVED
    off = StepOptions(fuse_sliding=False, tail_sums=False)
    assert cache(step_options=off).decode_step.options is off
    with using(off):  # made inside a block: the options in force there
        made = cache()
    assert made.step_options is off and made.decode_step.options is off
    with pytest.raises(FoldKvInputError, match="StepOptions"):  # red twin: refused before any pool
        cache(step_options={"merge": False})
    seen = []
    route = fs.StepForward.route
    monkeypatch.setattr(fs.StepForward, "route", staticmethod(lambda *a: seen.append(in_force()) or route(*a)))
    ids, mask = left_padded_batch((5, 9, 7), TINY_SYNTHETIC["vocab_size"])
    kw = {cache_keyword(model): made}
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, **kw)
    assert seen and set(seen) == {off}  # every layer of the decode steps (the CPU's prompt is the model's forward)
    assert in_force() is SERVED
