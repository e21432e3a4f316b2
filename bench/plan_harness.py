"""Decode chunking harness: the library's byte-balanced eager plan, the graph workspace's exact-count plan
(`DecodeWorkspace`, fixed grids: the `*_graph` arms) and, with --one-wave, the one-wave plan they replaced
(bench/versions/plan_one_wave.py), on the batches a server sees, with the floor and the strongest peer in the same
run: a plain streaming read of the folded pool's bytes (the lab's `read_folded` arm) and FlashInfer's tensor-core
decode on a split pool of the same values. Timed by `foldkv.lab.bench.run_cell` (outputs poisoned and checked against
the float64 reference first, CUDA-graph replays, arms interleaved round by round). Prints a table last.

Cases (the serving batches): ragged batches of 8, 32, 64 and 128 requests with lengths uniform in 1K-48K and a
long-tail mix of 64 (90% of 1-4K, 10% of 64K-200K), drawn by `foldkv.lab.bench.serving_cases` (the batches notebook 04
measures); one request at 10,602, 40,002 and 131,072 tokens; the 31B decode step's global-layer shapes at notebook
05's short cells (`MODEL_STEP_CASES`: one and eight requests of 4,100 tokens, one of 32,772). --only runs the cases
named, in that order (an unknown name stops the harness before it touches the GPU).

    python bench/plan_harness.py --json $OUT/plan.json          # on the H200 (source .devsite/env.sh first)
    python bench/plan_harness.py --plans                          # CPU: the two plans' chunk counts and estimates
    python bench/plan_harness.py --draw 920385503 --only drawn920385503/short_many --caps 16 24 32 48 64
                                  # a drawn batch of notebook 04 (its seed re-creates it), the plan at fixed caps
    python bench/plan_harness.py --draw 920385503 --only drawn920385503/short_many uniform128 --two-ctas
                                  # also the folded partial at two CTAs an SM (fp8_harness's folded_2cta_w264)

Then the host time of updating a plan per step (workspace plan()/advance() against FlashInfer's plan()).
Lab notes (prediction, outcome): bench/DECODE_NOTES.md, runs 7 and 8.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import foldkv
from foldkv import KvFormat, PagedKvLayout
from foldkv.kernels.plan import DEFAULT_SMS, balanced_chunk_pages, cta_count, estimated_step
from foldkv.lab.bench import (DRAWN_SHAPES, AttentionCase, ArmSpec, draw_batches, generated_arm, host_time_markdown,
                              measure_read_roof, plan_host_times, run_cell)
from foldkv.lab.bench.arms import READ_FOLDED
from foldkv.lab.bench.case import serving_cases
from foldkv.lab.checkout_stamp import provenance
from foldkv.lab.jsonsafe import jsonable
from foldkv.lab.report import environment

from versions import plan_one_wave  # bench/versions/

GEOM = foldkv.GEMMA4_31B


SINGLE_LENGTHS = (10602, 40002, 131072)
# the 31B decode step's global layers at notebook 05's short cells (bench/model_decode_probe.py): the prompt and a few
# generated tokens, one request or eight of the same length
MODEL_STEP_CASES = {"step4k_x1": [4100], "step4k_x8": [4100] * 8, "step32k_x1": [32772]}


def cases(seed: int = 0, draw_seeds=(), draw_shapes=DRAWN_SHAPES) -> dict[str, list[int]]:
    """The serving batches (the lab's `serving_cases`, the ones notebook 04 measures), one request at each of
    SINGLE_LENGTHS, the 31B step's global-layer shapes (MODEL_STEP_CASES), and for each of `draw_seeds` notebook 04's
    drawn batches of `draw_shapes` (`drawn<seed>/<shape>`: the seed a run printed re-creates its batches)."""
    drawn = {f"drawn{s}/{shape}": lens for s in draw_seeds for shape, lens in draw_batches(s, draw_shapes).items()}
    return {**serving_cases(seed), **{f"single{n}": [n] for n in SINGLE_LENGTHS}, **MODEL_STEP_CASES, **drawn}


def cap_arm(fmt: KvFormat, cap_pages: int) -> ArmSpec:
    """The eager decode with every request cut at `cap_pages` pages (plan_decode's chunk_tokens), whatever the
    byte-balanced plan would pick: the cost of a cap measured rather than modelled."""
    return ArmSpec(f"{fmt.value}_cap{cap_pages}", f"generated {fmt.value} decode, requests cut at {cap_pages} pages",
                   fmt.value, False, generated_arm("decode", fmt, "jit", plan_kw=lambda case: {
                       "chunk_tokens": cap_pages * case.page_size}), generated=True)


def one_wave_arm(fmt: KvFormat) -> ArmSpec:
    return ArmSpec(f"{fmt.value}_one_wave", f"generated {fmt.value} decode, one-wave chunking", fmt.value, False,
                   generated_arm("decode", fmt, "jit", plan_kw=lambda case: {"chunk_tokens": plan_one_wave.chunk_tokens(
                       PagedKvLayout(case.geom, fmt, case.page_size, 0), case.seq_lens,
                       torch.cuda.get_device_properties(case.device).multi_processor_count)}), generated=True)


def balanced_arm(fmt: KvFormat) -> ArmSpec:
    return ArmSpec(f"{fmt.value}_balanced", f"generated {fmt.value} decode, byte-balanced plan (library)", fmt.value,
                   False, generated_arm("decode", fmt, "jit"), generated=True)


def one_level_arm(fmt: KvFormat, unroll: int) -> ArmSpec:
    """One merge level: every merge group one chunk (plan merge_group=1), so level one has nothing to merge and is
    not launched; the level-two merge reads the request's chunks directly, `unroll` per round trip."""
    from foldkv.kernels.merge import build_merge_final

    def kernels(case):
        final = build_merge_final(case.geom, unroll=unroll)
        return {"merge_groups": lambda *args: None, "merge_final": final}

    return ArmSpec(f"{fmt.value}_one_level{unroll}", f"generated {fmt.value} decode, one merge level ({unroll} per "
                   "round trip)", fmt.value, False,
                   generated_arm("decode", fmt, "jit", kernels=kernels, plan_kw=lambda case: {"merge_group": 1}),
                   generated=True)


def show_plans(draw_seeds=(), caps=()):
    layout = PagedKvLayout(GEOM, KvFormat.FOLDED, 64, 0)
    print(f"{'case':<16} {'one-wave cap':>12} {'est':>8} {'balanced cap':>12} {'est':>8} {'predicted speed-up':>18}")
    for name, lens in cases(draw_seeds=draw_seeds).items():
        pages = [layout.pages_for(n) for n in lens]
        ow, bal = plan_one_wave.chunk_pages(layout, lens, DEFAULT_SMS), balanced_chunk_pages(layout, lens, DEFAULT_SMS)
        e_ow, e_bal = (estimated_step(pages, c, GEOM.num_kv_heads, DEFAULT_SMS) for c in (ow, bal))
        print(f"{name:<16} {ow:>12} {e_ow:>8.1f} {bal:>12} {e_bal:>8.1f} {e_ow / e_bal:>18.2f}")
        for cap in caps:
            print(f"{'':<16} cap {cap:>4}: {cta_count(pages, cap, GEOM.num_kv_heads):>6} CTAs, estimate "
                  f"{estimated_step(pages, cap, GEOM.num_kv_heads, DEFAULT_SMS):8.1f}")


def two_cta_arm() -> ArmSpec:
    """fp8_harness's `folded_2cta_w264` (run 11): the folded partial at two CTAs an SM, one stage each, planned for a
    wave of 2 x 132, so that one CTA's prologue, first load and epilogue run under the other's stream."""
    from fp8_harness import TWO_CTAS  # bench/

    return next(a for a in TWO_CTAS if a.name == "folded_2cta_w264")


def bench(rounds: int, out_json: str | None, only: list[str] | None, one_wave: bool = False,
          host_batches: list[int] = (), one_level: bool = False, draw_seeds=(), caps=(), two_ctas: bool = False):
    known = cases(draw_seeds=draw_seeds)
    unknown = [n for n in only or () if n not in known]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; --plans lists them")
    device = torch.device("cuda")
    roof = measure_read_roof(device)
    print(f"read roof measured: {roof['gbps']:.0f} GB/s ({roof['method']})", flush=True)
    arms = [balanced_arm(KvFormat.FOLDED), "folded_graph", balanced_arm(KvFormat.SPLIT), "split_graph",
            READ_FOLDED, "fi_tc"]
    if one_wave:
        arms += [one_wave_arm(KvFormat.FOLDED), one_wave_arm(KvFormat.SPLIT)]
    if one_level:
        arms += [one_level_arm(KvFormat.FOLDED, 8), one_level_arm(KvFormat.FOLDED, 40),
                 one_level_arm(KvFormat.SPLIT, 40)]
    arms += [cap_arm(KvFormat.FOLDED, c) for c in caps]
    if two_ctas:
        arms.append(two_cta_arm())
    cells = []
    for name in only or list(known):  # in the order asked: a call cut short keeps the first
        lens = known[name]
        case = AttentionCase(lens, device=device, fi_kv_layout="HND", min_copies=1)
        cells.append(run_cell(f"plan/{name}", "decode", case, arms, rounds=rounds, warmup=3, roof=roof,
                              log=lambda s: print(s, flush=True)))
        case.release()
        torch.cuda.empty_cache()
        if out_json:  # after every cell: a run cut short keeps what it measured
            save(out_json, device, roof, cells)
    host = plan_host_times(list(host_batches), device=device) if host_batches else []
    if out_json:
        save(out_json, device, roof, cells, host)
    print(f"\n{'case':<22} {'arm':<26} {'us':>9} {'x read':>7} {'x fi_tc':>8} {'chunks':>7} check")
    for c in cells:
        arms_ok = {n: a for n, a in c["arms"].items() if a["status"] == "ok"}
        read = arms_ok.get(READ_FOLDED, {}).get("us", {}).get("median")
        fi = arms_ok.get("fi_tc", {}).get("us", {}).get("median")
        for n, a in c["arms"].items():
            if a["status"] != "ok":
                print(f"{c['cell']:<22} {n:<26} {a['status']}: {a.get('reason', '')[:90]}")
                continue
            us = a["us"]["median"]
            rel = a["check"].get("rel_err", float("nan"))
            print(f"{c['cell']:<22} {n:<26} {us:9.1f} {us / read if read else float('nan'):7.2f} "
                  f"{fi / us if fi else float('nan'):8.2f} {str(a.get('info', {}).get('chunks', '')):>7} {rel:.1e}")
    if host:
        print("\nhost time per step (median us):")
        print(host_time_markdown(host))
    return cells


def save(path: str, device, roof: dict, cells: list, host: list | None = None) -> None:
    with open(path, "w") as fh:
        json.dump(jsonable({"env": environment(device), "provenance": provenance(), "roof": roof, "cells": cells,
                            "host_time": host or []}), fh, indent=1, allow_nan=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="*", help="case names (see --plans)")
    ap.add_argument("--plans", action="store_true", help="print the plans and their estimates (CPU) and exit")
    ap.add_argument("--one-wave", action="store_true", help="also time the one-wave plan it replaced")
    ap.add_argument("--one-level", action="store_true", help="also time one merge level (no level-one launch)")
    ap.add_argument("--host-batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256],
                    help="batch sizes of the host-time table (workspace plan/advance vs FlashInfer plan())")
    ap.add_argument("--draw", type=int, nargs="*", default=[], help="seeds of notebook 04's drawn batches to add")
    ap.add_argument("--caps", type=int, nargs="*", default=[], help="also time the folded decode cut at these caps")
    ap.add_argument("--two-ctas", action="store_true", help="also time the folded partial at two CTAs an SM, one stage"
                    " each, planned for a wave of 2 x SMs (fp8_harness's folded_2cta_w264, run 11's)")
    args = ap.parse_args(argv)
    if args.plans:
        show_plans(args.draw, args.caps)
        return 0
    bench(args.rounds, args.json, args.only, args.one_wave, args.host_batches, args.one_level, args.draw, args.caps,
          args.two_ctas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
