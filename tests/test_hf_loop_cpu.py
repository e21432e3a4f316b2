"""generate()'s thin decoding loop (`foldkv.hf_loop.decode_loop`, made generate()'s decoding method by
`hf_loop.install` for a FoldKvCache with a decode step) against transformers' own loop (`GenerationMixin._sample`), on
the CPU with decode_step="static": the same tokens (greedy, sampling, EOS with the padding after it), the thin path
taking every decode step after the capturing one (counted exactly: the step's `loop_steps`), and every call it does
not cover (beams, a dict of outputs, a streamer, stop strings with their tokenizer) left to transformers.

The model is test_hf_step_cpu's tiny synthetic Gemma 4 (sliding window 8: the rings wrap over a prompt of 17 and 12 new
tokens), float32, prompts left-padded (3 lengths) or one unpadded prompt, prefilled whole or in chunks of 4 (17 = 4 x 4
+ 1: the last chunk, one column, is the capturing step). "Loop off" is the same generate() with `hf_loop.applies`
answering False (transformers' `_sample` runs, as without the loop); the tokens must also equal the eager decode path's
(decode_step="eager") and transformers' own attention's (sdpa, DynamicCache).

Red twins: a loop that feeds the thin step the previous token, one that skips the logits processors on the thin path,
one that does not pad finished sequences there: each changes the tokens. A loop forced onto a streamer or onto stop
strings loses what transformers hands only to its own methods (the streamer's tokens, the tokenizer).

Reproduce one case: pytest tests/test_hf_loop_cpu.py -k "greedy and split and chunk-4 and padded"
"""

from __future__ import annotations

import inspect

import pytest
import torch

from conftest import TINY_SYNTHETIC, left_padded_batch, require_module
from foldkv.lab.model import cache_keyword

LENGTHS = (5, 17, 11)
NEW = 12
WINDOW = 8
PAD = 0  # the synthetic checkpoint's pad_token_id


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    require_module("transformers")
    require_module("safetensors")
    import foldkv.hf  # noqa: F401
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp("loop"), seed=3, sliding_window=WINDOW, **TINY_SYNTHETIC)
    return {impl: load_model(ckpt, dtype=torch.float32, attn_implementation=impl) for impl in ("sdpa", "foldkv")}


BATCHES = {"padded": lambda b: b, "single": lambda b: (b[0][1:2], torch.ones_like(b[0][1:2]))}


@pytest.fixture(scope="module", params=list(BATCHES))
def batch(request):
    """(name, (input_ids, attention_mask)): the left-padded batch of 3 (conftest.left_padded_batch) or its longest
    prompt alone (no padding: generate() drops the all-ones mask)."""
    return request.param, BATCHES[request.param](left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"]))


def _cache(model, fmt="folded", decode_step="static"):
    from foldkv.hf import FoldKvCache

    return FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, kv_format=fmt, scatter_seed=5,
                       decode_step=decode_step)


def _generate(model, batch, cache=None, *, loop=True, seed=None, **kw):
    """(sequences [B, prompt + new], the loop's steps {"thin": n, "transformers": n, "rewound": n}: the growth of the
    cache's decode step's `loop_steps`, zeros without one) of one generate(); loop=False:
    transformers' own loop (`hf_loop.applies` answers False). seed: torch seeded before the call."""
    from foldkv import hf_loop

    ids, mask = batch
    if cache is not None:
        kw[cache_keyword(model)] = cache
    kw.setdefault("do_sample", False)
    def counted():
        step = getattr(cache, "decode_step", None)
        return dict(step.loop_steps) if step is not None else {"thin": 0, "transformers": 0, "rewound": 0}

    before = counted()
    with pytest.MonkeyPatch.context() as mp:
        if not loop:
            mp.setattr(hf_loop, "applies", lambda model, kwargs: False)
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **kw)
    after = counted()
    return out, {k: after[k] - before[k] for k in before}


def _broken_loop(monkeypatch, old: str, new: str) -> None:
    """Install a copy of `decode_loop` with `old` (found exactly once in its source) replaced by `new`: install's
    generate() reads `hf_loop.decode_loop` at every call."""
    from foldkv import hf_loop

    src = inspect.getsource(hf_loop.decode_loop)
    assert src.count(old) == 1, f"{old!r} is not in decode_loop's source once: the twin would not break it"
    scope = dict(vars(hf_loop))
    exec(compile(src.replace(old, new), hf_loop.__file__, "exec"), scope)
    monkeypatch.setattr(hf_loop, "decode_loop", scope["decode_loop"])


# --- greedy: the thin loop's tokens are transformers' ---------------------------------------------------------------

def _greedy(models, batch, fmt, chunk):
    """(thin loop's output, its loop steps, loop off's output, its growth, cache) of one greedy generate();
    min_new_tokens keeps every sequence going (the synthetic eos, 1, is suppressed), so the counts are exact."""
    model = models["foldkv"]
    kw = dict(min_new_tokens=NEW, prefill_chunk_size=chunk)
    cache = _cache(model, fmt)
    got, steps = _generate(model, batch, cache, **kw)
    want, off_steps = _generate(model, batch, _cache(model, fmt), loop=False, **kw)
    return got, steps, want, off_steps, cache


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunk-4"])
@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_greedy_thin_loop_equals_transformers_loop(models, batch, fmt, chunk):
    _, inputs = batch
    got, steps, want, off_steps, cache = _greedy(models, inputs, fmt, chunk)
    assert got.shape == (inputs[0].shape[0], inputs[0].shape[1] + NEW)
    where = (got != want).nonzero()[:4].tolist()
    assert torch.equal(got, want), f"thin loop vs transformers' loop: tokens differ at {where}"
    # the eager decode path and transformers' own attention give the same tokens
    eager, _ = _generate(models["foldkv"], inputs, _cache(models["foldkv"], fmt, "eager"),
                         min_new_tokens=NEW, prefill_chunk_size=chunk)
    incumbent, _ = _generate(models["sdpa"], inputs, min_new_tokens=NEW, prefill_chunk_size=chunk)
    assert torch.equal(got, eager) and torch.equal(got, incumbent)
    # NEW - 1 decode forwards: the first one captures through transformers' path, the rest are thin; a last prompt
    # chunk of one column (17 in chunks of 4) is the capturing step, so every decode forward is thin
    captured_in_prefill = chunk is not None and max(LENGTHS) % chunk == 1
    assert steps == {"thin": NEW - 1 - (not captured_in_prefill), "transformers": int(not captured_in_prefill),
                     "rewound": 0}  # the length criterion's stop is known before a step would run ahead
    assert off_steps == {"thin": 0, "transformers": 0, "rewound": 0}
    assert cache.decode_step.steps == NEW - 1 + captured_in_prefill  # every forward after the capture is a step


def test_a_custom_generate_of_the_caller_wins(models):
    """custom_generate=GenerationMixin._sample (a callable with _sample's signature): transformers' loop runs, not the
    thin one, with the thin loop's tokens (its twin: the greedy test's thin count, > 0 without it)."""
    from transformers.generation.utils import GenerationMixin

    inputs = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    model = models["foldkv"]
    got, steps = _generate(model, inputs, _cache(model), min_new_tokens=NEW, custom_generate=GenerationMixin._sample)
    want, loop_steps = _generate(model, inputs, _cache(model), min_new_tokens=NEW)
    assert steps == {"thin": 0, "transformers": 0, "rewound": 0} and loop_steps["thin"] == NEW - 2
    assert torch.equal(got, want)


# --- EOS: finished sequences padded, the loop stopping when all are ---------------------------------------------------

def _eos_case(models, batch, case):
    """(eos ids, the expected output) from a greedy generation without EOS: eos = sequence 0's 4th new token
    ("one_finishes"), or one token of each sequence ("all_finish": the generation ends early). Expected: those tokens,
    PAD after each sequence's first EOS, cut after the step where the last sequence finished."""
    ids = batch[0]
    model = models["foldkv"]
    free, _ = _generate(model, batch, _cache(model), loop=False, min_new_tokens=NEW)
    new = free[:, ids.shape[1]:]
    picks = [(0, 3)] if case == "one_finishes" else [(0, 3), (1, 5), (2, 2)][:ids.shape[0]]
    eos = sorted({int(new[b, s]) for b, s in picks})
    want = new.clone()
    ends = []
    for b in range(new.shape[0]):
        hits = [s for s in range(NEW) if int(new[b, s]) in eos]
        end = hits[0] if hits else NEW - 1
        want[b, end + 1:] = PAD
        ends.append(end)
    return eos, torch.cat([ids, want[:, :max(ends) + 1]], dim=1), ends


@pytest.mark.parametrize("case", ["one_finishes", "all_finish"])
def test_eos_stops_and_pads_as_transformers(models, batch, case):
    _, inputs = batch
    model = models["foldkv"]
    eos, want, ends = _eos_case(models, inputs, case)
    assert ends[0] == 3 < NEW - 1  # sequence 0 finishes early: PAD follows its EOS
    got, steps = _generate(model, inputs, _cache(model), eos_token_id=eos, pad_token_id=PAD)
    off, off_steps = _generate(model, inputs, _cache(model), loop=False, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(off, want), "transformers' loop is not what the test expects"
    assert got.shape == want.shape and torch.equal(got, want), f"thin loop: {got[:, inputs[0].shape[1]:]}"
    if case == "all_finish":
        assert want.shape[1] < inputs[0].shape[1] + NEW  # the loop stopped before max_new_tokens
    generated = want.shape[1] - inputs[0].shape[1]
    # an EOS stop before max_new_tokens takes back the step run ahead of it
    rewound = int(want.shape[1] < inputs[0].shape[1] + NEW)
    assert steps == {"thin": generated - 2, "transformers": 1, "rewound": rewound}
    assert off_steps == {"thin": 0, "transformers": 0, "rewound": 0}


# --- the step run ahead of the stop check, taken back ---------------------------------------------------------------

def _state(cache):
    """What a stop leaves in a cache with a decode step: its columns and lengths on the host, the step's lengths, its
    device counters (lengths, ring column)."""
    step = cache.decode_step
    return (cache.get_seq_length(), [list(layer.lengths) for layer in cache.global_layers], list(step.lens),
            step.dev_lens.tolist(), step.col.tolist(), step.steps)


def _after_stop(models, inputs, loop, rewind=None, monkeypatch=None):
    """(output, loop steps, cache state, logits of one more step) of an EOS stop before max_new_tokens
    ("all_finish"), then one decode forward of each sequence's last token on the same cache: a cache the stop left
    one step ahead reads its ring and pools one column off. rewind: replaces DecodeStep.rewind (red twins)."""
    from foldkv.hf_graph import DecodeStep

    model = models["foldkv"]
    eos, _, _ = _eos_case(models, inputs, "all_finish")
    if rewind is not None:
        monkeypatch.setattr(DecodeStep, "rewind", rewind)
    cache = _cache(model)
    out, steps = _generate(model, inputs, cache, loop=loop, eos_token_id=eos, pad_token_id=PAD)
    state = _state(cache)
    with torch.no_grad():
        logits = model(input_ids=out[:, -1:], **{cache_keyword(model): cache}).logits
    return out, steps, state, logits


def test_a_stop_leaves_the_cache_as_transformers_loop_does(models, batch):
    _, inputs = batch
    got, steps, state, logits = _after_stop(models, inputs, loop=True)
    want, _, want_state, want_logits = _after_stop(models, inputs, loop=False)
    assert steps["rewound"] == 1 and torch.equal(got, want)
    assert state == want_state, f"after the stop: {state} where transformers' loop leaves {want_state}"
    assert torch.equal(logits, want_logits), "the next step after a stop reads another cache"


def _rewind_without(counter):
    """DecodeStep.rewind with one device counter left one step ahead."""
    from foldkv.hf_graph import DecodeStep

    own = DecodeStep.rewind

    def rewind(self):
        keep = getattr(self, counter).clone()
        own(self)
        getattr(self, counter).copy_(keep)
    return rewind


@pytest.mark.parametrize("counter", ["dev_lens", "col"])
def test_a_rewind_that_leaves_a_counter_ahead_is_seen(models, counter, monkeypatch):
    """Red twins: the state check and the next step's logits both see a device counter the rewind did not step back."""
    inputs = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    _, steps, state, logits = _after_stop(models, inputs, loop=True, rewind=_rewind_without(counter),
                                          monkeypatch=monkeypatch)
    monkeypatch.undo()
    _, _, want_state, want_logits = _after_stop(models, inputs, loop=False)
    assert steps["rewound"] == 1
    assert state != want_state
    assert not torch.equal(logits, want_logits)


def test_no_column_left_is_refused_by_both_loops(models):
    """A cache with columns for 5 new tokens asked for NEW: the step past its columns is refused with the step's
    error under either loop (the thin loop runs no step ahead into it)."""
    from foldkv import FoldKvInputError
    from foldkv.hf import FoldKvCache

    inputs = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    model = models["foldkv"]
    for loop in (True, False):
        cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + 5, kv_format="folded", scatter_seed=5,
                            decode_step="static")
        with pytest.raises(FoldKvInputError, match="holds max_tokens"):
            _generate(model, inputs, cache, loop=loop, min_new_tokens=NEW)
        assert cache.get_seq_length() == max(LENGTHS) + 5


# --- sampling ---------------------------------------------------------------------------------------------------------

SAMPLING = dict(do_sample=True, top_k=8, temperature=0.7, min_new_tokens=NEW)


def _sampled(models, batch, seed=123):
    model = models["foldkv"]
    got, steps = _generate(model, batch, _cache(model), seed=seed, **SAMPLING)
    want, _ = _generate(model, batch, _cache(model), loop=False, seed=seed, **SAMPLING)
    return got, want, steps


def test_sampling_thin_loop_equals_transformers_loop(models, batch):
    _, inputs = batch
    got, want, steps = _sampled(models, inputs)
    assert torch.equal(got, want), f"sampled tokens differ at {(got != want).nonzero()[:4].tolist()}"
    incumbent, _ = _generate(models["sdpa"], inputs, seed=123, **SAMPLING)
    assert torch.equal(got, incumbent)
    assert steps == {"thin": NEW - 2, "transformers": 1, "rewound": 0}
    # the seed decided: another seed samples another continuation, and it is not the greedy one
    other, _ = _generate(models["foldkv"], inputs, _cache(models["foldkv"]), seed=7, **SAMPLING)
    greedy, _ = _generate(models["foldkv"], inputs, _cache(models["foldkv"]), min_new_tokens=NEW)
    assert not torch.equal(got, other) and not torch.equal(got, greedy)


# --- red twins: a broken thin loop changes the tokens -----------------------------------------------------------------

BROKEN = {
    # the thin step fed the token before the new one
    "previous_token": ("step_ids = next_tokens[:, None]", "step_ids = input_ids[:, -2:-1]"),
    # top_k and temperature dropped once the step has started
    "no_processors": ("pick_tokens(input_ids, outputs.logits[:, -1], logits_processor,",
                      "pick_tokens(input_ids, outputs.logits[:, -1], (lambda i, s: s) if step.started else"
                      " logits_processor,"),
    # finished sequences not padded once the step has started
    "no_padding": ("has_eos_stopping_criteria)", "has_eos_stopping_criteria and not step.started)"),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_thin_loop_changes_the_tokens(models, broken, monkeypatch):
    """On the padded batch (with one sequence, the last to finish ends the loop: nothing to pad)."""
    inputs = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    _broken_loop(monkeypatch, *BROKEN[broken])
    if broken == "previous_token":
        got, steps, want, _, _ = _greedy(models, inputs, "folded", None)
    elif broken == "no_processors":
        got, want, steps = _sampled(models, inputs)
    else:
        eos, want, _ = _eos_case(models, inputs, "one_finishes")
        model = models["foldkv"]
        got, steps = _generate(model, inputs, _cache(model), eos_token_id=eos, pad_token_id=PAD)
    assert steps["thin"] > 0  # the broken copy ran
    assert not torch.equal(got, want), f"{broken}: the thin loop's tokens did not change"


# --- what the thin loop leaves to transformers ------------------------------------------------------------------------

class _Streamer:
    """A transformers streamer (put / end) that keeps what it is handed."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def _tokenizer():
    """A word-level tokenizer over the synthetic vocabulary (id i is "w<i>"; id 3 is "abcdef", the prefix
    StopStringCriteria tokenizes to clean the vocabulary)."""
    require_module("tokenizers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {("abcdef" if i == 3 else f"w{i}"): i for i in range(TINY_SYNTHETIC["vocab_size"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w1")


def _fallback_kwargs(case):
    if case == "dict":
        return dict(return_dict_in_generate=True, output_logits=True)
    if case == "streamer":
        return dict(streamer=_Streamer())
    return dict(stop_strings=["w55"], tokenizer=_tokenizer())  # case "stop_strings"


@pytest.mark.parametrize("case", ["dict", "streamer", "stop_strings"])
def test_calls_the_loop_does_not_cover_go_to_transformers(models, case):
    from foldkv import hf_loop

    inputs = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    model = models["foldkv"]
    kw, off_kw = _fallback_kwargs(case), _fallback_kwargs(case)
    cache = _cache(model)
    assert not hf_loop.applies(model, dict(kw, cache=cache))
    got, steps = _generate(model, inputs, cache, min_new_tokens=NEW, **kw)
    want, _ = _generate(model, inputs, _cache(model), loop=False, min_new_tokens=NEW, **off_kw)
    assert steps == {"thin": 0, "transformers": 0, "rewound": 0}
    if case == "dict":
        assert torch.equal(got.sequences, want.sequences) and len(got.logits) == NEW
        assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
        # covers() refuses it too, were decode_loop called
        assert not hf_loop.covers(model, model._prepare_generation_config(None, **kw)[0], False, None, cache)
        return
    assert torch.equal(got, want)
    if case == "streamer":
        streamer, off_streamer = kw["streamer"], off_kw["streamer"]
        assert len(streamer.puts) == 1 + NEW and streamer.ended  # the prompt, then every token
        assert all(torch.equal(a, b) for a, b in zip(streamer.puts, off_streamer.puts))
    else:  # sequence 0's 4th new token is 55 ("w55"): it stops there, PAD after
        assert int(got[0, inputs[0].shape[1] + 3]) == 55 and bool((got[0, inputs[0].shape[1] + 4:] == PAD).all())


@pytest.mark.parametrize("case", ["streamer", "stop_strings"])
def test_a_loop_forced_onto_them_loses_what_transformers_keeps(models, case, monkeypatch):
    """Red twins of the fall-backs: `applies` answering True anyway. transformers hands a callable custom_generate
    none of its own methods' arguments: the streamer gets the prompt alone, stop strings find no tokenizer."""
    from foldkv import hf_loop

    inputs = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    model = models["foldkv"]
    monkeypatch.setattr(hf_loop, "applies", lambda model, kwargs: True)
    kw = _fallback_kwargs(case)
    if case == "streamer":
        _, steps = _generate(model, inputs, _cache(model), min_new_tokens=NEW, **kw)
        assert steps["thin"] == NEW - 2 and len(kw["streamer"].puts) == 1 and not kw["streamer"].ended
    else:
        with pytest.raises(ValueError, match="could not locate a tokenizer"):
            _generate(model, inputs, _cache(model), min_new_tokens=NEW, **kw)


def test_beams_are_refused_with_or_without_the_loop(models):
    """A FoldKvCache refuses beam search; the loop is not asked to take it (`applies`), and generate() raises the same
    refusal as without the loop. Twin: the same call with one beam is the loop's."""
    from foldkv import FoldKvInputError, hf_loop

    inputs = BATCHES["single"](left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"]))  # 2 beams fit max_batch
    model = models["foldkv"]
    assert not hf_loop.applies(model, dict(cache=_cache(model), num_beams=2))
    assert hf_loop.applies(model, dict(cache=_cache(model), num_beams=1))
    for loop in (True, False):
        with pytest.raises(FoldKvInputError, match="beam search reorders the cache"):
            _generate(model, inputs, _cache(model), loop=loop, num_beams=2)


# --- the lab's versions of the loop on the CPU (their GPU tests hold their tokens) ------------------------------------

def _generate_with_version(models, batch, version: str, patched: str) -> dict:
    """A greedy generate() (min_new_tokens) without and with bench/versions/<version>.py installed, which must swap
    `hf_loop.<patched>` inside its block and put it back after: the same tokens and thin steps; what it took."""
    from conftest import bench_version
    from foldkv import hf_loop

    _, inputs = batch
    model = models["foldkv"]
    want, want_steps = _generate(model, inputs, _cache(model), min_new_tokens=NEW)
    served = getattr(hf_loop, patched)
    with bench_version(version).installed() as took:
        assert getattr(hf_loop, patched) is not served
        got, steps = _generate(model, inputs, _cache(model), min_new_tokens=NEW)
    assert getattr(hf_loop, patched) is served
    assert torch.equal(got, want) and steps == want_steps and want_steps["thin"] > 0
    return took


def test_the_side_stream_loop_leaves_a_cpu_generate_to_the_served_loop(models, batch):
    """bench/versions/loop_tail_side_stream.py: on the CPU (no streams) the version hands every call to the loop it
    replaced, no token checked on a side stream. The probe parses --loop-tail-ab."""
    from conftest import bench_script

    took = _generate_with_version(models, batch, "loop_tail_side_stream", "decode_loop")
    assert took["tokens"] == 0
    probe = bench_script("model_decode_probe").parser()
    assert probe.parse_args(["--loop-tail-ab"]).loop_tail_ab and not probe.parse_args([]).loop_tail_ab


def test_the_two_launch_pick_leaves_a_cpu_generate_to_the_library_pick(models, batch):
    """bench/versions/greedy_pick_fused.py: on the CPU the version hands every pick to the library's (counted under its
    reason). It reads the processors a greedy generate() gets: min_new_tokens' EOS ids while below the minimum, none
    at it; another processor is refused by name. The probe parses --greedy-pick-ab (and the notes' command)."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinLengthLogitsProcessor,
                                                        MinNewTokensLengthLogitsProcessor,
                                                        RepetitionPenaltyLogitsProcessor)

    from conftest import bench_script, bench_version, probe_command_of_run

    took = _generate_with_version(models, batch, "greedy_pick_fused", "pick_tokens")
    pick = bench_version("greedy_pick_fused")
    assert took["tokens"] == 0 and took["refusals"] == {"logits not on the ids' CUDA device": NEW}, dict(took)
    ids = torch.zeros(1, 10, dtype=torch.long)
    new = MinNewTokensLengthLogitsProcessor(8, 3, [5, 1])  # 2 new tokens of a minimum of 3: EOS masked
    assert pick.masked_eos(ids, LogitsProcessorList([new])) == (1, 5)
    assert pick.masked_eos(ids, LogitsProcessorList([MinNewTokensLengthLogitsProcessor(7, 3, [5])])) == ()
    assert pick.masked_eos(ids, LogitsProcessorList([new, MinLengthLogitsProcessor(11, 9)])) == (1, 5, 9)
    assert pick.masked_eos(ids, LogitsProcessorList([MinLengthLogitsProcessor(10, 9)])) == ()
    refused = pick.masked_eos(ids, LogitsProcessorList([new, RepetitionPenaltyLogitsProcessor(1.2)]))
    assert refused == "processor RepetitionPenaltyLogitsProcessor"  # red twin: a processor it does not describe
    probe = bench_script("model_decode_probe").parser()
    assert probe.parse_args(["--greedy-pick-ab"]).greedy_pick_ab and not probe.parse_args([]).greedy_pick_ab
    noted = probe_command_of_run(29)  # the notes' command for run 29 is one the probe takes
    assert noted.greedy_pick_ab and noted.loop_tail_ab and "foldkv-folded:4096:8" in noted.decode


# --- the prompt's chunks: as many as prefill_chunk_size makes, of near-equal lengths ------------------------------

def _even_chunks(chunks: list[int], prompt: int, size: int) -> str | None:
    """Why `chunks` are not a prompt of `prompt` tokens in ceil(prompt / size) chunks of at most `size`, the last at
    most the chunk count shorter than the first (None: they are)."""
    count = -(-prompt // size)
    if sum(chunks) != prompt or len(chunks) != count:
        return f"{chunks[:4]}...: {len(chunks)} chunks of {sum(chunks)} tokens, not {count} of {prompt}"
    if max(chunks) > size or min(chunks) < max(chunks) - count:
        return f"chunk lengths {min(chunks)}..{max(chunks)} for at most {size}, {count} chunks"
    return None


@pytest.mark.parametrize("size", [1, 4, 63, 64, 4096])
@pytest.mark.parametrize("prompt", [1, 5, 63, 65, 4100, 10_602])
def test_balanced_chunks(prompt, size):
    from types import SimpleNamespace

    from foldkv.hf_loop import balanced_chunks

    config = SimpleNamespace(prefill_chunk_size=size)
    got = balanced_chunks(config, prompt).prefill_chunk_size
    assert config.prefill_chunk_size == size, "the caller's generation config was changed"
    chunks = [len(c) for c in torch.arange(prompt).split(got)]  # as transformers' _prefill splits the prompt
    assert _even_chunks(chunks, prompt, size) is None, _even_chunks(chunks, prompt, size)


def test_balanced_chunks_red_twin():
    """The plain split of 4,100 tokens in chunks of 4,096 ends in a chunk of 4: the check catches it."""
    assert _even_chunks([len(c) for c in torch.arange(4100).split(4096)], 4100, 4096) is not None


def test_decode_loop_prefills_in_balanced_chunks(models, monkeypatch):
    """17 tokens with prefill_chunk_size=8 go to transformers' chunked prefill as chunks of 6 (6, 6, 5), not 8, 8, 1;
    the tokens are those of the prompt prefilled whole."""
    from foldkv import hf_loop

    ids = left_padded_batch((17,), TINY_SYNTHETIC["vocab_size"])[0]
    seen, prefill = [], hf_loop.compat.prefill
    monkeypatch.setattr(hf_loop.compat, "prefill", lambda model, input_ids, config, kw: (
        seen.append(config.prefill_chunk_size), prefill(model, input_ids, config, kw))[1])
    got, _ = _generate(models["foldkv"], (ids, torch.ones_like(ids)), _cache(models["foldkv"]), prefill_chunk_size=8)
    assert seen == [6]
    whole, _ = _generate(models["foldkv"], (ids, torch.ones_like(ids)), _cache(models["foldkv"]))
    assert torch.equal(got, whole)
