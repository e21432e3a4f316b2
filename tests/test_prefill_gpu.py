"""GPU gates of the paged causal prefill (both formats) through `foldkv.lab.gates` (the notebook's gates: float64
reference, hostile pools with NaN/Inf pages and poisoned page-table padding, NaN-poisoned outputs with rows past the
plan that must stay untouched): a chunk starting mid-page, a one-token chunk, a whole short prompt, a page-aligned
chunk, a ragged batch and an 8,192-token chunk ending at 163,336; a rerun is bit-identical; refusals write nothing.
The last row of a prefill against a decode of the same token is `tests/test_gates_gpu.py`'s."""

from __future__ import annotations

import json
import os

import pytest
import torch

import foldkv
from foldkv import FoldKvInputError, KvFormat
from foldkv.kernels.prefill import prefill
from foldkv.lab import gates

pytestmark = pytest.mark.gpu

GEOM = foldkv.GEMMA4_31B
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]
GATE_LOG = os.environ.get("FOLDKV_PREFILL_GATE_LOG")  # one JSON line per gated case, for the notes

CASES = {  # name: (seq_lens, q_lens)
    "mid_page_chunk": ((1000,), (97,)),  # the chunk starts at 903 = 14 pages + 7
    "one_token": ((4099,), (1,)),
    "whole_prompt_54": ((54,), (54,)),  # one partial page: 10 NaN rows after the sequence
    "page_aligned_chunk": ((4096,), (64,)),
    "ragged_batch": ((97, 2113, 300, 1, 16384), (97, 54, 1, 1, 333)),
    "chunk_8192_at_163336": ((163_336,), (8192,)),
}


def make_case(fmt: KvFormat, name: str, seed: int, device: torch.device) -> gates.GateInputs:
    seq_lens, q_lens = CASES[name]
    return gates.make_inputs(gates.Case(name, seq_lens, q_lens=q_lens), fmt, device, seed)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_matches_reference(cuda_device, fmt, case):
    inputs = make_case(fmt, case, seed=len(case) * 31 + len(CASES[case][0]), device=cuda_device)
    res = gates.run_case(inputs, gates.prefill_arm())
    row = gates.summary_row(inputs.case, fmt, "jit", res)
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert res["passed"], row
    # same inputs again: a moving result is a race
    out, lse = res["outputs"]
    again = gates.run_case(inputs, gates.prefill_arm())["outputs"]
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("case", ["mid_page_chunk", "ragged_batch"])
def test_bench_version_shared_tiles_matches_reference(cuda_device, case):
    """bench/versions/prefill_shared_tiles.py (the folded tiling that lost) through the launcher's public `kernels=`
    hook: the same gate as the library's prefill, so the harness times a correct kernel."""
    from conftest import bench_version

    from foldkv.kernels.resolve import kernel_params

    shared = bench_version("prefill_shared_tiles").build(GEOM, **kernel_params("prefill_folded"))

    def launch(inputs: gates.GateInputs, out: torch.Tensor, lse: torch.Tensor):
        return prefill(inputs.pool, inputs.query, inputs.table, inputs.q_lens, out=out, lse=lse,
                       kernels={"prefill_folded": shared})

    inputs = make_case(KvFormat.FOLDED, case, seed=3, device=cuda_device)
    res = gates.run_case(inputs, launch)
    assert res["passed"], gates.summary_row(inputs.case, KvFormat.FOLDED, "shared-tiles", res)


@pytest.mark.parametrize("bad", ["q_len_past_seq", "query_rows", "query_dtype", "page_id", "out_shape", "backend"])
def test_refusals_write_nothing(cuda_device, bad):
    fmt = KvFormat.FOLDED
    inputs = gates.make_inputs(gates.Case("refuse", (130, 65), q_lens=(10, 65)), fmt, cuda_device, seed=2)
    pool, query, table = inputs.pool, inputs.query, inputs.table
    q_lens = inputs.q_lens.to(cuda_device)
    out_buf, lse_buf = gates.poisoned_outputs(query.shape[0], GEOM, cuda_device, pad_rows=1)
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
