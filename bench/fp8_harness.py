"""FP8 decode harness: the FP8 folded decode (foldkv's e4m3 row, one float32 scale per token and KV head) against the
bf16 folded decode, the plain read of each pool's bytes, and FlashInfer's tensor-core decode over a bf16 and an e4m3
split pool (per-tensor scales), in one run. Timed by `foldkv.lab.bench.run_cell` (each arm checked first against the
float64 reference over its own pool, dequantized for FP8; CUDA-graph replays; arms interleaved round by round).
Prints a table last.

    python bench/fp8_harness.py --json $OUT/fp8.json          # on the H200 (source .devsite/env.sh first)

Lab notes (prediction, outcome): bench/FP8_NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch

from foldkv import GEMMA4_31B, KvFormat
from foldkv.fp8 import FP8_DTYPE
from foldkv.kernels.decode import partial_kernel_name
from foldkv.kernels.decode_partial import build_decode_partial, build_decode_partial_fp8
from foldkv.lab.bench import ArmSpec, AttentionCase, generated_arm, measure_read_roof, run_cell
from foldkv.lab.bench.case import serving_cases
from foldkv.lab.checkout_stamp import provenance
from foldkv.lab.jsonsafe import jsonable
from foldkv.lab.report import environment
from foldkv.pool import BlockTable, PagedKvLayout
from versions import (decode_fused_ll, decode_fused_ll_compact, decode_fused_smem_tail,  # bench/versions/
                      decode_fused_tail_paths, decode_partial_fp8_cvt, decode_partial_fp8_mma, decode_partial_fp8_probe,
                      decode_partial_fp8_rs, decode_partial_fp8_tc_t32, decode_partial_fp8_tc_vrot,
                      decode_partial_fp8_tc_ws, decode_partial_two_ctas)


def partial_variant(name: str, what: str, build: Callable[[], object], fp8: bool = True,
                    fmt: KvFormat = KvFormat.FOLDED, plan_kw: dict | None = None, fp8_math: str = "exact") -> ArmSpec:
    """An experiment's arm: the decode of `fmt` (folded over the FP8 pool, or a bf16 pool with fp8=False) with its
    partial kernel replaced by `build()` (a version's or the library's builder with other params), planned with
    `plan_kw` (plan_decode's keywords) when given. Over the FP8 pool the experiment stands in for the partial of
    `fp8_math` ("exact": the converting one, named so by runs 1-16; "tensor_cores": the FP8 tensor-core partial,
    whose plan then balances its wave of 2 x SMs, `decode.partial_wave`)."""
    kernels = lambda case: {partial_kernel_name(fmt, fp8, fp8_math): build()}  # noqa: E731
    return ArmSpec(name, what, "folded_fp8" if fp8 else fmt.value, False,
                   generated_arm("decode", fmt, "jit", kernels=kernels, plan_kw=plan_kw and (lambda case: plan_kw),
                                 dtype=FP8_DTYPE if fp8 else torch.bfloat16, fp8_math=fp8_math if fp8 else None),
                   generated=True)


G = GEMMA4_31B
# run 3: the library's partial (integer e4m3 -> bf16 conversion, one consumer warpgroup), the run-1 partial
# (TileLang's element conversion through the conversion unit) and two consumer warpgroups (each converts half of
# each panel; S's query columns and O's rows split between them)
VARIANTS = [partial_variant("fp8_cvt", "FP8 partial, TileLang's element conversion (run 1)",
                            lambda: decode_partial_fp8_cvt.build(G)),
            partial_variant("fp8_t256", "FP8 partial, integer conversion, two consumer warpgroups",
                            lambda: build_decode_partial_fp8(G, KvFormat.FOLDED, threads=256))]
# run 5: both gemms with A from registers, converted there (bench/versions/decode_partial_fp8_rs.py)
RS = partial_variant("fp8_rs", "FP8 partial, both gemms with A from registers (wgmma RS)",
                     lambda: decode_partial_fp8_rs.build(G))
# run 6: the library's FP8 partial with its conversion cut to a copy, or left out (wrong output: timing probes)
PROBES = [partial_variant(f"fp8_{kind}", f"FP8 partial, conversion {what} (probe: wrong output)",
                          lambda kind=kind: decode_partial_fp8_probe.build(G, kind))
          for kind, what in (("copy", "replaced by a copy of the bytes"), ("skip", "left out"))]
# run 8: the consumer split over two warpgroups, or not, with the conversion out of the way: does it shorten a tile?
SPLITS = [partial_variant("folded_t256", "bf16 folded partial, two consumer warpgroups (S's columns and O's rows"
                          " split)", lambda: build_decode_partial(G, KvFormat.FOLDED, threads=256), fp8=False),
          partial_variant("fp8_skip_t128", "FP8 partial, conversion left out, one consumer warpgroup (probe: wrong"
                          " output)", lambda: decode_partial_fp8_probe.build(G, "skip", threads=128))]
# run 9: the softmax's cross-warp reductions carry all of a thread's queries at once (one barrier chain per max and
# per sum instead of one per query): does the tile's chain shorten?
BATCHED = [partial_variant("folded_rb4", "bf16 folded partial, batched softmax reductions",
                           lambda: build_decode_partial(G, KvFormat.FOLDED, reduce_batch=4), fp8=False),
           partial_variant("split_rb4", "bf16 split partial, batched softmax reductions",
                           lambda: build_decode_partial(G, KvFormat.SPLIT, reduce_batch=4), fp8=False,
                           fmt=KvFormat.SPLIT),
           partial_variant("fp8_rb2", "FP8 partial, batched softmax reductions",
                           lambda: build_decode_partial_fp8(G, KvFormat.FOLDED, reduce_batch=2)),
           partial_variant("fp8_rs_rb2", "FP8 partial, A from registers, batched softmax reductions",
                           lambda: decode_partial_fp8_rs.build(G, reduce_batch=2))]
# run 11: two CTAs of the bf16 folded partial on each SM (one stage each, 104 KB of shared memory and 128 registers a
# thread; the consumer warpgroup 232 after setmaxnreg): two tiles' chains and loads in flight per SM, planned for one
# wave of 132 or of 264 CTAs
TWO_CTAS = [partial_variant(f"folded_2cta_w{w}", f"bf16 folded partial, two CTAs per SM, plan for {w} CTAs a wave",
                            lambda: decode_partial_two_ctas.build(G, KvFormat.FOLDED, reduce_batch=4), fp8=False,
                            plan_kw={"num_sms": w})
            for w in (132, 264)]
# runs 12-13: both gemms on FP8 tensor cores, no conversion (bench/versions/decode_partial_fp8_mma.py): V^T left
# unwritten (probe: the chain without a transpose) or transposed by the consumer (16 x 4 blocks, run 12; 4 x 16
# conflict-free, run 13), the query and P in one e4m3 part with constant gains or in two (hi + lo, "p"); one CTA per SM
# with two stages, or two CTAs per SM with one stage each (planned for one wave of 264)
def _fp8_mma(name: str, transpose: str, two: bool, precise: bool = False) -> ArmSpec:
    what = {"none": "V^T unwritten", "t16x4": "V^T transposed by the consumer (16 x 4 blocks)",
            "t4x16": "V^T transposed by the consumer (4 x 16 blocks)"}[transpose]
    return partial_variant(
        name + ("_2cta_w264" if two else ""),
        f"FP8 partial, FP8 wgmma for both gemms, {what}{', two CTAs per SM' if two else ''}, query and P in"
        f" {'two e4m3 parts' if precise else 'e4m3 with constant gains (probe)'}",
        lambda: decode_partial_fp8_mma.build(G, transpose=transpose, precise=precise, num_stages=1 if two else 2,
                                             ctas_per_sm=2 if two else 1),
        plan_kw={"num_sms": 264} if two else None)


FP8_MMA = [_fp8_mma(name, t, two, p) for name, t, p in (("fp8_mma", "none", False), ("fp8_mma_t", "t16x4", False),
                                                        ("fp8_mma_t4", "t4x16", False), ("fp8_mma_t4p", "t4x16", True))
           for two in (False, True)]
# run 19: the FP8 tensor-core partial at a 32-token tile with three (or two) stages a CTA, two CTAs an SM
# (bench/versions/decode_partial_fp8_tc_t32.py), in place of the library's tensor-core partial (fp8_math="tensor_cores":
# its plan balances 2 x SMs CTAs a wave); checked first against the float64 reference over the dequantized pool
FP8_TC_T32 = [partial_variant(f"fp8_tc_t32s{s}", f"FP8 tensor-core partial, 32-token tile, {s} stages a CTA, two CTAs"
                              " an SM (query and P in two e4m3 parts)",
                              lambda s=s: decode_partial_fp8_tc_t32.build(G, num_stages=s), fp8_math="tensor_cores")
              for s in (3, 2)]
# run 20: the FP8 tensor-core partial with V^T written by a transposer warpgroup (value window read from global memory)
# and the consumer's chain without the transpose, a T.WSSchedule (bench/versions/decode_partial_fp8_tc_ws.py), in
# place of the library's tensor-core partial; `_r96`: the transposer at 96 registers (the consumer 160; ptxas spills
# 60 bytes), against the default 112 / 144 (no spill)
FP8_TC_WS = [partial_variant(f"fp8_tc_ws{suffix}", f"FP8 tensor-core partial, V^T by a transposer warpgroup, consumer"
                             f" without the transpose (transposer {n} registers), two CTAs an SM",
                             lambda n=n: decode_partial_fp8_tc_ws.build(G, transposer_nreg=n), fp8_math="tensor_cores")
             for suffix, n in (("", 112), ("_r96", 96))]
# the served tensor-core partial alone: merge_groups and merge_final replaced by nothing (a timing probe: the output is
# never written, so its check fails by design): the step less its two merge launches, which an FP8 step pays where a
# bf16 one-wave step merges at its partial's tail
FP8_TC_PARTIAL_ONLY = ArmSpec("fp8_tc_partial_only", "FP8 tensor-core partial alone, no merges (probe: output not"
                              " written)", "folded_fp8", False,
                              generated_arm("decode", KvFormat.FOLDED, "jit", dtype=FP8_DTYPE, fp8_math="tensor_cores",
                                            kernels=lambda case: {"merge_groups": lambda *a: None,
                                                                  "merge_final": lambda *a: None}),
                              generated=True)
# run 21: the FP8 tensor-core partial over a pool whose V_rot panel is stored pre-transposed (a permuted copy of the
# case's pool, made at the arm's first call: bench/versions/decode_partial_fp8_tc_vrot.py), three panels transposed a
# tile instead of four; the reference reads the unpermuted pool
FP8_TC_VROT = partial_variant("fp8_tc_vrot", "FP8 tensor-core partial, V_rot pre-transposed in the pool (three value"
                              " panels transposed a tile), two CTAs an SM",
                              lambda: decode_partial_fp8_tc_vrot.harness_kernel(G), fp8_math="tensor_cores")
# run 12: a one-wave plan's step is one launch, the partial merging its request-heads at its tail (the library's
# decode_fused_<format>, what folded_jit / split_jit run there); these arms run the three launches on the same plan
THREE_LAUNCHES = [ArmSpec(f"{f.value}_three", f"{f.value} decode, three launches (partial, merge_groups, merge_final)",
                          f.value, False, generated_arm("decode", f, "jit", fused=False), generated=True)
                  for f in (KvFormat.FOLDED, KvFormat.SPLIT)]
# run 14: the fused step with its tail's partials as self-validating words (bench/versions/decode_fused_ll.py), or a
# timing probe of it, in place of the library's fused kernel (one-wave plans; the three launches elsewhere, as the
# library); run 21: the same protocol with a compact merge and a wait between the readers' passes
# (bench/versions/decode_fused_ll_compact.py). One step per arm, built on first use
_LL_STEPS: dict = {}


def _ll_arm(fmt: KvFormat, probe: str | None = None, compact: bool = False, wait: str | None = None) -> ArmSpec:
    key = (fmt, probe, compact, wait)

    def kernels(case):
        if key not in _LL_STEPS:
            _LL_STEPS[key] = (decode_fused_ll_compact.CompactLLStep(G, fmt, wait) if compact
                              else decode_fused_ll.LLStep(G, fmt, probe))
        return {f"decode_fused_{fmt.value}": _LL_STEPS[key]}

    name = f"{fmt.value}_ll" + ("_compact" if compact else "") + "".join(f"_{x}" for x in (wait, probe) if x)
    what = f"{fmt.value} decode, fused step with the tail's partials as self-validating words" + (
        f", compact merge, readers' wait: {wait or 'none'}" if compact else "") + (f", probe: {probe}" if probe else "")
    return ArmSpec(name, what, fmt.value, False, generated_arm("decode", fmt, "jit", kernels=kernels), generated=True)


LL_FUSED = [_ll_arm(f) for f in (KvFormat.FOLDED, KvFormat.SPLIT)]
LL_PROBES = [_ll_arm(KvFormat.FOLDED, probe) for probe in ("inline", "no_wait")]
LL_COMPACT = [_ll_arm(f, compact=True, wait=wait) for f in (KvFormat.FOLDED, KvFormat.SPLIT)
              for wait in (None, "spin", "spin_warp")]


def _tail_paths_arm(fmt: KvFormat, name: str, paths: tuple) -> ArmSpec:
    """The fused step with its tail merging `paths` ((columns a thread, members a round trip) per member count: one
    path for any count, or the few-members path then the many-members one) instead of the library's
    (bench/versions/decode_fused_tail_paths.py)."""
    kernels = lambda case: {f"decode_fused_{fmt.value}": decode_fused_tail_paths.build(G, fmt, paths)}  # noqa: E731
    return ArmSpec(f"{fmt.value}_tail_{name}", f"{fmt.value} decode, fused step, tail paths {paths}", fmt.value, False,
                   generated_arm("decode", fmt, "jit", kernels=kernels), generated=True)


# run 16: the fused tail with fewer members a round trip (less merge code, more trips)
TAIL_SIZES = [_tail_paths_arm(f, name, paths) for f in (KvFormat.FOLDED, KvFormat.SPLIT)
              for name, paths in decode_fused_tail_paths.PATHS.items()]
# run 17: the same merge from shared memory, all loads in flight by cp.async, rolled loops
SMEM_TAIL = [ArmSpec(f"{f.value}_tail_smem", f"{f.value} decode, fused step, tail merged from shared memory (cp.async)",
                     f.value, False, generated_arm("decode", f, "jit", kernels=lambda case, f=f: {
                         f"decode_fused_{f.value}": decode_fused_smem_tail.build(G, f)}), generated=True)
             for f in (KvFormat.FOLDED, KvFormat.SPLIT)]
# run 20b: the library's step planned for fewer SMs (w / 4 chunks a request-head): how fast w SMs read a short request,
# the part of a thread-block-cluster step (chunks of a request-head in one cluster, merged through distributed shared
# memory instead of the tail's trips to L2) that a plan measures today
NARROW = [ArmSpec(f"folded_w{w}", f"bf16 folded decode planned for {w} SMs ({w // 4} chunks a request-head)", "folded",
                  False, generated_arm("decode", KvFormat.FOLDED, "jit", plan_kw=lambda case, w=w: {"num_sms": w}),
                  generated=True)
          for w in (32, 64, 96)]
ARMS = ["folded_jit", "split_jit", "folded_fp8_jit", *VARIANTS, RS, *PROBES, *SPLITS, *BATCHED, *TWO_CTAS, *FP8_MMA,
        *FP8_TC_T32, *FP8_TC_WS, FP8_TC_VROT, FP8_TC_PARTIAL_ONLY,
        *THREE_LAUNCHES, *LL_FUSED, *LL_PROBES, *LL_COMPACT, *TAIL_SIZES, *SMEM_TAIL, *NARROW,
        "read_folded", "read_folded_fp8", "fi_tc", "fi_tc_fp8"]


class ResidentCase(AttentionCase):
    """The case with every request's pages mapped in turn onto `resident` physical pages (a few MB: they stay in L2),
    one copy, no rotation: the arms' time with the DRAM stream out of the way, so a kernel's per-tile cost on its
    own. The same table serves the kernels and the float64 reference, so the checks hold as usual. The plain-read
    arms read their own buffers (not this pool): they keep measuring DRAM."""

    def __init__(self, seq_lens, resident: int, **kw):
        super().__init__(seq_lens, rotate_bytes=0, min_copies=1, max_copies=1, **kw)
        self.resident = resident

    def layout(self, fmt, dtype=torch.bfloat16) -> PagedKvLayout:
        return PagedKvLayout(self.geom, KvFormat.parse(fmt), self.page_size, self.resident, dtype=dtype)

    @property
    def table_cpu(self) -> BlockTable:
        if self._table is None:
            need = [-(-n // self.page_size) for n in self.seq_lens]
            ids = torch.full((len(need), max(need) + 1), -1, dtype=torch.int32)
            first = 0
            for r, n in enumerate(need):
                ids[r, :n] = (torch.arange(first, first + n) % self.resident).to(torch.int32)
                first += n
            self._table = BlockTable(ids, torch.tensor(self.seq_lens, dtype=torch.int32))
        return self._table


SINGLE = (10_602, 81_653, 163_336)
BATCHES = ("uniform32", "uniform128", "longtail64")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-flashinfer", action="store_true", help="leave out the FlashInfer arms (their JIT builds take "
                    "minutes on a fresh machine)")
    ap.add_argument("--batches", nargs="*", default=list(BATCHES), help="serving cases (foldkv.lab.bench.case)")
    ap.add_argument("--single", nargs="*", type=int, default=list(SINGLE), help="lengths of one-request cases")
    ap.add_argument("--lens", nargs="*", default=[], help="more cases, each a comma-separated list of request lengths"
                    " (e.g. 1,63,65,10602)")
    ap.add_argument("--arms", nargs="*", default=None, help="only these arms (names), e.g. folded_jit fp8_rs")
    ap.add_argument("--resident-pages", type=int, default=None, help="map every request's pages onto this many "
                    "physical pages (held in L2; ResidentCase): the per-tile cost without the DRAM stream")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    roof = measure_read_roof(device)
    print(f"read roof measured: {roof['gbps']:.0f} GB/s ({roof['method']})", flush=True)
    cases = {**{f"single{n}": [n] for n in args.single},
             **(serving_cases(0, tuple(args.batches)) if args.batches else {}),  # no names: none (not all)
             **{f"lens{i}": [int(n) for n in spec.split(",")] for i, spec in enumerate(args.lens)}}
    cells = []
    for name, lens in cases.items():
        if args.resident_pages:
            case = ResidentCase(lens, args.resident_pages, device=device, fi_kv_layout="HND")
        else:
            case = AttentionCase(lens, device=device, fi_kv_layout="HND", min_copies=1 if len(lens) > 1 else 2)
        arms = [a for a in ARMS if not (args.no_flashinfer and isinstance(a, str) and a.startswith("fi_"))]
        if args.arms:
            arms = [a for a in arms if (a if isinstance(a, str) else a.name) in args.arms]
        prefix = f"fp8_resident{args.resident_pages}" if args.resident_pages else "fp8"
        cells.append(run_cell(f"{prefix}/{name}", "decode", case, arms, rounds=args.rounds, warmup=3, roof=roof,
                              log=lambda s: print(s, flush=True)))
        case.release()
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(jsonable({"env": environment(device), "provenance": provenance(), "roof": roof,
                                    "cells": cells}), fh, indent=1, allow_nan=False)
    print(f"\n{'case':<20} {'arm':<17} {'us':>9} {'x own read':>10} {'x bf16 fold':>11} {'fi_tc_fp8 x':>11} check"
          f" (output rel, LSE max abs, ok)")
    for c in cells:
        ok = {n: a for n, a in c["arms"].items() if a["status"] == "ok"}
        us = lambda n: ok.get(n, {}).get("us", {}).get("median")  # noqa: E731
        for n, a in c["arms"].items():
            if a["status"] != "ok":
                print(f"{c['cell']:<20} {n:<17} {a['status']}: {a.get('reason', '')[:80]}")
                continue
            read = us("read_folded_fp8" if "fp8" in n else "read_folded")
            m = a["us"]["median"]
            print(f"{c['cell']:<20} {n:<17} {m:9.1f} {m / read if read else float('nan'):10.2f} "
                  f"{m / us('folded_jit') if us('folded_jit') else float('nan'):11.2f} "
                  f"{us('fi_tc_fp8') / m if us('fi_tc_fp8') else float('nan'):11.2f} "
                  f"{a['check'].get('rel_err', float('nan')):.1e} {a['check'].get('lse_max_abs_err', float('nan')):.1e}"
                  f" {a['check'].get('ok')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
