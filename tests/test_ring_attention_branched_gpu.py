"""bench/versions/ring_attention_branched.py on the GPU: a sliding layer's ring attention in two halves on two
streams (the batch's halves, or the KV heads' at B = 1), the library's kernels in each, against
`ring.ring_attention` itself, then in the whole step.

Bounds: each half is the library's arithmetic on its heads (the same batched matmul per head, the same softmax rows):
bitwise, as long as cuBLAS runs each head's GEMM with the same kernel at half the batch (a failure here says it did
not: the version then needs test_ring_attention_split_gpu.py's bound). The output NaN-poisoned before (every element
written). The whole step (the synthetic model's graph generate(), rings of 128 slots partly filled and wrapped): greedy
tokens and logits torch.equal with and without the version, every ring attention through the halves. An odd batch of
3 is refused (the library's). Red twin: each half given the other half's mask rows (at B = 1 the second half's slot 0
dead).

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_ring_attention_branched_gpu.py -k "31b and 8"
"""

from __future__ import annotations

import pytest
import torch

from conftest import RING_GEOMETRIES, bench_version, graph_generate, scaled_module, synthetic_gpu_models

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def branched():
    return bench_version("ring_attention_branched")


def _inputs(batch, geometry, seed):
    hq, hkv, d, w, scaling = RING_GEOMETRIES[geometry]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(batch, hq, 1, d, generator=g, device="cuda") / d ** 0.5 / scaling).to(BF16)
    k = torch.randn(batch, hkv, w, d, generator=g, device="cuda").to(BF16)
    v = torch.randn(batch, hkv, w, d, generator=g, device="cuda").to(BF16)
    slots = torch.arange(w, device="cuda")
    m = torch.stack([((slots + 5 * b) % w) < [w, 300 % w or 1, w // 2, 33][b % 4] for b in range(batch)])
    return q, k, v, m.view(batch, 1, 1, w), scaling


@pytest.mark.parametrize("geometry", list(RING_GEOMETRIES))
@pytest.mark.parametrize("batch", [1, 2, 8])
def test_the_halves_are_the_library(branched, batch, geometry):
    from foldkv.masks import RingMask
    from foldkv.ring import ring_attention

    q, k, v, m, scaling = _inputs(batch, geometry, seed=batch)
    assert branched.refusal(q, k, v, RingMask(m)) is None
    want = ring_attention(scaled_module(scaling), q, k, v, RingMask(m))[0]
    torch.cuda.synchronize()
    got = branched.ring_attend(q, k, v, m, scaling)
    assert bool(torch.isfinite(got).all()), "an output element left unwritten"
    assert got.shape == want.shape and torch.equal(got, want), (
        f"not bitwise the library's: max |gap| {(got.float() - want.float()).abs().max().item():.3g}")
    twin = branched.ring_attend(q, k, v, m, scaling, _red="swap_masks")
    assert not torch.equal(twin, want), "red twin: the halves' masks swapped changed nothing"


def test_an_odd_batch_is_the_librarys(branched):
    from foldkv.masks import RingMask

    q, k, v, m, _ = _inputs(3, "31b", seed=3)
    assert "odd" in branched.refusal(q, k, v, RingMask(m))


LENGTHS = (97, 300, 1000, 5, 64, 129, 700, 33)  # rings of 128 slots: partly filled, wrapped
NEW = 12


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


@pytest.mark.parametrize("lengths", [LENGTHS, LENGTHS[:1]], ids=["batch8", "batch1"])
def test_the_step_with_the_halves(branched, synthetic_model, lengths):
    lib = graph_generate(synthetic_model, lengths, NEW)
    with branched.installed() as route:
        got = graph_generate(synthetic_model, lengths, NEW)
    assert route.calls > 0 and route.refusals == {}, route.report()
    assert bool(torch.isfinite(got[1]).all())
    assert torch.equal(got[0], lib[0]), "greedy tokens differ"
    assert torch.equal(got[1], lib[1]), f"logits differ (max |gap| {(got[1] - lib[1]).abs().max().item():.3g})"
    with branched.installed(red="swap_masks"):
        twin = graph_generate(synthetic_model, lengths, NEW)
    assert not torch.equal(twin[1], lib[1]), "red twin: the halves' masks swapped changed nothing in the step"
