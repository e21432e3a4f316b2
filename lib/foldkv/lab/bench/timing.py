"""Timing one cell: every arm built, checked against the float64 reference (outputs poisoned first), captured in a
CUDA graph (or timed eagerly, saying why) and sampled in interleaved rounds whose order alternates; the cell's
result dict with medians, spreads, % of roof and paired speedups."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch

from ...kernels.workspace import capture_graph
from ...layout import KvFormat
from ..arms import ArmUnavailable
from ..jsonsafe import jsonable
from .arms import DECODE_ARMS, PREFILL_ARMS
from .case import POOL_KINDS, AttentionCase
from .clock import err_text, time_events
from .spec import GUARD_VALUE, ArmImpl, ArmSpec
from .stats import paired_ratios, pct_of_roof, summarize

CHECK_REL_TOL = 3e-2  # bf16 operands, split vs folded rounding of K: measured errors sit near 1e-2 at most


def _reason(exc: BaseException) -> str:
    """The recorded reason: an ArmUnavailable's own sentence, else the exception's type, text and place."""
    return str(exc)[:400] if isinstance(exc, ArmUnavailable) else err_text(exc)


def _not_run(exc: BaseException) -> bool:
    return isinstance(exc, (ArmUnavailable, ImportError))


class _Timed:
    """An arm ready to sample: a replay (graph) or an eager loop of `calls_per_sample` calls."""

    def __init__(self, name: str, run: Callable[[], None], calls_per_sample: int, timing: str, why_eager: str = ""):
        self.name, self.run, self.calls_per_sample = name, run, calls_per_sample
        self.timing, self.why_eager = timing, why_eager
        self.events: list = []
        self.samples_us: list[float] = []
        self.keep: Any = None  # the graph and the arm, alive while the cell is timed

    def sample(self) -> None:
        if self.timing == "host clock":
            t0 = time.perf_counter()
            self.run()
            self.samples_us.append((time.perf_counter() - t0) * 1e6 / self.calls_per_sample)
            return
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.run()
        b.record()
        self.events.append((a, b))

    def collect(self) -> None:
        if self.events:
            torch.cuda.synchronize()
            self.samples_us += [a.elapsed_time(b) * 1e3 / self.calls_per_sample for a, b in self.events]
            self.events = []


def _poison(impl: ArmImpl) -> None:
    impl.out.fill_(float("nan"))
    if impl.lse is not None:
        impl.lse.fill_(float("nan"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_arm(impl: ArmImpl, case: AttentionCase) -> dict:
    """Poison, run copy 0, check every output element was written, nothing past the plan was, and the check rows
    match the float64 reference within CHECK_REL_TOL (or the arm's own `check`); the LSE's largest error against the
    reference's is reported beside it (`lse_max_abs_err`, natural log; NaN for an arm without an LSE)."""
    if impl.check is not None:
        return impl.check()
    _poison(impl)
    impl.calls[0]()
    _sync(case.device)
    written = bool(torch.isfinite(impl.out).all())
    lse_written = None if impl.lse is None else bool(torch.isfinite(impl.lse).all())
    ref = case.reference(impl.reference_kind)
    got = impl.out[ref["rows"].to(impl.out.device)].to(ref["out"].device, torch.float64)
    rel = float((got - ref["out"]).norm() / ref["out"].norm()) if written else float("nan")
    no_overrun = None if not impl.guards else all(bool((g.float() == GUARD_VALUE).all()) for g in impl.guards)
    ok = written and lse_written is not False and no_overrun is not False and rel <= CHECK_REL_TOL
    # reported, not held to a tolerance here (the gates hold it to a derived bound): an arm whose output passes
    # CHECK_REL_TOL can still be off in its LSE (bench/FP8_NOTES.md, run 16)
    lse_err = float("nan")
    if lse_written:
        got_lse = impl.lse[ref["rows"].to(impl.lse.device)].to(ref["lse"].device, torch.float64)
        lse_err = float((got_lse - ref["lse"]).abs().max())
    return {"written": written, "lse_written": lse_written, "no_overrun": no_overrun, "rel_err": rel,
            "lse_max_abs_err": lse_err, "tol": CHECK_REL_TOL, "ok": ok, "rows_checked": int(ref["rows"].numel()),
            "against": impl.reference_kind}


def _eager_us(steps: list[Callable[[], Any]]) -> float:
    """µs of one call, eagerly (median of 3 passes over the copies): sizes the graph."""
    return summarize(time_events(lambda: [c() for c in steps], 3, 1))["median"] / len(steps)


def _prepare(name: str, impl: ArmImpl, device: torch.device, target_sample_us: float, max_inner: int) -> _Timed:
    steps = impl.timed_calls or impl.calls
    if device.type != "cuda":
        return _Timed(name, lambda: [c() for c in steps], len(steps), "host clock", "no CUDA device")
    est = _eager_us(steps)
    inner = int(min(max_inner, max(1, math.ceil(target_sample_us / max(est * len(steps), 1e-3)))))
    calls = steps * inner

    def eager() -> None:
        for c in calls:
            c()

    if not impl.graph:
        return _Timed(name, eager, len(calls), "cuda events, eager", impl.why_eager)
    try:
        side = torch.cuda.Stream(device=device)  # warm up on a side stream before capture, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for c in steps:
                c()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph):
            eager()
        _sync(device)
        # The replay must compute what an eager call computes (same last copy): a capture that silently recorded
        # nothing, or froze a host-side value, shows up here.
        _poison(impl)
        graph.replay()
        _sync(device)
        replayed = impl.out.float().clone()
        _poison(impl)
        steps[-1]()
        _sync(device)
        eager_out = impl.out.float()
        if not bool(torch.isfinite(replayed).all()):
            raise RuntimeError("graph replay left output elements unwritten (NaN poison survived)")
        diff = float((replayed - eager_out).norm() / eager_out.norm().clamp_min(1e-30))
        if diff > 1e-2:
            raise RuntimeError(f"graph replay differs from the eager call (rel {diff:.2e})")
    except Exception as exc:
        try:
            _sync(device)
        except Exception:
            pass
        return _Timed(name, eager, len(calls), "cuda events, eager", f"graph capture failed: {err_text(exc)}")
    t = _Timed(name, graph.replay, len(calls), "cuda graph")
    t.keep = graph
    return t


def run_cell(cell: str, kind: str, case: AttentionCase, arms: Sequence[str | ArmSpec], *, rounds: int, warmup: int,
             roof: dict | None = None, matmul_roof: dict | None = None, target_sample_us: float = 2000.0,
             max_inner: int = 64, log: Callable[[str], None] = print, extra: dict | None = None) -> dict:
    """Build, check and time `arms` (names in DECODE_ARMS / PREFILL_ARMS by `kind`, or a harness's own ArmSpecs)
    on one case, interleaved round by round; return the cell's result dict."""
    registry = DECODE_ARMS if kind == "decode" else PREFILL_ARMS
    res: dict[str, Any] = {
        "cell": cell, "kind": kind, "batch": len(case.seq_lens), "seq_lens": case.seq_lens, "q_lens": case.q_lens,
        "context": max(case.seq_lens), "tokens": sum(case.seq_lens), "rounds": rounds, "warmup": warmup,
        "bytes": {f: case.step_bytes(f) for f in POOL_KINDS},
        "pool_bytes": {f.value: case.layout(f).nbytes for f in (KvFormat.SPLIT, KvFormat.FOLDED)},
        "copies": {f.value: case.copies_for(f) for f in (KvFormat.SPLIT, KvFormat.FOLDED)},
        "arms": {}, "speedup": {},
    }
    if kind == "prefill":
        res["flops"] = case.flops()
    if extra:
        res.update(extra)
    timed: list[_Timed] = []
    for requested in arms:
        spec = requested if isinstance(requested, ArmSpec) else registry.get(requested)
        name = requested.name if isinstance(requested, ArmSpec) else requested
        arm: dict[str, Any] = {"name": name, "status": "error"}
        res["arms"][name] = arm
        if spec is None:
            arm.update(status="not run", reason=f"no {kind} arm named {name!r} (known: {sorted(registry)})")
            continue
        arm.update(label=spec.label, format=spec.format, peer=spec.peer, generated=spec.generated,
                   bytes=res["bytes"][spec.format])
        if case.device.type != "cuda" and not spec.cpu_ok:
            arm.update(status="not run", reason="needs a CUDA device")
            continue
        try:
            impl = spec.build(case)
        except Exception as exc:
            arm.update(status="not run" if _not_run(exc) else "error", reason=_reason(exc))
            log(f"  {name}: {arm['status']}: {arm['reason']}")
            continue
        try:
            arm["check"] = check_arm(impl, case)
            t = _prepare(name, impl, case.device, target_sample_us, max_inner)
            arm.update(timing=t.timing, why_eager=t.why_eager, calls_per_sample=t.calls_per_sample,
                       copies=len(impl.calls), status="ok", info=jsonable(impl.info))
            if not arm["check"]["ok"]:
                arm["warning"] = (f"check failed (written={arm['check'].get('written')}, rel_err="
                                  f"{arm['check'].get('rel_err', float('nan')):.3g}): timed anyway, flagged")
            t.keep = (t.keep, impl)
            timed.append(t)
        except Exception as exc:
            arm.update(status="not run" if _not_run(exc) else "error", reason=_reason(exc))
            log(f"  {name}: {arm['status']}: {arm['reason']}")
            try:
                _sync(case.device)
            except Exception:
                pass
    # warm-up replays (also lifts the SM clock from idle), then interleaved rounds with alternating order; an arm
    # that raises while being timed is recorded and dropped, the others go on
    failed: dict[str, str] = {}

    def attempt(t: _Timed, what: Callable[[], Any]) -> None:
        if t.name in failed:
            return
        try:
            what()
        except Exception as exc:
            failed[t.name] = err_text(exc)
            log(f"  {t.name}: error while timing: {failed[t.name]}")

    for t in timed:
        attempt(t, lambda t=t: [t.run() for _ in range(warmup)])
    try:
        _sync(case.device)
    except Exception as exc:  # a fault in some arm's kernel: the context is gone, every later step fails too
        raise RuntimeError(f"device fault after the warm-up replays: {err_text(exc)}") from None
    for r in range(rounds):
        for t in (timed if r % 2 == 0 else timed[::-1]):
            attempt(t, t.sample)
    for t in timed:
        attempt(t, t.collect)
    for name, why in failed.items():
        res["arms"][name].update(status="error", reason=f"failed while timing: {why}")
    timed = [t for t in timed if t.name not in failed]
    gbps = (roof or {}).get("gbps")
    tflops_roof = (matmul_roof or {}).get("tflops")
    for t in timed:
        arm = res["arms"][t.name]
        arm["samples_us"] = t.samples_us
        arm["us"] = summarize(t.samples_us)
        arm["pct_roof"] = summarize([pct_of_roof(arm["bytes"], s, gbps) for s in t.samples_us]) if gbps else None
        arm["floor_us"] = arm["bytes"] / (gbps * 1e3) if gbps else None  # bytes / roof, µs
        if kind == "prefill":
            arm["tflops"] = summarize([res["flops"] / (s * 1e-6) / 1e12 for s in t.samples_us])
            if tflops_roof:
                arm["pct_matmul_roof"] = 100.0 * arm["tflops"]["median"] / tflops_roof
    for a in timed:
        res["speedup"][a.name] = {
            b.name: {"ratio_of_medians": res["arms"][b.name]["us"]["median"] / res["arms"][a.name]["us"]["median"],
                     "paired": paired_ratios(a.samples_us, b.samples_us)}
            for b in timed if b is not a}
    for t in timed:  # free graphs and their pools before the next cell
        t.keep = t.run = None
    return res
