"""Lab notebook: a sliding layer's ring attention at the 31B's geometry against decode kernels and a plain read of
its bytes (MODEL_DECODE_NOTES run 30's first measurement; written before any GPU run).

Question: the library's ring attention (`ring.ring_attention`: cuBLAS's q.K^T, the fused masked softmax, cuBLAS's
P.V) reads the batch-8 rings at ~82% of the roof and the one-row rings at ~1/3 of it. Does a decode kernel read them
nearer the roof: foldkv's own split decode at the sliding geometry, or FlashInfer's?

The lab's decode harness (`foldkv.lab.bench.run_cell`) times it, one case a batch: `AttentionCase` at RING_GEOMETRY
(32 query heads over 16 KV heads of 256) with every request WINDOW tokens (a full ring: its slots hold the window's
last 1,024 keys, all live, in any order: attention is a sum over them), pool copies rotated past L2, every output
poisoned, written whole, nothing past it, and within the harness's tolerance of the float64 reference; arms
interleaved round by round. Arms (ARMS):
- ring_cublas: the library's `ring.ring_attention` over rings [B, Hkv, W, d] made from each pool copy (the same
  K and V values in the ring's layout: each KV head's window contiguous; `rings_from_pool`);
- split_jit / split_graph: foldkv's split decode at that geometry (TileLang, JIT), eager over its balanced plan and
  through the graph workspace;
- read_split: a plain streaming read of the same bytes (the floor);
- fi_cuda / fi_tc: FlashInfer's paged decode on CUDA cores / on tensor cores.

Prediction (the notes): ring_cublas ~11 us (B = 1) and ~38-40 us (B = 8); read ~3.7 / ~30-31; the decode kernels
~5-7 / ~32-35. A decode kernel at <= 1.1x the read at B = 8 says one of our own is worth ~0.25-0.35 ms a step at
4K x 8 (run 30); no better than cuBLAS says the rings' ~82% is what this shape gets.

    python3 bench/ring_probe.py --batches 1 8            # on the H200 (source .devsite/env.sh first)
"""

from __future__ import annotations

import argparse
import json
import os
import types

import torch

from foldkv.config import AttentionGeometry
from foldkv.layout import KvFormat
from foldkv.lab.bench.arms import READ_SPLIT, guarded_outputs
from foldkv.lab.bench.spec import ArmImpl, ArmSpec

RING_GEOMETRY = AttentionGeometry(num_q_heads=32, num_kv_heads=16, head_dim=256, name="gemma-4-31b sliding ring")
WINDOW = 1024  # the 31B's sliding window: a ring's slots
ARMS = ("ring_cublas", "split_jit", "split_graph", READ_SPLIT, "fi_cuda", "fi_tc")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--rounds", type=int, default=15)
    return ap


def rings_from_pool(pool, page_ids: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rings (K, V) [B, Hkv, window, d] (contiguous, each KV head's window in a row) holding the split pool's
    rows of each request's first `window` tokens: page_ids [B, >= window / page] (host)."""
    d, page = pool.geometry.head_dim, pool.layout.page_size
    if window % page:
        raise ValueError(f"window {window}: not a whole number of {page}-token pages")
    pages = page_ids[:, :window // page].to(pool.data.device, torch.long)  # [B, W / page]
    rows = pool.data[pages]  # [B, W / page, Hkv, page, 2d]
    b, n, hkv = rows.shape[:3]
    ring = rows.permute(0, 2, 1, 3, 4).reshape(b, hkv, n * page, 2 * d)  # [B, Hkv, W, 2d]
    return ring[..., :d].contiguous(), ring[..., d:].contiguous()


def ring_arm(red: str | None = None) -> ArmSpec:
    """The library's ring attention as a harness arm (module docstring). `red` (the CPU test's red twin, never for
    use): "other_request" gives each request the next one's ring."""

    def build(case) -> ArmImpl:
        from foldkv import ring
        from foldkv.masks import RingMask

        q = case.query(KvFormat.SPLIT)  # [B, Hq, d]: one query a request, head order
        b, hq, d = q.shape
        hkv = case.geom.num_kv_heads
        if len(set(case.seq_lens)) != 1:
            raise ValueError(f"a ring case is requests of one window's length each, not {sorted(set(case.seq_lens))}")
        rings = [rings_from_pool(p, case.table_cpu.page_ids, case.seq_lens[0]) for p in case.pools(KvFormat.SPLIT)]
        if red == "other_request":
            rings = [(k.roll(1, 0).contiguous(), v.roll(1, 0).contiguous()) for k, v in rings]
        out, _, guards = guarded_outputs(q)
        mask = RingMask(torch.ones(b, 1, 1, case.seq_lens[0], dtype=torch.bool, device=q.device))
        module = types.SimpleNamespace(scaling=1.0)  # Gemma 4's (its q_norm replaces the scale), as the others'
        packed = out.view(b, hkv, hq // hkv, d)  # P.V written straight into the output (ring_attention's out=)
        calls = [lambda k=k, v=v: ring.ring_attention(module, q[:, :, None], k, v, mask, out=packed)
                 for k, v in rings]
        return ArmImpl(calls, out, graph=True, guards=guards[:1], keep=(rings, mask),
                       info={"ring": f"[{b}, {hkv}, {case.seq_lens[0]}, {d}] x 2"})

    return ArmSpec("ring_cublas", "the library's ring attention (cuBLAS q.K^T, fused softmax, cuBLAS P.V) over rings"
                   " made from the split pool", "split", False, build, cpu_ok=True)


def cases(batches, device) -> dict:
    """{"ring/xB": AttentionCase} for each batch: B requests of WINDOW tokens at RING_GEOMETRY (refused before any
    allocation when a batch is < 1)."""
    from foldkv.lab.bench.case import AttentionCase

    bad = [b for b in batches if b < 1]
    if bad:
        raise ValueError(f"batches {bad}: at least one request")
    return {f"ring/x{b}": AttentionCase([WINDOW] * b, device=device, geom=RING_GEOMETRY, fi_kv_layout="HND",
                                        min_copies=1) for b in batches}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from foldkv.lab.bench import measure_read_roof, run_cell
    from foldkv.lab.checkout_stamp import provenance

    dev = torch.device("cuda")
    todo = cases(args.batches, dev)
    roof = measure_read_roof(dev)
    print(f"read roof {roof['gbps']:.0f} GB/s", flush=True)
    arms = [ring_arm() if a == "ring_cublas" else a for a in args.arms]
    cells = []
    for name, case in todo.items():
        cells.append(run_cell(name, "decode", case, arms, rounds=args.rounds, warmup=3, roof=roof,
                              log=lambda s: print(s, flush=True)))
        case.release()
        torch.cuda.empty_cache()
    print(f"\n{'case':<10} {'arm':<14} {'us':>8} {'x read':>7} {'% roof':>7} check")
    for c in cells:
        read = c["arms"].get(READ_SPLIT, {}).get("us", {}).get("median")
        for n, a in c["arms"].items():
            if a["status"] != "ok":
                print(f"{c['cell']:<10} {n:<14} {a['status']}: {a.get('reason', '')[:90]}")
                continue
            us = a["us"]["median"]
            pct = a["pct_roof"]["median"] if a.get("pct_roof") else float("nan")
            print(f"{c['cell']:<10} {n:<14} {us:8.2f} {us / read if read else float('nan'):7.2f} {pct:7.1f}"
                  f" {'ok' if a['check']['ok'] else 'FAILED'} {a['check'].get('rel_err', float('nan')):.1e}")
    if os.environ.get("OUT"):
        from foldkv.lab.jsonsafe import jsonable

        with open(os.path.join(os.environ["OUT"], "ring_probe.json"), "w") as fh:
            json.dump(jsonable({"provenance": provenance(), "roof": roof, "cells": cells}), fh, indent=1)
    return 0 if all(a["status"] != "error" and a.get("check", {}).get("ok", True)
                    for c in cells for a in c["arms"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
