"""A global layer's prologue inside the fused step on the GPU (`foldkv.fused_step.StepForward`'s global route,
fuse_global_prologue): its norms, RoPE, query and row as two PDL kernels (`global_step.query_from_projection`,
`row_from_projection`), against the seven launches they replace (fused_step's rms_norm and rope, then
`global_step.query_into` and `row_into_pool`), then in the whole step.

Bounds: the same per-element formulas and rounding points, the row's norm reduced over the row loaded in its natural
order as rms_norm_rows reduces it: bitwise. The query into a poisoned workspace (rows past the batch unwritten), the
row into a pool whose step slots are poisoned (every other row unchanged); PDL and plain launches alike. The whole
step (the synthetic model's graph generate(), folded and split pools): greedy tokens and logits torch.equal with
fuse_global_prologue on and off, every global layer's step through the kernels (a spy's count at the warm-up and the capture). Red twins: the rotated
halves of the query swapped; the row stored one offset off; in the step, the rows stored one offset off.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_global_prologue_gpu.py -k "row and folded and 8"
"""

from __future__ import annotations

import pytest
import torch

from foldkv.step_options import StepOptions, using

from conftest import (ROW_FORMATS, attention_norms, graph_generate, pool_kind, query_kernel_check,
                      require_module, row_store_check, synthetic_gpu_models)

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
FORMATS = ["folded", "split"]


def _triton():
    require_module("triton")


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _inputs(batch, seed):
    from foldkv import GEMMA4_31B as geom

    hq, hkv, d = geom.num_q_heads, geom.num_kv_heads, geom.head_dim
    g = _gen(seed)
    rms = torch.exp(torch.randn(batch, 1, 1, generator=g, device="cuda"))
    x = (torch.randn(batch, 1, (hq + hkv) * d, generator=g, device="cuda") * rms).to(BF16)  # merged q|k output
    ang = torch.rand(batch, 1, d, generator=g, device="cuda") * 40.0
    ang[..., 64:256] = 0.0  # proportional RoPE: only [0, 64) and [256, 320) rotate (cos 1, sin 0 elsewhere)
    ang[..., 320:] = 0.0
    return geom, x[..., : hq * d], x[..., hq * d:], ang.cos().to(BF16), ang.sin().to(BF16)


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_query_is_norm_rope_then_query_into(batch, fmt, pdl, monkeypatch):
    _triton()
    from foldkv import fused_step_ops as ops, gemv, global_step as gst

    with using(StepOptions(pdl=pdl)):
        geom, q, _, cos, sin = _inputs(batch, seed=batch)
        hq, d = geom.num_q_heads, geom.head_dim
        attn = attention_norms(d, "cuda")
        roped = ops.rope(ops.rms_norm(q.view(batch, 1, hq, d), attn.q_norm.weight, 1e-6), cos, sin)
        want = torch.full((batch, hq, d), float("nan"), dtype=BF16, device="cuda")
        gst.query_into(geom, fmt, roped.transpose(1, 2), attn.k_norm.weight, want)

        ok, twin = query_kernel_check(geom, fmt, batch, want, lambda out: gst.query_from_projection(
            geom, fmt, q, attn, cos, sin, out))
        assert ok
        assert not twin, "red twin: the rotated halves swapped"


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_row_is_norms_rope_then_row_into_pool(batch, fmt, pdl, monkeypatch):
    _triton()
    from foldkv import fused_step_ops as ops, gemv, global_step as gst

    with using(StepOptions(pdl=pdl)):
        geom, _, k, cos, sin = _inputs(batch, seed=20 + batch)
        hkv, d = geom.num_kv_heads, geom.head_dim
        attn = attention_norms(d, "cuda")
        key = ops.rope(ops.rms_norm(k.view(batch, 1, hkv, d), attn.k_norm.weight, 1e-6), cos, sin).transpose(1, 2)
        value = ops.rms_norm(k.view(batch, 1, hkv, d), None, 1e-6).transpose(1, 2)
        ok, twin = row_store_check(
            geom, fmt, batch, "cuda", 40 + batch,
            lambda pool, pages, offsets: gst.row_into_pool(geom, pool, key, value, pages, offsets),
            lambda pool, pages, offsets: gst.row_from_projection(geom, pool, k, k, attn, cos, sin, pages, offsets))
        assert ok
        assert not twin, "red twin: the row stored one offset off"


LENGTHS = (97, 300, 1000, 5, 64, 129, 700, 33)
NEW = 12


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


def _generate(model, fmt, options=None):
    fmt, dtype = pool_kind(fmt)
    return graph_generate(model, LENGTHS, NEW, kv_format=fmt, dtype=dtype, step_options=options)


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_the_step_with_the_global_prologue(synthetic_model, fmt, monkeypatch):
    _triton()
    from foldkv import fused_step as fs, global_step as gst

    unfused = _generate(synthetic_model, fmt, StepOptions(fuse_global_prologue=False))
    calls = []
    query, row = gst.query_from_projection, gst.row_from_projection

    def spy(*a, **k):
        calls.append(a[0])
        return query(*a, **k)

    monkeypatch.setattr(gst, "query_from_projection", spy)
    got = _generate(synthetic_model, fmt)
    layers = sum(not layer.self_attn.is_sliding for layer in synthetic_model.model.layers)
    assert layers and calls and len(calls) % layers == 0, (len(calls), layers)  # warm-up and capture: the replays
    # run the graph, not Python
    assert bool(torch.isfinite(got[1]).all())
    assert torch.equal(got[0], unfused[0]), "greedy tokens differ"
    assert torch.equal(got[1], unfused[1]), f"logits differ (max |gap| {(got[1] - unfused[1]).abs().max().item():.3g})"

    # red twin: the step's rows stored one offset off in their page
    monkeypatch.setattr(gst, "row_from_projection", lambda geom, pool, k, v, attn, cos, sin, pages, offsets: row(
        geom, pool, k, v, attn, cos, sin, pages, torch.remainder(offsets + 1, pool.layout.page_size)))
    twin = _generate(synthetic_model, fmt)
    assert not torch.equal(twin[1], unfused[1]), "rows stored one offset off changed nothing"
