"""Where one prefill chunk's wall time goes: every profiled kernel's time assigned to one component, the GPU's idle
time between kernels as host gaps, the parts summing to the wall time exactly.

Components (COMPONENTS): "gemm" (the projections' and MLP's cuBLAS / CUTLASS GEMMs), "global_attention",
"sliding_attention", "prep" (foldkv's fold prep and page stores), "glue" (norms, RoPE, activations, masks, copies:
everything else the GPU runs) and "host_gaps" (no kernel running inside the window).
A kernel goes to the component of the innermost `prefill_scopes` range open on the host when it was launched (its
launching op's start, on that op's thread); a kernel launched outside every range goes by its name (NAME_RULES, in
order: attention names before GEMM names, since CUTLASS attention kernels carry "cutlass" too), else to glue. Glue
kernels whose names no rule knows are listed by name in `unknown` (with their time), never dropped.
Time is attributed on a sweep over the window: a stretch where k kernels run at once (two streams) gives each 1/k of
it, so overlapping kernels are counted once, and the stretches no kernel covers are the host gaps. Arithmetic is
exact (integer nanoseconds, `Fraction` shares): `Breakdown.parts` sums to the window to the nanosecond.

    events, ranges = kernel_events(prof)               # a torch.profiler.profile of one chunk (device="cpu": CPU ops)
    b = breakdown(events, ranges, window=chunk_windows(events, ranges)[0])   # the chunk's forward inside CHUNK
    b.seconds()  ->  {"gemm": ..., ..., "host_gaps": ...}; b.unknown -> {kernel name: seconds}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Sequence

from .prefill_scopes import CHUNK, GLOBAL_ATTENTION, PREP, SCOPES, SLIDING_ATTENTION

GEMM, GLOBAL, SLIDING, PREP_COMPONENT, GLUE, GAPS = (
    "gemm", "global_attention", "sliding_attention", "prep", "glue", "host_gaps")
COMPONENTS = (GEMM, GLOBAL, SLIDING, PREP_COMPONENT, GLUE, GAPS)
SCOPE_COMPONENT = {PREP: PREP_COMPONENT, GLOBAL_ATTENTION: GLOBAL, SLIDING_ATTENTION: SLIDING}

# (component, lower-case name fragments), tried in order for a kernel launched outside every scope. TileLang names a
# kernel after its prim_func: the bf16 prefill is "main" -> "main_kernel", the FP8 one "prefill_folded_fp8_kernel".
NAME_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (GLOBAL, ("prefill_folded", "prefill_split", "main_kernel", "batchprefillwithpagedkvcache")),
    (SLIDING, ("fmha", "flash", "attention", "sdpa", "fprop", "mem_efficient", "efficient_attention")),
    (GEMM, ("gemm", "nvjet", "cutlass", "xmma", "kernel2", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
            "aten::linear", "gemv")),
    (GLUE, ("elementwise", "reduce", "catarray", "index", "copy", "memcpy", "memset", "fill", "softmax", "norm",
            "rope", "triton", "gather", "scatter", "unrolled", "vectorized", "arange", "where", "cumsum", "scan",
            "sort", "aten::", "_rows")),  # "_rows": foldkv.fused_step_kernels' (gelu_mul_rows, norm_add_rows, ...)
)


@dataclass(frozen=True)
class KernelEvent:
    """One kernel (or device copy) of the trace: name, start and duration (microseconds, the trace's clock), stream;
    launched_at / thread: its launching host op's start and thread (None: unknown, so it goes by its name)."""

    name: str
    start_us: float
    dur_us: float
    stream: int = 0
    launched_at: float | None = None
    thread: int | None = None


@dataclass(frozen=True)
class HostRange:
    """A `prefill_scopes` range on the host: name, start, end (microseconds), thread (None: any)."""

    name: str
    start_us: float
    end_us: float
    thread: int | None = None


@dataclass
class Breakdown:
    """The window's nanoseconds by component (`parts`, exact), the kernels by component, and unknown glue by name."""

    window_ns: tuple[int, int]
    parts: dict[str, Fraction]
    kernels: dict[str, int] = field(default_factory=dict)
    unknown: dict[str, Fraction] = field(default_factory=dict)

    @property
    def wall_ns(self) -> int:
        return self.window_ns[1] - self.window_ns[0]

    def seconds(self) -> dict[str, float]:
        return {c: float(v) * 1e-9 for c, v in self.parts.items()}

    def as_dict(self) -> dict:
        return {"wall_s": self.wall_ns * 1e-9, "seconds": self.seconds(), "kernels": dict(self.kernels),
                "unknown_s": {n: float(v) * 1e-9 for n, v in self.unknown.items()}}


def _ns(us: float) -> int:
    return round(us * 1000)


def component_by_name(name: str) -> tuple[str, bool]:
    """(component, known) for a kernel launched outside every scope: the first NAME_RULES entry with a fragment in
    the lower-cased name; no match: glue, not known."""
    low = name.lower()
    for component, fragments in NAME_RULES:
        if any(f in low for f in fragments):
            return component, True
    return GLUE, False


def component_of(kernel: KernelEvent, ranges: Sequence[HostRange]) -> tuple[str, bool]:
    """(component, known): the innermost range (the latest-starting one) containing the kernel's launch, on its
    thread; else by name."""
    if kernel.launched_at is not None:
        t = kernel.launched_at
        inside = [r for r in ranges if r.name in SCOPE_COMPONENT and r.start_us <= t <= r.end_us
                  and (r.thread is None or kernel.thread is None or r.thread == kernel.thread)]
        if inside:
            innermost = max(inside, key=lambda r: (r.start_us, -r.end_us))
            return SCOPE_COMPONENT[innermost.name], True
    return component_by_name(kernel.name)


def breakdown(kernels: Iterable[KernelEvent], ranges: Iterable[HostRange] = (),
              window: tuple[float, float] | None = None) -> Breakdown:
    """The window's time by component (module docstring). window: (start, end) microseconds on the trace's clock,
    the chunk's wall time (default: first kernel start to last kernel end); kernels outside it are clipped. Refuses
    (ValueError) a negative duration, a window that ends before it starts, a range of an unknown scope name."""
    kernels = list(kernels)
    ranges = list(ranges)
    for k in kernels:
        if k.dur_us < 0:
            raise ValueError(f"kernel {k.name!r} has a negative duration {k.dur_us}")
    for r in ranges:
        if r.name not in SCOPES and r.name != CHUNK:
            raise ValueError(f"range {r.name!r} is not one of the prefill scopes {list(SCOPES) + [CHUNK]}")
    if window is None:
        if not kernels:
            raise ValueError("no kernels and no window: nothing to break down")
        window = (min(k.start_us for k in kernels), max(k.start_us + k.dur_us for k in kernels))
    lo, hi = _ns(window[0]), _ns(window[1])
    if hi < lo:
        raise ValueError(f"window {window} ends before it starts")
    parts = {c: Fraction(0) for c in COMPONENTS}
    counts = {c: 0 for c in COMPONENTS if c != GAPS}
    unknown: dict[str, Fraction] = {}
    spans = []  # (start, end, component, name, known), clipped to the window
    for k in kernels:
        comp, known = component_of(k, ranges)
        s, e = max(_ns(k.start_us), lo), min(_ns(k.start_us + k.dur_us), hi)
        counts[comp] += 1
        if not known:
            unknown.setdefault(k.name, Fraction(0))
        if e > s:
            spans.append((s, e, comp, k.name, known))
    # sweep: between consecutive boundaries the same set of kernels runs; each gets an equal share
    cuts = sorted({lo, hi, *(s for s, *_ in spans), *(e for _, e, *_ in spans)})
    for a, b in zip(cuts, cuts[1:]):
        running = [sp for sp in spans if sp[0] <= a and sp[1] >= b]
        if not running:
            parts[GAPS] += b - a
            continue
        share = Fraction(b - a, len(running))
        for _, _, comp, name, known in running:
            parts[comp] += share
            if not known:
                unknown[name] += share
    return Breakdown((lo, hi), parts, counts, unknown)


def chunk_windows(kernels: Sequence[KernelEvent], ranges: Sequence[HostRange]) -> list[tuple[float, float]]:
    """Each CHUNK range's wall time, in order: from the range's start on the host (the forward's first launch is
    after it), or from where the previous chunk's window ended if later (a host that runs ahead of the GPU enters
    the next chunk while the GPU still runs this one's kernels: the windows would overlap and count those kernels
    twice), to the end of the last kernel launched inside it (the GPU finishes after the host leaves the range); a
    range that launched nothing ends where it ends."""
    out: list[tuple[float, float]] = []
    for r in sorted((r for r in ranges if r.name == CHUNK), key=lambda r: r.start_us):
        ends = [k.start_us + k.dur_us for k in kernels if k.launched_at is not None
                and r.start_us <= k.launched_at <= r.end_us and (r.thread is None or k.thread in (None, r.thread))]
        end = max([r.end_us, *ends])
        start = max(r.start_us, out[-1][1]) if out else r.start_us
        out.append((min(start, end), end))
    return out


def _under_an_op(event: Any) -> bool:
    """Whether a host event runs inside another op (not only inside annotation ranges)."""
    parent = event.cpu_parent
    while parent is not None:
        if not parent.is_user_annotation and parent.name not in SCOPES and parent.name != CHUNK:
            return True
        parent = parent.cpu_parent
    return False


def kernel_events(prof: Any, device: str = "cuda") -> tuple[list[KernelEvent], list[HostRange]]:
    """A `torch.profiler.profile`'s kernels and its `prefill_scopes` ranges. device "cuda": the device events (kernels,
    copies, sets; not the GPU-side annotation ranges), each with its stream and the start and thread of the host op it
    is linked to (the profiler's correlation); "cpu": a CPU-only profile's outermost ops (inside no other op, only inside
    annotation ranges: aten::linear, not the aten::mm under it) stand in for kernels, each launched at its own start on
    its own thread (for tests without a GPU)."""
    from torch.autograd import DeviceType

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: 'cuda' or 'cpu'")
    events = list(prof.events())
    # the host ops (the profiler's frontend events: no link of their own); a runtime call such as cudaLaunchKernel is
    # linked to its op, and its id is another numbering that may collide with an op's
    host = {e.id: e for e in events if e.device_type == DeviceType.CPU and not getattr(e, "linked_correlation_id", 0)}
    ranges = [HostRange(e.name, e.time_range.start, e.time_range.end, e.thread) for e in host.values()
              if e.name in SCOPES or e.name == CHUNK]
    kernels = []
    if device == "cuda":
        for e in events:
            if e.device_type != DeviceType.CUDA or e.is_user_annotation or e.name in SCOPES or e.name == CHUNK:
                continue  # a range's GPU-side span is not a kernel
            op = host.get(getattr(e, "linked_correlation_id", None) or -1)
            kernels.append(KernelEvent(e.name, e.time_range.start, e.time_range.elapsed_us(),
                                       int(e.device_resource_id or 0), None if op is None else op.time_range.start,
                                       None if op is None else op.thread))
    else:
        for e in host.values():
            if e.is_user_annotation or e.name in SCOPES or e.name == CHUNK or _under_an_op(e):
                continue
            kernels.append(KernelEvent(e.name, e.time_range.start, e.time_range.elapsed_us(), e.thread,
                                       e.time_range.start, e.thread))
    return kernels, ranges


def chrome_trace_events(trace: dict) -> tuple[list[KernelEvent], list[HostRange]]:
    """`kernel_events` from a profile saved as a chrome trace (`prof.export_chrome_trace`, the JSON a device call
    brings back): each "kernel" event with the start and thread of the runtime or driver call that launched it (same
    correlation id; none found: it goes by its name), and the "user_annotation" ranges of the prefill scopes."""
    events = trace["traceEvents"]
    launches = _launch_calls(events)
    ranges = [HostRange(e["name"], e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
              if e.get("cat") == "user_annotation" and e.get("ph") == "X" and (e["name"] in SCOPES or e["name"] == CHUNK)]
    kernels = []
    for e in events:
        if e.get("cat") != "kernel" or e.get("ph") != "X":
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        kernels.append(KernelEvent(e["name"], e["ts"], e["dur"], int(e.get("args", {}).get("stream", 0) or 0),
                                   None if launch is None else launch["ts"], None if launch is None else launch.get("tid")))
    return kernels, ranges


def slow_launches(trace: dict, top: int = 20, within: str | None = None) -> list[dict]:
    """The `top` longest runtime or driver launch calls of a chrome trace, each with the kernel it launched (same
    correlation id): where a process's first prompt pays lazy module loading (CUDA loads a kernel's module at its first
    launch, inside that launch call) or a library's first-use set-up, which a warm-up can then launch ahead. Calls that
    launched no kernel (copies, syncs) are not counted; with `within`, only calls inside a user annotation of that
    name (`torch.profiler.record_function`)."""
    events = trace["traceEvents"]
    launches = _launch_calls(events)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if within is not None and e.get("cat") == "user_annotation" and e.get("name") == within]
    out = []
    for e in events:
        call = launches.get(e.get("args", {}).get("correlation")) if e.get("cat") == "kernel" else None
        if call is not None and call.get("ph") == "X" and (
                within is None or any(a <= call["ts"] <= b for a, b in spans)):
            out.append({"call": call["name"], "us": float(call["dur"]), "kernel": e["name"]})
    return sorted(out, key=lambda x: -x["us"])[:top]


def _launch_calls(events: list[dict]) -> dict:
    """A chrome trace's runtime and driver calls by correlation id: the call that launched the kernel of that id."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


__all__ = ["COMPONENTS", "Breakdown", "HostRange", "KernelEvent", "NAME_RULES", "SCOPE_COMPONENT", "breakdown",
           "chrome_trace_events", "chunk_windows", "component_by_name", "component_of", "kernel_events",
           "slow_launches"]
