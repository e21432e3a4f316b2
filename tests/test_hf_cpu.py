"""transformers' generate() on a FoldKvCache against transformers' own attention, on the CPU: a synthetic Gemma 4 in
float32, a batch of 3 prompts of different lengths (left padding), greedy and sampling, folded and split pools; broken
pools and folds caught; every refusal raised before anything is written.

The model is the synthetic Gemma 4 shrunk (hidden 64, vocab 128) with the 31B global geometry (32 x 512 query heads,
4 KV heads, k_eq_v, proportional RoPE 0.25), as in test_drift_cpu.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import TINY_SYNTHETIC, left_padded_batch, require_module
from foldkv.lab.model import cache_keyword

TINY = TINY_SYNTHETIC  # conftest: the `checkpoint` fixture is this model
LENGTHS = (5, 17, 11)  # real tokens of the three prompts; the batch is left-padded to the longest
NEW = 32
# A float32 model against a float32 pool read by the float64 reference: the logits differ from transformers' float32
# attention only by float32 reordering, measured <= 1.6e-5 here (|logit| ~ 10), as test_drift_cpu's FLOAT32_TOL
# (2e-4) derives for the same model; every broken twin below moves the scores by > 0.1.
FLOAT32_TOL = 2e-4


@pytest.fixture(scope="module")
def models(checkpoint):
    """float32 models by attention implementation: transformers' eager and sdpa, foldkv with eager or sdpa sliding."""
    import foldkv.hf  # noqa: F401  (registers "foldkv" and "foldkv_eager")
    from foldkv.lab.model import load_model

    return {impl: load_model(checkpoint, dtype=torch.float32, attn_implementation=impl)
            for impl in ("eager", "sdpa", "foldkv", "foldkv_eager")}


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask [3, max(LENGTHS)] int64, left-padded (conftest.left_padded_batch)."""
    return left_padded_batch(LENGTHS, TINY["vocab_size"])


def _run(model, batch, cache=None, *, seed: int | None = None, new: int = NEW):
    """generate() greedy (seed None) or sampling (torch seeded with `seed`): (new tokens [3, new], scores
    [new, 3, V] float32)."""
    ids, mask = batch
    kw = {cache_keyword(model): cache} if cache is not None else {}
    if seed is not None:
        torch.manual_seed(seed)
        kw.update(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    else:
        kw.update(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits).float()


@pytest.fixture(scope="module")
def incumbent(models, batch):
    """transformers' own greedy generations, by implementation."""
    return {impl: _run(models[impl], batch) for impl in ("eager", "sdpa")}


def _cache(model, fmt="folded", **kw):
    from foldkv.hf import FoldKvCache

    kw.setdefault("max_batch", 4)
    kw.setdefault("max_tokens", max(LENGTHS) + NEW)
    return FoldKvCache(model, kv_format=fmt, scatter_seed=5, **kw)


# --- generate() equals transformers' own ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["folded", "split"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_greedy_generate_equals_transformers(models, batch, incumbent, impl, fmt):
    foldkv_impl = {"eager": "foldkv_eager", "sdpa": "foldkv"}[impl]
    cache = _cache(models[foldkv_impl], fmt)
    tokens, scores = _run(models[foldkv_impl], batch, cache)
    want_tokens, want_scores = incumbent[impl]
    where = (tokens != want_tokens).nonzero()[:4].tolist()
    assert torch.equal(tokens, want_tokens), f"{fmt} vs {impl}: tokens differ at (sequence, step) {where}"
    gap = float((scores - want_scores).abs().max())
    assert gap <= FLOAT32_TOL, f"{fmt} vs {impl}: max |logit gap| {gap:.2e} > {FLOAT32_TOL}"
    # the other incumbent too: the two are the same model up to float32 reordering
    other = incumbent["sdpa" if impl == "eager" else "eager"]
    assert torch.equal(tokens, other[0])
    # only the real tokens are stored: prompt + the NEW - 1 tokens fed back, per sequence, in every global layer
    for layer in cache.global_layers:
        assert layer.lengths[:3] == [n + NEW - 1 for n in LENGTHS]
        assert layer.lengths[3] == 0
    _assert_pool_holds_exactly(cache)


def _assert_pool_holds_exactly(cache) -> None:
    """Every stored row is finite and every other row still holds the NaN poison."""
    for layer in cache.global_layers:
        data, table, page = layer.pool.data, layer.host_table, layer.pool.layout.page_size
        written = torch.zeros(data.shape[0], data.shape[2], dtype=torch.bool)
        for r, n in enumerate(layer.lengths):
            for pos in range(n):
                written[int(table.page_ids[r, pos // page]), pos % page] = True
        assert bool(torch.isfinite(data[written[:, None, :, None].expand_as(data)]).all())
        assert bool(torch.isnan(data[~written[:, None, :, None].expand_as(data)]).all())


def test_sampling_generate_equals_transformers(models, batch):
    want_tokens, want_scores = _run(models["eager"], batch, seed=123)
    tokens, scores = _run(models["foldkv_eager"], batch, _cache(models["foldkv_eager"]), seed=123)
    assert torch.equal(tokens, want_tokens)
    assert float((scores - want_scores).abs().max()) <= FLOAT32_TOL
    # the sampled continuation is not the greedy one (the seed is what decided it)
    greedy, _ = _run(models["eager"], batch)
    assert not torch.equal(tokens, greedy)


def test_forward_without_padding_and_a_smaller_batch(models, batch):
    """A batch below max_batch, no attention mask (generate drops an all-ones one): the global layers' mask is None."""
    ids = batch[0][1:2]  # the longest prompt: no padding
    cache = _cache(models["foldkv"], max_batch=3)
    tokens, scores = _run(models["foldkv"], (ids, torch.ones_like(ids)), cache, new=8)
    want, want_scores = _run(models["sdpa"], (ids, torch.ones_like(ids)), new=8)
    assert torch.equal(tokens, want) and float((scores - want_scores).abs().max()) <= FLOAT32_TOL
    assert cache.global_layers[0].lengths == [LENGTHS[1] + 7, 0, 0]


# --- red twins: a broken pool or fold must show ---------------------------------------------------------------------

def _scores_gap(models, batch, incumbent, cache) -> tuple[float, bool]:
    tokens, scores = _run(models["foldkv_eager"], batch, cache)
    want_tokens, want_scores = incumbent["eager"]
    return float((scores - want_scores).abs().max()), torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_corrupted_pool_row_changes_the_generation(models, batch, incumbent, monkeypatch, fmt):
    import foldkv.prep

    real_store = foldkv.prep.store_rows
    calls = []

    def corrupting_store(pool, pages, offsets, rows, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first global layer's prompt: one token's rows of sequence 1 negated
            rows = rows.clone()
            rows[LENGTHS[0] + 3] *= -1
        return real_store(pool, pages, offsets, rows, **kwargs)

    monkeypatch.setattr(foldkv.prep, "store_rows", corrupting_store)
    gap, same_tokens = _scores_gap(models, batch, incumbent, _cache(models["foldkv_eager"], fmt))
    assert gap > 0.1 and not same_tokens, f"a negated pool row went unnoticed (gap {gap:.2e})"


def test_fold_without_k_norm_changes_the_generation(models, batch, incumbent, monkeypatch):
    import foldkv.prep

    real_fold = foldkv.prep.fold_query
    monkeypatch.setattr(foldkv.prep, "fold_query",
                        lambda geom, fmt, q, w, dtype: real_fold(geom, fmt, q, torch.ones_like(w), dtype))
    gap, same_tokens = _scores_gap(models, batch, incumbent, _cache(models["foldkv_eager"], "folded"))
    assert gap > 0.1 and not same_tokens, f"a fold that forgets w_k went unnoticed (gap {gap:.2e})"


def test_unwritten_row_reads_as_nan(models, batch, incumbent, monkeypatch):
    """A row the store skips is read as the NaN poison, not as stale or zero data."""
    import foldkv.prep

    real_store = foldkv.prep.store_rows

    def skipping_store(pool, pages, offsets, rows, **kwargs):
        keep = offsets != 2  # position 2 of each prompt (all shorter than a page)
        return real_store(pool, pages[keep], offsets[keep], rows[keep], **kwargs)

    monkeypatch.setattr(foldkv.prep, "store_rows", skipping_store)
    with torch.no_grad():
        cache = _cache(models["foldkv_eager"])
        ids, mask = batch
        model = models["foldkv_eager"]
        logits = model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): cache}).logits
    assert bool(torch.isnan(logits[:, -1]).all())


# --- refusals, each before anything is written ------------------------------------------------------------------

def _assert_untouched(cache) -> None:
    for layer in cache.layers:
        if hasattr(layer, "pool"):
            assert bool(torch.isnan(layer.pool.data).all()) and layer.lengths == [0] * len(layer.lengths)
        else:  # transformers' sliding layer: never written
            assert not layer.is_initialized


def test_refuses_a_batch_above_max_batch(models, batch):
    from foldkv import FoldKvInputError

    cache = _cache(models["foldkv"], max_batch=2)
    with pytest.raises(FoldKvInputError, match="max_batch=2"):
        _run(models["foldkv"], batch, cache)
    _assert_untouched(cache)


def test_refuses_a_pool_too_small_for_the_prompt(models, batch):
    from foldkv import FoldKvInputError

    cache = _cache(models["foldkv"], max_tokens=max(LENGTHS) - 1)
    with pytest.raises(FoldKvInputError, match="max_tokens"):
        _run(models["foldkv"], batch, cache)
    _assert_untouched(cache)


def test_refuses_a_pool_too_small_for_prompt_and_new_tokens(models, batch):
    from foldkv import FoldKvInputError

    cache = _cache(models["foldkv"], max_tokens=max(LENGTHS) + NEW - 1, max_new_tokens=NEW)
    with pytest.raises(FoldKvInputError, match=f"max_new_tokens={NEW}"):
        _run(models["foldkv"], batch, cache)
    _assert_untouched(cache)
    # its twin: the same cache one token larger serves the whole generation
    cache = _cache(models["foldkv"], max_tokens=max(LENGTHS) + NEW, max_new_tokens=NEW)
    _run(models["foldkv"], batch, cache, new=2)


def test_refuses_the_step_that_would_overflow(models, batch):
    """Without max_new_tokens the forward that would pass max_tokens is refused, before it writes."""
    from foldkv import FoldKvInputError

    cache = _cache(models["foldkv"], max_tokens=max(LENGTHS) + 4)
    with pytest.raises(FoldKvInputError, match="max_tokens"):
        _run(models["foldkv"], batch, cache, new=8)
    assert cache.global_layers[0].lengths[:3] == [n + 4 for n in LENGTHS]  # prompt + 4 fed tokens, nothing more


def test_refuses_right_padding(models, batch):
    from foldkv import FoldKvInputError

    ids, mask = batch
    cache = _cache(models["foldkv"])
    with pytest.raises(FoldKvInputError, match="left padding"):
        with torch.no_grad():
            models["foldkv"](input_ids=ids.flip(1), attention_mask=mask.flip(1),
                             **{cache_keyword(models["foldkv"]): cache})
    _assert_untouched(cache)


def test_refuses_other_attention_implementations(models, batch):
    from foldkv import FoldKvInputError
    from foldkv.config import ConfigError

    with pytest.raises(ConfigError, match="attention implementation is 'sdpa'"):
        _cache(models["sdpa"])
    # foldkv attention without a FoldKvCache (generate would make a DynamicCache)
    with pytest.raises(FoldKvInputError, match="FoldKvCache"):
        _run(models["foldkv"], batch, new=2)


def _tiny(**overrides):
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    import foldkv.hf  # noqa: F401

    kw = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=2, head_dim=32,
              global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              vocab_size=128, intermediate_size=64, hidden_size_per_layer_input=0, vocab_size_per_layer_input=128,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1_000_000.0}},
              max_position_embeddings=262_144)
    kw.update(overrides)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**kw)).eval()
    model.set_attn_implementation("foldkv")
    return model


@pytest.mark.parametrize("case, overrides, message", [
    ("k_eq_v", {}, None),
    ("no k_eq_v", {"attention_k_eq_v": False}, "k_eq_v"),
    ("kv-shared layers", {"num_kv_shared_layers": 2}, "num_kv_shared_layers=2"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_refuses_models_it_cannot_serve(case, overrides, message):
    """Each refusal has its twin: the same tiny model with k_eq_v global layers and no KV sharing is served."""
    require_module("transformers")
    from foldkv.config import ConfigError
    from foldkv.hf import FoldKvCache

    model = _tiny(**overrides)
    if message is None:
        cache = FoldKvCache(model, max_batch=1, max_tokens=8)
        ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(0))
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, **{cache_keyword(model): cache})
        assert out.shape == (1, 7) and cache.global_layers[0].lengths == [6]
        return
    with pytest.raises(ConfigError, match=message):
        FoldKvCache(model, max_batch=1, max_tokens=8)


@pytest.mark.parametrize("kw,match", [
    (dict(kv_format="split", dtype=torch.float8_e4m3fn), "holds folded rows only; kv_format=split"),
    (dict(kv_format="split", dtype=torch.float8_e4m3fn, attention="kernel"), "holds folded rows only"),
    (dict(dtype=torch.float16, attention="kernel"), r"the kernels read bf16 or FP8 .* dtype=torch.float16"),
    (dict(dtype=torch.float8_e4m3fn, attention="kernel"), "attention='kernel' runs on CUDA"),
])
def test_pool_dtype_refusals(models, kw, match):
    """An FP8 cache is folded only; the kernels take bf16 or FP8 pools, refused on the dtype before the device (so
    the last case, a valid FP8 kernel cache, reaches the device check on the CPU: its red twin)."""
    from foldkv import FoldKvInputError
    from foldkv.hf import FoldKvCache

    with pytest.raises(FoldKvInputError, match=match):
        FoldKvCache(models["foldkv_eager"], max_batch=1, max_tokens=8, **kw)


def test_import_foldkv_does_not_import_transformers():
    code = "import sys, foldkv, foldkv.prep, foldkv.reference; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _rows_read_back(monkeypatch) -> list:
    """Each FP8 finiteness check (a host read of the rows: on CUDA it waits for the stream) recorded."""
    from foldkv import fp8, prep

    reads, own = [], fp8.check_finite_rows
    monkeypatch.setattr(prep, "check_finite_rows", lambda rows: reads.append(rows.shape) or own(rows))
    return reads


@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_an_fp8_forward_stores_its_rows_without_reading_them_back(models, batch, monkeypatch, decode_step):
    """generate() on an FP8 FoldKvCache: no global layer's store reads its rows back to the host (the prefill's
    stores and the eager decode's: the model's own activations; a host read at every global layer would drain the
    stream there, ~24 ms a 4,096-token chunk of the 31B on the H100). Red twin: a store that checks them does."""
    from foldkv import global_step

    reads = _rows_read_back(monkeypatch)
    tokens, logits = _run(models["foldkv"], batch, _cache(models["foldkv"], dtype=torch.float8_e4m3fn,
                                                          decode_step=decode_step))
    assert reads == [] and bool(torch.isfinite(logits).all())
    own = global_step.fold_and_store
    monkeypatch.setattr(global_step, "fold_and_store", lambda *a, **kw: own(*a, **{**kw, "check_finite": True}))
    _run(models["foldkv"], batch, _cache(models["foldkv"], dtype=torch.float8_e4m3fn, decode_step=decode_step))
    assert reads, "the red twin's checking store read nothing back"


@pytest.mark.parametrize("fmt,dtype", [("folded", torch.bfloat16), ("split", torch.bfloat16),
                                       ("folded", torch.float8_e4m3fn)], ids=["folded", "split", "folded-fp8"])
def test_kernel_path_hands_the_launchers_what_they_accept(models, batch, fmt, dtype):
    """The CUDA path on the CPU: each prefill call goes to the real launcher and each decode step to the cache's
    DecodeWorkspace's step, whose checks all pass up to the last one (the device: CUDA); it is then served by the
    reference over the same pool (bf16, or the FP8 pool with its scales), a decode reading the workspace's query,
    lengths and page ids (as planned or advanced): the generation must then equal, bit for bit, the reference path's
    over a pool of that dtype (only the routing differs)."""
    from foldkv import BlockTable, FoldKvInputError, paged_attention_reference
    from foldkv.kernels.prefill import prefill
    from foldkv.kernels.workspace import DecodeWorkspace

    calls = {"prefill": 0, "decode": 0}

    def through(launcher):
        def call(pool, query, table, *args, **kwargs):
            with pytest.raises(FoldKvInputError, match="CUDA"):
                launcher(pool, query, table, *args, **kwargs)
            calls["prefill"] += 1
            return paged_attention_reference(pool, query, table, args[0])[0], None
        return call

    model = models["foldkv_eager"]
    cache = _cache(model, fmt, dtype=dtype)
    cache.attention, cache._kernels = "kernel", {"prefill": through(prefill)}
    own_workspace = cache.decode_workspace

    def workspace(n):
        ws = own_workspace(n)

        def step(pool, **kwargs):
            with pytest.raises(FoldKvInputError, match="CUDA"):
                DecodeWorkspace.step(ws, pool, **kwargs)
            calls["decode"] += 1
            b = ws.batch
            table = BlockTable(ws.page_ids[:b], torch.tensor(ws.seq_lens, dtype=torch.int32))
            return paged_attention_reference(pool, ws.query[:b], table)[0], None
        ws.step = step
        return ws

    cache.decode_workspace = workspace
    tokens, scores = _run(model, batch, cache, new=4)
    layers = len(cache.global_layers)
    assert calls == {"prefill": layers, "decode": 3 * layers}
    assert all(layer.pool.layout.dtype == dtype for layer in cache.global_layers)
    want_tokens, want_scores = _run(model, batch, _cache(model, fmt, dtype=dtype), new=4)
    assert torch.equal(tokens, want_tokens) and torch.equal(scores, want_scores)
    assert bool(torch.isfinite(scores).all())
