"""The fused sliding attention of foldkv.fused_step (`q_norm_rope`, `kv_to_ring`, `ring_attend`; FUSE_SLIDING) on
the GPU: each kernel against what it replaces, then the whole graph step with the switch on and off.

Bounds, from where each op rounds:
- q_norm_rope / kv_to_ring: the same per-element formulas and the same row reduction as `rms_norm` then `rope`
  (themselves held to the modules in test_fused_step_gpu.py): bitwise those two kernels; v_norm bitwise `rms_norm`
  without weight. The rings: the step's slot holds those rows, every other slot is unchanged.
- ring_attend, on inputs whose scores are exact in float32 in any order (q and K small dyadic numbers): the scores
  are torch's bitwise (one rounding of an exact sum; then x scaling rounded), each probability within one bf16 ulp
  (float32 softmax, the sum in another order), and the output within
      sum_j ulp(p_j)|v_j| + W 2^-23 sum_j |p_j v_j| + 2 ulp(out)
  of P.V in float64 (the probabilities' ulps, float32 accumulation over W slots, the output's rounding on both
  sides); checked against that float64 reference and against hf_graph.ring_attention itself (cuBLAS with reduced
  precision reductions off). Split programs (`splits`) give bitwise the same output.
- the whole step (tiny synthetic Gemma 4, rings wrapping): FUSE_SLIDING on and off give the same greedy tokens and
  logits within 5% of the logits' spread (test_fused_step_gpu's merged-step bound); the graph replays the static
  step bit for bit.
Red twins: RoPE with sin and cos exchanged, the rows written one slot off, the mask ignored, the scores' rounding
left out (the reference without it misses the bound), the whole step with the mask ignored.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_fused_step_sliding_gpu.py -k ring_attend
"""

from __future__ import annotations

import pytest
import torch

from conftest import left_padded_batch, require_hopper, require_module, require_tilelang

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
GEOMETRIES = {"31b": (32, 16, 256, 1024), "synthetic": (32, 4, 32, 128)}  # Hq, Hkv, head_dim, window


def _ulp(y: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(y.double().abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - 7)


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
        fs.kv_to_ring(k, v, w, 1e-6, 1e-6, cos, sin, rk, rv, slot)
        others = torch.ones(window, dtype=torch.bool, device="cuda")
        others[slot_at] = False
        unchanged = torch.equal(rk[:, :, others], before_k[:, :, others]) and torch.equal(rv[:, :, others],
                                                                                          before_v[:, :, others])
        return torch.equal(rk[:, :, slot_at], want_k) and torch.equal(rv[:, :, slot_at], want_v) and unchanged

    assert run(slot_at)
    assert not run((slot_at + 1) % window), "red twin: the rows written one slot off"


def _ring_case(batch, geometry, seed):
    """q [B, Hq, d], rings [B, Hkv, W, d] and a partly filled ring's mask [B, 1, 1, W]: q and K small dyadic numbers
    (every score's float32 sum exact in any order), V normal."""
    hq, hkv, d, window = GEOMETRIES[geometry]
    g = _gen(seed)
    q = (torch.randint(-8, 9, (batch, hq, d), generator=g, device="cuda") / 16).to(BF16)
    k = (torch.randint(-8, 9, (batch, hkv, window, d), generator=g, device="cuda") / 4).to(BF16)
    v = torch.randn(batch, hkv, window, d, generator=g, device="cuda").to(BF16)
    filled = [window if b % 3 == 2 else [1, window // 3 + 7][b % 2] for b in range(batch)]
    mask = torch.arange(window, device="cuda")[None, :] < torch.tensor(filled, device="cuda")[:, None]
    perm = torch.randperm(window, generator=g, device="cuda")  # the ring's live slots anywhere, not a prefix
    return q, k, v, mask[:, perm][:, None, None, :].contiguous()


def _reference(q, k, v, mask, scaling, round_scores=True):
    """(out float64 [B, 1, Hq, d], the bound): ring_attention's rounding points over exact scores."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, d).double()
    s = qg @ k.double().transpose(-1, -2)  # exact
    s = s.float().to(BF16) if round_scores else s.float()
    if scaling != 1.0:
        s = (s.float() * torch.tensor(scaling, dtype=torch.float32)).to(BF16) if round_scores else s * scaling
    p = torch.softmax(s.float().masked_fill(~mask, float("-inf")), dim=-1).to(BF16).double()
    vd = v.double()
    out = p @ vd
    w = k.shape[2]
    bound = _ulp(p) * (p != 0) @ vd.abs() + w * 2.0 ** -23 * (p.abs() @ vd.abs()) + 2 * _ulp(out)
    return out.reshape(b, 1, hq, d), bound.reshape(b, 1, hq, d)


def _within(got, out, bound) -> bool:
    assert got.shape == out.shape and got.dtype == BF16 and bool(torch.isfinite(got).all())
    return bool(((got.double() - out).abs() <= bound).all())


@pytest.mark.parametrize("scaling", [1.0, 0.3])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_ring_attend_within_its_bound(batch, geometry, scaling):
    from foldkv import fused_step as fs
    from foldkv.hf_graph import RingMask, ring_attention

    q, k, v, mask = _ring_case(batch, geometry, seed=20 + batch)
    out, bound = _reference(q, k, v, mask, scaling)
    got = fs.ring_attend(q, k, v, mask, scaling)
    assert _within(got, out, bound)
    d = q.shape[-1]
    for splits in [n for n in (1, 2, 4) if d % (16 * n) == 0]:  # each split: the same scores, its own columns
        assert torch.equal(fs.ring_attend(q, k, v, mask, scaling, splits=splits), got), splits
    module = torch.nn.Module()
    module.scaling = scaling
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        torch_out = ring_attention(module, q[:, :, None], k, v, RingMask(mask))[0]
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
    assert _within(torch_out, out, bound), "the torch path itself is outside the derived bound"
    # red twins: the mask ignored; the scores' rounding left out (that reference misses the kernel by the bound)
    assert not _within(fs.ring_attend(q, k, v, torch.ones_like(mask), scaling), out, bound), "mask ignored passed"
    unrounded, _ = _reference(q, k, v, mask, scaling, round_scores=False)
    assert not _within(got, unrounded, bound), "a reference without the scores' rounding matched the kernel"


# --- the whole step ---------------------------------------------------------------------------------------------
LENGTHS = (97, 300, 1000)  # rings of 128 slots: partly filled, wrapped
NEW = 12


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    require_hopper()  # (a module fixture runs before the gpu mark's cuda_device check)
    require_tilelang()
    require_module("transformers")
    require_module("safetensors")
    import foldkv.hf  # noqa: F401
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic_sliding_gpu"), seed=2)
    return load_model(ckpt, device="cuda", dtype=BF16, attn_implementation="foldkv")


def _generate(model, decode_step="graph"):
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    ids, mask = left_padded_batch(LENGTHS, model.config.vocab_size, seed=7)
    cache = FoldKvCache(model, max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW, scatter_seed=3,
                        decode_step=decode_step)
    out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu()


@pytest.mark.parametrize("decode_step", ["graph", "static"])
def test_the_step_with_and_without_the_fused_sliding_attention(synthetic_model, decode_step, monkeypatch):
    from foldkv import fused_step as fs

    calls = []
    own = fs.ring_attend
    monkeypatch.setattr(fs, "ring_attend", lambda *a, **kw: calls.append(1) or own(*a, **kw))
    try:
        fs.FUSE_SLIDING = False
        unfused = _generate(synthetic_model, decode_step)
        assert not calls
    finally:
        fs.FUSE_SLIDING = True
    fused = _generate(synthetic_model, decode_step)
    assert calls, "the fused sliding attention never ran"
    assert bool(torch.isfinite(fused[1]).all())
    assert torch.equal(fused[0], unfused[0]), "greedy tokens differ"
    spread = unfused[1].std().item()
    gap = (fused[1] - unfused[1]).abs().max().item()
    assert gap <= 0.05 * spread, f"max |logit gap| {gap:.3g} > 5% of the spread {spread:.3g}"
    if decode_step == "graph":  # the graph replays the static step bit for bit
        static = _generate(synthetic_model, "static")
        assert torch.equal(static[0], fused[0]) and torch.equal(static[1], fused[1])
    # red twin: the ring's mask ignored moves the step (the short prompts' unwritten slots join the softmax)
    monkeypatch.setattr(fs, "ring_attend", lambda q, k, v, mask, *a, **kw: own(q, k, v, torch.ones_like(mask),
                                                                                 *a, **kw))
    twin = _generate(synthetic_model, decode_step)
    assert not torch.equal(twin[1], fused[1]), "the mask ignored changed nothing"
