"""What a FoldKvCache saves against transformers' DynamicCache in `model.generate()` (notebook 05's CPU sections): the
global layers' cache bytes computed for a geometry (the 31B) at a context, and those bytes checked against the caches a
generation really holds (a tiny synthetic Gemma 4). The full-size model's timings are `foldkv.lab.model_decode`'s.

Bytes. A DynamicCache global layer keeps K and V, each [B, Hkv, T, D] in the model dtype: per token and KV head 2D
elements, the split row (`byte_floor.step_bytes(geom, SPLIT, ...)["kv"]`, unpaged: it holds exactly the T tokens
seen). A FoldKvCache global layer allocates its pool when it is made: per sequence the whole pages of `max_tokens`
(`byte_floor.pool_bytes`), split rows (2D) or folded rows (D + R: 640 of 1024 columns at the 31B geometry).

Arms (`GENERATE_ARMS`): `sdpa` (transformers' own attention for Gemma 4 and its DynamicCache), `flash_attention_2`
(the same with FlashAttention 2, when installed), `foldkv-folded` / `foldkv-split` (attn_implementation "foldkv",
whose sliding layers run sdpa, with a FoldKvCache: the generated kernels on CUDA, the float64 reference elsewhere).
Every arm runs the same `model.generate()`: greedy, `min_new_tokens = max_new_tokens` (no early stop), the prompt
prefilled in chunks of `prefill_chunk` tokens (generate's `prefill_chunk_size`). Timing: a stopping criterion stamps
the clock after every generated token (after a CUDA synchronize), so one generate gives the prefill time (start to
the first token) and the decode time (first to last token).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..config import AttentionGeometry
from .byte_floor import pool_bytes, step_bytes
from ..layout import KvFormat
from .arms import ArmUnavailable
from .model import cache_keyword, check_arm_available, foldkv_implementation, incumbent_implementation
from .palette import Styles, legend_right_of

GIB = 2**30


@dataclass(frozen=True)
class GenerateArm:
    name: str
    implementation: str  # the attention implementation the incumbent model is switched to ("sdpa": its own)
    format: KvFormat | None  # None: transformers' DynamicCache


GENERATE_ARMS: dict[str, GenerateArm] = {
    "sdpa": GenerateArm("sdpa", "sdpa", None),
    "flash_attention_2": GenerateArm("flash_attention_2", "flash_attention_2", None),
    "foldkv-folded": GenerateArm("foldkv-folded", "foldkv", KvFormat.FOLDED),
    "foldkv-split": GenerateArm("foldkv-split", "foldkv", KvFormat.SPLIT),
}


def generate_arm(name: str) -> GenerateArm:
    try:
        return GENERATE_ARMS[name]
    except KeyError:
        raise ValueError(f"unknown arm {name!r}; expected one of {list(GENERATE_ARMS)}") from None


# --- bytes, computed ------------------------------------------------------------------------------------------------

def dynamic_cache_bytes(geom: AttentionGeometry, tokens: int, *, batch: int = 1, dtype: torch.dtype = torch.bfloat16,
                        layers: int | None = None) -> int:
    """Bytes of a DynamicCache's global layers holding `tokens` tokens for each of `batch` sequences: K and V of D
    each per token and KV head, the split row, unpaged."""
    layers = geom.num_global_layers if layers is None else layers
    return step_bytes(geom, KvFormat.SPLIT, [int(tokens)] * batch, dtype=dtype)["kv"] * layers


def foldkv_cache_bytes(geom: AttentionGeometry, fmt: KvFormat | str, max_tokens: int, *, batch: int = 1,
                       page_size: int = 64, dtype: torch.dtype = torch.bfloat16, layers: int | None = None) -> int:
    """Bytes of a FoldKvCache's global-layer pools for `batch` sequences of up to `max_tokens` tokens (whole pages)."""
    layers = geom.num_global_layers if layers is None else layers
    return batch * pool_bytes(geom, fmt, int(max_tokens), page_size=page_size, dtype=dtype, layers=layers)


def cache_bytes_rows(geom: AttentionGeometry, contexts: Sequence[int], *, batch: int = 1,
                     page_size: int = 64) -> list[dict]:
    """One row per context: the global layers' cache bytes of a DynamicCache, a split and a folded FoldKvCache
    holding that context (bf16), and what the folded one saves."""
    rows = []
    for n in contexts:
        dyn = dynamic_cache_bytes(geom, n, batch=batch)
        split = foldkv_cache_bytes(geom, KvFormat.SPLIT, n, batch=batch, page_size=page_size)
        folded = foldkv_cache_bytes(geom, KvFormat.FOLDED, n, batch=batch, page_size=page_size)
        rows.append({"context": int(n), "batch": batch, "layers": geom.num_global_layers, "dynamic_bytes": dyn,
                     "split_bytes": split, "folded_bytes": folded, "folded_over_dynamic": folded / dyn,
                     "saved_bytes": dyn - folded})
    return rows


# --- bytes, measured on a generation's caches ---------------------------------------------------------------------

def held_cache_bytes(cache) -> int:
    """Bytes the global layers of `cache` hold: a FoldKvCache's pools, or a DynamicCache's full-attention layers'
    keys and values (the sliding layers are the same in both and left out)."""
    from ..hf import FoldKvCache

    if isinstance(cache, FoldKvCache):
        return cache.pool_bytes()
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def expected_cache_bytes(geom: AttentionGeometry, arm: str, *, batch: int, stored_tokens: int, max_tokens: int,
                         page_size: int, dtype: torch.dtype, layers: int) -> int:
    """What `held_cache_bytes` must read after a generation, by the formulas above: a DynamicCache holds the stored
    tokens, a FoldKvCache's pools the whole pages of max_tokens."""
    spec = generate_arm(arm)
    if spec.format is None:
        return dynamic_cache_bytes(geom, stored_tokens, batch=batch, dtype=dtype, layers=layers)
    return foldkv_cache_bytes(geom, spec.format, max_tokens, batch=batch, page_size=page_size, dtype=dtype,
                              layers=layers)


def check_cache_bytes(results: Sequence[dict]) -> list[str]:
    """Failures (empty: passed): every measured run whose held cache bytes differ from the computed ones."""
    bad = []
    for r in results:
        if r.get("status") == "ran" and r["cache_bytes"] != r["expected_cache_bytes"]:
            bad.append(f"{r['arm']} at {r['prompt_tokens']} tokens x batch {r['batch']}: the cache holds"
                       f" {r['cache_bytes']:,} bytes, the formula says {r['expected_cache_bytes']:,}")
    return bad


# --- one generation, measured ---------------------------------------------------------------------------------------

def step_clock(device: torch.device):
    """A generate() stopping criterion that never stops: `.stamps`, the time (perf_counter seconds) each generated
    token existed. On CUDA the first call synchronizes (the prompt's token: its stamp is a host time) and every later
    call records a CUDA event in stream order, without a sync, so a loop that keeps the GPU a step ahead of the host
    (`foldkv.hf_loop`) is timed as it runs; `.stamps` (read after generate() returns) synchronizes once and places
    each event after the first stamp by the events' elapsed times. Elsewhere each call stamps the host clock."""
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self):
            self._host: list[float] = []
            self._events: list = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
            if device.type == "cuda":
                if not self._events:
                    torch.cuda.synchronize(device)
                    self._host.append(time.perf_counter())
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(device))
                self._events.append(event)
            else:
                self._host.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        @property
        def stamps(self) -> list[float]:
            if not self._events:
                return list(self._host)
            self._events[-1].synchronize()
            first = self._events[0]
            return [self._host[0] + first.elapsed_time(e) / 1e3 for e in self._events]

    return StepClock()


def prompt_ids(batch: int, tokens: int, vocab: int, *, seed: int = 0) -> torch.Tensor:
    """[batch, tokens] int64 random ids in [3, vocab) (0-2 are pad / eos / bos), one generator per seed."""
    return torch.randint(3, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _make_cache(model: nn.Module, spec: GenerateArm, batch: int, max_tokens: int, page_size: int):
    if spec.format is None:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from ..hf import FoldKvCache

    return FoldKvCache(model, max_batch=batch, max_tokens=max_tokens, kv_format=spec.format, page_size=page_size)


def arm_available(model: nn.Module, arm: str) -> None:
    """Raise ArmUnavailable (with the reason) when `arm` cannot run on this model's device."""
    spec = generate_arm(arm)
    device = next(model.parameters()).device
    if spec.implementation == "flash_attention_2":
        import importlib.util

        if device.type != "cuda":
            raise ArmUnavailable("FlashAttention 2 runs on CUDA")
        if importlib.util.find_spec("flash_attn") is None:
            raise ArmUnavailable("flash_attn is not installed")
    if spec.format is not None and device.type == "cuda":
        check_arm_available("folded", device)  # the kernels import


@torch.no_grad()
def measure_generation(model: nn.Module, arm: str, *, prompt_tokens: int, batch: int, new_tokens: int,
                       prefill_chunk: int, page_size: int = 64, seed: int = 0) -> dict:
    """One greedy generate() of `new_tokens` tokens for `batch` random prompts of `prompt_tokens` tokens through `arm`:
    prefill and decode time, tokens/s, peak memory above what was allocated before (CUDA only; None elsewhere), the
    cache bytes held and the bytes the formulas expect, and the tokens. Raises what generate raises."""
    from ..hf import global_geometry, global_layer_indices, text_model_of

    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens}: decode speed needs at least 2 generated tokens")
    spec = generate_arm(arm)
    own = incumbent_implementation(model)
    device = next(model.parameters()).device
    text = text_model_of(model)
    glob = global_layer_indices(text)
    geom = global_geometry(text, text.layers[glob[0]].self_attn)
    ids = prompt_ids(batch, prompt_tokens, int(model.config.vocab_size), seed=seed).to(device)
    impl = foldkv_implementation(own) if spec.implementation == "foldkv" else spec.implementation
    max_tokens = prompt_tokens + new_tokens
    clock = step_clock(device)
    if impl != own:
        if spec.format is not None:
            import foldkv.hf  # noqa: F401  (registers the foldkv implementations)
        model.set_attn_implementation(impl)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        cache = _make_cache(model, spec, batch, max_tokens, page_size)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=prefill_chunk,
                             stopping_criteria=[clock], **{cache_keyword(model): cache})
        peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    finally:
        if impl != own:
            model.set_attn_implementation(own)
    stamps = clock.stamps
    if len(stamps) != new_tokens:
        raise RuntimeError(f"{arm}: the clock stamped {len(stamps)} tokens of {new_tokens}")
    prefill_s, decode_s = stamps[0] - t0, stamps[-1] - stamps[0]
    # each decode step's own time: a mean that moved is a uniform slowdown if the median moved with it, a few slow
    # steps (an allocation, a re-plan) if only the maximum did
    steps_ms = sorted(1e3 * (b - a) for a, b in zip(stamps, stamps[1:]))
    cache_dtype = next(model.parameters()).dtype if spec.format is None else cache.pool_dtype
    return {
        "arm": arm, "status": "ran", "implementation": impl, "prompt_tokens": prompt_tokens, "batch": batch,
        "new_tokens": new_tokens, "prefill_chunk": prefill_chunk, "device": str(device),
        "prefill_s": prefill_s, "decode_s": decode_s, "total_s": stamps[-1] - t0,
        "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else None,
        "decode_step_ms_p50": steps_ms[len(steps_ms) // 2], "decode_step_ms_max": steps_ms[-1],
        "end_to_end_tokens_per_s": batch * new_tokens / (stamps[-1] - t0),
        "prefill_tokens_per_s": batch * prompt_tokens / prefill_s,
        "peak_bytes": peak,
        "cache_bytes": held_cache_bytes(cache),
        "expected_cache_bytes": expected_cache_bytes(
            geom, arm, batch=batch, stored_tokens=prompt_tokens + new_tokens - 1, max_tokens=max_tokens,
            page_size=page_size, dtype=cache_dtype, layers=len(glob)),
        "tokens": out[:, prompt_tokens:].cpu().tolist(),
    }


def run_generate_bench(model: nn.Module, *, arms: Sequence[str], prompt_lengths: Sequence[int],
                       batches: Sequence[int], new_tokens: int, prefill_chunk: int, page_size: int = 64,
                       seed: int = 0, warmup_tokens: int = 256, log: Callable[[str], None] = print) -> dict:
    """Every (arm, prompt length, batch) cell, after one small warm-up generation per arm (builds or loads the
    kernels, so no cell times a compile). An arm that cannot run here is "not run: <why>"; a cell that fails (out of
    memory, an unsupported shape) is "failed: <error>" and the bench goes on. Returns {"arm_status", "runs"}."""
    status: dict[str, str] = {}
    runs: list[dict] = []
    for arm in arms:
        try:
            arm_available(model, arm)
            measure_generation(model, arm, prompt_tokens=min(warmup_tokens, min(prompt_lengths)), batch=1,
                               new_tokens=2, prefill_chunk=prefill_chunk, page_size=page_size, seed=seed)
            status[arm] = "ran"
        except ArmUnavailable as exc:
            status[arm] = f"not run: {exc}"
        except Exception as exc:  # the arm cannot generate at all here: recorded, the others go on
            status[arm] = f"failed: {type(exc).__name__}: {exc}"
        log(f"{arm}: {status[arm]}")
    for n in prompt_lengths:
        for b in batches:
            for arm in arms:
                if status[arm] != "ran":
                    continue
                t0 = time.perf_counter()
                try:
                    r = measure_generation(model, arm, prompt_tokens=n, batch=b, new_tokens=new_tokens,
                                           prefill_chunk=prefill_chunk, page_size=page_size, seed=seed)
                except Exception as exc:  # out of memory, a shape the attention refuses: the cell says so
                    r = {"arm": arm, "prompt_tokens": n, "batch": b, "new_tokens": new_tokens,
                         "status": f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}",
                         "traceback": traceback.format_exc(limit=4)}
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                runs.append(r)
                peak = "n/a" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / GIB:.2f} GiB"
                said = (f"prefill {r['prefill_s']:.2f} s, decode {r['decode_tokens_per_s']:.1f} tok/s, peak {peak}"
                        if r["status"] == "ran" else r["status"])
                log(f"  {arm} {n} tokens x {b}: {said} ({time.perf_counter() - t0:.1f} s)")
    agree_with_first(runs)
    return {"arm_status": status, "runs": runs}


def foldkv_failures(bench: dict) -> list[str]:
    """What fails a measured section: a foldkv arm that could not generate at all, or a cell of one that failed.
    transformers' own arms failing (out of memory, a head_dim an attention refuses) are findings, shown, not failures."""
    bad = [f"{a}: {s}" for a, s in bench["arm_status"].items()
           if s.startswith("failed") and generate_arm(a).format is not None]
    bad += [f"{r['arm']} at {r['prompt_tokens']} tokens x {r['batch']}: {r['status']}" for r in bench["runs"]
            if r["status"] != "ran" and generate_arm(r["arm"]).format is not None]
    return bad


def agree_with_first(runs: list[dict]) -> None:
    """Per run, `agrees_with`: the first arm that ran its cell, and `agreed_steps`: per sequence the generated steps
    before the first token that differs from that arm's (bf16 arithmetic orders differ, so a near-tie may diverge)."""
    first: dict[tuple, dict] = {}
    for r in runs:
        if r.get("status") != "ran":
            continue
        key = (r["prompt_tokens"], r["batch"])
        base = first.setdefault(key, r)
        r["agrees_with"] = base["arm"]
        same = torch.tensor(r["tokens"]) == torch.tensor(base["tokens"])
        r["agreed_steps"] = torch.cumprod(same.int(), dim=1).sum(1).tolist()


# --- tables and plots -----------------------------------------------------------------------------------------------


def bytes_table(rows: Sequence[dict]) -> str:
    from .report import markdown_table

    shown = [dict(r, dynamic_gib=r["dynamic_bytes"] / GIB, split_gib=r["split_bytes"] / GIB,
                  folded_gib=r["folded_bytes"] / GIB, saved_gib=r["saved_bytes"] / GIB) for r in rows]
    return markdown_table(shown, {"context": "context (tokens)", "batch": "batch", "dynamic_gib": "DynamicCache GiB",
                                  "split_gib": "FoldKvCache split GiB", "folded_gib": "FoldKvCache folded GiB",
                                  "folded_over_dynamic": "folded / DynamicCache", "saved_gib": "saved GiB"},
                          {"context": ",d", "dynamic_gib": ".2f", "split_gib": ".2f", "folded_gib": ".2f",
                           "folded_over_dynamic": ".4f", "saved_gib": ".2f"})


def runs_table(runs: Sequence[dict], columns: str = "speed") -> str:
    """Markdown of the measured runs: "speed" (prefill s, tokens/s, agreement) or "memory" (peak and cache bytes)."""
    from .report import markdown_table

    shown = []
    for r in runs:
        row = {"arm": r["arm"], "prompt": r["prompt_tokens"], "batch": r["batch"], "status": r["status"]}
        if r["status"] == "ran":
            row.update(prefill_s=r["prefill_s"], decode=r["decode_tokens_per_s"], e2e=r["end_to_end_tokens_per_s"],
                       step_ms=f"{r['decode_step_ms_p50']:.2f} / {r['decode_step_ms_max']:.2f}"
                       if "decode_step_ms_p50" in r else "n/a",
                       peak_gib=r["peak_bytes"] / GIB if r["peak_bytes"] is not None else "n/a (no CUDA)",
                       cache_gib=r["cache_bytes"] / GIB, agreed=f"{min(r['agreed_steps'])}/{r['new_tokens']}"
                       f" vs {r['agrees_with']}")
        shown.append(row)
    if columns == "memory":
        cols = {"arm": "arm", "prompt": "prompt tokens", "batch": "batch", "peak_gib": "peak GiB above the model",
                "cache_gib": "global-layer cache GiB", "status": "status"}
    else:
        cols = {"arm": "arm", "prompt": "prompt tokens", "batch": "batch", "prefill_s": "prefill s",
                "decode": "decode tokens/s", "step_ms": "decode step ms (median / max)",
                "e2e": "end-to-end tokens/s", "agreed": "same tokens (min steps)",
                "status": "status"}
    return markdown_table(shown, cols, {"prompt": ",d", "prefill_s": ".2f", "decode": ".1f", "e2e": ".1f",
                                        "peak_gib": ".2f", "cache_gib": ".3f"})


def plot_cache_bytes(rows: Sequence[dict], path: str | None = None):
    """The global layers' cache against context: transformers' DynamicCache (the incumbent's black) and a
    FoldKvCache's split and folded pools (their formats' palette colours), log-log; saved to `path` when given."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
    st = Styles()
    x = [r["context"] for r in rows]
    # DynamicCache holds the split pool's bytes: drawn wide and pale under it, so both lines show
    for key, label, name, over in (("dynamic_bytes", "DynamicCache (K and V)", "dynamic-cache",
                                    dict(linewidth=6, markersize=11, alpha=0.35)),
                                   ("split_bytes", "FoldKvCache split", "split", {}),
                                   ("folded_bytes", "FoldKvCache folded", "folded", {})):
        ax.plot(x, [r[key] / GIB for r in rows], label=label, **st.line(name, **over))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GiB, all global layers")
    ax.set_title(f"global-layer cache, batch {rows[0]['batch']}, {rows[0]['layers']} global layers (computed)")
    ax.grid(True, which="both", alpha=0.3)
    legend_right_of(ax)
    if path:
        fig.savefig(path, dpi=90)
    return fig
