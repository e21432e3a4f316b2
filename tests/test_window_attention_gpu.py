"""foldkv.window_attention on the GPU: FlashAttention's window against the float64 band (awkward query lengths,
cached windows empty, short, full; GQA 32/16 at head_dim 256 as the 31B's sliding layers), every element finite and
within a derived bound; red twin: the float64 band one key narrower is outside it. And in generate() on the
synthetic Gemma 4 (bf16, chunked prefill crossing its window): the sliding layers' prefill takes the kernel, and the
greedy tokens and logits equal transformers' masked sdpa path within the neutral figure.

Bound (u = 2^-24; ring_output_bound's terms): P rounded to bf16 before P.V (one ulp of each p_j), P.V summed in float32
over the window, the output's bf16 rounding, and the scores' own float32 error (q.k over D products: D 2u sum|q_i k_i|
times the scale) moving each p_j by at most twice the largest score error.

Reproduce a case: FOLDKV_REQUIRE_GPU=1 pytest tests/test_window_attention_gpu.py -k "<case id>"
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_cuda, ring_output_bound, synthetic_gpu_models
from foldkv import window_attention as wa
from foldkv.lab import window_reference as wr

pytestmark = pytest.mark.gpu


def _check(q, k, v, window, scale, against_window):
    out = wa.window_attention(q, k, v, window=window, scale=scale)  # [B, T, H, D]
    assert out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) and out.dtype == q.dtype
    assert bool(torch.isfinite(out).all())
    ref = wr.window_attention_reference(q, k, v, window=against_window, scale=scale)  # [B, T, H, D] float64
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~wr.window_mask(q.shape[2], k.shape[2], against_window, q.device), float("-inf"))
    p = torch.softmax(s, -1)  # [B, H, T, S]
    score_err = scale * q.shape[-1] * 2 * 2.0 ** -24 * (q.double().abs() @ kk.abs().transpose(-1, -2)).amax()
    bound = ring_output_bound(p, vv, ref.transpose(1, 2), extra=2 * score_err).transpose(1, 2)
    return bool(((out.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("window", [64, 1024])
@pytest.mark.parametrize("cached", [0, 1, "full"])
@pytest.mark.parametrize("q_length", [1, 63, 65, 1000])
def test_window_attention_against_float64(q_length, cached, window):
    dev = require_cuda()
    cached = window - 1 if cached == "full" else cached
    g = torch.Generator(device=dev).manual_seed(q_length * 7 + cached)
    q = torch.randn(1, 32, q_length, 256, device=dev, generator=g).bfloat16()
    k, v = (torch.randn(1, 16, cached + q_length, 256, device=dev, generator=g).bfloat16() for _ in range(2))
    assert wa.refusal(q, k, v, window=window) is None
    assert _check(q, k, v, window, 256 ** -0.5, window)
    if cached + q_length > 1:  # red twin: a band one key narrower (each query with more than one key sees it)
        assert not _check(q, k, v, window, 256 ** -0.5, min(window, cached + q_length) - 1)


def test_generate_prefill_through_the_window(tmp_path_factory, monkeypatch):
    from foldkv import hf
    from foldkv.lab.model import cache_keyword

    model = synthetic_gpu_models(tmp_path_factory, "foldkv")["foldkv"]
    ids = torch.randint(3, int(model.config.vocab_size), (1, 700), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(5))
    calls = []
    kernel = wa.window_attention
    monkeypatch.setattr(wa, "window_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))

    def run():
        cache = hf.FoldKvCache(model, max_batch=1, max_tokens=720)
        calls.clear()  # the cache's warm-up prefills through the window too: the prompt's calls alone are counted
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, prefill_chunk_size=300, output_logits=True, return_dict_in_generate=True,
                             **{cache_keyword(model): cache})
        return out.sequences[0, 700:].cpu(), torch.stack(out.logits).float().cpu()

    tokens, logits = run()
    sliding_layers = sum(1 for m in model.modules() if getattr(m, "is_sliding", False) and hasattr(m, "q_proj"))
    assert len(calls) == 3 * sliding_layers  # three prefill chunks, every sliding layer through the kernel
    monkeypatch.setattr(hf, "plain_window", lambda *a: False)  # transformers' mask and sdpa: what served before
    base_tokens, base_logits = run()
    eager = synthetic_gpu_models(tmp_path_factory, "foldkv_eager")["foldkv_eager"]
    cache = hf.FoldKvCache(eager, max_batch=1, max_tokens=720)
    out = eager.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                         do_sample=False, prefill_chunk_size=300, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(eager): cache})
    neutral = (torch.stack(out.logits).float().cpu()[0] - base_logits[0]).abs().max().item()
    gap = (logits[0] - base_logits[0]).abs().max().item()  # the prefill's logits: the same inputs in both runs
    assert gap <= max(2 * neutral, 4 * 2.0 ** -8 * base_logits[0].abs().max().item()), (gap, neutral)
    print(f"tokens equal: {torch.equal(tokens, base_tokens)}, first-token logit gap {gap:.3g}, neutral {neutral:.3g}")
