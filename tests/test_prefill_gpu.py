"""GPU gates of the paged causal prefill (both formats over bf16 pools, and folded over an FP8 pool) through
`foldkv.lab.gates` (the notebook's gates: float64 reference over the pool as stored - an FP8 pool's rows dequantized -,
hostile pools with NaN/Inf pages and poisoned page-table padding, NaN-poisoned outputs with rows past the plan that
must stay untouched): a chunk starting mid-page, a one-token chunk, a whole short prompt, a page-aligned chunk, a
ragged batch and an 8,192-token chunk ending at 163,336; a rerun is bit-identical; refusals write nothing. An FP8 pool
is read both ways the launcher offers (`fp8_rows`): "gather" (the page gather, held bit for bit to its torch
definition, then the bf16 prefill, held to the float64 reference over those bf16 rows with the bf16 bound) and
"in_kernel" (the bf16 bound plus the derived term for P rounded to bf16 after its scale, `gates.compare(p_scaled=True)`);
each has a red twin that runs with two tokens' scales swapped and must fail. The last row of a prefill against a
decode of the same token is `tests/test_gates_gpu.py`'s."""

from __future__ import annotations

import json
import os

import pytest
import torch

import foldkv
from foldkv import FoldKvInputError, KvFormat
from foldkv.fp8 import FP8_DTYPE
from foldkv.kernels.prefill import prefill
from foldkv.lab import gates

pytestmark = pytest.mark.gpu

GEOM = foldkv.GEMMA4_31B
POOLS = {  # pool kind: (format, stored dtype, how the prefill reads an FP8 pool)
    "split": (KvFormat.SPLIT, torch.bfloat16, "gather"),
    "folded": (KvFormat.FOLDED, torch.bfloat16, "gather"),
    "folded_fp8": (KvFormat.FOLDED, FP8_DTYPE, "gather"),
    "folded_fp8_in_kernel": (KvFormat.FOLDED, FP8_DTYPE, "in_kernel"),
}
GATE_LOG = os.environ.get("FOLDKV_PREFILL_GATE_LOG")  # one JSON line per gated case, for the notes

CASES = {  # name: (seq_lens, q_lens)
    "mid_page_chunk": ((1000,), (97,)),  # the chunk starts at 903 = 14 pages + 7
    "one_token": ((4099,), (1,)),
    "whole_prompt_54": ((54,), (54,)),  # one partial page: 10 NaN rows after the sequence
    "page_aligned_chunk": ((4096,), (64,)),
    "ragged_batch": ((97, 2113, 300, 1, 16384), (97, 54, 1, 1, 333)),
    "chunk_8192_at_163336": ((163_336,), (8192,)),
}


def make_case(fmt: KvFormat, name: str, seed: int, device: torch.device,
              dtype: torch.dtype = torch.bfloat16) -> gates.GateInputs:
    seq_lens, q_lens = CASES[name]
    return gates.make_inputs(gates.Case(name, seq_lens, q_lens=q_lens), fmt, device, seed, dtype=dtype)


def _scales(pool) -> torch.Tensor | None:
    return None if pool.scales is None else pool.scales.clone()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pool_kind", list(POOLS))
def test_prefill_matches_reference(cuda_device, pool_kind, case):
    fmt, dtype, fp8_rows = POOLS[pool_kind]
    inputs = make_case(fmt, case, seed=len(case) * 31 + len(CASES[case][0]), device=cuda_device, dtype=dtype)
    scales_before = _scales(inputs.pool)
    arm = gates.prefill_arm(fp8_rows=fp8_rows)  # run_case picks the rows its reference reads from arm.fp8_rows
    res = gates.run_case(inputs, arm)
    row = gates.summary_row(inputs.case, fmt, "jit" if dtype == torch.bfloat16 else f"jit-fp8-{fp8_rows}", res)
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert res["passed"], row
    if scales_before is not None:
        assert torch.equal(inputs.pool.scales.view(torch.int32), scales_before.view(torch.int32)), "scales changed"
    # same inputs again: a moving result is a race
    out, lse = res["outputs"]
    again = gates.run_case(inputs, arm)["outputs"]
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


def _nan_aware_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits wherever either is a number; NaN in the same places (the NaN payload of a conversion is not fixed:
    torch writes 0x7FC0, the CUDA intrinsic 0x7FFF)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    ia, ib = a.view(torch.int16), b.view(torch.int16)
    return bool(torch.equal(na, nb)) and bool(torch.equal(ia[~na], ib[~nb]))


@pytest.mark.parametrize("case", ["ragged_batch", "chunk_8192_at_163336"])
def test_page_gather_equals_its_torch_definition(cuda_device, case):
    """The page gather over a hostile FP8 pool (NaN rows and scales, Inf scales on unused pages, poisoned padding
    entries): every converted page bit for bit `foldkv.fp8.dequantize_rows_bf16` of its page, NaN where it is, the FP8
    pool untouched. Red twin: one page's scales changed before the kernel runs (the torch rows made from the pool as
    it was) must differ."""
    from foldkv.lab.page_gather import bf16_pages, bf16_pages_reference

    inputs = make_case(KvFormat.FOLDED, case, seed=7, device=cuda_device, dtype=FP8_DTYPE)
    pool, table = inputs.pool, inputs.table
    before = pool.data.view(torch.uint8).clone(), pool.scales.clone()
    want, want_table = bf16_pages_reference(pool, table)
    got, got_table = bf16_pages(pool, table)
    torch.cuda.synchronize()
    assert torch.equal(got_table.page_ids, want_table.page_ids) and torch.equal(got_table.seq_lens, table.seq_lens)
    assert _nan_aware_equal(got.data, want.data)
    assert torch.equal(pool.data.view(torch.uint8), before[0]) and torch.equal(pool.scales.view(torch.int32),
                                                                             before[1].view(torch.int32))
    page = int(table.page_ids[0, 0])
    pool.scales[page] *= 1.5  # red twin
    try:
        bad, _ = bf16_pages(pool, table)
        torch.cuda.synchronize()
        assert not _nan_aware_equal(bad.data, want.data)
    finally:
        pool.scales[page] /= 1.5


@pytest.mark.parametrize("fp8_rows", ["gather", "in_kernel"])
def test_fp8_prefill_with_two_scales_swapped_fails(cuda_device, fp8_rows):
    """Red twin of the FP8 gate: the kernel reads the pool with token 0's scale swapped (in every KV head) with the
    scale of the token that differs from it most, the reference reads the pool as written. Query 0 of the whole
    prompt sees token 0 alone (its output is token 0's value row), so the swap moves it by the scales' ratio."""
    inputs = make_case(KvFormat.FOLDED, "whole_prompt_54", seed=5, device=cuda_device, dtype=FP8_DTYPE)
    pool, table = inputs.pool, inputs.table
    n = int(table.seq_lens[0])
    page0 = int(table.page_ids[0, 0])
    slots = [(int(table.page_ids[0, t // 64]), t % 64) for t in range(n)]
    scales = torch.stack([pool.scales[p, :, o] for p, o in slots])  # [n, Hkv]
    other = (scales[1:] / scales[0]).log().abs().argmax(dim=0) + 1  # [Hkv] the token farthest from token 0
    ratio = scales[other, torch.arange(scales.shape[1])] / scales[0]
    assert bool(((ratio - 1).abs() > 0.1).all()), f"scales too close to make a red twin: {ratio.tolist()}"

    def swap():
        for h, t in enumerate(other.tolist()):
            p, o = slots[t]
            a, b = pool.scales[page0, h, 0].clone(), pool.scales[p, h, o].clone()
            pool.scales[page0, h, 0], pool.scales[p, h, o] = b, a

    def swapped_launch(inp: gates.GateInputs, out: torch.Tensor, lse: torch.Tensor):
        swap()
        try:
            res = prefill(inp.pool, inp.query, inp.table, inp.q_lens, out=out, lse=lse, fp8_rows=fp8_rows)
            torch.cuda.synchronize()
            return res
        finally:
            swap()  # back: the reference reads the pool as written

    swapped_launch.fp8_rows = fp8_rows
    res = gates.run_case(inputs, swapped_launch)
    assert res["all_written"] and not res["elementwise_ok"] and not res["passed"], \
        gates.summary_row(inputs.case, KvFormat.FOLDED, f"jit-fp8-{fp8_rows}-swapped-scales", res)
    assert gates.run_case(inputs, gates.prefill_arm(fp8_rows=fp8_rows))["passed"]  # unswapped, they pass


FOLDED_VERSIONS = ("prefill_shared_tiles", "prefill_folded_two_stages", "prefill_folded_two_stages_batched",
                   "prefill_folded_lazy_rescale", "prefill_folded_seesaw_async")  # bench/versions/ for prefill_folded


@pytest.mark.parametrize("case", ["mid_page_chunk", "ragged_batch"])
@pytest.mark.parametrize("version", FOLDED_VERSIONS)
def test_bench_version_matches_reference(cuda_device, version, case):
    """A folded version in bench/versions/ through the launcher's public `kernels=` hook: the same gate as the
    library's prefill, so the harness and bench/prefill_kernel_probe.py time a correct kernel."""
    from conftest import bench_version

    from foldkv.kernels.resolve import kernel_params

    kernel = bench_version(version).build(GEOM, **kernel_params("prefill_folded"))

    def launch(inputs: gates.GateInputs, out: torch.Tensor, lse: torch.Tensor):
        return prefill(inputs.pool, inputs.query, inputs.table, inputs.q_lens, out=out, lse=lse,
                       kernels={"prefill_folded": kernel})

    inputs = make_case(KvFormat.FOLDED, case, seed=3, device=cuda_device)
    res = gates.run_case(inputs, launch)
    assert res["passed"], gates.summary_row(inputs.case, KvFormat.FOLDED, version, res)


@pytest.mark.parametrize("pool_kind", ["folded", "folded_fp8"])
def test_prefill_queues_its_launches_without_waiting_for_the_stream(cuda_device, pool_kind):
    """With the block table and q_lens on the host, `prefill` plans everything before its first launch and copies the
    plan asynchronously: it returns while a 0.1-0.2 s sleep queued before it is still running (the FP8 route's gather
    and prefill both queued behind it), and its output is then the same as an unqueued call's. Red twin: the same
    call with the table on the device (its checks read it back, waiting for the stream) returns after the sleep."""
    fmt, dtype, fp8_rows = POOLS[pool_kind]
    inputs = make_case(fmt, "ragged_batch", seed=5, device=cuda_device, dtype=dtype)
    host_table, q_lens = inputs.table.to("cpu"), inputs.q_lens.cpu()
    want = prefill(inputs.pool, inputs.query, host_table, q_lens, fp8_rows=fp8_rows)  # builds the kernels
    torch.cuda.synchronize()

    def queued_behind_a_sleep(table):
        done = torch.cuda.Event()
        torch.cuda._sleep(300_000_000)  # ~0.15 s at the H200's clock
        done.record()
        got = prefill(inputs.pool, inputs.query, table, q_lens, fp8_rows=fp8_rows)
        returned_early = not done.query()
        torch.cuda.synchronize()
        return returned_early, got

    early, got = queued_behind_a_sleep(host_table)
    assert early, "prefill waited for the stream"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    early, _ = queued_behind_a_sleep(inputs.table)  # red twin
    assert not early, "the check cannot see a wait: a device table's read-back must wait for the stream"


@pytest.mark.parametrize("bad", ["q_len_past_seq", "query_rows", "query_dtype", "page_id", "out_shape", "backend",
                                 "kv_dtype"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_refusals_write_nothing(cuda_device, bad, dtype):
    fmt = KvFormat.FOLDED
    inputs = gates.make_inputs(gates.Case("refuse", (130, 65), q_lens=(10, 65)), fmt, cuda_device, seed=2,
                               dtype=dtype)
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
    elif bad == "kv_dtype":  # a pool of one dtype asked to run as the other
        kw["kv_dtype"] = FP8_DTYPE if dtype == torch.bfloat16 else torch.bfloat16
        match = "prefill was asked of a pool that stores"
    else:
        kw["backend"] = "cuda"
        match = "backend"
    pool_before, scales_before = pool.data.clone(), _scales(pool)
    out_before, lse_before = out_buf.clone(), lse_buf.clone()
    with pytest.raises(FoldKvInputError, match=match):
        prefill(pool, query, table, q_lens, **kw)
    torch.cuda.synchronize()
    assert torch.equal(pool.data.view(torch.int16), pool_before.view(torch.int16))
    assert scales_before is None or torch.equal(pool.scales.view(torch.int32), scales_before.view(torch.int32))
    assert torch.equal(out_buf.view(torch.int16), out_before.view(torch.int16))
    assert torch.equal(lse_buf.view(torch.int32), lse_before.view(torch.int32))
