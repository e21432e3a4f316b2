"""CPU tests of the prefill and the fused prep (bench/versions/prep_fused.py): the tile plan, the registry entries,
generation of every variant for sm_90a without a GPU (argument order, wgmma + TMA in the emitted CUDA, no spills), and
the refusals that need no GPU (every check runs before the device check), over bf16 and FP8 pools."""

from __future__ import annotations

import pytest
import torch
from conftest import bench_version, require_tilelang

import foldkv
from foldkv import FoldKvInputError, KvFormat, PagedKvLayout, PagedKvPool
from foldkv.fp8 import FP8_DTYPE
from foldkv.kernels import prefill_attention, producer_guard, registry
from foldkv.kernels.prefill import TOKENS_PER_TILE, prefill, tile_plan, variant_name

GEOM = foldkv.GEMMA4_31B
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]
PREFILL_ARGS = ["Q", "Pool", "PageIds", "SeqLens", "QStart", "QLens", "TileReq", "TileTok", "Out", "Lse"]
PREFILL_FP8_ARGS = ["Q", "Pool", "Scales", *PREFILL_ARGS[2:]]  # the scales right after the pool
PREP_ARGS = ["Qraw", "KVraw", "QNormW", "KNormW", "InvFreq", "Positions", "SlotPage", "SlotOffset", "Pool", "QueryOut"]


# --- the tile plan -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_lens", [[1], [8], [9], [54, 1, 97, 16384, 7]])
def test_tile_plan_covers_every_query_once(q_lens):
    q_start, tile_req, tile_tok = tile_plan(torch.tensor(q_lens))
    assert q_start.tolist() == [sum(q_lens[:r]) for r in range(len(q_lens))]
    covered = [[0] * m for m in q_lens]
    for r, t0 in zip(tile_req.tolist(), tile_tok.tolist()):
        assert 0 <= t0 < q_lens[r] and t0 % TOKENS_PER_TILE == 0
        for t in range(t0, min(t0 + TOKENS_PER_TILE, q_lens[r])):
            covered[r][t] += 1
    assert all(c == 1 for req in covered for c in req)
    assert tile_req.dtype == tile_tok.dtype == q_start.dtype == torch.int32


def test_registry_holds_every_variant():
    names = {v.name: v for v in registry.all_variants()}
    for fmt in FORMATS:
        assert names[variant_name(fmt)].family == "prefill" and names[variant_name(fmt)].format is fmt
    folded, split = names["prefill_folded"].params, names["prefill_split"].params
    # the bf16 folded prefill is the seesaw with released halves (prefill_folded.py: its own schedule, the lazy max its
    # one choice); split is prefill_attention's program with one stage and the plain softmax (the builder's defaults)
    assert folded == {"page_size": 64, "block_N": 64, "max_slack_log2": 8.0}
    assert names["prefill_folded"].build_function().hands_out == "prefill_{fmt}"
    assert names["prefill_folded"].builder.endswith("prefill_folded:build")
    assert split == {"page_size": 64, "block_N": 64, "num_stages": 1, "threads": 256}
    assert names["prefill_split"].builder.endswith("prefill_attention:build")
    fp8 = names[variant_name(KvFormat.FOLDED, quantized=True)]
    assert fp8.name == "prefill_folded_fp8" and fp8.family == "prefill" and fp8.format is KvFormat.FOLDED
    assert set(fp8.params) == set(split) and fp8.params["block_N"] == 64
    assert fp8.build_function().hands_out == "prefill_{fmt}_fp8"


def test_an_fp8_split_prefill_is_never_built():
    require_tilelang()
    with pytest.raises(ValueError, match="FP8 rows are folded only"):
        prefill_attention.prefill_program(GEOM, KvFormat.SPLIT, fp8=True)


# --- generation for sm_90a, no GPU ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["prefill_split", "prefill_folded", "prefill_folded_fp8", "prep_split",
                                        "prep_folded"])
def generated(request):
    require_tilelang()
    if request.param.startswith("prep_"):  # the fused prep: a version, built without the registry
        return request.param, bench_version("prep_fused").build(GEOM, request.param.split("_")[1])
    return request.param, registry.get(request.param).build(GEOM)


def test_generated_kernel(generated):
    name, kernel = generated
    params = [kernel.prim_func.buffer_map[p].name for p in kernel.prim_func.params]
    src = kernel.get_kernel_source()
    # one warp-specialised producer in each prefill, its loop kept in the warp that issues the copies
    assert producer_guard.check_producer_guard(name, src) == {"producer_branches": int(name.startswith("prefill"))}
    if name == "prefill_folded_fp8":
        assert params == PREFILL_FP8_ARGS  # the order prefill() passes and an AOT backend must follow
        buffers = kernel.prim_func.buffer_map
        assert [str(buffers[p].dtype) for p in kernel.prim_func.params[1:3]] == ["float8_e4m3", "float32"]
        assert "wgmma" in src and "Scales_desc" in src, "expected wgmma and a TMA load of the scales"
        # the row as stored: five 128-column e4m3 panels by TMA, every gemm on bf16 tiles (no FP8 MMA)
        assert src.count("tma_load(Pool_desc") == 5 and all(f"stored_{p}" in src for p in range(5))
        assert "wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in src
        assert "DataType::kFloat8" not in src
    elif name.startswith("prefill"):
        assert params == PREFILL_ARGS  # the order prefill() passes and an AOT backend must follow
        assert "wgmma" in src and "tma_load" in src, "expected Hopper wgmma + TMA loads"
        # the seesaw (PREFILL_SCHEDULE.md): two consumer warpgroups, each a whole 64 x 64 score tile (m64n64: three
        # gemms in warpgroup 0, two in warpgroup 1) and half the output columns (m64n256, warpgroup 0's own P from
        # registers), three rescales under the lazy max's flag; split (the red twin) has one consumer branch
        # splitting every tile
        seesaw = (src.count("tl::warpgroup_reg_alloc<") == 2 and src.count("DataType::kFloat32, 64, 64, 16") == 5
                  and src.count("DataType::kFloat32, 64, 256, 16") == 4 and src.count("tl::wgmma_rs<") == 1
                  and all(f"if (moved{s}[0] != 0)" in src for s in ("", "_1", "_2")))
        assert seesaw == (name == "prefill_folded"), name
    else:
        assert params == PREP_ARGS
        assert "__fmul_rn" in src and "__fadd_rn" in src, "RoPE must keep torch's rounding order (no FMA)"
        assert "__cosf" not in src and "__sinf" not in src, "fast-math trig would break bit equality"


# --- refusals without a GPU ------------------------------------------------------------------------------------------
def _cpu_case(fmt=KvFormat.FOLDED, seq_lens=(70, 5), q_lens=(6, 5), page_size=64, dtype=torch.bfloat16):
    pool = PagedKvPool(PagedKvLayout(GEOM, fmt, page_size, 8, dtype=dtype), fill=0.5)
    table = pool.allocate(list(seq_lens), pad_pages=1, pad_value=-1)
    query = torch.randn(sum(q_lens), GEOM.num_q_heads, GEOM.head_dim).to(torch.bfloat16)
    return pool, query, table, torch.tensor(q_lens, dtype=torch.int32)


def test_valid_cpu_input_reaches_only_the_device_check():
    pool, query, table, q_lens = _cpu_case()
    with pytest.raises(FoldKvInputError, match="prefill runs on CUDA"):
        prefill(pool, query, table, q_lens)


@pytest.mark.parametrize("bad,match", [
    ("q_len_zero", r"q_lens\[1\] = 0"),
    ("q_len_past_seq", r"q_lens\[0\] = 71 must be in 1..seq_len = 70"),
    ("query_rows", r"query has shape \[10, 32, 512\]"),
    ("query_dtype", "query has dtype torch.float32"),
    ("query_noncontiguous", "query must be contiguous"),
    ("lse_dtype", "lse has dtype"),
    ("page_id", "page_ids"),
    ("page_size", "not a multiple of the kernel's key tile"),
    ("pool_dtype", "prefill kernels read bf16 or FP8"),
    ("backend", "backend 'triton'"),
    ("kernels", r"kernels= names \['prefill_split'\]; this launch uses \['prefill_folded'\]"),
    ("param", r"prefill_folded has no parameter \['block_n'\]"),
])
def test_prefill_refusals(bad, match):
    pool, query, table, q_lens = _cpu_case()
    kw = {}
    if bad == "q_len_zero":
        q_lens = torch.tensor([6, 0], dtype=torch.int32)
    elif bad == "q_len_past_seq":
        q_lens = torch.tensor([71, 5], dtype=torch.int32)
    elif bad == "query_rows":
        query = query[:-1]
    elif bad == "query_dtype":
        query = query.float()
    elif bad == "query_noncontiguous":
        query = query.transpose(0, 1).contiguous().transpose(0, 1)
    elif bad == "lse_dtype":
        kw["lse"] = torch.empty(11, 32, dtype=torch.float64)
    elif bad == "page_id":
        table.page_ids[0, 0] = 99
    elif bad == "page_size":
        pool, query, table, q_lens = _cpu_case(page_size=32)
    elif bad == "pool_dtype":
        pool = PagedKvPool(PagedKvLayout(GEOM, KvFormat.FOLDED, 64, 8, torch.float32), fill=0.5)
    elif bad == "kernels":
        kw["kernels"] = {"prefill_split": lambda *args: None}
    elif bad == "param":
        kw["params"] = {"block_n": 32}  # the prefill's key tile is block_N
    else:
        kw["backend"] = "triton"
    with pytest.raises(FoldKvInputError, match=match):
        prefill(pool, query, table, q_lens, **kw)


def _fp8_case(seq_lens=(70, 5), q_lens=(6, 5)):
    return _cpu_case(KvFormat.FOLDED, seq_lens, q_lens, dtype=FP8_DTYPE)


@pytest.mark.parametrize("fp8_rows", ["gather", "in_kernel"])
def test_valid_fp8_input_reaches_only_the_device_check(fp8_rows):
    pool, query, table, q_lens = _fp8_case()
    with pytest.raises(FoldKvInputError, match="prefill runs on CUDA"):
        prefill(pool, query, table, q_lens, kv_dtype=FP8_DTYPE, fp8_rows=fp8_rows)


@pytest.mark.parametrize("bad,match", [
    ("fp8_pool_as_bf16", "a torch.bfloat16 prefill was asked of a pool that stores torch.float8_e4m3fn"),
    ("bf16_pool_as_fp8", "a torch.float8_e4m3fn prefill was asked of a pool that stores torch.bfloat16"),
    ("scales_missing", "an FP8 pool has no scales"),
    ("scales_shape", r"pool scales has shape \[8, 4, 32\]"),
    ("scales_dtype", "pool scales has dtype torch.float64"),
    ("scales_on_bf16_pool", "pool holds no scales"),
    ("in_kernel_variant_for_gather_rows",
     r"kernels= names \['prefill_folded_fp8'\]; this launch uses \['dequant_pages_folded_fp8', 'prefill_folded'\]"),
    ("bf16_kernel_for_in_kernel_rows",
     r"kernels= names \['prefill_folded'\]; this launch uses \['prefill_folded_fp8'\]"),
    ("fp8_rows", r"fp8_rows must be one of \('gather', 'in_kernel'\), got 'exact'"),
])
def test_fp8_prefill_refusals_write_nothing(bad, match):
    """A pool of one dtype asked to run as the other, an FP8 pool's scales missing or misshapen (or scales on a bf16
    pool), a kernel offered that the FP8 rows' route does not launch, an unknown route: refused before the device
    check, the pool unchanged."""
    pool, query, table, q_lens = _fp8_case()
    kw = {}
    if bad == "fp8_pool_as_bf16":
        kw["kv_dtype"] = torch.bfloat16
    elif bad == "bf16_pool_as_fp8":
        pool = _cpu_case()[0]
        kw["kv_dtype"] = FP8_DTYPE
    elif bad == "scales_missing":  # the pool's tensors changed after it was made (its constructor checks them)
        pool.scales = None
    elif bad == "scales_shape":
        pool.scales = pool.scales[:, :, :32].contiguous()
    elif bad == "scales_dtype":
        pool.scales = pool.scales.double()
    elif bad == "scales_on_bf16_pool":
        pool = _cpu_case()[0]
        pool.scales = torch.ones(8, 4, 64)
    elif bad == "in_kernel_variant_for_gather_rows":
        kw["kernels"] = {"prefill_folded_fp8": lambda *args: None}
    elif bad == "bf16_kernel_for_in_kernel_rows":
        kw.update(kernels={"prefill_folded": lambda *args: None}, fp8_rows="in_kernel")
    else:
        kw["fp8_rows"] = "exact"
    data, scales = pool.data.clone(), None if pool.scales is None else pool.scales.clone()
    with pytest.raises(FoldKvInputError, match=match):
        prefill(pool, query, table, q_lens, **kw)
    assert torch.equal(pool.data.view(torch.uint8), data.view(torch.uint8))
    assert (pool.scales is None and scales is None) or torch.equal(pool.scales, scales)


def _prep_case():
    pool = PagedKvPool(PagedKvLayout(GEOM, KvFormat.FOLDED, 64, 4), fill=0.25)
    table = pool.allocate([70, 3])
    request = torch.tensor([0, 0, 1], dtype=torch.int32)
    positions = torch.tensor([68, 69, 2], dtype=torch.int32)
    q = torch.randn(3, GEOM.num_q_heads, GEOM.head_dim).to(torch.bfloat16)
    kv = torch.randn(3, GEOM.num_kv_heads, GEOM.head_dim).to(torch.bfloat16)
    w = torch.rand(GEOM.head_dim)
    return pool, table, request, positions, q, kv, w, w.clone()


@pytest.mark.parametrize("bad,match", [
    (None, "fused prep runs on CUDA"),
    ("position_past_len", "past its request's length"),
    ("kv_dtype", "kv has dtype"),
    ("q_dtype", "q has dtype torch.float64"),
    ("request_len", r"request has shape \[2\]"),
])
def test_prep_refusals_leave_pool_unchanged(bad, match):
    pool, table, request, positions, q, kv, qw, kw = _prep_case()
    if bad == "position_past_len":
        positions = torch.tensor([68, 70, 2], dtype=torch.int32)
    elif bad == "kv_dtype":
        kv = kv.float()
    elif bad == "q_dtype":
        q, kv = q.double(), kv.double()
    elif bad == "request_len":
        request = request[:2]
    before = pool.data.clone()
    with pytest.raises(FoldKvInputError, match=match):
        bench_version("prep_fused").prep_and_store_gpu(pool, table, request, positions, q, kv, qw, kw)
    assert torch.equal(pool.data, before)


def test_launchers_import_without_tilelang():
    import subprocess
    import sys

    code = ("import sys; sys.modules['tilelang'] = None\n"  # any TileLang import now raises
            "import foldkv.kernels.prefill\n"
            "from foldkv.kernels import registry; assert 'prefill_folded' in {v.name for v in registry.all_variants()}")
    subprocess.run([sys.executable, "-c", code], check=True)
