"""The transformers (and torch) internals foldkv's transformers adapter relies on, each held to what the adapter
passes and reads, in the installed transformers: one case per name of `PRIVATE_NAMES` (here,
with where each is used; what foldkv reads of each is `CHECKS`). `make test` runs this file twice, against the
newest transformers (the install's) and against the device's 5.17 (`scripts/transformers_pass.sh`), so a rename or a
changed signature shows here, by name, before a GPU test diverges.

A name is "private" here when it is not transformers' documented API: a `_` name, a module-level function the adapter
calls inside a model's module, a version shim's alternative, a keyword whose name moved between versions.
`missing(name)` is the one check; it says what is absent or changed (None: present as relied on). Red twin: a name
transformers does not have is reported missing by the same function.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import pytest

from conftest import require_module

require_module("transformers")


# --- the internals foldkv's adapter needs, the one list of them ------------------------------------------------------
@dataclass(frozen=True)
class PrivateName:
    """One internal of transformers (or torch) foldkv relies on: `name` as foldkv writes it, `used_by` where,
    `target` "module:attr.attr" (imported, then read), `passes` the parameters foldkv passes it by name.
    This file holds each to the installed transformers (one case a name, with what foldkv reads of it), against the
    newest and the device's 5.17."""

    name: str
    used_by: str
    target: str
    passes: tuple[str, ...] = ()


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("_prefill", "transformers_compat.prefill (hf_loop.decode_loop: the prompt's forwards)",
                "transformers.generation.utils:GenerationMixin._prefill",
                passes=("input_ids", "generation_config", "model_kwargs", "is_first_iteration")),
    PrivateName("_update_model_kwargs_for_generation", "transformers_compat.update_model_kwargs (hf_loop.decode_loop)",
                "transformers.generation.utils:GenerationMixin._update_model_kwargs_for_generation",
                passes=("outputs", "model_kwargs", "is_encoder_decoder")),
    PrivateName("_prepare_generation_config", "transformers_compat.prepare_generation_config (hf_loop.applies)",
                "transformers.generation.utils:GenerationMixin._prepare_generation_config",
                passes=("generation_config",)),
    PrivateName("_pad_token_tensor", "transformers_compat.pad_token_tensor (hf_loop.loop_state)",
                "transformers:GenerationConfig"),
    PrivateName("GENERATION_MODES_MAPPING", "transformers_compat.own_decoding_method (hf_loop.decode_loop)",
                "transformers.generation.utils:GENERATION_MODES_MAPPING"),
    PrivateName("_sample", "hf_loop.decode_loop (its contract as custom_generate, and its fallback)",
                "transformers.generation.utils:GenerationMixin._sample"),
    PrivateName("custom_generate", "hf_loop.install (generate()'s decoding method)",
                "transformers.generation.utils:GenerationMixin.generate", passes=("custom_generate",)),
    PrivateName("_attn_implementation", "hf.FoldKvCache, fused_step.StepForward.route, attention_function, lab.model",
                "transformers:PreTrainedConfig"),
    PrivateName("eager_attention_forward", "hf._sliding_attention ('foldkv_eager' sliding layers), attention_function",
                "transformers.models.gemma4.modeling_gemma4:eager_attention_forward",
                passes=("module", "query", "key", "value", "attention_mask")),
    PrivateName("Gemma4TextRotaryEmbedding.forward", "fused_step.StepForward (each layer type's cos and sin)",
                "transformers.models.gemma4.modeling_gemma4:Gemma4TextRotaryEmbedding.forward",
                passes=("x", "position_ids", "layer_type")),
    PrivateName("create_causal_mask", "transformers_compat.causal_masks (fused_step.StepForward.prefill)",
                "transformers.masking_utils:create_causal_mask",
                passes=("config", "inputs_embeds", "attention_mask", "position_ids")),
    PrivateName("create_sliding_window_causal_mask", "transformers_compat.causal_masks",
                "transformers.masking_utils:create_sliding_window_causal_mask",
                passes=("config", "inputs_embeds", "attention_mask", "position_ids")),
    PrivateName("CausalLMOutputWithPast", "transformers_compat.causal_lm_output (the step's forward's output)",
                "transformers.modeling_outputs:CausalLMOutputWithPast", passes=("logits",)),
    PrivateName("_forward_hooks", "transformers_compat.has_forward_hooks (fused_step.foreign_projection, refusal)",
                "torch.nn:Module"),
    PrivateName("_forward_pre_hooks", "transformers_compat.has_forward_hooks", "torch.nn:Module"),
    PrivateName("_global_forward_hooks", "transformers_compat.has_forward_hooks (fused_step.refusal)",
                "torch.nn.modules.module:_global_forward_hooks"),
    PrivateName("get_max_length / get_max_cache_shape", "hf.FoldKvLayer (both names defined)",
                "transformers.cache_utils:Cache.get_max_length"),
    PrivateName("cache / past_key_values", "transformers_compat.cache_keyword (the forward's cache keyword)",
                "transformers:Gemma4ForCausalLM.forward"),
    PrivateName("CacheLayerMixin.get_mask_sizes", "hf.FoldKvLayer (the masks' sizes)",
                "transformers.cache_utils:CacheLayerMixin.get_mask_sizes", passes=("query_length",)),
    PrivateName("CacheLayerMixin.update", "hf.FoldKvLayer / FoldKvCache.update",
                "transformers.cache_utils:CacheLayerMixin.update", passes=("key_states", "value_states")),
    PrivateName("CacheLayerMixin.lazy_initialization", "hf.FoldKvLayer",
                "transformers.cache_utils:CacheLayerMixin.lazy_initialization", passes=("key_states", "value_states")),
    PrivateName("DynamicSlidingWindowLayer.keys", "hf_graph.DecodeStep._ring, hf.FoldKvCache.reset",
                "transformers.cache_utils:DynamicSlidingWindowLayer"),
    PrivateName("ALL_MASK_ATTENTION_FUNCTIONS", "hf._mask (the sliding layers' own mask)",
                "transformers.masking_utils:ALL_MASK_ATTENTION_FUNCTIONS"),
    PrivateName("the mask interface's keywords", "hf._mask (called by name with them)",
                "transformers.masking_utils:sdpa_mask",
                passes=("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function",
                        "attention_mask")),
    PrivateName("causal_mask_function", "hf._mask (the only full-attention mask served)",
                "transformers.masking_utils:causal_mask_function"),
    PrivateName("ALL_ATTENTION_FUNCTIONS", "hf._sliding_attention, transformers_compat.attention_function",
                "transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS"),
)


def _resolve(target: str) -> object:
    module, _, attrs = target.partition(":")
    obj = importlib.import_module(module)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def missing(entry: PrivateName, check: Callable[[object], str | None] | None = None) -> str | None:
    """What the installed transformers lacks of `entry` (None: it has it as the adapter relies on it); `check`: what
    the adapter reads of it, beyond existing (returns what is wrong, or None; `CHECKS[entry.name]` by default)."""
    import transformers

    where = f"transformers {transformers.__version__}"
    try:
        obj = _resolve(entry.target)
    except (ImportError, AttributeError) as e:
        return f"{where} has no {entry.target} ({type(e).__name__}: {e}); used by {entry.used_by}"
    if entry.passes:
        params = inspect.signature(obj).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        absent = [p for p in entry.passes if p not in params and not takes_any]
        if absent:
            return f"{where}: {entry.target} takes no {absent} (its parameters: {list(params)}); used by {entry.used_by}"
    check = CHECKS.get(entry.name) if check is None else check
    if check is not None:
        why = check(obj)
        if why:
            return f"{where}: {entry.target}: {why}; used by {entry.used_by}"
    return None


# --- what the adapter reads of each ---------------------------------------------------------------------------------

def _modes_mapping(mapping) -> str | None:
    from transformers.generation.configuration_utils import GenerationMode
    from transformers.generation.utils import GenerationMixin

    for mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        if mapping.get(mode) != "_sample":
            return f"{mode} maps to {mapping.get(mode)!r}, not '_sample' (hf_loop.covers serves those two modes)"
    absent = [m for m in mapping.values() if m.startswith("_") and not hasattr(GenerationMixin, m)]  # (others: Hub)
    return f"modes map to methods GenerationMixin lacks: {absent}" if absent else None


def _sample_contract(sample) -> str | None:
    """hf_loop.decode_loop is handed to generate() as `custom_generate`, called as `_sample` is: its parameters in
    this order."""
    from foldkv.hf_loop import decode_loop

    want = [p for p in inspect.signature(decode_loop).parameters if p not in ("model_kwargs",)]
    got = [p for p in inspect.signature(sample).parameters if p != "self"]
    got_named = [p for p in got if inspect.signature(sample).parameters[p].kind is not inspect.Parameter.VAR_KEYWORD]
    return None if got_named == want[1:] else f"parameters {got_named}; decode_loop takes {want[1:]}"


@functools.cache
def _meta_model():
    """The synthetic Gemma 4 (`foldkv.lab.synthetic.synthetic_config`, small) built by the installed transformers on
    the meta device: its configs and methods, no weights."""
    import json
    import tempfile

    import torch
    from transformers import AutoConfig, Gemma4ForCausalLM

    from foldkv.lab.synthetic import synthetic_config

    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as fh:
            json.dump(synthetic_config(hidden_size=64, intermediate_size=128, vocab_size=128), fh)
        config = AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        return Gemma4ForCausalLM(config)


def _returns_config_and_kwargs(prepare) -> str | None:
    from transformers import GenerationConfig

    out = prepare(_meta_model(), None, max_new_tokens=3, do_sample=False)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], GenerationConfig)
            and isinstance(out[1], dict)):
        return f"returned {type(out).__name__}, hf_loop.applies unpacks (GenerationConfig, dict)"
    return None if out[0].max_new_tokens == 3 else "the keywords did not reach the config"


def _pad_token_tensor(config_class) -> str | None:
    """generate() sets it on the generation config (`_prepare_special_tokens`); hf_loop.loop_state reads it."""
    from transformers import GenerationMixin

    src = inspect.getsource(GenerationMixin._prepare_special_tokens)
    return None if "_pad_token_tensor" in src else "_prepare_special_tokens no longer sets _pad_token_tensor"


def _a_layer_method_the_cache_calls(names: tuple[str, ...]) -> Callable[[object], str | None]:
    def check(cache_method) -> str | None:
        src = inspect.getsource(cache_method)
        return None if any(f".{n}(" in src for n in names) else f"asks its layers by none of {list(names)}"
    return check


def _cache_keyword(forward) -> str | None:
    from foldkv.transformers_compat import cache_keyword

    params = inspect.signature(forward).parameters
    if not ({"cache", "past_key_values"} & set(params)):
        return "forward takes neither cache= nor past_key_values="

    class Model:  # cache_keyword reads the forward's signature
        pass

    Model.forward = forward
    return None if cache_keyword(Model()) in params else f"cache_keyword() says {cache_keyword(Model())!r}"


def _has_attribute(*names: str) -> Callable[[object], str | None]:
    def check(obj) -> str | None:
        absent = [n for n in names if not hasattr(obj, n)]
        return f"no attribute {absent}" if absent else None
    return check


def _module_hooks(module_class) -> str | None:
    import torch

    lin = torch.nn.Linear(2, 2)
    for name in ("_forward_hooks", "_forward_pre_hooks"):
        if not isinstance(getattr(lin, name, None), dict):
            return f"nn.Module has no dict {name}"
    handle = lin.register_forward_hook(lambda *a: None)
    seen = bool(lin._forward_hooks)
    handle.remove()
    return None if seen and isinstance(torch.nn.modules.module._global_forward_hooks, dict) else \
        "a registered forward hook is not in _forward_hooks"


def _attn_implementation(config_class) -> str | None:
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig()
    cfg._attn_implementation = "eager"
    return None if cfg._attn_implementation == "eager" else "config._attn_implementation does not keep what is set"


def _sliding_layer_holds_columns(layer_class) -> str | None:
    """hf_graph's rings read a DynamicSlidingWindowLayer's keys / values [B, Hkv, n, d] (its last columns) and set
    them to empty tensors; the cache's reset makes a new one with sliding_window=."""
    import torch

    layer = layer_class(sliding_window=4)
    k = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).view(2, 1, 6, 2)
    layer.update(k, k.clone())
    if not (isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4 and layer.keys.shape[2] <= 6
            and torch.equal(layer.keys, k[:, :, -layer.keys.shape[2]:])):
        return "keys are not the last columns [B, Hkv, n, d] of what was stored"
    return None if layer.get_seq_length() == 6 else f"get_seq_length() {layer.get_seq_length()} after 6 columns"


def _mask_call(fn) -> str | None:
    src = inspect.getsource(_resolve("transformers.masking_utils:create_causal_mask"))
    absent = [k for k in ("batch_size=", "q_length=", "kv_length=", "q_offset=", "kv_offset=", "mask_function=",
                          "attention_mask=") if k not in src]
    return f"create_causal_mask calls the mask interface without {absent}" if absent else None


def _rotary_call(forward) -> str | None:
    params = list(inspect.signature(forward).parameters)
    return None if params[:4] == ["self", "x", "position_ids", "layer_type"] else \
        f"takes {params}; the step calls rotary_emb(x, position_ids, layer_type)"


def _mask_builder(fn) -> str | None:
    params = inspect.signature(fn).parameters
    return None if {"cache", "past_key_values"} & set(params) else "takes neither cache= nor past_key_values="


def _output_cache_field(output_class) -> str | None:
    fields = getattr(output_class, "__dataclass_fields__", {})
    return None if {"cache", "past_key_values"} & set(fields) else "has no cache / past_key_values field"


# What the adapter reads of each name in `PRIVATE_NAMES` beyond its existence.
CHECKS: dict[str, Callable[[object], str | None]] = {
    "_prepare_generation_config": _returns_config_and_kwargs,
    "_pad_token_tensor": _pad_token_tensor,
    "GENERATION_MODES_MAPPING": _modes_mapping,
    "_sample": _sample_contract,
    "_attn_implementation": _attn_implementation,
    "Gemma4TextRotaryEmbedding.forward": _rotary_call,
    "create_causal_mask": _mask_builder,
    "create_sliding_window_causal_mask": _mask_builder,
    "CausalLMOutputWithPast": _output_cache_field,
    "_forward_hooks": _module_hooks,
    "_forward_pre_hooks": _module_hooks,
    "_global_forward_hooks": _has_attribute("__len__"),
    "get_max_length / get_max_cache_shape": _a_layer_method_the_cache_calls(("get_max_length", "get_max_cache_shape")),
    "cache / past_key_values": _cache_keyword,
    "DynamicSlidingWindowLayer.keys": _sliding_layer_holds_columns,
    "ALL_MASK_ATTENTION_FUNCTIONS": _has_attribute("__getitem__"),
    "the mask interface's keywords": _mask_call,
    "ALL_ATTENTION_FUNCTIONS": _has_attribute("__getitem__"),
}


def test_every_check_names_a_listed_name():
    assert set(CHECKS) <= {e.name for e in PRIVATE_NAMES}, set(CHECKS) - {e.name for e in PRIVATE_NAMES}


@pytest.mark.parametrize("entry", PRIVATE_NAMES, ids=[e.name for e in PRIVATE_NAMES])
def test_transformers_has_what_the_adapter_relies_on(entry):
    why = missing(entry)
    assert why is None, why


@pytest.mark.parametrize("entry", [
    PrivateName("_no_such_step", "a planted name", "transformers.generation.utils:GenerationMixin._no_such_step"),
    PrivateName("_prefill", "a planted keyword", "transformers.generation.utils:GenerationMixin._prefill",
                passes=("no_such_keyword",)),
    PrivateName("GENERATION_MODES_MAPPING", "a planted check",
                "transformers.generation.utils:GENERATION_MODES_MAPPING"),
], ids=["absent-name", "absent-keyword", "changed-behaviour"])
def test_a_name_transformers_lacks_is_reported(entry):
    planted = None
    if entry.used_by == "a planted check":
        planted = lambda m: _modes_mapping({**m, next(iter(m)): "_no_such_method"})  # noqa: E731
    why = missing(entry, planted)
    assert why is not None and entry.used_by in why and "transformers " in why, why


def unlisted(sources) -> set[str]:
    """The `_` names `sources` (texts of lib/foldkv's files) read off transformers' generation objects and configs, or
    off torch modules the step leaves to their own forward, that PRIVATE_NAMES lacks (foldkv's own `_foldkv_*` marks
    excepted)."""
    import re

    pattern = re.compile(r"(?:model|GenerationMixin|generation_config|config|lin|owner|modules\.module|attn|layer)"
                         r"\.(_[a-z]\w+)")
    used = {m for text in sources for m in pattern.findall(text) if not m.startswith("_foldkv")}
    return used - {e.name for e in PRIVATE_NAMES}


def test_every_private_transformers_name_in_the_adapter_is_listed():
    from pathlib import Path

    lib = Path(__file__).resolve().parents[1] / "lib" / "foldkv"
    missed = unlisted(path.read_text() for path in lib.rglob("*.py"))
    assert missed == set(), f"private names used in lib/foldkv and not in PRIVATE_NAMES: {missed}"


def test_a_planted_private_call_is_unlisted():
    assert unlisted(["out = model._no_such_step(ids)", "attn._foldkv_mark = 1"]) == {"_no_such_step"}
