"""foldkv.fused_step's kernels against the torch modules and functions they replace inside the decode step, on the
GPU: the 31B's step shapes (hidden 5,376, intermediate 21,504, heads of 256 and 512, a ring of 1,024 slots), bf16
inputs drawn at random (never zeros), outputs allocated fresh by each op and checked finite.

Bounds, from where each op rounds (torch computes a bf16 elementwise op in float32 and rounds once):
- RoPE: x*cos and rotate_half(x)*sin are exact in float32 (two 8-bit mantissas), each is rounded, then their sum:
  the kernel rounds at the same three points, so it is bitwise torch's.
- RMSNorm (and the norms inside the residual tails): float32 throughout, rounded once; only the order of the sum of
  squares differs, so a bf16 output is within one bf16 ulp of the module's. A tail's add rounds (residual + normed):
  when the normed term moved by one ulp u of itself, the sum moves by u plus one ulp of the sum.
- GELU x up: the kernel's tanh is 1 - 2/(exp(2z)+1) in float32 (a few float32 ulps from torch's tanh), so the rounded
  activation is within one bf16 ulp a of torch's; the product then moves by a*|up| plus one ulp of the product.
- masked softmax: float32 throughout, the exponentials summed in another order: within one bf16 ulp; masked slots 0.
Red twins: RoPE with sin and cos exchanged, RMSNorm with eps 1e-3, GELU without the tanh approximation (erf), the
softmax without its mask: each misses its bound.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_fused_step_gpu.py -k "rope"
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import exact_projections, merged_linear, require_module, rounding_bound, step_logits

from foldkv.step_options import StepOptions

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _norm(dim: int, with_scale: bool, seed: int = 0, eps: float = 1e-6):
    require_module("transformers")
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    m = Gemma4RMSNorm(dim, eps=eps, with_scale=with_scale).cuda()
    if with_scale:
        with torch.no_grad():
            m.weight.copy_(torch.exp(0.5 * torch.randn(dim, generator=torch.Generator().manual_seed(dim + seed))))
    return m


def _input(shape, seed, spread: float = 2.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rms = torch.exp(spread * torch.randn(*shape[:-1], 1, generator=g, device="cuda"))  # rows of RMS 1e-3 .. 1e3
    return (torch.randn(*shape, generator=g, device="cuda") * rms).to(BF16)


def _ulp(y: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp of each value (8 significant bits)."""
    e = torch.floor(torch.log2(y.float().abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - 7)


def _within(got, want, bound) -> bool:
    assert got.shape == want.shape and got.dtype == want.dtype and bool(torch.isfinite(got).all())
    return bool(((got.float() - want.float()).abs() <= bound).all())


@pytest.mark.parametrize("with_scale", [True, False], ids=["scale", "no-scale"])
@pytest.mark.parametrize("shape", [(1, 1, 5376), (8, 1, 5376), (3, 1, 32, 256), (8, 1, 4, 512), (1, 1, 16, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_the_module(shape, with_scale):
    from foldkv.fused_step import norm_eps, rms_norm

    m = _norm(shape[-1], with_scale)
    x = _input(shape, seed=sum(shape))
    want = m(x)
    got = rms_norm(x, m.weight if with_scale else None, norm_eps(m))
    assert _within(got, want, _ulp(want))


def test_rms_norm_red_twin_wrong_eps():
    from foldkv.fused_step import rms_norm

    m = _norm(256, True)
    x = _input((64, 256), seed=5)
    want = m(x)
    assert not _within(rms_norm(x, m.weight, 1e-3), want, _ulp(want)), "eps 1e-3 passed the one-ulp bound"


@pytest.mark.parametrize("batch", [1, 8])
def test_residual_tails_match_the_layer(batch):
    from step_twins import norm_add_norm, norm_add_scale

    post, pre = _norm(5376, True, 1), _norm(5376, True, 2)
    x, res = _input((batch, 1, 5376), 10 + batch), _input((batch, 1, 5376), 20 + batch, spread=0.5)
    h, y = norm_add_norm(x, res, post, pre)
    a = post(x)
    h0 = res + a
    assert _within(h, h0, _ulp(a) + _ulp(h0))
    assert _within(y, pre(h), _ulp(pre(h)))  # the second norm of the kernel's own sum
    scalar = torch.tensor([0.6171875], device="cuda", dtype=BF16)
    z = norm_add_scale(x, res, post, scalar)
    z0 = res + a
    z0 *= scalar
    assert _within(z, z0, (_ulp(a) + _ulp(res + a)) * 0.6171875 + _ulp(z0))


def test_rope_is_bitwise_torch():
    require_module("transformers")
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    from foldkv.fused_step import rope

    for shape in [(1, 1, 32, 256), (8, 1, 16, 256), (8, 1, 4, 512), (3, 1, 32, 512)]:
        x = _input(shape, seed=sum(shape))
        ang = torch.rand(shape[0], 1, shape[3], device="cuda") * 40.0
        cos, sin = ang.cos().to(BF16), ang.sin().to(BF16)
        want = apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
        assert torch.equal(rope(x, cos, sin), want), shape
        assert not torch.equal(rope(x, sin, cos), want), "red twin: sin and cos exchanged matched"


@pytest.mark.parametrize("batch", [1, 8])
def test_gelu_mul_matches_torch(batch):
    from foldkv.fused_step import gelu_mul

    gate, up = _input((batch, 1, 21504), 30 + batch, 0.5), _input((batch, 1, 21504), 40 + batch, 0.5)
    act = torch.nn.functional.gelu(gate, approximate="tanh")
    want = act * up
    bound = _ulp(act) * up.float().abs() + _ulp(want)
    assert _within(gelu_mul(gate, up), want, bound)
    erf = torch.nn.functional.gelu(gate) * up  # red twin: the exact GELU is another function
    assert not _within(erf, want, bound)


@pytest.mark.parametrize("batch", [1, 8])
def test_masked_softmax_matches_torch(batch):
    from foldkv.fused_step import masked_softmax

    scores = (_input((batch, 16, 2, 1024), 50 + batch, 0.2).float() * 4).to(BF16)
    g = torch.Generator(device="cuda").manual_seed(batch)
    mask = torch.rand(batch, 1, 1, 1024, generator=g, device="cuda") > 0.3
    want = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(BF16)
    got = masked_softmax(scores, mask, BF16)
    assert _within(got, want, _ulp(want))
    assert bool((got[~mask.expand_as(got)] == 0).all())
    unmasked = masked_softmax(scores, torch.ones_like(mask), BF16)  # red twin: the mask ignored
    assert not _within(unmasked, want, _ulp(want))



# --- the projections on graph branches ------------------------------------------------------------------------------
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_a_tail_sums_split_partials_as_split_sum_does(batch, parts):
    """norm_add_rows given a split GEMM's float32 partials (PARTS) computes, bit for bit, what it computes from
    split_sum's sum of them (both tails: the second norm, and the layer scalar), its x never read (NaN-poisoned);
    red twin: told one partial fewer, it does not."""
    from foldkv import gemv
    from foldkv.fused_step import _norm_add

    post, pre = _norm(5376, True, 1), _norm(5376, True, 2)
    ws = torch.randn(parts, batch, 5376, generator=torch.Generator(device="cuda").manual_seed(30 + batch),
                     device="cuda") * 3
    res = _input((batch, 1, 5376), 40 + batch, spread=0.5)
    summed = torch.full((batch, 1, 5376), float("nan"), dtype=BF16, device="cuda")
    gemv.sum_partials(ws, summed.view(batch, 5376), pdl=gemv.HAS_GDC)
    poisoned = torch.full_like(summed, float("nan"))
    scalar = torch.tensor([0.6171875], device="cuda", dtype=BF16)
    for second, scale in ((pre, None), (None, scalar), (pre, scalar)):
        want = _norm_add(summed, res, post, second, scale)
        got = _norm_add(poisoned, res, post, second, scale, ws)
        assert all(bool(torch.isfinite(t).all()) for t in (*want, *got))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (second, scale)
    red = _norm_add(poisoned, res, post, pre, None, ws[:parts - 1])
    assert not torch.equal(red[0], _norm_add(summed, res, post, pre, None)[0])


@pytest.mark.parametrize("batch", [1, 8])
def test_a_tail_norms_its_output_as_the_next_layer_would(batch):
    """norm_add_rows' second output with the layer scalar (the next layer's input_layernorm of the scaled sum) is
    bitwise rms_norm of the tail's own output, what that layer computes; red twin: another eps is not."""
    from foldkv.fused_step import _norm_add, norm_eps, rms_norm

    post, nxt = _norm(5376, True, 1), _norm(5376, True, 3)
    x, res = _input((batch, 1, 5376), 50 + batch), _input((batch, 1, 5376), 60 + batch, spread=0.5)
    scalar = torch.tensor([0.6171875], device="cuda", dtype=BF16)
    h, y = _norm_add(x, res, post, nxt, scalar)
    assert torch.equal(y, rms_norm(h, nxt.weight, norm_eps(nxt)))
    assert not torch.equal(_norm_add(x, res, post, _norm(5376, True, 3, eps=1e-3), scalar)[1], y)


def _tail_run(model, ids, sums: bool, next_norm: bool, monkeypatch):
    """The 6-layer model's logits through the step's forward with the tail links as told, and (partials a norm
    summed, rms_norm calls)."""
    from foldkv import fused_step as fs

    took = {"summed": 0, "rms_norm": 0}
    own_norm_add, own_norm = fs._norm_add, fs.rms_norm

    def norm_add(x, residual, first, second, scalar, parts=None):
        took["summed"] += parts is not None
        return own_norm_add(x, residual, first, second, scalar, parts)

    def norm(*a, **kw):
        took["rms_norm"] += 1
        return own_norm(*a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(fs, "_norm_add", norm_add)
        mp.setattr(fs, "rms_norm", norm)
        logits = step_logits(model, ids, StepOptions(tail_sums=sums, tail_next_norm=next_norm))
    return logits, took


@pytest.mark.parametrize("batch", [1, 8])
def test_the_tail_links_are_bitwise_the_step_without_them(batch, monkeypatch):
    """A 6-layer model of the 31B's kind, one token a sequence, through the step's forward: the logits with split
    partials summed by the norms and the next layer's input norm made by the tail are bitwise those without either
    (each alone too); the sums took every o_proj and down_proj that splits K, the next norms every layer but the
    first. Red twins: the norm told one partial fewer, and the tail norming with the post-feedforward norm's weight
    instead of the next layer's, each move the logits (the routes are read, not recomputed)."""
    require_module("transformers")
    from foldkv import fused_step as fs
    from foldkv import gemv
    from foldkv.lab.gemma31b import build_gemma4_31b

    model = build_gemma4_31b("cuda", num_layers=6, vocab_size=1024, hidden_size=512, intermediate_size=1536)
    ids = torch.randint(3, 1024, (batch, 1), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    assert gemv.tc_config(512, 1536, batch)["SPLIT"] > 1  # down_proj splits K: the sums have partials to take
    splits = sum(gemv.tc_config(*lin.weight.shape, batch)["SPLIT"] > 1 for layer in model.model.layers
                 for lin in (layer.self_attn.o_proj, layer.mlp.down_proj))
    base, off = _tail_run(model, ids, False, False, monkeypatch)
    got, on = _tail_run(model, ids, True, True, monkeypatch)
    assert bool(torch.isfinite(got).all()) and torch.equal(got, base)
    assert off["summed"] == 0 and on["summed"] == splits >= 6, (on, splits)
    assert off["rms_norm"] - on["rms_norm"] == 5, (off, on)
    for sums, next_norm in ((True, False), (False, True)):
        assert torch.equal(_tail_run(model, ids, sums, next_norm, monkeypatch)[0], base), (sums, next_norm)

    own_norm_add = fs._norm_add
    with monkeypatch.context() as mp:
        mp.setattr(fs, "_norm_add", lambda x, res, first, second, scalar, parts=None: own_norm_add(
            x, res, first, second, scalar, None if parts is None else parts[:-1]))
        assert not torch.equal(step_logits(model, ids, StepOptions(tail_next_norm=False)), base)
    with monkeypatch.context() as mp:
        mp.setattr(fs, "_norm_add", lambda x, res, first, second, scalar, parts=None: own_norm_add(
            x, res, first, first if (second is not None and scalar is not None) else second, scalar, parts))
        assert not torch.equal(step_logits(model, ids, StepOptions(tail_sums=False)), base)


def test_branched_projections_compute_what_serial_ones_do():
    """The step's q/k/v and gate/up branches (side streams, merge off) give the logits of the same step with every
    projection on the current stream, bit for bit (the same cuBLAS kernels), on a 6-layer model of the 31B's kind; red
    twin: the first layer's v projection moved by noise changes them (a scale would not: q, k and v are RMS-normed
    after their projections, and a one-token forward attends only to itself, so its k does not reach the output)."""
    require_module("transformers")
    from foldkv import fused_step as fs
    from foldkv.lab.gemma31b import build_gemma4_31b

    model = build_gemma4_31b("cuda", num_layers=6, vocab_size=1024, hidden_size=512, intermediate_size=1536)
    ids = torch.randint(3, 1024, (2, 1), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    step = fs.StepForward(model, StepOptions(merge=False))
    assert all(g.merged is None and g.branch for g in step.qkv + step.gate_up)
    logits = {branches: step_logits(model, ids, StepOptions(merge=False, branches=branches))
              for branches in (False, True)}
    assert torch.isfinite(logits[True]).all()
    diff = (logits[True].float() - logits[False].float()).abs().max().item()
    assert torch.equal(logits[True], logits[False]), f"branched != serial: max |diff| {diff}"
    with torch.no_grad():
        v = model.model.layers[0].self_attn.v_proj.weight
        v.add_(torch.randn(v.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
               .to(v.dtype) * v.float().std())
    moved = step_logits(model, ids, StepOptions(merge=False))
    assert not torch.equal(moved, logits[True]), "the red twin's v projection changed nothing"


@pytest.mark.parametrize("batch", [1, 8])
def test_merged_projections_step_within_the_gemv_bound(batch):
    """The step's forward with the projections merged (one GEMV a group, the norms and GELU reading its column slices in
    place): every projection output within the bf16 GEMV bound of float64 (what each separate GEMV is held to), and
    the step's logits finite, written and within `rounding_bound` of the unmerged step's (twice the neutral figure:
    the unmerged step with every projection rounded once from float64); red twins: the merged tensor's k rows moved
    by noise move the logits past that bound (the step reads the merged tensor, not a stale copy)."""
    require_module("transformers")
    from foldkv import fused_step as fs
    from foldkv.lab.gemma31b import build_gemma4_31b

    model = build_gemma4_31b("cuda", num_layers=6, vocab_size=1024, hidden_size=512, intermediate_size=1536)
    ids = torch.randint(3, 1024, (batch, 1), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    with torch.no_grad():
        unmerged = StepOptions(merge=False)
        serial = step_logits(model, ids, unmerged)
        with exact_projections():
            neutral = step_logits(model, ids, dataclasses.replace(unmerged, pdl=False))
        merged = step_logits(model, ids, StepOptions())
        assert fs.merged_groups(model) == 12
        assert torch.isfinite(merged).all()
        bound = rounding_bound(neutral, serial)
        assert 0 < bound, "the exact-rounded step equals cuBLAS's bit for bit: no neutral figure to hold it to"
        assert (merged.float() - serial.float()).abs().max().item() <= bound
        x = (torch.randn(batch, 1, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
             * 0.5).to(BF16)
        for owner in [*fs.branched_attention_modules(model), *fs.mlp_modules(model)]:
            for name, y in zip(owner._foldkv_merged[1], merged_linear(owner, x)):
                w = getattr(owner, name).weight
                ref = x.double() @ w.double().T
                assert bool(((y.double() - ref).abs() <= _gemv_bound(x, w, ref)).all()), name
        attn = model.model.layers[0].self_attn
        k = attn.k_proj.weight
        k.add_(torch.randn(k.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
               .to(k.dtype) * k.float().std() * 4)
        v = getattr(attn, "v_proj", None)
        if v is not None:
            v.weight.add_(torch.randn(v.weight.shape, generator=torch.Generator(device="cuda").manual_seed(8),
                                      device="cuda").to(k.dtype) * v.weight.float().std())
        moved = step_logits(model, ids, StepOptions())
        assert (moved.float() - serial.float()).abs().max().item() > bound, \
            "the merged tensor's rows moved and the step stayed within the rounding bound"


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_norm_and_gelu_read_strided_slices_as_their_packed_copies(batch):
    """rms_norm over a head-split column slice of a merged output, and gelu_mul over the halves of a gate|up output,
    read in place: bitwise the results of the same kernels over packed copies; red twin: the slice read as if packed
    (wrong rows) differs."""
    from foldkv import fused_step as fs

    g = torch.Generator(device="cuda").manual_seed(batch)
    full = torch.randn(batch, 1, 8192 + 2 * 4096, device="cuda", generator=g).to(BF16)
    w = torch.randn(256, device="cuda", generator=g).to(BF16)
    k = full[..., 8192:8192 + 4096].view(batch, 1, 16, 256)
    got = fs.rms_norm(k, w, 1e-6)
    want = fs.rms_norm(k.contiguous(), w, 1e-6)
    assert torch.equal(got, want)
    if batch > 1:
        wrong = fs.rms_norm(full.reshape(-1)[8192:8192 + batch * 4096].view(batch, 1, 16, 256), w, 1e-6)
        assert not torch.equal(wrong, want)
    gu = torch.randn(batch, 1, 2 * 1536, device="cuda", generator=g).to(BF16)
    gate, up = gu.split(1536, dim=-1)
    assert torch.equal(fs.gelu_mul(gate, up), fs.gelu_mul(gate.contiguous(), up.contiguous()))
    if batch > 1:
        assert not torch.equal(fs.gelu_mul(gu.reshape(-1)[:batch * 1536].view(batch, 1, 1536), up),
                               fs.gelu_mul(gate.contiguous(), up.contiguous()))


# --- the streaming GEMV that lost (bench/versions/gemv_stream.py): it keeps building and meeting its bound ---------
# Bound per element against float64: the bf16 products are exact in float32, each of the K adds rounds by at most one
# float32 ulp of the running sum (|partial| <= sum_k |x_k w_k|), and the result is rounded once to bf16 (half an ulp
# of the output's binade; one ulp taken): |y - ref| <= ulp(ref) + K * 2^-23 * sum_k |x_k w_k|.
GEMV_SHAPES = [(4096, 5376), (5376, 21504), (2048, 5376)]


def _gemv_bound(x, w, ref):
    k = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T
    return _ulp(ref).double() + k * 2.0 ** -23 * mag


def _gemv_case(shape, m, seed):
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, generator=g, device="cuda") * 0.5).to(BF16)
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(BF16)
    return x, w, x.double() @ w.double().T


def _gemv_within_bound(run, shape, rows: int, seed: int) -> bool:
    """`run(x, w, out)` over a fresh case into an output poisoned with NaN: every element must be written (finite),
    and a GEMV that returns its result must return `out` itself. True when every element is inside `_gemv_bound`."""
    x, w, ref = _gemv_case(shape, rows, seed)
    out = torch.full((rows, shape[0]), float("nan"), dtype=BF16, device="cuda")
    got = run(x, w, out)
    assert got is None or got.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(out).all())
    return bool(((out.double() - ref).abs() <= _gemv_bound(x, w, ref)).all())


@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=[f"{n}x{k}" for n, k in GEMV_SHAPES])
def test_stream_gemv_within_its_bound(shape, rows):
    from conftest import bench_version

    gs = bench_version("gemv_stream")
    assert _gemv_within_bound(lambda x, w, out: gs.gemv(x, w, out=out), shape, rows, seed=shape[0] + rows)


def test_stream_gemv_red_twin_wrong_reduction_length():
    """The same check over the kernel told a reduction one K tile short (rows read at the wrong stride) must fail."""
    from conftest import bench_version

    gs = bench_version("gemv_stream")
    shape = (4096, 5376)
    cfg = gs.gemv_config(*shape, torch.cuda.get_device_properties(0).multi_processor_count)

    def short(x, w, out):
        gs.gemv_rows[(shape[0] // cfg["BLOCK_N"],)](x, w, out, 1, shape[0], shape[1] - cfg["BLOCK_K"],
                                                     BLOCK_M=gs.GEMV_MAX_ROWS, **cfg)
    assert not _gemv_within_bound(short, shape, 1, seed=3)


# --- the one-row register-loop GEMV (bench/versions/gemv_fma.py, not measured yet): the same bound as the stream GEMV
@pytest.mark.parametrize("rows_per_program", [2, 4, 16])
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=[f"{n}x{k}" for n, k in GEMV_SHAPES])
def test_fma_gemv_within_its_bound(shape, rows_per_program):
    from conftest import bench_version

    gf = bench_version("gemv_fma")
    assert gf.config(*shape, rows_per_program) is not None  # the kernel runs, not F.linear
    assert _gemv_within_bound(lambda x, w, out: gf.gemv(x, w, rows_per_program, out=out), shape, 1,
                              seed=shape[0] + rows_per_program)


def test_fma_gemv_red_twin_wrong_reduction_length():
    """The same check over the kernel told a reduction one K block short must fail."""
    from conftest import bench_version

    gf = bench_version("gemv_fma")
    shape = (4096, 5376)
    cfg = gf.config(*shape, 4)

    def short(x, w, out):
        gf.gemv_fma_rows[(shape[0] // cfg["ROWS"],)](x.reshape(-1), w, out, shape[1] - cfg["BLOCK_K"], **cfg)
    assert not _gemv_within_bound(short, shape, 1, seed=5)


# --- the same GEMV under programmatic dependent launch (bench/versions/gemv_pdl.py; its winner is foldkv.gemv) --------
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=[f"{n}x{k}" for n, k in GEMV_SHAPES])
def test_pdl_gemv_within_its_bound(shape, prefetch, pdl):
    from conftest import bench_version

    gp = bench_version("gemv_pdl")
    assert _gemv_within_bound(lambda x, w, out: gp.gemv(x, w, 4, prefetch, pdl=pdl, out=out), shape, 1,
                              seed=shape[0] + prefetch)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_pdl_gemv_waits_for_its_producer_and_launches_early(prefetch, graph):
    """A producer writing x 20 us after letting its dependent launch: the PDL GEMV is bitwise its plain launch on the
    clean x (the wait holds, eager and in a graph), and in a graph the red twin reading the head's x before the wait
    is wrong (the GEMV did launch early: capture kept the programmatic edge). Eagerly the overlap is not asserted: on
    the H200 (Triton 3.6.0) an eager PDL launch did not start during its producer's sleep (MODEL_DECODE_NOTES run 11)
    and the library only launches under PDL inside its step's graph."""
    from conftest import bench_version

    got = bench_version("gemv_pdl").race_check(prefetch=prefetch, graph=graph)
    assert got["ok"], got
    if graph:
        assert got["red_caught"], got


def test_pdl_gemv_ptx_loads_no_x_before_its_wait():
    from conftest import bench_version

    gp = bench_version("gemv_pdl")
    pf0, pf1, red = gp.ptx_order(0), gp.ptx_order(1), gp.ptx_order(1, red_x_early=True)
    assert (pf0["waits"], pf0["loads_before_wait"]) == (1, 0)
    assert pf1["waits"] == 1 and 0 < pf1["loads_before_wait"] <= pf1["weight_loads_expected"], pf1
    assert red["loads_before_wait"] > pf1["loads_before_wait"], red  # an x load before the wait is visible here


def test_head_norm_is_rms_norm_of_the_head_rows():
    """gemv_pdl.head_norm (the probe's dependent kernel) against fused_step.rms_norm over the same head rows, with
    and without PDL: bitwise (the same formula, the same rounding)."""
    from conftest import bench_version
    from foldkv import fused_step as fs

    gp = bench_version("gemv_pdl")
    g = torch.Generator(device="cuda").manual_seed(11)
    y = torch.randn(1, 4096, generator=g, device="cuda").to(BF16)
    gamma = (1 + 0.1 * torch.randn(256, generator=g, device="cuda")).to(BF16)
    src = torch.cat([y, y], dim=1)[:, :5376]  # k = 5,376 > 4,096: the rows wrap around y
    want = fs.rms_norm(src.reshape(-1, 256), gamma, 1e-6).reshape(1, -1)
    for pdl in (False, True):
        assert torch.equal(gp.head_norm(y, 5376, gamma, 1e-6, pdl=pdl), want)
