"""CPU tests of the dequantizing page gather (`foldkv.kernels.dequant_pages`) and of the rows the prefill over an FP8
pool attends over: the host page plan over ragged, poisoned block tables; the torch definition's rows against the FP8
pool's own rows; the bf16 rounding bound of `foldkv.fp8.dequantize_rows_bf16`; the gate's choice of the rows its
float64 reference reads; generation for sm_90a without a GPU; refusals. Each check has a red twin.
Reproduce one: `python -m pytest tests/test_dequant_pages_cpu.py -k <name>`."""

from __future__ import annotations

import pytest
import torch
from conftest import require_tilelang

import foldkv
from foldkv import FoldKvInputError, KvFormat, PagedKvLayout, PagedKvPool
from foldkv.fp8 import FP8_DTYPE, dequantize_rows, dequantize_rows_bf16, quantize_rows
from foldkv.kernels import dequant_pages, registry
from foldkv.kernels.dequant_pages import page_plan
from foldkv.lab.page_gather import bf16_pages, bf16_pages_reference
from foldkv.lab import gates

GEOM = foldkv.GEMMA4_31B
DEQUANT_ARGS = ["Pool", "PoolScales", "SrcPages", "Out"]


def _fp8_pool(seq_lens, seed=0, spare=3):
    """An FP8 pool holding random rows for `seq_lens`, pages scattered, padding entries poisoned (-7, 10**6)."""
    lay = PagedKvLayout(GEOM, KvFormat.FOLDED, 64, sum(-(-n // 64) for n in seq_lens) + spare, dtype=FP8_DTYPE)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(lay.num_pages, GEOM.num_kv_heads, 64, lay.row_width, generator=g) * 3
    q, s = quantize_rows(rows)
    pool = PagedKvPool(lay, data=q, scales=s)
    table = pool.allocate(list(seq_lens), scatter_seed=seed, pad_pages=2)
    for r, n in enumerate(seq_lens):
        k = -(-n // 64)
        table.page_ids[r, k:] = -7
        table.page_ids[r, k + 1:] = 10**6
    return pool, table


@pytest.mark.parametrize("seq_lens", [(1,), (63,), (64,), (65,), (70, 5, 129, 1), (640,)])
def test_page_plan_covers_each_requests_pages_once_in_order(seq_lens):
    """The host plan: request r's pages, in its page order, each once (its padding entries, poisoned, never taken);
    the compact table points at them. Red twin: the plan of a table with two requests swapped is not this one."""
    pool, table = _fp8_pool(seq_lens)
    src, compact = page_plan(pool.layout, table)
    need = [-(-n // 64) for n in seq_lens]
    assert src.dtype == torch.int32 and src.numel() == sum(need) and compact.page_ids.dtype == torch.int32
    assert torch.equal(compact.seq_lens, table.seq_lens)
    first = 0
    for r, n in enumerate(need):
        assert compact.page_ids[r, :n].tolist() == list(range(first, first + n))
        assert src[first:first + n].tolist() == table.page_ids[r, :n].tolist()
        first += n
    foldkv.pool.check_block_table(PagedKvLayout(GEOM, KvFormat.FOLDED, 64, max(1, sum(need))), compact)
    if len(seq_lens) > 1:
        order = torch.arange(len(seq_lens)).roll(1)
        swapped, _ = page_plan(pool.layout, foldkv.BlockTable(table.page_ids[order], table.seq_lens[order]))
        assert not torch.equal(swapped, src)


@pytest.mark.parametrize("seq_lens", [(70, 5, 129, 1), (64, 130)])
def test_reference_rows_are_each_requests_rows_rounded_once(seq_lens):
    """bf16_pages_reference: every request's rows, in token order, are its FP8 rows times their scales as one float32
    product rounded to bf16, bit for bit; the red twin (a request's pages taken in the wrong order) is caught."""
    pool, table = _fp8_pool(seq_lens, seed=4)
    bpool, btable = bf16_pages_reference(pool, table)
    assert bpool.layout.dtype == torch.bfloat16 and bpool.layout.num_pages == sum(-(-n // 64) for n in seq_lens)
    want = [dequantize_rows_bf16(pool.gather(table, r), pool.gather_scales(table, r)) for r in range(table.batch)]
    for r in range(table.batch):
        assert torch.equal(bpool.gather(btable, r).view(torch.int16), want[r].view(torch.int16))
    r = max(range(table.batch), key=lambda i: int(table.seq_lens[i]))  # a request of 3 pages
    n = -(-int(table.seq_lens[r]) // 64)
    rolled = btable.page_ids.clone()
    rolled[r, :n] = torch.roll(rolled[r, :n], 1)
    bad = bpool.gather(foldkv.BlockTable(rolled, btable.seq_lens), r)
    assert not torch.equal(bad.view(torch.int16), want[r].view(torch.int16))


def test_bf16_rows_within_one_rounding_of_the_exact_product():
    """dequantize_rows_bf16 is within 2^-8 |x| (bf16's unit roundoff) + 2^-24 |x| (the float32 product) of the exact
    q * scale, over every e4m3 code and a spread of scales; its red twin rounds the scale to bf16 first and breaks it."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    codes = codes[torch.isfinite(codes.float())]
    g = torch.Generator().manual_seed(1)
    scales = torch.exp(torch.randn(512, generator=g) * 4).float()
    q = codes[None, :].expand(scales.numel(), -1).contiguous()
    exact = dequantize_rows(q, scales)
    bound = (2.0**-8 + 2.0**-24) * exact.abs() * (1 + 2.0**-8)
    assert bool(((dequantize_rows_bf16(q, scales).double() - exact).abs() <= bound).all())
    twin = (q.to(torch.bfloat16) * scales.to(torch.bfloat16)[:, None]).double()
    assert not bool(((twin - exact).abs() <= bound).all())


def _prefill_case(dtype=FP8_DTYPE):
    case = gates.Case("ragged", (70, 5, 129), q_lens=(6, 5, 64))
    return gates.make_inputs(case, KvFormat.FOLDED, "cpu", seed=2, dtype=dtype)


def _reference_launch(rows_of, fp8_rows):
    """A stand-in kernel: the float64 reference over `rows_of(inputs)`, written into the gate's outputs in bf16."""
    def launch(inputs, out, lse):
        pool, table = rows_of(inputs)
        o, l = foldkv.paged_attention_reference(pool, inputs.query, table, inputs.q_lens)
        out.copy_(o.to(out.dtype))
        lse.copy_(l.to(lse.dtype))
        return out, lse

    launch.fp8_rows = fp8_rows
    return launch


def test_gate_reference_reads_the_rows_the_prefill_reads():
    """run_case holds a "gather" prefill over an FP8 pool to the float64 reference over its rows rounded to bf16 (green:
    that reference itself passes); red twin: an arm attending over the exact dequantized rows, declared "gather", is
    off by the bf16 rounding of the rows (~6e-3 relative, over the 3e-3 Frobenius bound) and fails. The same exact-rows
    arm declared "in_kernel" is held to the exact rows and passes."""
    inputs = _prefill_case()
    exact = _reference_launch(lambda i: (i.pool, i.table), "gather")
    gathered = _reference_launch(lambda i: bf16_pages_reference(i.pool, i.table), "gather")
    assert gates.run_case(inputs, gathered)["passed"]
    red = gates.run_case(inputs, exact)
    assert red["all_written"] and not red["rel_ok"] and not red["passed"]
    assert gates.run_case(inputs, _reference_launch(lambda i: (i.pool, i.table), "in_kernel"))["passed"]
    pool, table, p_scaled = gates.attended_rows(inputs, "gather")
    assert pool.layout.dtype == torch.bfloat16 and not p_scaled
    assert gates.attended_rows(inputs, "in_kernel")[2] is True


def test_registry_entry_and_generation():
    v = registry.get(dequant_pages.NAME)
    assert v.family == "dequant_pages" and v.format is KvFormat.FOLDED and v.params == dequant_pages.DEFAULTS
    assert v.build_function().hands_out == "dequant_pages_{fmt}_fp8"
    require_tilelang()
    kernel = v.build(GEOM)
    assert [kernel.prim_func.buffer_map[p].name for p in kernel.prim_func.params] == DEQUANT_ARGS
    src = kernel.get_kernel_source()
    # 8-byte loads of the e4m3 rows, one float32 product per value, round-to-nearest-even bf16 pairs, 16-byte stores,
    # no shared memory
    assert "*(fp8_e4_8_t*)(Pool" in src and "__float22bfloat162_rn" in src and "*(uint4*)(Out" in src
    assert "shmem" not in src and "__fmaf" not in src
    with pytest.raises(NotImplementedError, match="folded rows only"):
        dequant_pages.build(GEOM, KvFormat.SPLIT)


@pytest.mark.parametrize("bad,match", [
    ("bf16_pool", "reads an FP8 \\(e4m3\\) folded pool"),
    ("scales_missing", "an FP8 pool has no scales"),
    ("page_id", "page_ids"),
    ("kernels", r"kernels= names \['prefill_folded'\]; this launch uses \['dequant_pages_folded_fp8'\]"),
    ("backend", "backend 'cuda'"),
    (None, "the page gather runs on CUDA"),
])
def test_gather_refusals_leave_the_pool_unchanged(bad, match):
    pool, table = _fp8_pool((70, 5))
    kw = {}
    if bad == "bf16_pool":
        pool = PagedKvPool(PagedKvLayout(GEOM, KvFormat.FOLDED, 64, 8), fill=0.5)
    elif bad == "scales_missing":
        pool.scales = None
    elif bad == "page_id":
        table.page_ids[0, 0] = 10**6
    elif bad == "kernels":
        kw["kernels"] = {"prefill_folded": lambda *a: None}
    elif bad == "backend":
        kw["backend"] = "cuda"
    data = pool.data.clone()
    with pytest.raises(FoldKvInputError, match=match):
        bf16_pages(pool, table, **kw)
    assert torch.equal(pool.data.view(torch.uint8), data.view(torch.uint8))
