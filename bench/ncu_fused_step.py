"""One fused decode step at LENGTH tokens, eagerly, REPEAT times, by the library's kernel (`lib`) or the LL version
(`ll`, `ll_no_wait`): a target for ncu (-k regex:decode_fused --launch-skip REPEAT-1 --launch-count 1). Also prints
the kernel's time by CUDA events over many eager launches (host-bound: not a benchmark). Diagnosis only.
    python3 bench/ncu_fused_step.py {lib,ll,ll_no_wait} LENGTH REPEAT [CALLS]    # repo root, lib on PYTHONPATH
"""
import sys
import torch
sys.path.insert(0, "bench")
from foldkv.lab.bench.case import AttentionCase
from foldkv.layout import KvFormat
from foldkv.kernels.decode import decode, plan_decode

which, length, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = torch.device("cuda")
case = AttentionCase([length], device=dev, min_copies=1, max_copies=1, rotate_bytes=0)
pool, query, table = case.pools(KvFormat.FOLDED)[0], case.query(KvFormat.FOLDED), case.table
plan = plan_decode(pool.layout, case.table_cpu.seq_lens, device=dev)
kw = {}
if which.startswith("ll"):
    from versions import decode_fused_ll as V
    kw["kernels"] = {"decode_fused_folded": V.LLStep(case.geom, "folded", None if which == "ll" else which[3:])}
out = torch.empty(query.shape, dtype=torch.bfloat16, device=dev)  # [1, Hq, D]
lse = torch.empty(query.shape[:2], dtype=torch.float32, device=dev)
for _ in range(repeat):
    decode(pool, query, table, plan=plan, out=out, lse=lse, check=False, **kw)
torch.cuda.synchronize()
if len(sys.argv) > 4:
    n = int(sys.argv[4])
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        decode(pool, query, table, plan=plan, out=out, lse=lse, check=False, **kw)
    e1.record(); torch.cuda.synchronize()
    print(f"{which} {length}: {e0.elapsed_time(e1) * 1000 / n:.1f} us a call (eager, {n} calls, pool in L2)")
print(which, "ok", float(out.float().abs().sum()))
