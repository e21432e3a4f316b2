"""The FP8 (e4m3) folded pool on the CPU: its bytes, the one rounding and its bound, the prep and fill writing it, the
float64 reference reading it, the refusals (nothing written), and the format gate with its red twins."""

from __future__ import annotations

import math

import pytest
import torch

import foldkv as fk
from foldkv import GEMMA4_31B as G
from foldkv.lab import byte_floor as floor
from foldkv.fp8 import E4M3_MAX, FP8_DTYPE, dequantize_rows, quantize_rows
from foldkv.lab.gates.fp8_pool import rounding_bound
from foldkv.lab import gates
from foldkv.lab.gates.inputs import fill_sequences

FP8 = FP8_DTYPE


def fp8_pool(pages: int = 8, fill: float = float("nan")) -> fk.PagedKvPool:
    return fk.PagedKvPool(fk.PagedKvLayout(G, "folded", 64, pages, dtype=FP8), fill=fill)


def raw_inputs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(n, G.num_kv_heads, G.head_dim, generator=g) for n in lens]
    kw = torch.exp(0.5 * torch.randn(G.head_dim, generator=g))
    return kv, kw


def filled(lens=(97, 130), seed=0):
    kv, kw = raw_inputs(lens, seed)
    pool = fp8_pool(sum(-(-n // 64) for n in lens) + 2)
    table = pool.allocate(lens, scatter_seed=seed)
    fill_sequences(pool, table, kv, kw)
    rows = [fk.prep_rows(G, "folded", x, kw, torch.arange(x.shape[0]), out_dtype=torch.float32) for x in kv]
    return pool, table, rows


# --- bytes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, per_token_head", [(torch.bfloat16, 1280), (FP8, 644)])
def test_folded_bytes_per_token_count_rows_and_scales(dtype, per_token_head):
    lay = fk.PagedKvLayout(G, "folded", 64, 10, dtype=dtype)
    assert lay.bytes_per_token == 4 * per_token_head
    assert lay.nbytes == 10 * 64 * 4 * per_token_head
    assert floor.step_bytes(G, "folded", [1000], dtype=dtype)["kv"] == 1000 * 4 * per_token_head
    assert floor.step_bytes(G, "folded", [1000], dtype=dtype)["query"] == 32 * 512 * 2  # bf16 query either way
    assert floor.tokens_in_budget(G, "folded", 1.0, dtype=dtype) == (1 << 30) // (64 * 4 * per_token_head * 10) * 64


def test_fp8_folded_reads_at_most_055_of_bf16_folded():
    fp8 = floor.step_bytes(G, "folded", [81_920], dtype=FP8)["kv"]
    bf16 = floor.step_bytes(G, "folded", [81_920])["kv"]
    assert fp8 / bf16 == pytest.approx(644 / 1280) and fp8 / bf16 <= 0.55


# --- the rounding --------------------------------------------------------------------------------------------------
def _rows(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 640, generator=g)
    if kind == "outliers":
        x[..., [5, 200, 600]] *= 40
    elif kind == "tiny":
        x *= 1e-30
    elif kind == "zeros":
        x[7] = 0
    elif kind == "huge":
        x *= 1e30
    return x


@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny", "zeros", "huge"])
def test_quantized_rows_stay_within_the_derived_bound(kind):
    x = _rows(kind)
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    err = (dequantize_rows(q, s) - x.double()).abs()
    assert bool((err <= rounding_bound(x, s)).all()), float((err / rounding_bound(x, s)).max())
    nonzero = x.abs().amax(-1) > 0
    assert bool((q.float().abs().amax(-1)[nonzero] == E4M3_MAX).all()), "each row's amax must map to 448"


@pytest.mark.parametrize("factor", [2.0, 0.5, 1.2])
def test_a_scale_that_is_off_breaks_the_bound(factor):
    """Red twin of the bound: the same e4m3 values with a scale off by `factor` move some element past it."""
    x = _rows("normal")
    q, s = quantize_rows(x)
    s = s.clone()
    s[3, 1] *= factor
    err = (dequantize_rows(q, s) - x.double()).abs()
    assert not bool((err <= rounding_bound(x, quantize_rows(x)[1])).all())


def test_rounding_is_round_to_nearest_even_of_x_over_scale():
    x = torch.tensor([[448.0, 1.0625, 1.1875, 2**-10, 3 * 2**-10, -1.0625]])  # ties: 1.0625 -> 1, 1.1875 -> 1.25
    q, s = quantize_rows(x)
    assert float(s) == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 0.0, 2**-8, -1.0]]


# --- prep and fill ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_prep_and_store_writes_quantized_rows_and_returns_a_bf16_query(in_dtype):
    g = torch.Generator().manual_seed(1)
    t = 70
    q = torch.randn(t, G.num_q_heads, G.head_dim, generator=g).to(in_dtype)
    kv = torch.randn(t, G.num_kv_heads, G.head_dim, generator=g).to(in_dtype)
    qw, kw = torch.rand(G.head_dim, generator=g) + 0.5, torch.exp(0.5 * torch.randn(G.head_dim, generator=g))
    pool = fp8_pool(4)
    table = pool.allocate([t], scatter_seed=2)
    query = fk.prep_and_store(pool, table, torch.zeros(t, dtype=torch.long), torch.arange(t), q, kv, qw, kw)
    want_q, want_rows = fk.prep_rows_and_query(G, "folded", q, kv, qw, kw, torch.arange(t), out_dtype=torch.float32)
    assert query.dtype == torch.bfloat16 and torch.equal(query, want_q.bfloat16())
    wq, ws = quantize_rows(want_rows)
    assert torch.equal(pool.gather(table, 0).view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(pool.gather_scales(table, 0), ws)


def test_fill_and_the_reference_read_the_dequantized_rows():
    pool, table, rows = filled()
    g = torch.Generator().manual_seed(5)
    query = torch.randn(2, G.num_q_heads, G.head_dim, generator=g).bfloat16() * 0.1
    out, lse = fk.paged_attention_reference(pool, query, table)
    # the same values in a float64 pool: the reference must read the FP8 pool as exactly these
    lay64 = fk.PagedKvLayout(G, "folded", 64, pool.layout.num_pages, dtype=torch.float64)
    pool64 = fk.PagedKvPool(lay64, fill=float("nan"))
    t64 = pool64.allocate(table.seq_lens.tolist())
    for r in range(table.batch):
        n = int(table.seq_lens[r])
        gates.write_tokens(pool64, t64, torch.full((n,), r), torch.arange(n), pool.gather_values(table, r))
    out64, lse64 = fk.paged_attention_reference(pool64, query, t64)
    assert torch.equal(out, out64) and torch.equal(lse, lse64)
    assert gates.fp8_row_check(pool, table, rows)["passed"]


# --- refusals: before anything is written ------------------------------------------------------------------------
def _snapshot(pool):
    return pool.data.view(torch.uint8).clone(), None if pool.scales is None else pool.scales.clone()


REFUSALS = ["split_fp8_layout", "scales_missing", "scales_wrong_shape", "scales_wrong_dtype", "scales_on_bf16",
            "reader_of_bf16", "bf16_pool_to_fp8_reader", "nan_kv", "inf_kv_fill", "bf16_rows_to_fp8_pool"]


@pytest.mark.parametrize("what", REFUSALS)
def test_fp8_refusals_name_the_problem_and_write_nothing(what):
    pool, table, _ = filled((97,))
    before = _snapshot(pool)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, G.num_q_heads, G.head_dim, generator=g)
    kv = torch.randn(1, G.num_kv_heads, G.head_dim, generator=g)
    w = torch.ones(G.head_dim)
    query = torch.zeros(1, G.num_q_heads, G.head_dim, dtype=torch.bfloat16)
    with pytest.raises(fk.FoldKvInputError) as exc:
        if what == "split_fp8_layout":
            fk.PagedKvLayout(G, "split", 64, 2, dtype=FP8)
        elif what == "scales_missing":
            fk.PagedKvPool(pool.layout, data=pool.data)
        elif what == "scales_wrong_shape":
            fk.PagedKvPool(pool.layout, data=pool.data, scales=pool.scales[:, :, :32].contiguous())
        elif what == "scales_wrong_dtype":
            fk.PagedKvPool(pool.layout, data=pool.data, scales=pool.scales.half())
        elif what == "scales_on_bf16":
            lay = fk.PagedKvLayout(G, "folded", 64, pool.layout.num_pages)
            fk.PagedKvPool(lay, data=torch.zeros(lay.shape, dtype=torch.bfloat16), scales=pool.scales)
        elif what == "reader_of_bf16":
            fk.paged_attention_reference(pool, query, table, dtype=torch.bfloat16)
        elif what == "bf16_pool_to_fp8_reader":
            bf = fk.PagedKvPool(fk.PagedKvLayout(G, "folded", 64, 2), fill=0.0)
            fk.paged_attention_reference(bf, query, bf.allocate([5]), dtype=FP8)
        elif what == "nan_kv":
            kv[0, 1, 7] = float("nan")
            fk.prep_and_store(pool, table, torch.zeros(1, dtype=torch.long), torch.tensor([50]), q, kv, w, w)
        elif what == "inf_kv_fill":
            bad = torch.randn(97, G.num_kv_heads, G.head_dim)
            bad[90, 0, 0] = float("inf")
            fill_sequences(pool, table, [bad], w)
        elif what == "bf16_rows_to_fp8_pool":
            rows = torch.zeros(1, G.num_kv_heads, 640, dtype=torch.bfloat16)
            gates.write_tokens(pool, table, torch.zeros(1, dtype=torch.long), torch.tensor([3]), rows)
    assert str(exc.value)
    after = _snapshot(pool)
    assert torch.equal(before[0], after[0]), "a refusal wrote rows to the pool"
    assert torch.equal(before[1].nan_to_num(-7.0), after[1].nan_to_num(-7.0)), "a refusal wrote scales to the pool"


def test_a_pool_whose_scales_were_dropped_is_refused_by_the_reference():
    pool, table, _ = filled((97,))
    pool.scales = None
    with pytest.raises(fk.FoldKvInputError, match="no scales"):
        fk.paged_attention_reference(pool, torch.zeros(1, 32, 512), table)


# --- the format gate and its red twins ----------------------------------------------------------------------------
@pytest.mark.parametrize("corruption", ["none", "scale_x2", "scale_x0.9", "value_flip"])
def test_row_gate_catches_a_corrupted_scale_or_value(corruption):
    pool, table, rows = filled()
    page, off = int(table.page_ids[1, 1]), 5
    if corruption.startswith("scale_x"):
        pool.scales[page, 2, off] *= float(corruption.removeprefix("scale_x"))
    elif corruption == "value_flip":
        bits = pool.data.view(torch.uint8)
        bits[page, 2, off, 300] ^= 0x08  # one e4m3 exponent bit
    res = gates.fp8_row_check(pool, table, rows)
    assert res["passed"] == (corruption == "none"), res
    if corruption == "none":
        assert 0.5 < res["max_ratio"] <= 1.0  # the bound is tight, not loose: some element comes near it


def test_format_error_of_a_spread_decode_is_within_its_derived_bound():
    res = gates.fp8_format_error(gates.Case("spread", (300,), score_scale=0.05), seed=0)
    assert res["rows_passed"] and res["out_bound_finite"] == 1.0 and res["out_over_bound"] == 0, res
    assert 0 < res["out_max_over_finite_bound"] < 1 and math.isfinite(res["out_rel_fro"])


@pytest.mark.parametrize("misuse", ["decode-as-bf16", "decode-without-scales", "decode-scales-shape",
                                    "bf16-pool-decode-as-fp8", "prefill-as-bf16", "prefill-without-scales"])
def test_launchers_refuse_a_dtype_mismatch_before_anything_runs(misuse):
    """A pool of one dtype asked to decode (or prefill) as the other and an FP8 pool without (or with misshapen)
    scales are refused on the CPU before any build or launch, writing nothing (tests/test_prefill_cpu.py has the
    prefill's full set)."""
    from foldkv.kernels.decode import decode
    from foldkv.kernels.prefill import prefill

    pool, table, _ = filled((97, 130))
    query = torch.zeros(2, G.num_q_heads, G.head_dim, dtype=torch.bfloat16)
    if misuse == "bf16-pool-decode-as-fp8":
        pool = fk.PagedKvPool(fk.PagedKvLayout(G, fk.KvFormat.FOLDED, 64, pool.layout.num_pages), device="cpu")
        pool.data.fill_(1.0)
    before = _snapshot(pool)
    call, match = {
        "decode-as-bf16": (lambda: decode(pool, query, table, kv_dtype=torch.bfloat16), "bfloat16 decode"),
        "bf16-pool-decode-as-fp8": (lambda: decode(pool, query, table, kv_dtype=torch.float8_e4m3fn),
                                    "float8_e4m3fn decode"),
        "decode-without-scales": (lambda: decode(fk.PagedKvPool(pool.layout, data=pool.data, scales=None), query,
                                                 table), "no scales"),
        "decode-scales-shape": (lambda: decode(fk.PagedKvPool(pool.layout, data=pool.data,
                                                              scales=pool.scales[:, :, :32].contiguous()),
                                               query, table), "pool scales"),
        "prefill-as-bf16": (lambda: prefill(pool, query, table, torch.ones(2, dtype=torch.int32),
                                            kv_dtype=torch.bfloat16), "bfloat16 prefill"),
        "prefill-without-scales": (lambda: prefill(fk.PagedKvPool(pool.layout, data=pool.data, scales=None), query,
                                                   table, torch.ones(2, dtype=torch.int32)), "no scales"),
    }[misuse]
    with pytest.raises(fk.FoldKvInputError, match=match):
        call()
    assert torch.equal(before[0], _snapshot(pool)[0])


# --- the fused prep writing an FP8 pool: what runs without a GPU ----------------------------------------------------
def test_scale_is_amax_over_448_by_division():
    """quantize_rows's scale is amax / 448 rounded once (the definition the fused prep's IEEE division follows); the
    red twin, amax times the float32 reciprocal of 448 (what torch's CUDA division by a Python number computes),
    differs on most rows, so the check tells the two apart."""
    x = _rows("normal")
    _, s = quantize_rows(x)
    amax = x.abs().amax(-1)
    assert torch.equal(s, (amax.double() / E4M3_MAX).float())  # float64 then float32: one correct rounding
    assert not torch.equal(s, amax * torch.tensor(1 / E4M3_MAX, dtype=torch.float32))


def _prep_fp8_case():
    pool = fp8_pool(4, fill=0.25)
    table = pool.allocate([70, 3])
    g = torch.Generator().manual_seed(5)
    args = dict(request=torch.tensor([0, 0, 1], dtype=torch.int32), positions=torch.tensor([68, 69, 2]),
                q=torch.randn(3, G.num_q_heads, G.head_dim, generator=g).bfloat16(),
                kv=torch.randn(3, G.num_kv_heads, G.head_dim, generator=g).bfloat16(),
                q_norm_weight=torch.rand(G.head_dim, generator=g), k_norm_weight=torch.rand(G.head_dim, generator=g))
    return pool, table, args


PREP_FP8_REFUSALS = {  # case: (message, whether the torch prep refuses the same input)
    "valid_input_on_cpu": ("fused prep runs on CUDA", False),
    "nan_kv": ("finite rows only", True),
    "inf_k_norm_weight": ("finite rows only", True),
    "huge_k_norm_weight": ("could overflow float32", True),
    "scales_missing": ("no scales", True),
    "scales_dtype": ("pool scales has dtype", True),
}


@pytest.mark.parametrize("case", list(PREP_FP8_REFUSALS))
def test_fused_prep_refuses_before_writing_an_fp8_pool(case):
    """Every check of the fused prep over an FP8 pool runs before the device check (so on the CPU), the pool (rows
    and scales) unchanged; where the torch prep refuses the same input too, it does."""
    from conftest import bench_version

    pool, table, args = _prep_fp8_case()
    if case == "nan_kv":
        args["kv"][2, 3, 100] = float("nan")
    elif case == "inf_k_norm_weight":
        args["k_norm_weight"][11] = float("-inf")
    elif case == "huge_k_norm_weight":
        args["k_norm_weight"] = args["k_norm_weight"] * 3e38  # finite; V * w_k is not
    elif case == "scales_missing":
        pool.scales = None
    elif case == "scales_dtype":
        pool.scales = pool.scales.double()
    message, torch_refuses = PREP_FP8_REFUSALS[case]
    before = _snapshot(pool)
    with pytest.raises(fk.FoldKvInputError, match=message):
        bench_version("prep_fused").prep_and_store_gpu(pool, table, **args)
    after = _snapshot(pool)
    assert torch.equal(before[0], after[0]) and (before[1] is None or torch.equal(before[1], after[1]))
    if torch_refuses:
        with pytest.raises(fk.FoldKvInputError):
            fk.prep_and_store(pool, table, **args)


def test_fused_prep_fp8_builds_beside_untouched_bf16_ones():
    """The fused prep is a version (bench/versions/prep_fused.py), not a registered kernel: the runtime's
    fold-and-store is global_step's; its FP8 builder sits beside the bf16 one, with the same parameters."""
    import inspect

    from conftest import bench_version
    from foldkv.kernels import registry

    prep = bench_version("prep_fused")
    assert not [v.name for v in registry.all_variants() if v.family == "prep"]
    assert prep.build_fp8.hands_out == "prep_{fmt}_fp8" and prep.build.hands_out == "prep_{fmt}"
    assert inspect.signature(prep.build_fp8).parameters.keys() == inspect.signature(prep.build).parameters.keys()


PREP_FP8_ARGS = ["Qraw", "KVraw", "QNormW", "KNormW", "InvFreq", "Positions", "SlotPage", "SlotOffset", "Pool",
                 "PoolScales", "QueryOut"]


def quantizing_store_problems(source: str) -> list[str]:
    """What is wrong with an emitted FP8 prep source: every e4m3 store must be the clamp of an IEEE division
    (`__fdiv_rn`, not a product with a reciprocal), the scale amax / 448 an IEEE division, the amax a block max."""
    import re

    casts = source.count("(fp8_e4_t)")
    good = len(re.findall(r"\(\(fp8_e4_t\)min\(max\(__fdiv_rn\(\w+\[\w+\], scale\[0\]\), -0x1\.cp\+8f", source))
    problems = [] if casts and good == casts else [f"{casts - good} of {casts} e4m3 casts are not clamp(x / scale)"]
    if not re.search(r"__fdiv_rn\(scale\[0\], 0x1\.cp\+8f", source):
        problems.append("the scale is not amax / 448 by IEEE division")
    if "AllReduce<tl::MaxOp, 128" not in source:
        problems.append("no block-wide max over the 128 threads")
    if "__frcp" in source or "__fdividef" in source:
        problems.append("a reciprocal or fast division")
    return problems


def e4m3_ptx_problems(ptx: str) -> list[str]:
    """What is wrong with the FP8 prep's PTX: its e4m3 conversions must be cvt.rn.satfinite (round to nearest even),
    its divisions div.rn.f32 (IEEE), nothing approximate."""
    import re

    cvts = re.findall(r"cvt\.[\w.]*e4m3[\w.]*", ptx)
    rounding = {"cvt.rn.satfinite.e4m3x2.f32"}
    problems = [] if cvts and set(cvts) == rounding else [f"e4m3 conversions {sorted(set(cvts))}"]
    if "div.rn.f32" not in ptx:
        problems.append("no IEEE division")
    problems += [f"approximate op {op}" for op in sorted(set(re.findall(r"(?:div\.approx|div\.full|rcp\.approx)\S*",
                                                                         ptx)))]
    return problems


@pytest.fixture(scope="module")
def fp8_prep_source():
    from conftest import require_tilelang

    require_tilelang()
    from conftest import bench_version

    kernel = bench_version("prep_fused").build_fp8(G)
    return kernel, kernel.get_kernel_source()


def test_fused_prep_fp8_source_quantizes_as_the_definition(fp8_prep_source):
    kernel, src = fp8_prep_source
    assert [kernel.prim_func.buffer_map[p].name for p in kernel.prim_func.params] == PREP_FP8_ARGS
    assert quantizing_store_problems(src) == []
    assert src.count("(fp8_e4_t)") == 6  # two elements per thread at each of the row's six store sites
    # red twins: a product with the reciprocal instead of the division, and a sum instead of the max
    assert quantizing_store_problems(src.replace("__fdiv_rn(x_lo[i_2], scale[0])", "(x_lo[i_2] * (1.f / scale[0]))"))
    assert quantizing_store_problems(src.replace("AllReduce<tl::MaxOp", "AllReduce<tl::SumOp"))


def test_fused_prep_fp8_ptx_rounds_to_nearest_even(fp8_prep_source, tmp_path):
    """The emitted source compiled to PTX with the JIT's nvcc options: e4m3 by cvt.rn.satfinite, divisions IEEE."""
    import subprocess

    from conftest import skip_or_fail

    from foldkv.aot.build import _toolchain, find_nvcc, nvcc_command, nvcc_options
    from foldkv.kernels.tl import pass_configs

    if find_nvcc() is None:
        skip_or_fail("no nvcc")
    _, src = fp8_prep_source
    tc = _toolchain()
    (tmp_path / "prep.cu").write_text(src)
    cmd = nvcc_command(tc["nvcc"], tc["ccbin"], "sm_90a", nvcc_options(pass_configs(), template_dir=tc["template_dir"],
                                                                       cutlass_dir=tc["cutlass_dir"]),
                       str(tmp_path / "prep.cu"), str(tmp_path / "prep.ptx"))
    cmd[cmd.index("--cubin")] = "--ptx"
    subprocess.run(cmd, check=True, capture_output=True)
    ptx = (tmp_path / "prep.ptx").read_text()
    assert e4m3_ptx_problems(ptx) == []
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 12  # six store sites, two elements per thread
    assert e4m3_ptx_problems(ptx.replace("cvt.rn.satfinite.e4m3x2.f32", "cvt.rz.satfinite.e4m3x2.f32"))  # red twins
    assert e4m3_ptx_problems(ptx.replace("div.rn.f32", "div.approx.f32"))


# --- the e4m3 conversion's barriers, checked on the emitted CUDA --------------------------------------------------
@pytest.fixture(scope="module", params=["decode", "prefill"])
def fp8_kernel_source(request):
    """(kernel name, emitted CUDA) of the registered FP8 decode partial or prefill: each builder ran the check."""
    from conftest import require_tilelang

    require_tilelang()
    from foldkv.kernels import registry

    name = {"decode": "decode_partial_folded_fp8", "prefill": "prefill_folded_fp8"}[request.param]
    return name, registry.get(name).build(G).get_kernel_source()


def _break(source: str, how: str) -> str:
    import re

    calls = list(re.finditer(r"foldkv_e4m3x8_to_bf16\((\d+), (\d+), (\d+), (\d+),", source))
    assert len(calls) == 5, len(calls)
    if how == "no closing barrier":
        return source.replace("foldkv_e4m3x8_to_bf16(0, 1,", "foldkv_e4m3x8_to_bf16(0, 0,")
    if how == "two opening barriers":
        return source.replace("foldkv_e4m3x8_to_bf16(0, 0,", "foldkv_e4m3x8_to_bf16(1, 0,", 1)
    if how == "TileLang's barrier id":
        return re.sub(r"(foldkv_e4m3x8_to_bf16\(\d+, \d+, )7,", r"\g<1>3,", source)
    if how == "wrong thread count":
        return re.sub(r"(foldkv_e4m3x8_to_bf16\(\d+, \d+, 7, )(\d+),", r"\g<1>64,", source)
    if how == "id taken by another barrier":
        i = source.index("foldkv_e4m3x8_to_bf16(1,")
        return source[:i] + "tl::__sync_thread_partial(7, 128);\n" + source[i:]
    raise AssertionError(how)


def test_the_conversion_barriers_pass_on_the_registered_kernels(fp8_kernel_source):
    from foldkv.kernels import macros
    from foldkv.kernels.cuda_checks import check_e4m3_conversion

    name, src = fp8_kernel_source
    report = check_e4m3_conversion(name, src, macros.CONVERT_BARRIER_ID)
    assert report["calls"] == 5 and report["threads"] == 256 and macros.CONVERT_BARRIER_ID not in report[
        "other_barrier_ids"]


@pytest.mark.parametrize("how", ["no closing barrier", "two opening barriers", "TileLang's barrier id",
                                 "wrong thread count", "id taken by another barrier"])
def test_the_conversion_barrier_check_refuses_a_broken_kernel(fp8_kernel_source, how):
    from foldkv.kernels import macros
    from foldkv.kernels.cuda_checks import ConversionCheckError, check_e4m3_conversion

    name, src = fp8_kernel_source
    with pytest.raises(ConversionCheckError):
        check_e4m3_conversion(name, _break(src, how), macros.CONVERT_BARRIER_ID)
