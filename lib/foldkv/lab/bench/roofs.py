"""The roofs a run is measured against, measured in the same run: the read roof (a Triton grid-stride streaming sum
and torch.sum over far more than L2; the faster is the roof) and the bf16 matmul rate; and, where no GPU is here,
the read roof the newest committed H200 run measured. GB/s = 1e9 bytes/s, TFLOP/s = 1e12 FLOP/s."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..arms import ArmUnavailable
from .arms import ArmImpl
from .results import RESULTS_GLOB, find_results, run_name
from .stats import summarize
from .timing import err_text, time_events

STREAM_BLOCK = 4096  # elements per Triton program step: the streamed tensor is a whole number of blocks


def stream_read_kernel() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """run(x, partials): a grid-stride streaming sum in Triton of bf16 `x` (a multiple of STREAM_BLOCK elements)
    into float32 `partials` (one per program; their sum is x's sum). Raises ImportError without Triton."""
    # Bound as module globals (not locals): Triton resolves the names a kernel uses through its function's globals.
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read_sum(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr):
        # whole blocks only (no mask) and offsets that are multiples of BLOCK: the loads vectorise to 16 bytes
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for b in range(pid, n_blocks, tl.num_programs(0)):
            offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    def run(x: torch.Tensor, out: torch.Tensor) -> None:
        if x.numel() % STREAM_BLOCK:
            raise ValueError(f"stream read needs a multiple of {STREAM_BLOCK} elements, got {x.numel()}")
        stream_read_sum[(out.numel(),)](x, out, x.numel() // STREAM_BLOCK, BLOCK=STREAM_BLOCK, num_warps=8)

    return run


def _partials(device: torch.device) -> torch.Tensor:
    return torch.empty(torch.cuda.get_device_properties(device).multi_processor_count * 4, dtype=torch.float32,
                       device=device)


def _sum_error(partials: torch.Tensor, x: torch.Tensor) -> float:
    """|sum of partials - float64 sum| / sum |x|: float32 accumulation of bf16 values sits near 1e-6."""
    return abs(float(partials.double().sum()) - float(x.double().sum())) / max(1.0, float(x.double().abs().sum()))


SUM_TOL = 1e-3


def stream_read_arm(nbytes: int, device: torch.device | str, copies: int) -> ArmImpl:
    """No attention at all: the streaming-read kernel over `nbytes` (rounded up to whole blocks of bf16) in `copies`
    buffers (rotated like a case's pools), as an arm: what any single kernel reading those bytes costs here, the
    floor plus one launch, ramp and drain. Its check: the partial sums, poisoned first, add up to the buffer's sum."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ArmUnavailable("the streaming read is a Triton kernel: it needs a CUDA device")
    run = stream_read_kernel()
    elems = -(-int(nbytes) // 2 // STREAM_BLOCK) * STREAM_BLOCK
    g = torch.Generator(device=device).manual_seed(elems)
    bufs = [torch.randn(elems, generator=g, device=device).to(torch.bfloat16) for _ in range(copies)]
    part = _partials(device)

    def check() -> dict:
        part.fill_(float("nan"))
        run(bufs[0], part)
        torch.cuda.synchronize(device)
        err = _sum_error(part, bufs[0])
        return {"written": bool(torch.isfinite(part).all()), "rel_err": err, "tol": SUM_TOL, "ok": err <= SUM_TOL,
                "what": "partial sums against the float64 sum of the buffer"}

    return ArmImpl([lambda b=b: run(b, part) for b in bufs], part, graph=True, keep=bufs, check=check,
                   info={"streamed_bytes": elems * 2})


def _roof_stats(nbytes: int, us: list[float]) -> dict:
    s = summarize(us)
    return {"gbps": nbytes / (s["median"] * 1e-6) / 1e9, "us": s}


def measure_read_roof(device: torch.device | str, nbytes: int = 2 << 30, reps: int = 30, warmup: int = 5) -> dict:
    """The card's read roof: the faster of the Triton streaming sum and torch.sum over `nbytes` of random bf16
    (far larger than L2). Returns {"gbps", "method", "bytes", "methods": {name: stats or error}, "timer"}."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = int(nbytes) // (2 * STREAM_BLOCK) * (2 * STREAM_BLOCK)  # whole blocks of bf16
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    methods: dict[str, Any] = {}
    if cuda:
        try:
            run, part = stream_read_kernel(), _partials(device)
            us = time_events(lambda: run(x, part), reps, warmup, cuda)
            if _sum_error(part, x) > SUM_TOL:
                raise RuntimeError(f"triton stream sum {float(part.sum())} != torch {float(x.double().sum())}")
            methods["triton_stream_sum"] = _roof_stats(nbytes, us)
        except Exception as exc:
            methods["triton_stream_sum"] = {"error": err_text(exc)}
    us = time_events(lambda: x.sum(dtype=torch.float32), reps, warmup, cuda)
    methods["torch_sum"] = _roof_stats(nbytes, us)
    del x
    ok = {k: v for k, v in methods.items() if "gbps" in v}
    best = max(ok, key=lambda k: ok[k]["gbps"])
    return {"gbps": ok[best]["gbps"], "method": best, "bytes": nbytes, "methods": methods,
            "timer": "cuda events" if cuda else "host clock"}


def measure_matmul_roof(device: torch.device | str, n: int = 8192, reps: int = 20, warmup: int = 5) -> dict:
    """bf16 dense matmul rate (n x n x n, random operands), the ceiling prefill is held to."""
    device = torch.device(device)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    us = time_events(lambda: torch.matmul(a, b, out=c), reps, warmup, device.type == "cuda")
    s = summarize(us)
    return {"tflops": 2 * n**3 / (s["median"] * 1e-6) / 1e12, "n": n, "us": s}


def committed_read_roof(results_glob: str = RESULTS_GLOB, *, root: str | None = None) -> dict:
    """The read roof measured by the newest full H200 run of the benchmarks (committed runs first: `find_results`),
    for where no GPU is here to measure one: {"gbps", "method", "run", "path", "committed", "said"}, `said` a
    sentence naming the run. Raises LookupError when no such run has a read roof."""
    found = find_results(results_glob, root=root)
    read = (found or {}).get("results", {}).get("roof", {}).get("read", {})
    if not read.get("gbps"):
        raise LookupError(f"no full H200 benchmark run with a measured read roof matched {results_glob!r}")
    run = run_name(found["path"])
    state = "committed" if found["committed"] else "NOT committed"
    return {"gbps": float(read["gbps"]), "method": read.get("method"), "run": run, "path": found["path"],
            "committed": found["committed"],
            "said": f"read roof {read['gbps']:,.0f} GB/s ({read.get('method')}), measured by run {run} "
                    f"({found['path']}, {state})"}
