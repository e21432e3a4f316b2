"""foldkv.window_attention on the CPU: its band is transformers' sliding-window causal mask over the keys a
DynamicSlidingWindowLayer returns (awkward sizes; red twin: a band one key wider), its float64 reference is
transformers' sdpa over that mask (GQA included), `refusal` names what it cannot serve, and the adapter's
`SlidingWindow` mask is made only for a plain window and falls back to transformers' mask where the kernel cannot
serve (a CPU generate() forced through it gives the tokens of the unforced one).

Reproduce a case: pytest tests/test_window_attention_cpu.py -k "<case id>"
"""

from __future__ import annotations

import pytest
import torch

from foldkv import window_attention as wa
from foldkv.lab import window_reference as wr

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function  # noqa: E402


def _transformers_band(q_length: int, cached: int, window: int) -> torch.Tensor:
    """transformers' mask for a sliding layer holding `cached` earlier tokens (DynamicSlidingWindowLayer's mask sizes)
    and taking q_length new ones: [q_length, kv_length] bool."""
    kv_offset = max(cached - window + 1, 0)
    kv_length = (window - 1 if cached >= window else cached) + q_length
    m = sdpa_mask(batch_size=1, q_length=q_length, kv_length=kv_length, q_offset=cached, kv_offset=kv_offset,
                  mask_function=sliding_window_causal_mask_function(window), local_size=window,
                  allow_is_causal_skip=False)
    return m[0, 0]


@pytest.mark.parametrize("window", [1, 64, 1024])
@pytest.mark.parametrize("cached", [0, 1, 63, 1023, 5000])
@pytest.mark.parametrize("q_length", [1, 63, 65, 1000])
def test_band_is_transformers_mask(q_length, cached, window):
    want = _transformers_band(q_length, cached, window)
    got = wr.window_mask(q_length, want.shape[1], window)
    assert torch.equal(got, want)
    wider = wr.window_mask(q_length, want.shape[1], window + 1)  # red twin: one key more a query
    assert not torch.equal(wider, want) or want.shape[1] <= window


@pytest.mark.parametrize("q_length,cached,window", [(65, 63, 64), (1000, 1023, 1024), (63, 0, 1024)])
def test_reference_is_transformers_sdpa(q_length, cached, window):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(q_length + cached)
    kv = min(cached, window - 1) + q_length
    q = torch.randn(2, 8, q_length, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 4, kv, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = _transformers_band(q_length, cached, window)[None, None].expand(2, 1, -1, -1)

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal, training = 2, True, False

    want, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.5)
    got = wr.window_attention_reference(q, k, v, window=window, scale=0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    narrower = min(window, kv) - 1  # red twin: a band one key narrower than the keys each query can reach
    off = wr.window_attention_reference(q, k, v, window=narrower, scale=0.5)
    assert not torch.allclose(off, want, rtol=1e-12, atol=1e-12)


def test_refusals_name_what_is_missing():
    q, k = torch.zeros(1, 8, 4, 16, dtype=torch.bfloat16), torch.zeros(1, 4, 6, 16, dtype=torch.bfloat16)
    assert wa.refusal(q, k, k, window=8) == "on cpu"
    assert "no sliding window" in wa.refusal(q, k, k, window=None)
    meta = {n: t.to("meta") for n, t in (("q", q), ("k", k))}
    assert wa.refusal(meta["q"], meta["k"], meta["k"], window=8) == "on meta"


def test_sliding_window_mask_only_for_a_plain_window():
    from foldkv import masks

    plain = dict(device="cuda", use_vmap=False, allow_is_causal_skip=True)
    ones = torch.ones(2, 40, dtype=torch.bool)
    assert masks.plain_window("sdpa", 8, 40, 32, 0, ones, plain)
    assert masks.plain_window("sdpa", 8, 40, 32, 0, None, plain)
    padded = ones.clone()
    padded[1, :3] = False
    assert not masks.plain_window("sdpa", 8, 40, 32, 0, padded, plain)  # padding: transformers' mask
    assert not masks.plain_window("eager", 8, 40, 32, 0, ones, plain)  # foldkv_eager's sliding layers
    assert not masks.plain_window("sdpa", 1, 33, 32, 0, ones, plain)  # a decode step
    assert not masks.plain_window("sdpa", 8, 40, 32, 0, ones, {**plain, "device": "cpu"})
    assert not masks.plain_window("sdpa", 8, 40, 32, 0, ones, {**plain, "use_vmap": True})  # another overlay
    assert not masks.plain_window("sdpa", 8, 40, 32, 0, ones, {**plain, "allow_is_causal_skip": False})  # packing
    assert not masks.plain_window("sdpa", 8, 40, 31, 0, ones, plain)  # the queries are not the last keys
    assert not masks.plain_window("sdpa", 8, 40, 32, 0, ones, {"device": "cuda"})  # an older call: no flags, no window
    built = []
    m = masks.SlidingWindow(16, lambda: built.append(1) or torch.ones(1))
    assert m.tensor() is m.tensor() and built == [1]  # transformers' mask built once, on first use


def test_cpu_generate_forced_through_the_window_mask(monkeypatch, tmp_path):
    """A CPU prefill whose sliding mask is forced to a SlidingWindow: window_attention refuses the CPU, each sliding
    layer takes transformers' mask from it: the tokens of the unforced run (chunked prefill, the cache's window
    crossed)."""
    from foldkv import hf, masks
    from foldkv.lab.model import cache_keyword, load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    model = load_model(make_synthetic_checkpoint(tmp_path, seed=3, hidden_size=64, intermediate_size=128,
                                                 vocab_size=128), dtype=torch.float32, attn_implementation="foldkv")
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))

    def run():
        cache = hf.FoldKvCache(model, max_batch=1, max_tokens=310)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              prefill_chunk_size=96, **{cache_keyword(model): cache})[0, 300:]

    want = run()
    made = []
    plain = masks.plain_window
    monkeypatch.setattr(hf, "plain_window", lambda *a: made.append(1) or (a[1] > 1 and plain(
        a[0], a[1], a[2], a[3], a[4], a[5], {**a[6], "device": "cuda"})))
    assert torch.equal(run(), want)
    assert made  # the sliding mask calls went through it
