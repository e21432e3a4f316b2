"""The bf16 folded prefill (kernels/prefill_folded.py, the seesaw with released halves) without a GPU: its softmax
schedule emulated on the CPU (warpgroup 0 takes m0 from its own tile, warpgroup 1 m1 = max(m0, its tile), warpgroup 0
rescales P0 and its half of the output by exp2(m0 - m1); the lazy max on both sides; an odd tile count leaves
warpgroup 1's last tile empty) against float64 softmax attention; the kernel generated for sm_90a (each part of a
stage loaded on its own barrier with its bytes, in release order; the producer loop in one warp; warpgroup 0's P.V
from registers). Red twins: warpgroup 0 not rescaling P0 onto m1 misses the reference; the source with a part waiting
on another's release, or a box short of its bytes, fails the part check."""

from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import bench_version, require_tilelang

from foldkv.kernels import producer_guard

C = math.log2(math.e)  # the kernel's scale: scores in natural units, exp2(s c - m c)
SLACK = 8.0 / C  # max_slack_log2 8 in score units


def version():
    from foldkv.kernels import prefill_folded

    return prefill_folded


def lazy(m, base, slack):
    return m if slack is None else torch.where(m - base > slack, m, base)


def emulate(s: torch.Tensor, v: torch.Tensor, slack: float | None = SLACK, rescale_p0: bool = True,
            block_n: int = 64):
    """The kernel's loop for one CTA's rows in float64: s [M, N] scores, v [N, D] values (N a multiple of block_n);
    warpgroup 0 keeps output columns [0, D/2), warpgroup 1 [D/2, D). Returns (output, largest P seen)."""
    M, N = s.shape
    H = v.shape[1] // 2
    tiles = N // block_n
    neg = torch.full((M,), float("-inf"), dtype=s.dtype)
    m_w0, m_w1 = neg.clone(), neg.clone()
    l0, l1 = torch.zeros(M, dtype=s.dtype), torch.zeros(M, dtype=s.dtype)
    o_l, o_r = torch.zeros(M, H, dtype=s.dtype), torch.zeros(M, H, dtype=s.dtype)
    p_max = 0.0

    def tile(k):
        if k >= tiles:  # past the CTA's last causal key: every score masked, no P.V
            return torch.full((M, block_n), float("-inf"), dtype=s.dtype), torch.zeros(block_n, v.shape[1],
                                                                                      dtype=s.dtype)
        return s[:, k * block_n:(k + 1) * block_n], v[k * block_n:(k + 1) * block_n]

    for i in range((tiles + 1) // 2):
        s0, v0 = tile(2 * i)
        s1, v1 = tile(2 * i + 1)
        # warpgroup 0: m0 from its own tile, then its softmax and P0.V0_L on m0
        m_prev0 = m_w0
        m0 = lazy(torch.maximum(m_prev0, s0.amax(1)), m_prev0, slack)
        alpha0 = torch.exp2((m_prev0 - m0) * C)
        p0 = torch.exp2(s0 * C - (m0 * C)[:, None])
        l0 = l0 * alpha0 + p0.sum(1)
        o_l = o_l * alpha0[:, None] + p0 @ v0[:, :H]
        # warpgroup 1: m1 = max(m0, its tile), decided against m0
        m_prev1 = m_w1
        m1 = lazy(torch.maximum(m0, s1.amax(1)), m0, slack)
        alpha1 = torch.exp2((m_prev1 - m1) * C)
        p1 = torch.exp2(s1 * C - (m1 * C)[:, None])
        l1 = l1 * alpha1 + p1.sum(1)
        o_r = o_r * alpha1[:, None] + p1 @ v1[:, H:]
        # warpgroup 0 onto m1: P0 for warpgroup 1, its output and denominator; then P1.V1_L
        beta = torch.exp2((m0 - m1) * C)
        p0_shared = p0 * beta[:, None] if rescale_p0 else p0
        l0, o_l = l0 * beta, o_l * beta[:, None]
        o_l = o_l + p1 @ v1[:, :H]
        o_r = o_r + p0_shared @ v0[:, H:]
        m_w0, m_w1 = m1, m1
        p_max = max(p_max, float(p0.max()), float(p1.max()), float(p0_shared.max()))
    return torch.cat([o_l, o_r], 1) / (l0 + l1)[:, None], p_max


def case(seed: int, tiles: int, M: int = 64, D: int = 32, spread: float = 12.0):
    """Scores whose row max climbs tile by tile (so the max moves past the slack on some pairs, not on others) and a
    causal edge on the last tile: row r sees keys up to N - M + r - 7."""
    g = torch.Generator().manual_seed(seed)
    N = tiles * 64
    s = torch.randn(M, N, generator=g, dtype=torch.float64) * 2
    s += torch.linspace(0, spread, N, dtype=torch.float64)[None, :] * (torch.rand(M, 1, generator=g,
                                                                                dtype=torch.float64) > 0.5)
    keys = torch.arange(N)[None, :]
    s = s.masked_fill(keys > (N - M + torch.arange(M) - 7).clamp(min=0)[:, None], float("-inf"))
    v = torch.randn(N, D, generator=g, dtype=torch.float64)
    return s, v


def reference(s, v):
    return torch.softmax(s, 1) @ v


@pytest.mark.parametrize("tiles", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("slack", [None, SLACK], ids=["eager_max", "lazy_max"])
def test_schedule_matches_softmax(tiles, slack):
    s, v = case(tiles, tiles)
    out, p_max = emulate(s, v, slack)
    assert torch.allclose(out, reference(s, v), rtol=1e-12, atol=1e-12)
    assert p_max <= 2.0 ** 8 * (1 + 1e-12)  # the lazy max's bound on P (bf16 in the P.Vs)


def test_p0_not_rescaled_misses():
    """Red twin: warpgroup 0 handing over P0 on m0 (not m1) puts warpgroup 1's half on two maxima."""
    s, v = case(5, 9)
    out, _ = emulate(s, v, SLACK, rescale_p0=False)
    assert not torch.allclose(out, reference(s, v), rtol=1e-6, atol=1e-6)


# --- generation for sm_90a, no GPU ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def source():
    require_tilelang()
    return version().build().get_kernel_source()


def producer_loads(src: str) -> tuple[list[int], dict[int, int]]:
    """(the barriers the producer loop waits on, in order; the bytes each loaded barrier expects) of emitted CUDA."""
    loop = src[src.index(producer_guard.GUARD):src.index("warpgroup_reg_alloc<")]
    waits = [int(w) for w in re.findall(r"mbarrier\[(\d+)\]\.wait", loop)]
    expected = {}
    for bar, nbytes in re.findall(r"mbarrier\[(\d+)\]\.(?:arrive_and_expect_tx|expect_transaction)\((\d+)\)", loop):
        expected[int(bar)] = expected.get(int(bar), 0) + int(nbytes)
    return waits, expected


def test_each_part_loads_on_its_barrier_in_release_order(source):
    """The producer loads X0 (value half [0, 256): 32 KiB), X1 (half [256, 512): 32 KiB), Y0 (K_rot and half [256,
    512): 16 + 32 KiB), Y1 (K_rot and half [0, 256): 48 KiB), each after its own release barrier. Red twins: the
    source with Y0 waiting on Y1's release, or with K_rot's box short of its 16 KiB, fails the same check."""
    v = version()
    kib = 1024
    want = ([v.FREE + p for p in (v.X0, v.X1, v.Y0, v.Y1)],
            {v.LOADED + v.X0: 32 * kib, v.LOADED + v.X1: 32 * kib, v.LOADED + v.Y0: 48 * kib,
             v.LOADED + v.Y1: 48 * kib})
    assert producer_loads(source) == want
    assert len(v.ARRIVALS) == v.P_READY + 2
    y0_wait = f"mbarrier[{v.FREE + v.Y0}].wait"
    assert producer_loads(source.replace(y0_wait, f"mbarrier[{v.FREE + v.Y1}].wait"))[0] != want[0]
    assert producer_loads(source.replace("expect_transaction(16384)", "expect_transaction(8192)"))[1] != want[1]


def test_generated_kernel(source):
    assert producer_guard.check_producer_guard("prefill_folded", source) == {"producer_branches": 1}
    assert re.search(r"__launch_bounds__\(384, 1\)", source)
    assert source.count("tl::wgmma_rs<") == 1  # warpgroup 0's P0.V0 from registers; every other gemm from shared
    assert "warpgroup_reg_dealloc<40>" in source and "warpgroup_reg_alloc<232>" in source


def test_the_in_flight_version_fences_what_it_waits_for(source):
    """bench/versions/prefill_folded_seesaw_async.py (the library's program with its P.Vs left in flight, through the
    `values` hook point): every `wait_wgmma` is followed by the fence of a thread's 128 output registers (and warpgroup
    0's 16 of P), so nvcc reads none of them before the gemm retires; the library (the red twin) waits inside each
    gemm and has no such wait. The two programs differ only there: their producers are the same."""
    src = bench_version("prefill_folded_seesaw_async").build().get_kernel_source()
    waits = re.findall(r"tl::wait_wgmma<(\d)>\(\);\n((?:\s*tl::warpgroup_fence_operand\([^\n]*\n)*)", src)
    assert [w for w, _ in waits] == ["0", "1", "0"]
    assert ", 128);" in waits[0][1] and ", 16);" in waits[0][1]  # warpgroup 0: its output and P
    assert waits[1][1] == "" and ", 128);" in waits[2][1]  # warpgroup 1: X1 released between, then its output
    assert "wait_wgmma" not in source
    assert producer_loads(src) == producer_loads(source)
