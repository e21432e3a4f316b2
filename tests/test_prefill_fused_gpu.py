"""A prefill forward on a FoldKvCache with the decode step's fused kernels (`DecodeStep.prefill`): on the synthetic
Gemma 4 (bf16, a chunked prefill crossing the sliding window, batch 1 and a left-padded batch of 3) every chunk goes
through it, and the prefill's logits equal transformers' own modules' within the neutral figure (transformers' eager
against its sdpa: two orderings of the same bf16 model) or 4 bf16 ulps of the largest logit, the tokens reported;
red twin: the same check catches a prefill whose fused norm uses another epsilon. The prefill's A/B options: q and k
normed and rotated in one pass (`StepOptions.fuse_prefill_norm_rope`, `fused_step_ops.norm_rope`) bitwise the two
passes, kernel by kernel at the 31B's head shapes and in the prefill's tokens and logits; the projection groups one
GEMM a projection (`merge_prefill` off) within the same neutral figure.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_prefill_fused_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import left_padded_batch, synthetic_gpu_models

pytestmark = pytest.mark.gpu


def _prefill(model, ids, mask, chunk=300, calls=None):
    """(the new tokens, the prefill's logits); `calls` emptied once the cache is made (its warm-up prefills too)."""
    from foldkv import hf
    from foldkv.lab.model import cache_keyword

    cache = hf.FoldKvCache(model, max_batch=ids.shape[0], max_tokens=ids.shape[1] + 4)
    if calls is not None:
        calls.clear()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                         prefill_chunk_size=chunk, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    return out.sequences[:, ids.shape[1]:].cpu(), out.logits[0].float().cpu()  # the prefill's logits [B, V]


@pytest.mark.parametrize("lengths", [(700,), (97, 700, 301)])
def test_fused_prefill_within_the_neutral_figure(tmp_path_factory, monkeypatch, lengths):
    from foldkv import fused_step_ops, hf_graph
    from foldkv.step_options import StepOptions, using

    models = synthetic_gpu_models(tmp_path_factory, "foldkv", "foldkv_eager")
    model = models["foldkv"]
    ids, mask = left_padded_batch(lengths, model.config.vocab_size, seed=11)
    ids, mask = ids.cuda(), mask.cuda()
    calls = []
    prefill = hf_graph.DecodeStep.prefill
    monkeypatch.setattr(hf_graph.DecodeStep, "prefill", lambda self, f, kw: calls.append(1) or prefill(self, f, kw))
    tokens, logits = _prefill(model, ids, mask, calls=calls)
    assert len(calls) == -(-ids.shape[1] // 300)  # every chunk of the prompt through the fused kernels
    with using(StepOptions(fuse_prefill=False)):  # transformers' modules: what served before
        base_tokens, base = _prefill(model, ids, mask)
    _, eager = _prefill(models["foldkv_eager"], ids, mask)
    bound = max(2 * (eager - base).abs().max().item(), 4 * 2.0 ** -8 * base.abs().max().item())
    gap = (logits - base).abs().max().item()
    assert gap <= bound, (gap, bound)
    print(f"tokens equal: {torch.equal(tokens, base_tokens)}; prefill logit gap {gap:.3g} (bound {bound:.3g})")
    monkeypatch.undo()
    norm = fused_step_ops.rms_norm  # red twin: a fused norm with another epsilon is outside the bound
    monkeypatch.setattr("foldkv.fused_step.rms_norm", lambda x, w, eps, **place: norm(x, w, eps + 0.5, **place))
    _, twin = _prefill(model, ids, mask)
    assert (twin - base).abs().max().item() > bound


# the 31B's head rows in a prefill: (q heads, kv heads, head_dim) of its sliding and global layers
HEADS_31B = {"sliding": (32, 16, 256), "global": (32, 4, 512)}


@pytest.mark.parametrize("layer", list(HEADS_31B))
@pytest.mark.parametrize("batch,tokens", [(1, 4096), (2, 300)])
def test_norm_rope_is_the_two_passes(layer, batch, tokens):
    """A prefill's q and k normed and rotated in one pass (`fused_step_ops.norm_rope`), read in place from a merged
    q|k|v output, bitwise `rms_norm` then `rope` on the card (the same row reduction and the same roundings). Red
    twin: cos and sin exchanged."""
    from foldkv import fused_step_ops as ops

    hq, hkv, d = HEADS_31B[layer]
    g = torch.Generator(device="cuda").manual_seed(tokens + d)
    rms = torch.exp(torch.randn(batch, tokens, 1, generator=g, device="cuda"))
    x = (torch.randn(batch, tokens, (hq + 2 * hkv) * d, generator=g, device="cuda") * rms).to(torch.bfloat16)
    ang = torch.rand(batch, tokens, d, generator=g, device="cuda") * 40.0
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    for heads, lo in ((hq, 0), (hkv, hq * d)):
        rows = x[..., lo:lo + heads * d].view(batch, tokens, heads, d)
        w = torch.exp(0.5 * torch.randn(d, generator=g, device="cuda")).to(torch.bfloat16)
        want = ops.rope(ops.rms_norm(rows, w, 1e-6), cos, sin)
        assert torch.equal(ops.norm_rope(rows, w, 1e-6, cos, sin), want)
        assert not torch.equal(ops.norm_rope(rows, w, 1e-6, sin, cos), want), "red twin: sin and cos exchanged"


@pytest.mark.parametrize("lengths", [(700,), (97, 700, 301)])
def test_prefill_norm_rope_and_merge_options(tmp_path_factory, lengths):
    """The prefill's A/B options on the synthetic model: `fuse_prefill_norm_rope` on (one pass) and off (the two
    passes) give bitwise the same tokens and logits; `merge_prefill` off (one GEMM a projection) within the neutral figure of the served
    prefill (another cuBLAS kernel may sum K in another order), tokens reported."""
    from foldkv.step_options import StepOptions, using

    models = synthetic_gpu_models(tmp_path_factory, "foldkv", "foldkv_eager")
    model = models["foldkv"]
    ids, mask = left_padded_batch(lengths, model.config.vocab_size, seed=12)
    ids, mask = ids.cuda(), mask.cuda()
    with using(StepOptions(fuse_prefill_norm_rope=True)):
        one_tokens, one = _prefill(model, ids, mask)
    tokens, logits = _prefill(model, ids, mask)  # the served prefill
    with using(StepOptions(fuse_prefill_norm_rope=False)):
        two_tokens, two = _prefill(model, ids, mask)
    assert torch.equal(one_tokens, two_tokens) and torch.equal(one, two)
    with using(StepOptions(merge_prefill=False)):
        split_tokens, split = _prefill(model, ids, mask)
    _, eager = _prefill(models["foldkv_eager"], ids, mask)
    with using(StepOptions(fuse_prefill=False)):
        _, base = _prefill(model, ids, mask)
    bound = max(2 * (eager - base).abs().max().item(), 4 * 2.0 ** -8 * base.abs().max().item())
    gap = (split - logits).abs().max().item()
    assert gap <= bound, (gap, bound)
    print(f"merge_prefill off: tokens equal {torch.equal(tokens, split_tokens)}, logit gap {gap:.3g}"
          f" (bound {bound:.3g})")
