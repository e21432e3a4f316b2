"""The sliding layers' prefill through the shared scratch (`StepOptions.sliding_scratch`, `foldkv.sliding_cache`) on
the GPU: on the synthetic Gemma 4 (bf16, a chunked prefill crossing the sliding window, then decode steps through the
CUDA graph, whose rings start from the layers' windows) the greedy tokens and every step's logits with the option on
are bitwise those with it off (transformers' torch.cat); at batch 1 every chunk's K and V rows are written into the
scratch by the norm and RoPE kernels (`placed`), a left-padded batch of 3 copies them there once (`copied`). The ops'
`out=`: `rms_norm`, `rope` and `norm_rope` writing into a scratch's chunk rows give bitwise their own outputs and
write nothing outside those rows (red twin: a place one row off is caught by the same comparison).

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_sliding_cache_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import left_padded_batch, synthetic_gpu_models

pytestmark = pytest.mark.gpu


def _generate(model, ids, mask, chunk=300, new=4):
    from foldkv import hf
    from foldkv.lab.model import cache_keyword

    cache = hf.FoldKvCache(model, max_batch=ids.shape[0], max_tokens=ids.shape[1] + new)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         prefill_chunk_size=chunk, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    counts = [(layer.placed, layer.copied) for i, layer in enumerate(cache.layers) if cache.is_sliding_layer(i)]
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu(), counts


@pytest.mark.parametrize("lengths", [(700,), (97, 700, 301)])
def test_the_scratch_prefill_is_the_cat_prefill_bitwise(tmp_path_factory, lengths):
    from foldkv.step_options import StepOptions, using

    model = synthetic_gpu_models(tmp_path_factory, "foldkv")["foldkv"]
    ids, mask = left_padded_batch(lengths, model.config.vocab_size, seed=13)
    ids, mask = ids.cuda(), mask.cuda()
    with using(StepOptions(sliding_scratch=False)):
        tokens, logits, off = _generate(model, ids, mask)
    with using(StepOptions(sliding_scratch=True)):
        on_tokens, on_logits, on = _generate(model, ids, mask)
    chunks = -(-ids.shape[1] // 300)
    assert all(c == (0, 0) for c in off)
    assert all(c == ((chunks, 0) if len(lengths) == 1 else (0, chunks)) for c in on), on
    assert torch.equal(on_tokens, tokens)
    assert torch.equal(on_logits, logits), (on_logits - logits).abs().max().item()


@pytest.mark.parametrize("op", ["rms_norm", "rope", "norm_rope"])
def test_an_op_writes_its_output_into_the_place_and_nowhere_else(op):
    from foldkv import fused_step_ops as ops

    g = torch.Generator(device="cuda").manual_seed(5)
    window, t, h, d = 1024, 300, 16, 256
    x = torch.randn(1, t, h, d, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.exp(0.5 * torch.randn(d, generator=g, device="cuda")).to(torch.bfloat16)
    ang = torch.rand(1, t, d, generator=g, device="cuda") * 40.0
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    run = {"rms_norm": lambda **o: ops.rms_norm(x, w, 1e-6, **o), "rope": lambda **o: ops.rope(x, cos, sin, **o),
           "norm_rope": lambda **o: ops.norm_rope(x, w, 1e-6, cos, sin, **o)}[op]
    want = run()
    for shift, equal in ((0, True), (1, False)):  # red twin: the place one row off
        scratch = torch.full((1, window - 1 + t + 1, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        place = scratch[:, window - 1 + shift:window - 1 + shift + t]
        run(out=place)
        got = scratch[:, window - 1:window - 1 + t]
        assert torch.equal(got, want) is equal
        if equal:
            rest = torch.cat([scratch[:, :window - 1], scratch[:, window - 1 + t:]], 1)
            assert bool(rest.isnan().all()), "the op wrote outside its place"
