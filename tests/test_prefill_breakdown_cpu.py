"""The prefill chunk's breakdown (`foldkv.lab.prefill_breakdown`) and the ranges that feed it
(`foldkv.lab.prefill_scopes`), on the CPU.

Synthetic traces: two streams overlapping (the overlap counted once, the idle time the host gaps), kernels clipped to
the window, nested ranges (the innermost wins), names outside every range, unknown names listed; the parts sum to the
window exactly. Red twins: a bookkeeping that adds durations (double-counting the overlap) and one that drops unknown
names are caught by the same checks.
A CPU profile of the tiny synthetic Gemma 4's generate() on a FoldKvCache (CPU ops standing in for kernels) with
`scoped_attention` installed: every op under a sliding layer's attention counts as sliding attention, the pool
attention as global attention, the rest of foldkv's attend as prep, the Linear GEMMs as gemm; the wrapping leaves
the attention registry and the cache exactly as they were, after an exception too.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from conftest import left_padded_batch, require_module
from foldkv.lab import prefill_breakdown as pb
from foldkv.lab import prefill_scopes as ps

K = pb.KernelEvent
R = pb.HostRange


def two_streams() -> list:
    return [K("sm90_xmma_gemm_bf16", 0, 10, stream=7), K("vectorized_elementwise_kernel", 5, 10, stream=8),
            K("fmha_cutlassF_bf16", 20, 5, stream=7)]


def union_us(kernels, lo, hi) -> float:
    """Time inside [lo, hi] at least one kernel runs (the independent answer for the gaps)."""
    covered, end = 0.0, lo
    for k in sorted(kernels, key=lambda k: k.start_us):
        s, e = max(k.start_us, end), min(k.start_us + k.dur_us, hi)
        if e > s:
            covered += e - s
            end = e
    return covered


def check(b: pb.Breakdown, kernels, window, ranges=()) -> list[str]:
    """What must hold for any breakdown of `kernels` over `window`: the parts sum to the wall, the gaps are the idle
    time, every kernel is counted, every unknown name is listed."""
    problems = []
    if sum(b.parts.values()) != b.wall_ns:
        problems.append(f"parts sum to {sum(b.parts.values())} ns, the wall is {b.wall_ns} ns")
    idle = round((window[1] - window[0] - union_us(kernels, *window)) * 1000)
    if b.parts[pb.GAPS] != idle:
        problems.append(f"host gaps {b.parts[pb.GAPS]} ns, the GPU was idle {idle} ns")
    if sum(b.kernels.values()) != len(kernels):
        problems.append(f"{sum(b.kernels.values())} kernels counted of {len(kernels)}")
    unknown = {k.name for k in kernels if not pb.component_of(k, list(ranges))[1]}
    if set(b.unknown) != unknown:
        problems.append(f"unknown {sorted(b.unknown)} != {sorted(unknown)}")
    return problems


def test_overlap_counted_once_gaps_are_idle_time():
    kernels = two_streams()
    b = pb.breakdown(kernels, window=(0, 30))
    assert check(b, kernels, (0, 30)) == []
    assert b.parts[pb.GAPS] == 10_000  # [15, 20) and [25, 30)
    assert b.parts[pb.GEMM] == 7_500 and b.parts[pb.GLUE] == 7_500  # the shared [5, 10) split in two
    assert b.parts[pb.SLIDING] == 5_000  # "fmha...cutlass": attention before GEMM
    assert b.seconds()[pb.GAPS] == pytest.approx(1e-5)


def test_red_twin_adding_durations_is_caught():
    kernels = two_streams()

    def adding(kernels, window):  # durations summed, the gaps what is left of the wall
        b = pb.breakdown(kernels, window=window)
        parts = {c: Fraction(0) for c in pb.COMPONENTS}
        for k in kernels:
            parts[pb.component_by_name(k.name)[0]] += round(k.dur_us * 1000)
        parts[pb.GAPS] = b.wall_ns - sum(parts.values())
        return pb.Breakdown(b.window_ns, parts, b.kernels, b.unknown)

    assert any("host gaps" in p for p in check(adding(kernels, (0, 30)), kernels, (0, 30)))


def test_unknown_names_listed_and_counted():
    kernels = [K("mystery_kernel", 0, 4), K("nvjet_tst_128x256", 4, 6), K("mystery_kernel", 12, 2)]
    b = pb.breakdown(kernels, window=(0, 16))
    assert check(b, kernels, (0, 16)) == []
    assert b.unknown == {"mystery_kernel": 6_000}
    assert b.parts[pb.GLUE] == 6_000 and b.parts[pb.GEMM] == 6_000 and b.parts[pb.GAPS] == 4_000

    # red twin: a bookkeeping that drops what it does not know
    known = [k for k in kernels if pb.component_by_name(k.name)[1]]
    dropped = pb.breakdown(known, window=(0, 16))
    assert check(dropped, kernels, (0, 16)) != []


def test_innermost_scope_wins_and_threads_are_kept_apart():
    ranges = [R(ps.PREP, 0, 100, thread=1), R(ps.GLOBAL_ATTENTION, 40, 60, thread=1), R(ps.SLIDING_ATTENTION, 0, 100,
                                                                                      thread=2)]
    kernels = [K("vectorized_elementwise_kernel", 10, 5, launched_at=5, thread=1),  # prep
               K("main_kernel", 20, 30, launched_at=45, thread=1),  # global, inside prep
               K("indexSelectLargeIndex", 60, 5, launched_at=70, thread=1),  # prep again
               K("sm90_xmma_gemm", 70, 5, launched_at=120, thread=1),  # outside: by name
               K("elementwise_kernel", 80, 5, launched_at=50, thread=3),  # another thread: by name
               K("odd_kernel", 90, 5, launched_at=50, thread=2)]  # the sliding range's thread
    b = pb.breakdown(kernels, ranges, window=(0, 100))
    assert check(b, kernels, (0, 100), ranges) == []
    assert b.kernels == {pb.GEMM: 1, pb.GLOBAL: 1, pb.SLIDING: 1, pb.PREP_COMPONENT: 2, pb.GLUE: 1}
    assert b.parts[pb.GLOBAL] == 30_000 and b.parts[pb.PREP_COMPONENT] == 10_000 and b.parts[pb.SLIDING] == 5_000
    assert b.unknown == {}  # odd_kernel was placed by its range


def test_clipped_to_the_window_and_exact_with_odd_shares():
    kernels = [K("gemm_a", -5, 10, stream=1), K("gemm_b", 0, 7, stream=2), K("softmax_c", 3, 100, stream=3)]
    b = pb.breakdown(kernels, window=(0, 10))
    assert check(b, kernels, (0, 10)) == []
    assert b.parts[pb.GAPS] == 0 and b.wall_ns == 10_000
    assert b.parts[pb.GEMM] + b.parts[pb.GLUE] == 10_000
    assert b.parts[pb.GLUE].denominator in (1, 3)  # [3, 5) shared by three: exact thirds
    default = pb.breakdown(kernels)
    assert default.window_ns == (-5_000, 103_000) and check(default, kernels, (-5, 103)) == []


@pytest.mark.parametrize("bad", [dict(kernels=[K("k", 0, -1)]), dict(kernels=[K("k", 0, 1)], window=(5, 1)),
                                 dict(kernels=[K("k", 0, 1)], ranges=[R("prep", 0, 1)]), dict(kernels=[])])
def test_bad_input_refused(bad):
    with pytest.raises(ValueError):
        pb.breakdown(**bad)


def test_components_scope_refuses_unknown_names():
    with ps.components_scope(ps.PREP):
        pass
    with pytest.raises(ValueError):
        ps.components_scope("foldkv.other")


# --- a profile of the tiny model ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(checkpoint):
    import foldkv.hf  # noqa: F401
    from foldkv.lab.model import load_model

    return load_model(checkpoint, dtype=torch.float32, attn_implementation="foldkv")


def _generate(model, cache):
    from foldkv.lab.model import cache_keyword

    ids, mask = left_padded_batch((9, 6), int(model.config.vocab_size))
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                          prefill_chunk_size=4, **{cache_keyword(model): cache})


def test_profile_of_the_tiny_model(model):
    require_module("transformers")
    from torch.profiler import ProfilerActivity, profile
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from foldkv.hf import FoldKvCache

    cache = FoldKvCache(model, max_batch=2, max_tokens=16)
    with torch.no_grad(), ps.scoped_attention(model, cache), profile(activities=[ProfilerActivity.CPU]) as prof:
        with ps.components_scope(ps.CHUNK):
            _generate(model, cache)
    kernels, ranges = pb.kernel_events(prof, device="cpu")
    assert {r.name for r in ranges} == {*ps.SCOPES, ps.CHUNK}
    (lo, hi), = pb.chunk_windows(kernels, ranges)
    chunk = next(r for r in ranges if r.name == ps.CHUNK)
    assert (lo, hi) == (chunk.start_us, chunk.end_us)  # CPU ops end inside the range that runs them
    assert lo <= min(k.start_us for k in kernels) and hi >= max(k.start_us + k.dur_us for k in kernels)
    b = pb.breakdown(kernels, ranges, window=(lo, hi))
    assert check(b, kernels, (lo, hi), ranges) == []
    assert all(b.parts[c] > 0 for c in (pb.GEMM, pb.GLOBAL, pb.SLIDING, pb.PREP_COMPONENT, pb.GLUE))
    # every op under a scope went to its component: recount from the profile's own tree
    stand_ins = {(k.name, k.start_us) for k in kernels}
    by_scope = {}
    for e in prof.events():
        node, scope = e.cpu_parent, None
        while node is not None and scope is None:
            scope = node.name if node.name in ps.SCOPES else None
            node = node.cpu_parent
        if (e.name, e.time_range.start) in stand_ins and scope is not None:
            by_scope[pb.SCOPE_COMPONENT[scope]] = by_scope.get(pb.SCOPE_COMPONENT[scope], 0) + 1
    assert set(by_scope) == {pb.GLOBAL, pb.SLIDING, pb.PREP_COMPONENT}
    for comp, n in by_scope.items():
        assert b.kernels[comp] == n, comp
    assert "foldkv" not in ALL_ATTENTION_FUNCTIONS._local_mapping and "pool_attention" not in vars(cache)


def test_scoped_attention_restores_on_exit_and_on_error(model):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from foldkv.hf import FoldKvCache

    cache = FoldKvCache(model, max_batch=2, max_tokens=16)
    before = (ALL_ATTENTION_FUNCTIONS["foldkv"], dict(ALL_ATTENTION_FUNCTIONS._local_mapping), type(cache).pool_attention)
    with pytest.raises(RuntimeError):
        with ps.scoped_attention(model, cache):
            assert ALL_ATTENTION_FUNCTIONS["foldkv"] is not before[0]
            assert "pool_attention" in vars(cache)
            raise RuntimeError("inside")
    assert (ALL_ATTENTION_FUNCTIONS["foldkv"], dict(ALL_ATTENTION_FUNCTIONS._local_mapping),
            type(cache).pool_attention) == before
    assert "pool_attention" not in vars(cache)
    # red twin: a wrapping left installed is seen by the same comparison
    ALL_ATTENTION_FUNCTIONS["foldkv"] = lambda *args, **kwargs: None
    try:
        assert (ALL_ATTENTION_FUNCTIONS["foldkv"], dict(ALL_ATTENTION_FUNCTIONS._local_mapping),
                type(cache).pool_attention) != before
    finally:
        del ALL_ATTENTION_FUNCTIONS["foldkv"]
    # an instance attribute the cache already had is put back
    own = cache.pool_attention
    cache.pool_attention = own
    with ps.scoped_attention(model, cache):
        assert cache.pool_attention is not own
    assert vars(cache)["pool_attention"] is own
    # the tokens are those of the unscoped model
    with torch.no_grad():
        plain = _generate(model, FoldKvCache(model, max_batch=2, max_tokens=16))
        scoped_cache = FoldKvCache(model, max_batch=2, max_tokens=16)
        with ps.scoped_attention(model, scoped_cache):
            scoped = _generate(model, scoped_cache)
    assert torch.equal(plain, scoped)


def test_eager_is_refused(checkpoint):
    from foldkv.lab.model import load_model

    eager = load_model(checkpoint, dtype=torch.float32, attn_implementation="eager")
    with pytest.raises(ValueError):
        with ps.scoped_attention(eager):
            pass


def test_cuda_events_are_linked_to_their_launching_op():
    """kernel_events(device="cuda") on a stand-in of the profiler's events: a kernel takes its linked host op's start
    and thread; a runtime call whose id collides with an op's is not taken for the op; the GPU-side span of a range is
    not a kernel."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, id, start, end, device=DeviceType.CPU, linked=0, thread=1, stream=0, annotation=False):
        return NS(name=name, id=id, time_range=NS(start=start, end=end, elapsed_us=lambda: end - start),
                  device_type=device, linked_correlation_id=linked, thread=thread, device_resource_id=stream,
                  is_user_annotation=annotation, cpu_children=[], cpu_parent=None)

    events = [ev(ps.SLIDING_ATTENTION, 1, 0, 50, annotation=True),
              ev("aten::_efficient_attention_forward", 2, 10, 20),
              ev("cudaLaunchKernel", 2, 400, 401, linked=2),  # a runtime call: its own numbering, id 2 again
              ev("fmha_cutlassF_bf16_aligned", 7, 100, 140, device=DeviceType.CUDA, linked=2, stream=7),
              ev("sm90_xmma_gemm", 8, 150, 160, device=DeviceType.CUDA, linked=99, stream=7),  # no such op
              ev(ps.SLIDING_ATTENTION, 9, 100, 140, device=DeviceType.CUDA, annotation=True, stream=7)]
    kernels, ranges = pb.kernel_events(NS(events=lambda: events), device="cuda")
    assert ranges == [pb.HostRange(ps.SLIDING_ATTENTION, 0, 50, 1)]
    assert kernels == [pb.KernelEvent("fmha_cutlassF_bf16_aligned", 100, 40, 7, 10, 1),
                       pb.KernelEvent("sm90_xmma_gemm", 150, 10, 7, None, None)]
    b = pb.breakdown(kernels, ranges, window=(100, 170))
    assert b.parts[pb.SLIDING] == 40_000 and b.parts[pb.GEMM] == 10_000 and b.parts[pb.GAPS] == 20_000
    with pytest.raises(ValueError):
        pb.kernel_events(NS(events=lambda: events), device="tpu")


def test_chunk_window_ends_with_the_last_kernel_it_launched():
    ranges = [R(ps.CHUNK, 0, 50, thread=1), R(ps.CHUNK, 60, 70, thread=1), R(ps.PREP, 10, 20, thread=1)]
    kernels = [K("gemm", 5, 80, launched_at=40, thread=1), K("gemm", 90, 30, launched_at=65, thread=1),
               K("gemm", 200, 5, launched_at=45, thread=2)]  # another thread's launch is not the chunk's
    # the second chunk's host range starts at 60, while the first chunk's kernel runs to 85: its window starts at 85
    assert pb.chunk_windows(kernels, ranges) == [(0, 85), (85, 120)]
    assert pb.chunk_windows(kernels[:0], ranges) == [(0, 50), (60, 70)]


def test_chunk_windows_of_a_host_running_ahead_count_each_kernel_once():
    """Four chunks whose host ranges each end before the GPU finishes the chunk before (a prefill without host syncs):
    each kernel in one window only, the windows' GEMM time the kernels' sum; red twin: windows from the host ranges'
    starts overlap and count the earlier chunks' kernels again (a 16K profile read 2.73 s of chunks out of a 1.93 s
    prefill this way)."""
    ranges = [R(ps.CHUNK, 10 * i, 10 * i + 8, thread=1) for i in range(4)]  # the host: 10 us a chunk
    kernels = [K("gemm", 5 + 100 * i, 100, launched_at=10 * i + 1, thread=1) for i in range(4)]  # the GPU: 100 us
    windows = pb.chunk_windows(kernels, ranges)
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:]))
    gemm = [pb.breakdown(kernels, ranges, window=w).parts[pb.GEMM] for w in windows]
    assert sum(gemm) == pytest.approx(sum(k.dur_us for k in kernels) * 1e3)
    from_host_starts = [(r.start_us, w[1]) for r, w in zip(ranges, windows)]  # the rule before
    twin = [pb.breakdown(kernels, ranges, window=w).parts[pb.GEMM] for w in from_host_starts]
    assert sum(twin) > 1.5 * sum(gemm)


def test_chrome_trace_events_link_kernels_to_their_launch():
    """A saved chrome trace (what a device call brings back): a kernel goes to the scope open at the runtime or driver
    call that launched it (same correlation, same thread), a kernel with no launch goes by its name, ranges outside
    the prefill scopes are not read; red twin: with its launch's correlation lost, the prep's copy goes by its name
    (glue)."""
    from foldkv.lab.prefill_breakdown import breakdown, chrome_trace_events

    def trace(correlation):
        return {"traceEvents": [
            {"cat": "user_annotation", "ph": "X", "name": ps.CHUNK, "ts": 0, "dur": 100, "tid": 1},
            {"cat": "user_annotation", "ph": "X", "name": ps.PREP, "ts": 10, "dur": 20, "tid": 1},
            {"cat": "user_annotation", "ph": "X", "name": "something else", "ts": 40, "dur": 5, "tid": 1},
            {"cat": "cuda_runtime", "ph": "X", "name": "cudaLaunchKernel", "ts": 12, "dur": 1, "tid": 1,
             "args": {"correlation": 7}},
            {"cat": "cuda_driver", "ph": "X", "name": "cuLaunchKernel", "ts": 50, "dur": 1, "tid": 1,
             "args": {"correlation": 8}},
            {"cat": "kernel", "ph": "X", "name": "direct_copy_kernel", "ts": 20, "dur": 10,
             "args": {"correlation": correlation, "stream": 7}},
            {"cat": "kernel", "ph": "X", "name": "nvjet_sm90_gemm", "ts": 52, "dur": 30, "args": {"correlation": 8}},
            {"cat": "kernel", "ph": "X", "name": "main_kernel", "ts": 85, "dur": 5, "args": {}},
        ]}

    kernels, ranges = chrome_trace_events(trace(7))
    assert [r.name for r in ranges] == [ps.CHUNK, ps.PREP]
    assert [(k.launched_at, k.thread, k.stream) for k in kernels] == [(12, 1, 7), (50, 1, 0), (None, None, 0)]
    parts = breakdown(kernels, ranges, (0, 100)).seconds()
    assert parts["prep"] == pytest.approx(10e-6) and parts["gemm"] == pytest.approx(30e-6)  # (microseconds in)
    assert parts["global_attention"] == pytest.approx(5e-6) and parts["host_gaps"] == pytest.approx(55e-6)
    lost = breakdown(*chrome_trace_events(trace(99)), (0, 100)).seconds()
    assert lost["prep"] == 0 and lost["glue"] == pytest.approx(10e-6)


def test_slow_launches_names_the_kernel_each_long_launch_call_launched():
    """The longest launch calls first, each with the kernel of its correlation id; a copy's or sync's call (no kernel)
    is not listed; red twin: with the correlation ids swapped, the names swap."""
    def trace(first, second):
        return {"traceEvents": [
            {"cat": "cuda_runtime", "ph": "X", "name": "cudaLaunchKernel", "ts": 0, "dur": 900, "args": {"correlation": 1}},
            {"cat": "cuda_driver", "ph": "X", "name": "cuLaunchKernelEx", "ts": 1000, "dur": 5, "args": {"correlation": 2}},
            {"cat": "cuda_runtime", "ph": "X", "name": "cudaMemcpyAsync", "ts": 2000, "dur": 5000,
             "args": {"correlation": 3}},
            {"cat": "kernel", "ph": "X", "name": "main_kernel", "ts": 950, "dur": 10, "args": {"correlation": first}},
            {"cat": "kernel", "ph": "X", "name": "nvjet_gemm", "ts": 1010, "dur": 10, "args": {"correlation": second}},
        ]}

    got = pb.slow_launches(trace(1, 2))
    assert [(x["kernel"], x["us"], x["call"]) for x in got] == [("main_kernel", 900.0, "cudaLaunchKernel"),
                                                                ("nvjet_gemm", 5.0, "cuLaunchKernelEx")]
    assert pb.slow_launches(trace(1, 2), top=1) == got[:1]
    assert pb.slow_launches(trace(2, 1))[0]["kernel"] == "nvjet_gemm"
    prompt = trace(1, 2)
    prompt["traceEvents"].append({"cat": "user_annotation", "ph": "X", "name": "prompt", "ts": 999, "dur": 100})
    assert [x["kernel"] for x in pb.slow_launches(prompt, within="prompt")] == ["nvjet_gemm"]  # the first: before it
