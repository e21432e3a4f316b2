"""foldkv.gemv (the decode step's projections at 1..16 rows as Triton kernels under programmatic dependent launch) and
fused_step's kernels launched with PDL, on the GPU.

Bounds:
- the GEMV against float64: the bf16 products are exact in float32, each of the K adds (the register loop's, the
  tree sum's, the prefetched head's) rounds by at most one float32 ulp of a partial sum bounded by sum_k |x_k w_k|,
  and the result is rounded once to bf16 (half an ulp of the output; one taken):
  |y - ref| <= ulp(ref) + K * 2^-23 * sum_k |x_k w_k| (test_fused_step_gpu's `_gemv_bound`, the same derivation).
- fused_step's kernels with PDL against their plain launches: bitwise (the wait comes before every load and store;
  only the ordering changes).
- the route at 1..16 rows (the tensor-core GEMM, `foldkv.gemv.gemv_tc`; its own tests: test_gemv_tc_gpu.py) within
  the same bound, every element written.
- the whole step (the synthetic Gemma 4 at batch 1 and a left-padded batch of 8, graph): StepOptions.pdl on against off.
  The kernels are not bitwise cuBLAS, so the logits are held to the bound the merged projections are held to against
  the unmerged ones (twice the neutral figure: how far the step with every projection rounded once from float64
  moves them from cuBLAS's, conftest's `rounding_bound`, step by step, the exact-rounded run made to follow the
  incumbent's tokens so that every step's figure describes the same inputs), and the greedy tokens must agree up to
  the first step whose reference top-two margin is itself inside twice that bound (there a flip is a rounding, not a
  bug: the sequences part and nothing after is compared). The static step with PDL on is bitwise the graph's.
Red twins: the kernel told a K range one tile short; in a graph, the route's head x loaded before its wait and a
fused_step kernel launched with PDL but built without its wait (each reads the poisoned x: `foldkv.lab.pdl_checks`);
the step with every routed projection's input missing its last K block moves the logits past the bound.

Reproduce: FOLDKV_REQUIRE_GPU=1 PYTHONPATH=$PWD/lib python -m pytest -q tests/test_gemv_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import exact_projections, left_padded_batch, require_module, rounding_bound, synthetic_gpu_models
from test_fused_step_gpu import _gemv_case, _gemv_within_bound

from foldkv.lab import pdl_checks
from foldkv.lab.pdl_checks import gemv_routes
from foldkv.step_options import StepOptions, using

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
# the 31B's projection shapes at one row: sliding q|k|v merged, global q|k merged, gate|up merged, o_proj (sliding,
# global), down_proj; a small one
SHAPES = [(16384, 5376), (18432, 5376), (43008, 5376), (5376, 8192), (5376, 16384), (5376, 21504), (2048, 5376)]


@pytest.fixture(autouse=True)
def _gdc():
    from foldkv import gemv

    if not gemv.HAS_GDC:
        from conftest import skip_or_fail

        skip_or_fail("Triton has no triton.language.extra.cuda.gdc_wait (PDL)")
    from foldkv.step_options import in_force

    assert in_force().pdl


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_pdl_gemv_within_its_bound(shape):
    from foldkv import gemv

    n, k = shape
    routes = None

    def one_row(x, w, out):  # x as the step's [1, 1, K]
        nonlocal routes
        assert gemv.refusal(x.view(1, 1, k), w) is None
        with gemv_routes() as routes:
            y = gemv.linear(x.view(1, 1, k), w, out=out)
        assert y.shape == (1, 1, n)
        return y
    assert _gemv_within_bound(one_row, shape, 1, seed=n + k)  # poisoned first: every element written, into out
    assert routes == {"kernel": 1}


def test_pdl_gemv_red_twin_one_block_short():
    from foldkv import gemv

    shape = n, k = 4096, 5376
    cfg = gemv.tc_config(n, k, 1)

    def short(x, w, out):
        pdl_checks.tc_launch_twin(x, w, out, cfg, k_split=k // cfg["SPLIT"] - cfg["BLOCK_K"])
    assert not _gemv_within_bound(short, shape, 1, seed=3)


@pytest.mark.parametrize("m", [2, 3, 8, 16])
@pytest.mark.parametrize("shape", [(16384, 5376), (5376, 21504), (262144, 5376)], ids=["qkv", "down", "lm_head"])
def test_the_route_takes_the_kernel_at_2_to_16_rows(shape, m):
    from foldkv import gemv

    n, k = shape
    with gemv_routes() as routes:
        assert _gemv_within_bound(lambda x, w, out: gemv.linear(x, w, out=out), shape, m, seed=n + k + m)
    assert routes == {"kernel": 1}


def test_what_no_kernel_takes_is_f_linear():
    from foldkv import gemv

    x, w, _ = _gemv_case((4096, 5376), 1, seed=4)
    x = x.view(1, 1, 5376)
    cases = [(x.expand(17, 1, 5376).contiguous(), "17 rows, more than 16"), (x.float(), "not bf16"),
             (x, "StepOptions.pdl is off")]
    with gemv_routes() as routes:
        for xi, why in cases:
            wi = w.float() if xi.dtype == torch.float32 else w
            with using(StepOptions(pdl=why != "StepOptions.pdl is off")):
                assert torch.equal(gemv.linear(xi, wi), torch.nn.functional.linear(xi, wi))
    assert routes["kernel"] == 0 and sum(routes.values()) == len(cases)
    assert [why in r for (_, why), r in zip(cases, routes)] == [True] * len(cases)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("consumer", ["gemv", "rms_norm"])
def test_pdl_waits_for_its_producer(consumer, graph):
    """The wait holds (eager and in a graph); in the graph the red twin is caught: the consumer did launch during
    its producer, so PDL is in effect there (eagerly the H200 did not overlap: red_caught is not asserted)."""
    from foldkv.lab.pdl_checks import race_check

    got = race_check(consumer, graph=graph)
    assert got["ok"], got
    if graph:
        assert got["red_caught"], got


def test_pdl_gemv_ptx_loads_no_x_before_its_wait():
    from foldkv.lab.pdl_checks import ptx_order

    plain, red = ptx_order(), ptx_order(red_x_early=True)
    assert plain["waits"] == 1 and 0 < plain["loads_before_wait"] <= plain["weight_loads_expected"], plain
    assert plain["cp_async_before_wait"] == 0, plain
    assert red["loads_before_wait"] > plain["loads_before_wait"], red


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _ops():
    """Each fused_step op on random inputs of the 31B's shapes at batch 1 (bf16): name -> zero-argument call."""
    import step_twins as twins
    from foldkv import fused_step as fs

    require_module("transformers")
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    g = _gen(1)
    x = torch.randn(1, 1, 5376, generator=g, device="cuda").to(BF16)
    res = torch.randn(1, 1, 5376, generator=g, device="cuda").to(BF16)
    norm = Gemma4RMSNorm(5376, eps=1e-6).cuda().to(BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.exp(0.5 * torch.randn(5376, generator=g, device="cuda")))
    heads = torch.randn(1, 1, 32, 256, generator=g, device="cuda").to(BF16)
    ang = torch.rand(1, 1, 256, generator=g, device="cuda") * 40
    cos, sin = ang.cos().to(BF16), ang.sin().to(BF16)
    gu = torch.randn(1, 1, 2 * 21504, generator=g, device="cuda").to(BF16)
    gate, up = gu.split(21504, dim=-1)
    scores = torch.randn(1, 16, 2, 1024, generator=g, device="cuda").to(BF16)
    mask = torch.rand(1, 1, 1, 1024, generator=g, device="cuda") > 0.3
    qkv = torch.randn(1, 1, (32 + 32) * 256, generator=g, device="cuda").to(BF16)
    q, k, v = qkv.split([32 * 256, 16 * 256, 16 * 256], dim=-1)
    w = torch.exp(0.5 * torch.randn(256, generator=g, device="cuda")).to(BF16)
    scalar = torch.tensor([0.6171875], device="cuda", dtype=BF16)

    def ring():
        rk = torch.zeros(1, 16, 1024, 256, dtype=BF16, device="cuda")
        rv = torch.zeros_like(rk)
        twins.kv_to_ring(k, v, w, 1e-6, 1e-6, cos, sin, rk, rv, torch.tensor([37], device="cuda"))
        return torch.cat([rk, rv])

    return {"rms_norm": lambda: fs.rms_norm(x, norm.weight, 1e-6),
            "rms_norm_heads": lambda: fs.rms_norm(heads, None, 1e-6),
            "norm_add_norm": lambda: torch.cat(twins.norm_add_norm(x, res, norm, norm)),
            "norm_add_scale": lambda: twins.norm_add_scale(x, res, norm, scalar),
            "rope": lambda: fs.rope(heads, cos, sin),
            "gelu_mul": lambda: fs.gelu_mul(gate, up),
            "masked_softmax": lambda: fs.masked_softmax(scores, mask, BF16),
            "q_norm_rope": lambda: fs.q_norm_rope(q, w, 1e-6, cos, sin, 32),
            "kv_to_ring": ring}


def test_fused_step_kernels_under_pdl_are_bitwise_their_plain_launches():
    from foldkv import gemv

    ops = _ops()
    x = torch.zeros(1, device="cuda")
    assert gemv.pdl_kw(x) == dict(GDC=True, launch_pdl=True)
    with_pdl = {name: op() for name, op in ops.items()}
    with using(StepOptions(pdl=False)):
        assert gemv.pdl_kw(x) == {}
        plain = {name: op() for name, op in ops.items()}
    for name in ops:
        assert bool(torch.isfinite(plain[name]).all()), name
        assert torch.equal(with_pdl[name], plain[name]), name


# --- the whole step -----------------------------------------------------------------------------------------------
NEW = 8


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv")["foldkv"]


# batch 1 (the one-row GEMV) and a left-padded batch of 8 (the tensor-core GEMM)
BATCHES = {1: (300,), 8: (300, 257, 1, 129, 65, 63, 200, 17)}


def _generate(model, decode_step="graph", batch=1, follow=None, options=None):
    """(new tokens, logits of every step) of greedy generate() through a FoldKvCache (its step_options: `options`, None:
    those in force). follow: new tokens [B, NEW] the
    run is made to pick at every step (a logits processor; the logits returned are the model's own, unprocessed): the
    exact-rounded run taken along the incumbent's sequence, so its figure describes the same inputs at every step."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    lens = BATCHES[batch]
    ids, mask = left_padded_batch(lens, model.config.vocab_size, seed=7)
    cache = FoldKvCache(model, max_batch=len(lens), max_tokens=max(lens) + NEW, scatter_seed=3,
                        decode_step=decode_step, step_options=options)
    extra = {}
    if follow is not None:
        start = ids.shape[1]

        class Follow(LogitsProcessor):
            def __call__(self, input_ids, scores):
                pick = follow[:, input_ids.shape[1] - start].to(scores.device)
                return torch.full_like(scores, float("-inf")).scatter_(1, pick[:, None], 0.0)

        extra["logits_processor"] = LogitsProcessorList([Follow()])
    out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache}, **extra)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu()


def _agree(got, want, neutral) -> tuple[int, list[float]]:
    """Steps compared and each step's bound (`rounding_bound`: twice how far the exact-rounded projections, taken
    along the incumbent's tokens, move the logits from the incumbent's at that step). Tokens equal and logits within
    the bound, up to the first step where the got sequence parts at a top-two margin inside twice the bound (a
    rounding flip: the sequences part and nothing after is compared)."""
    assert torch.equal(neutral[0], want[0]), "the exact-rounded run did not follow the incumbent's tokens"
    bounds = []
    for t in range(want[0].shape[1]):
        bound = rounding_bound(neutral[1][t], want[1][t])
        assert bound > 0, f"step {t}: the exact-rounded logits equal the incumbent's: no neutral figure"
        bounds.append(bound)
        assert (got[1][t] - want[1][t]).abs().max().item() <= bound, f"step {t}: logits past {bound:.3g}"
        if not torch.equal(got[0][:, t], want[0][:, t]):
            top2 = want[1][t].topk(2, dim=-1).values
            margin = (top2[..., 0] - top2[..., 1]).min().item()
            assert margin <= 2 * bound, f"step {t}: token flipped at a margin of {margin:.3g} (bound {bound:.3g})"
            return t + 1, bounds
    return want[0].shape[1], bounds


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_the_graph_step_with_and_without_the_tail_links(synthetic_model, monkeypatch, batch):
    """generate() through a FoldKvCache (graph step): the tail links (split partials summed by the layer's norms, the
    next layer's input norm made by the tail: StepOptions.tail_sums, tail_next_norm) give the tokens and logits of
    the step without them, bit for bit, having taken every o_proj and every down_proj whose GEMM splits K."""
    from foldkv import fused_step as fs
    from foldkv import gemv

    without = _generate(synthetic_model, batch=batch, options=StepOptions(tail_sums=False, tail_next_norm=False))
    summed, own = [], fs._norm_add

    def counted(x, residual, first, second, scalar, parts=None):
        summed.extend([first] if parts is not None else [])
        return own(x, residual, first, second, scalar, parts)

    monkeypatch.setattr(fs, "_norm_add", counted)
    with_links = _generate(synthetic_model, batch=batch)
    assert torch.equal(with_links[0], without[0]) and torch.equal(with_links[1], without[1])
    rows = len(BATCHES[batch])
    splits = lambda lin: (gemv.tc_config(*lin.weight.shape, rows) or {}).get("SPLIT", 1) > 1  # noqa: E731
    layers = synthetic_model.model.layers
    # the norm after each projection that splits K: post_feedforward after down_proj, post_attention after o_proj
    split = [m.post_feedforward_layernorm for m in layers if splits(m.mlp.down_proj)]
    split += [m.post_attention_layernorm for m in layers if splits(m.self_attn.o_proj)]
    assert split, "no projection of the synthetic model splits K: nothing to check"
    assert sorted(map(id, summed)) == sorted(map(id, split * 2)), (len(summed), len(split))  # warm-up and capture


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_the_step_with_and_without_the_pdl_gemv(synthetic_model, monkeypatch, batch):
    from foldkv import fused_step as fs
    from foldkv import gemv

    with gemv_routes() as routes:
        plain = _generate(synthetic_model, batch=batch, options=StepOptions(pdl=False))
    assert routes["kernel"] == 0
    with gemv_routes() as routes:
        pdl = _generate(synthetic_model, batch=batch)
    # the merged groups, each o_proj and down_proj and the LM head (every one a plain Linear here)
    routed = fs.merged_groups(synthetic_model) + 2 * len(synthetic_model.model.layers) + 1
    # the warm-up and the capture; the prefill's projections F.linear (pdl off there)
    assert routes["kernel"] == 2 * routed and set(routes) <= {"kernel", "StepOptions.pdl is off"}, routes
    assert bool(torch.isfinite(pdl[1]).all())
    with exact_projections():
        neutral = _generate(synthetic_model, batch=batch, follow=plain[0])
    steps, bounds = _agree(pdl, plain, neutral)
    assert steps >= 2, (steps, bounds)  # the prompt's forward and at least the first step
    static = _generate(synthetic_model, "static", batch)  # the graph replays the static step bit for bit
    assert torch.equal(static[0], pdl[0]) and torch.equal(static[1], pdl[1])

    # red twin: every routed projection's input missing its last K block (a reduction one block short) moves the
    # logits past the bound
    own = gemv.linear

    def short(x, weight, bias=None, **kw):
        cut = x.clone()
        cut[..., -gemv.tc_config(*weight.shape, 1)["BLOCK_K"]:] = 0
        return own(cut, weight, bias, **kw)

    monkeypatch.setattr(gemv, "linear", short)
    twin = _generate(synthetic_model, batch=batch)
    # (logits[0] is the prompt's forward, not a step; logits[1] is the first step's, after the same tokens)
    assert (twin[1][1] - plain[1][1]).abs().max().item() > bounds[1], "a GEMV one block short stayed inside the bound"
