#!/usr/bin/env python3
"""One small case of every kernel, both formats, for `compute-sanitizer --tool memcheck` to watch.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_cases.py [--backend jit]

Prints one line per kernel run; the sanitizer's own summary says whether any access was bad.
"""

from __future__ import annotations

import argparse
import sys

import torch

from foldkv.lab import gates
from foldkv.layout import KvFormat


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="jit")
    args = ap.parse_args(argv)
    decode_case = gates.Case("sanitize-decode", (1, 65, 300), chunk_tokens=128)
    prefill_case = gates.Case("sanitize-prefill", (97, 300), q_lens=(54, 65))
    bad = 0
    for fmt in KvFormat:
        for case in (decode_case, prefill_case):
            inputs = gates.make_inputs(case, fmt, "cuda", seed=1)
            res = gates.run_case(inputs, gates.arm_for(case, args.backend))
            bad += not res["passed"]
            print(f"{case.kind:8s} {fmt.value:7s} passed={res['passed']} rel={res['rel_fro']:.2e}", flush=True)
        from foldkv.kernels.prep_kernel import prep_and_store_gpu

        inputs = gates.make_inputs(prefill_case, fmt, "cuda", seed=2)
        n = sum(prefill_case.q_lens)
        request = torch.cat([torch.full((m,), r) for r, m in enumerate(prefill_case.q_lens)]).cuda()
        positions = torch.cat([torch.arange(s - m, s) for s, m in zip(prefill_case.seq_lens, prefill_case.q_lens)]).cuda()
        q = torch.randn(n, 32, 512, device="cuda")
        kv = torch.randn(n, 4, 512, device="cuda")
        prep_and_store_gpu(inputs.pool, inputs.table, request, positions, q, kv,
                           inputs.raw["q_norm_weight"].cuda(), inputs.raw["k_norm_weight"].cuda())
        torch.cuda.synchronize()
        print(f"prep     {fmt.value:7s} ran", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
