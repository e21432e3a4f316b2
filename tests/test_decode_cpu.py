"""CPU tests of split-KV decode: the emitted-CUDA barrier check red/green on real generated source, the plan, and
the refusals that need no GPU (every check runs before the device check)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import bench_version, require_tilelang

import foldkv
from foldkv import BlockTable, FoldKvInputError, KvFormat, PagedKvLayout, PagedKvPool
from foldkv.kernels import cuda_checks, merge, registry
from foldkv.kernels.decode import decode, kernel_names
from foldkv.kernels.plan import (MAX_BATCH, MAX_LEN, balanced_chunk_pages, estimated_step, one_wave_cap,
                                  plan_decode)

GEOM = foldkv.GEMMA4_31B
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]


# --- the barrier check on real generated source -------------------------------------------------------------------
@pytest.fixture(scope="module")
def merge_groups_source() -> str:
    require_tilelang()
    return merge.build_merge_groups(GEOM).get_kernel_source()


def test_barrier_check_passes_generated_merge(merge_groups_source):
    report = cuda_checks.check_in_place_merge("merge_groups", merge_groups_source)
    assert set(report.in_place_buffers) == {"part_o", "part_lse"}
    assert report.last_read < report.barrier < report.first_store


def test_barrier_check_refuses_merge_generated_without_barrier():
    require_tilelang()
    with pytest.raises(cuda_checks.BarrierCheckError, match="merge_groups"):
        merge.build_merge_groups(GEOM, barrier=False)  # the check runs at generation time
    source = merge.build_merge_groups(GEOM, barrier=False, check=False).get_kernel_source()
    with pytest.raises(cuda_checks.BarrierCheckError, match=r"merge_groups.*none between them"):
        cuda_checks.check_in_place_merge("merge_groups", source)


def test_barrier_check_refuses_conditional_barrier(merge_groups_source):
    # the same generated kernel with its barrier reached only by some threads
    source = merge_groups_source.replace("__syncthreads();", "if (threadIdx.x < 64) { __syncthreads(); }", 1)
    assert source != merge_groups_source
    with pytest.raises(cuda_checks.BarrierCheckError, match="only inside a conditional"):
        cuda_checks.check_in_place_merge("merge_groups", source)


def test_barrier_check_names_missing_kernel(merge_groups_source):
    with pytest.raises(cuda_checks.BarrierCheckError, match="merge_final"):
        cuda_checks.check_in_place_merge("merge_final", merge_groups_source)


def test_barrier_check_reports_a_kernel_that_stores_before_it_reads():
    """Store, barrier, read back: every pair is separated, so it passes; there is no read before the first store to
    report (the check's report says so instead of failing)."""
    source = """extern "C" __global__ void __launch_bounds__(128, 1) k_kernel(float* __restrict__ buf) {
  buf[threadIdx.x] = 1.0f;
  __syncthreads();
  float x = buf[127 - threadIdx.x];
  __syncthreads();
  buf[threadIdx.x] = x;
}
"""
    report = cuda_checks.check_in_place_merge("k", source)
    assert report.in_place_buffers == ("buf",) and report.last_read is None and report.barrier is None
    assert report.pairs_checked == 2
    with pytest.raises(cuda_checks.BarrierCheckError, match="none between them"):
        cuda_checks.check_in_place_merge("k", source.replace("__syncthreads();", "", 1))


def test_every_in_place_variant_is_checked_at_generation():
    in_place = [v for v in registry.all_variants() if v.in_place_merge]
    assert [v.name for v in in_place] == ["merge_groups"]
    assert in_place[0].build_function() is merge.build_merge_groups  # whose default (check=True) runs the check
    assert "check" not in in_place[0].params and "barrier" not in in_place[0].params


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_argument_order_matches_launcher(fmt):
    """The argument order decode.py passes (and an AOT backend must follow) is the prim_funcs' parameter order."""
    require_tilelang()
    from foldkv.kernels.decode_partial import decode_partial_program

    names = lambda f: [f.buffer_map[p].name for p in f.params]  # noqa: E731
    assert names(decode_partial_program(GEOM, fmt)) == ["query", "pool", "page_ids", "chunk_req", "chunk_start", "chunk_len",
                                    "part_o", "part_lse"]
    assert names(merge.merge_groups_program(GEOM)) == ["part_o", "part_lse", "group_first", "group_count"]
    assert names(merge.merge_final_program(GEOM)) == ["part_o", "part_lse", "group_first", "req_group_first",
                                                      "req_group_count", "value_head_column", "out", "lse"]
    assert kernel_names(fmt)[0] == f"decode_partial_{fmt.value}"
    assert names(decode_partial_program(GEOM, fmt, tail_merge=True)) == [
        "query", "pool", "page_ids", "chunk_req", "chunk_start", "chunk_len", "merge_first", "merge_count", "part_o",
        "part_lse", "counters", "value_head_column", "out", "lse"]
    assert kernel_names(fmt, fused=True) == (f"decode_fused_{fmt.value}",)


def test_prefetch_keeps_the_arguments_and_is_refused_off_bf16_page_tiles():
    """The L2 prefetch version (bench/versions/decode_partial_l2_prefetch.py: the partial's `loaded` and `source` hook
    points) takes no argument of its own, and is refused where a tile is not one page of bf16 rows (its prefetch is a
    whole page tile)."""
    require_tilelang()
    from foldkv.kernels.decode_partial import decode_partial_program

    prefetch = bench_version("decode_partial_l2_prefetch")
    names = lambda f: [f.buffer_map[p].name for p in f.params]  # noqa: E731
    assert names(prefetch.program(GEOM, KvFormat.FOLDED, 2)) == [
        "query", "pool", "page_ids", "chunk_req", "chunk_start", "chunk_len", "part_o", "part_lse"]
    for bad in (dict(fp8=True), dict(page_size=128)):
        with pytest.raises(ValueError, match="L2 prefetch"):
            prefetch.program(GEOM, KvFormat.FOLDED, 2, **bad)
    decode_partial_program(GEOM, KvFormat.FOLDED, page_size=128)  # red twin: the same tiling, no prefetch, builds


# --- the fused step's hand-off check on real generated source ------------------------------------------------------
@pytest.fixture(scope="module")
def fused_source() -> str:
    require_tilelang()
    from foldkv.kernels.decode_partial import build_decode_fused

    return build_decode_fused(GEOM, KvFormat.FOLDED).get_kernel_source()  # the check already ran on it


def test_hand_off_check_passes_generated_fused_step(fused_source):
    from foldkv.kernels import macros

    report = cuda_checks.check_tail_hand_off("decode_fused_folded", fused_source, threads=128)
    assert report["barrier_id"] == macros.TAIL_BARRIER_ID and report["leader"] == 128
    assert macros.TAIL_BARRIER_ID not in report["other_barrier_ids"]


def test_hand_off_check_refuses_fused_step_generated_without_hand_off():
    require_tilelang()
    from foldkv.kernels.decode_partial import build_decode_fused

    with pytest.raises(cuda_checks.HandOffCheckError, match="decode_fused_split: 0 hand-off calls"):
        build_decode_fused(GEOM, KvFormat.SPLIT, tail_hand_off=False)  # the check runs at generation time


def _hand_off_line(source: str) -> str:
    (line,) = [ln for ln in source.splitlines() if "foldkv_tail_hand_off(counters" in ln]
    return line


@pytest.mark.parametrize("broken,match", [
    ("before_stores", "every store must come before it"),
    ("barrier_1", "named barrier 1 is also used"),
    ("threads_256", "counts 256 threads; the consumers are 128"),
    ("leader_0", "the leader is thread 0"),
    ("twice", "2 hand-off calls"),
])
def test_hand_off_check_refuses_broken_fused_step(fused_source, broken, match):
    """Each a deliberately broken copy of the generated kernel: the hand-off moved ahead of the partial's stores, on a
    barrier TileLang's reductions use, counting the wrong threads, led by a producer thread, or called twice."""
    line = _hand_off_line(fused_source)
    call = line.strip()
    if broken == "before_stores":  # ahead of the epilogue's first store into part_o
        source = fused_source.replace(line + "\n", "", 1)
        at = source.index("part_o[")
        at = source.rindex("\n", 0, at)
        source = source[:at] + "\n" + call + source[at:]
    else:
        new = {"barrier_1": call.replace(", 128, 8, 128);", ", 128, 1, 128);"),
               "threads_256": call.replace(", 128, 8, 128);", ", 128, 8, 256);"),
               "leader_0": call.replace(", 128, 8, 128);", ", 0, 8, 128);"),
               "twice": call + " " + call}[broken]
        assert new != call
        source = fused_source.replace(call, new, 1)
    with pytest.raises(cuda_checks.HandOffCheckError, match=match):
        cuda_checks.check_tail_hand_off("decode_fused_folded", source, threads=128)


# --- the plan ----------------------------------------------------------------------------------------------------
def _layout(fmt=KvFormat.FOLDED, pages=0):
    return PagedKvLayout(GEOM, fmt, 64, pages)


RAGGED_128 = [1, 63, 64, 65, 262144] + [int(x) for x in torch.randint(1, 49152, (123,),
                                                                   generator=torch.Generator().manual_seed(128))]


@pytest.mark.parametrize("lens", [[1], [63], [64], [65], [10602], [163336], [1, 97, 16384, 54, 262144], [5] * 256,
                                  RAGGED_128])
@pytest.mark.parametrize("chunk_tokens", [None, 64, 512, 4096])
@pytest.mark.parametrize("merge_group", [None, 1, 3])
def test_plan_covers_every_token_once(lens, chunk_tokens, merge_group):
    plan = plan_decode(_layout(), lens, device="cpu", chunk_tokens=chunk_tokens, merge_group=merge_group)
    covered = [[] for _ in lens]
    for r, start, n in plan.chunks:
        assert start % 64 == 0 and 1 <= n <= plan.chunk_tokens
        covered[r].append((start, n))
    for r, n in enumerate(lens):
        spans = covered[r]
        assert spans[0][0] == 0 and sum(s for _, s in spans) == n
        assert all(a + la == b for (a, la), (b, _) in zip(spans, spans[1:]))  # consecutive, no gap or overlap
    # groups: consecutive slots of one request, at most merge_group each, every slot in exactly one group
    seen = []
    for first, count in plan.groups:
        assert 1 <= count <= plan.merge_group
        assert len({plan.chunks[s][0] for s in range(first, first + count)}) == 1
        seen += range(first, first + count)
    assert seen == list(range(plan.num_chunks))
    for r, (g0, ng) in enumerate(plan.request_groups):
        slots = [s for g in range(g0, g0 + ng) for s in range(plan.groups[g][0], sum(plan.groups[g]))]
        assert [plan.chunks[s][0] for s in slots] == [r] * len(slots) and len(slots) == len(covered[r])
    # device tensors hold the same lists
    assert plan.chunk_len.tolist() == [n for _, _, n in plan.chunks]
    assert plan.group_first.tolist() == [f for f, _ in plan.groups]
    assert plan.req_group_count.tolist() == [n for _, n in plan.request_groups]
    assert plan.part_o.shape == (plan.num_chunks, 32, 512) and plan.part_lse.shape == (plan.num_chunks, 32)
    # the fused step's view: each chunk's request's first slot and chunk count; counters zero
    firsts = {r: min(c for c, (q, _, _) in enumerate(plan.chunks) if q == r) for r in range(len(lens))}
    assert plan.merge_first.tolist() == [firsts[r] for r, _, _ in plan.chunks]
    assert plan.merge_count.tolist() == [len(covered[r]) for r, _, _ in plan.chunks]
    assert plan.tail_counters.shape == (len(lens), 4) and not plan.tail_counters.any()
    assert plan.fused == (plan.num_chunks * 4 <= 132)


PLAN_CASES = {
    "single10602": [10602], "single40002": [40002], "single163336": [163336],
    "ragged4": [27275, 9021, 18110, 12300], "ragged32": [int(x) for x in torch.randint(4096, 28672, (32,),
                                                          generator=torch.Generator().manual_seed(32))],
    "longtail64": [int(x) for x in torch.randint(1, 4096, (58,), generator=torch.Generator().manual_seed(9))]
                  + [65536, 98304, 131072, 163336, 200000, 262144],
    "ragged128": RAGGED_128, "tiny256": [1] * 256,
}


@pytest.mark.parametrize("lens", [[10602], [40002], [81653], [163336], [262144]])
def test_single_request_keeps_one_wave(lens):
    """One request: the smallest cap that fits one wave of CTAs is already balanced (every CTA the same pages)."""
    layout = _layout()
    pages = [layout.pages_for(n) for n in lens]
    plan = plan_decode(layout, lens, device="cpu", num_sms=132)
    assert max(n for _, _, n in plan.chunks) == 64 * one_wave_cap(pages, GEOM.num_kv_heads, 132)
    assert plan.num_chunks * GEOM.num_kv_heads <= 132


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_balanced_cap_is_near_the_best_cap(case):
    """The chooser's ladder of caps lands within 3% of the best cap found by trying every cap (brute force)."""
    lens = PLAN_CASES[case]
    layout = _layout()
    pages = [layout.pages_for(n) for n in lens]
    est = lambda cap: estimated_step(pages, cap, GEOM.num_kv_heads, 132)  # noqa: E731
    best = min(est(c) for c in range(1, max(pages) + 1))
    assert est(balanced_chunk_pages(layout, lens, 132)) <= 1.03 * best


def test_balanced_plan_beats_one_wave_on_a_ragged_batch():
    """32 requests of 4K-28K: one wave means one CTA per request and head, so the step is the longest request's
    read; balanced pieces cut the modelled step by over a third (the H200 numbers are in notebook 04)."""
    lens = PLAN_CASES["ragged32"]
    layout = _layout()
    pages = [layout.pages_for(n) for n in lens]
    wave = one_wave_cap(pages, GEOM.num_kv_heads, 132)
    assert wave > 0.9 * max(pages)  # one wave only by (nearly) not splitting at all
    balanced = balanced_chunk_pages(layout, lens, 132)
    assert estimated_step(pages, balanced, GEOM.num_kv_heads, 132) < 0.67 * estimated_step(pages, wave,
                                                                                            GEOM.num_kv_heads, 132)


def test_estimate_is_the_floor_plus_the_longest_cta():
    """The model on hand-made numbers: one wave -> the longest CTA; more -> total / SMs + the longest CTA."""
    assert estimated_step([10, 10], 5, 1, 4, overhead=1) == 6  # 4 CTAs of 5 pages on 4 SMs
    assert estimated_step([10, 10], 5, 1, 2, overhead=1) == (20 + 4) / 2 + 6


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_balanced_pieces_are_even_and_largest_first(case):
    """More than one wave: near-equal pieces per request, largest first. One wave: fixed chunks of the chosen cap in
    request order (what the one-wave planner laid out, measured faster there)."""
    lens = PLAN_CASES[case]
    plan = plan_decode(_layout(), lens, device="cpu", num_sms=132)
    if plan.num_chunks * GEOM.num_kv_heads <= 132:
        fixed = plan_decode(_layout(), lens, device="cpu", chunk_tokens=plan.chunk_tokens)
        assert plan.chunks == fixed.chunks and plan.groups == fixed.groups
        return
    per_request: dict[int, list[int]] = {}
    for r, start, n in plan.chunks:
        per_request.setdefault(r, []).append(-(-n // 64))
    for r, pieces in per_request.items():  # within a request: at most one page apart (the last may be partial)
        full = pieces[:-1] or pieces
        assert max(full) - min(full) <= 1, (r, pieces)
    firsts = [per_request[plan.chunks[g0][0]][0] for g0, _ in (plan.groups[f] for f, _ in plan.request_groups)]
    slot_order = sorted(range(len(lens)), key=lambda r: plan.request_groups[r][0])
    first_piece = [per_request[r][0] for r in slot_order]
    assert first_piece == sorted(first_piece, reverse=True) and len(firsts) == len(lens)


def test_plan_chunk_boundary():
    plan = plan_decode(_layout(), [511, 512, 513], device="cpu", chunk_tokens=512)
    assert plan.chunks == [(0, 0, 511), (1, 0, 512), (2, 0, 512), (2, 512, 1)]


def test_value_head_column_per_format():
    assert plan_decode(_layout(KvFormat.SPLIT), [5], device="cpu").value_head_column.tolist() == list(range(512))
    cols = plan_decode(_layout(KvFormat.FOLDED), [5], device="cpu").value_head_column
    assert torch.equal(cols.long(), foldkv.value_window_columns(GEOM, KvFormat.FOLDED))


@pytest.mark.parametrize("lens,chunk,match", [
    ([], None, "a batch of 0"),
    ([5] * (MAX_BATCH + 1), None, f"batch of {MAX_BATCH + 1}"),
    ([0], None, "seq_lens holds 0"),
    ([MAX_LEN + 1], None, "262144"),
    ([100], 96, "multiple of the page size"),
    ([100], 0, "multiple of the page size"),
])
def test_plan_refusals(lens, chunk, match):
    with pytest.raises(FoldKvInputError, match=match):
        plan_decode(_layout(), lens, device="cpu", chunk_tokens=chunk)


# --- launcher refusals, all before the device check --------------------------------------------------------------
def _cpu_case(fmt=KvFormat.FOLDED, lens=(70, 5)):
    pool = PagedKvPool(_layout(fmt, 8), fill=0.5)
    table = pool.allocate(list(lens), scatter_seed=3)
    query = torch.randn(len(lens), 32, 512).to(torch.bfloat16)
    out = torch.full((len(lens), 32, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((len(lens), 32), float("nan"))
    return pool, table, query, out, lse


def _refused(match, pool, query, table, out, lse, **kw):
    before = (pool.data.clone(), out.clone(), lse.clone())
    with pytest.raises(FoldKvInputError, match=match):
        decode(pool, query, table, out=out, lse=lse, **kw)
    assert torch.equal(pool.data, before[0])
    assert torch.equal(out.view(torch.int16), before[1].view(torch.int16))  # NaN poison untouched, bit for bit
    assert torch.equal(lse.view(torch.int32), before[2].view(torch.int32))


def test_valid_cpu_input_reaches_only_the_device_check():
    pool, table, query, out, lse = _cpu_case()
    _refused("decode runs on a CUDA device", pool, query, table, out, lse)


def test_refuses_page_id_out_of_range():
    pool, table, query, out, lse = _cpu_case()
    table.page_ids[1, 0] = 8
    _refused(r"page_ids.*outside \[0, 8\)", pool, query, table, out, lse)


def test_refuses_length_above_pages():
    pool, table, query, out, lse = _cpu_case()
    table.seq_lens[0] = 64 * table.page_ids.shape[1] + 1
    _refused("block table holds only", pool, query, table, out, lse)


def test_refuses_batch_above_limit():
    b = MAX_BATCH + 1
    pool = PagedKvPool(_layout(KvFormat.FOLDED, b), fill=0.5)
    table = pool.allocate([3] * b)
    q = torch.randn(b, 32, 512).to(torch.bfloat16)
    out = torch.full((b, 32, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((b, 32), float("nan"))
    _refused(f"batch of {b}", pool, q, table, out, lse)


def test_refuses_length_above_limit():
    pool, table, query, out, lse = _cpu_case()
    table = BlockTable(torch.zeros(2, 4097, dtype=torch.int32), torch.tensor([MAX_LEN + 1, 5], dtype=torch.int32))
    _refused("above the limit", pool, query, table, out, lse)


@pytest.mark.parametrize("bad", ["dtype", "shape", "noncontiguous", "page_ids_dtype", "out_dtype", "lse_shape"])
def test_refuses_bad_tensors(bad):
    pool, table, query, out, lse = _cpu_case()
    if bad == "dtype":
        query = query.float()
    elif bad == "shape":
        query = query[:, :16]
    elif bad == "noncontiguous":
        query = torch.randn(2, 512, 32).to(torch.bfloat16).transpose(1, 2)
    elif bad == "page_ids_dtype":
        table = BlockTable(table.page_ids.long(), table.seq_lens)
    elif bad == "out_dtype":
        out = out.float()
    elif bad == "lse_shape":
        lse = lse[:, :8]
    _refused({"dtype": "query has dtype", "shape": "query has shape", "noncontiguous": "contiguous",
              "page_ids_dtype": "page_ids has dtype", "out_dtype": "out has dtype", "lse_shape": "lse has shape"}[bad],
             pool, query, table, out, lse)


def test_refuses_pool_of_other_format():
    pool, table, query, out, lse = _cpu_case(KvFormat.SPLIT)
    _refused("folded decode was asked of a split pool", pool, query, table, out, lse, kv_format="folded")
    folded_plan = plan_decode(_layout(KvFormat.FOLDED), [70, 5], device="cpu")
    _refused("plan was made for folded pages", pool, query, table, out, lse, plan=folded_plan)


def test_refuses_plan_for_other_lengths():
    pool, table, query, out, lse = _cpu_case()
    plan = plan_decode(pool.layout, [70, 6], device="cpu")
    _refused("other sequence lengths", pool, query, table, out, lse, plan=plan)


def test_plan_is_fused_only_in_one_wave_of_bf16_rows():
    assert plan_decode(_layout(), [163336], device="cpu").fused  # a single request: one wave
    assert plan_decode(_layout(), [5] * 33, device="cpu").fused  # 33 chunks x 4 KV heads = 132 CTAs
    assert not plan_decode(_layout(), [5] * 34, device="cpu").fused
    assert not plan_decode(_layout(), [163336], device="cpu", chunk_tokens=4096).fused  # 40 chunks x 4 KV heads
    assert plan_decode(_layout(), [163336], device="cpu", num_sms=64).fused  # one wave of 64 SMs: 16 chunks
    from foldkv.fp8 import FP8_DTYPE

    fp8 = PagedKvLayout(GEOM, KvFormat.FOLDED, 64, 0, dtype=FP8_DTYPE)
    assert not plan_decode(fp8, [10602], device="cpu").fused


def test_refuses_fused_step_off_one_wave():
    pool, table, query, out, lse = _cpu_case()
    plan = plan_decode(pool.layout, table.seq_lens, device="cpu", num_sms=4)
    assert not plan.fused
    _refused(r"fused=True needs a one-wave plan", pool, query, table, out, lse, plan=plan, fused=True)


def test_refuses_unknown_backend():
    pool, table, query, out, lse = _cpu_case()
    _refused(r"unknown backend 'nope'; known: \['jit', 'aot'\]", pool, query, table, out, lse, backend="nope")


@pytest.mark.parametrize("bad,match", [
    ("other_name", r"kernels= names \['prefill_folded'\]; this launch uses \['decode_partial_folded'"),
    ("not_callable", r"kernels= gives \['merge_final'\] a value that is not callable"),
])
def test_refuses_bad_kernel_overrides(bad, match):
    pool, table, query, out, lse = _cpu_case()
    kernels = {"prefill_folded": lambda *a: None} if bad == "other_name" else {"merge_final": "merge_final"}
    _refused(match, pool, query, table, out, lse, kernels=kernels)


def _forbid_builds(monkeypatch):
    """Any kernel build or load from here on fails the test: a refusal must come before the resolver builds."""
    from foldkv.kernels import resolve

    def no_kernel(*args, **kwargs):
        raise AssertionError(f"a kernel was resolved for refused input: {args}")

    monkeypatch.setattr(resolve, "kernel", no_kernel)


@pytest.mark.parametrize("page_size", [32, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_refuses_pool_of_other_page_size(monkeypatch, fmt, page_size):
    """The partial indexes pages with the page size baked into it (64): a pool of other pages is refused before any
    kernel is built, on any device, with every output and the pool untouched."""
    _forbid_builds(monkeypatch)
    pool = PagedKvPool(PagedKvLayout(GEOM, fmt, page_size, 8), fill=0.5)
    table = pool.allocate([70, 5], scatter_seed=3)
    query = torch.randn(2, 32, 512).to(torch.bfloat16)
    out = torch.full((2, 32, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, 32), float("nan"))
    _refused(f"the pool's pages hold {page_size} tokens; decode_partial_{fmt.value} is built for pages of 64",
             pool, query, table, out, lse)


def test_pool_of_the_kernels_page_size_passes_the_page_check(monkeypatch):
    """The red twin's control: the same case with pages of 64 gets past the page-size check (to the device check)."""
    _forbid_builds(monkeypatch)
    pool, table, query, out, lse = _cpu_case()
    _refused("decode runs on a CUDA device", pool, query, table, out, lse)


@pytest.mark.parametrize("name", ["fp8-math-unknown", "fp8-math-tensor-cores-on-bf16"])
def test_refusal_table_fp8_math_rows_are_refused_before_the_device(name):
    """The refusals table's fp8_math rows (gates.DECODE_REFUSALS, notebook 02's refusal section on the GPU): on a bf16
    pool on the CPU, decode refuses each naming the fault before any device check or kernel build; the red twin, the
    same pool with fp8_math="exact" (a no-op on bf16 rows), is not refused for fp8_math."""
    from foldkv import KvFormat
    from foldkv.lab import gates
    from foldkv.kernels.decode import decode
    from foldkv.validate import FoldKvInputError

    what, make, expect = gates.DECODE_REFUSALS[name]
    inputs = gates.make_inputs(gates.Case("refuse", (65,)), KvFormat.FOLDED, "cpu", 0)
    with pytest.raises(FoldKvInputError, match=expect):
        decode(inputs.pool, inputs.query, inputs.table, **make(inputs))
    try:
        decode(inputs.pool, inputs.query, inputs.table, fp8_math="exact")
    except FoldKvInputError as exc:  # refused later for the CPU device, not for fp8_math
        assert "fp8_math" not in str(exc), exc
    except Exception:  # no GPU / TileLang here: anything past the refusals
        pass
