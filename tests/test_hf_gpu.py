"""transformers' generate() on a FoldKvCache served by the generated kernels (synthetic Gemma 4, bf16, on the GPU; over
bf16 pools of both formats and over the FP8 folded pool):
the kernels never read a poisoned row, stay as close to foldkv's float64 reference over the same pools as bf16
arithmetic allows, and their agreement with the incumbent (transformers' sdpa) is reported beside the neutral figure.

Comparable steps. Free-running generations are compared only while they are fed the same tokens: a sequence's step s
is comparable when both runs generated the same tokens before it (its logits then come from the same inputs).
The neutral figure is transformers' own eager against its own sdpa: two orderings of the same bf16 model.
Bound (as test_drift_gpu derives it): a kernel run and the reference run store the same rows and fold the same query
and differ only in the attention's arithmetic (bf16 tensor cores, fp32 accumulation, vs float64 rounded once to bf16),
the same kind of bf16 reordering as the neutral figure, so their gap is held to
    max(2 x neutral max, 2 x reference-vs-incumbent max, 4 bf16 ulps of the largest |logit|).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import left_padded_batch, require_module, synthetic_gpu_models
from foldkv.lab.model import cache_keyword

pytestmark = pytest.mark.gpu

LENGTHS = (97, 300, 1000)  # awkward lengths, one past 15 pages of 64; left-padded to the longest
NEW = 16


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "sdpa", "eager", "foldkv")


@pytest.fixture(scope="module")
def batch(gpu_models):
    ids, mask = left_padded_batch(LENGTHS, gpu_models["sdpa"].config.vocab_size, seed=7)
    return ids.cuda(), mask.cuda()


def _run(model, batch, cache=None):
    """Greedy generate(): (new tokens [B, NEW] on the CPU, logits [NEW, B, V] float32 on the CPU)."""
    ids, mask = batch
    kw = {cache_keyword(model): cache} if cache is not None else {}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu()


def _compare(a, b) -> dict:
    """Agreement of two runs: steps each sequence shares before its first differing token, and the max |logit gap|
    over the comparable steps (those fed the same tokens, the first differing step included)."""
    (ta, la), (tb, lb) = a, b
    same = ta == tb  # [B, NEW]
    agree = [int(torch.cumprod(same[r].int(), 0).sum()) for r in range(ta.shape[0])]
    gap = max(float((la[: min(n + 1, NEW), r] - lb[: min(n + 1, NEW), r]).abs().max()) for r, n in enumerate(agree))
    return {"agreed_steps": agree, "gap": gap}


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


# How decode steps run: the whole forward as one CUDA graph (the default), or transformers' forward layer by layer,
# each global layer's decode the cache's DecodeWorkspace stepped eagerly.
STEPS = {"model-graph": dict(decode_step="graph"), "eager": dict(decode_step="eager")}


def _check_step_kind(cache, step: str) -> None:
    """The decode steps ran the way `step` says: NEW - 1 replays of the model's graph over the cache's workspace, or
    the layers' forwards through that workspace (planned for the batch, advanced step by step)."""
    ws = cache.decode_workspace(len(LENGTHS))
    if step == "model-graph":
        assert cache.decode_step.steps == NEW - 1 and cache.decode_step.graph is not None
        assert cache.decode_step.ws is ws
    else:
        assert cache.decode_step is None
    assert ws.batch == len(LENGTHS)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("fmt", ["split", "folded"])
def test_generate_on_the_kernels(gpu_models, batch, fmt, step):
    from foldkv.hf import FoldKvCache

    model = gpu_models["foldkv"]
    incumbent = _run(gpu_models["sdpa"], batch)
    neutral = _compare(_run(gpu_models["eager"], batch), incumbent)

    def cache(attention, **kw):
        return FoldKvCache(model, max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW, kv_format=fmt,
                           dtype=torch.bfloat16, attention=attention, scatter_seed=3, **kw)

    ref_cache, ker_cache = cache("reference"), cache("kernel", **STEPS[step])
    ref, ker = _run(model, batch, ref_cache), _run(model, batch, ker_cache)
    _check_step_kind(ker_cache, step)
    if step == "model-graph":  # the graph replays what the same step does eagerly, bit for bit
        static = _run(model, batch, cache("kernel", decode_step="static"))
        assert torch.equal(static[0], ker[0]) and torch.equal(static[1], ker[1])
    assert bool(torch.isfinite(ker[1]).all()), "NaN logits: a kernel read a poisoned (unwritten) pool row"
    for layer in ker_cache.global_layers:  # exactly the real tokens are stored, every other row keeps its poison
        data, table, page = layer.pool.data, layer.host_table, layer.pool.layout.page_size
        assert layer.lengths == [n + NEW - 1 for n in LENGTHS]
        written = torch.zeros(data.shape[0], data.shape[2], dtype=torch.bool, device=data.device)
        for r, n in enumerate(layer.lengths):
            pos = torch.arange(n)
            written[table.page_ids[r, pos // page].long().to(data.device), (pos % page).to(data.device)] = True
        mask = written[:, None, :, None].expand_as(data)
        assert bool(torch.isfinite(data[mask]).all()) and bool(torch.isnan(data[~mask]).all())

    vs_inc, ref_vs_inc, vs_ref = _compare(ker, incumbent), _compare(ref, incumbent), _compare(ker, ref)
    print(f"\n{fmt} ({step}): kernels vs incumbent {vs_inc}; reference vs incumbent {ref_vs_inc}; kernels vs reference"
          f" {vs_ref}; neutral (eager vs sdpa) {neutral}")
    bound = max(2 * neutral["gap"], 2 * ref_vs_inc["gap"], 4 * _bf16_ulp(float(incumbent[1].abs().max())))
    assert vs_ref["gap"] <= bound, f"{fmt}: kernels vs reference gap {vs_ref['gap']:.3g} > {bound:.3g}"


@pytest.mark.parametrize("step", list(STEPS))
def test_generate_on_the_fp8_kernels(gpu_models, batch, step):
    """The FP8 folded pool (`dtype=torch.float8_e4m3fn`) through generate() on the FP8 kernels (decode converting the
    e4m3 rows in the kernel, prefill through the page gather), against foldkv's float64 reference over an FP8 pool.
    Both store the same kind of rows (the same torch prep, quantized once), so they differ in the attention's
    arithmetic only, and their gap is held to the bf16 test's bound with the bf16 folded reference's gap to the
    incumbent in the place of the FP8 one (that one carries the format's own error, not arithmetic):
        max(2 x neutral max, 2 x bf16-reference-vs-incumbent max, 4 bf16 ulps of the largest |logit|).
    The gather's rows are rounded to bf16 once (2^-8 relative, `foldkv.fp8.dequantize_rows_bf16`), the size of the
    bf16 pool's own rounding, which the bf16 reference-vs-incumbent term spans. Also: no kernel read a poisoned row
    (finite logits), and the format's drift (FP8 reference vs incumbent) is reported beside the bf16 one."""
    from foldkv.hf import FoldKvCache

    model = gpu_models["foldkv"]
    incumbent = _run(gpu_models["sdpa"], batch)
    neutral = _compare(_run(gpu_models["eager"], batch), incumbent)

    def cache(attention, dtype, **kw):
        return FoldKvCache(model, max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW, kv_format="folded",
                           dtype=dtype, attention=attention, scatter_seed=3, **kw)

    fp8 = torch.float8_e4m3fn
    ker_cache = cache("kernel", fp8, fp8_math="exact", **STEPS[step])  # the converting partial, named (tensor cores,
    # the default: tests/test_fp8_tc_gpu.py)
    ker, ref = _run(model, batch, ker_cache), _run(model, batch, cache("reference", fp8))
    ref16 = _run(model, batch, cache("reference", torch.bfloat16))
    assert all(layer.pool.layout.dtype == fp8 for layer in ker_cache.global_layers)
    _check_step_kind(ker_cache, step)
    assert bool(torch.isfinite(ker[1]).all()), "NaN logits: a kernel read a poisoned (unwritten) pool row"
    vs_ref, ref_vs_inc, ref16_vs_inc = _compare(ker, ref), _compare(ref, incumbent), _compare(ref16, incumbent)
    print(f"\nfolded-fp8 ({step}): kernels vs FP8 reference {vs_ref}; FP8 reference"
          f" vs incumbent {ref_vs_inc} (the format's drift); bf16 reference vs incumbent {ref16_vs_inc};"
          f" neutral {neutral}")
    bound = max(2 * neutral["gap"], 2 * ref16_vs_inc["gap"], 4 * _bf16_ulp(float(incumbent[1].abs().max())))
    assert vs_ref["gap"] <= bound, f"FP8 kernels vs FP8 reference gap {vs_ref['gap']:.3g} > {bound:.3g}"


def test_generate_through_flashinfer(gpu_models, batch):
    """notebook 05's FlashInfer arm (`foldkv.lab.flashinfer_model`): FlashInfer's paged prefill and decode as the
    global layers' attention on the split pool, inside the one-graph step, held to the float64 reference over the
    same pool by the bound above. Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_hf_gpu.py -k flashinfer"""
    require_module("flashinfer")
    from foldkv.hf import FoldKvCache
    from foldkv.lab.flashinfer_model import FlashInferCache, FlashInferStep

    model = gpu_models["foldkv"]
    incumbent = _run(gpu_models["sdpa"], batch)
    neutral = _compare(_run(gpu_models["eager"], batch), incumbent)
    kw = dict(max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW, kv_format="split", dtype=torch.bfloat16,
              scatter_seed=3)
    ref = _run(model, batch, FoldKvCache(model, attention="reference", **kw))
    fi_cache = FlashInferCache(model, **kw)
    fi = _run(model, batch, fi_cache)
    assert isinstance(fi_cache.decode_step, FlashInferStep) and fi_cache.decode_step.graph is not None
    assert fi_cache.decode_step.steps == NEW - 1 and fi_cache._fi_prefill is not None  # both of FlashInfer's paths ran
    assert bool(torch.isfinite(fi[1]).all())
    ref_vs_inc, vs_ref = _compare(ref, incumbent), _compare(fi, ref)
    print(f"\nflashinfer: vs reference {vs_ref}; reference vs incumbent {ref_vs_inc}; neutral {neutral}")
    bound = max(2 * neutral["gap"], 2 * ref_vs_inc["gap"], 4 * _bf16_ulp(float(incumbent[1].abs().max())))
    assert vs_ref["gap"] <= bound, f"flashinfer vs reference gap {vs_ref['gap']:.3g} > {bound:.3g}"


@pytest.mark.parametrize("arm", ["folded", "flashinfer"])
def test_a_stop_after_a_step_run_ahead_leaves_the_cache_as_transformers_loop(gpu_models, batch, arm):
    """generate()'s thin loop (`foldkv.hf_loop`) issues each graph replay before the host reads the stop flag; an EOS
    stop takes that step back (`DecodeStep.rewind`, the FlashInfer step re-planning its own wrapper). After a stop
    where every sequence ends before max_new_tokens, the thin loop's tokens, the cache's host and device counters and
    the logits of one more step on the same cache equal those transformers' own loop leaves, bit for bit (the same
    graph over the same rows). Red twin: tests/test_hf_loop_cpu.py (a rewind leaving a counter ahead).
    Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_hf_gpu.py -k "run_ahead" """
    from foldkv import hf_loop
    from foldkv.hf import FoldKvCache

    model = gpu_models["foldkv"]
    ids, mask = batch
    if arm == "flashinfer":
        require_module("flashinfer")
        from foldkv.lab.flashinfer_model import FlashInferCache as cls
    else:
        cls = FoldKvCache

    def make_cache():
        return cls(model, max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW,
                   kv_format="split" if arm == "flashinfer" else "folded", dtype=torch.bfloat16, scatter_seed=3)

    # the stop tokens from this arm's own free run: another arm's tokens may part from these on a near-tie of the
    # random synthetic model (split's rows against folded's), and then no sequence would stop early
    free, _ = _run(model, batch, make_cache())
    eos = sorted({int(free[0, 3]), int(free[1, 5]), int(free[2, 2])})  # every sequence ends early

    def once(loop: bool):
        cache = make_cache()
        with pytest.MonkeyPatch.context() as mp:
            if not loop:
                mp.setattr(hf_loop, "applies", lambda model, kwargs: False)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0, **{cache_keyword(model): cache})
        step = cache.decode_step
        state = (cache.get_seq_length(), [list(layer.lengths) for layer in cache.global_layers], list(step.lens),
                 step.dev_lens.tolist(), step.col.tolist(), step.steps)
        with torch.no_grad():
            logits = model(input_ids=out[:, -1:], **{cache_keyword(model): cache}).logits.float().cpu()
        return out.cpu(), state, logits, step.loop_steps["rewound"]

    got, state, logits, rewound = once(True)
    want, want_state, want_logits, _ = once(False)
    assert got.shape[1] < ids.shape[1] + NEW and rewound == 1  # the stop came early and took a step back
    assert torch.equal(got, want) and state == want_state
    assert torch.equal(logits, want_logits), "the step after the stop read another cache"


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_a_reset_cache_replays_its_graph_for_a_second_generate(gpu_models, batch, fmt):
    """A FoldKvCache with the CUDA-graph decode step, reset after one generate() and given a second batch of the same
    shape: the same graph replayed (not captured again: the step's graph object and capture time unchanged), the
    greedy tokens and logits of a fresh cache bit for bit (tests/test_hf_reset_cpu.py holds the same on the CPU with
    the static step)."""
    from foldkv.hf import FoldKvCache

    model = gpu_models["foldkv"]
    ids, mask = batch
    second = (ids.flip(0), mask.flip(0))  # the same shape, other prompts per row

    def cache():
        return FoldKvCache(model, max_batch=4, max_tokens=ids.shape[1] + NEW, kv_format=fmt, decode_step="graph")

    used = cache()
    _run(model, batch, used)
    step = used.decode_step
    graph, captured = step.graph, step.capture_s
    used.reset()
    got, want = _run(model, second, used), _run(model, second, cache())
    assert used.decode_step is step and step.graph is graph and step.capture_s == captured
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
