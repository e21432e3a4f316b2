"""Lab notebook: a few of notebook 05's cells on the 31B at full size, one model load, JSON to stdout / $OUT.

For a quick look at a change of the decode step before the batch of record (notebook 05 runs every cell):

    python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 flashinfer:4096:1 --tail foldkv-folded:32768:8

--decode ARM:CONTEXT:BATCH (model_decode.measure_decode), --tail ARM:CONTEXT:BATCH (measure_prefill_tail, chunk
4096), --profile (step_kernels at 4K x 1), --compile N (measure_static_compile: transformers' static cache and
automatic compile on an N-token prompt, last: it leaves the compiler's state behind). Results are not records: the batch's notebook is.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _cells(specs):
    for s in specs:
        arm, n, b = s.split(":")
        yield arm, int(n), int(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", nargs="*", default=[])
    ap.add_argument("--tail", nargs="*", default=[])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--compile", type=int, default=0)
    args = ap.parse_args(argv)
    import foldkv.hf  # noqa: F401
    from foldkv.lab import gemma31b, model_decode as md
    from foldkv.lab.bench.roofs import measure_read_roof

    t0 = time.perf_counter()
    model = gemma31b.build_gemma4_31b("cuda", seed=0)
    roof = measure_read_roof("cuda")
    print(f"built in {time.perf_counter() - t0:.1f} s; roof {roof['gbps']:.0f} GB/s", flush=True)
    out = {"roof": roof, "decode": [], "tail": []}
    md.run_cells(md.measure_prefill, [dict(model=model, arm_name=a, prompt_tokens=256, new_tokens=2,
                                           prefill_chunk=4096) for a in dict.fromkeys(
                                               a for a, _, _ in _cells(args.decode + args.tail))])
    out["decode"] = md.run_cells(md.measure_decode, [dict(model=model, arm_name=a, context=n, batch=b,
                                                          new_tokens=args.new_tokens, read_gbps=roof["gbps"])
                                                     for a, n, b in _cells(args.decode)])
    out["tail"] = md.run_cells(md.measure_prefill_tail, [dict(model=model, arm_name=a, context=n, batch=b,
                                                              chunk=4096) for a, n, b in _cells(args.tail)])
    if args.profile:
        out["profile"] = md.step_kernels(model, "foldkv-folded", context=4096, batch=1, top=16)
        for k in out["profile"]:
            print(f"{k['ms']:8.3f} ms {k['calls']:5d}  {k['kernel']}")
    if args.compile:
        out["compile"] = md.run_cells(md.measure_static_compile, [dict(model=model, prompt_tokens=args.compile,
                                                                       new_tokens=args.new_tokens)])
    for r in out["decode"] + out.get("compile", []):
        r.pop("tokens", None)
    text = json.dumps(out, indent=1, default=str)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "probe.json"), "w").write(text)
    print(md.decode_table(out["decode"]))
    print(md.memory_table(out["decode"] + out["tail"]))
    for r in out.get("compile", []):
        print({k: v for k, v in r.items() if k != "tokens"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
