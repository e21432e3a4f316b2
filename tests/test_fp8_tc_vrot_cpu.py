"""CPU checks of run 21's version (bench/versions/decode_partial_fp8_tc_vrot.py: the FP8 tensor-core partial over a pool
whose V_rot panel is stored pre-transposed, three value panels transposed a tile and the fourth copied): the pool's
permutation and its inverse; the copy's destinations fill V^T's rows 384-511 with exactly the served transpose's bytes
(emulated on a pool; the unpermuted pool is the red twin); the wrapper's one copy a pool and its refusal inside a
capture; the emitted CUDA (the tile's barriers on one opening and one closing call, three transposes and one copy),
each with a red twin; the harness arm."""

from __future__ import annotations

import pytest
import torch

from foldkv import GEMMA4_31B as G

from conftest import bench_script, bench_version
from test_aot_cpu import require_tilelang_and_nvcc


@pytest.fixture(scope="module")
def vrot():
    return bench_version("decode_partial_fp8_tc_vrot")


def _pool(pages: int = 3, heads: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, heads, 64, 640), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _served_vt(pool: torch.Tensor) -> torch.Tensor:
    """V^T [P, H, 512, 64] as the served kernel's transpose writes it from a page: row d = value-window column d."""
    return pool.view(torch.uint8)[..., 128:].transpose(-1, -2)


def _copied_vt(vrot, stored: torch.Tensor) -> torch.Tensor:
    """V^T's rows 384-511 as the copy writes them from `stored` (the pool as the kernel reads it), by the macro's
    `copy_destination` for every thread (i, j) of T.Parallel(16, 8), row r and byte e."""
    p, h = stored.shape[:2]
    out = torch.zeros(p, h, 512, 64, dtype=torch.uint8)
    panel = stored.view(torch.uint8)[..., 512:]
    for i in range(16):
        for j in range(8):
            for r in range(4):
                row, col = vrot.copy_destination(i, j, r)
                out[:, :, row, col:col + 16] = panel[:, :, i * 4 + r, j * 16:j * 16 + 16]
    return out[:, :, 384:]


def test_the_copy_writes_the_served_transposes_bytes(vrot):
    pool = _pool()
    want = _served_vt(pool)[:, :, 384:]
    assert torch.equal(_copied_vt(vrot, vrot.vrot_pool(pool)), want)
    assert not torch.equal(_copied_vt(vrot, pool), want), "red twin: the unpermuted pool copied as V_rot^T"
    assert torch.equal(vrot.unvrot_pool(vrot.vrot_pool(pool)).view(torch.uint8), pool.view(torch.uint8))
    assert torch.equal(vrot.vrot_pool(pool).view(torch.uint8)[..., :512], pool.view(torch.uint8)[..., :512])


def test_vrot_pool_refuses_other_shapes(vrot):
    with pytest.raises(ValueError, match="64-token pages"):
        vrot.vrot_pool(_pool()[:, :, :32])
    with pytest.raises(ValueError, match="640 columns"):
        vrot.vrot_pool(_pool()[..., :512])


def test_the_wrapper_permutes_each_pool_once(vrot, monkeypatch):
    seen = []
    wrapped = vrot.OverVrotPool(lambda q, pool, scales, *rest: seen.append(pool))
    a, b = _pool(seed=1), _pool(seed=2)
    for pool in (a, a, b):
        wrapped(None, pool, None, 7)
    assert len(wrapped.pools) == 2 and seen[0] is seen[1] and seen[2] is not seen[0]
    assert torch.equal(seen[0].view(torch.uint8), vrot.vrot_pool(a).view(torch.uint8))
    fresh = vrot.OverVrotPool(lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with pytest.raises(RuntimeError, match="inside a capture"):
        fresh(None, a, None)


@pytest.fixture(scope="module")
def vrot_source(vrot):
    require_tilelang_and_nvcc()
    return vrot.build(G).get_kernel_source()  # check_emitted runs inside: the green side


def test_emitted_cuda_has_the_design(vrot, vrot_source):
    facts = vrot.check_emitted(vrot_source)
    assert (facts["transposes"], facts["copies"], facts["threads"]) == (3, 1, 128)


@pytest.mark.parametrize("twin", ["copy_does_not_close", "fourth_transpose"])
def test_red_twins_fail_the_emitted_check(vrot, vrot_source, twin):
    from foldkv.kernels.cuda_checks import ConversionCheckError

    if twin == "copy_does_not_close":  # the value gemm could read V^T before the copy's stores are in
        src = vrot_source.replace("foldkv_e4m3_copy4x16(0, 1,", "foldkv_e4m3_copy4x16(0, 0,")
        with pytest.raises(ConversionCheckError, match="close"):
            vrot.check_emitted(src)
    else:  # the fourth panel transposed as well as copied
        extra = "foldkv_e4m3_t4x16(0, 0, 7, 128); "
        src = vrot_source.replace("foldkv_e4m3_copy4x16(0, 1,", extra + "foldkv_e4m3_copy4x16(0, 1,")
        with pytest.raises(AssertionError, match="off the design"):
            vrot.check_emitted(src)
    assert src != vrot_source


def test_the_harness_has_the_arm():
    harness = bench_script("fp8_harness")
    assert "fp8_tc_vrot" in [a if isinstance(a, str) else a.name for a in harness.ARMS]
