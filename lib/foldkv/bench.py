"""The paired timing harness: arms (foldkv's generated kernels and their peers) timed side by side in one process.

How a cell is timed (notes for whoever reads the numbers):
- Every arm gets the same logical inputs: one set of raw projections, prepped into a split pool, a folded pool and
  FlashInfer's layout of the split pool, with the same page ids. Each pool exists in several copies (different
  memory, same values) so that consecutive calls never find their pages in the 60 MB L2: copies are added until
  they hold at least `rotate_bytes` (4 x L2 by default), and a sample cycles through all of them.
- Each arm is warmed up eagerly (JIT builds, plans, first-use allocations), checked against a float32 torch
  reference (outputs poisoned with NaN first, so an unwritten element fails), then captured in a CUDA graph that
  calls it `inner` times per copy, enough for a sample to last `target_sample_us`. A graph replay is timed with CUDA
  events; an arm that cannot be captured is timed eagerly between the same events, and says so.
- Rounds interleave the arms, the order alternating (forward, then backward), so clock and thermal drift land on
  every arm alike. Each round gives one sample per arm; the figures are the median across rounds with p10/p90 and
  the IQR, plus paired per-round ratios between arms.
- The read roof is measured in the same process by a streaming-read kernel (Triton grid-stride sum, and a torch
  sum; the faster is the roof), at the start and end of the run. GB/s means 1e9 bytes/s.
- Byte model: a decode step must read the pool bytes of its context (tokens x bytes per token of the arm's format)
  plus the query and write the output (bf16) and LSE (float32). % of roof = those bytes / time / roof.
  Prefill FLOPs: 4 * C * (K - C/2) * Hq * D for a chunk of C queries at the end of a K-token context (causal).

Arms whose import fails (FlashInfer absent, a kernel module not written) are recorded "not run: <reason>"; an arm
that raises is recorded "error: <text>"; neither stops the others. Results are plain JSON-serialisable dicts.
"""

from __future__ import annotations

import datetime as _dt
import glob as _glob
import json
import math
import os
import platform
import subprocess
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from .config import GEMMA4_31B, AttentionGeometry
from .layout import KvFormat
from .peers import ArmImpl, ArmUnavailable
from .pool import BlockTable, PagedKvLayout, PagedKvPool

SCHEMA = "foldkv.bench/1"
RESULTS_NAME = "04_benchmarks.json"
L2_BYTES = 60 * 10**6  # the H200's L2, as the brief counts it
DEFAULT_ROTATE_BYTES = 4 * L2_BYTES
SINGLE_LENGTHS = (10_602, 40_002, 81_653, 163_336)
SWEEP_LENGTHS = tuple(1024 * 2**i for i in range(9))  # 1K .. 256K
BATCH_SIZES = (4, 16, 32)
PREFILL_CHUNK = 8192
PREFILL_CONTEXTS = (8192, 32_768, 81_653, 131_072)
DEFAULT_DECODE_ARMS = ("fi_cuda", "fi_tc", "torch", "split_jit", "folded_jit", "folded_aot")
DEFAULT_PREFILL_ARMS = ("fi_prefill", "split_jit", "folded_jit", "folded_aot")
CHECK_REL_TOL = 3e-2  # bf16 operands, split vs folded rounding of K: measured errors sit near 1e-2 at most


# ====================================================================================================================
# Byte and FLOP model
# ====================================================================================================================
def kv_bytes(seq_lens: Iterable[int], fmt: KvFormat | str, geom: AttentionGeometry = GEMMA4_31B,
             dtype: torch.dtype = torch.bfloat16) -> int:
    """Pool bytes the context occupies (tokens x Hkv x row width x element size); what a step must read."""
    per_token = PagedKvLayout(geom, KvFormat.parse(fmt), dtype=dtype).bytes_per_token
    return int(sum(int(n) for n in seq_lens)) * per_token


def decode_bytes(seq_lens: Sequence[int], fmt: KvFormat | str, geom: AttentionGeometry = GEMMA4_31B,
                 q_lens: Sequence[int] | None = None) -> dict:
    """Bytes one attention step moves at least: the context's pool bytes, the query read, the output (bf16) and
    LSE (float32) written. `q_lens` (default one query per request) also covers prefill chunks."""
    tokens = int(sum(q_lens)) if q_lens is not None else len(seq_lens)
    q = tokens * geom.num_q_heads * geom.head_dim * 2
    parts = {"kv": kv_bytes(seq_lens, fmt, geom), "query": q, "out": q, "lse": tokens * geom.num_q_heads * 4}
    parts["total"] = sum(parts.values())
    return parts


def prefill_flops(chunk: int, context: int, geom: AttentionGeometry = GEMMA4_31B) -> int:
    """4 * C * (K - C/2) * Hq * D: scores and P.V (2 FLOPs per MAC each) over the causal triangle of a C-query chunk
    at the end of a K-token context."""
    if not 0 < chunk <= context:
        raise ValueError(f"chunk {chunk} must be in 1..context {context}")
    return int(4 * chunk * (context - chunk / 2) * geom.num_q_heads * geom.head_dim)


def pool_bytes_at(context: int, fmt: KvFormat | str, geom: AttentionGeometry = GEMMA4_31B, page_size: int = 64,
                  layers: int = 1) -> int:
    """Pool bytes (whole pages) one request of `context` tokens holds, over `layers` global layers."""
    return PagedKvLayout.for_tokens(context, geometry=geom, format=KvFormat.parse(fmt), page_size=page_size).nbytes * layers


def ragged_lengths(batch: int, mean: int, seed: int = 0, spread: float = 0.75) -> list[int]:
    """`batch` request lengths drawn uniformly in mean x [1 - spread, 1 + spread], odd-sized (no page multiples)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=g, dtype=torch.float64)
    return [max(1, int(mean * (1 - spread + 2 * spread * float(x)))) | 1 for x in u]


# ====================================================================================================================
# Statistics
# ====================================================================================================================
def summarize(samples: Sequence[float]) -> dict:
    """Median, p10/p90, quartiles, IQR, min/max, mean and n of a list of samples (empty -> n 0 and None)."""
    x = np.asarray([float(s) for s in samples], dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "median": None, "p10": None, "p90": None, "q1": None, "q3": None, "iqr": None,
                "min": None, "max": None, "mean": None}
    p10, q1, med, q3, p90 = np.percentile(x, [10, 25, 50, 75, 90])
    return {"n": int(x.size), "median": float(med), "p10": float(p10), "p90": float(p90), "q1": float(q1),
            "q3": float(q3), "iqr": float(q3 - q1), "min": float(x.min()), "max": float(x.max()),
            "mean": float(x.mean())}


def paired_ratios(faster: Sequence[float], slower: Sequence[float]) -> dict:
    """Per-round ratios slower_i / faster_i (rounds are interleaved, so each pair saw the same card state)."""
    return summarize([b / a for a, b in zip(faster, slower) if a > 0])


def pct_of_roof(nbytes: int, us: float | None, roof_gbps: float | None) -> float | None:
    """100 * (bytes / time) / roof, with time in µs and the roof in GB/s (1e9 bytes/s)."""
    if not us or not roof_gbps:
        return None
    return 100.0 * nbytes / (us * 1e-6) / (roof_gbps * 1e9)


# ====================================================================================================================
# Roofs: streaming read (Triton and torch) and a bf16 matmul, measured in the run
# ====================================================================================================================
def _triton_stream_read():
    """A grid-stride streaming sum in Triton (imported here, lazily), or raise ImportError."""
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

    block = 4096

    def run(x: torch.Tensor, out: torch.Tensor) -> None:
        if x.numel() % block:
            raise ValueError(f"stream read needs a multiple of {block} elements, got {x.numel()}")
        stream_read_sum[(out.numel(),)](x, out, x.numel() // block, BLOCK=block, num_warps=8)

    return run


def _time_events(fn: Callable[[], Any], reps: int, warmup: int, cuda: bool = True) -> list[float]:
    """µs per call of fn, one sample per call: CUDA events, or the host clock when `cuda` is False."""
    for _ in range(warmup):
        fn()
    if not cuda:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in ev]


def measure_read_roof(device: torch.device | str, nbytes: int = 2 << 30, reps: int = 30, warmup: int = 5) -> dict:
    """The card's read roof: the faster of a Triton streaming sum and torch.sum over `nbytes` of random bf16
    (far larger than L2). Returns {"gbps", "method", "bytes", "methods": {name: stats or error}}."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = int(nbytes) // 8192 * 8192  # whole 4096-element blocks of bf16
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    methods: dict[str, Any] = {}
    if device.type == "cuda":
        try:
            run = _triton_stream_read()
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            part = torch.empty(sms * 4, dtype=torch.float32, device=device)
            us = _time_events(lambda: run(x, part), reps, warmup, cuda)
            ref = x.float().sum()
            if not torch.allclose(part.sum(), ref, rtol=1e-3, atol=1e-1 * math.sqrt(x.numel()) * 1e-3):
                raise RuntimeError(f"triton stream sum {float(part.sum())} != torch {float(ref)}")
            methods["triton_stream_sum"] = _roof_stats(nbytes, us)
        except Exception as exc:
            methods["triton_stream_sum"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    us = _time_events(lambda: x.sum(dtype=torch.float32), reps, warmup, cuda)
    methods["torch_sum"] = _roof_stats(nbytes, us)
    del x
    ok = {k: v for k, v in methods.items() if "gbps" in v}
    best = max(ok, key=lambda k: ok[k]["gbps"])
    return {"gbps": ok[best]["gbps"], "method": best, "bytes": nbytes, "methods": methods,
            "timer": "cuda events" if device.type == "cuda" else "host clock"}


def _roof_stats(nbytes: int, us: list[float]) -> dict:
    s = summarize(us)
    return {"gbps": nbytes / (s["median"] * 1e-6) / 1e9, "us": s}


def measure_matmul_roof(device: torch.device | str, n: int = 8192, reps: int = 20, warmup: int = 5) -> dict:
    """bf16 dense matmul rate (n x n x n, random operands), the ceiling prefill is held to. TFLOP/s = 1e12 FLOP/s."""
    device = torch.device(device)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    us = _time_events(lambda: torch.matmul(a, b, out=c), reps, warmup, device.type == "cuda")
    s = summarize(us)
    return {"tflops": 2 * n**3 / (s["median"] * 1e-6) / 1e12, "n": n, "us": s}


# ====================================================================================================================
# Inputs: one logical case, prepped into every format, in rotated copies
# ====================================================================================================================
class AttentionCase:
    """One attention problem (requests of `seq_lens` tokens, `q_lens` queries each at their last positions) with its
    inputs built on demand per format: pool copies (same values, different memory), the query, the block table."""

    def __init__(self, seq_lens: Sequence[int], *, device: torch.device | str, q_lens: Sequence[int] | None = None,
                 geom: AttentionGeometry = GEMMA4_31B, page_size: int = 64, seed: int = 0,
                 rotate_bytes: int = DEFAULT_ROTATE_BYTES, min_copies: int = 2, max_copies: int = 64,
                 fi_kv_layout: str = "NHD"):
        self.seq_lens = [int(n) for n in seq_lens]
        self.q_lens = [1] * len(self.seq_lens) if q_lens is None else [int(m) for m in q_lens]
        if len(self.q_lens) != len(self.seq_lens) or any(not 1 <= m <= n for m, n in zip(self.q_lens, self.seq_lens)):
            raise ValueError("q_lens must give 1 <= q_len <= seq_len for every request")
        self.device, self.geom, self.page_size, self.seed = torch.device(device), geom, page_size, seed
        self.rotate_bytes, self.min_copies, self.max_copies = rotate_bytes, min_copies, max_copies
        self.fi_kv_layout = fi_kv_layout
        g = torch.Generator(device="cpu").manual_seed(seed)
        d, hq, hkv = geom.head_dim, geom.num_q_heads, geom.num_kv_heads
        # Norm weights near Gemma's scale, k small enough that scores have a std of a few units (a softmax that is
        # neither flat nor one-hot): the kernels' cost does not depend on it, the accuracy check does.
        self.q_norm_weight = (1 + 0.1 * torch.randn(d, generator=g)).to(self.device)
        self.k_norm_weight = (0.1 * (1 + 0.1 * torch.randn(d, generator=g))).to(self.device)
        tokens = sum(self.q_lens)
        self.raw_q = torch.randn(tokens, hq, d, generator=g).to(self.device, torch.bfloat16)  # [T, Hq, D]
        self.positions = torch.cat([torch.arange(n - m, n) for m, n in zip(self.q_lens, self.seq_lens)])  # [T]
        self._kv_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
        self._pools: dict[KvFormat, list[PagedKvPool]] = {}
        self._fi: list[torch.Tensor] | None = None
        self._queries: dict[KvFormat, torch.Tensor] = {}
        self._table: BlockTable | None = None
        self._reference: dict | None = None

    # --- sizes ---------------------------------------------------------------------------------------------------
    def layout(self, fmt: KvFormat | str) -> PagedKvLayout:
        pages = sum(-(-n // self.page_size) for n in self.seq_lens)
        return PagedKvLayout(self.geom, KvFormat.parse(fmt), self.page_size, pages)

    def copies_for(self, fmt: KvFormat | str) -> int:
        """Copies so that a cycle through them reads at least rotate_bytes (so nothing is still in L2)."""
        one = max(1, self.layout(fmt).nbytes)
        return int(min(self.max_copies, max(self.min_copies, math.ceil(self.rotate_bytes / one))))

    # --- inputs ----------------------------------------------------------------------------------------------------
    @property
    def table_cpu(self) -> BlockTable:
        if self._table is None:
            lay = self.layout(KvFormat.FOLDED)
            scratch = PagedKvPool(lay, device="meta")  # only the allocator: page ids, scattered
            self._table = scratch.allocate(self.seq_lens, scatter_seed=self.seed + 1, pad_pages=1)
        return self._table

    @property
    def table(self) -> BlockTable:
        return self.table_cpu.to(self.device)

    def pools(self, fmt: KvFormat | str) -> list[PagedKvPool]:
        fmt = KvFormat.parse(fmt)
        if fmt not in self._pools:
            from .prep import fill_sequences

            lay = self.layout(fmt)
            first = PagedKvPool(lay, device=self.device)
            # Slots past a request's length hold finite garbage, as a reused page does in serving: an arm that reads
            # them into its softmax fails the check instead of passing on zeros.
            if self.device.type == "cpu":  # its own generator: the raw kv below must not depend on the format
                tail = torch.Generator(device="cpu").manual_seed(self._kv_seed + 1)
                first.data.copy_(torch.randn(lay.shape, generator=tail).to(lay.dtype))
            else:
                first.data.normal_(generator=torch.Generator(device=self.device).manual_seed(self._kv_seed))
            g = torch.Generator(device=self.device).manual_seed(self._kv_seed)  # the same draws for every format
            kv = [torch.randn(n, self.geom.num_kv_heads, self.geom.head_dim, generator=g, device=self.device,
                              dtype=torch.bfloat16) for n in self.seq_lens]  # raw projections [n, Hkv, D]
            fill_sequences(first, self.table_cpu, kv, self.k_norm_weight)
            del kv
            copies = [first] + [PagedKvPool(lay, data=first.data.clone()) for _ in range(self.copies_for(fmt) - 1)]
            self._pools[fmt] = copies
        return self._pools[fmt]

    def query(self, fmt: KvFormat | str) -> torch.Tensor:
        """The prepped query [T, Hq, D] (bf16) in the format's form."""
        from .prep import prep_query

        fmt = KvFormat.parse(fmt)
        if fmt not in self._queries:
            self._queries[fmt] = prep_query(self.geom, fmt, self.raw_q, self.q_norm_weight, self.k_norm_weight,
                                            self.positions.to(self.device)).contiguous()
        return self._queries[fmt]

    def flashinfer_kv(self) -> list[torch.Tensor]:
        """The split pool in FlashInfer's layout, one tensor per split copy."""
        from .peers import flashinfer_kv_from_split

        if self._fi is None:
            split = self.pools(KvFormat.SPLIT)
            first = flashinfer_kv_from_split(split[0], self.fi_kv_layout)
            self._fi = [first] + [first.clone() for _ in range(len(split) - 1)]
        return self._fi

    def check_rows(self, max_rows: int = 192) -> torch.Tensor:
        """Query rows the accuracy check compares: all of them for decode, a spread sample of a long chunk."""
        t = sum(self.q_lens)
        if t <= max_rows:
            return torch.arange(t)
        third = max_rows // 3
        g = torch.Generator().manual_seed(self.seed + 7)
        mid = torch.randperm(t - 2 * third, generator=g)[:third] + third
        return torch.cat([torch.arange(third), mid.sort().values, torch.arange(t - third, t)])

    def reference(self) -> dict:
        """Float32 torch attention on the split pool for the check rows: {"rows": idx, "out": [m, Hq, D] float32}."""
        from .peers import torch_attention_rows

        if self._reference is None:
            pool, q = self.pools(KvFormat.SPLIT)[0], self.query(KvFormat.SPLIT)
            table = self.table_cpu
            rows = self.check_rows()
            outs, start = [], 0
            for r, m in enumerate(self.q_lens):
                sel = rows[(rows >= start) & (rows < start + m)]
                if sel.numel():
                    outs.append(torch_attention_rows(pool, q[start:start + m], table, r, sel - start, m))
                start += m
            self._reference = {"rows": rows, "out": torch.cat(outs)}
        return self._reference

    def release(self) -> None:
        self._pools.clear()
        self._fi = None
        self._queries.clear()
        self._reference = None


# ====================================================================================================================
# Arms
# ====================================================================================================================
@dataclass(frozen=True)
class ArmSpec:
    """A named arm: what it is, which pool format its bytes are counted in, whether it is a peer (what a user would
    pick instead of foldkv) and whether it runs without CUDA."""

    name: str
    label: str
    format: str  # split | folded
    peer: bool
    build: Callable[[AttentionCase], ArmImpl]
    cpu_ok: bool = False
    generated: bool = False


GUARD_VALUE = 7.0  # sentinel in the row past each output: a kernel writing past its plan changes it


def _guarded_outputs(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """out [T, Hq, D] bf16 and lse [T, Hq] float32 as contiguous views of buffers one row longer, whose last row
    holds GUARD_VALUE (checked after each run: nothing past the plan may be written)."""
    t, hq, d = query.shape
    out_full = torch.empty(t + 1, hq, d, dtype=torch.bfloat16, device=query.device)  # [T + 1, Hq, D]
    lse_full = torch.empty(t + 1, hq, dtype=torch.float32, device=query.device)  # [T + 1, Hq]
    out_full[t:].fill_(GUARD_VALUE)
    lse_full[t:].fill_(GUARD_VALUE)
    return out_full[:t], lse_full[:t], [out_full[t:], lse_full[t:]]


def _require_aot_build() -> None:
    """backend="aot" needs an active build (foldkv.aot.use_build or $FOLDKV_AOT_DIR): without one the arm did not
    run, it did not fail."""
    try:
        from .aot import active_build

        active_build()
    except Exception as exc:
        raise ArmUnavailable(f"no AOT build ({type(exc).__name__}: {str(exc)[:200]})") from None


def aot_build_dir() -> str | None:
    """The active AOT build's folder, or None (never raises)."""
    try:
        from .aot import active_build

        b = active_build()
        return str(getattr(b, "path", None) or getattr(b, "root", None) or getattr(b, "dir", None) or b)
    except Exception:
        return None


def _generated_decode(fmt: KvFormat, backend: str) -> Callable[[AttentionCase], ArmImpl]:
    def build(case: AttentionCase) -> ArmImpl:
        try:
            from .kernels.decode import decode, plan_decode
        except Exception as exc:
            raise ArmUnavailable(f"foldkv.kernels.decode is not importable ({type(exc).__name__}: {str(exc)[:200]})") from None
        if backend == "aot":
            _require_aot_build()
        pools, query, table = case.pools(fmt), case.query(fmt), case.table
        plan = plan_decode(pools[0].layout, case.table_cpu.seq_lens, device=case.device)
        out, lse, guards = _guarded_outputs(query)
        calls = [lambda p=p: decode(p, query, table, plan=plan, out=out, lse=lse, backend=backend) for p in pools]
        # timed: check=False skips the host read-back of the table (checked by `calls` first), as a graph needs
        timed = [lambda p=p: decode(p, query, table, plan=plan, out=out, lse=lse, backend=backend, check=False)
                 for p in pools]
        return ArmImpl(calls, out, graph=True, timed_calls=timed,
                       info={"backend": backend, "lse": lse, "_guards": guards, "_keep": (plan,)})

    return build


def _generated_prefill(fmt: KvFormat, backend: str) -> Callable[[AttentionCase], ArmImpl]:
    def build(case: AttentionCase) -> ArmImpl:
        try:
            from .kernels.prefill import prefill
        except Exception as exc:
            raise ArmUnavailable(f"foldkv.kernels.prefill is not importable ({type(exc).__name__}: {str(exc)[:200]})") from None
        if backend == "aot":
            _require_aot_build()
        pools, query, table = case.pools(fmt), case.query(fmt), case.table
        q_lens = torch.tensor(case.q_lens, dtype=torch.int32, device=case.device)
        out, lse, guards = _guarded_outputs(query)
        calls = [lambda p=p: prefill(p, query, table, q_lens, out=out, lse=lse, backend=backend) for p in pools]
        return ArmImpl(calls, out, graph=False, why_eager="prefill launches are milliseconds long: timed eagerly",
                       info={"backend": backend, "lse": lse, "_guards": guards})

    return build


def _torch_decode(fmt: KvFormat) -> Callable[[AttentionCase], ArmImpl]:
    def build(case: AttentionCase) -> ArmImpl:
        from .peers import torch_decode_arm

        return torch_decode_arm(case.pools(fmt), case.query(fmt), case.table_cpu)

    return build


def _flashinfer_decode(tc: bool) -> Callable[[AttentionCase], ArmImpl]:
    def build(case: AttentionCase) -> ArmImpl:
        from .peers import _import_flashinfer, flashinfer_decode_arm

        _import_flashinfer()  # "not run" before any pool is built when FlashInfer is absent
        return flashinfer_decode_arm(case.flashinfer_kv(), case.query(KvFormat.SPLIT), case.table_cpu,
                                     num_kv_heads=case.geom.num_kv_heads, page_size=case.page_size,
                                     use_tensor_cores=tc, kv_layout=case.fi_kv_layout)

    return build


def _flashinfer_prefill(case: AttentionCase) -> ArmImpl:
    from .peers import _import_flashinfer, flashinfer_prefill_arm

    _import_flashinfer()
    return flashinfer_prefill_arm(case.flashinfer_kv(), case.query(KvFormat.SPLIT), case.table_cpu, case.q_lens,
                                  num_kv_heads=case.geom.num_kv_heads, page_size=case.page_size,
                                  kv_layout=case.fi_kv_layout)


S, F = KvFormat.SPLIT, KvFormat.FOLDED
DECODE_ARMS: dict[str, ArmSpec] = {a.name: a for a in (
    ArmSpec("fi_cuda", "FlashInfer decode, CUDA cores (use_tensor_cores=False)", "split", True, _flashinfer_decode(False)),
    ArmSpec("fi_tc", "FlashInfer decode, tensor cores (use_tensor_cores=True)", "split", True, _flashinfer_decode(True)),
    ArmSpec("torch", "plain torch (gather + bf16 matmul), split pool", "split", True, _torch_decode(S), cpu_ok=True),
    ArmSpec("torch_folded", "plain torch (gather + bf16 matmul), folded pool", "folded", False, _torch_decode(F),
            cpu_ok=True),
    ArmSpec("split_jit", "generated split (JIT)", "split", False, _generated_decode(S, "jit"), generated=True),
    ArmSpec("split_aot", "generated split (AOT)", "split", False, _generated_decode(S, "aot"), generated=True),
    ArmSpec("folded_jit", "generated folded (JIT)", "folded", False, _generated_decode(F, "jit"), generated=True),
    ArmSpec("folded_aot", "generated folded (AOT)", "folded", False, _generated_decode(F, "aot"), generated=True),
)}
PREFILL_ARMS: dict[str, ArmSpec] = {a.name: a for a in (
    ArmSpec("fi_prefill", "FlashInfer paged prefill (causal, hd512)", "split", True, _flashinfer_prefill),
    ArmSpec("split_jit", "generated split prefill (JIT)", "split", False, _generated_prefill(S, "jit"), generated=True),
    ArmSpec("split_aot", "generated split prefill (AOT)", "split", False, _generated_prefill(S, "aot"), generated=True),
    ArmSpec("folded_jit", "generated folded prefill (JIT)", "folded", False, _generated_prefill(F, "jit"),
            generated=True),
    ArmSpec("folded_aot", "generated folded prefill (AOT)", "folded", False, _generated_prefill(F, "aot"),
            generated=True),
)}


def _err_text(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {str(exc)[:400]}{where}"


def _reason(exc: BaseException) -> str:
    """The recorded reason: an ArmUnavailable's own sentence, else the exception's type, text and place."""
    return str(exc)[:400] if isinstance(exc, ArmUnavailable) else _err_text(exc)


def _not_run(exc: BaseException) -> bool:
    return isinstance(exc, (ArmUnavailable, ImportError))


# ====================================================================================================================
# Timing one cell
# ====================================================================================================================
class _Timed:
    """An arm ready to sample: a replay (graph) or an eager loop of `calls_per_sample` calls."""

    def __init__(self, name: str, run: Callable[[], None], calls_per_sample: int, timing: str, why_eager: str = ""):
        self.name, self.run, self.calls_per_sample = name, run, calls_per_sample
        self.timing, self.why_eager = timing, why_eager
        self.events: list = []
        self.samples_us: list[float] = []

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
    lse = impl.info.get("lse")
    if isinstance(lse, torch.Tensor):
        lse.fill_(float("nan"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(impl: ArmImpl, case: AttentionCase) -> dict:
    """Poison, run copy 0, check every output element was written and the rows match the float32 reference."""
    _poison(impl)
    impl.calls[0]()
    _sync(case.device)
    out = impl.out.float()
    written = bool(torch.isfinite(out).all())
    lse = impl.info.get("lse")
    lse_written = None if not isinstance(lse, torch.Tensor) else bool(torch.isfinite(lse).all())
    ref = case.reference()
    got = out[ref["rows"].to(out.device)]
    rel = float((got - ref["out"]).norm() / ref["out"].norm()) if written else float("nan")
    guards = impl.info.get("_guards") or []
    no_overrun = None if not guards else all(bool((g.float() == GUARD_VALUE).all()) for g in guards)
    ok = written and lse_written is not False and no_overrun is not False and rel <= CHECK_REL_TOL
    return {"written": written, "lse_written": lse_written, "no_overrun": no_overrun, "rel_err": rel,
            "tol": CHECK_REL_TOL, "ok": ok, "rows_checked": int(ref["rows"].numel())}


def _eager_us(steps: list[Callable[[], Any]]) -> float:
    """µs of one call, eagerly (median of 3 passes over the copies): sizes the graph."""
    return summarize(_time_events(lambda: [c() for c in steps], 3, 1))["median"] / len(steps)


def _prepare(name: str, impl: ArmImpl, case: AttentionCase, target_sample_us: float, max_inner: int) -> _Timed:
    dev = case.device
    steps = impl.timed_calls or impl.calls
    if dev.type != "cuda":
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
        side = torch.cuda.Stream(device=dev)  # warm up on a side stream before capture, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for c in steps:
                c()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        _sync(dev)
        # The replay must compute what an eager call computes (same last copy): a capture that silently recorded
        # nothing, or froze a host-side value, shows up here.
        _poison(impl)
        graph.replay()
        _sync(dev)
        replayed = impl.out.float().clone()
        _poison(impl)
        steps[-1]()
        _sync(dev)
        eager_out = impl.out.float()
        if not bool(torch.isfinite(replayed).all()):
            raise RuntimeError("graph replay left output elements unwritten (NaN poison survived)")
        diff = float((replayed - eager_out).norm() / eager_out.norm().clamp_min(1e-30))
        if diff > 1e-2:
            raise RuntimeError(f"graph replay differs from the eager call (rel {diff:.2e})")
    except Exception as exc:
        try:
            _sync(dev)
        except Exception:
            pass
        return _Timed(name, eager, len(calls), "cuda events, eager", f"graph capture failed: {_err_text(exc)}")
    t = _Timed(name, graph.replay, len(calls), "cuda graph")
    t._graph = graph  # keep alive
    return t


def run_cell(cell: str, kind: str, case: AttentionCase, arm_names: Sequence[str], *, rounds: int, warmup: int,
             roof: dict | None = None, matmul_roof: dict | None = None, target_sample_us: float = 2000.0,
             max_inner: int = 64, log: Callable[[str], None] = print, extra: dict | None = None) -> dict:
    """Build, check and time `arm_names` on one case, interleaved round by round; return the cell's result dict."""
    registry = DECODE_ARMS if kind == "decode" else PREFILL_ARMS
    geom = case.geom
    res: dict[str, Any] = {
        "cell": cell, "kind": kind, "batch": len(case.seq_lens), "seq_lens": case.seq_lens, "q_lens": case.q_lens,
        "context": max(case.seq_lens), "tokens": sum(case.seq_lens), "rounds": rounds, "warmup": warmup,
        "bytes": {f: decode_bytes(case.seq_lens, f, geom, case.q_lens)["total"] for f in ("split", "folded")},
        "pool_bytes": {f: case.layout(f).nbytes for f in ("split", "folded")},
        "copies": {f: case.copies_for(f) for f in ("split", "folded")},
        "arms": {}, "speedup": {},
    }
    if kind == "prefill":
        res["flops"] = sum(prefill_flops(m, n, geom) for m, n in zip(case.q_lens, case.seq_lens))
    if extra:
        res.update(extra)
    timed: list[_Timed] = []
    for name in arm_names:
        spec = registry.get(name)
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
            arm["check"] = _check(impl, case)
            t = _prepare(name, impl, case, target_sample_us, max_inner)
            arm.update(timing=t.timing, why_eager=t.why_eager, calls_per_sample=t.calls_per_sample,
                       copies=len(impl.calls), status="ok",
                       info={k: v for k, v in impl.info.items() if not k.startswith("_") and _jsonable(v)})
            if not arm["check"]["ok"]:
                arm["warning"] = (f"check failed (written={arm['check']['written']}, rel_err="
                                  f"{arm['check']['rel_err']:.3g}): timed anyway, flagged")
            t._impl = impl
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
            failed[t.name] = _err_text(exc)
            log(f"  {t.name}: error while timing: {failed[t.name]}")

    for t in timed:
        attempt(t, lambda t=t: [t.run() for _ in range(warmup)])
    try:
        _sync(case.device)
    except Exception as exc:  # a fault in some arm's kernel: the context is gone, every later step fails too
        raise RuntimeError(f"device fault after the warm-up replays: {_err_text(exc)}") from None
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
        t._graph = t._impl = t.run = None
    return res


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


# ====================================================================================================================
# A run: roofs + cells -> one JSON document
# ====================================================================================================================
def environment(device: torch.device | str) -> dict:
    from .peers import flashinfer_version

    device = torch.device(device)
    env = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "flashinfer": flashinfer_version(), "device_type": device.type}
    try:  # the installed version, without importing TileLang
        from importlib.metadata import version

        env["tilelang"] = version("tilelang")
    except Exception:
        env["tilelang"] = None
    env["aot_build"] = aot_build_dir()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device_name=p.name, capability=list(torch.cuda.get_device_capability(device)),
                   sms=p.multi_processor_count, memory_bytes=p.total_memory)
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()})"
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True,
                                           text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["git_commit"] = None
    return env


class BenchRun:
    """The results document of one notebook run, with the roofs measured at its start (and end)."""

    def __init__(self, device: torch.device | str, *, mode: str, params: dict, geom: AttentionGeometry = GEMMA4_31B,
                 log: Callable[[str], None] = print):
        self.device = torch.device(device)
        self.geom, self.log = geom, log
        self.results: dict[str, Any] = {
            "schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode, "params": params, "env": environment(self.device), "roof": {}, "cells": [],
        }

    @property
    def cells(self) -> list[dict]:
        return self.results["cells"]

    def resume(self, path: str) -> int:
        """Keep the cells of an earlier run of this notebook (a run split across commands by `sections`, each under
        the device's time limit): they are listed first, each tagged with the run it came from. Returns how many."""
        doc = load_results(path)
        kept = [dict(c, from_run=doc.get("created")) for c in doc.get("cells", [])]
        self.cells[:0] = kept
        self.results.setdefault("resumed_from", []).append(
            {"path": os.path.abspath(path), "created": doc.get("created"), "roof": doc.get("roof"),
             "env": doc.get("env"), "cells": len(kept)})
        return len(kept)

    def measure_roofs(self, *, read_bytes: int = 2 << 30, matmul_n: int = 8192, when: str = "start") -> dict:
        key = "read" if when == "start" else f"read_{when}"
        try:
            self.results["roof"][key] = measure_read_roof(self.device, read_bytes)
        except Exception as exc:
            self.results["roof"][key] = {"error": _err_text(exc)}
        if when == "start":
            try:
                self.results["roof"]["matmul"] = measure_matmul_roof(self.device, matmul_n)
            except Exception as exc:
                self.results["roof"]["matmul"] = {"error": _err_text(exc)}
        return self.results["roof"]

    def cell(self, cell: str, kind: str, seq_lens: Sequence[int], arms: Sequence[str], *, q_lens=None,
             rounds: int = 30, warmup: int = 3, seed: int = 0, case_kw: dict | None = None, **kw) -> dict:
        """Time one cell; failures of the whole cell (e.g. out of memory building inputs) are recorded, not raised."""
        t0 = time.perf_counter()
        case = None
        try:
            case = AttentionCase(seq_lens, q_lens=q_lens, device=self.device, geom=self.geom, seed=seed,
                                 **(case_kw or {}))
            res = run_cell(cell, kind, case, arms, rounds=rounds, warmup=warmup, roof=self.results["roof"].get("read"),
                           matmul_roof=self.results["roof"].get("matmul"), log=self.log, **kw)
        except Exception as exc:
            res = {"cell": cell, "kind": kind, "batch": len(seq_lens), "seq_lens": [int(n) for n in seq_lens],
                   "context": int(max(seq_lens)), "error": _err_text(exc), "arms": {}, "speedup": {}}
            self.log(f"{cell}: cell failed: {res['error']}")
        finally:
            if case is not None:
                case.release()
            del case
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        res["wall_s"] = time.perf_counter() - t0
        self.cells[:] = [c for c in self.cells if c.get("cell") != cell]  # a re-measured cell replaces a resumed one
        self.cells.append(res)
        return res

    def save(self, path: str | os.PathLike) -> str:
        return save_results(self.results, path)


def _clean(o: Any) -> Any:
    """NaN/inf -> None (strict JSON)."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def save_results(results: dict, path: str | os.PathLike) -> str:
    """Write a results document as strict JSON (NaN -> null), with the provenance of the code at save time (commit,
    dirty flag, sha256 of every kernel this process built or loaded: `foldkv.provenance.provenance`)."""
    from .provenance import provenance

    results["provenance"] = provenance()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(_clean(results), fh, indent=1, allow_nan=False)
    return path


def results_path(out_dir: str | None, name: str = RESULTS_NAME, *, root: str | None = None) -> tuple[str, str]:
    """Where a run writes its JSON: `out_dir`/name (relative to the repo root), or papermill_runs/_scratch (ignored
    by git) when out_dir is empty. A path git already tracks (a committed run) is never overwritten: the file goes
    to _scratch instead. Returns (path, a sentence saying where and why)."""
    root = root or repo_root()
    scratch = os.path.join(root, "papermill_runs", "_scratch", name)
    if not out_dir:
        return scratch, f"out_dir not given: writing to the git-ignored {scratch}"
    d = out_dir if os.path.isabs(out_dir) else os.path.join(root, out_dir)
    path = os.path.abspath(os.path.join(d, name))
    if path in _tracked([path], root):
        return scratch, f"{path} is a committed run and is never overwritten: writing to {scratch} instead"
    return path, f"writing to {path}"


def load_results(path: str | os.PathLike) -> dict:
    with open(path) as fh:
        doc = json.load(fh)
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    return doc


# ====================================================================================================================
# Redraw: find the last committed H200 results
# ====================================================================================================================
def repo_root() -> str:
    """The checkout foldkv is imported from (lib/foldkv/bench.py -> ../..)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_mode(mode: str) -> str:
    """"auto" -> "gpu" with a CUDA device, else "redraw"; "gpu", "redraw" and "cpu" (the harness on the CPU with the
    torch arms and a host clock: pipeline checks only, not a benchmark) pass through."""
    mode = str(mode).lower()
    if mode == "auto":
        return "gpu" if torch.cuda.is_available() else "redraw"
    if mode not in ("gpu", "redraw", "cpu"):
        raise ValueError(f"mode {mode!r}: expected auto, gpu, redraw or cpu")
    if mode == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("mode='gpu' but torch sees no CUDA device (use 'auto' to redraw instead)")
    return mode


def _tracked(paths: list[str], root: str) -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--", *paths], cwd=root, capture_output=True, text=True, timeout=20)
        if out.returncode != 0:
            return set()
        return {os.path.abspath(os.path.join(root, p)) for p in out.stdout.split()}
    except Exception:
        return set()


def find_results(results_glob: str, *, root: str | None = None, require_gpu: bool = True,
                 device_contains: str | None = "H200") -> dict | None:
    """The newest results document matching `results_glob` (relative to the repo root unless absolute) that is a
    full GPU run (not smoke) on a device whose name contains `device_contains`; git-tracked (committed) files win
    over untracked ones. Returns {"path", "committed", "results"} or None."""
    root = root or repo_root()
    pattern = results_glob if os.path.isabs(results_glob) else os.path.join(root, results_glob)
    paths = sorted(os.path.abspath(p) for p in _glob.glob(pattern, recursive=True))
    tracked = _tracked(paths, root)
    found = []
    for p in paths:
        try:
            doc = load_results(p)
        except Exception:
            continue
        if require_gpu and (doc.get("mode") != "gpu" or doc.get("params", {}).get("smoke")):
            continue
        name = str(doc.get("env", {}).get("device_name", ""))
        if device_contains and device_contains.lower() not in name.lower():
            continue
        found.append((p in tracked, doc.get("created", ""), p, doc))
    if not found:
        return None
    committed, _, path, doc = max(found, key=lambda f: (f[0], f[1]))
    return {"path": path, "committed": committed, "results": doc}


# ====================================================================================================================
# Reading results: series, tables, conclusions
# ====================================================================================================================
def cells_of(results: dict, prefix: str) -> list[dict]:
    return [c for c in results.get("cells", []) if str(c.get("cell", "")).startswith(prefix)]


def arm_names(results: dict, prefix: str = "") -> list[str]:
    names: list[str] = []
    for c in cells_of(results, prefix):
        for n in c.get("arms", {}):
            if n not in names:
                names.append(n)
    return names


def series(results: dict, prefix: str, arm: str, field: str = "us", stat: str = "median") -> tuple[list, list]:
    """(contexts, values) of one arm across the cells whose name starts with `prefix` (arms that ran only)."""
    xs, ys = [], []
    for c in sorted(cells_of(results, prefix), key=lambda c: c["context"]):
        a = c.get("arms", {}).get(arm, {})
        v = a.get(field)
        if a.get("status") == "ok" and v is not None:
            xs.append(c["context"])
            ys.append(v[stat] if isinstance(v, dict) else v)
    return xs, ys


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def arm_cell_text(arm: dict, kind: str = "decode") -> str:
    """One table cell: 'µs median [p10–p90] · % of roof', or the reason the arm did not run."""
    st = arm.get("status")
    if st != "ok":
        return f"{st}: {str(arm.get('reason', ''))[:90]}"
    us = arm["us"]
    txt = f"{_fmt(us['median'])} µs [{_fmt(us['p10'])}–{_fmt(us['p90'])}]"
    if kind == "prefill" and arm.get("tflops"):
        txt += f" · {_fmt(arm['tflops']['median'])} TFLOP/s"
        if arm.get("pct_matmul_roof") is not None:
            txt += f" ({_fmt(arm['pct_matmul_roof'], '.0f')}% mm)"
    elif arm.get("pct_roof"):
        txt += f" · {_fmt(arm['pct_roof']['median'], '.0f')}% roof"
    if arm.get("timing") and arm["timing"] != "cuda graph":
        txt += f" ({arm['timing']})"
    if arm.get("check") and not arm["check"].get("ok"):
        txt += " ⚠ check failed"
    return txt


def markdown_table(results: dict, prefix: str, arms: Sequence[str] | None = None) -> str:
    """A markdown table of the cells starting with `prefix`: one row per cell, one column per arm."""
    cells = cells_of(results, prefix)
    arms = list(arms or arm_names(results, prefix))
    head = "| cell | context | batch | " + " | ".join(arms) + " |"
    lines = [head, "|" + "---|" * (3 + len(arms))]
    for c in cells:
        kind = c.get("kind", "decode")
        row = [c["cell"], str(c.get("context")), str(c.get("batch"))]
        if c.get("error"):
            row += [f"cell error: {c['error'][:90]}"] + [""] * (len(arms) - 1)
        else:
            row += [arm_cell_text(c["arms"].get(a, {"status": "not run", "reason": "not requested"}), kind)
                    for a in arms]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def prediction_table(seq_lens_list: Sequence[Sequence[int]], roof_gbps: float | None,
                     geom: AttentionGeometry = GEMMA4_31B) -> str:
    """Written before timing: each case's bytes per format and the floor (bytes / roof) they imply, and the most a
    bandwidth-bound folded step can gain over a split one (the byte ratio)."""
    lines = ["| case | split MB | folded MB | split floor µs | folded floor µs | byte ratio split/folded |",
             "|---|---|---|---|---|---|"]
    for lens in seq_lens_list:
        sb, fb = (decode_bytes(lens, f, geom)["total"] for f in ("split", "folded"))
        fl = (lambda b: f"{b / (roof_gbps * 1e3):.1f}") if roof_gbps else (lambda b: "–")
        name = str(lens[0]) if len(lens) == 1 else f"{len(lens)} x ~{sum(lens) // len(lens)}"
        lines.append(f"| {name} | {sb / 1e6:.1f} | {fb / 1e6:.1f} | {fl(sb)} | {fl(fb)} | {sb / fb:.3f} |")
    return "\n".join(lines)


def best_folded(cell: dict) -> str | None:
    """The fastest folded generated arm that ran and passed its check."""
    ok = [(a["us"]["median"], n) for n, a in cell.get("arms", {}).items()
          if a.get("status") == "ok" and a.get("generated") and a.get("format") == "folded" and a["check"]["ok"]]
    return min(ok)[1] if ok else None


def verdicts(results: dict) -> list[dict]:
    """Per cell: the best folded arm against every peer that ran, with the ratio and, where folded is not ahead, a
    reason read off the data."""
    out = []
    roof = results.get("roof", {}).get("read", {}).get("gbps")
    for c in results.get("cells", []):
        f = best_folded(c)
        v: dict[str, Any] = {"cell": c["cell"], "kind": c.get("kind"), "context": c.get("context"),
                             "batch": c.get("batch"), "folded": f, "behind": [], "ahead": []}
        if f is None:
            why = c.get("error") or "; ".join(f"{n}: {a.get('status')} ({str(a.get('reason', a.get('warning', '')))[:80]})"
                                              for n, a in c.get("arms", {}).items()
                                              if a.get("generated") and a.get("format") == "folded")
            v["note"] = f"no folded arm ran and passed its check: {why or 'none requested'}"
            out.append(v)
            continue
        fa = c["arms"][f]
        for n, a in c["arms"].items():
            if not a.get("peer") or a.get("status") != "ok":
                continue
            sp = c["speedup"][f][n]
            entry = {"peer": n, "speedup": sp["ratio_of_medians"], "paired_p10": sp["paired"]["p10"],
                     "paired_p90": sp["paired"]["p90"]}
            if sp["ratio_of_medians"] > 1.0 and (sp["paired"]["p10"] or 0) > 1.0:
                v["ahead"].append(entry)
            else:
                reasons = []
                if sp["ratio_of_medians"] > 1.0:
                    reasons.append("ahead on the median but not in every round (p10 of the paired ratio ≤ 1)")
                if fa.get("floor_us") and fa["us"]["median"] > 3 * fa["floor_us"]:
                    reasons.append(f"folded runs at {fa['us']['median'] / fa['floor_us']:.1f}x its byte floor "
                                   f"({fa['floor_us']:.1f} µs): latency/overhead-bound, not bandwidth-bound")
                if a.get("pct_roof") and fa.get("pct_roof") and a["pct_roof"]["median"] > fa["pct_roof"]["median"]:
                    reasons.append(f"{n} reaches {a['pct_roof']['median']:.0f}% of roof on its own bytes vs folded's "
                                   f"{fa['pct_roof']['median']:.0f}%")
                if c.get("kind") == "prefill":
                    reasons.append("prefill is compute-bound: the fold saves bytes, not FLOPs")
                entry["reason"] = "; ".join(reasons) or "no reason visible in the data"
                v["behind"].append(entry)
        out.append(v)
    return out


def conclusions(results: dict) -> list[str]:
    """Sentences computed from a results document (no typed numbers): roof, single-request and batch summaries,
    and every cell where folded is not ahead of every peer, with the reason read off the data."""
    lines = []
    env, roof = results.get("env", {}), results.get("roof", {})
    rd = roof.get("read", {})
    if rd.get("gbps"):
        end = roof.get("read_end", {}).get("gbps")
        lines.append(f"Read roof on {env.get('device_name')}: {rd['gbps']:.0f} GB/s ({rd['method']})"
                     + (f", {end:.0f} GB/s at the end of the run" if end else "") + ".")
    if results.get("mode") != "gpu":
        lines.append(f"These timings come from mode={results.get('mode')!r} on {env.get('device_name')}: they check the "
                      "pipeline, they are not a benchmark.")
    for v in verdicts(results):
        c = next(c for c in results["cells"] if c["cell"] == v["cell"])
        if v["folded"] is None:
            lines.append(f"{v['cell']}: {v['note']}.")
            continue
        fa = c["arms"][v["folded"]]
        if c.get("kind") == "prefill" and fa.get("tflops"):  # compute-bound: against the measured bf16 MMA rate
            pct = f", {fa['tflops']['median']:.0f} TFLOP/s" + (
                f" ({fa['pct_matmul_roof']:.0f}% of the measured bf16 matmul rate)" if fa.get("pct_matmul_roof") else "")
        else:
            pct = f", {fa['pct_roof']['median']:.0f}% of roof" if fa.get("pct_roof") else ""
        head = f"{v['cell']} (context {v['context']}, batch {v['batch']}): {v['folded']} {fa['us']['median']:.1f} µs{pct}"
        if v["ahead"]:
            head += "; ahead of " + ", ".join(f"{e['peer']} {e['speedup']:.2f}x" for e in v["ahead"])
        if v["behind"]:
            head += "; NOT ahead of " + ", ".join(f"{e['peer']} ({e['speedup']:.2f}x: {e['reason']})" for e in v["behind"])
        if not v["ahead"] and not v["behind"]:
            head += "; no peer ran"
        if v["cell"].startswith(("single/", "batch/")):
            head += ". All arms: " + ", ".join(
                f"{n} {a['us']['median']:.1f} µs" + (f" ({a['pct_roof']['median']:.0f}% roof)" if a.get("pct_roof") else "")
                for n, a in c["arms"].items() if a.get("status") == "ok")
        lines.append(head + ".")
    not_run = sorted({f"{n}: {a.get('status')} ({str(a.get('reason'))[:120]})" for c in results.get("cells", [])
                      for n, a in c.get("arms", {}).items() if a.get("status") != "ok"})
    for s in not_run:
        lines.append(f"Arm {s}.")
    return lines


def open_results(path: str, *, root: str | None = None) -> dict:
    """An explicitly named results document to redraw: {"path", "committed", "results"} (no filtering: the banner
    says what it is)."""
    root = root or repo_root()
    p = os.path.abspath(path if os.path.isabs(path) else os.path.join(root, path))
    return {"path": p, "committed": p in _tracked([p], root), "results": load_results(p)}


def run_name(path: str | os.PathLike) -> str:
    """The run a results file belongs to: the name of its folder (its tag under papermill_runs/, e.g. h200-20261129-s2)."""
    return os.path.basename(os.path.dirname(os.path.abspath(os.fspath(path))))


def mark_redrawn(fig: Any, source_run: str | None) -> None:
    """Add "(redrawn from <run>, not measured now)" to the title of every axes of a matplotlib figure drawn from an
    earlier run's results; `source_run` None (measured now) leaves the figure as it is."""
    if not source_run:
        return
    mark = f"(redrawn from {source_run}, not measured now)"
    for ax in fig.axes:
        title = ax.get_title()
        ax.set_title(f"{title}\n{mark}" if title else mark)


def redraw_banner(found: dict | None, results_glob: str) -> str:
    if found is None:
        return (f"No CUDA device here, and no H200 results matched {results_glob!r}: nothing to redraw. "
                "Run this notebook on the H200 (mode='gpu') to produce them.")
    r = found["results"]
    state = "committed" if found["committed"] else "NOT committed (untracked file)"
    what = "H200" if "h200" in str(r.get("env", {}).get("device_name", "")).lower() else "NON-H200"
    kind = f"mode={r.get('mode')!r}" + (", smoke" if r.get("params", {}).get("smoke") else "")
    return (f"REDRAWING (nothing below was measured now): the {what} results ({kind}) of {r.get('created')} from {found['path']} ({state}, "
            f"device {r.get('env', {}).get('device_name')}, git {str(r.get('env', {}).get('git_commit'))[:10]}).")
