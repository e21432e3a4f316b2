"""Lab notebook: FP8 wgmma's accumulation on the H200, characterised against float64 (bench/FP8_NOTES.md, run 17).

Question: how many bits does Hopper's FP8 wgmma keep per add when k32 steps accumulate into one float32 accumulator
fragment (the FP8 MMA decode partial's score gemm: 16 steps), does it round or truncate, and how does the error grow
with the steps, against a fresh accumulator per step added in float32 (the promotion)?
Method: foldkv.lab.fp8_accumulation (its docstring): e4m3 operands never zero over spreads of 0-8 binades, mixed and
positive signs, 1-16 k32 steps; the measured error against the float64 reference fitted by a model that keeps b bits
of every addend below the largest addend's exponent (b = 8..24, nearest or truncate).
Prediction (written before the run, FP8_NOTES run 17): b ~ 13-14 (DeepSeek-V3 3.3.2), truncation; one accumulator's
median error growing with the steps, ~3-8x the fresh-per-step error at 16 steps.

    python3 bench/fp8_accumulation_probe.py            # the full grid, ~1 min on an H200
    python3 bench/fp8_accumulation_probe.py --trials 8 --steps 1 16

Prints the fit and the error-against-steps table; writes fp8_accumulation.json to $OUT when set (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from foldkv.lab import fp8_accumulation as fa

    ap.add_argument("--steps", type=int, nargs="*", default=list(fa.STEPS))
    ap.add_argument("--spreads", type=int, nargs="*", default=list(fa.SPREADS))
    ap.add_argument("--fresh-every", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    from foldkv.lab.arms import ArmUnavailable
    from foldkv.lab.checkout_stamp import provenance
    from foldkv.lab.jsonsafe import jsonable
    from foldkv.lab.report import environment

    t0 = time.perf_counter()
    try:
        res = fa.characterise("cuda", steps=args.steps, spreads=args.spreads, fresh_every=args.fresh_every,
                              trials=args.trials, seed=args.seed)
    except ArmUnavailable as exc:
        print(f"not run: {exc}")
        return 1
    res.update(seconds=time.perf_counter() - t0, environment=environment("cuda"), provenance=provenance())
    print(fa.markdown(res))
    print(f"\n{res['seconds']:.1f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "fp8_accumulation.json")
        with open(path, "w") as fh:
            json.dump(jsonable(res), fh, indent=1, allow_nan=False)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
