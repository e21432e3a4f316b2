"""The profiler ranges that say which part of a prefill launched a kernel: their names, the context manager that opens
one, and the wrapping that opens them around a model's attention while a prefill is profiled.

A prefill's sliding attention, fold prep and page stores run generic torch kernels (copies, index_select, cat,
scatter) that a kernel's name cannot tell apart from the model's norms and RoPE; the range open on the host when the
kernel was launched can. `scoped_attention(model, cache)` opens them without editing the runtime or patching a class:
- transformers' attention function of the model's implementation is overridden on `ALL_ATTENTION_FUNCTIONS`'s
  instance (its local mapping, which `del` removes again; the registered function is untouched): a sliding layer's
  call runs inside SLIDING_ATTENTION, a global layer's inside PREP when a pool-backed cache serves it (foldkv's
  `FoldKvLayer.attend`: the gather of the real tokens, the rows and the folded query, the page stores, the output
  scatter) and inside GLOBAL_ATTENTION otherwise (transformers' own attention);
- the cache's `pool_attention` (a FoldKvCache's, or a subclass's such as FlashInfer's) is wrapped on the instance in
  GLOBAL_ATTENTION, so the attention kernel inside the prep's range counts as attention (the innermost range wins).
On exit both are removed, leaving exactly what was there before (an instance attribute the cache already had is put
back). `foldkv.lab.prefill_breakdown` reads the ranges back.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

PREP = "foldkv.prep"
GLOBAL_ATTENTION = "foldkv.global_attention"
SLIDING_ATTENTION = "foldkv.sliding_attention"
SCOPES = (PREP, GLOBAL_ATTENTION, SLIDING_ATTENTION)
CHUNK = "foldkv.prefill_chunk"  # around one chunk's forward: its wall time on the host's clock (prefill_breakdown)


def components_scope(name: str):
    """A `torch.profiler.record_function` range of one of SCOPES or CHUNK (another name is refused: the breakdown
    would not know it)."""
    if name not in SCOPES and name != CHUNK:
        raise ValueError(f"unknown prefill scope {name!r}; the scopes are {list(SCOPES) + [CHUNK]}")
    from torch.profiler import record_function

    return record_function(name)


def _implementation(model: Any) -> str:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config._attn_implementation


@contextlib.contextmanager
def scoped_attention(model: Any, cache: Any | None = None) -> Iterator[None]:
    """While inside: `model`'s attention calls run inside the SCOPES ranges (module docstring); `cache`: the cache the
    profiled generate()/forward uses (a pool-backed one has `pool_attention`; None or a transformers cache: the global
    layers' attention is transformers' own). The model's implementation must be one transformers dispatches through
    `ALL_ATTENTION_FUNCTIONS` (not "eager", which the model calls directly)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = _implementation(model)
    if impl not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {impl!r} is not dispatched through ALL_ATTENTION_FUNCTIONS;"
                         " scoped_attention wraps 'sdpa', 'foldkv' and the other registered ones")
    pooled = cache is not None and hasattr(cache, "pool_attention")
    original = ALL_ATTENTION_FUNCTIONS[impl]
    had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping

    @functools.wraps(original)
    def attention(module, *args, **kwargs):
        scope = SLIDING_ATTENTION if getattr(module, "is_sliding", False) else PREP if pooled else GLOBAL_ATTENTION
        with components_scope(scope):
            return original(module, *args, **kwargs)

    own_pool_attention = vars(cache).get("pool_attention") if pooled else None
    ALL_ATTENTION_FUNCTIONS[impl] = attention
    try:
        if pooled:
            bound = cache.pool_attention

            @functools.wraps(bound)
            def pool_attention(*args, **kwargs):
                with components_scope(GLOBAL_ATTENTION):
                    return bound(*args, **kwargs)

            cache.pool_attention = pool_attention
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[impl] = original
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]
        if pooled:
            if own_pool_attention is None:
                vars(cache).pop("pool_attention", None)
            else:
                cache.pool_attention = own_pool_attention


__all__ = ["CHUNK", "GLOBAL_ATTENTION", "PREP", "SCOPES", "SLIDING_ATTENTION", "components_scope", "scoped_attention"]
