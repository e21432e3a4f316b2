"""Prefill kernel probe: the library's prefill (folded and split) and the folded versions in bench/versions/, first
gated on a small hostile case against the float64 reference, then timed on a 4,096-query chunk at the end of 8K and of
32K tokens of context (batch 1), against the bf16 matmul rate measured in the same run. One device call:

    source .devsite/env.sh; export PYTHONPATH=$PWD/lib:$PYTHONPATH; python3 bench/prefill_kernel_probe.py --out $OUT

Stages, each printed as it goes and written to --out/prefill_kernel_probe.json as soon as it ends (a call cut short
keeps what it finished):
  1. build every arm's kernel, each in its own process at once (TileLang's JIT is ~20-60 s a kernel, single-threaded;
     the processes fill TileLang's disk cache, the probe then loads from it);
  2. the gate: `foldkv.lab.gates.run_case` on HOSTILE (lengths 1, 63, 65, 4,100 and a chunk starting mid-page; NaN
     and Inf in unused pages, poisoned page-table padding; outputs NaN-poisoned before the launch, every planned
     element checked written and finite, rows past the plan untouched, the pool unchanged) through the launcher's
     public `kernels=`. An arm that fails is reported and not timed;
  3. the bf16 torch.matmul rate before and after the timing cells (`matmul_rates`: 8192^3, the rate the issue's
     floor is taken at and the % column's; and [32,768 x 512] @ [512 x 8,192], the score gemm's depth, reported);
  4. each cell in CELLS through `foldkv.lab.bench.run_cell`: arms interleaved round by round in alternating order,
     pool copies rotated past L2, outputs checked again against the float64 reference on sampled rows, warm-up
     replays, median of --rounds (CUDA events), TFLOP/s (4 C (K - C/2) 32 512) and % of the matmul rate.
Notes and predictions: bench/PREFILL_NOTES.md ("Why 43-54% of the matmul rate, and the two-stage folded row").
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # bench/versions/ as `versions.<name>`, as the harnesses import them
    sys.path.insert(0, str(BENCH))

CHUNK = 4096
PAGE = 64  # the page size of the gate's pools (`gates.make_inputs`) and of the timing cells' (`AttentionCase`)
CELLS = ((CHUNK, 8192), (CHUNK, 32768))  # (queries, context): the chunk is the context's last CHUNK positions
# The gate's case: (seq_lens, q_lens). One token alone; a partial first page (63) and one token past a page (65), each
# its whole prompt; 4,100 tokens (4 past a 64-page boundary) with 1,027 queries (a partial last tile of 3 tokens);
# a 97-query chunk starting mid-page (at 903 = 14 pages + 7).
HOSTILE = ((1, 63, 65, 4100, 1000), (1, 63, 65, 1027, 97))
# arm -> (format, version module in bench/versions/ or None for the library's kernel)
ARMS = {
    "library_folded": ("folded", None),
    "library_split": ("split", None),
    "two_stages": ("folded", "prefill_folded_two_stages"),
    "two_stages_batched": ("folded", "prefill_folded_two_stages_batched"),
    "lazy_rescale": ("folded", "prefill_folded_lazy_rescale"),
    "seesaw_async": ("folded", "prefill_folded_seesaw_async"),
}


def version_module(name: str):
    return importlib.import_module(f"versions.{name}")


def kernel_name(fmt: str) -> str:
    from foldkv.kernels.prefill import variant_name

    return variant_name(fmt)


@functools.lru_cache(maxsize=None)
def arm_kernel(arm: str, page_size: int):
    """The kernel an arm replaces the library's with ({} for a library arm): the launcher's `kernels=`, built with
    the library's registered params (each version keeps its own stage count), once a process."""
    from foldkv import GEMMA4_31B
    from foldkv.kernels.resolve import kernel_params

    fmt, version = ARMS[arm]
    if version is None:
        return {}
    params = kernel_params(kernel_name(fmt), {"page_size": page_size})
    return {kernel_name(fmt): version_module(version).build(GEMMA4_31B, **params)}


def _build_one(arm: str) -> tuple[str, float, str | None]:
    """Process body: build (or find in TileLang's cache) one arm's kernel. Returns (arm, seconds, error)."""
    t = time.time()
    try:
        if ARMS[arm][1] is None:
            from foldkv import GEMMA4_31B, KvFormat
            from foldkv.kernels import resolve
            from foldkv.kernels.resolve import kernel_params

            fmt = KvFormat.parse(ARMS[arm][0])
            name = kernel_name(fmt)
            resolve.kernel(name, GEMMA4_31B, kernel_params(name, {"page_size": PAGE}), "jit")
        else:
            arm_kernel(arm, PAGE)
        return arm, time.time() - t, None
    except Exception as exc:  # reported by the parent, which then leaves the arm out
        return arm, time.time() - t, f"{type(exc).__name__}: {str(exc)[:400]}"


def build_all(arms: list[str], log) -> dict:
    """Every arm's kernel built at once, one process each (spawned: no CUDA state is inherited)."""
    t = time.time()
    with mp.get_context("spawn").Pool(len(arms)) as pool:
        done = pool.map(_build_one, arms)
    res = {a: {"seconds": round(s, 1), "error": e} for a, s, e in done}
    for a, r in res.items():
        log(f"  built {a}: {r['seconds']} s" + (f"  ERROR {r['error']}" if r["error"] else ""))
    log(f"built {len(arms)} kernels in {time.time() - t:.0f} s")
    return res


def gate(arms: list[str], device, log, seed: int = 7) -> dict:
    """Each arm on HOSTILE through the launcher's `kernels=`: `gates.run_case` (module docstring)."""
    import torch

    from foldkv import KvFormat
    from foldkv.kernels.prefill import prefill
    from foldkv.lab import gates

    case = gates.Case("hostile", HOSTILE[0], q_lens=HOSTILE[1])
    inputs = {}
    res = {}
    for arm in arms:
        fmt = KvFormat.parse(ARMS[arm][0])
        if fmt not in inputs:
            inputs[fmt] = gates.make_inputs(case, fmt, device, seed)
        kernels = arm_kernel(arm, PAGE) or None

        def launch(inp, out, lse, kernels=kernels):
            return prefill(inp.pool, inp.query, inp.table, inp.q_lens, out=out, lse=lse, kernels=kernels)

        t = time.time()
        try:
            r = gates.summary_row(case, fmt, arm, gates.run_case(inputs[fmt], launch))
        except Exception as exc:
            r = {"passed": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            try:
                torch.cuda.synchronize()
            except Exception:  # a device fault: every later launch fails too, and says so
                pass
        res[arm] = r
        log(f"  gate {arm}: {'PASS' if r.get('passed') else 'FAIL'} in {time.time() - t:.1f} s "
            f"(rel {r.get('rel_fro', float('nan')):.2e}, max|err| {r.get('max_abs', float('nan')):.2e}, "
            f"written {r.get('all_written')}, past plan untouched {r.get('past_plan_untouched')}, "
            f"lse {r.get('lse_ok')}) {r.get('error', '')}")
    return res


def time_cells(arms: list[str], device, rounds: int, log, done) -> None:
    """Each cell of CELLS through `run_cell`, every arm in it; `done(cell)` as each ends."""
    from foldkv import KvFormat
    from foldkv.lab.bench import ArmSpec, AttentionCase, generated_arm, run_cell

    specs = [ArmSpec(arm, f"{arm} (prefill_kernel_probe)", ARMS[arm][0], False,
                     generated_arm("prefill", KvFormat.parse(ARMS[arm][0]), "jit",
                                   kernels=(lambda case, arm=arm: arm_kernel(arm, case.page_size))
                                   if ARMS[arm][1] else None), generated=True)
             for arm in arms]
    for chunk, context in CELLS:
        t = time.time()
        case = AttentionCase([context], q_lens=[chunk], device=device)
        cell = run_cell(f"prefill_{chunk}_at_{context}", "prefill", case, specs, rounds=rounds, warmup=2,
                        matmul_roof=None, log=log)
        case.release()
        log(f"  cell {chunk} at {context}: {cell['flops'] / 1e12:.2f} TFLOP, {time.time() - t:.0f} s")
        done(cell)


def matmul_rates(device) -> dict:
    """bf16 torch.matmul rates in TFLOP/s: the square 8192^3 the issue's floor is taken at (`measure_matmul_roof`),
    and the score gemm's depth: [32,768 x 512] @ [512 x 8,192] (a chunk's 4,096 queries x one KV group's 8 heads
    against 8K keys, K = head_dim 512)."""
    import torch

    from foldkv.lab.bench import measure_matmul_roof, summarize, time_events

    a = torch.randn(32768, 512, dtype=torch.bfloat16, device=device)
    b = torch.randn(512, 8192, dtype=torch.bfloat16, device=device)
    c = torch.empty(32768, 8192, dtype=torch.bfloat16, device=device)
    us = summarize(time_events(lambda: torch.matmul(a, b, out=c), 20, 5))["median"]
    return {"square_8192": measure_matmul_roof(device)["tflops"],
            "k512_32768x8192": 2 * 32768 * 512 * 8192 / (us * 1e-6) / 1e12}


def rates(cells: list[dict], roof_tflops: float) -> list[dict]:
    """Per cell and arm: median ms, TFLOP/s, % of the matmul rate, the check; ratios to library_folded."""
    rows = []
    for cell in cells:
        base = cell["arms"].get("library_folded", {})
        for name, a in cell["arms"].items():
            row = {"cell": cell["cell"], "arm": name, "status": a.get("status"), "reason": a.get("reason")}
            if a.get("status") == "ok":
                tf = cell["flops"] / (a["us"]["median"] * 1e-6) / 1e12
                row.update(ms=a["us"]["median"] / 1e3, p10_ms=a["us"]["p10"] / 1e3, p90_ms=a["us"]["p90"] / 1e3,
                           tflops=tf, pct_matmul=100 * tf / roof_tflops, check_ok=a["check"]["ok"],
                           rel_err=a["check"]["rel_err"])
                if base.get("status") == "ok":
                    row["speedup_vs_library_folded"] = base["us"]["median"] / a["us"]["median"]
            rows.append(row)
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for prefill_kernel_probe.json")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-build", action="store_true", help="skip the parallel build (kernels already cached)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from foldkv.lab.jsonsafe import jsonable
    from foldkv.lab.report import environment

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "prefill_kernel_probe.json")
    t0 = time.time()

    def log(s: str) -> None:
        print(f"[{time.time() - t0:6.1f} s] {s}", flush=True)

    result: dict = {"cells": [list(c) for c in CELLS], "hostile": [list(h) for h in HOSTILE], "arms": args.arms}

    def save() -> None:
        with open(path, "w") as fh:
            json.dump(jsonable(result), fh, indent=1, allow_nan=False)

    dev = torch.device("cuda")
    result["env"] = environment(dev)
    arms = list(args.arms)
    if not args.no_build:
        result["build"] = build_all(arms, log)
        arms = [a for a in arms if not result["build"][a]["error"]]
        save()
    result["gate"] = gate(arms, dev, log)
    save()
    timed = [a for a in arms if result["gate"][a].get("passed")]
    roof = [matmul_rates(dev)]
    log(f"bf16 matmul {roof[0]} TFLOP/s")
    result["cell_results"] = []

    def cell_done(cell: dict) -> None:
        result["cell_results"].append(cell)
        save()

    if timed:
        time_cells(timed, dev, args.rounds, log, cell_done)
    roof.append(matmul_rates(dev))
    log(f"bf16 matmul {roof[1]} TFLOP/s (after the cells)")
    roof_tflops = sum(r["square_8192"] for r in roof) / len(roof)  # the rate the issue's floor is taken at
    result["matmul_roof"] = {"runs": roof, "tflops": roof_tflops}
    result["rates"] = rates(result["cell_results"], roof_tflops)
    from foldkv.lab.checkout_stamp import provenance

    result["provenance"] = provenance()
    save()
    print(f"\n{'cell':24s} {'arm':20s} {'ms':>8s} {'TFLOP/s':>8s} {'% mm':>6s} {'vs lib':>7s} check")
    for r in result["rates"]:
        if r["status"] != "ok":
            print(f"{r['cell']:24s} {r['arm']:20s} {r['status']}: {(r['reason'] or '')[:120]}")
            continue
        print(f"{r['cell']:24s} {r['arm']:20s} {r['ms']:8.2f} {r['tflops']:8.1f} {r['pct_matmul']:6.1f} "
              f"{r.get('speedup_vs_library_folded', float('nan')):7.3f} {'ok' if r['check_ok'] else 'FAILED'}")
    print(f"(% mm: of the {roof_tflops:.0f} TFLOP/s bf16 matmul measured in this run; {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
