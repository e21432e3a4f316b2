#!/usr/bin/env python3
"""One small case of every kernel, for compute-sanitizer (memcheck, racecheck, synccheck) to watch:

    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_cases.py [--backend jit]

Per pool (split bf16, folded bf16, folded FP8): the decode as one fused launch (a one-wave plan of bf16 rows) and as
its three launches (partial, merge of groups, final merge; over the FP8 pool also with the tensor-core partial) and the prefill; awkward small sizes
(requests of 1, 65 and 300 tokens on 128-token chunks; prefill chunks of 54 and 65 over 97 and 300 tokens), so that
the slowest tool (racecheck) takes seconds a launch. Prints one line per launch; the sanitizer's own summary says
whether any access was bad, and a launch that fails its float64 check makes the exit status 1.
"""

from __future__ import annotations

import argparse
import sys

import torch

from foldkv.fp8 import FP8_DTYPE
from foldkv.lab import gates
from foldkv.layout import KvFormat

POOLS = (("split", KvFormat.SPLIT, torch.bfloat16), ("folded", KvFormat.FOLDED, torch.bfloat16),
         ("folded-fp8", KvFormat.FOLDED, FP8_DTYPE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="jit")
    args = ap.parse_args(argv)
    decode_case = gates.Case("sanitize-decode", (1, 65, 300), chunk_tokens=128)
    prefill_case = gates.Case("sanitize-prefill", (97, 300), q_lens=(54, 65))
    bad = 0
    for name, fmt, dtype in POOLS:
        quantized = dtype == FP8_DTYPE
        launches = [("decode-fused", decode_case, gates.decode_arm(args.backend, fused=None if quantized else True))]
        launches += [("decode-3-launch", decode_case, gates.decode_arm(args.backend, fused=False)),
                     ("prefill", prefill_case, gates.prefill_arm(args.backend))]
        if quantized:
            launches = launches[1:]  # an FP8 pool's decode is its three launches (the fused step reads bf16 rows)
            # and its partial on FP8 tensor cores (fp8_math="tensor_cores"), held to its own bound (gates.fp8_tc)
            launches.insert(1, ("decode-tc", decode_case, gates.decode_arm(args.backend, fused=False,
                                                                          fp8_math="tensor_cores")))
        for what, case, launch in launches:
            inputs = gates.make_inputs(case, fmt, "cuda", seed=1, dtype=dtype)
            res = gates.run_case(inputs, launch, extra=gates.fp8_tc_extra if what == "decode-tc" else None)
            bad += not res["passed"]
            print(f"{what:16s} {name:10s} passed={res['passed']} rel={res['rel_fro']:.2e}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
