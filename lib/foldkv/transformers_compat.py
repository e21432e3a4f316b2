"""Every place foldkv leans on an API of transformers (or torch) that is private or moved between versions, in one file.

The runtime is written against transformers 5.5 to 5.24 (tests/test_hf_cpu.py); each function below names the
version difference or the private name it hides, so that a new transformers that moves one of them breaks here, in
one place, and the rest of foldkv asks these functions. It imports nothing of foldkv (every layer may use it) and
imports transformers only inside the functions that need it (`import foldkv` works without transformers).

- the cache keyword of forward() / generate(): `cache` from 5.24, `past_key_values` before (`cache_keyword`,
  `cache_of`, `cache_keyword_of`);
- a Gemma 4 RMSNorm's epsilon: `eps` up to 5.24, `variance_epsilon` from 5.25 (`norm_eps`);
- torch's hook dictionaries, read to leave a module with hooks to its own forward (`has_forward_hooks`);
- the generation loop's private calls that foldkv's thin decoding loop makes as `GenerationMixin._sample` makes them
  (`has_prefill`, `prefill`, `update_model_kwargs`, `prepare_generation_config`, `pad_token_tensor`, `sampling_mode`,
  `own_decoding_method`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn


# --- the cache keyword -------------------------------------------------------------------------------------------------
def cache_keyword(model: nn.Module) -> str:
    """forward()'s / generate()'s cache keyword: `cache` in transformers >= 5.24, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(kwargs: dict) -> Any:
    """The cache passed in a forward()'s or generate()'s keywords (None when there is none)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def cache_keyword_of(kwargs: dict) -> str:
    """Which cache keyword these keywords use (transformers' model_kwargs of a generate() call)."""
    return "cache" if "cache" in kwargs else "past_key_values"


# --- modules -------------------------------------------------------------------------------------------------------
def norm_eps(norm: nn.Module) -> float:
    """A Gemma 4 RMSNorm's epsilon: `eps` up to transformers 5.24, `variance_epsilon` from 5.25."""
    eps = getattr(norm, "eps", None)
    return float(norm.variance_epsilon if eps is None else eps)


def has_forward_hooks(*modules: nn.Module, pre: bool = True, global_hooks: bool = False) -> bool:
    """Whether any of `modules` has forward hooks (and forward pre-hooks, with `pre`), or (with `global_hooks`) torch
    holds global forward hooks: torch's private hook dictionaries (`_forward_hooks`, `_forward_pre_hooks`,
    `torch.nn.modules.module._global_forward_hooks`), read because a replaced forward would skip what they do."""
    return (any(bool(m._forward_hooks or (pre and m._forward_pre_hooks)) for m in modules)
            or (global_hooks and bool(nn.modules.module._global_forward_hooks)))


# --- the generation loop's private calls -------------------------------------------------------------------------------
def has_prefill(model: nn.Module) -> bool:
    """Whether the model's generation mixin has `_prefill` (transformers 5.2x on; the thin loop needs it)."""
    return hasattr(type(model), "_prefill")


def prefill(model: nn.Module, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict) -> Any:
    """The prompt's forward(s) as `_sample` runs them (`GenerationMixin._prefill`, chunked prefill included)."""
    return model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)


def update_model_kwargs(model: nn.Module, outputs: Any, model_kwargs: dict) -> dict:
    """transformers' bookkeeping after a forward (`GenerationMixin._update_model_kwargs_for_generation`)."""
    return model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)


def prepare_generation_config(model: nn.Module, generation_config: Any, kwargs: dict) -> Any:
    """The generation config generate() will use for these keywords (`GenerationMixin._prepare_generation_config`)."""
    config, _ = model._prepare_generation_config(generation_config, **kwargs)
    return config


def pad_token_tensor(generation_config: Any) -> torch.Tensor | None:
    """The pad id as generate() prepared it (`GenerationConfig._pad_token_tensor`)."""
    return generation_config._pad_token_tensor


def sampling_mode(generation_config: Any) -> bool:
    """Whether the config asks for greedy search or multinomial sampling."""
    from transformers.generation.configuration_utils import GenerationMode

    return generation_config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def own_decoding_method(generation_config: Any) -> Callable:
    """transformers' own decoding method for the config's mode (`GENERATION_MODES_MAPPING`; `_sample` by default),
    unbound: called as method(model, input_ids, logits_processor, stopping_criteria, generation_config, ...)."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin

    return getattr(GenerationMixin, GENERATION_MODES_MAPPING[generation_config.get_generation_mode()],
                   GenerationMixin._sample)


__all__ = ["cache_keyword", "cache_of", "cache_keyword_of", "norm_eps", "has_forward_hooks",
           "has_prefill", "prefill", "update_model_kwargs", "prepare_generation_config", "pad_token_tensor",
           "sampling_mode", "own_decoding_method"]
