"""bench/versions/window_attention_tilelang.py on the GPU: the TileLang window kernel against the float64 band on the
hostile cases of bench/window_kernel_probe.py (batch 1 and 2; 1, 63, 65 and 4,096 queries; S = T and S = T + 1,023;
the 31B's 32 query heads over 16 KV heads of 256, window 1,024), the output NaN-poisoned before the launch and every
element finite and within the bound tests/test_window_attention_gpu.py derives (`window_kernel_probe.window_check`);
the lazy-max build on the longest case; a refusal launches nothing. Red twin: the kernel built with a key-tile bound
one tile short (`band_tiles` missing its last tile: each block's own diagonal) is outside the bound.

Reproduce a case: FOLDKV_REQUIRE_GPU=1 pytest tests/test_window_kernel_gpu.py -k "<case id>"
"""

from __future__ import annotations

import pytest
import torch

from conftest import bench_script, bench_version, require_hopper, require_tilelang

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def probe():
    require_hopper()
    require_tilelang()
    return bench_script("window_kernel_probe")


def _run(probe, batch, q_len, kv_len, **tiling):
    q, k, v = probe.inputs(batch, q_len, kv_len, "cuda", 11 + q_len + kv_len)
    out = torch.full((batch, q_len, probe.HEADS, probe.HEAD_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = bench_version("window_attention_tilelang").window_attention(q, k, v, window=probe.WINDOW, scale=probe.SCALE,
                                                                       out=out, **tiling)
    assert got is out
    return probe.window_check(out, q, k, v, probe.WINDOW, probe.SCALE)


@pytest.mark.parametrize("batch,q_len,kv_len", bench_script("window_kernel_probe").HOSTILE,
                         ids=lambda x: str(x))
def test_window_kernel_against_float64(probe, batch, q_len, kv_len):
    r = _run(probe, batch, q_len, kv_len)
    assert r["finite"] and r["within"], r


def test_lazy_max_against_float64(probe):
    r = _run(probe, 2, 4096, 4096 + probe.WINDOW - 1, max_slack_log2=probe.LAZY_SLACK_LOG2)
    assert r["finite"] and r["within"], r


def test_a_band_one_tile_short_is_caught(probe):
    """Red twin: the last key tile of every block left out (its own diagonal keys); 65 queries over 65 keys: two
    blocks, each missing its diagonal tile."""
    version = bench_version("window_attention_tilelang")

    def short(first_pos, last_pos, window, block_n, max_fn=max):
        lo, hi = version.band_tiles(first_pos, last_pos, window, block_n, max_fn)
        return lo, hi - 1

    r = _run(probe, 1, 65, 65 + probe.WINDOW - 1, band=short)
    assert not r["within"], r


def test_refusal_launches_nothing(probe):
    version = bench_version("window_attention_tilelang")
    q, k, v = probe.inputs(1, 8, 8, "cuda", 1)
    out = torch.full((1, 8, probe.HEADS, probe.HEAD_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="dtype torch.float16"):
        version.window_attention(q.half(), k.half(), v.half(), window=probe.WINDOW, scale=1.0, out=out.half())
    with pytest.raises(ValueError, match=r"0 < scale < 1e8"):
        version.window_attention(q, k, v, window=probe.WINDOW, scale=1e9, out=out)
    with pytest.raises(ValueError, match="out"):
        version.window_attention(q, k, v, window=probe.WINDOW, scale=1.0, out=out[:, :7])
    assert bool(out.isnan().all())
