"""The random gate: seeded random decode and prefill cases over every GPU path, each against the float64 reference
with the gates' derived bounds, each failure printed with the one command that runs it again.

A case is drawn from (seed, index) alone (`draw_case`), so any one of a run is reproduced without the others:
`python -m foldkv.lab.random_gate --seed S --case I`. What is drawn: the batch (1 to 256), the lengths (1 to
262,144, page edges over-drawn: multiples of 64 and one either side, 1-3 tokens, the longest), the pool (folded,
split, FP8 folded), the path (eager `decode()`, the workspace's `plan()`, the workspace's `plan()` then
`advance()` to the lengths, each through the fused one-wave step or the three launches; or a prefill of random
chunks, an FP8 pool's read both ways), scattered pages, peaked or spread attention, and for the eager three-launch
decode fixed chunks and merge groups. The set-up is the gates' (`gates.make_inputs`: pages scattered, NaN outside
the written slots, an Inf page, poisoned page-table padding; outputs poisoned first; `gates.run_case`), the raw
projections drawn on the device. The budget: long lengths only in every LONG_EVERY-th case, a batch of 128-256
short requests in one more of each LONG_EVERY, the rest at most NORMAL_TOKENS tokens and a prefill at most
PREFILL_PAIRS (query, key) pairs, so that DEFAULT_CASES cases run in a few minutes on an H200.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from ..config import GEMMA4_31B, AttentionGeometry
from ..kernels.plan import DEFAULT_SMS, MAX_BATCH, MAX_LEN, plan_decode
from ..layout import KvFormat
from ..pool import PagedKvLayout
from .gates import (Case, GateInputs, decode_arm, make_inputs, prefill_arm, replay_workspace, run_case,
                    summary_row)

DEFAULT_CASES = 300
LONG_EVERY = 25  # case i is long when i % LONG_EVERY == LONG_EVERY - 1, wide when i % LONG_EVERY == WIDE_AT
WIDE_AT = 12
LONG_MIN = 65_536
NORMAL_TOKENS = 32_768  # the tokens of a normal case's batch, at most
WIDE_LEN = 512  # a wide case's longest request
PREFILL_PAIRS = 20_000_000  # (query, key) pairs of a normal prefill case, at most (the float64 reference's cost)
LONG_PREFILL_PAIRS = 400_000_000
PAGE = 64
POOLS = ("folded", "split", "fp8")
DECODE_PATHS = ("eager", "workspace-plan", "workspace-advance")
STEPS = ("fused", "three-launch")
FP8_ROWS = ("gather", "in_kernel")


@dataclass(frozen=True)
class RandomCase:
    """One drawn case. `path`: "eager", "workspace-plan", "workspace-advance" (decode) or "prefill"; `step`: the
    decode step drawn ("fused": one launch, one wave of bf16 rows; "three-launch"); `advance`: the workspace's
    advance() calls after a plan for the lengths less that many; `max_batch` / `max_len`: the workspace's size;
    `fp8_rows`: how a prefill reads an FP8 pool."""

    seed: int
    index: int
    size: str  # "normal", "long" or "wide"
    pool: str
    path: str
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None
    step: str | None = None
    advance: int = 0
    max_batch: int | None = None
    max_len: int | None = None
    chunk_tokens: int | None = None
    merge_group: int | None = None
    fp8_rows: str | None = None
    score_scale: float = 1.0
    scattered: bool = True

    @property
    def kind(self) -> str:
        return "prefill" if self.path == "prefill" else "decode"

    @property
    def format(self) -> KvFormat:
        return KvFormat.SPLIT if self.pool == "split" else KvFormat.FOLDED

    @property
    def dtype(self) -> torch.dtype:
        from ..fp8 import FP8_DTYPE

        return FP8_DTYPE if self.pool == "fp8" else torch.bfloat16

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def name(self) -> str:
        return f"random-{self.seed}-{self.index}"

    def gate_case(self) -> Case:
        """The gates' Case of these lengths (what `make_inputs` builds the hostile inputs from)."""
        return Case(self.name, self.seq_lens, q_lens=self.q_lens, chunk_tokens=self.chunk_tokens,
                    merge_group=self.merge_group, score_scale=self.score_scale, scattered=self.scattered)

    def reproduce(self) -> str:
        """The one command that runs this case again."""
        return f"python -m foldkv.lab.random_gate --seed {self.seed} --case {self.index}"

    def as_dict(self) -> dict:
        return asdict(self)


# --- the drawer ---------------------------------------------------------------------------------------------------
def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def draw_length(rng: np.random.Generator, lo: int, hi: int) -> int:
    """A length in [lo, hi], page edges over-drawn: 40% k x 64 - 1 / + 0 / + 1, 10% the smallest (lo .. lo + 2),
    10% hi or hi - 1, else log-uniform."""
    u = rng.random()
    if u < 0.4:
        k = _log_uniform(rng, max(1, lo // PAGE), max(1, hi // PAGE))
        n = k * PAGE + int(rng.integers(-1, 2))
    elif u < 0.5:
        n = lo + int(rng.integers(0, 3))
    elif u < 0.6:
        n = hi - int(rng.integers(0, 2))
    else:
        n = _log_uniform(rng, lo, hi)
    return int(min(hi, max(lo, n)))


def _q_lens(rng: np.random.Generator, lens: list[int], pairs: int) -> tuple[int, ...]:
    """Prefill chunks: 20% one token, 20% the whole sequence, 20% from a page edge to the end, else uniform; then
    the largest halved until the (query, key) pairs fit `pairs`."""
    q = []
    for n in lens:
        u = rng.random()
        if u < 0.2:
            m = 1
        elif u < 0.4:
            m = n
        elif u < 0.6:
            m = n - PAGE * int(rng.integers(0, (n - 1) // PAGE + 1))
        else:
            m = int(rng.integers(1, n + 1))
        q.append(m)
    while sum(m * n for m, n in zip(q, lens)) > pairs:
        r = int(np.argmax([m * n for m, n in zip(q, lens)]))
        q[r] = max(1, q[r] // 2)
    return tuple(q)


def _eager_plan_fused(pool: str, lens: tuple[int, ...], chunk_tokens: int | None, merge_group: int | None) -> bool:
    """Whether the eager decode's plan for these lengths is one fused launch on an H200 (DEFAULT_SMS), host only."""
    lay = PagedKvLayout(format=KvFormat.SPLIT if pool == "split" else KvFormat.FOLDED)
    plan = plan_decode(lay, lens, device="cpu", chunk_tokens=chunk_tokens, merge_group=merge_group,
                       num_sms=DEFAULT_SMS)
    return plan.fused and pool != "fp8"


def draw_case(seed: int, index: int, geom: AttentionGeometry = GEMMA4_31B) -> RandomCase:
    """Case `index` of the run of `seed` (module docstring), from (seed, index) alone."""
    rng = np.random.default_rng([int(seed), int(index)])
    size = ("long" if index % LONG_EVERY == LONG_EVERY - 1 else "wide" if index % LONG_EVERY == WIDE_AT
            else "normal")
    pool = POOLS[int(rng.integers(0, len(POOLS)))]
    prefill = rng.random() < 0.3
    if size == "long":
        batch = int(rng.integers(1, 5))
        lens = [draw_length(rng, LONG_MIN, MAX_LEN)] + [draw_length(rng, 1, 4096) for _ in range(batch - 1)]
        rng.shuffle(lens)
    elif size == "wide":
        batch = int(rng.integers(128, MAX_BATCH + 1)) if not prefill else int(rng.integers(32, 65))
        lens = [draw_length(rng, 1, WIDE_LEN) for _ in range(batch)]
    else:
        batch = _log_uniform(rng, 1, MAX_BATCH if not prefill else 64)
        hi = max(1, min(MAX_LEN, NORMAL_TOKENS // batch))
        lens = [draw_length(rng, 1, hi) for _ in range(batch)]
    score_scale = float(rng.choice([1.0, 1.0, 4.0, 0.05]))
    kw = dict(seed=int(seed), index=int(index), size=size, pool=pool, score_scale=score_scale,
              scattered=bool(rng.random() < 0.85))
    if prefill:
        pairs = LONG_PREFILL_PAIRS if size == "long" else PREFILL_PAIRS
        return RandomCase(path="prefill", seq_lens=tuple(lens), q_lens=_q_lens(rng, lens, pairs),
                          fp8_rows=FP8_ROWS[int(rng.integers(0, 2))] if pool == "fp8" else None, **kw)
    path = DECODE_PATHS[int(rng.integers(0, len(DECODE_PATHS)))]
    want_fused = pool != "fp8" and rng.random() < 0.6
    if path == "eager":
        chunk_tokens = merge_group = None
        if not want_fused and rng.random() < 0.3:  # fixed chunks: at most 2,048 of them
            least = -(-max(lens) // 2048 // PAGE) * PAGE
            chunk_tokens = max(PAGE, least, PAGE * int(rng.integers(1, 9)))
        if not want_fused and rng.random() < 0.3:
            merge_group = int(rng.integers(1, 9))
        lens = tuple(lens)
        fused = want_fused and _eager_plan_fused(pool, lens, None, None)
        return RandomCase(path=path, seq_lens=lens, step="fused" if fused else "three-launch",
                          chunk_tokens=chunk_tokens, merge_group=merge_group, **kw)
    wave = DEFAULT_SMS // geom.num_kv_heads  # chunks of one wave on an H200
    fused = want_fused and batch <= wave
    advance = int(rng.integers(1, 4)) if path == "workspace-advance" else 0
    lens = tuple(max(n, advance + 1) for n in lens)
    max_batch = min(wave if fused else MAX_BATCH, batch + int(rng.integers(0, 4)))
    max_len = min(MAX_LEN, max(lens) + int(rng.integers(0, 2 * PAGE)))
    return RandomCase(path=path, seq_lens=lens, step="fused" if fused else "three-launch", advance=advance,
                      max_batch=max_batch, max_len=max_len, **kw)


def draw_cases(seed: int, count: int = DEFAULT_CASES) -> list[RandomCase]:
    return [draw_case(seed, i) for i in range(count)]


def coverage(cases: list[RandomCase]) -> dict:
    """What the cases cover: counts per pool, path, step, size, fp8 read; the page edges and extremes drawn."""
    lens = [n for c in cases for n in c.seq_lens]
    def count(key) -> dict[str, int]:
        values = [str(key(c)) for c in cases]
        return {v: values.count(v) for v in sorted(set(values))}

    return {"cases": len(cases), "pool": count(lambda c: c.pool), "path": count(lambda c: c.path),
            "step": count(lambda c: f"{c.path} {c.step}"), "size": count(lambda c: c.size),
            "fp8_rows": count(lambda c: c.fp8_rows), "batch_min": min(len(c.seq_lens) for c in cases),
            "batch_max": max(len(c.seq_lens) for c in cases), "len_min": min(lens), "len_max": max(lens),
            "page_edges": sum(1 for n in lens if n % PAGE in (0, 1, PAGE - 1)),
            "fixed_chunks": sum(c.chunk_tokens is not None for c in cases),
            "merge_groups": sum(c.merge_group is not None for c in cases),
            "tokens": sum(c.tokens for c in cases),
            "prefill_pairs": sum(m * n for c in cases if c.q_lens for m, n in zip(c.q_lens, c.seq_lens))}


# --- the runner ---------------------------------------------------------------------------------------------------
def case_raw(case: RandomCase, device: torch.device | str, geom: AttentionGeometry = GEMMA4_31B) -> dict:
    """The case's raw projections drawn on `device` (as `gates.make_inputs` draws them on the CPU: kv per request,
    q for its queries, the norm weights, the q_norm weight scaled by score_scale / 4)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(case.seed * 100_003 + case.index)
    q_rows = sum(case.q_lens) if case.q_lens is not None else len(case.seq_lens)
    rand = dict(generator=g, device=device)
    return {
        "kv": [torch.randn(n, geom.num_kv_heads, geom.head_dim, **rand) for n in case.seq_lens],
        "q": torch.randn(q_rows, geom.num_q_heads, geom.head_dim, **rand),
        "q_norm_weight": (torch.rand(geom.head_dim, **rand) * 0.5 + 0.75) * case.score_scale * 0.25,
        "k_norm_weight": torch.rand(geom.head_dim, **rand) * 0.5 + 0.75,
    }


def case_inputs(case: RandomCase, device: torch.device | str) -> GateInputs:
    """The gates' hostile inputs for the case on `device` (pool of the case's format and dtype)."""
    return make_inputs(case.gate_case(), case.format, device, case.seed + case.index, raw=case_raw(case, device),
                       dtype=case.dtype)


def workspace_for(case: RandomCase, inputs: GateInputs, num_sms: int | None = None):
    """A DecodeWorkspace of the case's size, planned for its lengths less `advance` with its (poisoned) block
    table: the fused step's workspace has one wave of chunks (SMs / KV heads), the other its default count."""
    from ..kernels.plan import device_sms
    from ..kernels.workspace import DecodeWorkspace

    lay = inputs.pool.layout
    sms = device_sms(inputs.pool.device) if num_sms is None else num_sms
    chunks = max(sms // lay.geometry.num_kv_heads, case.max_batch) if case.step == "fused" else None
    ws = DecodeWorkspace(lay, max_batch=case.max_batch, max_len=case.max_len, device=inputs.pool.device,
                         num_chunks=chunks, num_sms=sms)
    width = lay.pages_for(max(case.seq_lens))
    ws.plan([n - case.advance for n in case.seq_lens], inputs.table.page_ids[:, :width].contiguous())
    return ws


def workspace_arm(case: RandomCase, backend: str = "jit") -> Callable:
    """The case through its workspace: planned, the step captured, `advance` advance() calls, outputs poisoned,
    the graph replayed; the rows copied into run_case's (poisoned) outputs."""
    def launch(inputs: GateInputs, out: torch.Tensor, lse: torch.Tensor):
        return replay_workspace(workspace_for(case, inputs), inputs, out, lse, backend=backend,
                                fused=case.step == "fused", advance=case.advance)

    launch.fp8_math = None  # the workspace's default partial: run_case picks its bound
    return launch


def arm(case: RandomCase, backend: str = "jit") -> Callable:
    """The launcher under test for the case's path and step."""
    if case.path == "prefill":
        return prefill_arm(backend, case.fp8_rows or "gather")
    if case.path == "eager":
        return decode_arm(backend, fused=case.step == "fused")
    return workspace_arm(case, backend)


def run_random_case(case: RandomCase, device: torch.device | str = "cuda", backend: str = "jit",
                    launch: Callable | None = None) -> dict:
    """One case through `gates.run_case` (`launch`: an arm standing in for the case's; default `arm(case)`). A row:
    the case, its checks, "passed", and "reproduce" (the command); an exception is a failed row with its error."""
    t0 = time.perf_counter()
    row = {"index": case.index, "size": case.size, "pool": case.pool, "path": case.path, "step": case.step,
           "fp8_rows": case.fp8_rows, "batch": len(case.seq_lens), "tokens": case.tokens,
           "max_seq_len": max(case.seq_lens), "reproduce": case.reproduce()}
    try:
        inputs = case_inputs(case, device)
        res = run_case(inputs, launch or arm(case, backend))
        row.update({k: v for k, v in summary_row(inputs.case, inputs.format, case.path, res).items()
                    if k not in ("case", "format", "arm", "tokens", "batch")})
        del inputs, res
    except Exception as exc:  # noqa: BLE001 (a case that raises is a failed case, the run goes on)
        row.update(passed=False, error=f"{type(exc).__name__}: {exc}")
    row["seconds"] = time.perf_counter() - t0
    if torch.device(device).type == "cuda" and (case.size != "normal" or not row["passed"]):
        torch.cuda.empty_cache()
    return row


def random_gate(seed: int, count: int = DEFAULT_CASES, *, device: torch.device | str = "cuda", backend: str = "jit",
                indices=None, out=sys.stdout) -> dict:
    """Cases `indices` (default 0 .. count-1) of the run of `seed`; each failure's reproduce command printed to
    `out`. Returns {"rows", "coverage", "failed", "passed", "seconds"}."""
    cases = [draw_case(seed, i) for i in (range(count) if indices is None else indices)]
    t0 = time.perf_counter()
    rows = []
    for case in cases:
        row = run_random_case(case, device, backend)
        rows.append(row)
        if not row["passed"] and out is not None:
            why = row.get("error") or ", ".join(k for k in ("elementwise_ok", "rel_ok", "lse_ok", "all_written",
                                                            "past_plan_untouched", "pool_untouched")
                                                if not row.get(k, True))
            print(f"FAILED case {case.index} ({case.pool} {case.path} {case.step or ''} batch {len(case.seq_lens)},"
                  f" longest {max(case.seq_lens)}): {why}\n  reproduce: {case.reproduce()}", file=out)
    failed = [r["index"] for r in rows if not r["passed"]]
    return {"seed": seed, "rows": rows, "coverage": coverage(cases), "failed": failed, "passed": not failed,
            "seconds": time.perf_counter() - t0}


def random_gate_section(seed: int, record, count: int = DEFAULT_CASES) -> dict | None:
    """Notebook 02's section: `random_gate` recorded as `random_gate` (not run without CUDA)."""
    if not record.cuda_or_not_run("random_gate"):
        print(record.sections["random_gate"])
        return None
    res = random_gate(seed, count)
    record.ran("random_gate", rows=res["rows"], coverage=res["coverage"], failed=res["failed"],
               passed=res["passed"], seconds=res["seconds"])
    return res


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m foldkv.lab.random_gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, action="append", help="run only this case (repeatable)")
    p.add_argument("--cases", type=int, default=DEFAULT_CASES, help="cases of the run (without --case)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="jit", choices=("jit", "aot"))
    p.add_argument("--show", action="store_true", help="print the cases drawn, run nothing")
    return p.parse_args(argv)


def case_of_command(command: str) -> RandomCase:
    """The case a reproduce command runs (its --seed and single --case)."""
    words = shlex.split(command)
    args = parse_args(words[words.index("foldkv.lab.random_gate") + 1:])
    if not args.case or len(args.case) != 1:
        raise ValueError(f"{command!r} names no single case")
    return draw_case(args.seed, args.case[0])


def main(argv=None) -> int:
    args = parse_args(argv)
    indices = args.case if args.case else range(args.cases)
    if args.show:
        for i in indices:
            print(draw_case(args.seed, i))
        print(coverage([draw_case(args.seed, i) for i in indices]))
        return 0
    res = random_gate(args.seed, device=args.device, backend=args.backend, indices=indices)
    for row in res["rows"] if args.case else ():
        print(row)
    print(f"{len(res['rows']) - len(res['failed'])} of {len(res['rows'])} cases passed in {res['seconds']:.0f} s")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
