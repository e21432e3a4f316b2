"""Decode harness: one request at the 31B shape, one layer, end to end (partial + merges), timed by the lab's
harness (`foldkv.lab.bench.run_cell`: pools rotated past L2, outputs poisoned and checked against the float64
reference, CUDA-graph replays, arms interleaved round by round). Prints a table: us, GB/s, % of the read roof
measured in the same run.

Arms: our generated kernels on a folded pool and on a split pool (tags: a partial tiling such as tm64s2 = the library
partial; hm32s3 = the head-major order of bench/versions/decode_partial_head_major.py; a 'v3' suffix = the query load
by all threads of bench/versions/decode_partial_query_all_threads.py), the partial kernel alone (no merges), a plain
streaming read of the bytes a decode reads (`foldkv.lab.bench.stream_read_arm`), and FlashInfer's paged decode
(tensor-core and CUDA-core paths, `fi_tc` / `fi_cuda`) on a split pool of the same values in its HND layout.

    python bench/decode_harness.py                   # on the H200 (source .devsite/env.sh first for FlashInfer)
    python bench/decode_harness.py --resources       # CPU: registers / shared memory / spills per variant (nvcc)

Lab notes (prediction, outcome, resource report) are in bench/DECODE_NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

import foldkv
from foldkv import KvFormat
from foldkv.kernels import decode as dec
from foldkv.kernels import decode_partial, merge
from foldkv.lab import byte_floor
from foldkv.lab.bench import (ArmImpl, ArmSpec, AttentionCase, generated_arm, measure_read_roof, run_cell,
                              stream_read_arm)
from foldkv.lab.checkout_stamp import provenance
from foldkv.lab.jsonsafe import jsonable
from foldkv.lab.report import environment
from versions import decode_partial_head_major, decode_partial_query_all_threads  # bench/versions/

GEOM = foldkv.GEMMA4_31B
LENGTHS = (10602, 40002, 81653, 163336)
DEFAULT_TILINGS = {"folded": ["tm64s2", "tm64s2v3"], "split": ["tm64s1", "tm64s1v3"]}


def parse_tiling(tag: str) -> tuple:
    """'tm64s2' -> (the library partial's builder, block_n=64, num_stages=2); 'hm32s3' -> the head-major version's
    builder; a 'v3' suffix (token-major only) -> the version whose query is loaded by all threads."""
    v3 = tag.endswith("v3")
    tag = tag[:-2] if v3 else tag
    order, (bn, st) = tag[:2], tag[2:].split("s")
    if order not in ("tm", "hm") or (v3 and order != "tm"):
        raise SystemExit(f"tiling {tag!r}: expected tm<block_n>s<stages>[v3] or hm<block_n>s<stages>")
    build = (decode_partial_head_major.build if order == "hm" else
             decode_partial_query_all_threads.build if v3 else decode_partial.build_decode_partial)
    return build, dict(block_n=int(bn), num_stages=int(st))


def build_partial(fmt: KvFormat, tag: str):
    build, tiling = parse_tiling(tag)
    return build(GEOM, fmt, **tiling)


def smem_bytes(fmt: KvFormat, block_n: int, num_stages: int, **_) -> int:
    """Shared memory of a partial CTA: the K/V stages, the padded query (16 x 512 bf16) and P (16 x N bf16)."""
    width = foldkv.row_width(GEOM, fmt)
    return num_stages * block_n * width * 2 + 16 * GEOM.head_dim * 2 + 16 * block_n * 2


def kernels_for(fmt: KvFormat, tag: str) -> dict:
    """The launcher's `kernels=` for tiling `tag`: its partial kernel; the merges come from the library's resolver."""
    return {dec.partial_kernel_name(fmt): build_partial(fmt, tag)}


# --- arms ------------------------------------------------------------------------------------------------------
def tiling_arm(fmt: KvFormat, tag: str) -> ArmSpec:
    """The whole decode (partial + merges) with the partial of tiling `tag`, through the public launcher."""
    return ArmSpec(f"{fmt.value}_{tag}", f"generated {fmt.value} decode, partial {tag}", fmt.value, False,
                   generated_arm("decode", fmt, "jit", kernels=lambda case: kernels_for(fmt, tag)),
                   generated=True)


def partial_only_arm(fmt: KvFormat, tag: str) -> ArmSpec:
    """The partial kernel alone (no merges): end to end minus this is what the two merges cost. Its check: every
    chunk's partial output and LSE, poisoned first, is written."""

    def build(case: AttentionCase) -> ArmImpl:
        pools, query, table = case.pools(fmt), case.query(fmt), case.table
        plan = dec.plan_decode(pools[0].layout, case.table_cpu.seq_lens, device=case.device)
        partial = build_partial(fmt, tag)
        calls = [lambda p=p: partial(query, p.data, table.page_ids, plan.chunk_req, plan.chunk_start, plan.chunk_len,
                                     plan.part_o, plan.part_lse) for p in pools]

        def check() -> dict:
            plan.part_o.fill_(float("nan"))
            plan.part_lse.fill_(float("nan"))
            calls[0]()
            torch.cuda.synchronize(case.device)
            written = bool(torch.isfinite(plan.part_o).all()) and bool(torch.isfinite(plan.part_lse).all())
            return {"written": written, "ok": written, "what": "every chunk's partial output and LSE written"}

        return ArmImpl(calls, plan.part_o, graph=True, keep=plan, check=check,
                       info={"chunks": plan.num_chunks, "chunk_tokens": plan.chunk_tokens})

    return ArmSpec(f"{fmt.value}_{tag}_partial", f"generated {fmt.value} partial {tag} alone", fmt.value, False, build)


def stream_read_spec(fmt: KvFormat) -> ArmSpec:
    """No attention at all: the read-roof kernel over the pool bytes a decode of `fmt` reads, rotated like the
    pools: what any single kernel reading those bytes costs here (the floor plus one launch, ramp and drain)."""

    def build(case: AttentionCase) -> ArmImpl:
        kv = byte_floor.step_bytes(case.geom, fmt, case.seq_lens)["kv"]
        return stream_read_arm(kv, case.device, copies=case.copies_for(fmt))

    return ArmSpec(f"stream_read_{fmt.value}_bytes", f"streaming read of the {fmt.value} pool's bytes", fmt.value,
                   False, build)


def bench(lengths, tilings, rounds, with_flashinfer, out_json, partial_only=(), stream_read=(), library=False):
    device = torch.device("cuda")
    roof = measure_read_roof(device)
    print(f"read roof measured: {roof['gbps']:.0f} GB/s ({roof['method']})", flush=True)
    arms: list = [tiling_arm(KvFormat.parse(f), tag) for f, tags in tilings.items() for tag in tags]
    arms += [partial_only_arm(KvFormat.parse(f), tag) for f, tag in (spec.split(":") for spec in partial_only)]
    arms += [stream_read_spec(KvFormat.parse(f)) for f in stream_read]
    arms += ["folded_jit", "split_jit"] if library else []
    arms += ["fi_tc", "fi_cuda"] if with_flashinfer else []
    cells = []
    for length in lengths:
        case = AttentionCase([length], device=device, fi_kv_layout="HND")
        cell = run_cell(f"decode/{length}", "decode", case, arms, rounds=rounds, warmup=5, roof=roof,
                        log=lambda s: print(s, flush=True))
        case.release()
        torch.cuda.empty_cache()
        cells.append(cell)
        for name, a in cell["arms"].items():
            if a["status"] == "ok":
                print(f"  {length:>7} {name:<24} {a['us']['median']:8.1f} us  check {a['check']}", flush=True)
            else:
                print(f"  {length:>7} {name:<24} {a['status']}: {a.get('reason', '')[:150]}", flush=True)
    if out_json:  # the cells with the code they measured (commit, dirty flag, sha256 of each kernel built)
        with open(out_json, "w") as fh:
            json.dump(jsonable({"env": environment(device), "provenance": provenance(), "roof": roof,
                                "cells": cells}), fh, indent=1, allow_nan=False)
    print(f"\n{'tokens':>7} {'arm':<24} {'us':>8} {'floor':>7} {'GB/s':>7} {'%roof':>6} {'rel_err':>8} timing")
    for c in cells:
        for name, a in c["arms"].items():
            if a["status"] != "ok":
                continue
            us, floor_us = a["us"]["median"], a["floor_us"]
            rel = a["check"].get("rel_err", float("nan"))
            print(f"{c['context']:>7} {name:<24} {us:8.1f} {floor_us:7.1f} {a['bytes'] / (us * 1e3):7.0f} "
                  f"{100 * floor_us / us:6.1f} {rel:8.1e} {a['timing']}")
    return cells


# --- resource report (CPU) ---------------------------------------------------------------------------------------
def resources(tilings):
    """nvcc -Xptxas -v on each variant's emitted CUDA: registers, stack, spills; shared memory from the tiling."""
    from tilelang.contrib.nvcc import default_compile_options, get_nvcc_compiler

    todo = [(f"decode_partial_{f}_{t}", build_partial(KvFormat.parse(f), t),
             smem_bytes(KvFormat.parse(f), **parse_tiling(t)[1])) for f, tags in tilings.items() for t in tags]
    todo += [("merge_groups", merge.build_merge_groups(GEOM), 0), ("merge_final", merge.build_merge_final(GEOM), 0)]
    for name, kernel, smem in todo:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.cu")
            with open(src, "w") as fh:
                fh.write(kernel.get_kernel_source())
            cmd = [get_nvcc_compiler(), "-cubin", "-O3", "-arch=sm_90a", "-Xptxas=-v", "-o",
                   os.path.join(tmp, "k.cubin"), src] + default_compile_options()
            res = subprocess.run(cmd, capture_output=True, text=True)
        info = [ln.strip() for ln in res.stderr.splitlines() if "ptxas info    : Used" in ln or "spill" in ln]
        print(f"{name}: dynamic smem {smem} B; " + "; ".join(info))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    ap.add_argument("--folded", nargs="*", default=DEFAULT_TILINGS["folded"], help="folded tilings, e.g. tm64s2 hm64s2 tm64s2v3")
    ap.add_argument("--split", nargs="*", default=DEFAULT_TILINGS["split"], help="split tilings, e.g. tm64s1 hm32s2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--partial-only", nargs="*", default=["folded:tm64s2", "split:tm64s1"],
                    help="format:tiling arms timed without the merges")
    ap.add_argument("--stream-read", nargs="*", default=[], choices=["folded", "split"],
                    help="a plain streaming read of the bytes a decode of that format reads (the per-kernel floor)")
    ap.add_argument("--library", action="store_true", help="also the library's decode of each format (folded_jit,"
                    " split_jit: one fused launch when the plan is one wave)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--resources", action="store_true", help="print the resource report (CPU, nvcc) and exit")
    args = ap.parse_args(argv)
    tilings = {"folded": args.folded, "split": args.split}
    if args.resources:
        return resources(tilings)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --resources on a CPU machine")
    bench(args.lengths, tilings, args.rounds, not args.no_flashinfer, args.json, args.partial_only,
          args.stream_read, library=args.library)


if __name__ == "__main__":
    main()
