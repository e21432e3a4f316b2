"""Gemma 4 31B at full size (foldkv.lab.gemma31b: the published text architecture, random bf16 weights on the GPU)
through generate() on a FoldKvCache: the whole decode step as one CUDA graph against the same step run eagerly
(bitwise: the graph replays those kernels) and against foldkv's per-layer eager decode (transformers' forward layer by
layer, the unfused norms), a few steps of a left-padded batch of real prompts.

Bound for graph vs per-layer eager: both store the same rows and attend with the same kernels; they differ by the
fused step's ops (one bf16 ulp where a reduction is reordered) and the sliding layers' attention arithmetic (the ring's
matmuls vs transformers' sdpa), the same kind of bf16 reordering as transformers' own eager against its own sdpa on
this model (the neutral figure), so the logit gap is held to max(2 x neutral, 4 bf16 ulps of the largest |logit|).
Red twin: a step whose decode reads one token too few (the workspace planned a token shorter) misses it.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_model_31b_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import left_padded_batch, require_hopper, require_module, require_tilelang
from foldkv.lab.model import cache_keyword

pytestmark = pytest.mark.gpu

LENGTHS = (300, 517)
NEW = 6


@pytest.fixture(scope="module")
def model31():
    require_hopper()
    require_tilelang()
    require_module("transformers")
    if torch.cuda.get_device_properties(0).total_memory < 100 * 2**30:
        pytest.skip("the 31B at full size needs ~62 GB of GPU memory and room for its caches")
    import foldkv.hf  # noqa: F401  (registers "foldkv")
    from foldkv.lab.gemma31b import build_gemma4_31b

    model = build_gemma4_31b("cuda", seed=0)
    yield model
    del model
    torch.cuda.empty_cache()


def _run(model, batch, impl, cache=None):
    ids, mask = batch
    model.set_attn_implementation(impl)
    kw = {cache_keyword(model): cache} if cache is not None else {}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu()


def _gap(a, b) -> float:
    """Max |logit gap| over the steps each sequence was fed the same tokens (its first differing step included)."""
    (ta, la), (tb, lb) = a, b
    agree = [int(torch.cumprod((ta[r] == tb[r]).int(), 0).sum()) for r in range(ta.shape[0])]
    return max(float((la[: min(n + 1, NEW), r] - lb[: min(n + 1, NEW), r]).abs().max()) for r, n in enumerate(agree))


def test_the_31b_step_graph_equals_its_eager_forms(model31, monkeypatch):
    from foldkv.hf import FoldKvCache

    ids, mask = left_padded_batch(LENGTHS, model31.config.vocab_size, seed=11)
    batch = (ids.cuda(), mask.cuda())
    incumbent = _run(model31, batch, "sdpa")
    neutral = _gap(_run(model31, batch, "eager"), incumbent)

    def cache(**kw):
        model31.set_attn_implementation("foldkv")  # a FoldKvCache is made for a model served by foldkv
        return FoldKvCache(model31, max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW, kv_format="folded", **kw)

    graph_cache = cache(decode_step="graph")
    graph = _run(model31, batch, "foldkv", graph_cache)
    assert graph_cache.decode_step.graph is not None and graph_cache.decode_step.steps == NEW - 1
    static = _run(model31, batch, "foldkv", cache(decode_step="static"))
    assert torch.equal(graph[0], static[0]) and torch.equal(graph[1], static[1])
    eager = _run(model31, batch, "foldkv", cache(decode_step="eager"))
    bound = max(2 * neutral, 4 * 2.0 ** (math.floor(math.log2(float(incumbent[1].abs().max()))) - 7))
    gap = _gap(graph, eager)
    print(f"\n31B: graph vs per-layer eager gap {gap:.3g}, neutral (eager vs sdpa) {neutral:.3g}, bound {bound:.3g};"
          f" tokens graph {graph[0].tolist()} eager {eager[0].tolist()}")
    assert bool(torch.isfinite(graph[1]).all())
    assert gap <= bound, f"graph vs eager logits {gap:.3g} > {bound:.3g}"

    # red twin: the step's global layers read one token fewer than they hold (advance() keeps the shortfall;
    # no re-plan within NEW steps)
    from foldkv.hf_graph import DecodeStep

    own = DecodeStep._global_workspace

    def short(self, first):
        ws = own(self, first)
        ws.plan([n - 1 for n in self.lens], first.device_table.page_ids[:self.cache.batch])
        return ws

    monkeypatch.setattr(DecodeStep, "_global_workspace", short)
    broken = _run(model31, batch, "foldkv", cache(decode_step="graph"))
    assert _gap(broken, eager) > bound, "a step reading one token too few passed the bound"
    model31.set_attn_implementation("sdpa")
