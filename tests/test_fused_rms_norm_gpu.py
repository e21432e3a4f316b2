"""foldkv.fused_rms_norm against transformers' Gemma4RMSNorm on the GPU: the decode step's shapes (hidden 5,376; heads
of 256 and 512; with and without the scale), bf16 inputs drawn at random (never zeros), the output poisoned first.
Bound: both compute in float32 and round once to bf16; only the order of the sum of squares differs, so the float32
results differ by a few float32 ulps and a bf16 output by at most one bf16 ulp of its value. Red twin: the same kernel
with eps 1e-3 (instead of the module's 1e-6) misses the bound on rows of small RMS.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_fused_rms_norm_gpu.py -k "5376-scale"
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_module

pytestmark = pytest.mark.gpu


def _module(dim: int, with_scale: bool):
    require_module("transformers")
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    m = Gemma4RMSNorm(dim, eps=1e-6, with_scale=with_scale).cuda()
    if with_scale:
        with torch.no_grad():
            m.weight.copy_(torch.exp(0.5 * torch.randn(dim, generator=torch.Generator().manual_seed(dim))))
    return m


def _input(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rms = torch.exp(2.0 * torch.randn(*shape[:-1], 1, generator=g, device="cuda"))  # rows of RMS 1e-3 .. 1e3
    return (torch.randn(*shape, generator=g, device="cuda") * rms).to(torch.bfloat16)


def _ulp_bf16(y: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(y.float().abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - 7)


@pytest.mark.parametrize("with_scale", [True, False], ids=["scale", "no-scale"])
@pytest.mark.parametrize("shape", [(1, 1, 5376), (8, 1, 5376), (3, 1, 32, 256), (8, 1, 4, 512), (1, 1, 16, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fused_rms_norm_matches_the_module(shape, with_scale):
    from foldkv.fused_rms_norm import fused_norms, rms_norm

    m = _module(shape[-1], with_scale)
    x = _input(shape, seed=sum(shape))
    want = m(x)
    got = rms_norm(x, m.weight if with_scale else None, m.eps)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(torch.isfinite(got).all())
    gap = (got.float() - want.float()).abs()
    assert bool((gap <= _ulp_bf16(want)).all()), f"max gap {float(gap.max()):.3g}"
    with fused_norms(torch.nn.Sequential(m)) as n:  # the context swaps the module's forward and puts it back
        assert n == 1 and torch.equal(m(x), got)
    assert "forward" not in m.__dict__ and torch.equal(m(x), want)


def test_fused_rms_norm_red_twin_wrong_eps():
    from foldkv.fused_rms_norm import rms_norm

    m = _module(256, True)
    x = _input((64, 256), seed=5)
    want = m(x)
    got = rms_norm(x, m.weight, 1e-3)
    gap = (got.float() - want.float()).abs()
    assert not bool((gap <= _ulp_bf16(want)).all()), "eps 1e-3 passed the one-ulp bound"
