"""GPU gates of split-KV decode (both formats) through `foldkv.lab.gates` (the notebook's gates: float64 reference, hostile
pools with NaN/Inf pages and poisoned page-table padding, NaN-poisoned outputs with rows past the plan that must stay
untouched): lengths 1 / 63 / 64 / 65, a chunk boundary +-1, 10602, 163336, ragged batches and plans with many merge
groups, the other operand order; a one-wave plan's fused step and its three launches; the fused step's counters; a
rerun is bit-identical; refusals leave pool and outputs untouched; a CUDA-graph replay of a step equals the eager step
bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

import foldkv
from foldkv import FoldKvInputError, KvFormat, PagedKvLayout
from foldkv.kernels.decode import decode, plan_decode
from foldkv.kernels.macros import TAIL_STEP
from foldkv.kernels.plan import MAX_BATCH
from foldkv.kernels.workspace import capture_graph
from foldkv.lab import gates

pytestmark = pytest.mark.gpu

GEOM = foldkv.GEMMA4_31B
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]
GATE_LOG = os.environ.get("FOLDKV_DECODE_GATE_LOG")  # one JSON line per gated case, for the notes


def make_case(fmt: KvFormat, lens: list[int], seed: int, device: torch.device, **plan_kw) -> gates.GateInputs:
    return gates.make_inputs(gates.Case(f"{len(lens)}x{max(lens)}", tuple(lens), **plan_kw), fmt, device, seed)


def decode_with(kernels: dict):
    """A gates arm: the library's decode with `kernels=` replacing some of its kernels (the public experiment hook)."""
    def launch(inputs: gates.GateInputs, out: torch.Tensor, lse: torch.Tensor):
        plan = plan_decode(inputs.pool.layout, inputs.case.seq_lens, device=inputs.pool.device,
                           chunk_tokens=inputs.case.chunk_tokens, merge_group=inputs.case.merge_group)
        return decode(inputs.pool, inputs.query, inputs.table, plan=plan, out=out, lse=lse, kernels=kernels)

    return launch


def gate(fmt, lens, seed, device, backend="jit", kernels=None, fused=None, **plan_kw):
    """`foldkv.lab.gates.run_case` on one decode case, then the same call again: a moving result is a race."""
    inputs = make_case(fmt, lens, seed, device, **plan_kw)
    arm = gates.decode_arm(backend, fused=fused) if kernels is None else decode_with(kernels)
    res = gates.run_case(inputs, arm)
    row = gates.summary_row(inputs.case, fmt, (backend if kernels is None else "+".join(kernels))
                            + {None: "", True: "+fused", False: "+three_launches"}[fused], res)
    if GATE_LOG:
        with open(GATE_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert res["passed"], row
    out, lse = res["outputs"]
    again = gates.run_case(inputs, arm)["outputs"]
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


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


@pytest.mark.parametrize("lens", [[10602], [54, 97, 16384, 1, 10602, 64, 1025, 263]], ids=["single", "ragged8"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "three_launches"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_both_steps_of_a_one_wave_plan(cuda_device, fmt, fused, lens):
    """A one-wave plan runs fused by default; asked for, either step (one launch, or the partial and two merges)
    passes the gate on the same plan."""
    assert plan_decode(PagedKvLayout(GEOM, fmt, 64, 0), lens, device=cuda_device).fused
    gate(fmt, lens, seed=13, device=cuda_device, fused=fused)


@pytest.mark.parametrize("start", [0, -TAIL_STEP], ids=["zero", "wraps"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_step_leaves_its_counters_ready(cuda_device, fmt, start):
    """After each fused step every request-head of more than one chunk has added exactly TAIL_STEP to its counter
    (whatever its chunk count; a single chunk writes the output itself: no hand-off), so the next step starts from a
    multiple of it, also across 2^32 (`wraps`: counters one step below it, as int32); each step passes the gate."""
    lens = [10602, 97, 1, 40002]
    inputs = make_case(fmt, lens, 17, cuda_device)
    plan = plan_decode(inputs.pool.layout, lens, device=cuda_device)
    assert plan.fused
    chunks = torch.tensor([sum(r == q for q, _, _ in plan.chunks) for r in range(len(lens))])
    assert chunks[2] == 1 and (chunks[[0, 3]] > 1).all()
    plan.tail_counters.fill_(start)

    def on_the_plan(inputs, out, lse):
        return decode(inputs.pool, inputs.query, inputs.table, plan=plan, out=out, lse=lse)

    for step in (1, 2, 3):
        res = gates.run_case(inputs, on_the_plan)
        assert res["passed"], gates.summary_row(inputs.case, fmt, f"fused step {step}", res)
        moved = (chunks > 1).long()[:, None].expand(-1, 4) * step * TAIL_STEP
        expected = ((start + moved + 2**31) % 2**32 - 2**31).int()  # int32 arithmetic modulo 2^32
        assert torch.equal(plan.tail_counters.cpu(), expected), plan.tail_counters.cpu()


@pytest.mark.parametrize("version", ["decode_partial_head_major", "decode_partial_query_all_threads"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bench_versions_compute_the_same_function(cuda_device, fmt, version):
    """The partials that lost (bench/versions: the head-major operand order, the query loaded by all threads), each
    with the library's merges through the launcher's public `kernels=` hook, pass the same gate as the library's
    partial: the harness times a correct kernel."""
    from conftest import bench_version

    from foldkv.kernels.decode import partial_kernel_name

    partial = bench_version(version).build(GEOM, fmt)
    gate(fmt, [1, 65, 1025, 10602, 64], seed=13, device=cuda_device, kernels={partial_kernel_name(fmt): partial},
         chunk_tokens=512, merge_group=3)


@pytest.mark.parametrize("partial", ["split", "folded", "folded_fp8"])
def test_batched_softmax_reductions_give_the_same_bits(cuda_device, partial):
    """The softmax's cross-warp reductions over all of a thread's queries at once (`reduce_batch`, one barrier chain
    for them) reduce the same values in the same order as one query at a time: the outputs are bitwise equal, on a
    batch whose requests end mid-tile and mid-page. Red twin: over a query with one element moved by one bf16 step,
    the float32 LSE differs (the comparison sees a change that small; the bf16 output may round it away)."""
    from foldkv.fp8 import FP8_DTYPE
    from foldkv.kernels.decode import partial_kernel_name
    from foldkv.kernels.decode_partial import build_decode_partial, build_decode_partial_fp8

    fp8 = partial == "folded_fp8"
    fmt = KvFormat.FOLDED if fp8 else KvFormat.parse(partial)
    build = build_decode_partial_fp8 if fp8 else build_decode_partial
    per_thread = 2 if fp8 else 4  # queries a consumer thread holds (two consumer warpgroups for FP8)
    inputs = gates.make_inputs(gates.Case("bits", (1, 65, 1000, 10602)), fmt, cuda_device, 17,
                               dtype=FP8_DTYPE if fp8 else torch.bfloat16)
    plan = plan_decode(inputs.pool.layout, list(inputs.case.seq_lens), device=cuda_device, chunk_tokens=512)

    def run(reduce_batch, query):
        kernels = {partial_kernel_name(fmt, fp8, "exact"): build(GEOM, fmt, reduce_batch=reduce_batch)}
        return decode(inputs.pool, query, inputs.table, plan=plan, kernels=kernels, fp8_math="exact" if fp8 else None)

    one = run(1, inputs.query)
    batched = run(per_thread, inputs.query)
    assert torch.isfinite(one[0]).all() and torch.equal(batched[0], one[0]) and torch.equal(batched[1], one[1])
    nudged = inputs.query.clone()
    nudged.view(torch.int16)[1, 3, 5] += 1  # one bf16 step on one element of request 1's query
    assert not torch.equal(run(per_thread, nudged)[1], one[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_replay_matches_eager(cuda_device, fmt):
    lens = [10602, 97]
    inputs = make_case(fmt, lens, 3, cuda_device)
    pool, query, table = inputs.pool, inputs.query, inputs.table
    plan = plan_decode(pool.layout, lens, device=cuda_device)
    eager_out, eager_lse = decode(pool, query, table, plan=plan)  # checked once, compiles the kernels
    out, lse = gates.poisoned_outputs(len(lens), GEOM, cuda_device, pad_rows=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), capture_graph(graph, stream=stream):
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
    inputs = make_case(fmt, lens, 2, cuda_device)
    pool, query, table = inputs.pool, inputs.query, inputs.table
    out_buf, lse_buf = gates.poisoned_outputs(len(lens), GEOM, cuda_device, pad_rows=1)
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
        n = MAX_BATCH + 1
        table = foldkv.BlockTable(table.page_ids.repeat(n, 1)[:n].contiguous(), table.seq_lens.repeat(n)[:n])
        match = f"batch of {n}"
    pool_before = pool.data.clone()
    out_before, lse_before = out_buf.clone(), lse_buf.clone()
    with pytest.raises(FoldKvInputError, match=match):
        decode(pool, query, table, out=out_buf[:-1], lse=lse_buf[:-1], **kw)
    torch.cuda.synchronize()
    assert torch.equal(pool.data.view(torch.int16), pool_before.view(torch.int16))
    assert torch.equal(out_buf.view(torch.int16), out_before.view(torch.int16))
    assert torch.equal(lse_buf.view(torch.int32), lse_before.view(torch.int32))


@pytest.mark.parametrize("lens", [[10602], [40002], [1, 65, 1025, 10602, 64]], ids=["10602", "40002", "ragged5"])
@pytest.mark.parametrize("merge", ["unrolled", "compact", "compact_spin", "compact_spin_warp"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_ll_version_gates_and_leaves_its_words_empty(cuda_device, fmt, merge, lens):
    """bench/versions/decode_fused_ll.py (the fused step's tail as self-validating words; its merge unrolled, or
    decode_fused_ll_compact.py's with each of its waits) through the library's `kernels=` hook passes the gate twice,
    bit for bit, and leaves every word empty after each launch (the next launch's readers must not see this one's
    words)."""
    from conftest import bench_version

    version = bench_version("decode_fused_ll")
    wait = merge.removeprefix("compact").removeprefix("_") or None
    step = (version.LLStep(GEOM, fmt) if merge == "unrolled"
            else bench_version("decode_fused_ll_compact").CompactLLStep(GEOM, fmt, wait))
    gate(fmt, lens, seed=13, device=cuda_device, kernels={f"decode_fused_{fmt.value}": step})
    assert step.words and all(version.all_empty(w) for w in step.words.values())
