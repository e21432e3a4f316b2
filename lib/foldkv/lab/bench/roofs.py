"""The roofs a run is measured against, measured in the same run: the read roof (a Triton grid-stride streaming sum
and torch.sum over far more than L2; the faster is the roof) and the bf16 matmul rate; and, where no GPU is here,
the read roof notebook 01's run of record measured. GB/s = 1e9 bytes/s, TFLOP/s = 1e12 FLOP/s."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..arms import ArmUnavailable
from .spec import ArmImpl
from .results import find_results, notebook_record, run_name
from .stats import summarize
from .clock import err_text, time_events

STREAM_BLOCK = 4096  # elements per Triton program step: the streamed tensor is a whole number of blocks
STREAM_READ_MAX_BYTES = 2 << 30  # the stream-read arm's buffers together: far past L2, far below a big case's pools
SUM_CHUNK = 1 << 24  # elements summed in float64 at a time by the checks (a 128 MiB temporary, whatever the buffer)


def stream_read_kernel() -> Callable[..., None]:
    """run(x, partials, n_blocks=None): a grid-stride streaming sum in Triton of bf16 `x` (a multiple of STREAM_BLOCK
    elements) into float32 `partials` (one per program; their sum is the sum of what was read). `n_blocks` blocks
    are read, by default all of x's; more than x holds wraps around x (block b reads x's block b % x's blocks), so a
    bounded buffer can stand for any byte count. Raises ImportError without Triton."""
    # Bound as module globals (not locals): Triton resolves the names a kernel uses through its function's globals.
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read_sum(x_ptr, out_ptr, n_blocks, buf_blocks, BLOCK: tl.constexpr, WRAP: tl.constexpr):
        # whole blocks only (no mask) and offsets that are multiples of BLOCK: the loads vectorise to 16 bytes
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for b in range(pid, n_blocks, tl.num_programs(0)):
            if WRAP:  # resolved at compile time: without it the loop is the plain read
                blk = b % buf_blocks
            else:
                blk = b
            offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    def run(x: torch.Tensor, out: torch.Tensor, n_blocks: int | None = None) -> None:
        if x.numel() % STREAM_BLOCK:
            raise ValueError(f"stream read needs a multiple of {STREAM_BLOCK} elements, got {x.numel()}")
        buf_blocks = x.numel() // STREAM_BLOCK
        n = buf_blocks if n_blocks is None else int(n_blocks)
        stream_read_sum[(out.numel(),)](x, out, n, buf_blocks, BLOCK=STREAM_BLOCK, WRAP=n > buf_blocks,
                                        num_warps=8)

    return run


def _partials(device: torch.device) -> torch.Tensor:
    return torch.empty(torch.cuda.get_device_properties(device).multi_processor_count * 4, dtype=torch.float32,
                       device=device)


def _sums(x: torch.Tensor, elems: int | None = None) -> tuple[float, float]:
    """(sum, sum of |.|) of x's first `elems` elements (default all) in float64, SUM_CHUNK elements at a time: a
    float64 copy of a whole many-GiB buffer would need four times its memory."""
    flat = x.reshape(-1)[: x.numel() if elems is None else elems]
    total = absolute = 0.0
    for i in range(0, flat.numel(), SUM_CHUNK):
        part = flat[i:i + SUM_CHUNK].double()
        total += float(part.sum())
        absolute += float(part.abs().sum())
    return total, absolute


def _wrapped_sums(x: torch.Tensor, n_blocks: int) -> tuple[float, float]:
    """(sum, sum of |.|) of what reading `n_blocks` blocks of x, wrapping around it, reads."""
    whole, rest = divmod(n_blocks, x.numel() // STREAM_BLOCK)
    total, absolute = _sums(x) if whole else (0.0, 0.0)
    part_total, part_abs = _sums(x, rest * STREAM_BLOCK) if rest else (0.0, 0.0)
    return whole * total + part_total, whole * absolute + part_abs


def _sum_error(partials: torch.Tensor, x: torch.Tensor, n_blocks: int | None = None) -> float:
    """|sum of partials - float64 sum of what was read| / sum |read|: float32 accumulation of bf16 values sits near
    1e-6."""
    total, absolute = _wrapped_sums(x, x.numel() // STREAM_BLOCK if n_blocks is None else n_blocks)
    return abs(float(partials.double().sum()) - total) / max(1.0, absolute)


SUM_TOL = 1e-3


def stream_read_buffers(nbytes: int, device: torch.device | str, copies: int,
                        max_bytes: int = STREAM_READ_MAX_BYTES) -> tuple[list[torch.Tensor], int]:
    """The stream-read arm's inputs: (buffers, blocks one call reads). A call reads `nbytes` rounded up to whole
    blocks of bf16. The buffers hold at most `max_bytes` together: `copies` buffers of the whole byte count when they
    fit (rotated like a case's pools), else as many whole copies as fit, else one buffer of `max_bytes` that a call
    reads around more than once (what is read, and so the time, stays the byte count). Values uniform in [0, 1),
    drawn in bf16 (no float32 draft twice the size): all positive, so a block read too few or too many times moves
    the sum by its share, where a mean-zero draw would hide it under the sum of |x|. Raises ValueError for a cap
    below one block or no bytes."""
    block_bytes = 2 * STREAM_BLOCK
    if int(nbytes) <= 0 or copies < 1:
        raise ValueError(f"stream read of {nbytes} bytes in {copies} copies: need bytes > 0 and copies >= 1")
    if max_bytes < block_bytes:
        raise ValueError(f"max_bytes {max_bytes}: the stream read needs at least one block ({block_bytes} bytes)")
    n_blocks = -(-int(nbytes) // block_bytes)
    per_copy = min(n_blocks, max_bytes // block_bytes)  # blocks per buffer
    buffers = min(copies, max_bytes // (per_copy * block_bytes))
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(n_blocks)
    bufs = [torch.rand(per_copy * STREAM_BLOCK, generator=g, device=device, dtype=torch.bfloat16)
            for _ in range(buffers)]
    return bufs, n_blocks


def stream_read_arm(nbytes: int, device: torch.device | str, copies: int,
                    max_bytes: int = STREAM_READ_MAX_BYTES) -> ArmImpl:
    """No attention at all: the streaming-read kernel over `nbytes` (rounded up to whole blocks of bf16), as an arm:
    what any single kernel reading those bytes costs here, the floor plus one launch, ramp and drain. Its buffers
    (`stream_read_buffers`: `copies` rotated like a case's pools, together at most `max_bytes`, read around when the
    bytes exceed them) leave the memory to the case. Its check: the partial sums, poisoned first, add up to the
    float64 sum of every block the call read."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ArmUnavailable("the streaming read is a Triton kernel: it needs a CUDA device")
    run = stream_read_kernel()
    bufs, n_blocks = stream_read_buffers(nbytes, device, copies, max_bytes)
    part = _partials(device)

    def check() -> dict:
        part.fill_(float("nan"))
        run(bufs[0], part, n_blocks)
        torch.cuda.synchronize(device)
        err = _sum_error(part, bufs[0], n_blocks)
        return {"written": bool(torch.isfinite(part).all()), "rel_err": err, "tol": SUM_TOL, "ok": err <= SUM_TOL,
                "what": "partial sums against the float64 sum of every block read"}

    buffer_bytes = bufs[0].numel() * 2
    return ArmImpl([lambda b=b: run(b, part, n_blocks) for b in bufs], part, graph=True, keep=bufs, check=check,
                   info={"streamed_bytes": n_blocks * STREAM_BLOCK * 2, "buffers": len(bufs),
                         "buffer_bytes": buffer_bytes, "reads_per_buffer": n_blocks * STREAM_BLOCK * 2 / buffer_bytes})


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
                raise RuntimeError(f"triton stream sum {float(part.sum())} != float64 sum {_sums(x)[0]}")
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


def committed_read_roof(results_glob: str | None = None, *, root: str | None = None) -> dict:
    """The read roof a committed run measured, for where no GPU is here to measure one: by default the one notebook
    01's run of record measured (its record's `measure_bandwidth`: `results.notebook_record`); with
    `results_glob`, the newest full H200 benchmark run matching it (`find_results`). Returns {"gbps", "method",
    "run", "path", "committed", "said"}, `said` a sentence naming the run. Raises LookupError when there is none."""
    if results_glob is None:
        found = notebook_record("01_byte_floor", root=root)
        read = (found["record"].get("results") or {}).get("measure_bandwidth") or {}
        path = found["path"]
    else:
        found = find_results(results_glob, root=root)
        read = (found or {}).get("results", {}).get("roof", {}).get("read", {})
        what = f"no full H200 benchmark run with a measured read roof matched {results_glob!r}"
    if not read.get("gbps"):
        raise LookupError(f"no read roof in {path}" if results_glob is None else what)
    run = run_name(found["path"])
    state = "committed" if found["committed"] else "NOT committed"
    return {"gbps": float(read["gbps"]), "method": read.get("method"), "run": run, "path": found["path"],
            "committed": found["committed"],
            "said": f"read roof {read['gbps']:,.0f} GB/s ({read.get('method')}), measured by run {run} "
                    f"({found['path']}, {state})"}
