"""bench/versions/window_attention_tilelang.py without a GPU: the band's key-tile bounds (`band_tiles`) and the edge
tiles that need the mask (`tile_needs_mask`) against a brute-force walk of every query's band; the kernel generated
for sm_90a (argument order, TMA loads of K and V, wgmma, the producer's register hand-off, its loop in one warp) and compiled by ptxas
within an SM's limits (no spill, registers x threads within the register file, shared memory within 227 KiB); a
call on the CPU refused before anything is built. Red twins: a bound one tile short misses keys; a mask test without
its upper edge misses tiles; the resource check catches a report over the limits."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import bench_version, require_tilelang

from foldkv.kernels import producer_guard

SM_REGISTERS = 65536
SM_SHARED = 227 * 1024  # an H100 CTA's dynamic shared memory at most
MAX_THREAD_REGISTERS = 255


def version():
    return bench_version("window_attention_tilelang")


def brute_force(q_len: int, kv_len: int, q0: int, tokens: int, window: int, block_n: int):
    """(tiles some query of the block sees a key in, tiles where some (query, key) pair of the block is outside the
    band) for queries q0..min(q0 + tokens, q_len) - 1, the last q_len of kv_len keys."""
    offset = kv_len - q_len
    rows = [offset + t for t in range(q0, min(q0 + tokens, q_len))]
    seen = {j // block_n for p in rows for j in range(max(0, p - window + 1), p + 1)}
    partial = {tile for tile in seen
               if any(not (p - window < j <= p) for p in rows for j in range(tile * block_n, (tile + 1) * block_n))}
    return seen, partial


CASES = [(q_len, q_len + cached, window) for window in (1024, 64, 100, 1) for q_len in (1, 63, 65, 200)
         for cached in (0, 1, window - 1, 3 * window)]


def _problems(band=None, needs_mask=None, block_n: int = 64, tokens: int = 64) -> list[str]:
    v = version()
    band = band or v.band_tiles
    needs_mask = needs_mask or v.tile_needs_mask
    problems = []
    for q_len, kv_len, window in CASES:
        for q0 in range(0, q_len, tokens):
            seen, partial = brute_force(q_len, kv_len, q0, tokens, window, block_n)
            first = kv_len - q_len + q0
            last = kv_len - q_len + min(q0 + tokens, q_len) - 1
            lo, hi = band(first, last, window, block_n)
            if set(range(lo, hi + 1)) != seen:  # every tile visited holds a key of the band, and every such tile is
                problems.append(f"T={q_len} S={kv_len} W={window} q0={q0}: tiles {lo}..{hi}, band {sorted(seen)}")
            masked = {t for t in range(lo, hi + 1) if needs_mask(t * block_n, first, last, window, block_n)}
            if masked != partial:
                problems.append(f"T={q_len} S={kv_len} W={window} q0={q0}: masked {sorted(masked)}, "
                                f"partial {sorted(partial)}")
    return problems


def test_band_tiles_match_a_brute_force_walk():
    assert _problems() == []


def test_the_cells_visit_seventeen_tiles_a_block():
    """The header's count: a full 64-query block visits 17 tiles of 64 at W = 1,024 when S - T is 0 or 63 mod 64
    (both timed cells), 18 at other offsets."""
    v = version()

    def tiles(offset, q0):
        lo, hi = v.band_tiles(offset + q0, offset + q0 + 63, 1024, 64)
        return hi - lo + 1

    assert {tiles(0, q0) for q0 in range(1024, 4096, 64)} == {17}
    assert {tiles(1023, q0) for q0 in range(0, 4096, 64)} == {17}
    assert {tiles(500, q0) for q0 in range(576, 4096, 64)} == {18}  # past the clamp at key 0


def test_a_bound_one_tile_short_misses_keys():
    """Red twin: the last tile left out: each block's diagonal keys are missed."""
    def short(first, last, window, block_n, max_fn=max):
        lo, hi = version().band_tiles(first, last, window, block_n, max_fn)
        return lo, hi - 1

    problems = _problems(band=short)
    assert len(problems) >= len(CASES), problems[:3]


def test_a_mask_without_its_upper_edge_misses_tiles():
    """Red twin: the mask test forgetting keys past the first query (the diagonal tile, S's tail)."""
    problems = _problems(needs_mask=lambda key0, first, last, window, block_n: key0 < last - (window - 1))
    assert problems and all("masked" in p for p in problems), problems[:3]


def emulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, start: float,
            block_n: int = 64, tokens: int = 64) -> torch.Tensor:
    """The kernel's loop in float32 on the CPU for one head (q [T, d], k/v [S, d]): per block of `tokens` queries the
    tiles `band_tiles` names in order, TMA's zero rows past S, the mask on `tile_needs_mask`'s tiles, and the library
    softmax's update (fold_scale: exp2(s c - m c), c = scale log2 e) from a running max of `start`."""
    import math

    v_ = version()
    n_q, n_k = q.shape[0], k.shape[0]
    c = scale * math.log2(math.e)
    out = torch.empty(n_q, v.shape[1])
    for q0 in range(0, n_q, tokens):
        pos = torch.arange(q0, q0 + tokens).clamp(max=n_q - 1) + (n_k - n_q)  # rows past T repeat the last
        first, last = int(pos[0]), int(pos.max())
        lo, hi = v_.band_tiles(first, last, window, block_n)
        qs = q[pos - (n_k - n_q)]
        m, l, acc = torch.full((tokens,), start), torch.zeros(tokens), torch.zeros(tokens, v.shape[1])
        for tile in range(lo, hi + 1):
            keys = torch.arange(tile * block_n, (tile + 1) * block_n)
            kt = torch.where((keys < n_k)[:, None], k[keys.clamp(max=n_k - 1)], 0.0)
            vt = torch.where((keys < n_k)[:, None], v[keys.clamp(max=n_k - 1)], 0.0)
            s = qs @ kt.T
            if v_.tile_needs_mask(tile * block_n, first, last, window, block_n):
                keep = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)
                s = s.masked_fill(~keep, float("-inf"))
            m_prev, m = m, torch.maximum(m, s.amax(1))
            alpha = torch.exp2((m_prev - m) * c)
            p = torch.exp2(s * c - (m * c)[:, None])
            l = l * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ vt
        rows = min(tokens, n_q - q0)
        out[q0:q0 + rows] = (acc / l[:, None])[:rows]
    return out


def test_a_row_whose_first_tiles_miss_its_band():
    """The running max's start (`NO_KEY_YET`): 200 queries over their own 200 keys, window 100: the third block
    (queries 128-191) starts at tile 0 (query 128's band: keys 29-128), which holds no key of its rows from 164 on
    (their bands start at 65 and later). The emulated loop equals the float64 band; red twin: the library prefill's
    -inf start gives NaN there."""
    from foldkv.lab import window_reference as wa

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 16, generator=g) for n in (200, 200, 200))
    first, last = 128, 191
    lo, _ = version().band_tiles(first, last, 100, 64)
    assert lo == 0 and last - 99 > 63  # the case is there: the last rows' bands start past tile 0
    ref = wa.window_attention_reference(q[None, None], k[None, None], v[None, None], window=100, scale=0.25)[0, :, 0]
    got = emulate(q, k, v, 100, 0.25, version().NO_KEY_YET)
    assert torch.isfinite(got).all() and (got.double() - ref).abs().max() < 1e-5
    assert torch.isnan(emulate(q, k, v, 100, 0.25, float("-inf"))[128:]).any()  # red twin


def test_the_block_rows():
    v = version()
    assert v.tokens_per_block(2) == 64 and v.ROWS == 128
    with pytest.raises(ValueError, match="does not divide"):
        v.tokens_per_block(3)


def test_a_cpu_call_is_refused_before_any_build():
    q = torch.zeros(1, 32, 4, 256, dtype=torch.bfloat16)
    k = torch.zeros(1, 16, 4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="on cpu"):
        version().window_attention(q, k, k, window=1024, scale=1.0)
    assert version().build.cache_info().currsize == 0


# --- generation and ptxas for sm_90a, no GPU ------------------------------------------------------------------------
def resource_problems(report: dict) -> list[str]:
    """What of a ptxas report ({"registers", "spill_bytes", "shared", "threads"}) does not fit one CTA on an SM."""
    problems = []
    if report["spill_bytes"]:
        problems.append(f"{report['spill_bytes']} bytes of spills")
    if report["registers"] * report["threads"] > SM_REGISTERS or report["registers"] > MAX_THREAD_REGISTERS:
        problems.append(f"{report['registers']} registers x {report['threads']} threads")
    if report["shared"] > SM_SHARED:
        problems.append(f"{report['shared']} B of shared memory")
    return problems


@pytest.fixture(scope="module", params=[None, 8.0], ids=["plain", "lazy_max"])
def generated(request):
    require_tilelang()
    kernel = version().build(max_slack_log2=request.param)
    return request.param, kernel


def test_generated_kernel(generated):
    slack, kernel = generated
    params = [kernel.prim_func.buffer_map[p].name for p in kernel.prim_func.params]
    assert params == ["Q", "K", "V", "Out"]
    src = kernel.get_kernel_source()
    assert "tma_load(K_desc" in src and "tma_load(V_desc" in src, "K and V tiles by TMA"
    assert src.count("wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32") == 2
    assert "warpgroup_reg_dealloc" in src and "warpgroup_reg_alloc" in src  # the producer warpgroup's hand-off
    assert producer_guard.check_producer_guard("window_attention_tilelang", src) == {"producer_branches": 1}
    assert ("if (moved[0] != 0)" in src) == (slack is not None)  # the lazy max's skipped rescale, and only there
    assert re.search(r"__launch_bounds__\(384, 1\)", src)  # 256 consumer threads + the producer warpgroup


def test_resources_within_one_sm(generated):
    slack, kernel = generated
    report = version().resource_report(max_slack_log2=slack)
    # Q, two stages of K and V, P (bf16): 208 KiB
    assert report["threads"] == 384 and report["dynamic_shared"] == 128 * 256 * 2 + 2 * 2 * 64 * 256 * 2 + 128 * 64 * 2
    assert resource_problems(report) == [], report
    print(f"window_attention_tilelang (slack {slack}): {report}")
    # red twins: a spill, a register count past the file, a third stage of K and V (64 KiB more) are each seen
    assert resource_problems({**report, "spill_bytes": 8}) == ["8 bytes of spills"]
    assert len(resource_problems({**report, "registers": 171})) == 1
    assert len(resource_problems({**report, "shared": report["shared"] + 2 * 64 * 256 * 2})) == 1
