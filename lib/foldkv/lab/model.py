"""Run a Gemma 4 text model the way transformers runs it, one arm at a time: a prefill, then a decode walk.

Every arm is the same transformers forward over a cache; what differs is the model's attention implementation and the
cache passed as `past_key_values` (`cache` in transformers >= 5.24):

| arm          | attention implementation                              | cache (global layers)                                 |
| ------------ | ----------------------------------------------------- | ----------------------------------------------------- |
| `incumbent`  | the model's own (`sdpa` or `eager`)                   | `DynamicCache`                                        |
| `split`      | `"foldkv"` (`"foldkv_eager"` beside `eager`)           | `foldkv.hf.FoldKvCache`, split pool, the GPU kernels  |
| `folded`     | same                                                  | same, folded pool                                     |
| `ref-split`  | same                                                  | `FoldKvCache(attention="reference")`: float64 `paged_attention_reference` over the pool, cast to the model dtype |
| `ref-folded` | same                                                  | same, folded pool                                     |
| `folded-fp8` | same                                                  | `FoldKvCache(dtype=float8_e4m3fn, fp8_math="tensor_cores")`: the FP8 folded pool (`foldkv.fp8`), its default decode (the FP8 tensor-core partial) |
| `folded-fp8-exact` | same                                            | same, `fp8_math="exact"`: the exact-conversion FP8 partial (bf16 MMA over exactly converted rows) |
| `ref-folded-fp8` | same                                              | same, the FP8 folded pool (`foldkv.fp8`): the format's drift, read dequantized |

The foldkv arms' sliding layers keep the incumbent's attention (sdpa beside sdpa, eager beside eager), so an arm and
the incumbent differ only in the global layers. transformers applies the norms and RoPE; foldkv folds the result
(`foldkv.prep.fold_query` / `rows_from_key_value`) and stores it. Kernel arms store bf16 (`folded-fp8`: e4m3);
reference arms store `ref_pool_dtype` (default: the model dtype; `ref-folded-fp8`: e4m3). Pools are poisoned with NaN
(a row read before it is written shows up as NaN logits) and their pages scattered (drawn in a random order), per
walk.

The arm is switched on the loaded model (`model.set_attn_implementation`) for one walk and switched back after it,
so one loaded model serves every arm.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..fp8 import FP8_DTYPE
from ..transformers_compat import cache_keyword
from ..layout import KvFormat
from ..validate import check_device
from .arms import ArmUnavailable


@dataclass(frozen=True)
class ModelArm:
    """One way of serving the model's global layers' attention (the drift study compares them)."""

    name: str
    format: KvFormat | None  # None: the model's own attention
    backend: str  # "model" | "kernel" | "reference" (FoldKvCache's `attention=`)
    pool_dtype: torch.dtype | None = None  # the pool's stored dtype when fixed by the arm (the FP8 pool)
    fp8_math: str | None = None  # a kernel arm over an FP8 pool: which decode partial (FoldKvCache's `fp8_math`)


MODEL_ARMS: dict[str, ModelArm] = {
    "incumbent": ModelArm("incumbent", None, "model"),
    "split": ModelArm("split", KvFormat.SPLIT, "kernel"),
    "folded": ModelArm("folded", KvFormat.FOLDED, "kernel"),
    "ref-split": ModelArm("ref-split", KvFormat.SPLIT, "reference"),
    "ref-folded": ModelArm("ref-folded", KvFormat.FOLDED, "reference"),
    "folded-fp8": ModelArm("folded-fp8", KvFormat.FOLDED, "kernel", FP8_DTYPE, "tensor_cores"),
    "folded-fp8-exact": ModelArm("folded-fp8-exact", KvFormat.FOLDED, "kernel", FP8_DTYPE, "exact"),
    "ref-folded-fp8": ModelArm("ref-folded-fp8", KvFormat.FOLDED, "reference", FP8_DTYPE),
}

# The incumbent implementations a foldkv arm can stand beside: the foldkv implementation whose sliding layers run it.
INCUMBENT_IMPLEMENTATIONS = ("sdpa", "eager")


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


# --- the arms on one loaded model -------------------------------------------------------------------------------

@dataclass
class ArmSettings:
    """The FoldKvCache settings every foldkv arm of a study shares."""

    page_size: int = 64
    ref_pool_dtype: torch.dtype | None = None  # reference arms' pool dtype; None: the model's dtype
    kernel_backend: str = "jit"  # the launchers' `backend=`: "jit" (TileLang builds here) or "aot"
    poison: bool = True
    scatter_seed: int | None = 0


def foldkv_implementation(incumbent: str) -> str:
    """The foldkv attention implementation whose sliding layers run `incumbent` ("sdpa" -> "foldkv")."""
    from ..hf import SLIDING_IMPLEMENTATION

    for name, sliding in SLIDING_IMPLEMENTATION.items():
        if sliding == incumbent:
            return name
    raise ValueError(f"incumbent attention {incumbent!r}: the foldkv arms' sliding layers run one of"
                     f" {sorted(SLIDING_IMPLEMENTATION.values())}, so the incumbent must be one of them")


def incumbent_implementation(model: nn.Module) -> str:
    """The model's own attention implementation (the one it was loaded with); refuses a model left on foldkv's."""
    from ..hf import SLIDING_IMPLEMENTATION

    impl = model.config._attn_implementation
    if impl in SLIDING_IMPLEMENTATION:
        raise ValueError(f"the model runs {impl!r}: load it with its own attention (e.g. 'sdpa'); the foldkv arms"
                         " switch to foldkv's for their walk")
    return impl


@contextlib.contextmanager
def serving(model: nn.Module, arm: str | ModelArm) -> Iterator[None]:
    """The model switched to `arm`'s attention implementation, switched back on exit."""
    spec = model_arm(arm)
    own = incumbent_implementation(model)
    if spec.backend == "model":
        yield
        return
    import foldkv.hf  # noqa: F401  (registers the foldkv implementations)

    model.set_attn_implementation(foldkv_implementation(own))
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def arm_cache(model: nn.Module, arm: str | ModelArm, capacity: int, settings: ArmSettings | None = None,
              batch: int = 1):
    """A fresh cache for one walk of `batch` sequences of up to `capacity` tokens: transformers' DynamicCache for the
    incumbent, a poisoned FoldKvCache of the arm's format and attention for the others (built while the model serves
    the arm: FoldKvCache checks the implementation)."""
    spec = model_arm(arm)
    if spec.backend == "model":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from ..hf import FoldKvCache

    s = settings or ArmSettings()
    dtype = spec.pool_dtype or (torch.bfloat16 if spec.backend == "kernel" else s.ref_pool_dtype)
    return FoldKvCache(model, max_batch=batch, max_tokens=int(capacity), kv_format=spec.format, dtype=dtype,
                       page_size=s.page_size, attention=spec.backend, backend=s.kernel_backend, poison=s.poison,
                       scatter_seed=s.scatter_seed, fp8_math=spec.fp8_math)


# --- loading and walking -------------------------------------------------------------------------------------------

def load_model(model_path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
               attn_implementation: str = "sdpa") -> nn.Module:
    """A Gemma 4 from a checkpoint directory (config.json + safetensors), in eval mode on `device`.

    A text checkpoint (`gemma4_text`) loads as `Gemma4ForCausalLM`; a multimodal one (`gemma4`) through
    `AutoModelForCausalLM` (its text tower is the same Gemma4TextModel, served the same way)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma4ForCausalLM

    if attn_implementation.startswith("foldkv"):
        import foldkv.hf  # noqa: F401  (registers the foldkv implementations before from_pretrained looks them up)
    device = check_device(device)  # before reading any weights
    cfg = AutoConfig.from_pretrained(os.fspath(model_path))
    cls = Gemma4ForCausalLM if cfg.model_type == "gemma4_text" else AutoModelForCausalLM
    model = cls.from_pretrained(os.fspath(model_path), dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()


def forward_logits(model: nn.Module, ids: torch.Tensor, *, cache=None, keep: int = 1) -> torch.Tensor:
    """Logits [keep, V] float32 of the last `keep` positions after feeding `ids` [T] (one sequence) to the model,
    after what `cache` holds (positions follow from the cache; None: a fresh single pass)."""
    dev = next(model.parameters()).device
    ids = ids.to(dev).reshape(1, -1)
    kw = {cache_keyword(model): cache} if cache is not None else {}
    out = model(input_ids=ids, use_cache=cache is not None, logits_to_keep=keep, **kw)
    return out.logits[0, -keep:].float()


@dataclass
class Walk:
    """A prefill of L prompt tokens then `steps` decode steps: logits [steps + 1, V] (row 0 from the prefill, row s
    after feeding token fed[s-1] at position L + s - 1), float32 on the model's device. `cache` is the cache the walk
    filled (a FoldKvCache's pools hold what the arm stored)."""

    arm: str
    logits: torch.Tensor
    fed: torch.Tensor  # [steps] int64 (CPU)
    attention: str  # "model", or the FoldKvCache's attention: "kernel" | "reference"
    cache: Any = None


@torch.no_grad()
def walk(model: nn.Module, arm: str, prompt: torch.Tensor, steps: int, feed: torch.Tensor | None = None,
         settings: ArmSettings | None = None) -> Walk:
    """Prefill `prompt` [L] then decode `steps` tokens one at a time, through `arm`'s implementation and cache. Without
    `feed` the walk is greedy (each step feeds the previous step's argmax); with it, every arm is fed the same tokens
    (teacher forcing), so all arms' logits are at the same positions for the same inputs."""
    prompt = prompt.reshape(-1).cpu()
    n = prompt.numel()
    if feed is not None and feed.numel() < steps:
        raise ValueError(f"feed holds {feed.numel()} tokens for {steps} steps")
    spec = model_arm(arm)
    check_arm_available(spec, next(model.parameters()).device)
    with serving(model, spec):
        cache = arm_cache(model, spec, n + steps, settings)
        rows = [forward_logits(model, prompt, cache=cache)[-1]]
        fed = []
        for s in range(steps):
            tok = int(feed[s]) if feed is not None else int(torch.argmax(rows[-1]))
            fed.append(tok)
            rows.append(forward_logits(model, torch.tensor([tok]), cache=cache)[-1])
    return Walk(spec.name, torch.stack(rows), torch.tensor(fed, dtype=torch.long),
                getattr(cache, "attention", "model"), cache)


@torch.no_grad()
def single_pass(model: nn.Module, tokens: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits [keep, V] of the last `keep` positions of one prefill over all of `tokens` through the model's own
    attention, without a cache: the incumbent walk's rows computed in one pass instead of step by step."""
    incumbent_implementation(model)
    return forward_logits(model, tokens.reshape(-1).cpu(), cache=None, keep=keep)
