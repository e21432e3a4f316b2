"""Every private or version-dependent call foldkv makes into transformers (or torch's hook dictionaries), in one place.

Written against transformers 5.5 to 5.24; transformers is imported inside the functions (`import foldkv` works
without it). The internals used are listed in tests/test_transformers_private_api.py's `PRIVATE_NAMES`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from .moved import moved


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
    """Whether any of `modules` has forward hooks (pre-hooks too, with `pre`), or torch holds global forward hooks
    (with `global_hooks`): a replaced forward would skip what they do."""
    return (any(bool(m._forward_hooks or (pre and m._forward_pre_hooks)) for m in modules)
            or (global_hooks and bool(nn.modules.module._global_forward_hooks)))


# --- around the decode step's own forward -------------------------------------------------------------------------
def causal_masks(text_model: nn.Module, inputs_embeds: torch.Tensor, attention_mask: Any, cache: Any,
                 position_ids: torch.Tensor) -> dict:
    """The {layer type: mask} a Gemma 4 text model's forward builds from a 2D padding mask, called as it calls them."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    keyword = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    kw = {"config": text_model.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
          keyword: cache, "position_ids": position_ids}
    return {"full_attention": create_causal_mask(**kw), "sliding_attention": create_sliding_window_causal_mask(**kw)}


def attention_function(module: nn.Module) -> Callable:
    """The attention function the module's forward calls for its config's `_attn_implementation`."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = module.config._attn_implementation
    if impl == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def causal_lm_output(logits: torch.Tensor, cache: Any) -> Any:
    """What a causal LM's forward returns, its cache under this version's field name (generate() reads it back)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(logits=logits, **{field: cache})


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
    """transformers' own (unbound) decoding method for the config's mode; `_sample` by default."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin

    return getattr(GenerationMixin, GENERATION_MODES_MAPPING[generation_config.get_generation_mode()],
                   GenerationMixin._sample)


__all__ = ["cache_keyword", "cache_of", "cache_keyword_of", "norm_eps", "has_forward_hooks", "causal_masks",
           "attention_function", "causal_lm_output", "has_prefill", "prefill", "update_model_kwargs",
           "prepare_generation_config", "pad_token_tensor", "sampling_mode", "own_decoding_method"]


__getattr__ = moved(__name__, {n: "tests/test_transformers_private_api.py (the list of the internals foldkv leans on,"
                                  " one case each)" for n in ("PrivateName", "PRIVATE_NAMES")})
