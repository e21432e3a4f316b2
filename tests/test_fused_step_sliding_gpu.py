"""The fused sliding-layer prologue of foldkv.fused_step (`q_norm_rope`, tests/step_twins.py's `kv_to_ring`;
fuse_sliding) on the GPU: each kernel against what it replaces, then the whole step with the switch on and off.

Bounds, from where each op rounds:
- q_norm_rope / kv_to_ring: the same per-element formulas and the same row reduction as `rms_norm` then `rope`
  (themselves held to the modules in test_fused_step_gpu.py): bitwise those two kernels; v_norm bitwise `rms_norm`
  without weight. The rings: the step's slot holds those rows, every other slot is unchanged.
- the whole step (tiny synthetic Gemma 4, rings wrapping): the ring attention after them is the same
  `ring.ring_attention` either way, so fuse_sliding on and off give bitwise the same greedy tokens and logits; the
  graph replays the static step bit for bit.
- sliding_prologue: both in one launch (`fused_step_kernels.sliding_prologue_rows`, the two kernels' row bodies
  side by side), bitwise the two launches (conftest.two_launch_prologue) into a poisoned slot, with PDL and without,
  and in the synthetic model's graph generate().
Red twins: RoPE with sin and cos exchanged, the rows written one slot off (a kernel test and the whole step), the one
launch's grid holding the query rows only (a kernel test and the whole step).

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_fused_step_sliding_gpu.py -k "kv_to_ring and 31b and 8"
"""

from __future__ import annotations

import pytest
import torch

from conftest import (attention_norms, left_padded_batch, sliding_prologue_without_kv, synthetic_gpu_models,
                      two_launch_prologue)

from foldkv.step_options import StepOptions, using

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
GEOMETRIES = {"31b": (32, 16, 256, 1024), "synthetic": (32, 4, 32, 128)}  # Hq, Hkv, head_dim, window


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _merged(batch, hq, hkv, d, seed):
    """A merged q|k|v GEMV output [B, 1, (hq + 2 hkv) d] and its q, k, v column slices (read in place)."""
    g = _gen(seed)
    rms = torch.exp(torch.randn(batch, 1, 1, generator=g, device="cuda"))
    full = (torch.randn(batch, 1, (hq + 2 * hkv) * d, generator=g, device="cuda") * rms).to(BF16)
    return full, full.split([hq * d, hkv * d, hkv * d], dim=-1)


def _rope_tables(batch, d, seed):
    ang = torch.rand(batch, 1, d, generator=_gen(seed), device="cuda") * 40.0
    return ang.cos().to(BF16), ang.sin().to(BF16)


def _weight(d, seed):
    return torch.exp(0.5 * torch.randn(d, generator=_gen(seed), device="cuda")).to(BF16)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_q_norm_rope_is_the_norm_then_rope(batch, geometry):
    from foldkv import fused_step as fs

    hq, hkv, d, _ = GEOMETRIES[geometry]
    _, (q, _, _) = _merged(batch, hq, hkv, d, seed=batch)
    cos, sin = _rope_tables(batch, d, seed=batch + 1)
    w = _weight(d, batch + 2)
    got = fs.q_norm_rope(q, w, 1e-6, cos, sin, hq)
    want = fs.rope(fs.rms_norm(q.view(batch, 1, hq, d), w, 1e-6), cos, sin)[:, 0]
    assert got.shape == (batch, hq, d) and bool(torch.isfinite(got).all())
    assert torch.equal(got, want)
    assert not torch.equal(fs.q_norm_rope(q, w, 1e-6, sin, cos, hq), want), "red twin: sin and cos exchanged"


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_kv_to_ring_writes_the_slot_only(batch, geometry):
    from step_twins import kv_to_ring

    from foldkv import fused_step as fs

    hq, hkv, d, window = GEOMETRIES[geometry]
    _, (_, k, v) = _merged(batch, hq, hkv, d, seed=10 + batch)
    cos, sin = _rope_tables(batch, d, seed=11 + batch)
    w = _weight(d, 12 + batch)
    slot_at = (37 * batch + 5) % window
    want_k = fs.rope(fs.rms_norm(k.view(batch, 1, hkv, d), w, 1e-6), cos, sin)[:, 0]
    want_v = fs.rms_norm(v.view(batch, 1, hkv, d), None, 1e-6)[:, 0]

    def run(slot_written):
        g = _gen(13 + batch)
        rk = torch.randn(batch, hkv, window, d, generator=g, device="cuda").to(BF16)
        rv = torch.randn(batch, hkv, window, d, generator=g, device="cuda").to(BF16)
        rk[:, :, slot_at], rv[:, :, slot_at] = float("nan"), float("nan")  # the slot to write: poisoned
        before_k, before_v = rk.clone(), rv.clone()
        slot = torch.tensor([slot_written], dtype=torch.long, device="cuda")
        kv_to_ring(k, v, w, 1e-6, 1e-6, cos, sin, rk, rv, slot)
        others = torch.ones(window, dtype=torch.bool, device="cuda")
        others[slot_at] = False
        unchanged = torch.equal(rk[:, :, others], before_k[:, :, others]) and torch.equal(rv[:, :, others],
                                                                                          before_v[:, :, others])
        return torch.equal(rk[:, :, slot_at], want_k) and torch.equal(rv[:, :, slot_at], want_v) and unchanged

    assert run(slot_at)
    assert not run((slot_at + 1) % window), "red twin: the rows written one slot off"


# --- the whole step ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_one_launch_is_the_two_launches(batch, geometry, pdl, monkeypatch):
    from foldkv import fused_step_ops as ops, gemv

    with using(StepOptions(pdl=pdl)):  # pdl_kw: both sides launched alike
        hq, hkv, d, window = GEOMETRIES[geometry]
        g = _gen(batch)
        rms = torch.exp(torch.randn(batch, 1, 1, generator=g, device="cuda"))
        full = (torch.randn(batch, 1, (hq + 2 * hkv) * d, generator=g, device="cuda") * rms).to(BF16)
        q, k, v = full.split([hq * d, hkv * d, hkv * d], dim=-1)
        ang = torch.rand(batch, 1, d, generator=g, device="cuda") * 40.0
        cos, sin = ang.cos().to(BF16), ang.sin().to(BF16)
        attn = attention_norms(d, "cuda")
        slot = torch.tensor([(37 * batch + 5) % window], device="cuda")

        def rings():
            r = torch.randn(2, batch, hkv, window, d, generator=_gen(50 + batch), device="cuda").to(BF16)
            r[:, :, :, slot.item()] = float("nan")  # the slot to write: poisoned
            return r[0], r[1]

        want_k, want_v = rings()
        want_q = two_launch_prologue(attn, q, k, v, cos, sin, want_k, want_v, slot)
        got_k, got_v = rings()
        got_q = ops.sliding_prologue(attn, q, k, v, cos, sin, got_k, got_v, slot)
        assert bool(torch.isfinite(got_q).all() and torch.isfinite(got_k).all() and torch.isfinite(got_v).all())
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        twin_k, twin_v = rings()  # red twin: the KV rows left out of the grid
        sliding_prologue_without_kv(attn, q, k, v, cos, sin, twin_k, twin_v, slot)
        assert not torch.equal(twin_k, want_k)


LENGTHS = (97, 300, 1000)  # rings of 128 slots: partly filled, wrapped
NEW = 12


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv")["foldkv"]

def _generate(model, decode_step="graph", options=None):
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    ids, mask = left_padded_batch(LENGTHS, model.config.vocab_size, seed=7)
    cache = FoldKvCache(model, max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW, scatter_seed=3,
                        decode_step=decode_step, step_options=options)
    out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu()


@pytest.mark.parametrize("decode_step", ["graph", "static"])
def test_the_step_with_and_without_the_fused_sliding_prologue(synthetic_model, decode_step, monkeypatch):
    from foldkv import fused_step as fs, fused_step_ops as ops

    calls = []
    own = ops.kv_rows_args  # what fused_step's sliding_prologue asks for its KV rows' launch
    monkeypatch.setattr(ops, "kv_rows_args", lambda *a, **kw: calls.append(1) or own(*a, **kw))
    unfused = _generate(synthetic_model, decode_step, StepOptions(fuse_sliding=False))
    assert not calls
    fused = _generate(synthetic_model, decode_step)
    assert calls, "the fused sliding prologue never ran"
    assert bool(torch.isfinite(fused[1]).all())
    assert torch.equal(fused[0], unfused[0]), "greedy tokens differ"
    gap = (fused[1] - unfused[1]).abs().max().item()
    assert torch.equal(fused[1], unfused[1]), f"logits differ (max |gap| {gap:.3g}): the prologue is not bitwise"
    if decode_step == "graph":  # the graph replays the static step bit for bit
        static = _generate(synthetic_model, "static")
        assert torch.equal(static[0], fused[0]) and torch.equal(static[1], fused[1])

    # red twin: the step's K/V rows written one slot ahead (the ring's slot the step reads keeps an old row)
    def one_off(k, v, kw, ke, ve, cos, sin, rk, rv, slot):
        return own(k, v, kw, ke, ve, cos, sin, rk, rv, torch.remainder(slot + 1, rk.shape[2]))
    monkeypatch.setattr(ops, "kv_rows_args", one_off)
    twin = _generate(synthetic_model, decode_step)
    assert not torch.equal(twin[1], fused[1]), "rows written one slot off changed nothing"


def test_the_step_with_the_one_launch_prologue(synthetic_model, monkeypatch):
    from foldkv import fused_step, fused_step_ops as ops

    calls = []
    own = ops.sliding_prologue
    monkeypatch.setattr(fused_step, "sliding_prologue", lambda *a, **kw: calls.append(1) or own(*a, **kw))
    one = _generate(synthetic_model)
    layers = sum(layer.self_attn.is_sliding for layer in synthetic_model.model.layers)
    assert layers and len(calls) >= layers and len(calls) % layers == 0, calls  # every sliding layer's step
    monkeypatch.setattr(fused_step, "sliding_prologue", two_launch_prologue)
    two = _generate(synthetic_model)
    assert bool(torch.isfinite(one[1]).all())
    assert torch.equal(one[0], two[0]), "greedy tokens differ"
    assert torch.equal(one[1], two[1]), f"logits differ (max |gap| {(one[1] - two[1]).abs().max().item():.3g})"
    # red twin: the step's K/V rows never reach the rings
    monkeypatch.setattr(fused_step, "sliding_prologue", sliding_prologue_without_kv)
    twin = _generate(synthetic_model)
    assert not torch.equal(twin[1], two[1]), "rings never written changed nothing"
