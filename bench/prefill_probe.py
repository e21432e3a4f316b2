"""Lab notebook: time to first token of the 31B through `model.generate()` (the user's path), where it goes, and what
a first use costs. One mode a process (a fresh process is what "first use" means), JSON into --out.

    python3 bench/prefill_probe.py warm  --arms foldkv-folded foldkv-split     # builds every kernel the arms use
    python3 bench/prefill_probe.py first --cells foldkv-folded:12000 foldkv-folded:12000 foldkv-split:12001 ...
    python3 bench/prefill_probe.py ttft  --cells foldkv-folded:32768 foldkv-split:32768 --rounds 2
    python3 bench/prefill_probe.py profile --cells foldkv-folded:16384 --trace prefill_trace.json.gz
    python3 bench/prefill_probe.py ttft  --cells foldkv-folded:32768 foldkv-folded:32768@merge_prefill=0 --rounds 3

A cell is ARM:PROMPT[:BATCH[:CHUNK]][@FIELD=0|1[,FIELD=0|1...]] (chunk: generate()'s prefill_chunk_size, default
--chunk; after @, foldkv.step_options.StepOptions fields set over the options in force for that cell's cache: an A/B
of a step option in one process, each value its own arm of the rotation). Every cell is a real random prompt through
`model_decode.measure_prefill`'s call of generate() with one new token.
- warm: each arm once at a short prompt, so that TileLang's JIT (and FlashInfer's) compile into their caches; the
  seconds each took are the fresh-cache first use.
- first: the cells in the order given, each timed, in a process that found the caches warm: the first call of a
  length pays what compiles, tunes or allocates for that length; each cell's cache creation timed beside it (what a
  FoldKvCache does ahead of the first prompt: its prefill kernels resolved and its first launches warmed). --cprofile:
  each cell under cProfile too, its slowest functions by cumulative time saved (what the first use spends its time
  in). --launches: each cell under torch.profiler too, its prompt's longest kernel launch calls saved with the kernel
  each launched (CUDA's lazy module loading is paid inside a kernel's first launch call:
  foldkv.lab.prefill_breakdown.slow_launches).
- ttft: the cells in `rounds` rounds, the arm order rotated each round, after one untimed call of each cell (steady
  state: the first use of each length is paid before timing). The matmul rate is measured in the same process.
- profile: the cells once untimed, then once under torch.profiler with the lab's prefill scopes open around foldkv's
  prep, attention and each chunk's forward (`components`); each chunk's time by component is
  foldkv.lab.prefill_breakdown's (every kernel to the innermost scope that launched it, else by its name; the GPU's
  idle time inside the chunk the host gap). --trace saves the raw chrome trace (gzip).
Results are not records: notebook 05 is.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gzip
import io
import json
import os
import pstats
import shutil
import tempfile
import time

import torch

# The functions the profile wraps in the lab's prefill scopes (foldkv.lab.prefill_scopes), by dotted name; the text
# model's forward (one prefill chunk) goes in CHUNK. foldkv.lab.prefill_breakdown does the accounting.
WRAPPED = {
    "foldkv.global_step.fold_and_store": "PREP",
    "foldkv.hf.FoldKvCache.pool_attention": "GLOBAL_ATTENTION",
    "foldkv.hf._sliding_attention": "SLIDING_ATTENTION",
    "foldkv.window_attention.window_attention": "SLIDING_ATTENTION",
}


def _step_options(text: str, cell: str) -> dict:
    """FIELD=0|1[,FIELD=0|1...] -> {field: bool}, each a foldkv.step_options.StepOptions field."""
    import dataclasses

    from foldkv.step_options import StepOptions

    fields = {f.name for f in dataclasses.fields(StepOptions)}
    options = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in fields or value not in ("0", "1"):
            raise argparse.ArgumentTypeError(f"{cell!r}: {item!r} is not FIELD=0|1 of a StepOptions field"
                                             f" ({', '.join(sorted(fields))})")
        options[name] = value == "1"
    return options


def _cell(text: str, chunk: int) -> dict:
    shape, _, opts = text.partition("@")
    parts = shape.split(":")
    if not 2 <= len(parts) <= 4:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ARM:PROMPT[:BATCH[:CHUNK]][@FIELD=0|1,...]")
    arm, n, *rest = parts
    b = int(rest[0]) if rest else 1
    c = int(rest[1]) if len(rest) > 1 else chunk
    options = _step_options(opts, text) if opts else {}
    return {"arm": arm, "prompt": int(n), "batch": b, "chunk": c, "options": options,
            "label": arm + (f"@{opts}" if opts else "")}


@contextlib.contextmanager
def components(model, entered: dict | None = None):
    """Wrap WRAPPED's functions in their prefill scopes, and one chunk's forward in CHUNK (record_function ranges the
    profiler keeps); restore on exit. A chunk's forward is the step's own (`StepForward.prefill`, the served fused
    prefill) or the text model's (every other arm): both are wrapped on their class, never on the model instance,
    because a forward set on a module the step computes makes the step refuse the model (`fused_step.refusal`) and
    the profile would time transformers' forward instead of the served one. `entered` counts which of the two ran."""
    import importlib

    undo = []
    from foldkv import fused_step
    from foldkv.hf import text_model_of
    from foldkv.lab import prefill_scopes as scopes

    def wrap(owner, rest, scope, key=None):
        fn = vars(owner)[rest] if rest in vars(owner) else getattr(owner, rest)

        @functools.wraps(fn)  # generate() reads the model forward's signature
        def wrapped(*a, **k):
            if key is not None and entered is not None:
                entered[key] = entered.get(key, 0) + 1
            with scopes.components_scope(scope):
                return fn(*a, **k)

        undo.append((owner, rest, vars(owner).get(rest, _ABSENT)))
        setattr(owner, rest, wrapped)

    for dotted, scope in WRAPPED.items():
        mod_name, _, rest = dotted.rpartition(".")
        try:
            owner = importlib.import_module(mod_name)
        except ImportError:  # Class.method
            mod_name, _, owner_name = mod_name.rpartition(".")
            owner = getattr(importlib.import_module(mod_name), owner_name)
        if not hasattr(owner, rest):
            print(f"  (no {dotted}: not wrapped)")
            continue
        wrap(owner, rest, getattr(scopes, scope))
    wrap(fused_step.StepForward, "prefill", scopes.CHUNK, "step")
    wrap(type(text_model_of(model)), "forward", scopes.CHUNK, "model")
    try:
        yield
    finally:
        for owner, rest, fn in reversed(undo):
            if fn is _ABSENT:
                delattr(owner, rest)
            else:
                setattr(owner, rest, fn)


_ABSENT = object()


def attribute(trace: dict) -> list[dict]:
    """Each prefill chunk of a chrome trace by component (foldkv.lab.prefill_breakdown), with its busiest kernels."""
    from foldkv.lab.prefill_breakdown import breakdown, chrome_trace_events, chunk_windows

    kernels, ranges = chrome_trace_events(trace)
    chunks = []
    for i, window in enumerate(chunk_windows(kernels, ranges)):
        b = breakdown(kernels, ranges, window).as_dict()
        top: dict[str, float] = {}
        for k in kernels:
            if window[0] <= k.start_us < window[1]:
                top[k.name[:90]] = top.get(k.name[:90], 0.0) + k.dur_us / 1e3
        b["top_kernels_ms"] = dict(sorted(top.items(), key=lambda x: -x[1])[:25])
        chunks.append({"chunk": i, **b})
    return chunks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["warm", "first", "ttft", "profile"])
    ap.add_argument("--cells", nargs="*", default=[])
    ap.add_argument("--arms", nargs="*", default=[])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--launches", action="store_true", help="first: each cell's longest launch calls (torch.profiler)")
    ap.add_argument("--no-untimed", action="store_true", help="ttft: no untimed first call of each cell")
    ap.add_argument("--glue", choices=["fused", "unfused"], default="fused",
                    help="a prefill's norms, RoPE, GELU x up and residual tails: the decode step's fused kernels (the "
                         "library's) or transformers' modules (what served before DecodeStep.prefill)")
    ap.add_argument("--sliding", choices=["window", "masked"], default="window",
                    help="the sliding layers' prefill: the library's (FlashAttention's window) or transformers' sdpa "
                         "over its materialised mask (what served before foldkv.window_attention)")
    ap.add_argument("--trace", default="")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the cells left once this much time has passed")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args(argv)
    cells = [_cell(c, args.chunk) for c in args.cells] + [_cell(f"{a}:256", args.chunk) for a in args.arms]

    import foldkv.hf  # noqa: F401
    from foldkv.lab import gemma31b, model_decode as md
    from foldkv.lab.bench.roofs import measure_matmul_roof

    if args.glue == "unfused":  # the caches made below take the options in force
        from foldkv.step_options import StepOptions, using

        options = contextlib.ExitStack()  # held for the process
        options.enter_context(using(StepOptions(fuse_prefill=False)))
    if args.sliding == "masked":
        foldkv.hf.plain_window = lambda *a, **k: False  # every sliding mask call gets transformers' mask
    t_start = time.perf_counter()
    model = gemma31b.build_gemma4_31b("cuda", seed=0)
    print(f"[{args.mode}, sliding {args.sliding}, glue {args.glue}] built in {time.perf_counter() - t_start:.1f} s", flush=True)
    out = {"mode": args.mode, "sliding": args.sliding, "device": torch.cuda.get_device_name(), "cells": [],
           "cudnn": torch.backends.cudnn.version()}

    def run(c, seed=0):
        import dataclasses

        from foldkv.step_options import in_force, using

        t0 = time.perf_counter()
        with using(dataclasses.replace(in_force(), **c["options"])):  # the cell's cache takes these
            r = md.measure_prefill(model, c["arm"], prompt_tokens=c["prompt"], new_tokens=1,
                                   prefill_chunk=c["chunk"], seed=seed, batch=c["batch"])
        r.pop("tokens", None)
        r.update(batch=c["batch"], chunk=c["chunk"], call_s=time.perf_counter() - t0, label=c["label"],
                 step_options=c["options"])
        return r

    def over_budget():
        return time.perf_counter() - t_start > args.budget_s

    if args.mode in ("warm", "first"):
        for i, c in enumerate(cells):
            if over_budget():
                print(f"  budget spent: {c} not run")
                continue
            prof = cProfile.Profile() if args.cprofile else None
            if prof:
                prof.enable()
            if args.launches:
                from torch.profiler import ProfilerActivity, profile

                from foldkv.lab.prefill_breakdown import slow_launches

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    r = run(c, seed=i)
                path = os.path.join(tempfile.mkdtemp(), "trace.json")
                p.export_chrome_trace(path)
                with open(path) as f:
                    r["slow_launches"] = slow_launches(json.load(f), top=25, within=md.PROMPT_RANGE)
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                for x in r["slow_launches"][:8]:
                    print(f"     {x['us'] / 1e3:7.2f} ms {x['call']} {x['kernel'][:100]}", flush=True)
            else:
                r = run(c, seed=i)
            if prof:
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
                r["cprofile_top"] = s.getvalue()[-9000:]
            out["cells"].append(r)
            print(f"  {i}: {c['label']} {c['prompt']} (chunk {c['chunk']}): TTFT {r['ttft_s']:.3f} s (cache made in"
                  f" {r['cache_s']:.3f} s before it)", flush=True)
    elif args.mode == "ttft":
        out["matmul"] = measure_matmul_roof("cuda")
        print(f"  matmul {out['matmul']['tflops']:.0f} TFLOP/s", flush=True)
        for c in cells if not args.no_untimed else []:  # first use of each cell's length and kernels, untimed
            run(c)
        arms = list(dict.fromkeys(c["label"] for c in cells))  # an arm with step options is an arm of its own
        for rnd in range(args.rounds):
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            for a in order:
                for c in (c for c in cells if c["label"] == a):
                    if over_budget():
                        continue
                    r = run(c, seed=rnd + 1)
                    r["round"] = rnd
                    out["cells"].append(r)
                    print(f"  round {rnd}: {a} {c['prompt']} x {c['batch']} (chunk {c['chunk']}): TTFT "
                          f"{r['ttft_s']:.3f} s, peak {r['peak_bytes'] / 2**30:.1f} GiB", flush=True)
    else:  # profile
        from torch.profiler import ProfilerActivity, profile

        for c in cells:
            run(c)
            entered: dict = {}
            with components(model, entered), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                r = run(c, seed=1)
            r["chunk_forward"] = entered  # {"step": chunks through the step's own forward, "model": transformers'}
            if args.glue == "fused" and c["arm"].startswith("foldkv") and not entered.get("step"):
                print(f"  {c['arm']}: the profiled prefill did not run the step's own forward ({entered}): this"
                      " profile is of transformers' forward, not the served one", flush=True)
            path = os.path.join(tempfile.mkdtemp(), "trace.json")
            p.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            r["breakdown"] = attribute(trace)
            out["cells"].append(r)
            if args.trace:
                with open(path, "rb") as src, gzip.open(os.path.join(args.out, f"{args.sliding}_{args.glue}_{args.trace}"),
                                                        "wb") as dst:
                    shutil.copyfileobj(src, dst)
            for ch in r["breakdown"]:
                comps = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in ch["seconds"].items())
                print(f"  {c['label']} {c['prompt']} chunk {ch['chunk']}: {1e3 * ch['wall_s']:.1f} ms | {comps}",
                      flush=True)
    out["glue"] = args.glue
    name = os.path.join(args.out, f"prefill_{args.mode}_{args.sliding}_{args.glue}.json")
    with open(name, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"[{args.mode}] wrote {name} at {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
