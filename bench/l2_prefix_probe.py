"""Lab notebook: one row's projection with the first bytes of its weight already in L2 (MODEL_DECODE_NOTES run 27's
first measurement; written before any GPU run).

Question: run 27 would read o_proj's first weight tiles into L2 on a branch of the step's graph while one row's
attention leaves DRAM idle. What does an L2-resident prefix of P bytes save the projection? Per weight shape (the
31B's o_proj: sliding 5,376 x 8,192, global 5,376 x 16,384; bf16) and prefix P: a CUDA graph of one round over the
weight's copies (rotated past L2), each the stream read of copy i's first P bytes (`roofs.stream_read_kernel`, the
read roof's kernel) then the library's GEMV of one row (`foldkv.gemv.linear`) over copy i; the same graph without the
GEMVs; the GEMV's time = the difference / copies (median over interleaved replays). P = 0 is the cold projection.

Prediction (written first): the tensor-core GEMV at one row splits K and keeps every program resident in one wave,
so a prefix in L2 takes its bytes off the DRAM stream the whole grid shares: saved ~P / roof while L2 serves the
prefix faster than DRAM (~2x): 8 MB ~1.5-1.8 us, 16 MB ~3-3.5, 24 MB ~4.5-5.3, 32 MB ~6-7 of a sliding o_proj's ~21
us (88 MB). What says run 27 is not worth building: < 1 us saved at 24 MB (L2 does not keep the prefix through the
read, or the GEMV's programs do not take the cached rows at L2 speed).
Checks (each pair of graphs): the prefix read's partial sums against the float64 sum of exactly the prefix's blocks
(`roofs._sum_error` <= SUM_TOL, a read of too few or too many blocks fails it); every GEMV output finite and bitwise
the cold run's on the same copy (the read changes timing only).

    python3 bench/l2_prefix_probe.py                       # both shapes, P = 0, 8, 16, 24, 32 MB
    python3 bench/l2_prefix_probe.py --prefix-mb 0 24 --shapes 5376x8192
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

SHAPES = {"5376x8192": (5376, 8192), "5376x16384": (5376, 16384)}  # o_proj, sliding and global (N x K)
ROTATE_BYTES = 768 << 20  # the copies of one weight together: far past the 50 MB L2


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--prefix-mb", type=int, nargs="*", default=[0, 8, 16, 24, 32])
    ap.add_argument("--rounds", type=int, default=15)
    return ap


def plan(n: int, k: int, prefix_mb: list[int]) -> dict:
    """The copies of an [n, k] bf16 weight (ROTATE_BYTES together, at least 2) and each prefix in whole stream-read
    blocks ({mb: blocks}); a prefix past the weight is refused (ValueError) before anything is allocated."""
    from foldkv.lab.bench.roofs import STREAM_BLOCK

    nbytes = n * k * 2
    if n * k % STREAM_BLOCK:
        raise ValueError(f"weight {n} x {k}: not a whole number of {STREAM_BLOCK}-element blocks")
    blocks = {}
    for mb in prefix_mb:
        b = -(-(mb << 20) // (2 * STREAM_BLOCK))
        if mb < 0 or b * STREAM_BLOCK > n * k:
            raise ValueError(f"prefix of {mb} MB: the weight holds {nbytes / 2**20:.0f} MB")
        blocks[mb] = b
    return {"copies": max(2, ROTATE_BYTES // nbytes), "weight_bytes": nbytes, "blocks": blocks}


def _graph(fn, dev) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        fn()  # warm-up: compiles, allocates
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _replay_us(g, dev) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b)


def measure_shape(name: str, prefix_mb: list[int], rounds: int, dev) -> list[dict]:
    from foldkv import gemv
    from foldkv.lab.bench.roofs import SUM_TOL, STREAM_BLOCK, _sum_error, stream_read_kernel

    n, k = SHAPES[name]
    p = plan(n, k, prefix_mb)
    g = torch.Generator(device=dev).manual_seed(n + k)
    ws = [(torch.randn(n, k, generator=g, device=dev) * k ** -0.5).to(torch.bfloat16) for _ in range(p["copies"])]
    x = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
    read = stream_read_kernel()
    parts = [torch.full((264,), float("nan"), device=dev) for _ in ws]
    ys = [torch.full((1, n), float("nan"), device=dev, dtype=torch.bfloat16) for _ in ws]
    cold = None
    rows = []
    for mb, blocks in p["blocks"].items():
        def prefix_only():
            for w, part in zip(ws, parts):
                if blocks:
                    read(w.view(-1), part, blocks)

        def prefix_and_gemv():
            for w, part, y in zip(ws, parts, ys):
                if blocks:
                    read(w.view(-1), part, blocks)
                gemv.linear(x, w, out=y)

        graphs = {"with": _graph(prefix_and_gemv, dev)}
        if blocks:  # (no prefix: nothing to take off)
            graphs["without"] = _graph(prefix_only, dev)
        times: dict[str, list[float]] = {"with": [], "without": [0.0]}
        for _ in range(rounds):  # interleaved
            for key, gr in graphs.items():
                times[key].append(_replay_us(gr, dev))
        torch.cuda.synchronize(dev)
        errs = [_sum_error(part, w.view(-1), blocks) for w, part in zip(ws, parts)] if blocks else [0.0]
        out = torch.stack(ys).clone()
        if cold is None:
            cold = out
        us = (statistics.median(times["with"]) - statistics.median(times["without"])) / len(ws)
        rows.append({"shape": name, "prefix_mb": mb, "prefix_bytes": blocks * STREAM_BLOCK * 2, "gemv_us": us,
                     "prefix_read_us": statistics.median(times["without"]) / len(ws), "copies": len(ws),
                     "sum_ok": max(errs) <= SUM_TOL, "max_sum_err": max(errs),
                     "finite": bool(torch.isfinite(out).all()), "same_as_cold": bool(torch.equal(out, cold)),
                     "kernel": gemv.refusal(x, ws[0]) is None})
        print(f"{name} prefix {mb:3d} MB: GEMV {us:6.2f} us (prefix read {rows[-1]['prefix_read_us']:.2f} us)"
              f" sum_ok {rows[-1]['sum_ok']} same_as_cold {rows[-1]['same_as_cold']}", flush=True)
    base = rows[0]["gemv_us"] if rows and rows[0]["prefix_mb"] == 0 else None
    for r in rows:
        r["saved_us"] = None if base is None else base - r["gemv_us"]
    return rows


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for name in args.shapes:  # refused before anything runs
        plan(*SHAPES[name], args.prefix_mb)
    dev = torch.device("cuda")
    rows = [r for name in args.shapes for r in measure_shape(name, args.prefix_mb, args.rounds, dev)]
    text = json.dumps({"rows": rows}, indent=1)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "l2_prefix.json"), "w").write(text)
    bad = [r for r in rows if not (r["sum_ok"] and r["finite"] and r["same_as_cold"] and r["kernel"])]
    print("checks:", "all passed" if not bad else f"{len(bad)} rows failed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
