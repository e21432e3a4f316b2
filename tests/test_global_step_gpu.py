"""foldkv.global_step on the GPU: a global layer's query and row as two Triton kernels (`query_into`, `row_into_pool`),
each against the library functions it replaces, then the whole step with `StepOptions.fuse_global` on and off.

Bounds, from where each op rounds:
- `query_into` (global_query_rows): fold_query's arithmetic (q and w_k to float32 exactly, one float32 product, rounded
  once to bf16, RNE) and moves of bf16 values otherwise: bitwise `fold_query` copied into the workspace's query; rows
  past the batch are not written.
- `row_into_pool` (global_row_store): moves of bf16 values: bitwise `store_rows(rows_from_key_value(...))` over the
  whole pool (the step's slots poisoned first, so an unwritten slot or a write elsewhere shows); an FP8 pool's rows
  quantized with `quantize_rows`' correctly rounded divisions and e4m3 rounding (cvt.rn): bitwise, values and scales.
- the whole step (tiny synthetic Gemma 4, graph mode, batch 1 and 8; bf16 pools of both formats and an FP8 one): the
  decode after them is the same `ws.step`, so the greedy tokens and logits are torch.equal with fuse_global on and
  off.
Red twins: the query's rotated halves swapped in the column map; the row stored one offset off (a kernel test and the
whole step).

Reproduce: FOLDKV_REQUIRE_GPU=1 PYTHONPATH=lib pytest tests/test_global_step_gpu.py -k "row and folded and 8"
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foldkv.step_options import StepOptions

from conftest import (ROW_FORMATS, left_padded_batch, pool_kind, query_kernel_check, require_hopper,
                      require_module, row_store_check, synthetic_gpu_models)

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
FORMATS = ["folded", "split"]


def _library():
    require_hopper()
    require_module("triton")
    from foldkv import global_step

    return global_step


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _geom():
    from foldkv import GEMMA4_31B

    return GEMMA4_31B  # the synthetic model's global layers have this geometry too: 32 q heads, 4 KV heads, D 512


def _heads(batch, heads, d, seed, extra=3):
    """[B, heads, 1, D] bf16, strided as the model hands it over (a transposed head view of a wider projection
    output); random, non-zero, per-row scales."""
    g = _gen(seed)
    rms = torch.exp(torch.randn(batch, 1, 1, generator=g, device="cuda"))
    full = (torch.randn(batch, 1, (heads + extra) * d, generator=g, device="cuda") * rms).to(BF16)
    x = full[..., : heads * d].view(batch, 1, heads, d).transpose(1, 2)
    assert bool((x != 0).all())
    return x


def _weight(d, seed):
    return torch.exp(0.5 * torch.randn(d, generator=_gen(seed), device="cuda")).to(BF16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_query_kernel_is_fold_query(batch, fmt):
    gst = _library()
    from foldkv.layout import KvFormat
    from foldkv.prep import fold_query

    geom = _geom()
    hq, d, r = geom.num_q_heads, geom.head_dim, geom.rotary_width
    q = _heads(batch, hq, d, seed=batch)
    w = _weight(d, 100 + batch)
    want = fold_query(geom, fmt, q[:, :, 0], w, BF16)

    ok, twin = query_kernel_check(geom, fmt, batch, want,
                                  lambda out: gst.query_into(geom, fmt, q, w, out))
    assert ok
    assert not twin, "red twin: the rotated columns swapped"
    score = gst.column_maps(geom, fmt, q.device)[0]
    if KvFormat.parse(fmt) is KvFormat.FOLDED:  # the fold is there: the unrotated columns are not q's own
        assert not torch.equal(want[..., r:], q[:, :, 0][..., score[r:].long()])


@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_row_kernel_is_rows_from_key_value_then_store_rows(batch, fmt):
    gst = _library()
    from foldkv.prep import rows_from_key_value, store_rows

    geom = _geom()
    hkv, d = geom.num_kv_heads, geom.head_dim
    key = _heads(batch, hkv, d, seed=20 + batch)
    value = _heads(batch, hkv, d, seed=30 + batch, extra=0)

    def reference(pool, pages, offsets):
        rows = rows_from_key_value(geom, pool.format, key[:, :, 0], value[:, :, 0], pool.layout.row_dtype)
        store_rows(pool, pages, offsets, rows, check_finite=False)

    ok, twin = row_store_check(geom, fmt, batch, "cuda", 40 + batch, reference,
                               lambda pool, pages, offsets: gst.row_into_pool(geom, pool, key, value, pages, offsets))
    assert ok  # the slots hold the rows, every other row is unchanged
    assert not twin, "red twin: the row stored one offset off"


# --- the whole step ---------------------------------------------------------------------------------------------
LENGTHS = {1: (300,), 8: (97, 300, 1000, 5, 64, 129, 700, 33)}
NEW = 12


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


def _generate(model, fmt, batch, decode_step="graph", options=None):
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    fmt, dtype = pool_kind(fmt)
    lengths = LENGTHS[batch]
    ids, mask = left_padded_batch(lengths, model.config.vocab_size, seed=7)
    cache = FoldKvCache(model, max_batch=len(lengths), max_tokens=max(lengths) + NEW, scatter_seed=3,
                        decode_step=decode_step, kv_format=fmt, dtype=dtype, step_options=options)
    out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu()


def _spied(monkeypatch, gst):
    """Every route's answer and every launch of the row kernel, recorded: (routes, rows)."""
    routes, rows = [], []
    route, row = gst.global_route, gst.row_into_pool
    monkeypatch.setattr(gst, "global_route", lambda *a: routes.append(route(*a)) or routes[-1])
    monkeypatch.setattr(gst, "row_into_pool", lambda *a: rows.append(1) or row(*a))
    return routes, rows


@pytest.mark.parametrize("batch", sorted(LENGTHS))
@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_the_step_with_and_without_the_global_kernels(synthetic_model, fmt, batch, monkeypatch):
    """DecodeStep.attend's two kernels: the fused step's global forward (tests/test_global_prologue_gpu.py) is off,
    so every global layer runs transformers' forward into attend (an FP8 pool's too: its rows quantized by the row
    kernel, bitwise the torch definition's)."""
    gst = _library()
    unfused = StepOptions(fuse_global_prologue=False)
    routes, rows = _spied(monkeypatch, gst)
    plain = _generate(synthetic_model, fmt, batch, options=dataclasses.replace(unfused, fuse_global=False))
    assert not rows and routes and set(routes) == {"StepOptions.fuse_global is off"}
    routes.clear()
    kernels = _generate(synthetic_model, fmt, batch, options=unfused)
    assert rows and routes and set(routes) == {None}, set(routes)
    assert bool(torch.isfinite(kernels[1]).all())
    assert torch.equal(kernels[0], plain[0]), "greedy tokens differ"
    gap = (kernels[1] - plain[1]).abs().max().item()
    assert torch.equal(kernels[1], plain[1]), f"logits differ (max |gap| {gap:.3g}): the kernels are not bitwise"

    # red twin: the step's row stored one offset off in its page (the slot the decode reads keeps an old row)
    row = gst.row_into_pool
    monkeypatch.setattr(gst, "row_into_pool", lambda geom, pool, k, v, pages, offsets: row(
        geom, pool, k, v, pages, torch.remainder(offsets + 1, pool.layout.page_size)))
    twin = _generate(synthetic_model, fmt, batch, options=unfused)
    assert not torch.equal(twin[1], kernels[1]), "rows stored one offset off changed nothing"
