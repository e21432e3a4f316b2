"""The fixed-address decode step of generate() on a FoldKvCache (`foldkv.hf_graph`, decode_step="static": what the CUDA
graph records, run eagerly, through the step's own forward, `foldkv.fused_step.StepForward`) against the eager path
(transformers' forward), on the CPU; the 31B architecture builder; caches filled to a
context without a prefill.

The model is the tiny synthetic Gemma 4 of test_hf_cpu with a sliding window of 8, so the rings wrap many times over
a prompt of 17 and 24 new tokens; prompts are left-padded (3 lengths) and prefilled whole or in chunks. float32 model,
float32 pools, float64 reference attention: static and eager differ only by float32 reordering (the ring's key order
and the grouped-query layout of the sliding attention), measured <= 2e-5 here (|logit| ~ 10), under test_hf_cpu's
FLOAT32_TOL; the broken twins move the logits by > 0.1.

Reproduce one case: pytest tests/test_hf_step_cpu.py -k "static_step_equals_eager and folded and chunk-4"
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_SYNTHETIC, left_padded_batch, require_module
from foldkv.lab.model import cache_keyword

LENGTHS = (5, 17, 11)
NEW = 24
WINDOW = 8
FLOAT32_TOL = 2e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    require_module("transformers")
    require_module("safetensors")
    import foldkv.hf  # noqa: F401
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp("ring"), seed=3, sliding_window=WINDOW, **TINY_SYNTHETIC)
    return {impl: load_model(ckpt, dtype=torch.float32, attn_implementation=impl)
            for impl in ("sdpa", "foldkv", "foldkv_eager")}


@pytest.fixture(scope="module")
def batch():
    """input_ids, attention_mask [3, max(LENGTHS)] int64, left-padded (conftest.left_padded_batch)."""
    return left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])


def _run(model, batch, cache=None, chunk=None):
    ids, mask = batch
    kw = {cache_keyword(model): cache} if cache is not None else {}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, prefill_chunk_size=chunk, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits).float()


def _cache(model, fmt="folded", **kw):
    from foldkv.hf import FoldKvCache

    return FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, kv_format=fmt, scatter_seed=5, **kw)


@pytest.fixture(scope="module")
def incumbent(models, batch):
    return _run(models["sdpa"], batch)


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunk-4"])
@pytest.mark.parametrize("impl", ["foldkv", "foldkv_eager"])
@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_static_step_equals_eager(models, batch, incumbent, fmt, impl, chunk):
    model = models[impl]
    eager_cache, static_cache = _cache(model, fmt, decode_step="eager"), _cache(model, fmt, decode_step="static")
    eager, static = _run(model, batch, eager_cache, chunk), _run(model, batch, static_cache, chunk)
    # a last prompt chunk of one column is a decode step too (17 columns in chunks of 4)
    assert static_cache.decode_step.steps == NEW - 1 + (chunk is not None and max(LENGTHS) % chunk == 1)
    assert eager_cache.decode_step is None
    assert static_cache.decode_step.forward is not None  # the step's own forward served each step, not the model's
    assert torch.equal(static[0], eager[0]) and torch.equal(static[0], incumbent[0])
    gap = float((static[1] - eager[1]).abs().max())
    assert gap <= FLOAT32_TOL, f"static vs eager logits {gap:.3g}"
    assert [layer.lengths[:3] for layer in static_cache.global_layers] == [
        [n + NEW - 1 for n in LENGTHS]] * len(static_cache.global_layers)
    assert static_cache.get_seq_length() == max(LENGTHS) + NEW - 1


@pytest.mark.parametrize("broken", ["ring_mask_drops_the_oldest", "position_one_behind", "slot_one_behind"])
def test_broken_step_changes_the_generation(models, batch, incumbent, broken, monkeypatch):
    """Red twins: a mask that hides the oldest column of the window, a position one short, a ring slot one short
    (the new key overwrites the previous column): each moves the logits far past the tolerance."""
    from foldkv import hf_graph

    own = hf_graph.DecodeStep._prologue

    def prologue(self):
        own(self)
        if broken == "ring_mask_drops_the_oldest":
            t = self.col
            held = t - torch.remainder(t - self.slots, self.window)
            self.mask &= (held > t - self.window + 1)[None, None, None, :]
        elif broken == "position_one_behind":
            self.pos.sub_(1)
        else:
            self.slot.copy_(torch.remainder(self.col - 1, self.window))

    monkeypatch.setattr(hf_graph.DecodeStep, "_prologue", prologue)
    _, logits = _run(models["foldkv"], batch, _cache(models["foldkv"], decode_step="static"))
    gap = float((logits - incumbent[1]).abs().max())
    assert gap > 0.1, f"{broken}: the logits moved only {gap:.3g}"


def test_a_prompt_after_decoding_is_refused(models, batch):
    from foldkv import FoldKvInputError

    model = models["foldkv"]
    cache = _cache(model, decode_step="static")
    _run(model, batch, cache)
    ids, mask = batch
    with pytest.raises(FoldKvInputError, match=f"holds {cache.get_seq_length()} tokens a sequence .*from an earlier"):
        model(input_ids=ids[:, :2], attention_mask=mask[:, :2], **{cache_keyword(model): cache})
    cache.reset()  # a reset cache serves a new prompt
    assert torch.equal(_run(model, batch, cache)[0], _run(model, batch, _cache(model, decode_step="eager"))[0])


def test_decode_step_refusals(models):
    from foldkv import FoldKvInputError

    with pytest.raises(FoldKvInputError, match="decode_step='graph' captures the kernels' decode"):
        _cache(models["foldkv"], decode_step="graph")
    with pytest.raises(FoldKvInputError, match="decode_step='fast'"):
        _cache(models["foldkv"], decode_step="fast")


def test_the_31b_architecture_counts_its_parameters():
    require_module("transformers")
    from foldkv.lab import gemma31b

    assert gemma31b.count_parameters() == gemma31b.PARAMETERS_31B == 30_697_345_280
    cfg = gemma31b.gemma4_31b_config()
    assert cfg["layer_types"].count("full_attention") == 10 and len(cfg["layer_types"]) == 60


def test_the_31b_builder_sets_what_to_empty_leaves_uninitialised():
    """A shrunk build (6 layers, small width and vocab) on the CPU: every buffer equals the one the model computes
    when built normally, the LM head is tied, no parameter is zero or repeated (seeded per tensor)."""
    require_module("transformers")
    from transformers import Gemma4ForCausalLM

    from foldkv.lab import gemma31b

    small = dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=128, intermediate_size=256)
    model = gemma31b.build_gemma4_31b("cpu", num_layers=6, dtype=torch.float32, **small)
    ref = Gemma4ForCausalLM(gemma31b._text_config(gemma31b.gemma4_31b_config(num_layers=6, dtype="float32", **small),
                                                  "sdpa"))
    got, want = dict(model.named_buffers()), dict(ref.named_buffers())
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    params = list(model.parameters())
    assert all(bool(p.abs().sum() > 0) for p in params)
    again = gemma31b.build_gemma4_31b("cpu", num_layers=6, dtype=torch.float32, **small)
    assert all(torch.equal(a, b) for a, b in zip(params, again.parameters()))


@pytest.mark.parametrize("arm", ["foldkv-folded", "foldkv-split", "foldkv-fp8", "sdpa"])
def test_a_filled_cache_decodes(models, arm):
    """model_decode.fill_cache: the cache holds the context (lengths, columns, the sliding windows) and generate()
    feeds only the one prompt token it lacks, then decodes through the step (foldkv) or its own cache (sdpa)."""
    from foldkv.lab import model_decode as md

    spec = md.model_arm(arm)
    model = models["foldkv" if spec.format is not None else "sdpa"]
    context, b = 40, 2
    if spec.format is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    else:
        from foldkv.hf import FoldKvCache

        dtype = spec.dtype if spec.dtype == torch.float8_e4m3fn else torch.float32
        cache = FoldKvCache(model, max_batch=b, max_tokens=context + 1 + 6, kv_format=spec.format, dtype=dtype,
                            decode_step="static")
    md.fill_cache(cache, model, context, b)
    assert cache.get_seq_length() == context
    ids = torch.randint(3, TINY_SYNTHETIC["vocab_size"], (b, context + 1))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                         do_sample=False, **{cache_keyword(model): cache})
    assert out.shape == (b, context + 7)
    assert cache.get_seq_length() == context + 6
    if spec.format is not None:
        assert cache.decode_step.steps == 6  # the prompt's one missing token was the first step
    per_token = md.step_kv_bytes(model, spec, context, b) - md.step_kv_bytes(model, spec, context - 1, b)
    assert per_token > 0
    # the cell's memory by component: the cache is the pools (their layout's bytes) and the sliding rings, or the
    # DynamicCache's K/V; the rest of the peak is what the cache and workspace do not explain
    mem = md.memory_components(cache, peak=10**9, weights=123)
    if spec.format is not None:
        text = model.model
        rings = sum(2 * b * WINDOW * text.layers[i].self_attn.k_proj.out_features * 4
                    for i, t in enumerate(model.config.layer_types) if t == "sliding_attention")
        assert mem["cache"] == cache.pool_bytes() + rings and mem["workspace"] == 0  # static on the CPU: no workspace
    else:
        # what the K/V hold: a sliding layer's window is a view of a longer tensor, its storage is held
        assert mem["cache"] == sum(t.untyped_storage().nbytes() for layer in cache.layers
                                   for t in (layer.keys, layer.values))
    assert mem["weights"] == 123 and mem["activations"] == 10**9 - mem["cache"] - mem["workspace"]
    assert mem["peak"] == 123 + 10**9


def test_a_filled_cache_prefills_its_last_chunk(models):
    """notebook 05's prefill-tail cell on the CPU: caches filled to context - chunk tokens take the prompts' last
    chunk as one prefill forward (chunked-prefill continuation), then decode."""
    from foldkv.lab import model_decode as md

    model, context, chunk, b = models["foldkv"], 40, 8, 2
    cache = _cache(model, decode_step="static")
    md.fill_cache(cache, model, context - chunk, b)
    ids = torch.randint(3, TINY_SYNTHETIC["vocab_size"], (b, context))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                         do_sample=False, **{cache_keyword(model): cache})
    assert out.shape == (b, context + 2) and cache.get_seq_length() == context + 1
    assert cache.decode_step.steps == 1
    assert [layer.lengths[:b] for layer in cache.global_layers] == [[context + 1] * b] * len(cache.global_layers)


def test_the_flashinfer_arm_takes_only_the_split_pool(models):
    from foldkv.lab.flashinfer_model import FlashInferCache, FlashInferStep

    with pytest.raises(ValueError, match="split pool"):
        FlashInferCache(models["foldkv"], max_batch=2, max_tokens=64, kv_format="folded")
    cache = FlashInferCache(models["foldkv"], max_batch=2, max_tokens=64, decode_step="static")
    assert isinstance(cache.decode_step, FlashInferStep) and cache.global_layers[0].pool.format.value == "split"
    cache.reset()
    assert isinstance(cache.decode_step, FlashInferStep)  # reset() keeps the arm's step class


def test_a_model_cast_to_bf16_is_served(models, batch):
    """`model.to(torch.bfloat16)` rounds the RoPE inverse frequencies to bf16; transformers computes with them and so
    does the served model (its K and Q come rotated by the model): the cache is made and greedy tokens equal the model's
    own. Red twin: frequencies that rotate another set of columns are refused by name."""
    import copy

    from foldkv import ConfigError
    from foldkv.hf import FoldKvCache

    model = copy.deepcopy(models["foldkv"]).to(torch.bfloat16)
    _cache(models["foldkv"], decode_step="static")  # the model's forward is routed through the decode step ...
    assert copy.deepcopy(models["foldkv"]).forward.__self__ is not models["foldkv"]  # ... and a copy gets its own
    inv = model.model.rotary_emb.full_attention_inv_freq
    assert inv.dtype == torch.bfloat16 or not torch.equal(inv.float(), inv.float().to(torch.bfloat16).float())
    cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, dtype=torch.bfloat16)
    sdpa = copy.deepcopy(models["sdpa"]).to(torch.bfloat16)
    got, want = _run(model, batch, cache), _run(sdpa, batch)
    assert torch.equal(got[0][:, :4], want[0][:, :4])
    with torch.no_grad():
        inv[-1] = 1.0  # a column foldkv treats as unrotated now rotates
    with pytest.raises(ConfigError, match="RoPE rotates other columns"):
        FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW)


# Bad uses of a FoldKvCache in generate(): each refused by name before a pool is written, or served correctly.
@pytest.mark.parametrize("use,match", [
    ("second_generate", r"holds \d+ tokens a sequence .*from an earlier generate\(\); call cache.reset\(\)"),
    ("only_padding", "have a prompt of padding only"),
    ("another_model", "this FoldKvCache was made for another model"),
])
@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_bad_uses_are_refused_before_a_pool_is_written(models, batch, use, match, decode_step):
    from foldkv import FoldKvInputError

    model = models["foldkv"]
    if use == "second_generate":
        cache = _cache(model, decode_step=decode_step)
        _run(model, batch, cache)
        call = lambda: _run(model, batch, cache)  # noqa: E731
    elif use == "only_padding":
        ids, mask = batch
        mask = mask.clone()
        mask[0] = 0
        cache = _cache(model, decode_step=decode_step)
        call = lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,  # noqa: E731
                                      **{cache_keyword(model): cache})
    else:  # a cache made for the foldkv_eager model (same checkpoint, other modules) used by the foldkv one
        cache = _cache(models["foldkv_eager"], decode_step=decode_step)
        call = lambda: _run(model, batch, cache)  # noqa: E731
    before = [layer.pool.data.clone() for layer in cache.global_layers]
    with pytest.raises(FoldKvInputError, match=match):
        call()
    if use != "only_padding":  # (a padding-only prompt is refused after the prompt's forward, at the first step)
        assert all(torch.equal(a.nan_to_num(7.0), layer.pool.data.nan_to_num(7.0))
                   for a, layer in zip(before, cache.global_layers))


def test_a_prompt_at_exactly_the_capacity_is_served(models, batch, incumbent):
    """max_tokens = prompt + new tokens - 1 (the last token is never fed back): served, the incumbent's tokens."""
    from foldkv import FoldKvInputError
    from foldkv.hf import FoldKvCache

    model = models["foldkv"]
    cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW - 1, decode_step="static")
    assert torch.equal(_run(model, batch, cache)[0], incumbent[0])
    with pytest.raises(FoldKvInputError, match="holds max_tokens"):  # one column fewer is refused
        _run(model, batch, FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW - 2, decode_step="static"))


def test_a_cache_on_another_device_is_refused(models):
    from foldkv import FoldKvInputError

    with pytest.raises(FoldKvInputError, match="a FoldKvCache lives on its model's device"):
        _cache(models["foldkv"], device="meta")


def _multimodal_model():
    """The tiny synthetic Gemma 4 (TINY_SYNTHETIC, window 8) as the text tower of a Gemma4ForConditionalGeneration with
    a one-layer vision tower and no audio, float32, seeded: weights under model.language_model, lm_head on top."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
    from foldkv.lab.synthetic import synthetic_config

    text = synthetic_config(sliding_window=WINDOW, dtype="float32", **TINY_SYNTHETIC)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    torch.manual_seed(11)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision.to_dict(),
                                                        audio_config=None)).float().eval()
    with torch.no_grad():  # the text tower's norms and projections drawn far from their initial values
        for p in model.model.language_model.parameters():
            p.add_(torch.randn_like(p) * 0.1 * (p.std() if p.numel() > 1 else 1))
    return model


def test_the_multimodal_model_decodes_through_the_steps_own_forward(batch, monkeypatch):
    """A Gemma4ForConditionalGeneration (text weights under model.language_model) on a FoldKvCache: the step's own
    forward describes it (`fused_step.refusal` is None) and runs every decode step, with the tokens of transformers'
    own forward (sdpa, its DynamicCache) and of foldkv's eager path. Red twin: a step whose forward embeds every token
    as the pad token (what the placeholder mapping does to image tokens only) changes the tokens."""
    require_module("transformers")
    import foldkv.hf  # noqa: F401
    from foldkv import fused_step

    model = _multimodal_model()
    assert fused_step.refusal(model) is None
    assert fused_step.text_model(model) is model.model.language_model
    model.set_attn_implementation("sdpa")
    want, _ = _run(model, batch)
    model.set_attn_implementation("foldkv")
    eager, eager_logits = _run(model, batch, _cache(model, decode_step="eager"))
    assert torch.equal(eager, want)
    calls = []
    decode = fused_step.StepForward.decode
    monkeypatch.setattr(fused_step.StepForward, "decode", lambda self, *a: calls.append(1) or decode(self, *a))
    cache = _cache(model, decode_step="static")
    got, logits = _run(model, batch, cache)
    assert torch.equal(got, want)
    assert (logits - eager_logits).abs().max().item() <= FLOAT32_TOL
    assert len(calls) == NEW - 1 and cache.decode_step.forward_refusal is None  # every step after the prompt's
    own = fused_step.StepForward._forward
    monkeypatch.setattr(fused_step.StepForward, "_forward",
                        lambda self, ids, *a: own(self, ids.new_full(ids.shape, self.pad_id), *a))
    red, _ = _run(model, batch, _cache(model, decode_step="static"))
    assert not torch.equal(red, want)
