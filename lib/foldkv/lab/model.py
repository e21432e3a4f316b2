"""Run a Gemma 4 text model with its global layers' attention served from a foldkv pool: a prefill, then a decode walk.

The hook. `hook_global_attention(model)` replaces each global (full-attention, k_eq_v) layer's `Gemma4TextAttention`
with a `FoldKvGlobalAttention` that adopts the original's q_proj / k_proj / q_norm / k_norm / o_proj (the same module
objects, so the state_dict keys and the weights are unchanged) and keeps the original module aside, unregistered.
Its forward, per call of T new tokens at positions p..p+T-1 of the one request:

    q  = q_proj(h)  -> [T, 32, 512]          kv = k_proj(h) -> [T, 4, 512]   (raw projections, model dtype)
    query = prep_and_store(pool, table, ..., q, kv, q_norm.weight, k_norm.weight)   (rows written into the pool)
    out   = attention(pool, query, table)     T == 1: decode; T > 1: prefill (bottom-right causal)
    return o_proj(out.to(model dtype)), None

Sliding layers are untouched; the transformers KV cache keeps serving them. The global layers never write that cache
(their KV lives only in the pool), so the cache's full-attention entries stay empty and the model is always called
with explicit `position_ids`. The arm is switched on the hook (`FoldKvRuntime.begin`) without re-hooking:

| arm          | prep                                   | attention                                    | pool dtype   |
| ------------ | -------------------------------------- | -------------------------------------------- | ------------ |
| `incumbent`  | the model's own forward (transformers attention and cache)                            | -            |
| `split`      | `prep_and_store_gpu` (torch prep if that kernel is missing) | `kernels.decode` / `kernels.prefill`, split | bf16 |
| `folded`     | same                                    | same, folded                                 | bf16         |
| `ref-split`  | `foldkv.prep_and_store`                | `foldkv.paged_attention_reference` (float64, cast to model dtype) | `ref_pool_dtype` (default: model dtype) |
| `ref-folded` | same                                   | same, folded                                 | same         |

Pools are poisoned with NaN when a walk begins (an unwritten or stale row read by an arm shows up as NaN logits) and
their page tables are scattered (pages drawn in a random order).

Compatibility: written against transformers 5.17 and 5.24 Gemma 4. Both pass the layer's arguments by keyword and
include `position_ids`; the cache keyword is `cache` in 5.24 (`past_key_values` before), found from the signature.
The global geometry is read from the modules (`head_dim`, projection widths) and checked against the model's own
RoPE inverse frequencies, so neither `global_head_dim` (5.17) nor `per_layer_config` (5.24) is read directly.
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import AttentionGeometry, ConfigError
from ..layout import KvFormat
from ..pool import BlockTable, PagedKvLayout, PagedKvPool
from ..prep import prep_and_store, rope_inv_freq
from ..reference import paged_attention_reference
from ..validate import check_device
from .arms import ArmUnavailable


@dataclass(frozen=True)
class ModelArm:
    """One way of serving the model's global layers' attention (the drift study compares them)."""

    name: str
    format: KvFormat | None  # None: the model's own attention
    backend: str  # "model" | "kernel" | "reference"


MODEL_ARMS: dict[str, ModelArm] = {
    "incumbent": ModelArm("incumbent", None, "model"),
    "split": ModelArm("split", KvFormat.SPLIT, "kernel"),
    "folded": ModelArm("folded", KvFormat.FOLDED, "kernel"),
    "ref-split": ModelArm("ref-split", KvFormat.SPLIT, "reference"),
    "ref-folded": ModelArm("ref-folded", KvFormat.FOLDED, "reference"),
}


def model_arm(arm: str | ModelArm) -> ModelArm:
    if isinstance(arm, ModelArm):
        return arm
    try:
        return MODEL_ARMS[arm]
    except KeyError:
        raise ValueError(f"unknown arm {arm!r}; expected one of {list(MODEL_ARMS)}") from None


def _import_kernel(module: str, attr: str):
    try:
        mod = importlib.import_module(f"foldkv.kernels.{module}")
    except Exception as exc:  # ImportError, TileLangUnavailable, or an error inside the module
        raise ArmUnavailable(f"import foldkv.kernels.{module} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ArmUnavailable(f"foldkv.kernels.{module} has no {attr}()")
    return fn


def check_arm_available(arm: str | ModelArm, device: torch.device | str) -> None:
    """Raise ArmUnavailable (with the reason) when `arm` cannot run on `device`."""
    spec = model_arm(arm)
    if spec.backend != "kernel":
        return
    if torch.device(device).type != "cuda":
        raise ArmUnavailable(f"the generated kernels need a CUDA device (this run is on {torch.device(device)})")
    if not torch.cuda.is_available():
        raise ArmUnavailable("torch sees no CUDA device")
    _import_kernel("decode", "decode")
    _import_kernel("prefill", "prefill")


# --- finding the global layers ---------------------------------------------------------------------------------

def text_model_of(model: nn.Module) -> nn.Module:
    """The Gemma4TextModel inside a Gemma4ForCausalLM (`.model`) or a Gemma4ForConditionalGeneration
    (`.model.language_model`): the module holding `.layers` and a config with `layer_types`."""
    for cand in (getattr(model, "model", None), getattr(getattr(model, "model", None), "language_model", None), model):
        if cand is not None and hasattr(cand, "layers") and hasattr(getattr(cand, "config", None), "layer_types"):
            return cand
    raise ConfigError(f"{type(model).__name__} has no Gemma 4 text model with .layers and config.layer_types")


def global_layer_indices(text_model: nn.Module) -> list[int]:
    return [i for i, t in enumerate(text_model.config.layer_types) if t == "full_attention"]


def global_geometry(text_model: nn.Module, attn: nn.Module) -> AttentionGeometry:
    """The foldkv geometry of one global attention module, read from its weights' shapes and the config's RoPE, then
    checked against the model's own RoPE inverse frequencies (a mismatch would be a silent position error)."""
    cfg = text_model.config
    if not getattr(attn, "use_alternative_attention", getattr(cfg, "attention_k_eq_v", False)) or getattr(attn, "v_proj", None) is not None:
        raise ConfigError(f"layer {attn.layer_idx}: not a k_eq_v global layer (it has a v_proj); nothing to fold")
    if getattr(attn, "is_kv_shared_layer", False):
        raise ConfigError(f"layer {attn.layer_idx} reuses another layer's KV (num_kv_shared_layers > 0): not served")
    d = int(attn.head_dim)
    rope = dict(cfg.rope_parameters.get("full_attention", {}) if isinstance(cfg.rope_parameters, dict) else {})
    if rope.get("rope_type") != "proportional":
        raise ConfigError(f"global RoPE type is {rope.get('rope_type')!r}; foldkv needs 'proportional'")
    geom = AttentionGeometry(
        num_q_heads=attn.q_proj.out_features // d,
        num_kv_heads=attn.k_proj.out_features // d,
        head_dim=d,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(attn.q_norm.eps),
        num_global_layers=len(global_layer_indices(text_model)),
        num_layers=len(cfg.layer_types),
        max_position=int(getattr(cfg, "max_position_embeddings", 262_144)),
        name=str(getattr(cfg, "name_or_path", "") or "model"),
    )
    model_inv = getattr(text_model.rotary_emb, "full_attention_inv_freq", None)
    if model_inv is not None:
        ours = rope_inv_freq(geom, model_inv.device)
        if model_inv.shape != ours.shape or not torch.allclose(model_inv.float(), ours, rtol=1e-6, atol=0):
            raise ConfigError("the model's full-attention RoPE frequencies differ from foldkv's proportional RoPE")
    return geom


# --- the hook ----------------------------------------------------------------------------------------------------

@dataclass
class FoldKvRuntime:
    """What every hooked layer reads: the arm, the pool settings, and a record of what ran."""

    device: torch.device
    arm: ModelArm = field(default_factory=lambda: MODEL_ARMS["incumbent"])
    page_size: int = 64
    ref_pool_dtype: torch.dtype | None = None  # None: the model's dtype
    prep_backend: str = "auto"  # kernel arms: "kernel", "torch" or "auto" (kernel if importable)
    kernel_backend: str = "jit"  # the launchers' `backend=`: "jit" (TileLang builds here) or "aot"
    poison: bool = True
    scatter_seed: int | None = 0
    capacity: int = 0
    prep_used: str = ""
    layers: list["FoldKvGlobalAttention"] = field(default_factory=list)
    _kernels: dict[str, Any] = field(default_factory=dict)

    def begin(self, arm: str | ModelArm, capacity: int) -> None:
        """Switch to `arm` and give every global layer a fresh, poisoned pool for one request of up to `capacity`
        tokens (the prompt plus the walk)."""
        spec = model_arm(arm)
        check_arm_available(spec, self.device)
        self.arm, self.capacity = spec, int(capacity)
        self._kernels = {}
        if spec.backend == "kernel":
            self._kernels["decode"] = _import_kernel("decode", "decode")
            self._kernels["prefill"] = _import_kernel("prefill", "prefill")
            self.prep_used = "torch"
            if self.prep_backend in ("kernel", "auto"):
                try:
                    self._kernels["prep"] = _import_kernel("prep_kernel", "prep_and_store_gpu")
                    self.prep_used = "kernel"
                except ArmUnavailable as exc:
                    if self.prep_backend == "kernel":
                        raise
                    self.prep_used = f"torch (prep kernel unavailable: {exc})"
        elif spec.backend == "reference":
            self.prep_used = "torch"
        else:
            self.prep_used = "model"
        for layer in self.layers:
            layer.reset_pool()

    def finish(self) -> None:
        """Back to the incumbent arm; the layers keep their last pools (and tables) for inspection until the next
        `begin`."""
        self.arm = MODEL_ARMS["incumbent"]
        self._kernels = {}

    def pool_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.arm.backend == "kernel":
            return torch.bfloat16
        return self.ref_pool_dtype or model_dtype


class FoldKvGlobalAttention(nn.Module):
    """A global layer's attention served from a foldkv pool (or, for the incumbent arm, by the original module)."""

    def __init__(self, inner: nn.Module, runtime: FoldKvRuntime, geometry: AttentionGeometry):
        super().__init__()
        self.__dict__["_inner"] = inner  # kept unregistered: the state_dict keys stay the checkpoint's
        self.__dict__["_runtime"] = runtime
        for name, child in inner.named_children():  # q_proj, q_norm, k_norm, v_norm, k_proj, o_proj, in its order
            setattr(self, name, child)
        for name in ("layer_idx", "layer_type", "is_sliding", "head_dim", "config", "scaling", "sliding_window",
                     "num_key_value_groups", "is_kv_shared_layer", "store_full_length_kv", "is_causal"):
            if hasattr(inner, name):
                self.__dict__[name] = getattr(inner, name)
        self.geometry = geometry
        self.pool: PagedKvPool | None = None
        self.table: BlockTable | None = None
        self.length = 0

    @property
    def inner(self) -> nn.Module:
        return self.__dict__["_inner"]

    def reset_pool(self) -> None:
        rt = self.__dict__["_runtime"]
        self.length = 0
        if rt.arm.backend == "model":
            self.pool = self.table = None
            return
        dtype = rt.pool_dtype(self.q_proj.weight.dtype)
        need = PagedKvLayout(self.geometry, rt.arm.format, rt.page_size, 0, dtype).pages_for(rt.capacity)
        # A few spare pages so a scattered table is drawn from more pages than it uses.
        layout = PagedKvLayout(self.geometry, rt.arm.format, rt.page_size, need + 3, dtype)
        self.pool = PagedKvPool(layout, rt.device, fill=float("nan") if rt.poison else 0.0)
        seed = None if rt.scatter_seed is None else rt.scatter_seed + 7919 * self.layer_idx
        table = self.pool.allocate([rt.capacity], scatter_seed=seed)
        self.table = BlockTable(table.page_ids.to(rt.device), table.seq_lens.to(rt.device))

    def forward(self, *args, **kwargs):
        rt = self.__dict__["_runtime"]
        if rt.arm.backend == "model":
            return self.inner(*args, **kwargs)
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return self._pool_attention(hidden, kwargs.get("position_ids")), None

    def _pool_attention(self, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        rt, geom = self.__dict__["_runtime"], self.geometry
        if hidden.dim() != 3 or hidden.shape[0] != 1:
            raise ValueError(f"the foldkv hook serves one request: hidden_states {list(hidden.shape)} must be [1, T, H]")
        t, start, dev = hidden.shape[1], self.length, self.pool.device
        if start + t > rt.capacity:
            raise ValueError(f"layer {self.layer_idx}: {start + t} tokens exceed the walk's capacity {rt.capacity}")
        if position_ids is not None:
            want = torch.arange(start, start + t, device=position_ids.device)
            if not torch.equal(position_ids.reshape(-1).to(want.dtype), want):
                raise ValueError(f"layer {self.layer_idx}: position_ids must continue the sequence at {start}")
        q = self.q_proj(hidden).view(t, geom.num_q_heads, geom.head_dim)  # [T, Hq, D] raw
        kv = self.k_proj(hidden).view(t, geom.num_kv_heads, geom.head_dim)  # [T, Hkv, D] raw (k_eq_v)
        self.table.seq_lens.fill_(start + t)  # the new tokens are part of the request before they are stored
        positions = torch.arange(start, start + t, dtype=torch.int32, device=dev)  # [T]
        request = torch.zeros(t, dtype=torch.int32, device=dev)  # [T], all request 0
        args = (self.pool, self.table, request, positions, q, kv, self.q_norm.weight, self.k_norm.weight)
        if "prep" in rt._kernels:
            query = rt._kernels["prep"](*args, backend=rt.kernel_backend)  # [T, Hq, D] bf16, the format's form
        else:
            query = prep_and_store(*args)  # [T, Hq, D] pool dtype, the format's form
        if rt.arm.backend == "reference":
            q_lens = None if t == 1 else torch.tensor([t], dtype=torch.int32)
            out, _ = paged_attention_reference(self.pool, query, self.table, q_lens)  # [T, Hq, D] float64
        elif t == 1:
            out, _ = rt._kernels["decode"](self.pool, query, self.table, backend=rt.kernel_backend)  # [1, Hq, D] bf16
        else:
            q_lens = torch.tensor([t], dtype=torch.int32, device=dev)
            out, _ = rt._kernels["prefill"](self.pool, query, self.table, q_lens,
                                            backend=rt.kernel_backend)  # [T, Hq, D] bf16, head order
        self.length = start + t
        out = out.to(hidden.dtype).reshape(1, t, geom.num_q_heads * geom.head_dim)  # [1, T, Hq*D]
        return self.o_proj(out)


class FoldKvHook:
    """The hooked global layers of one model, and the runtime that switches their arm."""

    def __init__(self, model: nn.Module, runtime: FoldKvRuntime):
        self.model, self.runtime = model, runtime
        self.text_model = text_model_of(model)
        self.originals: dict[int, nn.Module] = {}

    @property
    def global_layers(self) -> list[int]:
        return sorted(self.originals)

    def unhook(self) -> None:
        for i, inner in self.originals.items():
            self.text_model.layers[i].self_attn = inner
        self.originals.clear()
        self.runtime.layers.clear()


def hook_global_attention(model: nn.Module, *, device: torch.device | str | None = None, **runtime_kw) -> FoldKvHook:
    """Swap every global layer's attention for a `FoldKvGlobalAttention`; returns the hook (arm: incumbent)."""
    text_model = text_model_of(model)
    if int(getattr(text_model.config, "num_kv_shared_layers", 0) or 0):
        raise ConfigError("num_kv_shared_layers > 0: layers reusing a global layer's KV are not served by foldkv")
    dev = check_device(device) if device is not None else next(model.parameters()).device
    runtime = FoldKvRuntime(device=dev, **runtime_kw)
    hook = FoldKvHook(model, runtime)
    for i in global_layer_indices(text_model):
        inner = text_model.layers[i].self_attn
        if isinstance(inner, FoldKvGlobalAttention):
            raise ValueError(f"layer {i} is already hooked")
        wrapper = FoldKvGlobalAttention(inner, runtime, global_geometry(text_model, inner))
        text_model.layers[i].self_attn = wrapper
        hook.originals[i] = inner
        runtime.layers.append(wrapper)
    if not hook.originals:
        raise ConfigError("the model has no full_attention layer")
    return hook


# --- loading and walking -------------------------------------------------------------------------------------------

def load_model(model_path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
               attn_implementation: str = "sdpa") -> nn.Module:
    """A Gemma 4 from a checkpoint directory (config.json + safetensors), in eval mode on `device`.

    A text checkpoint (`gemma4_text`) loads as `Gemma4ForCausalLM`; a multimodal one (`gemma4`) through
    `AutoModelForCausalLM` (its text tower is the same Gemma4TextModel, hooked the same way)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma4ForCausalLM

    device = check_device(device)  # before reading any weights
    cfg = AutoConfig.from_pretrained(os.fspath(model_path))
    cls = Gemma4ForCausalLM if cfg.model_type == "gemma4_text" else AutoModelForCausalLM
    model = cls.from_pretrained(os.fspath(model_path), dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()


def _cache_keyword(model: nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def forward_logits(model: nn.Module, ids: torch.Tensor, start: int, *, cache=None, keep: int = 1) -> torch.Tensor:
    """Logits [keep, V] float32 of the last `keep` positions after feeding `ids` [T] at positions start.."""
    dev = next(model.parameters()).device
    ids = ids.to(dev).reshape(1, -1)
    positions = torch.arange(start, start + ids.shape[1], device=dev)[None]
    kw = {_cache_keyword(model): cache} if cache is not None else {}
    out = model(input_ids=ids, position_ids=positions, use_cache=cache is not None, logits_to_keep=keep, **kw)
    return out.logits[0, -keep:].float()


@dataclass
class Walk:
    """A prefill of L prompt tokens then `steps` decode steps: logits [steps + 1, V] (row 0 from the prefill, row s
    after feeding token fed[s-1] at position L + s - 1), float32 on the model's device."""

    arm: str
    logits: torch.Tensor
    fed: torch.Tensor  # [steps] int64 (CPU)
    prep: str


@torch.no_grad()
def walk(model: nn.Module, hook: FoldKvHook | None, arm: str, prompt: torch.Tensor, steps: int,
         feed: torch.Tensor | None = None) -> Walk:
    """Prefill `prompt` [L] then decode `steps` tokens one at a time. Without `feed` the walk is greedy (each step
    feeds the previous step's argmax); with it, every arm is fed the same tokens (teacher forcing), so all arms'
    logits are at the same positions for the same inputs."""
    prompt = prompt.reshape(-1).cpu()
    n = prompt.numel()
    if feed is not None and feed.numel() < steps:
        raise ValueError(f"feed holds {feed.numel()} tokens for {steps} steps")
    if hook is not None:
        hook.runtime.begin(arm, capacity=n + steps)
        prep = hook.runtime.prep_used
    elif arm != "incumbent":
        raise ValueError(f"arm {arm!r} needs a hooked model")
    else:
        prep = "model"
    try:
        cache = new_cache(model)
        rows = [forward_logits(model, prompt, 0, cache=cache)[-1]]
        fed = []
        for s in range(steps):
            tok = int(feed[s]) if feed is not None else int(torch.argmax(rows[-1]))
            fed.append(tok)
            rows.append(forward_logits(model, torch.tensor([tok]), n + s, cache=cache)[-1])
    finally:
        if hook is not None:
            hook.runtime.finish()
    return Walk(arm, torch.stack(rows), torch.tensor(fed, dtype=torch.long), prep)


@torch.no_grad()
def single_pass(model: nn.Module, hook: FoldKvHook | None, tokens: torch.Tensor, keep: int, arm: str = "incumbent") -> torch.Tensor:
    """Logits [keep, V] of the last `keep` positions of one prefill over all of `tokens` (no cache): the walk's
    rows computed in one pass instead of step by step."""
    tokens = tokens.reshape(-1).cpu()
    if hook is not None:
        hook.runtime.begin(arm, capacity=tokens.numel())
    try:
        return forward_logits(model, tokens, 0, cache=None, keep=keep)
    finally:
        if hook is not None:
            hook.runtime.finish()
