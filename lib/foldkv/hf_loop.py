"""generate()'s decoding loop on a FoldKvCache with a decode step: transformers' sampling loop
(`GenerationMixin._sample`, greedy or multinomial) with nothing between one step's end and the next step's replay but
that replay's launch, and that replay issued before the host waits for the stop flag.

transformers' loop reads `unfinished_sequences.max() == 0` on the host after every token (a device sync: the host must
know whether to go on), then runs `prepare_inputs_for_generation`, `_update_model_kwargs_for_generation` and the model's
forward wrapper before the next step reaches the GPU, which idles meanwhile (on the 31B at one H200, 0.4-0.8 ms a token:
2-5% of a step). Once the cache's decode step has started (`hf_graph.DecodeStep`: one graph replay a step that reads the
token ids and nothing else of the forward's arguments), the step needs none of that. This loop computes the next tokens,
the stopping criteria and the finished flag as `_sample` does (the same processors, selection, padding of finished
sequences and criteria, in the same order), all on the device in stream order, then issues the next step (the model
called with the ids and the cache alone) and only then waits for the flag (copied to pinned memory and marked by an
event before that step is queued: a sync on the stream would wait for the step too), as gpt-fast and vLLM's runners keep
the GPU a step ahead of the host: the host's work for token t+1 (reading the flag, the processors, the criteria, the
next launch) runs while step t+1 runs on the GPU, which does not wait for the host. When the flag says stop, the step
run ahead is taken back (`DecodeStep.rewind`: counters and lengths one step back; its rows lie past every length and a
later step rewrites them), so the cache holds what `_sample` leaves it. No step runs ahead past max_length or past the
cache's columns. The prompt's forward(s) (`_prefill`, chunked prefill included) and the first decode step (the capture)
go through transformers' own path, and every forward goes through the model's (wrapped) forward.

`install` makes it generate()'s decoding method when the cache passed has a decode step, the caller passed
no `custom_generate` (the transformers hook for a decoding loop: a callable with `_sample`'s signature) and the call is
greedy or sampling (`applies`). What it does not cover goes to transformers' own method unchanged: a cache without a
decode step, beams and the other modes, streamers, a tokenizer (stop strings), `return_dict_in_generate`, synced GPUs,
an assistant model, a transformers without `_prefill` (before 5.2x).
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch

from . import transformers_compat as compat
from .hf_graph import DecodeStep
from .moved import moved

def covers(model: torch.nn.Module, generation_config: Any, synced_gpus: bool, streamer: Any, cache: Any) -> bool:
    """Whether the thin loop runs this generate() call (module docstring); otherwise transformers' own method does."""
    step = getattr(cache, "decode_step", None)
    return (step is not None and compat.has_prefill(model) and streamer is None and not synced_gpus
            and not generation_config.return_dict_in_generate and not getattr(generation_config, "is_assistant", False)
            and not model.config.is_encoder_decoder and compat.sampling_mode(generation_config))


def applies(model: torch.nn.Module, kwargs: dict) -> bool:
    """Whether generate(**kwargs) should get this loop as its decoding method (`install`): the cache has a
    decode step, the caller set no decoding method of its own, nothing is passed that transformers hands only to its own
    methods (a callable `custom_generate` gets none of them: a streamer, synced GPUs, an assistant, a tokenizer), and
    the generation config generate() will use (the model's, the one passed, the keywords; unset fields at transformers'
    defaults) asks for greedy or multinomial sampling without a dict of outputs."""
    cache = compat.cache_of(kwargs)
    if (kwargs.get("custom_generate") is not None
            or not isinstance(getattr(cache, "decode_step", None), DecodeStep)
            or any(kwargs.get(k) is not None for k in ("assistant_model", "tokenizer", "assistant_tokenizer"))):
        return False
    rest = {k: v for k, v in kwargs.items() if k != "generation_config"}
    config = compat.prepare_generation_config(model, kwargs.get("generation_config"), rest)
    return covers(model, config, bool(kwargs.get("synced_gpus")), kwargs.get("streamer"), cache)


class _HostFlag:
    """A device bool copied to the host behind the work queued so far, read later without waiting for what is queued
    after the copy: on CUDA a pinned buffer, a non-blocking copy and an event (`read` waits on that event only);
    elsewhere the value itself."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.copied = torch.cuda.Event()
        self.value = None

    def copy(self, flag: torch.Tensor) -> None:
        if self.cuda:
            self.host.copy_(flag, non_blocking=True)
            self.copied.record()
        else:
            self.value = bool(flag)

    def read(self) -> bool:
        if self.cuda:
            self.copied.synchronize()
            return bool(self.host)
        return self.value


def loop_state(input_ids: torch.Tensor, stopping_criteria: Any, generation_config: Any, model_kwargs: dict) -> tuple:
    """What the loop holds from token to token, as `_sample` sets it up: (the cache's decode step, the cache's keyword,
    the pad id on the ids' device, whether a criterion stops at EOS, the finished flags [B] int64 all 1, the host's
    stop flag)."""
    pad = compat.pad_token_tensor(generation_config)
    return (compat.cache_of(model_kwargs).decode_step, compat.cache_keyword_of(model_kwargs),
            None if pad is None else pad.to(input_ids.device),
            any(hasattr(c, "eos_token_id") for c in stopping_criteria),
            torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device), _HostFlag(input_ids.device))


def pick_tokens(input_ids: torch.Tensor, logits: torch.Tensor, logits_processor: Any, do_sample: bool,
                unfinished: torch.Tensor, pad_token_id: torch.Tensor | None, has_eos: bool) -> torch.Tensor:
    """Each sequence's next token from the last position's logits [B, V] (the model's output, its dtype), as `_sample`
    picks it: the logits copied to float32, the processors, then a multinomial draw or the argmax; a finished
    sequence (when a criterion stops at EOS) gets the pad id."""
    logits = logits.to(copy=True, dtype=torch.float32, device=input_ids.device)
    scores = logits_processor(input_ids, logits)
    if do_sample:
        tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        tokens = torch.argmax(scores, dim=-1)
    return tokens * unfinished + pad_token_id * (1 - unfinished) if has_eos else tokens


def balanced_chunks(generation_config: Any, prompt: int) -> Any:
    """`generation_config`, or a copy whose `prefill_chunk_size` splits a prompt of `prompt` tokens into as many
    chunks as the given size does, of near-equal lengths (each at most the given size; the last at most their count
    shorter). A prompt a few tokens past a multiple of the chunk size would otherwise end in a chunk of those few
    tokens, whose forward reads every weight for them and runs on kernels no full chunk takes."""
    size = getattr(generation_config, "prefill_chunk_size", None)
    if not size or prompt <= size:
        return generation_config
    even = -(-prompt // -(-prompt // size))  # ceil(prompt / the chunk count)
    if even == size:
        return generation_config
    config = copy.copy(generation_config)
    config.prefill_chunk_size = even
    return config


def decode_loop(model: torch.nn.Module, input_ids: torch.LongTensor, logits_processor: Any, stopping_criteria: Any,
                generation_config: Any, synced_gpus: bool = False, streamer: Any = None,
                **model_kwargs) -> torch.LongTensor:
    """`GenerationMixin._sample`'s contract (same arguments, the prompt and its new tokens as one LongTensor)."""
    cache = compat.cache_of(model_kwargs)
    if not covers(model, generation_config, synced_gpus, streamer, cache):
        own = compat.own_decoding_method(generation_config)
        return own(model, input_ids, logits_processor, stopping_criteria, generation_config,
                   synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    step, cache_kw, pad_token_id, has_eos_stopping_criteria, unfinished, flag = loop_state(
        input_ids, stopping_criteria, generation_config, model_kwargs)
    do_sample = generation_config.do_sample
    max_length = generation_config.max_length

    prompt = input_ids.shape[1] - cache.get_seq_length()
    outputs = compat.prefill(model, input_ids, balanced_chunks(generation_config, prompt), model_kwargs)
    while True:
        if not step.started:  # the prompt's output or the capturing step: transformers' own bookkeeping
            model_kwargs = compat.update_model_kwargs(model, outputs, model_kwargs)
        next_tokens = pick_tokens(input_ids, outputs.logits[:, -1], logits_processor, do_sample, unfinished,
                                  pad_token_id, has_eos_stopping_criteria)
        del outputs
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, None)
        # the next step is issued before the host waits for the stop flag (module docstring); not when the length
        # criterion stops here anyway, nor without a column left for it (the call below then refuses it, as it would
        # under _sample)
        step_ids = next_tokens[:, None]
        ahead = step.started and (max_length is None or input_ids.shape[-1] < max_length) and step.room() > 0
        # _sample's stop check, the one sync a token: the flag is copied out and marked before the next step is
        # queued, so waiting on that mark waits for this token only (a sync on the stream, as `.item()` does, would
        # wait for the step queued behind it too)
        flag.copy(unfinished.max() == 0)
        if ahead:
            outputs = model(input_ids=step_ids, **{cache_kw: cache})
        if flag.read():
            if ahead:
                step.rewind()
                step.loop_steps["rewound"] += 1
            return input_ids
        if step.started:
            step.loop_steps["thin"] += 1
            if not ahead:
                outputs = model(input_ids=step_ids, **{cache_kw: cache})
        else:
            step.loop_steps["transformers"] += 1
            model_inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            outputs = model(**model_inputs, return_dict=True)


def install(model: torch.nn.Module) -> None:
    """Route `model`'s forward through the decode step of the FoldKvCache it is called with (idempotent), and make
    generate()'s decoding loop `decode_loop` when that cache has a decode step and the call is greedy or sampling
    (`applies`; a `custom_generate` the caller passes wins). The wrappers are methods bound to the model (a copy of
    the model, `copy.deepcopy`, gets its own), keep the class methods' signatures (functools.wraps: generate() reads
    forward's) and call them for every other call. `applies` and `decode_loop` are read at every call (the lab's
    versions replace them by name)."""
    if isinstance(vars(model).get("forward"), types.MethodType) and getattr(vars(model)["forward"], "_foldkv", False):
        return
    own_forward = type(model).forward

    @functools.wraps(own_forward)
    def forward(self, *args, **kwargs):
        own = own_forward.__get__(self)
        step = getattr(compat.cache_of(kwargs), "decode_step", None)
        if isinstance(step, DecodeStep) and not args and step.takes(kwargs):
            return step(own, kwargs)
        if isinstance(step, DecodeStep) and not args and step.fuses_prefill(kwargs):
            return step.prefill(own, kwargs)
        return own(*args, **kwargs)

    forward._foldkv = True
    model.forward = types.MethodType(forward, model)
    if hasattr(type(model), "generate"):
        own_generate = type(model).generate

        @functools.wraps(own_generate)
        def generate(self, *args, **kwargs):
            if applies(self, kwargs):
                kwargs["custom_generate"] = decode_loop
            return own_generate(self, *args, **kwargs)

        model.generate = types.MethodType(generate, model)


__getattr__ = moved(__name__, {"LOOP_STEPS": "each decode step counts the loop's steps on it"
                                              " (cache.decode_step.loop_steps)"})


__all__ = ["applies", "balanced_chunks", "covers", "decode_loop", "install", "loop_state", "pick_tokens"]
