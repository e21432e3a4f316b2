"""Which rounding of the FP8 MMA partial (bench/versions/decode_partial_fp8_mma.py) moves its LSE: the decode gate
(foldkv.lab.gates.run_case: output and LSE against the float64 reference over the dequantized pool, the bounds derived
for the bf16-MMA partials) on the gate's decode cases over hostile FP8 pools, for the library's conversion partial,
the two-part MMA version, the same with each score panel's k32 steps in a fresh accumulator (`panel_acc`: the FP8
accumulation's share), and the one-part version (the red twin); and each arm's LSE against the float64 reference over
the query the two-part versions' scores see (`effective_query`: their query rounding taken out). Prints one row per
arm, the worst over the cases.

    python bench/fp8_gate_probe.py [--size smoke|full] [--json $OUT/gate_probe.json]   # on the H200

Lab notes: bench/FP8_NOTES.md, run 16.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from foldkv import GEMMA4_31B, KvFormat
from foldkv.fp8 import FP8_DTYPE
from foldkv.kernels.decode import decode
from foldkv.kernels.plan import plan_decode
from foldkv.lab import gates
from foldkv.lab.checkout_stamp import provenance
from foldkv.lab.gates import effective_query  # the two-part query the MMA versions' scores see
from foldkv.lab.jsonsafe import jsonable
from foldkv.reference import paged_attention_reference
from versions import decode_partial_fp8_mma  # bench/versions/

G = GEMMA4_31B
MMA = dict(transpose="t4x16", num_stages=1, ctas_per_sm=2)
ARMS = {"conversion (library)": None,
        "mma two parts": dict(MMA, precise=True),
        "mma two parts, panel accumulators": dict(MMA, precise=True, panel_acc=True),
        "mma one part (red twin)": dict(MMA, precise=False)}


def launcher(kernel):
    def launch(inputs, out, lse):
        slots = MMA["ctas_per_sm"] * torch.cuda.get_device_properties(inputs.pool.device).multi_processor_count
        plan = plan_decode(inputs.pool.layout, inputs.case.seq_lens, device=inputs.pool.device, num_sms=slots,
                           chunk_tokens=inputs.case.chunk_tokens, merge_group=inputs.case.merge_group)
        return decode(inputs.pool, inputs.query, inputs.table, plan=plan, out=out, lse=lse, fp8_math="exact",
                      kernels={"decode_partial_folded_fp8": kernel})  # a version in place of the exact partial
    return launch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="smoke")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    launches = {name: gates.decode_arm("jit", fp8_math="exact") if kw is None
                else launcher(decode_partial_fp8_mma.build(G, **kw))
                for name, kw in ARMS.items()}
    rows = []
    for case in gates.decode_cases(args.size):
        inputs = gates.make_inputs(case, KvFormat.FOLDED, dev, 4, dtype=FP8_DTYPE)
        for name, launch in launches.items():
            res = gates.run_case(inputs, launch)
            row = {"case": case.name, "arm": name, **{k: res[k] for k in (
                "rel_fro", "rel_bound", "max_abs", "worst_margin", "elementwise_ok", "rel_ok", "lse_max_abs",
                "lse_worst_fraction_of_bound", "lse_ok", "all_written", "passed")}}
            # against the float64 reference over the query the MMA versions' scores see (their query rounding out)
            ref, ref_lse = paged_attention_reference(inputs.pool, effective_query(inputs.query), inputs.table)
            out, lse = res["outputs"]
            row["lse_vs_effective_query"] = float((lse.double() - ref_lse).abs().max())
            row["rel_fro_vs_effective_query"] = float((out.double() - ref).norm() / ref.norm())
            rows.append(row)
        print(f"{case.name}: " + ", ".join(f"{r['arm']} lse {r['lse_max_abs']:.1e} / {r['lse_vs_effective_query']:.1e}"
                                           for r in rows[-len(ARMS):]), flush=True)
    print(f"\n{'arm':<36} {'cases':>5} {'passed':>6} {'rel_fro max':>11} {'margin max':>10} {'LSE max':>9} "
          f"{'LSE / bound max':>15} {'LSE vs q_eff':>12}")
    for name in ARMS:
        rs = [r for r in rows if r["arm"] == name]
        print(f"{name:<36} {len(rs):>5} {sum(r['passed'] for r in rs):>6} {max(r['rel_fro'] for r in rs):11.2e} "
              f"{max(r['worst_margin'] for r in rs):10.2e} {max(r['lse_max_abs'] for r in rs):9.2e} "
              f"{max(r['lse_worst_fraction_of_bound'] for r in rs):15.2f} "
              f"{max(r['lse_vs_effective_query'] for r in rs):12.2e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(jsonable({"provenance": provenance(), "rows": rows}), fh, indent=1, allow_nan=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
