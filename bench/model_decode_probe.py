"""Lab notebook: a few of notebook 05's cells on the 31B at full size, one model load, JSON to stdout / $OUT.

For a quick look at a change of the decode step before the batch of record (notebook 05 runs every cell):

    python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 flashinfer:4096:1 --tail foldkv-folded:32768:8

--decode ARM:CONTEXT:BATCH (model_decode.measure_decode), --tail ARM:CONTEXT:BATCH (measure_prefill_tail, chunk 4096),
--profile (step_kernels at 4K x 1; --profile-at CONTEXT:BATCH another cell, e.g. 4096:8), --compile N
(measure_static_compile: transformers' static cache and automatic compile on an N-token prompt, last: it leaves the
compiler's state behind), --profile-top N (kernels the profile lists). --merge-ab: after the cells above (merged
projections, the library's default), the model's projections are split again (`fused_step.split_projections`; merge off)
and the --decode cells and the profile run a second time ("unmerged"). --sliding-ab: the --decode cells again with the
sliding layers' attention unfused (fuse_sliding off). --global-ab: the --decode cells again with the global
layers' query and row on the torch path (`StepOptions(fuse_global=False)`, label "global unfused"); the library cells'
route answers are counted and printed ("kernels" or the reason a call took the torch path). --loop-ab: the --decode
cells again with generate()'s own loop (`hf_loop.applies` answering False). --pdl-ab: the --decode cells again with
`StepOptions(pdl=False)` (the projections cuBLAS's F.linear, the step's Triton kernels launched without programmatic
dependent launch; label "PDL off"); the library's cells run it on (its default): how many projection calls took the PDL
GEMV and why the others did not are printed for both (host calls: a captured step counts its warm-up and its capture).
--ring-ab: the --decode cells again with a sliding layer's ring attention as three split-window PDL kernels
(`bench/versions/ring_attention_split.py` installed; label "ring split"); how many ring attentions took the kernels and
the reasons the others did not are printed. --tc-ab: the --decode cells again with the one-row projections on the
one-row CUDA-core GEMV that served them before the tensor-core kernel (`bench/versions/gemv_pdl.py` installed; label
"one-row CUDA-core GEMV"; at batch > 1 nothing changes: for cuBLAS there, --pdl-ab); the calls it took are printed.
--lab-ab: the --decode cells again with `bench/versions/gemv_pdl_tc.py` installed four ways (labels "fixup": split_sum
folded into the GEMM; "GELU in down_proj": the MLP's activation made in down_proj's x loads; "fixup + GELU"; "tail fit +
fixup + GELU": with two stages where that removes a last wave's tail); the calls each took are printed. --tails-ab: the
--decode cells again without the layer's tail links (`StepOptions` tail_sums and tail_next_norm off, each and
both; labels "no tail sums", "no next norm", "no tail links"). --global-prologue-ab: the --decode cells again with a
global layer's forward transformers' (fuse_global_prologue off: its norms and RoPE as five kernels, then
DecodeStep.attend's two; label "global prologue unfused"). --glue-ab: the --decode cells again with the step's prologue
and rotary tables on a side branch of its graph (`bench/versions/step_glue_branch.py`; label "glue on a branch").
--ring-one-ab: the --decode cells again with a sliding layer's ring attention in one launch (the window split over about
two programs an SM, an online softmax, the last program of a KV head combining;
`bench/versions/ring_attention_one_launch.py`; label "ring in one launch"); the calls it took and its refusals are
printed. --loop-tail-ab: the --decode cells again with generate()'s thin loop checking each token's stop on a side
stream (`bench/versions/loop_tail_side_stream.py`; label "stop check on a side stream"); the tokens it took are
printed. --ring-branch-ab: the --decode cells again with a sliding layer's ring attention in two halves on two
graph branches (`bench/versions/ring_attention_branched.py`; label "ring on two branches"); its calls and refusals are
printed. --greedy-pick-ab: the --decode cells again with each token's greedy pick (the processors' EOS mask, the
argmax, the padding) in two Triton launches (`bench/versions/greedy_pick_fused.py`; label "greedy pick in two
launches"); the tokens it took and its refusals are printed. --l2-prefetch-ab: the --decode cells again with each
sliding o_proj's first 24 MB read into L2 on a branch beside the ring attention at one row
(`bench/versions/oproj_l2_prefetch.py`; label "o_proj prefix in L2"); its calls and refusals are printed. With more
than one of --glue-ab, --ring-one-ab, --loop-tail-ab, --ring-branch-ab, --greedy-pick-ab and --l2-prefetch-ab, the
cells once more with all of them (label: their labels joined by " + "; --ring-one-ab and --ring-branch-ab both
patch the ring attention: not together; the L2 prefetch wraps whichever is installed before it).
--profile-lab: with --profile and any of those six, the profile once more with all of them installed ("profile_lab"
in the JSON: the versions' own kernel times). Results are not records: the batch's notebook is.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import os
import time
from unittest import mock

import torch

from foldkv.lab.model_decode import parse_cell
from foldkv.step_options import StepOptions, in_force, using


def _cells(specs):
    for s in specs:
        arm, n, b = s.split(":")
        yield arm, int(n), int(b)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", nargs="*", default=[])
    ap.add_argument("--tail", nargs="*", default=[])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--compile", type=int, default=0)
    ap.add_argument("--profile-top", type=int, default=16)
    ap.add_argument("--profile-at", type=parse_cell, default=(4096, 1), help="the profiled cell, CONTEXT:BATCH")
    ap.add_argument("--merge-ab", action="store_true")
    ap.add_argument("--loop-ab", action="store_true")
    ap.add_argument("--sliding-ab", action="store_true")
    ap.add_argument("--global-ab", action="store_true")
    ap.add_argument("--pdl-ab", action="store_true")
    ap.add_argument("--ring-ab", action="store_true")
    ap.add_argument("--tc-ab", action="store_true")
    ap.add_argument("--lab-ab", action="store_true")
    ap.add_argument("--tails-ab", action="store_true")
    ap.add_argument("--global-prologue-ab", action="store_true")
    ap.add_argument("--glue-ab", action="store_true")
    ap.add_argument("--ring-one-ab", action="store_true")
    ap.add_argument("--loop-tail-ab", action="store_true")
    ap.add_argument("--ring-branch-ab", action="store_true")
    ap.add_argument("--greedy-pick-ab", action="store_true")
    ap.add_argument("--l2-prefetch-ab", action="store_true")
    ap.add_argument("--profile-lab", action="store_true")
    return ap


def _between_steps(r: dict) -> str:
    """TPOT less the device step (ms): the loop's device work between two replays (runs 26 and 29 move it)."""
    if r.get("tpot_ms") is None or r.get("device_step_ms") is None:
        return "n/a"
    return f"{r['tpot_ms'] - r['device_step_ms']:.3f}"


@contextlib.contextmanager
def all_installed(versions):
    """Every (label, name) of bench/versions/ installed for the block, in the order given (bench/ is this script's
    directory)."""
    with contextlib.ExitStack() as stack:
        for _, name in versions:
            stack.enter_context(importlib.import_module(f"versions.{name}").installed())
        yield


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import foldkv.hf  # noqa: F401
    from foldkv.lab import gemma31b, model_decode as md
    from foldkv.lab.bench.roofs import measure_read_roof

    t0 = time.perf_counter()
    model = gemma31b.build_gemma4_31b("cuda", seed=0)
    roof = measure_read_roof("cuda")
    print(f"built in {time.perf_counter() - t0:.1f} s; roof {roof['gbps']:.0f} GB/s", flush=True)
    out = {"roof": roof, "decode": [], "tail": []}
    md.run_cells(md.measure_prefill, [dict(model=model, arm_name=a, prompt_tokens=256, new_tokens=2,
                                           prefill_chunk=4096) for a in dict.fromkeys(
                                               a for a, _, _ in _cells(args.decode + args.tail))])

    at_context, at_batch = args.profile_at

    def profile(key):
        out[key] = md.step_kernels(model, "foldkv-folded", context=at_context, batch=at_batch, top=args.profile_top)
        out[key + "_at"] = {"context": at_context, "batch": at_batch}
        total = sum(k["ms"] for k in out[key]) / max(sum(k["share"] for k in out[key]), 1e-9)
        print(f"{key} ({at_context} x {at_batch}): {total:.3f} ms of kernels a step")
        for k in out[key]:
            print(f"{k['ms']:8.3f} ms {k['calls']:5d}  {k['kernel']}")

    def decode_cells(label):
        rows = md.run_cells(md.measure_decode, [dict(model=model, arm_name=a, context=n, batch=b,
                                                     new_tokens=args.new_tokens, read_gbps=roof["gbps"])
                                                for a, n, b in _cells(args.decode)])
        for r in rows:
            r["variant"] = label
        return rows

    routes: collections.Counter = collections.Counter()

    def counted(route):
        def global_route(*a):
            why = route(*a)
            routes[why or "kernels"] += 1
            return why
        return global_route

    from foldkv import gemv, global_step
    from foldkv.lab.pdl_checks import gemv_routes

    with (mock.patch.object(global_step, "global_route", counted(global_step.global_route)) if args.global_ab
          else contextlib.nullcontext()), gemv_routes() as library_routes:
        out["decode"] = decode_cells("library")
    if args.global_ab:
        out["global_routes"] = dict(routes)
        print(f"global routes of the library cells: {out['global_routes']}", flush=True)
    out["pdl_gemv"] = {"library": dict(library_routes)}
    print(f"PDL GEMV (library, StepOptions.pdl={in_force().pdl}, HAS_GDC={gemv.HAS_GDC}): {out['pdl_gemv']['library']}",
          flush=True)
    out["tail"] = md.run_cells(md.measure_prefill_tail, [dict(model=model, arm_name=a, context=n, batch=b,
                                                              chunk=4096) for a, n, b in _cells(args.tail)])

    # the profiles come last: after torch.profiler every replay of the process runs ~1 ms slower (its hooks stay)
    if args.loop_ab:
        from foldkv import hf_loop

        with mock.patch.object(hf_loop, "applies", lambda *a, **k: False):
            out["decode"] += decode_cells("transformers loop")
    if args.sliding_ab:
        with using(StepOptions(fuse_sliding=False)):  # the caches the cells make take these options
            out["decode"] += decode_cells("sliding unfused")
    if args.ring_ab:
        from versions.ring_attention_split import installed as ring_split  # bench/ is this script's directory

        with ring_split() as route:
            out["decode"] += decode_cells("ring split")
        out["ring_split"] = route.report()
        print(f"ring split: {out['ring_split']['calls']} calls took the kernels; refusals"
              f" {out['ring_split']['refusals']}", flush=True)
    if args.global_ab:
        with using(StepOptions(fuse_global=False)):
            out["decode"] += decode_cells("global unfused")
    if args.tc_ab:
        from versions.gemv_pdl import installed as one_row_gemv  # bench/ is this script's directory

        with one_row_gemv() as took:
            out["decode"] += decode_cells("one-row CUDA-core GEMV")
        out["pdl_gemv"]["one-row CUDA-core GEMV"] = dict(took)
        print(f"one-row CUDA-core GEMV: {dict(took)}", flush=True)
    if args.lab_ab:
        from versions.gemv_pdl_tc import installed as tc_lab  # bench/ is this script's directory

        out["lab"] = {}
        for label, opts in (("fixup", dict(fixup=True)), ("GELU in down_proj", dict(gelu=True)),
                            ("fixup + GELU", dict(fixup=True, gelu=True)),
                            ("tail fit + fixup + GELU", dict(fixup=True, gelu=True, tail_fit=True))):
            with tc_lab(**opts) as took:
                out["decode"] += decode_cells(label)
            out["lab"][label] = dict(took)
            print(f"{label}: {dict(took)}", flush=True)
    if args.tails_ab:
        for label, sums, ahead in (("no tail sums", False, True), ("no next norm", True, False),
                                   ("no tail links", False, False)):
            with using(StepOptions(tail_sums=sums, tail_next_norm=ahead)):
                out["decode"] += decode_cells(label)
    if args.global_prologue_ab:
        with using(StepOptions(fuse_global_prologue=False)):
            out["decode"] += decode_cells("global prologue unfused")
    # the lab versions of runs 24-29, each alone, then together when more than one is asked for (entered in this order:
    # the glue branch's joins wrap what the others swap in, the L2 prefetch wraps the ring attention installed before)
    lab_versions = [(label, name) for flag, label, name in (
        (args.glue_ab, "glue on a branch", "step_glue_branch"),
        (args.ring_one_ab, "ring in one launch", "ring_attention_one_launch"),
        (args.loop_tail_ab, "stop check on a side stream", "loop_tail_side_stream"),
        (args.ring_branch_ab, "ring on two branches", "ring_attention_branched"),
        (args.greedy_pick_ab, "greedy pick in two launches", "greedy_pick_fused"),
        (args.l2_prefetch_ab, "o_proj prefix in L2", "oproj_l2_prefetch")) if flag]
    for label, name in lab_versions:
        with importlib.import_module(f"versions.{name}").installed() as took:  # bench/ is this script's directory
            out["decode"] += decode_cells(label)
        out.setdefault("lab_versions", {})[label] = took.report() if hasattr(took, "report") else dict(took)
        print(f"{label}: {out['lab_versions'][label]}", flush=True)
    if len(lab_versions) > 1:
        with all_installed(lab_versions):
            out["decode"] += decode_cells(" + ".join(label for label, _ in lab_versions))
    if args.pdl_ab:
        with using(StepOptions(pdl=False)), gemv_routes() as routes:
            out["decode"] += decode_cells("PDL off")
        out["pdl_gemv"]["PDL off"] = dict(routes)
        print(f"PDL GEMV (PDL off): {out['pdl_gemv']['PDL off']}", flush=True)
    if args.merge_ab:
        from foldkv import fused_step

        print(f"split {fused_step.split_projections(model)} merged groups", flush=True)
        with using(StepOptions(merge=False)):  # the next step after the block merges again
            out["decode"] += decode_cells("unmerged")
            if args.profile:
                profile("profile_unmerged")
    if args.profile:
        profile("profile")
        if args.profile_lab and lab_versions:
            with all_installed(lab_versions):
                profile("profile_lab")
    if args.compile:
        out["compile"] = md.run_cells(md.measure_static_compile, [dict(model=model, prompt_tokens=args.compile,
                                                                       new_tokens=args.new_tokens)])
    for r in out["decode"] + out.get("compile", []):
        r.pop("tokens", None)
    text = json.dumps(out, indent=1, default=str)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "probe.json"), "w").write(text)
    print(md.decode_table(out["decode"]))
    for r in out["decode"]:
        if r.get("status") == "ran":
            print(f"{r['variant']:18s} {r['arm']:14s} {r['context']:>7d} x {r['batch']:<3d}"
                  f" TPOT {r['tpot_ms']:.2f} device {r['device_step_ms']} step call {r['step_call_ms']}"
                  f" thin steps {r.get('thin_loop_steps')} merged groups {r.get('merged_groups')}"
                  f" TPOT - device {_between_steps(r)}")
    print(md.memory_table(out["decode"] + out["tail"]))
    for r in out.get("compile", []):
        print({k: v for k, v in r.items() if k != "tokens"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
