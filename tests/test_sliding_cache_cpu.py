"""A FoldKvCache's sliding layers through the shared scratch (`foldkv.sliding_cache`, `StepOptions.sliding_scratch`),
on the CPU.

The layer: `ScratchSlidingLayer.update` against transformers' `DynamicSlidingWindowLayer` fed the same chunks, bitwise:
the returned states, the kept window, `cumulative_length` and `get_mask_sizes`, over chunk sequences (the first chunk,
chunks shorter and longer than the window, one of exactly W - 1 and W rows), at batch 1 with the rows placed in the
scratch as the step's kernels place them (`chunk_rows`) and copied there once (the option in force), and at batch 3
(copied: no packed place exists). The returned states are the scratch's rows (nothing concatenated) and the window a
tensor of the layer's own (no view of the scratch, whose next layer overwrites it); without the option and without
placed rows the update is transformers' own. Red twin: a copy-back one row off fails the same check.
The model: greedy tokens and the prefill's logits of the tiny synthetic Gemma 4 (float32, window 8) with the option on
equal those with it off, through generate() (transformers' forward on the CPU, a left-padded batch, a chunked prefill,
the eager decode and the fixed-address "static" step, whose rings start from the layers' windows) and through the
step's own forward (`StepForward.prefill`, whose hook asks the layer for the places: the CPU's formulas write their own
tensors, so the update copies them). The ops' `out=` refuses a place that is not packed before any launch.

Reproduce: pytest tests/test_sliding_cache_cpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_SYNTHETIC, left_padded_batch, require_module, tiny_synthetic_model
from foldkv.step_options import StepOptions, using
from foldkv.validate import FoldKvInputError

require_module("transformers")

from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from foldkv.sliding_cache import ScratchSlidingLayer, SlidingScratch  # noqa: E402

WINDOW = 8
HEADS, DIM = 2, 4
SCRATCH = StepOptions(sliding_scratch=True)
CHUNKS = {
    "first": (5,),
    "shorter": (3, 2, 1, 4),
    "longer": (20, 3, 11),
    "window_edges": (WINDOW - 1, WINDOW, 1, WINDOW - 1),
    "one_at_a_time": (1,) * 10,
}


def _rows(g, batch, t):
    """K or V rows as the step's forward makes them: [B, T, H, D] packed, handed on as [B, H, T, D] transposes."""
    return torch.randn(batch, t, HEADS, DIM, generator=g)


def _written(place: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`rows` written into `place` as the step's kernels write it: their packed output (`fused_step_ops._destination`,
    [rows, D]) viewed back as [B, T, H, D], whose size-1 batch gets a stride of its own, not the scratch's."""
    from foldkv.fused_step_ops import _destination

    out = _destination(place, (rows.numel() // rows.shape[-1], rows.shape[-1]), rows)
    return out.copy_(rows.reshape(out.shape)).view(rows.shape)


def test_a_kernels_output_in_its_place_is_recognised_as_placed():
    """At batch 1 the kernels' output viewed back has another batch stride than the scratch's rows (the case a
    comparison of every stride missed: it then copied the rows onto themselves)."""
    from foldkv.sliding_cache import _is_view_of

    scratch = SlidingScratch(WINDOW)
    k_at, _ = scratch.chunk(1, 5, HEADS, DIM, torch.float32, "cpu")
    rows = _written(k_at, torch.randn(1, 5, HEADS, DIM)).transpose(1, 2)
    assert rows.stride() != k_at.transpose(1, 2).stride()  # (the case is the one that needs the rule)
    assert _is_view_of(rows, k_at)
    _, later = scratch.tensors(1, 6, HEADS, DIM, torch.float32, "cpu")[0], scratch.k[:, WINDOW:WINDOW + 5]
    assert not _is_view_of(rows, later)  # red twin: the place one row later


def mismatch(layer_class, chunks, batch, placed, seed=0) -> str | None:
    """The check: `layer_class` and transformers' layer fed the same chunks; None when every chunk's returned states,
    kept window, count and mask sizes are bitwise transformers', else what differs first. `placed`: the rows written
    into the scratch's places (`chunk_rows`) before `update`, else handed as their own tensors with the option in
    force."""
    g = torch.Generator().manual_seed(seed)
    scratch = SlidingScratch(WINDOW)
    ours, theirs = layer_class(WINDOW, scratch), DynamicSlidingWindowLayer(sliding_window=WINDOW)
    for i, t in enumerate(chunks):
        k, v = _rows(g, batch, t), _rows(g, batch, t)
        want = theirs.update(k.transpose(1, 2), v.transpose(1, 2))
        if placed:
            k_at, v_at = ours.chunk_rows(batch, t, HEADS, DIM, k.dtype, k.device)
            k_in, v_in = _written(k_at, k), _written(v_at, v)
            got = ours.update(k_in.transpose(1, 2), v_in.transpose(1, 2))
        else:
            with using(SCRATCH):
                got = ours.update(k.transpose(1, 2), v.transpose(1, 2))
        for name, a, b in (("keys returned", got[0], want[0]), ("values returned", got[1], want[1]),
                           ("kept keys", ours.keys, theirs.keys), ("kept values", ours.values, theirs.values)):
            if a.shape != b.shape or not torch.equal(a, b):
                return f"chunk {i} ({t} rows): {name} differ ({tuple(a.shape)} against {tuple(b.shape)})"
        if (ours.cumulative_length, ours.get_mask_sizes(3)) != (theirs.cumulative_length, theirs.get_mask_sizes(3)):
            return f"chunk {i}: count or mask sizes differ"
        storage = scratch.k.untyped_storage().data_ptr()
        if got[0].untyped_storage().data_ptr() != storage:
            return f"chunk {i}: the returned keys are not the scratch's rows"
        if ours.keys.untyped_storage().data_ptr() == storage:
            return f"chunk {i}: the kept window is a view of the scratch"
    if (ours.placed, ours.copied) != ((len(chunks), 0) if placed else (0, len(chunks))):
        return f"placed {ours.placed}, copied {ours.copied} of {len(chunks)} chunks"
    return None


class OneRowOff(ScratchSlidingLayer):
    """Red twin: the window copied back from one row before the chunk's end."""

    @staticmethod
    def _kept(sk, sv, end, kept):
        return ScratchSlidingLayer._kept(sk, sv, end - 1, kept)


@pytest.mark.parametrize("chunks", list(CHUNKS.values()), ids=list(CHUNKS))
@pytest.mark.parametrize("batch,placed", [(1, True), (1, False), (3, False)], ids=["placed", "copied", "batch3"])
def test_the_scratch_update_is_transformers_update(chunks, batch, placed):
    assert mismatch(ScratchSlidingLayer, chunks, batch, placed) is None


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "copied"])
def test_a_copy_back_one_row_off_is_caught(placed):
    why = mismatch(OneRowOff, CHUNKS["longer"], 1, placed)
    assert why is not None and "kept" in why, why


def test_batch_above_one_gets_no_place_and_the_option_off_is_transformers_update():
    scratch = SlidingScratch(WINDOW)
    layer = ScratchSlidingLayer(WINDOW, scratch)
    assert layer.chunk_rows(3, 5, HEADS, DIM, torch.float32, torch.device("cpu")) == (None, None)
    k = torch.randn(1, HEADS, 5, DIM)
    with using(StepOptions(sliding_scratch=False)):
        full, _ = layer.update(k, k.clone())  # no place filled, the option off: transformers' cat
    assert (layer.placed, layer.copied) == (0, 0) and scratch.k is None and full.is_contiguous()


def test_reset_drops_the_window_and_the_next_chunk_starts_anew():
    scratch = SlidingScratch(WINDOW)
    layer = ScratchSlidingLayer(WINDOW, scratch)
    with using(SCRATCH):
        layer.update(torch.randn(1, HEADS, 12, DIM), torch.randn(1, HEADS, 12, DIM))
    layer.reset()
    assert layer.keys is None and layer.cumulative_length == 0 and not layer.is_initialized
    k = torch.randn(1, HEADS, 3, DIM)
    with using(SCRATCH):
        full, _ = layer.update(k, k.clone())
    assert torch.equal(full, k) and layer.cumulative_length == 3


def test_an_out_that_is_not_packed_is_refused_before_any_launch():
    from foldkv import fused_step_ops as ops

    x = torch.randn(2, 5, HEADS, DIM)
    scratch = torch.empty(2, WINDOW - 1 + 5, HEADS, DIM)
    with pytest.raises(FoldKvInputError, match="packed"):  # batch-strided rows of a batch > 1
        ops.rms_norm(x, None, 1e-6, out=scratch[:, WINDOW - 1:])
    with pytest.raises(FoldKvInputError, match="packed"):
        ops.rope(x, torch.ones(2, 5, DIM), torch.zeros(2, 5, DIM), out=torch.empty(2, 5, HEADS, DIM + 1))


# --- the model -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_synthetic_model(tmp_path_factory, "sliding_scratch", sliding_window=WINDOW)


def _generate(model, lengths, decode_step, chunk):
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    ids, mask = left_padded_batch(lengths, TINY_SYNTHETIC["vocab_size"], seed=7)
    cache = FoldKvCache(model, max_batch=len(lengths), max_tokens=ids.shape[1] + 8, scatter_seed=5,
                        decode_step=decode_step)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         prefill_chunk_size=chunk, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    copied = sum(getattr(layer, "copied", 0) for layer in cache.layers)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits), copied


@pytest.mark.parametrize("lengths", [(23,), (5, 23, 11)])
@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_generate_with_the_scratch_gives_the_same_tokens(model, lengths, decode_step):
    with using(StepOptions(sliding_scratch=False)):
        tokens, logits, copied = _generate(model, lengths, decode_step, chunk=6)
    assert copied == 0  # the option off: transformers' update
    with using(SCRATCH):
        on_tokens, on_logits, on_copied = _generate(model, lengths, decode_step, chunk=6)
    assert on_copied >= -(-max(lengths) // 6)  # every prefill chunk of every sliding layer through the scratch
    assert torch.equal(on_tokens, tokens)
    assert torch.equal(on_logits, logits)


def test_the_steps_prefill_asks_the_layers_for_their_places(model, monkeypatch):
    """The step's own forward over a FoldKvCache with the option on: its hook asks each sliding layer for the
    chunk's places (`chunk_rows`), the CPU's formulas write their own tensors, the update copies them; the logits
    and the kept windows equal the option off's."""
    from foldkv import fused_step
    from foldkv.hf import FoldKvCache

    asked = []
    chunk_rows = ScratchSlidingLayer.chunk_rows
    monkeypatch.setattr(ScratchSlidingLayer, "chunk_rows", lambda self, *a: asked.append(a) or chunk_rows(self, *a))
    ids = left_padded_batch((21,), TINY_SYNTHETIC["vocab_size"], seed=9)[0]
    runs = {}
    for on in (False, True):
        options = StepOptions(sliding_scratch=on)
        cache = FoldKvCache(model, max_batch=1, max_tokens=32, decode_step="eager", step_options=options)
        forward = fused_step.StepForward(model, options)
        with using(options):
            logits = [forward.prefill(cache, ids[:, a:a + 6], None, None, 0).logits for a in range(0, 21, 6)]
        runs[on] = (torch.cat(logits, 1), [(layer.keys, layer.copied) for layer in cache.layers
                                           if isinstance(layer, ScratchSlidingLayer)])
    sliding = len(runs[True][1])
    assert sliding and len(asked) == 4 * sliding  # 4 chunks, each sliding layer asked once a chunk
    assert torch.equal(runs[True][0], runs[False][0])
    for (on_keys, on_copied), (off_keys, off_copied) in zip(runs[True][1], runs[False][1]):
        assert torch.equal(on_keys, off_keys) and (on_copied, off_copied) == (4, 0)


def test_the_first_update_copies_nothing_from_the_host(monkeypatch):
    """A layer's first update of a prompt makes its window-size tensor on the device with no `.to` (a copy from
    pageable memory waits for the stream: 50 waits in a 31B prompt's first chunk), with transformers' values; red
    twin: transformers' own layer copies it with `.to`."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    calls = []
    real = torch.Tensor.to

    def recording(self, *args, **kwargs):
        calls.append((tuple(self.shape), args, kwargs))
        return real(self, *args, **kwargs)

    k = torch.randn(1, 2, 5, 4)
    ours, theirs = ScratchSlidingLayer(8, SlidingScratch(8)), DynamicSlidingWindowLayer(sliding_window=8)
    monkeypatch.setattr(torch.Tensor, "to", recording)
    ours.lazy_initialization(k, k)
    assert calls == []
    theirs.lazy_initialization(k, k)
    assert calls  # the red twin
    monkeypatch.undo()
    for name in ("keys", "values", "_sliding_window_tensor"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert torch.equal(a, b) and a.dtype == b.dtype and a.device == b.device, name
    assert ours.is_initialized and ours.device == theirs.device
