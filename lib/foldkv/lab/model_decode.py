"""`generate()` on a whole model, timed per token against its byte floor (notebook 05's GPU sections): the arms, the
cells, the caches filled to a context without a prefill, the floor, the host's share of a step, the largest batch.

Arms (`MODEL_ARMS`): foldkv's FoldKvCache in three pools (folded bf16, folded FP8, split bf16), each decoding through
its one CUDA graph per step (`decode_step="graph"`); FlashInfer's paged prefill and decode as the global layers'
attention on the split pool, in the same one-graph step (`foldkv.lab.flashinfer_model`); foldkv folded with the
per-layer eager step (what the graph replaces); transformers' own sdpa attention with its DynamicCache; and
transformers' fastest path, its static cache with generate()'s automatic compile (`measure_static_compile`: a real
prompt, one cell, its compile timed).

A decode cell starts from caches that already hold `context` tokens per sequence, written directly (`fill_cache`:
random rows in the global pools or K/V tensors, random K/V in the sliding layers' windows) instead of prefilled: a
128K-token prefill of the 31B takes ~20 s a sequence, and a decode step's time depends on the lengths it reads, not on
the values. Then `generate()` is called with `context + 1` prompt tokens: transformers feeds only the one not in the
cache, and every step after is a decode step (the first one captures foldkv's graph and is not timed). The greedy
tokens of such cells are not compared across arms (their caches hold different random values); the prefill cells
(`measure_prefill`: a real prompt through every arm) are.

Per decode cell: TPOT (median and p90 of the step intervals after the first), decode tokens/s, peak memory by component
(weights, cache, decode workspace, the rest: activations and the graph's pool), the host's time per step (TPOT minus
the device time of one step, that time measured by replaying the arm's graph between CUDA events), and the byte
floor: (weights + the KV the step reads) / the streaming read measured in the same process.

Prefill memory (`measure_prefill_tail`): a long batch's prefill is chunked, and its last chunk is its peak (the
chunk's activations over a cache that is nearly full), so a cache filled to `context - chunk` tokens a sequence takes
that last chunk through generate(): its time and its peak memory by component are what a real prefill of the whole
batch peaks at.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..fp8 import FP8_DTYPE
from ..layout import KvFormat
from .generate_bench import step_clock
from .model import cache_keyword

GIB = 2**30


@dataclass(frozen=True)
class ModelArm:
    name: str
    implementation: str  # "foldkv" or transformers' "sdpa"
    format: KvFormat | None  # None: transformers' DynamicCache
    dtype: torch.dtype = torch.bfloat16
    decode_step: str = "graph"
    peer: str | None = None  # "flashinfer": the global layers' attention is FlashInfer's (foldkv.lab.flashinfer_model)


MODEL_ARMS: dict[str, ModelArm] = {
    "foldkv-folded": ModelArm("foldkv-folded", "foldkv", KvFormat.FOLDED),
    "foldkv-fp8": ModelArm("foldkv-fp8", "foldkv", KvFormat.FOLDED, FP8_DTYPE),
    "foldkv-split": ModelArm("foldkv-split", "foldkv", KvFormat.SPLIT),
    "flashinfer": ModelArm("flashinfer", "foldkv", KvFormat.SPLIT, peer="flashinfer"),
    "foldkv-folded-eager": ModelArm("foldkv-folded-eager", "foldkv", KvFormat.FOLDED, decode_step="eager"),
    "sdpa": ModelArm("sdpa", "sdpa", None),
}


def model_arm(name: str) -> ModelArm:
    try:
        return MODEL_ARMS[name]
    except KeyError:
        raise ValueError(f"unknown arm {name!r}; expected one of {list(MODEL_ARMS)}") from None


def _fresh_memory(dev: torch.device) -> int:
    """Free the previous cell's caches (a FoldKvCache and its decode step refer to each other: only the cyclic
    collector frees them), reset the peak counter; returns the bytes allocated now."""
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


@contextlib.contextmanager
def serving(model: nn.Module, arm: ModelArm) -> Iterator[None]:
    """The model switched to `arm`'s attention implementation (foldkv's registered first), switched back on exit."""
    own = model.config._attn_implementation
    if arm.implementation == own:
        yield
        return
    if arm.format is not None:
        import foldkv.hf  # noqa: F401  (registers "foldkv")
    model.set_attn_implementation(arm.implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def make_cache(model: nn.Module, arm: ModelArm, batch: int, max_tokens: int):
    if arm.format is None:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if arm.peer == "flashinfer":
        from .flashinfer_model import FlashInferCache as cache_class
    else:
        from ..hf import FoldKvCache as cache_class

    return cache_class(model, max_batch=batch, max_tokens=max_tokens, kv_format=arm.format, dtype=arm.dtype,
                       decode_step=arm.decode_step)


def memory_components(cache, peak: int, weights: int) -> dict:
    """Peak memory of a cell by component, bytes: the model's weights, the cache (global pools or K/V, the sliding
    layers' windows or rings), the decode step's workspace (foldkv's DecodeWorkspace or FlashInfer's buffers), and
    the rest of the peak above the weights (activations, logits, the graph's pool). `peak`: above the weights."""
    seen: set[int] = set()

    def nbytes(*tensors) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                n += t.untyped_storage().nbytes()
        return n

    cache_b = 0
    for layer in cache.layers:
        pool = getattr(layer, "pool", None)
        cache_b += nbytes(pool.data, pool.scales) if pool is not None else nbytes(getattr(layer, "keys", None),
                                                                                  getattr(layer, "values", None))
    step = getattr(cache, "decode_step", None)
    work_b = 0
    if step is not None and step.started:
        cache_b += nbytes(*[t for ring in step.rings.values() for t in ring])
        ws = step.ws
        if ws is not None:
            work_b += nbytes(*[v for v in vars(ws).values() if isinstance(v, torch.Tensor)])
        work_b += nbytes(*[v for k, v in vars(step).items() if k.startswith("fi_") and isinstance(v, torch.Tensor)])
        work_b += nbytes(*[t for k, v in vars(step).items() if k == "fi_buffers" for t in v])
    prefill = getattr(cache, "_fi_prefill", None)  # FlashInfer's prefill workspace (foldkv.lab.flashinfer_model)
    if prefill is not None:
        work_b += nbytes(prefill[2])
    return {"weights": weights, "cache": cache_b, "workspace": work_b,
            "activations": max(0, peak - cache_b - work_b), "peak": weights + peak}


# --- caches at a context without a prefill --------------------------------------------------------------------------

@torch.no_grad()
def fill_cache(cache, model: nn.Module, context: int, batch: int, *, seed: int = 0) -> None:
    """Make `cache` hold `context` tokens for each of `batch` sequences (no padding) as a prefill would leave it, with
    random values: each global pool's rows (an FP8 pool: e4m3 values, positive scales) or DynamicCache K/V, and each
    sliding layer's last sliding_window - 1 K/V."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from ..hf import FoldKvCache, FoldKvLayer, local_rows, text_model_of

    text = text_model_of(model)
    cfg = text.config
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=dtype)

    if isinstance(cache, FoldKvCache):
        cache.batch = batch
    for i, layer in enumerate(cache.layers):
        attn = text.layers[i].self_attn
        if isinstance(layer, FoldKvLayer):
            pool = layer.pool
            for start in range(0, pool.data.shape[0], 1024):  # page blocks: no float32 copy of the whole pool
                block = pool.data[start:start + 1024]
                block.copy_(torch.randn(block.shape, generator=g, device=dev).to(block.dtype))
                if pool.scales is not None:
                    pool.scales[start:start + 1024].uniform_(0.002, 0.02, generator=g)
            layer.lengths[:batch] = [context] * batch
            layer.host_table.seq_lens[:batch] = context
            layer.device_table.seq_lens[:batch] = context
            layer.columns = context
        elif isinstance(layer, DynamicSlidingWindowLayer) or getattr(layer, "is_sliding", False):
            n = min(context, int(cfg.sliding_window) - 1)
            hkv = local_rows(attn.k_proj) // attn.head_dim  # this rank's heads under tensor parallelism
            layer.update(rand(batch, hkv, n, attn.head_dim), rand(batch, hkv, n, attn.head_dim))
            layer.cumulative_length = context
        else:  # a DynamicCache's full-attention layer
            hkv = local_rows(attn.k_proj) // attn.head_dim
            layer.update(rand(batch, hkv, context, attn.head_dim), rand(batch, hkv, context, attn.head_dim))


def filled_prompt(cache, model: nn.Module, context: int, batch: int, *, seed: int = 0) -> torch.Tensor:
    """`cache` filled to `context` tokens a sequence (`fill_cache`) and the prompt a decode cell gives generate() over
    it: `context + 1` random ids a sequence [batch, context + 1], of which transformers feeds only the last."""
    fill_cache(cache, model, context, batch, seed=seed)
    dev = next(model.parameters()).device
    return torch.randint(3, int(model.config.vocab_size), (batch, context + 1), device=dev,
                         generator=torch.Generator(device=dev).manual_seed(seed + 1))


def step_kv_bytes(model: nn.Module, arm: ModelArm, context: int, batch: int) -> int:
    """Bytes of KV one decode step reads at `context` tokens a sequence (the new token included): the global layers'
    rows of the arm's format and dtype (a DynamicCache: K and V of the model dtype), and the sliding layers' window;
    under tensor parallelism, this rank's heads (`kv_bytes_read` over the model's own modules)."""
    from ..hf import global_geometry, global_layer_indices, local_rows, text_model_of

    text = text_model_of(model)
    cfg = text.config
    glob = global_layer_indices(text)
    geom = global_geometry(text, text.layers[glob[0]].self_attn)
    widths = [local_rows(text.layers[i].self_attn.k_proj) for i, t in enumerate(cfg.layer_types)
              if t == "sliding_attention"]
    return kv_bytes_read(geom, arm, global_layers=len(glob), sliding_widths=widths, window=int(cfg.sliding_window),
                         elem=next(model.parameters()).element_size(), context=context, batch=batch)


def kv_bytes_read(geom, arm: ModelArm, *, global_layers: int, sliding_widths: Sequence[int], window: int, elem: int,
                  context: int, batch: int) -> int:
    """`step_kv_bytes` from the shapes alone: `geom` the global layers' (one rank's under tensor parallelism),
    `sliding_widths` each sliding layer's K width (KV heads x head_dim), `elem` the model dtype's bytes."""
    from ..pool import PagedKvLayout

    n = context + 1
    if arm.format is None:
        per_token = 2 * geom.num_kv_heads * geom.head_dim * elem
    else:
        per_token = PagedKvLayout(geom, arm.format, 64, 0, arm.dtype).bytes_per_token
    return global_layers * batch * n * per_token + sum(batch * min(n, window) * 2 * w * elem for w in sliding_widths)


# --- one decode cell ------------------------------------------------------------------------------------------------

def _device_step_ms(cache, reps: int = 20) -> float | None:
    """Median device time of one replay of a FoldKvCache's decode graph (None: the arm has none), each replay preceded
    by the host's part of a step (`host_advance`: the workspace's advance(), FlashInfer's plan), untimed. The cache must have `reps` tokens of headroom left."""
    step = getattr(cache, "decode_step", None)
    if step is None or getattr(step, "graph", None) is None:
        return None
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step.host_advance()
        a.record()
        step.graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def measure_decode(model: nn.Module, arm_name: str, *, context: int, batch: int, new_tokens: int, read_gbps: float,
                   seed: int = 0, replay_reps: int = 20) -> dict:
    """One decode cell (module docstring). Raises what generate raises (out of memory: the caller records it)."""
    from .gemma31b import weight_bytes

    arm = model_arm(arm_name)
    dev = next(model.parameters()).device
    with serving(model, arm):
        before = _fresh_memory(dev)
        cache = make_cache(model, arm, batch, context + 1 + new_tokens + replay_reps)
        ids = filled_prompt(cache, model, context, batch, seed=seed)
        clock = step_clock(dev)
        from ..fused_step import merged_groups

        step = cache.decode_step
        thin0 = step.loop_steps["thin"] if step is not None else 0
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, stopping_criteria=[clock],
                             **{cache_keyword(model): cache})
        thin_steps = (step.loop_steps["thin"] if step is not None else 0) - thin0
        peak = torch.cuda.max_memory_allocated(dev) - before
        memory = memory_components(cache, peak, weight_bytes(model))
        device_ms = _device_step_ms(cache, replay_reps) if arm.format is not None else None
    stamps = clock.stamps
    steps_ms = sorted(1e3 * (b - a) for a, b in zip(stamps[1:], stamps[2:]))  # after the first (capturing) step
    tpot = steps_ms[len(steps_ms) // 2]
    p90 = steps_ms[min(len(steps_ms) - 1, int(0.9 * len(steps_ms)))]
    wbytes, kvbytes = weight_bytes(model), step_kv_bytes(model, arm, context, batch)
    floor_ms = 1e3 * (wbytes + kvbytes) / (read_gbps * 1e9)
    replays = sorted(step.host_s[1:]) if step is not None else []  # host seconds of each replayed step's call
    del cache
    return {
        "arm": arm_name, "status": "ran", "context": context, "batch": batch, "new_tokens": new_tokens,
        "tpot_ms": tpot, "tpot_p90_ms": p90, "steps_timed": len(steps_ms), "first_step_ms": 1e3 * (stamps[1] - stamps[0]),
        "decode_tokens_per_s": 1e3 * batch / tpot, "peak_bytes": peak, "memory": memory,
        "device_step_ms": device_ms, "host_ms": None if device_ms is None else tpot - device_ms,
        "host_share": None if device_ms is None else (tpot - device_ms) / tpot,
        "capture_s": None if step is None else step.capture_s,
        "step_call_ms": 1e3 * replays[len(replays) // 2] if replays else None,
        "weight_bytes": wbytes, "kv_bytes": kvbytes, "floor_ms": floor_ms, "tpot_over_floor": tpot / floor_ms,
        "generate_s": stamps[-1] - t0, "tokens": out[:, context + 1:].cpu().tolist(),
        "thin_loop_steps": thin_steps,  # decode steps generate() ran through foldkv.hf_loop's thin path
        "merged_groups": merged_groups(model),  # projection groups the step read with one GEMV
    }


PROMPT_RANGE = "foldkv.prompt"  # `measure_prefill`'s generate() in a profile


def token_gaps(stamps: Sequence[float], spike: float = 2.0, largest: int = 5) -> dict | None:
    """The decode's gaps between generated tokens (ms; None with fewer than two stamps): median, p90, max, the first
    (the first decode step: a captured step's capture), how many exceed `spike` x the median, and the `largest` gaps
    as (index of the token it ends at, ms). Where a slow decode's time goes: a periodic host wait shows as spikes at
    its period, a slower step as a higher median."""
    if len(stamps) < 2:
        return None
    from .bench.stats import summarize

    gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]  # gaps[i] ends at token i + 1
    s = summarize(gaps)
    ranked = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:largest]
    return {"median_ms": s["median"], "p90_ms": s["p90"], "max_ms": s["max"], "first_ms": gaps[0],
            "spikes": sum(g > spike * s["median"] for g in gaps), "spike_factor": spike,
            "largest": [(i + 1, gaps[i]) for i in ranked]}


@torch.no_grad()
def measure_prefill(model: nn.Module, arm_name: str, *, prompt_tokens: int, new_tokens: int, prefill_chunk: int,
                    seed: int = 0, batch: int = 1) -> dict:
    """`batch` real random prompts of `prompt_tokens` tokens through `arm_name`, prefilled in chunks of
    `prefill_chunk` (generate()'s prefill_chunk_size), `new_tokens` greedy tokens after: TTFT (the call to the first
    token), the call to the last token (`generate_s`), the decode's gaps between tokens (`token_gaps`), peak memory by
    component, the first sequence's tokens, and the cache's creation (`cache_s`, outside TTFT: what a FoldKvCache does
    ahead, its prefill's kernels resolved and warmed, is paid there)."""
    from .gemma31b import weight_bytes

    arm = model_arm(arm_name)
    dev = next(model.parameters()).device
    with serving(model, arm):
        before = _fresh_memory(dev)
        t_cache = time.perf_counter()
        cache = make_cache(model, arm, batch, prompt_tokens + new_tokens)
        torch.cuda.synchronize(dev)
        cache_s = time.perf_counter() - t_cache
        ids = torch.randint(3, int(model.config.vocab_size), (batch, prompt_tokens), device=dev,
                            generator=torch.Generator(device=dev).manual_seed(seed + 2))
        clock = step_clock(dev)
        torch.cuda.synchronize(dev)  # the prompt exists before the clock starts
        t0 = time.perf_counter()
        with torch.profiler.record_function(PROMPT_RANGE):  # a profile's prompt, apart from the cache's creation
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=prefill_chunk,
                                 stopping_criteria=[clock], **{cache_keyword(model): cache})
        stamps = clock.stamps
        peak = torch.cuda.max_memory_allocated(dev) - before
        memory = memory_components(cache, peak, weight_bytes(model))
    del cache
    return {"arm": arm_name, "status": "ran", "prompt_tokens": prompt_tokens, "batch": batch,
            "new_tokens": new_tokens, "ttft_s": stamps[0] - t0, "generate_s": stamps[-1] - t0, "peak_bytes": peak,
            "token_gaps": token_gaps(stamps), "memory": memory, "tokens": out[0, prompt_tokens:].cpu().tolist(),
            "cache_s": cache_s}


@torch.no_grad()
def measure_prefill_tail(model: nn.Module, arm_name: str, *, context: int, batch: int, chunk: int,
                         seed: int = 0) -> dict:
    """The last prefill chunk of a batch of `context`-token prompts (module docstring): caches filled to
    `context - chunk` tokens a sequence, then generate() takes the prompts' last `chunk` tokens (one forward) and
    one token more. Its time (the chunk's forward) and peak memory by component."""
    from .gemma31b import weight_bytes

    arm = model_arm(arm_name)
    dev = next(model.parameters()).device
    with serving(model, arm):
        before = _fresh_memory(dev)
        cache = make_cache(model, arm, batch, context + 2)
        fill_cache(cache, model, context - chunk, batch, seed=seed)
        ids = torch.randint(3, int(model.config.vocab_size), (batch, context), device=dev,
                            generator=torch.Generator(device=dev).manual_seed(seed + 3))
        clock = step_clock(dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                       do_sample=False, stopping_criteria=[clock], **{cache_keyword(model): cache})
        peak = torch.cuda.max_memory_allocated(dev) - before
        memory = memory_components(cache, peak, weight_bytes(model))
    del cache
    return {"arm": arm_name, "status": "ran", "context": context, "batch": batch, "chunk": chunk,
            "chunk_s": clock.stamps[0] - t0, "peak_bytes": peak, "memory": memory}


@torch.no_grad()
def measure_static_compile(model: nn.Module, *, prompt_tokens: int, new_tokens: int, seed: int = 0) -> dict:
    """transformers' fastest path at one cell (batch 1): sdpa attention, its StaticCache (`cache_implementation=
    "static"`) and generate()'s automatic compile of the decode forward (torch.compile, its CUDA graphs), on a real
    prompt. TPOT over the steps after the first two (the compile happens in them: `first_steps_s`)."""
    dev = next(model.parameters()).device
    arm = ModelArm("sdpa-static-compile", "sdpa", None)
    with serving(model, arm):
        before = _fresh_memory(dev)
        ids = torch.randint(3, int(model.config.vocab_size), (1, prompt_tokens), device=dev,
                            generator=torch.Generator(device=dev).manual_seed(seed + 2))
        clock = step_clock(dev)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                             stopping_criteria=[clock])
        peak = torch.cuda.max_memory_allocated(dev) - before
    stamps = clock.stamps
    steps_ms = sorted(1e3 * (b - a) for a, b in zip(stamps[3:], stamps[4:]))
    result = {"arm": arm.name, "status": "ran", "context": prompt_tokens, "batch": 1, "new_tokens": new_tokens,
              "ttft_s": stamps[0] - t0, "first_steps_s": stamps[3] - stamps[0], "peak_bytes": peak,
              "tpot_ms": steps_ms[len(steps_ms) // 2], "tpot_p90_ms": steps_ms[min(len(steps_ms) - 1,
                                                                               int(0.9 * len(steps_ms)))],
              "steps_timed": len(steps_ms), "compiled": bool(getattr(model, "_compiled_call", None) is not None),
              "tokens": out[0, prompt_tokens:].cpu().tolist()}
    from torch import _dynamo

    _dynamo.reset()  # the compiled forward and its graphs go (the next cells run uncompiled)
    _fresh_memory(dev)
    return result


@torch.no_grad()
def step_kernels(model: nn.Module, arm_name: str = "foldkv-folded", *, context: int = 4096, batch: int = 1,
                 top: int = 12) -> list[dict]:
    """Where one decode step's device time goes: one step of `arm_name`'s fixed-address step run eagerly
    (decode_step="static": the kernels its graph replays) under torch.profiler, its kernels grouped by name, the
    `top` longest: [{"kernel", "calls", "ms", "share"}] (share of the step's kernel time)."""
    from torch.profiler import ProfilerActivity, profile

    arm = model_arm(arm_name)
    dev = next(model.parameters()).device
    with serving(model, arm):
        _fresh_memory(dev)
        from ..hf import FoldKvCache

        cache = FoldKvCache(model, max_batch=batch, max_tokens=context + 4, kv_format=arm.format, dtype=arm.dtype,
                            decode_step="static")
        fill_cache(cache, model, context, batch)
        ids = torch.randint(3, int(model.config.vocab_size), (batch, context + 1), device=dev)
        kw = {cache_keyword(model): cache}
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, **kw)  # the first steps: every kernel built
        ids = torch.cat([ids, ids[:, -2:]], 1)
        torch.cuda.synchronize(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                           **kw)
            torch.cuda.synchronize(dev)
    rows: dict[str, list] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        t = getattr(e, "cuda_time_total", 0.0) if t is None else t
        if t > 0 and e.device_type.name == "CUDA":
            rows[e.key] = [e.count, t / 1e3]
    total = sum(ms for _, ms in rows.values()) or 1.0
    out = [{"kernel": k[:90], "calls": c, "ms": ms, "share": ms / total}
           for k, (c, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])]
    return out[:top]


def sdpa_backends(head_dims: Sequence[int] = (256, 512), device: str = "cuda") -> dict:
    """Which of torch's SDPA backends run a bf16 decode query ([1, 32, 1, d] against 16 or 4 KV heads of 1,024 keys,
    with a boolean mask, as transformers' sdpa calls it at decode) at each head dim: {d: {backend: "ok" or error}}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for d in head_dims:
        q = torch.randn(1, 32, 1, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 32, 1024, d, device=device, dtype=torch.bfloat16)
        mask = torch.ones(1, 1, 1, 1024, device=device, dtype=torch.bool)
        row = {}
        for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
                row[name] = "ok"
            except Exception as exc:  # the backend refuses the shape
                row[name] = f"{type(exc).__name__}"
        out[d] = row
    return out


def cache_bytes_per_sequence(model: nn.Module, arm: ModelArm, context: int) -> int:
    """Bytes one sequence of `context` tokens holds in the arm's cache (global layers + sliding windows)."""
    return step_kv_bytes(model, arm, context - 1, 1)


def largest_batch(model: nn.Module, arm_name: str, context: int, *, free_bytes: int, margin_bytes: int,
                  limit: int = 256) -> int:
    """The largest batch of `context`-token sequences whose caches fit in `free_bytes - margin_bytes` (the margin:
    activations, logits, the graph's pool). transformers' sdpa at a decode step also holds, per sequence, one global
    layer's K/V twice (DynamicCache's concatenation) and repeated to every query head (repeat_kv: a [Hq, T, D] K and
    V), counted here."""
    from ..hf import global_geometry, global_layer_indices, text_model_of

    arm = model_arm(arm_name)
    per_seq = cache_bytes_per_sequence(model, arm, context)
    if arm.format is None:
        text = text_model_of(model)
        geom = global_geometry(text, text.layers[global_layer_indices(text)[0]].self_attn)
        elem = next(model.parameters()).element_size()
        per_seq += 2 * context * (geom.num_kv_heads + geom.num_q_heads) * geom.head_dim * elem
    return max(0, min(limit, (free_bytes - margin_bytes) // per_seq))


def parse_cell(text: str) -> tuple[int, int]:
    """A decode cell named "CONTEXT:BATCH" -> (context, batch), both positive integers (parsed once, at a command
    line: argparse's `type=`)."""
    import argparse

    try:
        context, batch = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"cell {text!r}: expected CONTEXT:BATCH, e.g. 32768:8") from None
    if context < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f"cell {text!r}: context and batch must be positive")
    return context, batch


def agreed_steps(tokens: Sequence[int], base: Sequence[int]) -> int:
    """Greedy steps of one sequence before its first token that differs from `base`'s (after a difference the two
    condition on different text, so later positions are not compared)."""
    same = [x == y for x, y in zip(tokens, base)]
    return same.index(False) if False in same else len(same)


def largest_batch_run(model: nn.Module, arm_name: str, context: int, *, free_bytes: int, margin_bytes: int,
                      read_gbps: float, seed: int = 0, tries: int = 6, everywhere: Callable[[bool], bool] = bool,
                      log: Callable[[str], None] = print) -> dict:
    """The largest batch of `context`-token sequences the arm runs: `largest_batch`'s, then one sequence fewer after
    an out-of-memory, at most `tries` batches, each a `measure_decode` cell of 12 new tokens. `everywhere`: whether
    every process ran the batch (a tensor-parallel run asks its ranks). The row: the last cell's, `computed_batch`,
    and `largest_batch` when one ran."""
    want = largest_batch(model, arm_name, context, free_bytes=free_bytes, margin_bytes=margin_bytes)
    row: dict[str, Any] = {"arm": arm_name, "computed_batch": want, "status": "not run"}
    for b in range(want, max(want - tries, 0), -1):
        [r] = run_cells(measure_decode, [dict(model=model, arm_name=arm_name, context=context, batch=b, new_tokens=12,
                                              read_gbps=read_gbps, seed=seed)], log=log)
        row.update(r)
        if everywhere(r["status"] == "ran"):
            row["largest_batch"] = b
            break
    return row


def _said(r: dict) -> str:
    """One cell's progress line: its TPOT (and floor), TTFT or chunk time, or its status."""
    if r.get("status") != "ran":
        return r["status"]
    if "tpot_ms" in r:
        floor = f", {r['tpot_over_floor']:.2f}x floor" if "tpot_over_floor" in r else ""
        dev = r.get("device_step_ms")
        return f"TPOT {r['tpot_ms']:.2f} ms{floor}" + ("" if dev is None else f", device step {dev:.2f} ms")
    if "chunk_s" in r:
        return f"last chunk {r['chunk_s']:.2f} s, peak {r['peak_bytes'] / GIB:.1f} GiB above the weights"
    return f"TTFT {r['ttft_s']:.2f} s"


def run_cells(fn: Callable[..., dict], cells: Sequence[dict], log: Callable[[str], None] = print) -> list[dict]:
    """Run fn(**cell) for each cell; a cell that raises (out of memory) is recorded as "failed: ..." and the rest run."""
    rows = []
    for cell in cells:
        t0 = time.perf_counter()
        try:
            r = fn(**cell)
        except Exception as exc:
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            r = {("arm" if k == "arm_name" else k): v for k, v in cell.items() if k != "model"}
            r["status"] = f"failed: {type(exc).__name__}: {text}"
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(r)
        log(f"  {r.get('arm')} {r.get('context', r.get('prompt_tokens'))} x {r.get('batch', 1)}: {_said(r)}"
            f" [{time.perf_counter() - t0:.1f} s]")
    return rows


def decode_table(rows: Sequence[dict]) -> str:
    from .report import markdown_table

    shown = []
    for r in rows:
        row = {"arm": r["arm"], "context": r["context"], "batch": r["batch"], "status": r["status"]}
        if r["status"] == "ran":
            row.update({k: r[k] for k in ("tpot_ms", "tpot_p90_ms", "floor_ms", "tpot_over_floor",
                                          "decode_tokens_per_s")})
            row["peak_gib"] = r["peak_bytes"] / GIB
            row["host"] = "n/a" if r["host_ms"] is None else f"{r['host_ms']:.2f} ms ({r['host_share']:.1%})"
        shown.append(row)
    return markdown_table(shown, {"arm": "arm", "context": "context", "batch": "batch", "tpot_ms": "TPOT ms",
                                  "tpot_p90_ms": "p90 ms", "floor_ms": "floor ms", "tpot_over_floor": "TPOT / floor",
                                  "decode_tokens_per_s": "tokens/s", "host": "host per step",
                                  "peak_gib": "peak GiB", "status": "status"},
                          {"context": ",d", "tpot_ms": ".2f", "tpot_p90_ms": ".2f", "floor_ms": ".2f",
                           "tpot_over_floor": ".2f", "decode_tokens_per_s": ".1f", "peak_gib": ".1f"})


def memory_table(rows: Sequence[dict]) -> str:
    """Peak memory by component (GiB) of the cells that ran (`memory_components`)."""
    from .report import markdown_table

    shown = []
    for r in rows:
        if r.get("status") == "ran" and r.get("memory"):
            m = r["memory"]
            shown.append({"arm": r["arm"], "context": r["context"], "batch": r["batch"],
                          **{k: m[k] / GIB for k in ("weights", "cache", "workspace", "activations", "peak")}})
    names = {"arm": "arm", "context": "context", "batch": "batch", "weights": "weights GiB", "cache": "cache GiB",
             "workspace": "workspace GiB", "activations": "activations etc. GiB", "peak": "peak GiB"}
    return markdown_table(shown, names, {"context": ",d", **{k: ".2f" for k in list(names)[3:]}})


def plot_tpot(rows: Sequence[dict], path: str | None = None):
    """TPOT against context per arm (one panel per batch), the byte floor of the folded arm dashed. The TPOT axis is
    logarithmic: the eager sdpa arm runs 6-17x the floor, and on a linear axis the graphed arms and the floor merge.
    Each arm in its palette style, the floor a plain read's grey dashes, one legend beside the panels."""
    import matplotlib.pyplot as plt

    from .palette import Styles, finish_batch_panels

    ran = [r for r in rows if r["status"] == "ran"]
    batches = sorted({r["batch"] for r in ran})
    fig, axes = plt.subplots(1, max(len(batches), 1), figsize=(5.5 * max(len(batches), 1) + 2, 4), squeeze=False,
                             layout="constrained")
    st = Styles()
    for ax, b in zip(axes[0], batches):
        for arm in dict.fromkeys(r["arm"] for r in ran):
            pts = sorted((r["context"], r["tpot_ms"]) for r in ran if r["arm"] == arm and r["batch"] == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=arm, **st.line(arm))
        fl = sorted((r["context"], r["floor_ms"]) for r in ran if r["arm"] == "foldkv-folded" and r["batch"] == b)
        if fl:
            ax.plot([p[0] for p in fl], [p[1] for p in fl], label="floor (folded bytes)", **st.line("floor"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TPOT (ms, log)")
    return finish_batch_panels(fig, axes[0], batches, path)


__all__ = ["MODEL_ARMS", "ModelArm", "model_arm", "make_cache", "memory_components", "fill_cache", "step_kv_bytes",
           "measure_decode", "measure_prefill", "measure_prefill_tail", "measure_static_compile", "step_kernels",
           "sdpa_backends", "largest_batch", "run_cells", "decode_table", "memory_table", "plot_tpot"]
