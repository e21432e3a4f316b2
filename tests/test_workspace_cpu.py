"""CPU tests of the decode workspace's plan (no kernels): the exact-count cut is the shortest whole-page cut, every
request's tokens are covered once by its groups' slots, padding chunks / groups / requests are what the kernels can
ignore, advance() lengthens each request by one, and every refusal comes before anything is written."""

from __future__ import annotations

import contextlib
import gc
import types

import numpy as np
import pytest
import torch

from conftest import Destructible, collecting_at_every_allocation, drop_into_garbage
from foldkv import GEMMA4_31B, FoldKvInputError, KvFormat, PagedKvLayout, PagedKvPool
from foldkv.kernels.plan import MAX_LEN, fixed_count_pieces
from foldkv.kernels.workspace import DecodeWorkspace, capture_graph, default_num_chunks

LAYOUT = PagedKvLayout(GEMMA4_31B, KvFormat.FOLDED, 64, 0)


def smallest_cap(pages: np.ndarray, chunks: int) -> int:
    return next(p for p in range(1, int(pages.max()) + 1) if int((-(-pages // p)).sum()) <= chunks)


@pytest.mark.parametrize("batch", [1, 2, 63, 65, 256])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fixed_count_pieces_is_the_shortest_cut(batch, seed):
    rng = np.random.default_rng(seed)
    pages = rng.choice([1, 2, 17, 165, 4096], size=batch) * rng.integers(1, 3, size=batch)
    pages = np.minimum(pages, 4096).astype(np.int64)
    for chunks in (batch, batch + 1, 33, 4 * batch + 1, 1056):
        if chunks < batch:
            continue
        pieces = fixed_count_pieces(pages, chunks)
        assert (pieces >= 1).all() and (pieces <= pages).all()
        if pages.sum() <= chunks:
            assert (pieces == pages).all()
            continue
        assert pieces.sum() == chunks
        assert (-(-pages // pieces)).max() == smallest_cap(pages, chunks), (pages.tolist(), chunks)


def coverage(ws: DecodeWorkspace) -> dict[int, list[tuple[int, int]]]:
    """Token ranges each request's merged slots cover, from the workspace's device plan."""
    cr, cs, cl = ws.chunk_req.tolist(), ws.chunk_start.tolist(), ws.chunk_len.tolist()
    gf, gc = ws.group_first.tolist(), ws.group_count.tolist()
    rgf, rgc = ws.req_group_first.tolist(), ws.req_group_count.tolist()
    got = {}
    for r in range(ws.max_batch):
        slots = [s for g in range(rgf[r], rgf[r] + rgc[r]) for s in range(gf[g], gf[g] + gc[g])]
        assert all(cr[s] == r for s in slots), f"request {r} merges another request's slot"
        got[r] = sorted((cs[s], cs[s] + cl[s]) for s in slots)
    return got


@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [262_144, 1, 10_602], list(range(1, 257)),
                                  [40_000] * 7 + [3]], ids=["one-token", "page-edges", "long-and-short", "256",
                                                            "uniform-and-short"])
def test_plan_covers_every_token_once_and_pads_safely(lens):
    ws = DecodeWorkspace(LAYOUT, max_batch=max(len(lens), 8), max_len=min(max(lens) + 1, MAX_LEN), device="cpu")
    lens = [min(n, MAX_LEN - 1) for n in lens]  # room for one advance()
    ws.plan(lens)
    cov = coverage(ws)
    for r, n in enumerate(lens):
        ranges = cov[r]
        assert ranges[0][0] == 0 and ranges[-1][1] == n, (r, ranges[:2], ranges[-1:])
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"request {r}: gap or overlap"
        assert all(s % 64 == 0 for s, _ in ranges), "chunks start on a page"
    for r in range(len(lens), ws.max_batch):
        assert cov[r] == [], "a padding request merges nothing"
    merged = {s for g, c in zip(ws.group_first.tolist(), ws.group_count.tolist()) for s in range(g, g + c)}
    pad = [c for c in range(ws.num_chunks) if c not in merged]
    assert len(pad) == ws.num_chunks - ws.chunks_used
    assert all(ws.chunk_req[c] == 0 and ws.chunk_len[c] == 1 for c in pad), "padding chunks read one token of request 0"
    counts = ws.group_count.tolist()
    assert all(f == ws.num_chunks for f, c in zip(ws.group_first.tolist(), counts) if c == 0), \
        "an empty group's first slot is the scratch slot"
    # the fused step's view (used within one wave): a real chunk names its request's first slot and chunk count,
    # a padding chunk belongs to no request (count 0: it writes only its own slot)
    req, first, count = ws.chunk_req.tolist(), ws.merge_first.tolist(), ws.merge_count.tolist()
    for c in range(ws.num_chunks):
        if c in pad:
            assert count[c] == 0
        else:
            assert req[first[c]:first[c] + count[c]] == [req[c]] * count[c] and first[c] <= c < first[c] + count[c]
    assert ws.fused == ws.one_wave and not ws.tail_counters.any()
    ws.advance()
    for r, n in enumerate(lens):
        assert coverage(ws)[r][-1][1] == n + 1
    assert ws.seq_lens == tuple(n + 1 for n in lens)


def test_default_chunk_count_is_whole_waves():
    assert default_num_chunks(1, 132, 4) == 33
    assert default_num_chunks(8, 132, 4) == 33  # one wave: the layout measured fastest at 8 requests
    assert default_num_chunks(9, 132, 4) == 66
    assert default_num_chunks(128, 132, 4) == 528
    assert default_num_chunks(256, 132, 4) % 33 == 0


@pytest.mark.parametrize("bad,match", [
    (lambda ws: ws.plan([5] * 9), "a batch of 9 requests"),
    (lambda ws: ws.plan([1001]), "seq_lens holds 1001"),
    (lambda ws: ws.plan([0, 5]), "seq_lens holds 0"),
    (lambda ws: ws.plan([[5]]), "1-D sequence of ints"),
    (lambda ws: ws.plan([5], torch.zeros(1, 17, dtype=torch.int32)), "holds 17 pages per request"),
    (lambda ws: ws.plan([300], torch.zeros(1, 2, dtype=torch.int32)), "the lengths need 5"),
    (lambda ws: ws.plan([5], torch.zeros(1, 4, dtype=torch.int64)), "page_ids has dtype"),
    (lambda ws: ws.plan([5, 6], torch.zeros(1, 4, dtype=torch.int32)), "page_ids must be"),
    (lambda ws: ws.step(PagedKvPool(PagedKvLayout(GEMMA4_31B, KvFormat.SPLIT, 64, 4), device="cpu")),
     "made for folded pages"),
    (lambda ws: ws.step(PagedKvPool(PagedKvLayout(GEMMA4_31B, KvFormat.FOLDED, 64, 4), device="cpu")),
     "decode runs on a CUDA device"),
], ids=["batch", "length", "zero-length", "2-D", "wide-table", "narrow-table", "table-dtype", "table-rows",
        "pool-format", "cpu"])
def test_refusals_write_nothing(bad, match):
    ws = DecodeWorkspace(LAYOUT, max_batch=8, max_len=1000, device="cpu")
    ws.plan([700, 3])
    plan, pages, lens = ws._plan_dev.clone(), ws.page_ids.clone(), ws.seq_lens
    with pytest.raises(FoldKvInputError, match=match):
        bad(ws)
    assert torch.equal(ws._plan_dev, plan) and torch.equal(ws.page_ids, pages) and ws.seq_lens == lens


@pytest.mark.parametrize("kw,match", [({"max_batch": 0}, "max_batch=0"), ({"max_batch": 257}, "max_batch=257"),
                                      ({"max_len": MAX_LEN + 1}, "max_len="),
                                      ({"num_chunks": 3}, "num_chunks=3 is below max_batch=4"),
                                      ({"merge_group": 0}, "merge_group=0")])
def test_workspace_shape_refusals(kw, match):
    args = {"max_batch": 4, "max_len": 1000, "device": "cpu", **kw}
    with pytest.raises(FoldKvInputError, match=match):
        DecodeWorkspace(LAYOUT, **args)


def test_advance_refusals():
    ws = DecodeWorkspace(LAYOUT, max_batch=2, max_len=10, device="cpu")
    with pytest.raises(FoldKvInputError, match="before plan"):
        ws.advance()
    ws.plan([10])
    with pytest.raises(FoldKvInputError, match="past max_len=10"):
        ws.advance()


@pytest.mark.parametrize("lens", [[10_602], [40_002], [131_072], [1, 63, 64, 65], [9_001, 47_000, 1_024, 30_000, 12_345,
                                                                                   2_000, 48_000, 5_555]])
def test_one_wave_workspace_plans_as_the_eager_plan(lens):
    """Within one wave the workspace's real chunks are the eager plan's one-wave layout (the rest is padding)."""
    from foldkv.kernels.plan import plan_decode

    ws = DecodeWorkspace(LAYOUT, max_batch=8, max_len=max(lens), device="cpu", num_sms=132)
    assert ws.one_wave and ws.num_chunks == 33
    ws.plan(lens)
    eager = plan_decode(LAYOUT, lens, device="cpu", num_sms=132)
    got = list(zip(ws.chunk_req.tolist(), ws.chunk_start.tolist(), ws.chunk_len.tolist()))[:ws.chunks_used]
    assert got == eager.chunks
    used = ws.chunks_used  # and the same tail merge (the fused step of both)
    assert ws.fused and eager.fused
    assert ws.merge_first.tolist()[:used] == eager.merge_first.tolist()
    assert ws.merge_count.tolist()[:used] == eager.merge_count.tolist()


@pytest.mark.parametrize("capture", ["capture_graph", "torch_cuda_graph"])
def test_capture_graph_pauses_the_collector(monkeypatch, capture):
    """No graph that becomes garbage inside `capture_graph` is destroyed before the capture ends (the collector is
    paused; torch.cuda.graph itself stands in as a no-op here); the red twin, the bare `torch.cuda.graph`, destroys it
    mid-capture. Both collect it afterwards. The GPU half (a destroyed graph invalidates the capture) is
    tests/test_workspace_gpu.py::test_capture_outlives_a_garbage_graph."""
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: contextlib.nullcontext())
    destroyed: list = []
    held = [Destructible(destroyed)]
    enabled = gc.isenabled()
    with collecting_at_every_allocation():
        with (capture_graph if capture == "capture_graph" else torch.cuda.graph)(None):
            drop_into_garbage(held)
            during = len(destroyed)
        assert gc.isenabled() == enabled  # the collector's state is restored
    gc.collect()
    assert len(destroyed) == 1
    assert during == (0 if capture == "capture_graph" else 1)


@pytest.mark.parametrize("capture", ["capture_graph", "torch_cuda_graph"])
def test_a_failed_capture_ends_the_generators_capture(monkeypatch, capture):
    """A capture whose end raises (an invalidated capture: torch's capture_end raises before the CUDA generators'
    epilogue) is followed by one capture that ends cleanly, and its error is the one raised; red twin: the bare
    `torch.cuda.graph` leaves it there (on a GPU every later random op then raises: the GPU half is
    tests/test_workspace_gpu.py::test_capture_outlives_a_garbage_graph and the refusal tests after it)."""
    captures: list[str] = []

    @contextlib.contextmanager
    def graph(g, stream=None):
        captures.append("begin")
        yield
        if len(captures) == 1:
            raise RuntimeError("operation failed due to a previous error during capture")
        captures.append("ended")

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: types.SimpleNamespace(device="cpu"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    with pytest.raises(RuntimeError, match="previous error during capture"):
        with (capture_graph if capture == "capture_graph" else torch.cuda.graph)(None):
            pass
    assert captures == (["begin", "begin", "ended"] if capture == "capture_graph" else ["begin"])
