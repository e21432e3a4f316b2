"""GPU gates of the fused prep kernel (bench/versions/prep_fused.py) against the torch prep (`foldkv.prep_and_store` on the same GPU): the stored
rows, the whole pool around them and the returned query, bit for bit except where the one documented difference in
float order (the RMSNorm sum of squares) moves a value across a bf16 rounding boundary: there |got - want| <=
2^-7 |want| + 2^-16 max|row| (one bf16 ulp, plus the absolute term RoPE's cancellation needs: a - b near 0 amplifies
a last-bit change of the norm scale into many ulps of a tiny result), on at most 1e-4 of the elements (reported).
For one decode token per request, a prefill chunk starting mid-page and a ragged chunk; refusals leave the pool
unchanged.

The FP8 (e4m3) folded pool: the same difference seen through the quantization, with bounds derived below
(`fp8_bounds`): each scale within a few float32 ulps of torch's, each e4m3 value inside the e4m3 rounding of the
interval x/scale can reach, and the dequantized rows within the triangle of the two roundings and the row difference.
The comparison's red twins (one value moved by one code, two tokens' scales swapped, a scale off by 2^-10) run on the
CPU on a simulated difference and on the GPU on the kernel's own pool.

    FOLDKV_REQUIRE_GPU=1 python -m pytest -m gpu tests/test_prep_kernel_gpu.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import bench_version

import foldkv
from foldkv import FoldKvInputError, KvFormat, PagedKvLayout, PagedKvPool
from foldkv.fp8 import FP8_DTYPE, quantize_rows
from foldkv.lab.gates.fold import dense_attention_reference
from foldkv.lab.gates.fp8_pool import ROW_REL, ROW_SUB

prep_and_store_gpu = bench_version("prep_fused").prep_and_store_gpu

gpu = pytest.mark.gpu

GEOM = foldkv.GEMMA4_31B
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]
MAX_FLIP_FRACTION = 1e-4  # elements not bit-equal (measured ~5e-6: the RMSNorm sum order, see prep_fused)
GATE_LOG = os.environ.get("FOLDKV_PREP_GATE_LOG")

CASES = {  # name: (seq_lens of the requests, tokens written per request: their last positions)
    "decode_5_requests": ([54, 97, 4096, 1, 163], [1, 1, 1, 1, 1]),
    "chunk_97_mid_page": ([1000], [97]),
    "ragged_chunks": ([300, 65, 2049], [300, 1, 130]),
}


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 ulps via the integer encodings (same-sign values; NaN == NaN when the bits are equal)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


def flips(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Elements whose bits differ, and the worst of |got - want| / (2^-7 |want| + 2^-16 max|row of want|) over them
    (<= 1 passes). Rows are the last dimension; NaN-filled untouched pool rows compare bit-equal."""
    ulp = ulp_diff(got, want)
    diff = ulp > 0
    g, w = got.double(), want.double()
    row_max = torch.nan_to_num(w.abs(), nan=0.0).amax(dim=-1, keepdim=True)
    bound = 2.0**-7 * w.abs() + 2.0**-16 * row_max
    ratio = ((g - w).abs() / bound)[diff]
    return dict(flips=int(diff.sum()), elems=got.numel(), max_ulp=int(ulp.max()),
                worst_over_bound=float(torch.nan_to_num(ratio, nan=float("inf")).max()) if ratio.numel() else 0.0)


def make_inputs(fmt: KvFormat, seq_lens, writes, seed, device, dtype=torch.bfloat16, pool_dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = sum(-(-n // 64) for n in seq_lens)
    pool = PagedKvPool(PagedKvLayout(GEOM, fmt, 64, pages + 3, pool_dtype), device=device, fill=float("nan"))
    table = pool.allocate(seq_lens, scatter_seed=seed, pad_pages=1, pad_value=-1)
    request = torch.cat([torch.full((w,), r, dtype=torch.int32) for r, w in enumerate(writes)])
    positions = torch.cat([torch.arange(n - w, n, dtype=torch.int32) for n, w in zip(seq_lens, writes)])
    t = int(request.numel())
    q = torch.randn(t, GEOM.num_q_heads, GEOM.head_dim, generator=gen, device=device).to(dtype) * 3
    kv = torch.randn(t, GEOM.num_kv_heads, GEOM.head_dim, generator=gen, device=device).to(dtype) * 2
    q_norm_w = torch.rand(GEOM.head_dim, generator=gen, device=device) + 0.5
    k_norm_w = torch.rand(GEOM.head_dim, generator=gen, device=device) + 0.5
    return pool, table.to(device), request.to(device), positions.to(device), q, kv, q_norm_w, k_norm_w


# fp32 inputs are a separate build of the same kernel: one case of them is enough (listed, not skipped, so that
# FOLDKV_REQUIRE_GPU=1 runs show no skip)
DTYPE_CASES = [(torch.bfloat16, c) for c in CASES] + [(torch.float32, "ragged_chunks")]


@gpu
@pytest.mark.parametrize("dtype, case", DTYPE_CASES, ids=[f"{'bf16' if d == torch.bfloat16 else 'fp32'}-{c}"
                                                         for d, c in DTYPE_CASES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prep_matches_torch_prep(cuda_device, fmt, case, dtype):
    seq_lens, writes = CASES[case]
    pool, table, request, positions, q, kv, qw, kw = make_inputs(fmt, seq_lens, writes, sum(map(ord, case)), cuda_device,
                                                                 dtype)
    torch_pool = PagedKvPool(pool.layout, data=pool.data.clone())
    want = foldkv.prep_and_store(torch_pool, table, request, positions, q, kv, qw, kw)
    got = prep_and_store_gpu(pool, table, request, positions, q, kv, qw, kw)
    torch.cuda.synchronize()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    pages, offsets = pool.token_slots(table, request, positions)
    rows_got = pool.data[pages.to(cuda_device), :, offsets.to(cuda_device)]
    assert torch.isfinite(rows_got).all(), "a stored row element was not written"
    fq = flips(got, want)
    fr = flips(pool.data, torch_pool.data)  # the whole pool: elsewhere it must be untouched (bit-equal NaN)
    row = dict(format=fmt.value, case=case, dtype=str(dtype), tokens=int(request.numel()),
               query=fq, pool=dict(fr, rows_elems=rows_got.numel()))
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert fq["worst_over_bound"] <= 1.0 and fr["worst_over_bound"] <= 1.0, row
    assert fq["flips"] <= MAX_FLIP_FRACTION * fq["elems"], row
    assert fr["flips"] <= MAX_FLIP_FRACTION * rows_got.numel(), row


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_prep_then_prefill_matches_dense_reference(cuda_device, fmt):
    """Raw projections -> fused prep of a whole 300-token prompt -> prefill equals the float64 dense Gemma 4
    attention from the raw inputs (the end-to-end meaning of both kernels)."""
    from foldkv.kernels.prefill import prefill

    n = 300
    pool, table, request, positions, q, kv, qw, kw = make_inputs(fmt, [n], [n], 5, cuda_device)
    qw = qw * 0.1  # scores of a few units
    query = prep_and_store_gpu(pool, table, request, positions, q, kv, qw, kw)
    out, _ = prefill(pool, query, table, torch.tensor([n], dtype=torch.int32, device=cuda_device))
    ref = dense_attention_reference(GEOM, q, kv, qw, kw, positions.long())
    torch.cuda.synchronize()
    err = out.double() - ref
    rel = float(err.norm() / ref.norm())
    assert rel < 2e-2, rel


@gpu
@pytest.mark.parametrize("bad", ["position_past_len", "kv_dtype", "weight_shape", "request_index"])
def test_refusals_leave_pool_unchanged(cuda_device, bad):
    pool, table, request, positions, q, kv, qw, kw = make_inputs(KvFormat.FOLDED, [130, 65], [3, 2], 3, cuda_device)
    if bad == "position_past_len":
        positions = positions.clone()
        positions[0] = 130
        match = "past its request's length"
    elif bad == "kv_dtype":
        kv = kv.float()
        match = "kv has dtype"
    elif bad == "weight_shape":
        qw = qw[:-1]
        match = "q_norm_weight has shape"
    else:
        request = request.clone()
        request[-1] = 2
        match = "request index"
    before = pool.data.clone()
    with pytest.raises(FoldKvInputError, match=match):
        prep_and_store_gpu(pool, table, request, positions, q, kv, qw, kw)
    torch.cuda.synchronize()
    assert torch.equal(pool.data.view(torch.int16), before.view(torch.int16))


# --- the FP8 folded pool ---------------------------------------------------------------------------------------------
# The bounds, derived. The kernel and the torch prep compute the same float32 row x with the same operations in the
# same order (module docstring of bench/versions/prep_fused.py), except the RMSNorm sum of squares: 512 exactly computed
# squares (a bf16 square is exact in float32; a float32 one is rounded alike on both sides) summed in two orders. For
# positive terms a summation of depth d errs by <= d u (u = 2^-24) of the sum: the kernel's tree has depth 9 (a pair per
# element, two elements per thread, a 128-thread tree), torch's CUDA reduction of a 512-wide row <= 32 (a 16-element
# vectorised run per thread, then a 32-lane tree). The mean is the sum times 2^-9 (exact), + eps rounds once per side,
# and both sides take rsqrtf (<= 2 ulp from 1/sqrt, so <= 4u each): the two norm scales differ by at most
#   e = (9 + 32) u / 2 + 2u + 8u = 30.5 u  <=  NORM_SCALE_REL = 2^-19 (32 u) of either.
# From the norm scale to the stored row (each op one rounding, <= u, per side):
#   value columns  V = x ss:                                  |dV| <= (e + 3u) |V|
#   rotated K      K = V w, r = (K_lo c) + (-K_hi s):          |dr| <= (e + 9u) |(r_lo, r_hi)|
# (Cauchy-Schwarz: |K_lo c| + |K_hi s| <= |(K_lo, K_hi)| = |(r_lo, r_hi)| up to a few u, the pair's norm). So
# |dx_i| <= ROW_DIFF_REL m_i with ROW_DIFF_REL = e + 9u and m_i = |x_i| for a value column, the norm of its rotate_half
# pair for a rotated one. Then, with A = max_i ROW_DIFF_REL m_i (>= |amax_kernel - amax_torch|: a max is 1-Lipschitz):
#   scale = amax / 448 (IEEE, one rounding per side):          |ds| <= A / 448 + 2u s
#   y = x / scale (IEEE):  |dy_i| <= (|dx_i| + |y_i| |ds|) / (s - |ds|) + 2u (|y_i| + |dy_i|)
# and since the clamp and the cast to e4m3 (round to nearest even) are monotone, the kernel's code lies between the
# codes of clamp(y_i -+ dy_i): usually one code (the interval holds no rounding boundary), the neighbour too where
# it does ("straddles"). A differing code is allowed only there: the count of differing codes is held to the count of
# straddling elements, each derived from the data, not a tuned fraction. The dequantized rows differ by at most
#   |q_k s_k - q_t s_t| <= |dx_i| + (ROW_REL |x_i| + ROW_SUB s)_kernel + (ROW_REL |x_i| + ROW_SUB s)_torch
# (foldkv.fp8's rounding bound on each side). Every bound is first order; SECOND_ORDER covers the products of the
# first-order terms (each <= 2^-18 relative).
U = 2.0**-24
NORM_SCALE_REL = 2.0**-19
ROW_DIFF_REL = NORM_SCALE_REL + 9 * U
SECOND_ORDER = 1 + 2.0**-12
E4M3_MAX = 448.0


def fp8_bounds(x: torch.Tensor, scale: torch.Tensor) -> dict:
    """The derived bounds for torch's float32 folded rows x [N, Hkv, W] and its scales [N, Hkv]: per row "ds" (the
    scale), per element "lo"/"hi" (the e4m3 values, float64, the kernel's code may take) and "deq" (dequantized)."""
    x, s = x.double(), scale.double()
    pairs = GEOM.rotary_pairs
    mag = x.abs().clone()
    pair_norm = torch.hypot(x[..., :pairs], x[..., pairs:2 * pairs])
    mag[..., :pairs], mag[..., pairs:2 * pairs] = pair_norm, pair_norm
    dx = ROW_DIFF_REL * mag * SECOND_ORDER
    ds = (dx.amax(-1) / E4M3_MAX + 2 * U * s) * SECOND_ORDER
    y = (x.float() / scale[..., None]).double()  # torch's x / scale, exactly as it rounded it
    dy = (dx + y.abs() * ds[..., None]) / (s - ds)[..., None]
    dy = (dy + 2 * U * (y.abs() + dy)) * SECOND_ORDER

    def e4m3(v):  # clamp, then round to float32 and to e4m3: both monotone, so the interval maps to [lo, hi]
        return v.clamp(-E4M3_MAX, E4M3_MAX).float().to(FP8_DTYPE).double()

    deq = (dx + ROW_REL * (2 * x.abs() + dx) + ROW_SUB * (2 * s + ds)[..., None]) * SECOND_ORDER
    return dict(ds=ds, lo=e4m3(y - dy), hi=e4m3(y + dy), deq=deq)


def compare_fp8_rows(q_got: torch.Tensor, s_got: torch.Tensor, q_want: torch.Tensor, s_want: torch.Tensor,
                     x_want: torch.Tensor) -> dict:
    """The kernel's e4m3 rows q_got [N, Hkv, W] and scales s_got [N, Hkv] against torch's (q_want, s_want) and the
    float32 rows x_want torch quantized, within `fp8_bounds`. NaN anywhere fails. Returns counts and "passed"."""
    b = fp8_bounds(x_want.cpu(), s_want.cpu())
    qg, qw = q_got.cpu().double(), q_want.cpu().double()
    sg, sw = s_got.cpu().double(), s_want.cpu().double()
    ds = (sg - sw).abs()
    deq = (qg * sg[..., None] - qw * sw[..., None]).abs()
    flips = int((qg != qw).sum())  # as values: -0 == +0 (the sign of a value that rounds to zero)
    straddles = int((b["lo"] != b["hi"]).sum())
    row = dict(elems=qg.numel(), rows=sg.numel(),
               scales_over=int((~(ds <= b["ds"])).sum()),
               worst_scale_ulps=float((ds / (sw * U)).nan_to_num(float("inf")).max()),
               codes_outside=int((~((qg >= b["lo"]) & (qg <= b["hi"]))).sum()),
               deq_over=int((~(deq <= b["deq"])).sum()),
               flips=flips, straddles=straddles)
    row["passed"] = (row["scales_over"] == 0 and row["codes_outside"] == 0 and row["deq_over"] == 0
                     and flips <= straddles)
    return row


def corrupt(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Red twins of the comparison (copies): one e4m3 value moved to its neighbouring code where the interval holds a
    single code, two tokens' scales swapped, or one scale off by 2^-10."""
    q, s = q.clone(), s.clone()
    if how == "code_plus_one":
        b = fp8_bounds(x.cpu(), s.cpu())
        v = q.cpu().double()
        ok = (b["lo"] == b["hi"]) & (v.abs() > 0) & (v.abs() < E4M3_MAX)
        idx = tuple(int(i) for i in torch.nonzero(ok)[len(torch.nonzero(ok)) // 2])
        bits = q.view(torch.uint8)
        bits[idx] += 1  # sign-magnitude: one code further from zero
    elif how == "scales_swapped":
        s[[0, -1], 0] = s[[-1, 0], 0].clone()
    elif how == "scale_off":
        s[s.shape[0] // 2, 1] *= 1 + 2.0**-10
    return q, s


CORRUPTIONS = ["code_plus_one", "scales_swapped", "scale_off"]


def simulated_kernel_rows(t: int, seed: int):
    """CPU stand-in for the kernel's difference from torch: the same prep from kv * (1 + 2^-22), whose norm scale
    cancels the factor up to a few float32 ulps (the order-of-summation effect in size). Returns (x_kernel, x_torch)
    float32 folded rows [t, Hkv, W]."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(t, GEOM.num_kv_heads, GEOM.head_dim, generator=g) * 2
    kw = torch.rand(GEOM.head_dim, generator=g) + 0.5
    pos = torch.randint(0, 100_000, (t,), generator=g)
    rows = [foldkv.prep_rows(GEOM, "folded", x, kw, pos, out_dtype=torch.float32) for x in (kv * (1 + 2.0**-22), kv)]
    return rows[0], rows[1]


def test_fp8_comparison_accepts_a_difference_of_summation_order():
    """The comparison on the CPU: rows that differ as the kernel's may (a few ulps of the norm scale) pass, and the
    difference is real (rows and scales do differ, so the bounds are exercised, not vacuous)."""
    x_k, x_t = simulated_kernel_rows(256, seed=1)
    (q_k, s_k), (q_t, s_t) = quantize_rows(x_k), quantize_rows(x_t)
    assert not torch.equal(x_k, x_t) and not torch.equal(s_k, s_t), "the simulated difference vanished"
    row = compare_fp8_rows(q_k, s_k, q_t, s_t, x_t)
    assert row["passed"], row
    assert row["straddles"] < row["elems"] // 100, row  # the derived intervals are narrow: a code, rarely two


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_fp8_comparison_catches_a_corrupted_pool(how):
    x_k, x_t = simulated_kernel_rows(64, seed=2)
    (q_k, s_k), (q_t, s_t) = quantize_rows(x_k), quantize_rows(x_t)
    assert compare_fp8_rows(q_k, s_k, q_t, s_t, x_t)["passed"]
    q_bad, s_bad = corrupt(q_k, s_k, x_t, how)
    row = compare_fp8_rows(q_bad, s_bad, q_t, s_t, x_t)
    assert not row["passed"], (how, row)


def _fp8_slots(pool, pages, offsets):
    dev = pool.device
    pages, offsets = pages.to(dev), offsets.to(dev)
    return pool.data[pages, :, offsets], pool.scales[pages, :, offsets]


@gpu
@pytest.mark.parametrize("dtype, case", DTYPE_CASES, ids=[f"{'bf16' if d == torch.bfloat16 else 'fp32'}-{c}"
                                                         for d, c in DTYPE_CASES])
def test_fp8_prep_matches_torch_prep(cuda_device, case, dtype):
    seq_lens, writes = CASES[case]
    pool, table, request, positions, q, kv, qw, kw = make_inputs(KvFormat.FOLDED, seq_lens, writes,
                                                                 sum(map(ord, case)), cuda_device, dtype, FP8_DTYPE)
    torch_pool = PagedKvPool(pool.layout, data=pool.data.clone(), scales=pool.scales.clone())
    want = foldkv.prep_and_store(torch_pool, table, request, positions, q, kv, qw, kw)
    got = prep_and_store_gpu(pool, table, request, positions, q, kv, qw, kw)
    _, x_want = foldkv.prep_rows_and_query(GEOM, "folded", q, kv, qw, kw, positions, out_dtype=torch.float32)
    torch.cuda.synchronize()
    pages, offsets = pool.token_slots(table, request, positions)
    q_got, s_got = _fp8_slots(pool, pages, offsets)
    q_want, s_want = _fp8_slots(torch_pool, pages, offsets)
    assert torch.equal(q_want.view(torch.uint8), quantize_rows(x_want)[0].view(torch.uint8)), "not torch's row"
    assert torch.isfinite(q_got.float()).all() and torch.isfinite(s_got).all(), "a stored row or scale was not written"
    # nothing else in the pool written: outside the slots it still holds the NaN fill (rows and scales), bit for bit
    slot = torch.zeros(pool.layout.scale_shape, dtype=torch.bool, device=cuda_device)
    slot[pages.to(cuda_device), :, offsets.to(cuda_device)] = True
    fill = torch_pool.data.new_full((), float("nan")).view(torch.uint8)
    assert bool((pool.data.view(torch.uint8)[~slot] == fill).all()), "a row outside the written slots changed"
    assert bool(torch.isnan(pool.scales[~slot]).all()), "a scale outside the written slots changed"
    row = dict(case=case, dtype=str(dtype), tokens=int(request.numel()), query=flips(got, want),
               pool=compare_fp8_rows(q_got, s_got, q_want, s_want, x_want))
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(dict(row, format="folded-fp8")) + "\n")
    assert row["query"]["worst_over_bound"] <= 1.0 and row["query"]["flips"] <= MAX_FLIP_FRACTION * got.numel(), row
    assert row["pool"]["passed"], row
    for how in CORRUPTIONS:  # red twins on the kernel's own pool
        q_bad, s_bad = corrupt(q_got, s_got, x_want, how)
        assert not compare_fp8_rows(q_bad, s_bad, q_want, s_want, x_want)["passed"], how


@gpu
def test_torch_fp8_scale_is_the_division_on_cuda(cuda_device):
    """foldkv.fp8.quantize_rows gives the same scales and codes on the GPU as on the CPU (amax / 448 by division:
    torch's CUDA division by a Python number multiplies by its float32 reciprocal, which differs on most rows: the
    red twin shows it)."""
    x = torch.randn(4096, GEOM.num_kv_heads, 640, generator=torch.Generator().manual_seed(4)) * 3
    (q_cpu, s_cpu), (q_gpu, s_gpu) = quantize_rows(x), quantize_rows(x.to(cuda_device))
    assert torch.equal(s_gpu.cpu(), s_cpu) and torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    by_reciprocal = x.to(cuda_device).abs().amax(-1) / E4M3_MAX
    assert not torch.equal(by_reciprocal.cpu(), s_cpu)


FP8_REFUSALS = {
    "nan_kv": "finite rows only",
    "inf_k_norm_weight": "finite rows only",
    "huge_k_norm_weight": "could overflow float32",
    "scales_missing": "no scales",
}


@gpu
@pytest.mark.parametrize("bad", list(FP8_REFUSALS))
def test_fp8_refusals_leave_pool_unchanged(cuda_device, bad):
    pool, table, request, positions, q, kv, qw, kw = make_inputs(KvFormat.FOLDED, [130, 65], [3, 2], 3, cuda_device,
                                                                 pool_dtype=FP8_DTYPE)
    pool.data.view(torch.uint8).copy_(torch.randint(0, 126, pool.data.shape, dtype=torch.uint8))  # any write shows
    pool.scales.uniform_(1.0, 2.0)
    scales = pool.scales
    if bad == "nan_kv":
        kv = kv.clone()
        kv[-1, 2, 300] = float("nan")
    elif bad == "inf_k_norm_weight":
        kw = kw.clone()
        kw[7] = float("inf")
    elif bad == "huge_k_norm_weight":
        kw = kw * 1e37
    else:
        pool.scales = None
    before = pool.data.view(torch.uint8).clone(), scales.clone()
    with pytest.raises(FoldKvInputError, match=FP8_REFUSALS[bad]):
        prep_and_store_gpu(pool, table, request, positions, q, kv, qw, kw)
    torch.cuda.synchronize()
    assert torch.equal(pool.data.view(torch.uint8), before[0])
    assert torch.equal(scales.view(torch.int32), before[1].view(torch.int32))
