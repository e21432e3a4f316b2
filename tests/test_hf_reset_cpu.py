"""A FoldKvCache passed to a second generate(), on the CPU: refused with what it holds while it still holds the first
one's tokens (before anything is written), and served again after `cache.reset()` exactly as a fresh cache serves it.

The model is test_hf_step_cpu's tiny synthetic Gemma 4 (sliding window 8, float32, float64 reference attention). A
reset cache gives the greedy tokens of a fresh cache, for folded and split pools, through the eager layers and the
fixed-address decode step ("static", what the CUDA graph records): the same decode step object, the same fixed tensors
when the second batch has the first one's shape, the pools' page ownership unchanged. Red twins: a reset that keeps
the global layers' lengths, or the sliding layers' columns, changes the tokens, and the same check reports it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_SYNTHETIC, left_padded_batch, tiny_synthetic_model
from foldkv.lab.model import cache_keyword

FIRST = (5, 17, 11)  # the first generate()'s prompts (real tokens, left-padded to the longest)
SAME_SHAPE = (9, 3, 17)  # a second batch of the first one's shape: the decode step's fixed tensors are refilled
OTHER_SHAPE = (12, 6)  # a second batch of another shape: the decode step makes its tensors anew
NEW = 8
WINDOW = 8
MAX_TOKENS = 2 * (max(FIRST) + NEW)  # room for a reset that forgets the lengths to run (its twin) rather than overflow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_synthetic_model(tmp_path_factory, "reset", sliding_window=WINDOW)


def _batch(lengths, seed):
    return left_padded_batch(lengths, TINY_SYNTHETIC["vocab_size"], seed=seed)


def _cache(model, fmt, decode_step):
    from foldkv.hf import FoldKvCache

    return FoldKvCache(model, max_batch=4, max_tokens=MAX_TOKENS, kv_format=fmt, scatter_seed=5,
                       decode_step=decode_step)


def _generate(model, batch, cache):
    ids, mask = batch
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         **{cache_keyword(model): cache})
    return out[:, ids.shape[1]:]


def _ownership(cache):
    """Each global layer's page -> holder map and free-page count."""
    return [(layer.pool.ownership(), layer.pool.free_pages) for layer in cache.global_layers]


_FRESH: dict = {}


def served_as_fresh(model, cache, batch, fmt) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """The check: `batch`'s greedy tokens on `cache` (used, then reset) against a fresh cache's (an eager one, made
    once per batch and format: test_hf_step_cpu holds the static step to it). Returns (equal, the used cache's
    tokens, the fresh cache's)."""
    got = _generate(model, batch, cache)
    key = (fmt, batch[0].shape, batch[0].sum().item())
    if key not in _FRESH:
        _FRESH[key] = _generate(model, batch, _cache(model, fmt, "eager"))
    return torch.equal(got, _FRESH[key]), got, _FRESH[key]


def _fixed(step):
    """The decode step's fixed tensors a captured graph reads (a sample: ids, lengths, mask, one ring)."""
    return None if step is None else (step.ids, step.dev_lens, step.mask, *next(iter(step.rings.values())))


@pytest.mark.parametrize("decode_step", ["eager", "static"])
@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_a_reset_cache_serves_a_second_generate_as_a_fresh_one(model, fmt, decode_step):
    """One cache: a first generate(), reset(), a second batch of the same shape (the decode step refills its fixed
    tensors in place), reset(), a batch of another shape (the step makes them anew)."""
    cache = _cache(model, fmt, decode_step)
    owned = _ownership(cache)
    step = cache.decode_step
    _generate(model, _batch(FIRST, 1), cache)
    for second in (SAME_SHAPE, OTHER_SHAPE):
        fixed = _fixed(step)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.batch is None
        assert all(layer.lengths == [0] * 4 and not layer.host_table.seq_lens.any() for layer in cache.global_layers)
        assert all(layer.get_seq_length() == 0 for layer in cache.layers)  # the sliding layers hold nothing
        assert _ownership(cache) == owned  # every page still the cache's table's: none lost, none held twice
        assert cache.decode_step is step  # the decode step is kept, not made anew
        equal, got, want = served_as_fresh(model, cache, _batch(second, 2), fmt)
        assert equal, f"a reset cache's tokens\n{got}\na fresh cache's\n{want}"
        assert _ownership(cache) == owned and cache.decode_step is step
        if step is not None:
            assert step.steps == NEW - 1
            same = [a is b for a, b in zip(fixed, _fixed(step))]
            assert same == [second == SAME_SHAPE] * len(same)  # refilled in place for a batch of the same shape


@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_a_used_cache_is_refused_naming_what_it_holds(model, decode_step):
    """A second generate() without reset(): refused by the tokens the cache holds, nothing written, the pages the same;
    a prompt no longer than what it holds too (generate() would feed it no column)."""
    from foldkv import FoldKvInputError

    cache = _cache(model, "folded", decode_step)
    _generate(model, _batch(FIRST, 1), cache)
    held = cache.get_seq_length()
    assert held == max(FIRST) + NEW - 1
    before = [layer.pool.data.clone() for layer in cache.global_layers]
    owned, lengths = _ownership(cache), [list(layer.lengths) for layer in cache.global_layers]
    for batch in (_batch(SAME_SHAPE, 2), _batch((3, 2), 2)):
        with pytest.raises(FoldKvInputError, match=rf"this FoldKvCache holds {held} tokens a sequence .*from an"
                                                   r" earlier generate\(\); call cache.reset\(\) or make a new one"):
            _generate(model, batch, cache)
    assert all(torch.equal(a.nan_to_num(7.0), layer.pool.data.nan_to_num(7.0))
               for a, layer in zip(before, cache.global_layers))
    assert _ownership(cache) == owned and [layer.lengths for layer in cache.global_layers] == lengths


def _reset_keeping_lengths(cache, reset):
    """Red twin: a reset that forgets the global layers' lengths (they stay the first generate()'s)."""
    kept = [(list(layer.lengths), layer.host_table.seq_lens.clone()) for layer in cache.global_layers]
    reset(cache)
    for layer, (lengths, seq_lens) in zip(cache.global_layers, kept):
        layer.lengths = lengths
        layer.host_table.seq_lens.copy_(seq_lens)


def _reset_keeping_sliding(cache, reset):
    """Red twin: a reset that leaves the sliding layers as they are (their columns, their count)."""
    kept = {i: layer for i, layer in enumerate(cache.layers) if cache.is_sliding_layer(i)}
    reset(cache)
    for i, layer in kept.items():
        cache.layers[i] = layer


# (a static step after a reset that keeps the sliding layers fails in transformers' mask: their count is the old one)
@pytest.mark.parametrize("decode_step,broken", [("eager", _reset_keeping_lengths), ("static", _reset_keeping_lengths),
                                                ("eager", _reset_keeping_sliding)],
                         ids=["eager-keeps-lengths", "static-keeps-lengths", "eager-keeps-sliding"])
def test_a_reset_that_forgets_a_part_changes_the_tokens(model, decode_step, broken, monkeypatch):
    from foldkv.hf import FoldKvCache

    cache = _cache(model, "folded", decode_step)
    _generate(model, _batch(FIRST, 1), cache)
    reset = FoldKvCache.reset
    monkeypatch.setattr(FoldKvCache, "reset", lambda c: broken(c, reset))
    cache.reset()
    equal, got, want = served_as_fresh(model, cache, _batch(SAME_SHAPE, 2), "folded")
    assert not equal, f"{broken.__name__}: the tokens did not change"
