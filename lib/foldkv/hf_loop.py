"""generate()'s decoding loop on a FoldKvCache with a decode step: transformers' `_sample` (the same processors,
selection, padding and criteria, in the same order) with the next step issued before the host waits for the stop
flag, so the GPU runs a step ahead of the host; a stop takes that step back (`DecodeStep.rewind`). What it does not
cover goes to transformers' own method (`covers`, `applies`); `install` routes a model's generate() through it.
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
    """Whether the thin loop runs this generate() call; otherwise transformers' own method does."""
    step = getattr(cache, "decode_step", None)
    return (step is not None and compat.has_prefill(model) and streamer is None and not synced_gpus
            and not generation_config.return_dict_in_generate and not getattr(generation_config, "is_assistant", False)
            and not model.config.is_encoder_decoder and compat.sampling_mode(generation_config))


def applies(model: torch.nn.Module, kwargs: dict) -> bool:
    """Whether generate(**kwargs) gets this loop as its decoding method: no `custom_generate` of the caller's, nothing
    transformers hands only to its own methods (an assistant, a tokenizer), and `covers` on generate()'s config."""
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
    after the copy (on CUDA: pinned memory and an event)."""

    def __init__(self, device: torch.device):
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.host = torch.empty((), dtype=torch.bool, pin_memory=self.copied is not None)

    def copy(self, flag: torch.Tensor) -> None:
        self.host.copy_(flag, non_blocking=self.copied is not None)
        if self.copied is not None:
            self.copied.record()

    def read(self) -> bool:
        if self.copied is not None:
            self.copied.synchronize()
        return bool(self.host)


def loop_state(input_ids: torch.Tensor, stopping_criteria: Any, generation_config: Any, model_kwargs: dict) -> tuple:
    """What the loop holds from token to token, as `_sample` sets it up: (decode step, cache keyword, pad id, whether
    a criterion stops at EOS, the unfinished flags [B], the host's stop flag)."""
    pad = compat.pad_token_tensor(generation_config)
    return (compat.cache_of(model_kwargs).decode_step, compat.cache_keyword_of(model_kwargs),
            None if pad is None else pad.to(input_ids.device),
            any(hasattr(c, "eos_token_id") for c in stopping_criteria),
            torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device), _HostFlag(input_ids.device))


def pick_tokens(input_ids: torch.Tensor, logits: torch.Tensor, logits_processor: Any, do_sample: bool,
                unfinished: torch.Tensor, pad_token_id: torch.Tensor | None, has_eos: bool) -> torch.Tensor:
    """Each sequence's next token from the last position's logits [B, V] as `_sample` picks it (float32 logits, the
    processors, a draw or the argmax; the pad id for a finished sequence)."""
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
        # the next step is issued before the host waits for the stop flag, unless the length stops here anyway or no
        # column is left; the flag is marked before that step is queued, so waiting on it waits for this token only
        step_ids = next_tokens[:, None]
        ahead = step.started and (max_length is None or input_ids.shape[-1] < max_length) and step.room() > 0
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
    """Route `model`'s forward through the decode step of the FoldKvCache it is called with, and make `decode_loop`
    generate()'s decoding method where `applies` (idempotent). The wrappers are bound to the instance and keep the
    class methods' signatures; `applies` and `decode_loop` are read at every call (the lab replaces them by name)."""
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
