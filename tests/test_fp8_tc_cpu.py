"""The FP8 tensor-core decode (`fp8_math="tensor_cores"`, the FP8 pool's default; kernels/decode_partial_fp8_tc.py) on
the CPU, with "exact" (the conversion partial) selectable by name: its
refusals (a bad value, tensor cores asked of a bf16 pool) with nothing written, in decode, the workspace and the
FoldKvCache; its registry entry and the resolver's names; the plan's wave of two CTAs an SM; its emitted CUDA (e4m3
wgmma for both gemms, the transpose's barriers) and its AOT manifest entry; and the derivation behind its GPU bound
(`gates.fp8_tc`): the two-part rounding of e4m3 values, and the bound over an emulated two-part query."""

from __future__ import annotations

import pytest
import torch

import foldkv as fk
from foldkv import GEMMA4_31B as G
from foldkv.fp8 import FP8_DTYPE
from foldkv.kernels import registry, resolve
from foldkv.kernels.decode import (DEFAULT_FP8_MATH, decode, kernel_names, parse_fp8_math, partial_kernel_name,
                                   partial_wave, replaceable_kernels)
from foldkv.kernels.plan import DEFAULT_SMS, plan_decode
from foldkv.kernels.workspace import DecodeWorkspace
from foldkv.lab import gates

from conftest import require_module, require_tilelang
from test_aot_cpu import require_tilelang_and_nvcc

TC = "decode_partial_folded_fp8_tc"


def _pools():
    """An FP8 pool and a bf16 pool of two requests (97 and 130 tokens), every byte distinct from poison."""
    out = {}
    for dtype in (FP8_DTYPE, torch.bfloat16):
        pool = fk.PagedKvPool(fk.PagedKvLayout(G, "folded", 64, 6, dtype=dtype), device="cpu")
        pool.data.view(torch.uint8).copy_(torch.randint(0, 120, pool.data.view(torch.uint8).shape, dtype=torch.uint8))
        if pool.scales is not None:
            pool.scales.fill_(0.01)
        out[dtype] = (pool, pool.allocate([97, 130]))
    return out


def _state(pool, out, lse):
    return (pool.data.view(torch.uint8).clone(), None if pool.scales is None else pool.scales.clone(),
            out.view(torch.int16).clone(), lse.view(torch.int32).clone())


def _same(a, b):
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype, value, match", [
    (FP8_DTYPE, "fast", "fp8_math='fast'"),
    (FP8_DTYPE, "Tensor_Cores", "expected one of"),
    (FP8_DTYPE, 1, "fp8_math=1"),
    (torch.bfloat16, "tensor_cores", "needs an FP8 pool"),
    (torch.bfloat16, "nonsense", "expected one of"),
], ids=["unknown", "case", "not-a-string", "bf16-pool", "bf16-pool-unknown"])
def test_decode_refuses_a_bad_fp8_math_with_nothing_written(dtype, value, match):
    pool, table = _pools()[dtype]
    query = torch.zeros(2, G.num_q_heads, G.head_dim, dtype=torch.bfloat16)
    out = torch.full((2, G.num_q_heads, G.head_dim), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, G.num_q_heads), float("nan"))
    before = _state(pool, out, lse)
    with pytest.raises(fk.FoldKvInputError, match=match):
        decode(pool, query, table, out=out, lse=lse, fp8_math=value)
    assert _same(before, _state(pool, out, lse))


@pytest.mark.parametrize("dtype, value", [(FP8_DTYPE, "tensor_cores"), (FP8_DTYPE, "exact"), (FP8_DTYPE, None),
                                          (torch.bfloat16, "exact"), (torch.bfloat16, None)])
def test_a_valid_fp8_math_reaches_only_the_device_check(dtype, value):
    """The control: the same inputs with a valid value pass every check but the last (a CPU pool)."""
    pool, table = _pools()[dtype]
    query = torch.zeros(2, G.num_q_heads, G.head_dim, dtype=torch.bfloat16)
    with pytest.raises(fk.FoldKvInputError, match="decode runs on a CUDA device"):
        decode(pool, query, table, fp8_math=value)


@pytest.mark.parametrize("dtype, value, match", [(torch.bfloat16, "tensor_cores", "needs an FP8 pool"),
                                                 (FP8_DTYPE, "fp8", "expected one of")])
def test_workspace_refuses_a_bad_fp8_math_before_allocating(dtype, value, match):
    lay = fk.PagedKvLayout(G, "folded", 64, 6, dtype=dtype)
    with pytest.raises(fk.FoldKvInputError, match=match):
        DecodeWorkspace(lay, max_batch=2, max_len=256, device="cpu", fp8_math=value)


def test_fp8_cache_refuses_a_bad_fp8_math(checkpoint):
    """FoldKvCache parses fp8_math once, before any pool is made (a float32 cache refuses tensor cores too)."""
    require_module("transformers")
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import load_model

    model = load_model(checkpoint, dtype=torch.float32, attn_implementation="foldkv")

    for dtype, value, match in [(FP8_DTYPE, "fastest", "expected one of"),
                                (torch.float32, "tensor_cores", "needs an FP8 pool")]:
        with pytest.raises(fk.FoldKvInputError, match=match):
            FoldKvCache(model, max_batch=1, max_tokens=64, dtype=dtype, fp8_math=value)
    cache = FoldKvCache(model, max_batch=1, max_tokens=64, dtype=FP8_DTYPE, fp8_math="tensor_cores")
    assert cache.fp8_math == "tensor_cores"
    default = FoldKvCache(model, max_batch=1, max_tokens=64, dtype=FP8_DTYPE).fp8_math
    assert default == DEFAULT_FP8_MATH == "tensor_cores"
    assert FoldKvCache(model, max_batch=1, max_tokens=64, dtype=FP8_DTYPE, fp8_math="exact").fp8_math == "exact"
    assert FoldKvCache(model, max_batch=1, max_tokens=64).fp8_math == "exact"  # a bf16 cache: nothing to convert


def test_registry_entry_and_names():
    v = registry.get(TC)
    assert (v.family, v.format, v.builder) == ("decode_partial", fk.KvFormat.FOLDED,
                                               "foldkv.kernels.decode_partial_fp8_tc:build")
    assert v.params == dict(page_size=64, block_n=64, num_stages=1, block_h=16, reduce_batch=4, ctas_per_sm=2,
                            transpose="t4x16", precise=True)
    assert resolve.kernel_params(TC) == v.params
    assert registry.get("decode_partial_folded_fp8").params["threads"] == 256  # the exact one: unchanged
    assert partial_kernel_name("folded", True) == TC  # the default: tensor cores
    assert partial_kernel_name("folded", True, "exact") == "decode_partial_folded_fp8"  # by name
    assert partial_kernel_name("folded", True, "tensor_cores") == TC
    assert partial_kernel_name("folded") == "decode_partial_folded"  # a bf16 pool: no FP8 partial to pick
    assert partial_kernel_name("folded", False, "tensor_cores") == "decode_partial_folded"
    assert kernel_names("folded", True) == (TC, "merge_groups", "merge_final")
    assert kernel_names("folded", True, fp8_math="exact") == ("decode_partial_folded_fp8", "merge_groups",
                                                                "merge_final")
    assert kernel_names("folded", True, fp8_math="tensor_cores") == (TC, "merge_groups", "merge_final")
    assert replaceable_kernels("folded", True, "tensor_cores") == (TC, "merge_groups", "merge_final")  # no fused step
    assert parse_fp8_math(None, True) == "tensor_cores" and parse_fp8_math("exact", True) == "exact"
    assert parse_fp8_math(None, False) == "exact" and parse_fp8_math("exact", False) == "exact"
    # both FP8 partials stay registered (and so AOT-built: the build walks the registry)
    assert {TC, "decode_partial_folded_fp8"} <= {v.name for v in registry.VARIANTS}


def test_the_tensor_core_partial_plans_for_two_ctas_an_sm():
    """Its wave is 2 x SMs (264 on the H200): the eager plan and the workspace balance that many CTAs; the exact
    partial and the bf16 ones keep one CTA an SM. No FP8 plan is fused."""
    fp8 = fk.PagedKvLayout(G, "folded", 64, 200, dtype=FP8_DTYPE)
    cpu = torch.device("cpu")
    assert partial_wave(fp8, cpu, "tensor_cores") == partial_wave(fp8, cpu) == 2 * DEFAULT_SMS  # the default
    assert partial_wave(fp8, cpu, "exact") == partial_wave(fk.PagedKvLayout(G, "folded", 64, 200), cpu) == DEFAULT_SMS
    tc = DecodeWorkspace(fp8, max_batch=4, max_len=8192, device="cpu")  # the default: tensor cores
    exact = DecodeWorkspace(fp8, max_batch=4, max_len=8192, device="cpu", fp8_math="exact")
    assert exact.fp8_math == "exact"
    assert tc.num_chunks * G.num_kv_heads == 2 * DEFAULT_SMS  # one wave of 264 CTAs holds 4 x 4 + 1 chunks
    assert exact.num_chunks * G.num_kv_heads == DEFAULT_SMS
    assert tc.one_wave and not tc.fused and tc.fp8_math == "tensor_cores"
    plan = plan_decode(fp8, [8192], device="cpu", num_sms=partial_wave(fp8, cpu, "tensor_cores"))
    assert len(plan.chunks) * G.num_kv_heads <= 2 * DEFAULT_SMS and not plan.fused
    assert len(plan.chunks) > DEFAULT_SMS // G.num_kv_heads  # more chunks than one CTA an SM would cut


def test_the_builder_refuses_the_probe_options():
    require_tilelang()
    for options in (dict(transpose="none"), dict(transpose="t16x4"), dict(precise=False)):
        with pytest.raises(ValueError, match="probe"):
            registry.get(TC).build(G, **options)


# --- the emitted CUDA and the AOT build ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tc_build(tmp_path_factory):
    """An AOT build of the tensor-core partial alone (one JIT build and one nvcc compile): its manifest and source."""
    require_tilelang_and_nvcc()
    from foldkv.aot.build import build

    out = tmp_path_factory.mktemp("aot") / "fp8_tc"
    manifest = build(out, arch="sm_90a", variants=[registry.get(TC)], log=None)
    (entry,) = manifest["kernels"]
    return out, manifest, (out / entry["source"]).read_text()


def test_emitted_cuda_runs_both_gemms_on_e4m3_wgmma(tc_build):
    from foldkv.kernels.cuda_checks import check_e4m3_conversion
    from foldkv.kernels.decode_partial_fp8_tc import TRANSPOSE_BARRIER_ID, TRANSPOSE_FN

    _, _, src = tc_build
    fp8_mma = "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32"
    assert src.count(fp8_mma + ", 64, 16, 32") == 4 + 1, "four score panels and the value gemm, all e4m3 wgmma"
    assert "kBFloat16" not in src, "no bf16 MMA: the rows are never converted"
    assert "__launch_bounds__(256, 2)" in src, "two CTAs an SM"
    assert "Scales_desc" in src or "scales" in src
    report = check_e4m3_conversion(TC, src, TRANSPOSE_BARRIER_ID, calls=(TRANSPOSE_FN,))
    assert report["calls"] >= 2 and report["threads"] == 128
    broken = src.replace(f"{TRANSPOSE_FN}(1, 0,", f"{TRANSPOSE_FN}(0, 0,", 1)  # the red twin: no opening barrier
    assert broken != src
    with pytest.raises(Exception, match="open a tile"):
        check_e4m3_conversion(TC, broken, TRANSPOSE_BARRIER_ID, calls=(TRANSPOSE_FN,))


def test_aot_manifest_has_the_tensor_core_partial(tc_build):
    from foldkv.aot import verify

    out, manifest, _ = tc_build
    (k,) = manifest["kernels"]
    assert (k["name"], k["family"], k["format"]) == (TC, "decode_partial", "folded")
    assert k["variant_params"] == registry.get(TC).params
    args = [(p["name"], p["dtype"]) for p in k["params"] if p["kind"] == "tensor"]
    assert [a[1] for a in args] == ["bfloat16", "float8_e4m3", "float32", "int32", "int32", "int32", "int32",
                                    "float32", "float32"]
    assert verify(out)["kernels"][0]["cubin_sha256"] == k["cubin_sha256"]


# --- the derivation behind the GPU bound (gates.fp8_tc) -------------------------------------------------------------
def _two_part(x: torch.Tensor, parts: int = 2) -> torch.Tensor:
    """x (float32, |x| <= 448) as the kernel carries it: hi = e4m3(x), lo = e4m3(16 (x - hi)); hi + lo / 16."""
    hi = x.to(FP8_DTYPE).float()
    if parts == 1:
        return hi
    return hi + ((x - hi) * 16.0).to(FP8_DTYPE).float() / 16.0


@pytest.mark.parametrize("parts", [2, 1], ids=["two-parts", "one-part-red-twin"])
def test_two_part_rounding_is_within_its_derived_bound(parts):
    """|x - hi - lo / 16| <= 2^-8 |x| + 2^-14 over e4m3's whole range, normal and subnormal (the query's and P's
    rounding, gates.TWO_PART_REL and TWO_PART_ABS); one part (the red twin) breaks it."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.exp2(torch.empty(200_000).uniform_(-24, 8.8, generator=g)).clamp_max(448.0),
                   torch.linspace(0, 2**-6, 4097)])
    x = torch.cat([x, -x])
    err = (x.double() - _two_part(x, parts).double()).abs()
    bound = gates.TWO_PART_REL * x.double().abs() + gates.TWO_PART_ABS
    if parts == 2:
        assert bool((err <= bound).all()), float((err / bound).max())
        assert float((err / bound).max()) > 0.5  # and not loose by much
    else:
        assert float((err / bound).max()) > 4


def test_the_effective_query_moves_each_element_within_the_two_part_bound():
    """gates.effective_query (what the bound's query term is computed over) moves each element of a bf16 query by
    <= 2^-8 |q| + 2^-14 max|q| / 448 (float32's gain and inverse: 2^-20 of slack), and equals the two-part rounding
    above at the kernel's gain; one part breaks the bound."""
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(3, 32, 512, generator=g) * torch.exp2(torch.randint(-12, 4, (3, 32, 1), generator=g))).to(
        torch.bfloat16)
    q[0, 0, :7] = torch.tensor([0.0, 1e-30, -1e-20, 3e-5, -2e-5, 1.0, -1.0])
    amax = q.double().abs().amax(-1, keepdim=True)
    bound = (gates.TWO_PART_REL * q.double().abs() + gates.TWO_PART_ABS * amax / 448.0) * (1 + 2.0**-20)
    for parts in (2, 1):
        err = (gates.effective_query(q, parts) - q.double()).abs()
        assert bool((err <= bound).all()) == (parts == 2), float((err / bound).max())


def test_the_bound_takes_the_two_part_query_exactly_and_a_one_part_query_falls_outside():
    """With no accumulation error (bits_kept=60) the bound's query term is the float64 reference over the effective
    two-part query against the one over the bf16 query: that reference sits inside the bound; the reference over a
    one-part query (the red twin's rounding) does not, on a hostile FP8 pool."""
    inputs = gates.make_inputs(gates.Case("tc", (1, 65, 128)), fk.KvFormat.FOLDED, "cpu", 4, dtype=FP8_DTYPE)
    out_extra, lse_extra = gates.fp8_tc_extra_bounds(inputs.pool, inputs.query, inputs.table, bits_kept=60)
    ref, ref_lse = fk.paged_attention_reference(inputs.pool, inputs.query, inputs.table)
    over = {}
    for parts in (2, 1):
        out, lse = fk.paged_attention_reference(inputs.pool, gates.effective_query(inputs.query, parts), inputs.table)
        over[parts] = (float(((out - ref).abs() / out_extra).max()), float(((lse - ref_lse).abs() / lse_extra).max()))
    assert over[2][0] <= 1 + 1e-9 and over[2][1] <= 1 + 1e-9, over
    assert over[1][0] > 1 and over[1][1] > 1, over
