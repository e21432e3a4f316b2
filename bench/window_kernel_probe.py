"""Window kernel probe: a sliding layer's prefill attention through bench/versions/window_attention_tilelang.py (plain
and with the lazy max) against the library's FlashAttention-2 window (`foldkv.window_attention.window_attention`),
first checked on hostile cases against the float64 band, then timed on the 31B's shapes. One device call:

    source .devsite/env.sh; export PYTHONPATH=$PWD/lib:$PYTHONPATH; python3 bench/window_kernel_probe.py --out $OUT

Stages, each printed as it goes and written to --out/window_kernel_probe.json when it ends:
  1. the check (`window_check`, also tests/test_window_kernel_gpu.py's): every arm on HOSTILE (batch 1 and 2; 1, 63,
     65 and 4,096 queries; S = T, a prompt's first chunk, and S = T + 1,023, a later chunk with a full cached window),
     the output NaN-poisoned before the launch, every element finite and within the bound of
     tests/test_window_attention_gpu.py (P's bf16 rounding, P.V's float32 sum over the keys, the output's rounding,
     the scores' float32 error moving each p_j: conftest's `ring_output_bound`), taken a query head at a time. An arm
     that fails is reported and not timed;
  2. the bf16 matmul rate (8192^3, `bench.roofs.measure_matmul_roof`) in the same run;
  3. each cell in CELLS (a 4,096-query chunk, batch 1, 32 query heads over 16 KV heads of 256, window 1,024): warm-up,
     then --rounds rounds, the arms in alternating order each round, each round's median of --reps CUDA-event
     samples; the median over rounds, TFLOP/s of band work (4 x T x window x 256 x 32, the count of
     bench/PREFILL_NOTES.md's prediction; a first chunk's early queries see fewer keys: its exact count beside it), and
     x 50 layers: ms a chunk of the 31B's sliding attention.
Arms: `fa2` the library's window (torch's FlashAttention-2); `tilelang` the version's kernel on the served layouts
(the query a transposed view of [B, T, H, D] rows, K/V contiguous [B, Hkv, S, D]: no copy); `tilelang_lazy` the same
with the lazy max (2^8 slack); `tilelang_kv_copy` the version's launcher given K/V as transposed views of [B, S, Hkv,
D] rows (a prompt's first chunk): the copies it makes counted.
Prediction and what proves it wrong: the version's header and bench/PREFILL_NOTES.md ("Prediction: the sliding window
as a TileLang kernel").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
for _path in (BENCH, BENCH.parent / "tests"):  # bench/versions/ as `versions.<name>`; tests/conftest's bound
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 32, 16, 256, 1024  # the 31B's sliding layers
SCALE = 1.0  # Gemma 4's sliding attention scaling (q_norm and k_norm instead of 1/sqrt(d))
SLIDING_LAYERS = 50
# (batch, queries, keys): one query; a partial first tile (63) and one past it (65); a whole chunk; each as a prompt's
# first chunk (S = T) and as a later one (S = T + window - 1)
HOSTILE = tuple((b, t, t + cached) for b in (1, 2) for t in (1, 63, 65, 4096) for cached in (0, WINDOW - 1))
CELLS = ((4096, 4096), (4096, 4096 + WINDOW - 1))  # (queries, keys), batch 1
ARMS = ("fa2", "tilelang", "tilelang_lazy", "tilelang_kv_copy")
LAZY_SLACK_LOG2 = 8.0  # the library prefill's slack


def version():
    from versions import window_attention_tilelang  # bench/versions/

    return window_attention_tilelang


def inputs(batch: int, q_len: int, kv_len: int, device, seed: int, kv_rows_major: bool = False):
    """query [B, H, T, D] as the transposed view of [B, T, H, D] rows (the served layout), key/value [B, Hkv, S, D]
    contiguous (a later chunk's torch.cat), or (`kv_rows_major`) transposed views of [B, S, Hkv, D] rows (a prompt's
    first chunk). q and k scaled by d^-1/4 each: scores of unit spread at scale 1.0."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(batch, q_len, HEADS, HEAD_DIM, device=device, generator=g) * HEAD_DIM ** -0.25).bfloat16()
    shape = (batch, kv_len, KV_HEADS, HEAD_DIM) if kv_rows_major else (batch, KV_HEADS, kv_len, HEAD_DIM)
    k = (torch.randn(*shape, device=device, generator=g) * HEAD_DIM ** -0.25).bfloat16()
    v = torch.randn(*shape, device=device, generator=g).bfloat16()
    if kv_rows_major:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return q.transpose(1, 2), k, v


def arm_fn(arm: str, q, k, v, out=None):
    """A zero-argument launch of `arm` on (q, k, v) (into `out` for the version's arms)."""
    from foldkv import window_attention as wa

    if arm == "fa2":
        return lambda: wa.window_attention(q, k, v, window=WINDOW, scale=SCALE)
    slack = LAZY_SLACK_LOG2 if arm == "tilelang_lazy" else None
    return lambda: version().window_attention(q, k, v, window=WINDOW, scale=SCALE, out=out, max_slack_log2=slack)


def window_check(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                 scale: float) -> dict:
    """`out` [B, T, H, D] against the float64 band (`window_attention_reference`), a query head at a time: every
    element finite and within the bound tests/test_window_attention_gpu.py derives (module docstring); the score
    error term's largest |q||k| taken over every head, as that test takes it. Returns {"finite", "within", "max_err",
    "worst_ratio"} (the largest error / bound)."""
    from conftest import ring_output_bound

    from foldkv.lab import window_reference as wa

    rep = q.shape[1] // k.shape[1]
    u = 2.0 ** -24
    mask = wa.window_mask(q.shape[2], k.shape[2], window, q.device)
    qk_abs = max(float((q[:, h].double().abs() @ k[:, h // rep].double().abs().transpose(-1, -2)).amax())
                 for h in range(q.shape[1]))
    score_err = scale * q.shape[-1] * 2 * u * qk_abs
    finite = bool(torch.isfinite(out).all())
    within, max_err, worst = True, 0.0, 0.0
    for h in range(q.shape[1]):
        qh, kh, vh = q[:, h:h + 1], k[:, h // rep:h // rep + 1], v[:, h // rep:h // rep + 1]
        ref = wa.window_attention_reference(qh, kh, vh, window=window, scale=scale)[:, :, 0]  # [B, T, D]
        s = (qh.double() @ kh.double().transpose(-1, -2)) * scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)  # [B, 1, T, S]
        bound = ring_output_bound(p, vh.double(), ref[:, None], extra=2 * score_err)[:, 0]  # [B, T, D]
        err = (out[:, :, h].double() - ref).abs()
        within = within and bool((err <= bound).all())
        max_err = max(max_err, float(err.nan_to_num(float("inf")).max()))
        worst = max(worst, float((err / bound).nan_to_num(float("inf")).max()))
    return {"finite": finite, "within": within, "max_err": max_err, "worst_ratio": worst}


def check(arms, device, log, seed: int = 11) -> dict:
    """Stage 1: every arm on every HOSTILE case, the output poisoned first (module docstring)."""
    res = {}
    for arm in arms:
        rows = []
        for b, t, s in HOSTILE:
            q, k, v = inputs(b, t, s, device, seed + t + s, kv_rows_major=arm == "tilelang_kv_copy")
            out = torch.full((b, t, HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=device)
            try:
                got = arm_fn(arm, q, k, v, out)()
                if arm == "fa2":
                    out = got
                r = window_check(out, q, k, v, WINDOW, SCALE)
            except Exception as exc:  # reported; the arm is then not timed
                r = {"finite": False, "within": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            r.update(batch=b, queries=t, keys=s, passed=r["finite"] and r["within"])
            rows.append(r)
            log(f"  {arm:18s} B={b} T={t:5d} S={s:5d}: {'ok  ' if r['passed'] else 'FAIL'} max|err| "
                f"{r.get('max_err', float('nan')):.3g}, err/bound {r.get('worst_ratio', float('nan')):.3g}"
                + (f"  {r['error']}" if "error" in r else ""))
        res[arm] = {"passed": all(r["passed"] for r in rows), "cases": rows}
    return res


def band_flops(q_len: int, kv_len: int, window: int = WINDOW) -> tuple[float, float]:
    """(4 T window D H: the prediction's count at a full window, the exact count of (query, key) pairs in the band x
    4 D H) for one layer."""
    offset = kv_len - q_len
    pairs = sum(min(window, offset + i + 1) for i in range(q_len))
    return 4.0 * q_len * window * HEAD_DIM * HEADS, 4.0 * pairs * HEAD_DIM * HEADS


def time_cell(arms, q_len: int, kv_len: int, device, rounds: int, reps: int, log) -> dict:
    """Stage 3 for one cell (module docstring)."""
    from foldkv.lab.bench.clock import time_events

    fns = {}
    for arm in arms:
        q, k, v = inputs(1, q_len, kv_len, device, 3, kv_rows_major=arm == "tilelang_kv_copy")
        out = None if arm == "fa2" else torch.empty(1, q_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        fns[arm] = arm_fn(arm, q, k, v, out)
    for fn in fns.values():  # warm-up: first launches, clocks up
        time_events(fn, reps=3, warmup=2)
    per_round = {a: [] for a in arms}
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            per_round[arm].append(statistics.median(time_events(fns[arm], reps=reps, warmup=1)))
    full, exact = band_flops(q_len, kv_len)
    res = {}
    for arm in arms:
        us = statistics.median(per_round[arm])
        res[arm] = {"us": us, "rounds_us": per_round[arm], "tflops_band": full / us / 1e6,
                    "tflops_exact": exact / us / 1e6, "chunk_ms": us * SLIDING_LAYERS / 1e3}
        log(f"  T={q_len} S={kv_len} {arm:18s}: {us:8.1f} us a layer, {res[arm]['tflops_band']:6.1f} TFLOP/s band "
            f"({res[arm]['tflops_exact']:6.1f} exact), x{SLIDING_LAYERS} layers {res[arm]['chunk_ms']:6.2f} ms a chunk")
    if "fa2" in res:
        for arm in arms:
            if arm != "fa2":
                res[arm]["speedup_vs_fa2"] = res["fa2"]["us"] / res[arm]["us"]
                log(f"  T={q_len} S={kv_len} {arm}: {res[arm]['speedup_vs_fa2']:.3f}x fa2")
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="folder for window_kernel_probe.json")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-check", action="store_true", help="time without stage 1 (an arm is then timed unchecked)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the window kernel probe times on the GPU")
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(device), "arms": args.arms, "hostile": HOSTILE, "cells": CELLS}

    def save():
        from foldkv.lab.jsonsafe import jsonable

        (out / "window_kernel_probe.json").write_text(json.dumps(jsonable(record), indent=1))

    def log(msg):
        print(msg, flush=True)

    t0 = time.time()
    for arm in args.arms:  # the version's kernels built before anything is timed (TileLang's JIT: ~30 s each)
        if arm != "fa2":
            version().build(HEADS, KV_HEADS, HEAD_DIM, WINDOW, SCALE,
                            max_slack_log2=LAZY_SLACK_LOG2 if arm == "tilelang_lazy" else None)
    log(f"built in {time.time() - t0:.0f} s")
    arms = list(args.arms)
    if not args.no_check:
        record["check"] = check(arms, device, log)
        save()
        arms = [a for a in arms if record["check"][a]["passed"]]
        log(f"check done at {time.time() - t0:.0f} s; timed: {arms}")
    from foldkv.lab.bench.roofs import measure_matmul_roof

    record["matmul"] = measure_matmul_roof(device)
    log(f"matmul {record['matmul']['tflops']:.0f} TFLOP/s")
    record["timing"] = {}
    for q_len, kv_len in CELLS:
        record["timing"][f"{q_len}x{kv_len}"] = time_cell(arms, q_len, kv_len, device, args.rounds, args.reps, log)
        save()
    log(f"done at {time.time() - t0:.0f} s")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
