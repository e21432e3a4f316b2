"""transformers' `generate()` on foldkv pools: `FoldKvCache` and the "foldkv" attention implementation.

A global layer's `update` returns the step's rows (`NewRows`) and its mask says which columns are real
(`NewTokens`); foldkv's attention function folds and stores them and attends over the pool. Sliding layers are
transformers' own. Refusals come before anything is written. transformers is imported here, not by `import foldkv`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .config import AttentionGeometry, ConfigError, geometry_from_config
from . import global_step, ring
from .fp8 import FP8_DTYPE
from .fused_step import text_model
from .hf_graph import STEP_MODES, DecodeStep, used_cache_error
from .hf_loop import install
from .kernels.prefill import upload
from .layout import KvFormat
from .masks import SLIDING_IMPLEMENTATION, NewTokens, RingMask, SlidingWindow, plain_window
from .pool import BlockTable, PagedKvLayout, PagedKvPool
from .prep import rope_inv_freq
from .reference import paged_attention_reference
from .sliding_cache import ScratchSlidingLayer, SlidingScratch
from .step_options import StepOptions, in_force
from .transformers_compat import cache_keyword, norm_eps
from .validate import FoldKvInputError, check_device
from . import window_attention
from .moved import moved

from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION_BACKENDS = ("auto", "reference", "kernel")


# --- the model ---------------------------------------------------------------------------------------------------

def text_model_of(model: nn.Module) -> nn.Module:
    """The Gemma4TextModel of a Gemma 4 causal LM or conditional generation model, or the text model itself."""
    text = text_model(model)
    if text is None and isinstance(getattr(model, "layers", None), nn.ModuleList) and hasattr(
            getattr(model, "config", None), "layer_types"):
        text = model
    if text is None:
        raise ConfigError(f"{type(model).__name__} has no Gemma 4 text model with .layers and config.layer_types")
    return text


def global_layer_indices(text_model: nn.Module) -> list[int]:
    return [i for i, t in enumerate(text_model.config.layer_types) if t == "full_attention"]


def check_no_shared_kv(text_model: nn.Module) -> None:
    """Refuse (ConfigError) a Gemma 4 whose later layers reuse an earlier layer's KV (`shared_kv_states`)."""
    cfg = text_model.config
    shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    reusing = [i for i, layer in enumerate(text_model.layers) if getattr(layer.self_attn, "is_kv_shared_layer", False)]
    if shared or reusing:
        raise ConfigError(
            f"num_kv_shared_layers={shared}: layers {reusing} reuse an earlier layer's KV (is_kv_shared_layer,"
            " shared_kv_states); foldkv does not serve KV-shared Gemma 4 variants")


def global_geometry(text_model: nn.Module, attn: nn.Module) -> AttentionGeometry:
    """The foldkv geometry of one global attention module: the config's, checked against the module's weights and
    the model's RoPE frequencies; under tensor parallelism, this rank's heads."""
    cfg = text_model.config
    if getattr(attn, "v_proj", None) is not None or not getattr(attn, "use_alternative_attention", True):
        raise ConfigError(f"layer {attn.layer_idx}: not a k_eq_v global layer (it has a v_proj); nothing to fold")
    geom = geometry_from_config(cfg.to_dict(), name=str(getattr(cfg, "name_or_path", "") or "model"))
    d = int(attn.head_dim)
    got = (attn.q_proj.out_features // d, attn.k_proj.out_features // d, d, norm_eps(attn.q_norm))
    want = (geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.rms_norm_eps)
    if got != want:
        raise ConfigError(f"layer {attn.layer_idx}: module (Hq, Hkv, D, eps) = {got}, the config says {want}")
    if float(getattr(attn, "scaling", 1.0)) != 1.0:
        raise ConfigError(f"layer {attn.layer_idx}: attention scaling {attn.scaling}; foldkv's Gemma 4 uses 1.0")
    model_inv = getattr(text_model.rotary_emb, "full_attention_inv_freq", None)
    if model_inv is not None:
        # The fold relies only on which columns rotate (non-zero frequencies), not on their values (a bf16 cast
        # rounds them, and transformers computes with those).
        ours = rope_inv_freq(geom, model_inv.device)
        if model_inv.shape != ours.shape or not torch.equal(model_inv != 0, ours != 0):
            raise ConfigError(
                f"layer {attn.layer_idx}: the model's full-attention RoPE rotates other columns than foldkv's"
                f" proportional RoPE ({int((model_inv != 0).sum())} non-zero frequencies of {model_inv.numel()}, foldkv"
                f" folds around {int((ours != 0).sum())}): K outside the rotated columns would not be V * w_k")

    return geom.per_rank(tensor_parallel_ranks(attn, geom))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of a parameter: its DTensor shard under tensor parallelism, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_rows(linear: nn.Module) -> int:
    """Output rows of a projection this process computes (its shard's under tensor parallelism)."""
    return int(local_tensor(linear.weight).shape[0])


def tensor_parallel_ranks(attn: nn.Module, geom: AttentionGeometry) -> int:
    """Over how many tensor-parallel ranks a global attention module's heads are split (1: whole), read from its
    q_proj and k_proj shards; ConfigError for a split foldkv cannot serve (partial heads, a query group apart)."""
    d = geom.head_dim
    q_rows, k_rows = local_rows(attn.q_proj), local_rows(attn.k_proj)
    q_full, k_full = geom.num_q_heads * d, geom.num_kv_heads * d
    ranks = k_full // k_rows if k_rows else 0
    if (q_rows % d or k_rows % d or not k_rows or k_full % k_rows or q_full % q_rows
            or q_full // q_rows != ranks or q_rows // d != (k_rows // d) * geom.group_size):
        raise ConfigError(
            f"layer {attn.layer_idx}: the tensor-parallel plan gives this rank {q_rows} q_proj rows and {k_rows}"
            f" k_proj rows (head_dim {d}; the layer has {geom.num_q_heads} query heads over {geom.num_kv_heads} KV"
            " heads): foldkv needs whole KV heads on each rank with their query groups (q_proj and k_proj colwise,"
            " split the same number of ways, that number dividing the KV heads)")
    return ranks


# --- what flows from update / the mask to the attention function ----------------------------------------------------

class NewRows:
    """What a FoldKvLayer's `update` returns: the step's new key and value and the layer that stores them."""

    __slots__ = ("layer", "key", "value")

    def __init__(self, layer: "FoldKvLayer", key: torch.Tensor, value: torch.Tensor):
        self.layer, self.key, self.value = layer, key, value

    def __getattr__(self, name: str) -> Any:  # reached only for names other than the slots: a tensor's attributes
        raise FoldKvInputError(
            f"a FoldKvCache global layer was read as a tensor (.{name}): its KV lives in a foldkv pool and only the"
            " 'foldkv' attention implementation reads it; load the model with attn_implementation='foldkv' or call"
            " model.set_attn_implementation('foldkv')")


def _new_tokens(attention_mask: torch.Tensor | None, q_length: int, kv_length: int, kv_offset: int) -> NewTokens | None:
    """Which of the forward's q_length new columns are real, from the 2D padding mask (None: all are). A forward
    that reuses a cache still holding an earlier generate()'s tokens is refused here, before any layer writes."""
    end = kv_offset + kv_length
    if q_length == 0 and end > 0:  # a prompt no longer than what the cache holds: generate() left no column of it
        raise used_cache_error(end)
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if mask.shape[-1] < end:  # the mask may stop short of the new columns (transformers pads it with False)
        if mask.shape[-1] < end - q_length:  # it does not even cover what the cache holds
            raise used_cache_error(end - q_length)
        mask = torch.nn.functional.pad(mask, (0, end - mask.shape[-1]))
    real = mask[:, end - q_length:end]  # [B, T]
    host = real.cpu()
    counts = host.sum(-1)
    left_padded = torch.arange(q_length)[None, :] >= (q_length - counts)[:, None]  # the real tokens are a suffix
    if not torch.equal(host, left_padded):
        b = int(torch.nonzero((host != left_padded).any(-1))[0])
        raise FoldKvInputError(f"sequence {b}: a padding column follows a real token; foldkv serves left padding only")
    if not bool((counts > 0).any()):  # a chunk of a chunked prefill may hold only padding for some sequences
        raise FoldKvInputError(f"no sequence has a real token among this forward's {q_length} columns")
    return NewTokens(real, tuple(int(c) for c in counts))


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, *, sliding: str,
          **kwargs) -> Any:
    """transformers' mask call: sliding layers get their implementation's mask, global layers a NewTokens."""
    if kwargs.get("local_size") is not None:
        args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                    kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
        if plain_window(sliding, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs):
            return SlidingWindow(int(kwargs["local_size"]), lambda: ALL_MASK_ATTENTION_FUNCTIONS[sliding](**args))
        return ALL_MASK_ATTENTION_FUNCTIONS[sliding](**args)
    if mask_function is not causal_mask_function:
        raise FoldKvInputError(
            "foldkv's global layers serve plain causal attention; this model asked for another full-attention mask"
            f" ({getattr(mask_function, '__name__', mask_function)})")
    return _new_tokens(attention_mask, q_length, kv_length, kv_offset)


def _sliding_attention(sliding: str, module: nn.Module, *args, **kwargs):
    if sliding == "eager":  # the model's own eager function (Gemma 4's handles its softcap and GQA)
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ConfigError(f"{type(module).__module__} has no eager_attention_forward for the sliding layers")
        return fn(module, *args, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[sliding](module, *args, **kwargs)


def _attention(module: nn.Module, query: torch.Tensor, key: Any, value: Any, attention_mask: Any, *, sliding: str,
               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention call for every layer: sliding layers go to their implementation; a global layer
    stores the step's rows in its pool and attends over it. Returns ([B, T, Hq, D] in query's dtype, None)."""
    if getattr(module, "is_sliding", False):
        if isinstance(attention_mask, RingMask):  # a decode step through the cache's DecodeStep
            return ring.ring_attention(module, query, key, value, attention_mask)
        if isinstance(attention_mask, SlidingWindow):
            why = window_attention.refusal(query, key, value, window=kwargs.get("sliding_window"),
                                           softcap=getattr(module.config, "attn_logit_softcapping", None),
                                           dropout=kwargs.get("dropout", 0.0))
            if why is None and kwargs.get("sliding_window") == attention_mask.window:
                scale = kwargs.get("scaling")
                return window_attention.window_attention(
                    query, key, value, window=attention_mask.window,
                    scale=query.shape[-1] ** -0.5 if scale is None else scale), None
            attention_mask = attention_mask.tensor()
        return _sliding_attention(sliding, module, query, key, value, attention_mask, **kwargs)
    if not isinstance(key, NewRows):
        raise FoldKvInputError(
            f"layer {getattr(module, 'layer_idx', '?')}: the foldkv attention reads global layers from a FoldKvCache;"
            " pass cache=FoldKvCache(model, ...) (past_key_values= in older transformers) to generate / forward")
    if attention_mask is not None and not isinstance(attention_mask, NewTokens):
        raise FoldKvInputError("the global layers' mask was built outside foldkv's mask function (a prepared 4D"
                               " mask?); pass the 2D attention_mask")
    key.layer.check_module(module)
    return key.layer.attend(module, query, key, attention_mask), None


def register() -> None:
    """Register "foldkv" (sliding layers: sdpa) and "foldkv_eager" (eager) with transformers. Idempotent."""
    for name, sliding in SLIDING_IMPLEMENTATION.items():
        def attention(module, query, key, value, attention_mask, *, _sliding=sliding, **kwargs):
            return _attention(module, query, key, value, attention_mask, sliding=_sliding, **kwargs)

        def mask(*args, _sliding=sliding, **kwargs):
            return _mask(*args, sliding=_sliding, **kwargs)

        attention.__name__, mask.__name__ = f"{name}_attention", f"{name}_mask"
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, mask)


register()


# --- the cache ------------------------------------------------------------------------------------------------------

class FoldKvLayer(CacheLayerMixin):
    """One global layer's KV in a foldkv pool: one block-table row of max_tokens per batch sequence. lengths[b]: the
    real tokens sequence b holds; `columns`: the forward's columns as transformers counts them (padding included)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "FoldKvCache", layer_idx: int, geometry: AttentionGeometry):
        super().__init__()
        self.cache, self.layer_idx, self.geometry = cache, layer_idx, geometry
        c = cache
        per_seq = PagedKvLayout(geometry, c.kv_format, c.page_size, 0, c.pool_dtype).pages_for(c.max_tokens)
        layout = PagedKvLayout(geometry, c.kv_format, c.page_size, per_seq * c.max_batch, c.pool_dtype)
        self.pool = PagedKvPool(layout, c.device, fill=float("nan") if c.poison else None)
        # one page order for every global layer (same pools, same seed): the decode step shares one table among them
        self.host_table = self.pool.allocate([c.max_tokens] * c.max_batch, scatter_seed=c.scatter_seed)
        self.host_table.seq_lens.zero_()
        self.device_table = BlockTable(self.host_table.page_ids.to(c.device), self.host_table.seq_lens.to(c.device))
        self.lengths = [0] * c.max_batch
        self.columns = 0
        self.device = c.device
        self.is_initialized = True

    # transformers' layer interface ------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the pool is made with the cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[NewRows, NewRows]:
        self.columns += key_states.shape[-2]
        rows = NewRows(self, key_states, value_states)
        return rows, rows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return self.cache.max_tokens

    get_max_cache_shape = get_max_length  # the same question under its name before transformers 5.17

    def reset(self) -> None:
        """No token held, the pool poisoned again; the table keeps its pages (a decode step holds their ids)."""
        self.lengths = [0] * self.cache.max_batch
        self.columns = 0
        self.host_table.seq_lens.zero_()
        self.device_table.seq_lens.zero_()
        if self.cache.poison:
            self.pool.data.fill_(float("nan"))
            if self.pool.scales is not None:
                self.pool.scales.fill_(float("nan"))

    def offload(self):
        raise FoldKvInputError("a FoldKvCache is not offloaded")

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise FoldKvInputError("beam search reorders the cache; a FoldKvCache serves greedy and sampling only")

    def crop(self, tokens_to_remove: int) -> None:
        raise FoldKvInputError("a FoldKvCache cannot be cropped (assisted decoding is not served)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise FoldKvInputError("a FoldKvCache's batch is fixed by its first forward (num_return_sequences > 1 and"
                               " beam search are not served)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise FoldKvInputError("a FoldKvCache's batch is fixed by its first forward")

    # the store and the attention ------------------------------------------------------------------------------------
    def check_module(self, module: nn.Module) -> None:
        if module is not self.cache.attention_modules[self.layer_idx]:
            raise FoldKvInputError(f"layer {self.layer_idx}: this FoldKvCache was made for another model (its layer"
                                   " is another attention module); make a FoldKvCache for the model that uses it")

    def attend(self, module: nn.Module, query: torch.Tensor, new: NewRows, tokens: NewTokens | None) -> torch.Tensor:
        """Store the real tokens' rows and attend over the pool. query: [B, Hq, T, D], new.key / new.value:
        [B, Hkv, T, D] (normed, RoPE'd). Returns [B, T, Hq, D] in query's dtype, zeros at the padding columns."""
        pool, c = self.pool, self.cache
        if c.decode_step is not None and c.decode_step.started:
            return c.decode_step.attend(self, module, query, new.key, new.value)
        b, hq, t, d = query.shape
        # (the batch and the columns this forward adds were checked before its first write: FoldKvCache._check_forward)
        counts = tokens.counts if tokens is not None else (t,) * b
        starts = self.lengths[:b]
        new_lens = [n + k for n, k in zip(starts, counts)]
        # The real tokens, sequence by sequence: column j of sequence r is flat row r * T + j.
        every = sum(counts) == b * t  # no padding: the rows in order, nothing gathered or scattered
        flat = None if every else torch.cat([torch.arange(r * t + t - k, r * t + t) for r, k in enumerate(counts)])
        request = torch.repeat_interleave(torch.arange(b), torch.tensor(counts))  # [N] host
        slots = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, counts)])  # [N] host
        table = BlockTable(self.host_table.page_ids, self.host_table.seq_lens.clone())
        table.seq_lens[:b] = torch.tensor(new_lens, dtype=torch.int32)
        pages, offsets = pool.token_slots(table, request, slots)  # refuses before anything is written
        # Host to device through pinned memory, without waiting for the stream: a copy from pageable memory would
        # drain the queue at every global layer, and the GPU would then idle for this layer's host work.
        pages, offsets, *idx = upload(pool.device, pages, offsets, *([] if every else [flat]), dtype=torch.long)
        q, k, v = (x.transpose(1, 2).reshape(b * t, -1, d) for x in (query, new.key, new.value))
        if not every:  # [N, H, D]
            q, k, v = (x.index_select(0, idx[0]) for x in (q, k, v))
        # the sequences with tokens in this forward (a chunk of a chunked prefill may hold none of a short prompt's)
        active = [r for r in range(b) if counts[r]]
        # The model's own activations: no FP8 finiteness check (its host read drains the stream at every global
        # layer; the decode step leaves it out too): a non-finite row is stored as NaN and shows in the logits, as in
        # a bf16 pool. folded: [N, Hq, D], the format's form.
        folded = global_step.fold_and_store(pool, pages, offsets, q, k, v, module.k_norm.weight,
                                            out=c.decode_query(counts), check_finite=False)
        self.host_table.seq_lens.copy_(table.seq_lens)
        self.lengths[:b] = new_lens
        table = BlockTable(self.host_table.page_ids[active], self.host_table.seq_lens[active].clone())
        out = c.pool_attention(self, folded, table, tuple(counts[r] for r in active))  # [N, Hq, D] head order
        if every:
            return out.to(query.dtype).view(b, t, hq, d)
        full = torch.zeros(b * t, hq, d, dtype=query.dtype, device=query.device)
        full.index_copy_(0, idx[0], out.to(query.dtype))
        return full.view(b, t, hq, d)


class FoldKvCache(Cache):
    """A transformers Cache for Gemma 4 whose global layers keep their KV only in foldkv pools.

    model: a Gemma 4 (Gemma4ForCausalLM or Gemma4ForConditionalGeneration's text tower) loaded or set with
        attn_implementation "foldkv" (sliding layers: sdpa) or "foldkv_eager" (sliding layers: eager).
    max_batch: sequences the pools hold (the first forward's batch may be smaller; later forwards keep it).
    max_tokens: columns per sequence as transformers counts them (padded prompt + generated tokens).
    max_new_tokens: when given, a prompt whose columns + max_new_tokens exceed max_tokens is refused up front.
    kv_format: "folded" or "split". device: the model's (default). dtype: the pool's (default: the model's on the CPU,
        bf16 on CUDA; torch.float8_e4m3fn: the FP8 folded pool, `foldkv.fp8`). attention: "auto" (kernels on CUDA,
        the float64 reference elsewhere), "reference" or "kernel". backend: the kernels' "jit" or "aot".
    poison: fill pools with NaN (a row read before it is written shows). scatter_seed: pages in a random order.
    fp8_math: an FP8 pool's decode, "tensor_cores" (None: the default) or "exact" (`kernels.decode.parse_fp8_math`).
    decode_step: "graph" (the default with kernel attention: the whole forward as one CUDA graph, `foldkv.hf_graph`),
        "static" (the same fixed-address step eagerly, any device) or "eager" (transformers' forward layer by layer).
    step_options: the decode step's `StepOptions`; None: those in force here (`step_options.using`).
    On CUDA the creation runs one short generate() through the cache (`warm_generate`): a subclass sets what its
    attention needs before calling `super().__init__`.
    """

    step_class = DecodeStep  # the decode step's class (a subclass may serve the global layers another way)

    def __init__(self, model: nn.Module, *, max_batch: int, max_tokens: int, kv_format: KvFormat | str = "folded",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, page_size: int = 64,
                 attention: str = "auto", backend: str = "jit", max_new_tokens: int | None = None,
                 poison: bool = True, scatter_seed: int | None = None, cuda_graphs: None = None,
                 decode_step: str | None = None, fp8_math: str | None = None,
                 step_options: StepOptions | None = None):
        text_model = text_model_of(model)
        cfg = text_model.config
        impl = getattr(cfg, "_attn_implementation", None)
        if impl not in SLIDING_IMPLEMENTATION:
            raise ConfigError(f"the model's attention implementation is {impl!r}; a FoldKvCache needs one of"
                              f" {list(SLIDING_IMPLEMENTATION)} (attn_implementation= at load, or"
                              " model.set_attn_implementation('foldkv'))")
        check_no_shared_kv(text_model)
        if int(max_batch) < 1 or int(max_tokens) < 1:
            raise FoldKvInputError(f"max_batch={max_batch} and max_tokens={max_tokens} must be positive")
        if max_new_tokens is not None and int(max_new_tokens) < 0:
            raise FoldKvInputError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if attention not in ATTENTION_BACKENDS:
            raise FoldKvInputError(f"attention={attention!r}: expected one of {ATTENTION_BACKENDS}")
        model_param = next(model.parameters())
        self.device = check_device(device) if device is not None else model_param.device
        if self.device != model_param.device and not (self.device.type == model_param.device.type == "cuda"
                                                      and self.device.index is None):
            raise FoldKvInputError(f"device={self.device}: the model is on {model_param.device}; a FoldKvCache lives"
                                   " on its model's device")
        on_cuda = self.device.type == "cuda"
        self.attention = ("kernel" if on_cuda else "reference") if attention == "auto" else attention
        self.kv_format = KvFormat.parse(kv_format)
        self.pool_dtype = dtype or (torch.bfloat16 if self.attention == "kernel" else model_param.dtype)
        if self.pool_dtype == FP8_DTYPE and self.kv_format is not KvFormat.FOLDED:
            raise FoldKvInputError(f"an FP8 ({FP8_DTYPE}) pool holds folded rows only;"
                                   f" kv_format={self.kv_format.value}")
        if self.attention == "kernel" and self.pool_dtype not in (torch.bfloat16, FP8_DTYPE):
            raise FoldKvInputError(f"the kernels read bf16 or FP8 ({FP8_DTYPE}, folded) pools; dtype={self.pool_dtype}")
        if self.attention == "kernel" and not on_cuda:
            raise FoldKvInputError(f"attention='kernel' runs on CUDA; the cache is on {self.device}")
        from .kernels.decode import parse_fp8_math

        self.fp8_math = parse_fp8_math(fp8_math, self.pool_dtype == FP8_DTYPE)  # refused before any pool is made
        self.max_batch, self.max_tokens, self.page_size = int(max_batch), int(max_tokens), int(page_size)
        self.max_new_tokens = None if max_new_tokens is None else int(max_new_tokens)
        self.backend, self.poison, self.scatter_seed = backend, poison, scatter_seed
        if cuda_graphs is not None:
            raise FoldKvInputError("cuda_graphs= is gone: decode_step='graph' (the default with kernel attention)"
                                   " captures the whole decode step; decode_step='eager' runs the same workspace"
                                   " step per layer without a graph")
        if decode_step is None:
            decode_step = "graph" if self.attention == "kernel" else "eager"
        if decode_step not in STEP_MODES:
            raise FoldKvInputError(f"decode_step={decode_step!r}: expected one of {STEP_MODES}")
        if decode_step == "graph" and self.attention != "kernel":
            raise FoldKvInputError("decode_step='graph' captures the kernels' decode (attention='kernel' on CUDA);"
                                   " decode_step='static' runs the same step on any device")
        self.step_options = in_force() if step_options is None else step_options
        if not isinstance(self.step_options, StepOptions):
            raise FoldKvInputError(f"step_options={step_options!r}: expected a foldkv.step_options.StepOptions")
        self.decode_step: DecodeStep | None = None
        self.sliding_window = int(getattr(cfg, "sliding_window", 0) or 0)
        self.sliding_scratch = SlidingScratch(self.sliding_window)  # the sliding layers' prefill chunks (one a cache)
        self.cache_keyword = cache_keyword(model)
        self.batch: int | None = None
        self._kernels: dict[str, Any] = {}
        self._workspace = None  # the global layers' DecodeWorkspace (`decode_workspace`), made at the first decode

        # which attention module each global layer serves (a cache of another model is refused, by the module)
        self.attention_modules = {i: layer.self_attn for i, layer in enumerate(text_model.layers)}
        global_layers = set(global_layer_indices(text_model))
        if not global_layers:
            raise ConfigError("the model has no full_attention layer: nothing for foldkv to serve")
        layers: list[CacheLayerMixin] = []
        for i, layer_type in enumerate(cfg.layer_types):
            if i in global_layers:
                layers.append(FoldKvLayer(self, i, global_geometry(text_model, text_model.layers[i].self_attn)))
            elif layer_type == "sliding_attention":
                layers.append(self._sliding_layer())
            else:
                raise ConfigError(f"layer {i} is of type {layer_type!r}; foldkv serves Gemma 4's sliding and full"
                                  " attention layers")
        super().__init__(layers=layers)
        if self.attention == "kernel":
            self._load_kernels()
        if decode_step != "eager":
            self.decode_step = self.step_class(self, decode_step)  # its options: the cache's step_options
            install(model)
            self.decode_step.warm_prefill(model)  # the first prompt's first launches, done here (CUDA kernels only)
            if on_cuda:
                self.warm_generate(model)

    @property
    def global_layers(self) -> list[FoldKvLayer]:
        return [layer for layer in self.layers if isinstance(layer, FoldKvLayer)]

    def pool_bytes(self) -> int:
        """Bytes of all global layers' pools."""
        return sum(layer.pool.layout.nbytes for layer in self.global_layers)

    def is_sliding_layer(self, layer_idx: int) -> bool:
        return not isinstance(self.layers[layer_idx], FoldKvLayer)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns per sequence so far (padding included): the global layers' count."""
        return self.global_layers[0].get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        step = self.decode_step
        if step is not None and step.started:  # fixed addresses: rings and pools, no host state touched
            if self.is_sliding_layer(layer_idx):
                return step.update_sliding(layer_idx, key_states, value_states)
            rows = NewRows(self.layers[layer_idx], key_states, value_states)
            return rows, rows
        if layer_idx == 0:  # the first write of a forward: every refusal of this forward comes before it
            self._check_forward(key_states.shape[0], key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @staticmethod
    def refuse_padding_only(lengths) -> None:
        """Refuse a decode step after prompts that stored no token of some sequences (prompts of padding only)."""
        empty = [b for b, n in enumerate(lengths) if n == 0]
        if empty:
            raise FoldKvInputError(f"sequences {empty[:8]} have a prompt of padding only: nothing to attend to")

    def _check_forward(self, batch: int, columns: int) -> None:
        if columns == 1 and self.batch is not None and self.global_layers[0].columns > 0:
            self.refuse_padding_only(self.global_layers[0].lengths[:self.batch])
        if self.batch is None and batch > self.max_batch:
            raise FoldKvInputError(f"a batch of {batch} sequences; this FoldKvCache holds max_batch={self.max_batch}")
        if self.batch is not None and batch != self.batch:
            raise FoldKvInputError(f"a forward of {batch} sequences on a FoldKvCache holding {self.batch}")
        seen = self.global_layers[0].columns
        after = seen + columns
        if after > self.max_tokens:
            raise FoldKvInputError(f"this forward takes the sequences to {after} columns (padding included); the"
                                   f" FoldKvCache holds max_tokens={self.max_tokens}")
        if seen == 0 and self.max_new_tokens is not None and after + self.max_new_tokens > self.max_tokens:
            raise FoldKvInputError(
                f"a prompt of {after} columns plus max_new_tokens={self.max_new_tokens} needs"
                f" {after + self.max_new_tokens} tokens per sequence; the FoldKvCache holds"
                f" max_tokens={self.max_tokens}")
        self.batch = batch

    def _sliding_layer(self) -> DynamicSlidingWindowLayer:
        return ScratchSlidingLayer(self.sliding_window, self.sliding_scratch)

    WARM_PROMPT = (3, 4)  # the warm-up's prompt: two tokens (a prefill; one would be a decode step, the graph's capture)

    def warm_generate(self, model: nn.Module) -> bool:
        """One generate() of a two-token prompt and one new token through this cache under the model's generation
        config (`min_new_tokens` too, whose processor masks the scores; one beam and one sequence, all the cache may
        hold), then `reset`: CUDA loads a kernel's module at its first launch (~0.1 s of a fresh process's first
        prompt; vLLM's start-up runs a dummy sampling step too), so generate()'s own launches and the global layers'
        prefill attention are loaded here, not in the first request's TTFT. The random states are restored (a
        caller's seed sees no draw). False where it does not run: no generate(), or no room for three tokens."""
        room = len(self.WARM_PROMPT) + max(1, self.max_new_tokens or 0) <= self.max_tokens
        if not (room and callable(getattr(model, "generate", None))):
            return False
        ids = torch.tensor([self.WARM_PROMPT], device=self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                           num_beams=1, num_return_sequences=1, **{self.cache_keyword: self})  # one sequence
        self.reset()
        return True

    def reset(self) -> None:
        """Empty the cache for another generate() (as `StaticCache.reset()`): global layers keep their pages, sliding
        layers are new, the batch is free, and the decode step is reset (its graph serves the same shape again)."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, FoldKvLayer):
                layer.reset()
            else:
                self.layers[i] = self._sliding_layer()
        self.batch = None
        if self.decode_step is not None:
            self.decode_step.reset()

    # attention over a pool --------------------------------------------------------------------------------------
    def _load_kernels(self) -> None:
        from .kernels.prefill import prefill  # TileLang is imported only when the kernels are asked for

        self._kernels = {"prefill": prefill}
        self.resolve_prefill_kernels(self.global_layers[0].pool)

    def resolve_prefill_kernels(self, pool: PagedKvPool) -> None:
        """Build or load the prefill kernels for `pool`'s layout now, so the first prompt's TTFT does not pay for
        them. A cache whose prefill is not foldkv's overrides this."""
        from .kernels.prefill import resolve_kernels

        resolve_kernels(pool, backend=self.backend)

    def decode_workspace(self, batch: int) -> Any:
        """The global layers' one `DecodeWorkspace` for `batch` sequences, kept until another batch size asks."""
        from .kernels.workspace import DecodeWorkspace

        ws = self._workspace
        if ws is None or ws.max_batch != batch:
            layout = self.global_layers[0].pool.layout
            ws = self._workspace = DecodeWorkspace(layout, max_batch=batch, max_len=self.max_tokens,
                                                   device=self.device, fp8_math=self.fp8_math)
        return ws

    def decode_query(self, counts: tuple[int, ...]) -> torch.Tensor | None:
        """Where a global layer's fold writes this forward's query: the workspace's query when `pool_attention`
        decodes there (kernels, one token per sequence), else None."""
        if self.attention != "kernel" or min(counts) != 1 or max(counts) != 1:
            return None
        return self.decode_workspace(len(counts)).query

    def pool_attention(self, layer: FoldKvLayer, query: torch.Tensor, table: BlockTable,
                       counts: tuple[int, ...]) -> torch.Tensor:
        """Attention of the stored step: query [N, Hq, D] (the format's form), table: the batch's host BlockTable
        (lengths include the step), counts: the step's tokens per sequence. Returns [N, Hq, D] head order: float64
        (reference) or bf16 (kernels). A decode step runs the workspace's step (`decode_workspace`)."""
        q_lens = torch.tensor(counts, dtype=torch.int32)
        if self.attention == "reference":
            out, _ = paged_attention_reference(layer.pool, query, table, q_lens)
            return out
        if max(counts) > 1:  # the host table: the prefill plans on the host and queues its launches without waiting
            out, _ = self._kernels["prefill"](layer.pool, query.contiguous(), table, q_lens, backend=self.backend)
            return out
        n = table.batch  # the sequences with a token in this forward: all, except in a chunk of a chunked prefill
        ws = self.decode_workspace(n)  # fewer than the batch: a workspace of their own (the step's keeps its pages)
        lens = tuple(int(x) for x in table.seq_lens.tolist())
        if n == self.batch and ws.batch == n and ws.seq_lens == tuple(x - 1 for x in lens):
            ws.advance()  # the global layers share lengths and page order: the step's first layer moves them on
        elif ws.batch != n or ws.seq_lens != lens:  # an active set only grows: same size, same sequences
            ws.plan(lens, table.page_ids.to(self.device))
        if query.data_ptr() != ws.query.data_ptr():
            ws.query[:n].copy_(query)
        return ws.step(layer.pool, backend=self.backend)[0]


__getattr__ = moved(__name__, {"ring_attention": "foldkv.ring.ring_attention (the one name every caller reads)"})


__all__ = ["FoldKvCache", "FoldKvLayer", "NewRows", "NewTokens", "SLIDING_IMPLEMENTATION", "register",
           "text_model_of", "global_layer_indices", "global_geometry", "check_no_shared_kv"]
