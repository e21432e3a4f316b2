"""GPU gates of the paged causal prefill (both formats) against the float64 `paged_attention_reference`: scattered
page tables with NaN past every sequence and -1 padding page ids, outputs poisoned before the run with a guard row
after them; a chunk starting mid-page, a one-token chunk, a whole short prompt, a page-aligned chunk, a ragged batch
and an 8,192-token chunk ending at 163,336; the last row of a prefill against a decode of the same token; a rerun is
bit-identical; refusals write nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch

import foldkv
from foldkv import BlockTable, FoldKvInputError, KvFormat, PagedKvLayout, PagedKvPool
from foldkv.kernels.prefill import prefill

pytestmark = pytest.mark.gpu

GEOM = foldkv.GEMMA4_31B
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]
# bf16 output (relative rounding 2^-9) and bf16 probabilities in P.V: a few 1e-3 of the norm is expected
REL_TOL, ABS_TOL, LSE_TOL = 1e-2, 4e-2, 2e-3
GATE_LOG = os.environ.get("FOLDKV_PREFILL_GATE_LOG")  # one JSON line per gated case, for the notes

CASES = {  # name: (seq_lens, q_lens)
    "mid_page_chunk": ([1000], [97]),  # the chunk starts at 903 = 14 pages + 7
    "one_token": ([4099], [1]),
    "whole_prompt_54": ([54], [54]),  # one partial page: 10 NaN rows after the sequence
    "page_aligned_chunk": ([4096], [64]),
    "ragged_batch": ([97, 2113, 300, 1, 16384], [97, 54, 1, 1, 333]),
    "chunk_8192_at_163336": ([163_336], [8192]),
}
# the 8,192-row chunk is checked on three 64-row windows (first, one starting mid-page, last) so that the float64
# reference stays a few seconds; every row is still checked for being written
LONG_WINDOWS = [(0, 64), (4001, 64), (8128, 64)]


def make_case(fmt: KvFormat, seq_lens: list[int], q_lens: list[int], seed: int, device: torch.device):
    """A pool of random sequences prepped into scattered pages (slots past each sequence NaN), the chunk queries
    (each request's last q_len positions) in the format's form, the block table on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = sum(-(-n // 64) for n in seq_lens)
    pool = PagedKvPool(PagedKvLayout(GEOM, fmt, 64, pages + 5), device=device, fill=float("nan"))
    table = pool.allocate(seq_lens, scatter_seed=seed, pad_pages=2, pad_value=-1)
    q_norm_w = torch.rand(GEOM.head_dim, generator=gen, device=device) * 0.15 + 0.05  # scores of a few units
    k_norm_w = torch.rand(GEOM.head_dim, generator=gen, device=device) + 0.5
    kv = [torch.randn(n, GEOM.num_kv_heads, GEOM.head_dim, generator=gen, device=device, dtype=torch.bfloat16)
          for n in seq_lens]
    foldkv.fill_sequences(pool, table, kv, k_norm_w)
    del kv
    total = sum(q_lens)
    q = torch.randn(total, GEOM.num_q_heads, GEOM.head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(seq_lens, q_lens)]).to(device)
    query = foldkv.prep_query(GEOM, fmt, q, q_norm_w, k_norm_w, positions).contiguous()
    return pool, query, table.to(device), torch.tensor(q_lens, dtype=torch.int32, device=device)


def poisoned_outputs(tokens: int, device):
    """out/lse as views of buffers one row longer, all NaN: the guard row must stay NaN."""
    out_buf = torch.full((tokens + 1, GEOM.num_q_heads, GEOM.head_dim), float("nan"), dtype=torch.bfloat16,
                         device=device)
    lse_buf = torch.full((tokens + 1, GEOM.num_q_heads), float("nan"), dtype=torch.float32, device=device)
    return out_buf, lse_buf


def reference_rows(pool, query, table, q_lens, name):
    """(rows, ref_out, ref_lse): the float64 reference on every row, or on the windows of the long chunk (each
    window is the same request cut to end at the window's last position, so the reference's causality applies)."""
    if name != "chunk_8192_at_163336":
        out, lse = foldkv.paged_attention_reference(pool, query, table, q_lens)
        return torch.arange(query.shape[0], device=query.device), out, lse
    n, m = int(table.seq_lens[0]), int(q_lens[0])
    rows, outs, lses = [], [], []
    for start, width in LONG_WINDOWS:
        end_pos = n - m + start + width  # tokens the window's last query sees
        sub = BlockTable(table.page_ids[:1].clone(), torch.tensor([end_pos], dtype=torch.int32, device=query.device))
        out, lse = foldkv.paged_attention_reference(pool, query[start:start + width], sub,
                                                    torch.tensor([width], dtype=torch.int32))
        rows.append(torch.arange(start, start + width, device=query.device))
        outs.append(out)
        lses.append(lse)
    return torch.cat(rows), torch.cat(outs), torch.cat(lses)


def compare(out, lse, ref_out, ref_lse) -> dict:
    err = out.double() - ref_out
    return dict(max_abs=float(err.abs().max()), rel=float(err.norm() / ref_out.norm()),
                lse_max_abs=float((lse.double() - ref_lse).abs().max()), lse_scale=float(ref_lse.abs().max()))


def within_tolerance(m: dict) -> bool:
    return m["rel"] < REL_TOL and m["max_abs"] < ABS_TOL and m["lse_max_abs"] < LSE_TOL * max(1.0, m["lse_scale"])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_matches_reference(cuda_device, fmt, case):
    seq_lens, q_lens_list = CASES[case]
    pool, query, table, q_lens = make_case(fmt, seq_lens, q_lens_list, seed=len(case) * 31 + len(seq_lens), device=cuda_device)
    tokens = query.shape[0]
    out_buf, lse_buf = poisoned_outputs(tokens, cuda_device)
    pool_before = pool.data.clone()
    out, lse = prefill(pool, query, table, q_lens, out=out_buf[:-1], lse=lse_buf[:-1])
    torch.cuda.synchronize()
    assert out.data_ptr() == out_buf.data_ptr() and lse.data_ptr() == lse_buf.data_ptr()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "an output element was not written"
    assert torch.isnan(out_buf[-1]).all() and torch.isnan(lse_buf[-1]).all(), "written past the chunk"
    assert torch.equal(pool.data.view(torch.int16), pool_before.view(torch.int16)), "prefill wrote into the pool"
    del pool_before

    rows, ref_out, ref_lse = reference_rows(pool, query, table, q_lens, case)
    m = compare(out[rows], lse[rows], ref_out, ref_lse)
    row = dict(format=fmt.value, case=case, seq_lens=seq_lens, q_lens=q_lens_list, rows_checked=int(rows.numel()), **m)
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert within_tolerance(m), row

    # same inputs again: a moving result is a race
    out2, lse2 = prefill(pool, query, table, q_lens)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("fmt", FORMATS)
def test_last_row_matches_decode(cuda_device, fmt):
    """The last query of a chunk is the decode of the same token: prefill's last row against the decode launcher
    (and both against the reference)."""
    from foldkv.kernels.decode import decode

    seq_lens, q_lens_list = [10602, 777], [300, 777]
    pool, query, table, q_lens = make_case(fmt, seq_lens, q_lens_list, seed=99, device=cuda_device)
    out, lse = prefill(pool, query, table, q_lens)
    last = torch.cumsum(q_lens, 0) - 1  # each request's last row
    dec_out, dec_lse = decode(pool, query[last].contiguous(), table)
    ref_out, ref_lse = foldkv.paged_attention_reference(pool, query[last], table)
    torch.cuda.synchronize()
    vs_decode = compare(out[last], lse[last], dec_out.double(), dec_lse.double())
    vs_ref = compare(out[last], lse[last], ref_out, ref_lse)
    row = dict(format=fmt.value, case="last_row_vs_decode", vs_decode=vs_decode, vs_reference=vs_ref)
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert within_tolerance(vs_decode) and within_tolerance(vs_ref), row


@pytest.mark.parametrize("bad", ["q_len_past_seq", "query_rows", "query_dtype", "page_id", "out_shape", "backend"])
def test_refusals_write_nothing(cuda_device, bad):
    fmt = KvFormat.FOLDED
    pool, query, table, q_lens = make_case(fmt, [130, 65], [10, 65], seed=2, device=cuda_device)
    out_buf, lse_buf = poisoned_outputs(query.shape[0], cuda_device)
    kw = dict(out=out_buf[:-1], lse=lse_buf[:-1])
    if bad == "q_len_past_seq":
        q_lens = torch.tensor([10, 66], dtype=torch.int32, device=cuda_device)
        match = r"q_lens\[1\] = 66"
    elif bad == "query_rows":
        query = query[:-1]
        match = "query has shape"
    elif bad == "query_dtype":
        query = query.half()
        match = "query has dtype"
    elif bad == "page_id":
        table.page_ids[0, 1] = pool.layout.num_pages
        match = "page_ids"
    elif bad == "out_shape":
        kw["out"] = out_buf
        match = "out has shape"
    else:
        kw["backend"] = "cuda"
        match = "backend"
    pool_before = pool.data.clone()
    out_before, lse_before = out_buf.clone(), lse_buf.clone()
    with pytest.raises(FoldKvInputError, match=match):
        prefill(pool, query, table, q_lens, **kw)
    torch.cuda.synchronize()
    assert torch.equal(pool.data.view(torch.int16), pool_before.view(torch.int16))
    assert torch.equal(out_buf.view(torch.int16), out_before.view(torch.int16))
    assert torch.equal(lse_buf.view(torch.int32), lse_before.view(torch.int32))
