"""First use in the sliding layers' attention: what torch's SDPA pays the first time it sees a shape, by backend.

A chunked prefill's sliding layers call torch SDPA (through transformers' "sdpa", a materialised bool mask, K/V
repeated to the 32 query heads) on [1, 32, q, 256] against [1, 32, q + cached, 256], q = the chunk's tokens: a new
prompt length gives its last chunk a shape never seen. torch's cuDNN backend (first in the priority order on sm90
with cuDNN > 9.15: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `check_prefer_cudnn_attention`) builds a
cuDNN graph per shape (aten/src/ATen/native/cudnn/MHA.cpp: `MHAParams` holds s_q, s_kv and the mask's dims); the
cutlass memory-efficient backend builds nothing. This probe times, per backend (the default, cuDNN, efficient), the
first call at each of a few new lengths against the same call repeated, and the repeated calls at the chunk shapes of
a steady prefill (8,192 and 4,096 tokens after a full window), so the choice between them is made on numbers.

    python bench/first_use_probe.py --out $OUT/first_use_probe.json     (a GPU; ~1 minute)
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 python bench/first_use_probe.py    (torch's opt-in one-graph path, if it
                                                                          takes a mask)
Prediction (bench/PREFILL_NOTES.md, "First use"): the default is cuDNN on torch 2.11+cu130; its first call at a new
shape costs ~0.3-1 s more than a repeat, the efficient backend's < 10 ms more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from foldkv.lab.window_reference import window_mask


def timed(fn, device) -> float:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def call(q_len: int, cached: int, args, device, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv = q_len + cached
    q = torch.randn(1, args.heads, q_len, args.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, args.heads, kv, args.head_dim, device=device, dtype=torch.bfloat16)
    mask = window_mask(q_len, kv, args.window, device)[None, None]  # [1, 1, q, kv]

    def run():
        if backend == "default":
            return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask, scale=1.0)
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask, scale=1.0)
    return run


def kernel_names(run) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--new-lengths", type=int, nargs="+", default=[3809, 3811, 616, 1001])
    ap.add_argument("--steady", type=int, nargs="+", default=[8192, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cached = args.window - 1  # what a sliding layer holds before a later chunk
    result = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "device": torch.cuda.get_device_name(dev), "backends": {}}
    for b, backend in enumerate(("default", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")):
        row = {"first_use": [], "steady_ms": {}}
        for n in args.new_lengths:
            n = n + 2 * b  # a length no backend saw before this one
            try:
                run = call(n, cached, args, dev, backend)
                first = timed(run, dev)
                again = statistics.median(timed(run, dev) for _ in range(args.reps))
                row["first_use"].append({"q": n, "kv": n + cached, "first_s": first, "repeat_s": again,
                                         "extra_s": first - again})
            except RuntimeError as exc:  # the backend refuses the shape
                row["first_use"].append({"q": n, "error": str(exc).splitlines()[0][:200]})
        for n in args.steady:
            try:
                run = call(n, cached, args, dev, backend)
                timed(run, dev)
                row["steady_ms"][n] = 1e3 * statistics.median(timed(run, dev) for _ in range(args.reps))
                row.setdefault("kernels", kernel_names(run))
            except RuntimeError as exc:
                row["steady_ms"][n] = str(exc).splitlines()[0][:200]
        result["backends"][backend] = row
        print(backend, json.dumps(row, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
