"""GPU gates of split-KV decode (both formats) against the float64 `paged_attention_reference`: scattered page
tables, rows past each sequence poisoned with NaN, outputs poisoned before the run and a guard row after them,
lengths 1 / 63 / 64 / 65, a chunk boundary +-1, 10602, 163336 and ragged batches; refusals leave outputs untouched;
a CUDA-graph replay of a step equals the eager step bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

import foldkv
from foldkv import FoldKvInputError, KvFormat, PagedKvLayout, PagedKvPool
from foldkv.kernels.decode import decode, plan_decode

pytestmark = pytest.mark.gpu

GEOM = foldkv.GEMMA4_31B
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]
# bf16 output (relative rounding 2^-9) and bf16 probabilities in P.V: about 3e-3 of the norm is expected
REL_TOL, ABS_TOL, LSE_TOL = 1e-2, 4e-2, 2e-3
GATE_LOG = os.environ.get("FOLDKV_DECODE_GATE_LOG")  # one JSON line per gated case, for the notes


def make_case(fmt: KvFormat, lens: list[int], seed: int, device: torch.device):
    """A pool with `lens` random sequences prepped into scattered pages (every other row NaN), their queries at
    the last positions in the format's form, and the block table on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = sum(-(-n // 64) for n in lens)
    pool = PagedKvPool(PagedKvLayout(GEOM, fmt, 64, pages + 7), device=device, fill=float("nan"))
    table = pool.allocate(lens, scatter_seed=seed, pad_pages=2, pad_value=-1)
    q_norm_w = torch.rand(GEOM.head_dim, generator=gen, device=device) * 0.15 + 0.05  # scores of a few units
    k_norm_w = torch.rand(GEOM.head_dim, generator=gen, device=device) + 0.5
    kv = [torch.randn(n, GEOM.num_kv_heads, GEOM.head_dim, generator=gen, device=device) for n in lens]
    foldkv.fill_sequences(pool, table, kv, k_norm_w)
    q = torch.randn(len(lens), GEOM.num_q_heads, GEOM.head_dim, generator=gen, device=device)
    positions = torch.tensor(lens, device=device) - 1
    query = foldkv.prep_query(GEOM, fmt, q, q_norm_w, k_norm_w, positions).contiguous()
    return pool, query, table.to(device)


def poisoned_outputs(batch: int, device):
    """out/lse as views of buffers one row longer, all NaN: the guard row must stay NaN."""
    out_buf = torch.full((batch + 1, GEOM.num_q_heads, GEOM.head_dim), float("nan"), dtype=torch.bfloat16,
                         device=device)
    lse_buf = torch.full((batch + 1, GEOM.num_q_heads), float("nan"), dtype=torch.float32, device=device)
    return out_buf, lse_buf


def gate(fmt, lens, seed, device, backend="jit", **plan_kw):
    pool, query, table = make_case(fmt, lens, seed, device)
    plan = plan_decode(pool.layout, lens, device=device, **plan_kw)
    out_buf, lse_buf = poisoned_outputs(len(lens), device)
    out, lse = decode(pool, query, table, plan=plan, out=out_buf[:-1], lse=lse_buf[:-1], backend=backend)
    torch.cuda.synchronize()
    assert out.data_ptr() == out_buf.data_ptr() and lse.data_ptr() == lse_buf.data_ptr()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "an output element was not written"
    assert torch.isnan(out_buf[-1]).all() and torch.isnan(lse_buf[-1]).all(), "written past the batch"

    ref_out, ref_lse = foldkv.paged_attention_reference(pool, query, table)  # float64, head order, natural log
    err = out.double() - ref_out
    rel = float(err.norm() / ref_out.norm())
    max_abs = float(err.abs().max())
    lse_err = float((lse.double() - ref_lse).abs().max())
    row = dict(format=fmt.value, backend=backend, lens=lens if len(lens) <= 8 else f"{len(lens)} requests", plan=plan_kw,
               chunks=plan.num_chunks, groups=plan.num_groups, max_abs=max_abs, rel=rel, lse_max_abs=lse_err)
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert rel < REL_TOL and max_abs < ABS_TOL and lse_err < LSE_TOL * max(1.0, float(ref_lse.abs().max())), row

    # same inputs again: a moving result is a race
    out2, lse2 = decode(pool, query, table, plan=plan, backend=backend)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 10602, 163336])
@pytest.mark.parametrize("fmt", FORMATS)
def test_single_request(cuda_device, fmt, length):
    gate(fmt, [length], seed=length, device=cuda_device)


@pytest.mark.parametrize("length", [1023, 1024, 1025])
@pytest.mark.parametrize("fmt", FORMATS)
def test_chunk_boundary(cuda_device, fmt, length):
    gate(fmt, [length], seed=7 + length, device=cuda_device, chunk_tokens=1024, merge_group=1)


@pytest.mark.parametrize("plan_kw", [{}, {"chunk_tokens": 256, "merge_group": 3}], ids=["default", "chunk256_g3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_ragged_batch(cuda_device, fmt, plan_kw):
    gate(fmt, [54, 97, 16384, 1, 10602, 64, 1025, 263], seed=11, device=cuda_device, **plan_kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_batch_many_groups(cuda_device, fmt):
    lens = [int(x) for x in torch.randint(1, 3000, (32,), generator=torch.Generator().manual_seed(5))]
    gate(fmt, lens, seed=5, device=cuda_device, chunk_tokens=128, merge_group=4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_operand_order(cuda_device, fmt):
    """The non-default operand order of each format's partial (head-major mma.sync for both), same merges: both
    orders compute the same function."""
    from foldkv.kernels import decode_partial_folded, decode_partial_split, merge
    from foldkv.kernels.decode import partial_kernel_name, register_backend

    other = {KvFormat.SPLIT: (decode_partial_split.build_decode_partial_split,
                              dict(operand_order="head_major", block_n=32, num_stages=2)),
             KvFormat.FOLDED: (decode_partial_folded.build_decode_partial_folded,
                               dict(operand_order="head_major", block_n=32, num_stages=3))}[fmt]
    register_backend(f"test-other-{fmt.value}", lambda geom, f: {
        partial_kernel_name(f): other[0](geom, **other[1]), "merge_groups": merge.build_merge_groups(geom),
        "merge_final": merge.build_merge_final(geom)})
    gate(fmt, [1, 65, 1025, 10602, 64], seed=13, device=cuda_device, backend=f"test-other-{fmt.value}",
         chunk_tokens=512, merge_group=3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_replay_matches_eager(cuda_device, fmt):
    lens = [10602, 97]
    pool, query, table = make_case(fmt, lens, 3, cuda_device)
    plan = plan_decode(pool.layout, lens, device=cuda_device)
    eager_out, eager_lse = decode(pool, query, table, plan=plan)  # checked once, compiles the kernels
    out, lse = poisoned_outputs(len(lens), cuda_device)
    out, lse = out[:-1], lse[:-1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        decode(pool, query, table, plan=plan, out=out, lse=lse, check=False)
    for _ in range(3):  # every replay writes every output element again
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


@pytest.mark.parametrize("bad", ["page_id", "length", "query_on_cpu", "query_dtype", "plan_format", "batch_limit"])
def test_refusals_write_nothing(cuda_device, bad):
    fmt = KvFormat.FOLDED
    lens = [130, 5]
    pool, query, table = make_case(fmt, lens, 2, cuda_device)
    plan, out, lse = plan_decode(pool.layout, lens, device=cuda_device), None, None
    out_buf, lse_buf = poisoned_outputs(len(lens), cuda_device)
    kw = {}
    if bad == "page_id":
        table.page_ids[0, 1] = pool.layout.num_pages
        match = "page_ids"
    elif bad == "length":
        table.seq_lens[1] = 64 * table.page_ids.shape[1] + 1
        match = "block table holds only"
    elif bad == "query_on_cpu":
        query = query.cpu()
        match = "query is on cpu"
    elif bad == "query_dtype":
        query = query.half()
        match = "query has dtype"
    elif bad == "plan_format":
        kw["plan"] = plan_decode(PagedKvLayout(GEOM, KvFormat.SPLIT, 64, pool.layout.num_pages), lens,
                                 device=cuda_device)
        match = "plan was made for split pages"
    else:
        table = foldkv.BlockTable(table.page_ids.repeat(17, 1)[:33].contiguous(), table.seq_lens.repeat(17)[:33])
        match = "batch of 33"
    pool_before = pool.data.clone()
    out_before, lse_before = out_buf.clone(), lse_buf.clone()
    with pytest.raises(FoldKvInputError, match=match):
        decode(pool, query, table, out=out_buf[:-1], lse=lse_buf[:-1], **kw)
    torch.cuda.synchronize()
    assert torch.equal(pool.data.view(torch.int16), pool_before.view(torch.int16))
    assert torch.equal(out_buf.view(torch.int16), out_before.view(torch.int16))
    assert torch.equal(lse_buf.view(torch.int32), lse_before.view(torch.int32))
