#!/usr/bin/env python3
"""The main job: execute every notebook headless with papermill into papermill_runs/<tag>/ and say what ran.

Each notebook writes `<out_dir>/<notebook>.record.json` (foldkv.lab.report.RunRecord) whose `sections` say "ran", "redrawn from
<run>", "failed: ..." or "not run: <reason>"; this driver collects them into SUMMARY.md (a notebook that measured nothing
and redrew an earlier run says "redrawn from <run>") and lists every section that did not run.

    python3 scripts/run_batch.py                    # all notebooks, tag = <machine>-<date>
    python3 scripts/run_batch.py --smoke --out-root /tmp/x   # tiny parameters (what the tests run)
    python3 scripts/run_batch.py --only 02 04 --tag h200-20261129
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")

# Parameters per notebook (by file-name prefix) for the small run the tests make; a full run uses each notebook's
# own defaults. Keep these small: CI is a 2-core CPU machine.
SMOKE_PARAMETERS: dict[str, dict] = {
    "01": {"context_lengths": [97, 16384], "sweep": [1024, 4096, 16384]},
    "02": {"case_set": "smoke"},
    "03": {"lengths": [5, 66], "sweep_lengths": [3], "steps": 2, "prompts": ["ab", "the cat"],
           "synthetic_config": {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}, "seed": 1},
    "04": {"smoke": True},
    "05": {"decode_contexts": [256, 1024], "decode_batches": [1, 2], "agreement_prompts": [256], "new_tokens": 4,
           "prefill_chunk": 256, "largest_context": 1024, "prefill_tail_contexts": [1024], "prefill_tail_batch": 2,
           "prefill_tail_chunk": 256,
           "compile_prompt": 0},
    "06": {},
    "07": {"ttft_cells": ["512:1:3", "512:2"], "ttft_rounds": 2, "first_use_lengths": [259, 261], "e2e_prompt": 512,
           "e2e_new_tokens": 4, "prefill_memory_context": 1024, "prefill_memory_batches": [1, 2], "prefill_chunk": 256},
}


def machine_tag() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name().lower()
            kind = "h200" if "h200" in name else name.split()[-1]
            return f"{kind}-{dt.date.today():%Y%m%d}"
    except Exception:
        pass
    return f"cpu-{dt.date.today():%Y%m%d}"


def notebook_paths(only: list[str] | None) -> list[str]:
    paths = sorted(glob.glob(os.path.join(NOTEBOOKS, "[0-9][0-9]_*.ipynb")))
    if only:
        paths = [p for p in paths if any(os.path.basename(p).startswith(o) for o in only)]
    if not paths:
        raise SystemExit(f"no notebooks matched {only!r} in {NOTEBOOKS}")
    return paths


KERNEL_NAME = "foldkv-batch"


def ensure_kernelspec() -> str:
    """A kernelspec for *this* interpreter, found first through JUPYTER_PATH, so the notebooks run in the environment
    the batch was started from whatever other `python3` kernels the machine has registered."""
    kdir = os.path.join(ROOT, "build", "jupyter", "kernels", KERNEL_NAME)
    os.makedirs(kdir, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"foldkv batch ({sys.executable})", "language": "python"}
    with open(os.path.join(kdir, "kernel.json"), "w") as fh:
        json.dump(spec, fh)
    jp = os.path.join(ROOT, "build", "jupyter")
    os.environ["JUPYTER_PATH"] = jp + (os.pathsep + os.environ["JUPYTER_PATH"] if os.environ.get("JUPYTER_PATH") else "")
    return KERNEL_NAME


def run(paths: list[str], out_dir: str, smoke: bool, extra: dict, progress: bool = True,
        log_output: bool = False) -> list[dict]:
    """Execute each notebook with papermill into out_dir; `log_output`: stream every cell's output to stderr as it
    runs (a device run's log then shows where a notebook stopped, which the executed notebook may not: papermill
    saves it between cells)."""
    import papermill as pm

    kernel = ensure_kernelspec()
    if log_output:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(message)s")

    os.makedirs(out_dir, exist_ok=True)
    results = []
    for i, path in enumerate(paths, 1):
        stem = os.path.splitext(os.path.basename(path))[0]
        params = {"out_dir": out_dir}
        if smoke:
            params.update(SMOKE_PARAMETERS.get(stem[:2], {}))
        params.update(extra.get(stem[:2], {}))
        print(f"[batch {i}/{len(paths)}] {stem} -> {out_dir}", flush=True)
        t0 = time.time()
        entry = {"notebook": stem, "output": os.path.join(out_dir, f"{stem}.ipynb"), "parameters": params}
        try:
            pm.execute_notebook(path, entry["output"], parameters=params, kernel_name=kernel, cwd=ROOT,
                                progress_bar=progress, log_output=log_output)
            entry["status"] = "ok"
        except Exception as exc:  # papermill still writes the executed notebook up to the failing cell
            entry["status"] = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
        entry["seconds"] = round(time.time() - t0, 1)
        record = os.path.join(out_dir, f"{stem}.record.json")
        entry["sections"] = json.load(open(record)).get("sections", {}) if os.path.exists(record) else {}
        if not entry["sections"] and entry["status"] == "ok":
            entry["status"] = "failed: the notebook wrote no record of its sections"
        with open(os.path.join(out_dir, f"{stem}.batch.json"), "w") as fh:  # this notebook's line of the summary
            json.dump(entry, fh, indent=1)
        results.append(entry)
    return results


REDRAWN_FROM = "redrawn from"  # foldkv.lab.report.REDRAWN_FROM (this driver reads records without importing foldkv)


def section_counts(sections: dict) -> dict[str, list]:
    """A record's sections by status: ran / redrawn (from an earlier run) / not run / failed."""
    groups: dict[str, list] = {"ran": [], "redrawn": [], "not run": [], "failed": []}
    for name, status in sections.items():
        key = ("ran" if status == "ran" else "redrawn" if status.startswith(REDRAWN_FROM)
               else "failed" if status.startswith("failed") else "not run")
        groups[key].append((name, status))
    return groups


def notebook_status(entry: dict) -> str:
    """What the summary says of a notebook: papermill's failure as is; else "ok", "redrawn from <run>" when it
    measured nothing and showed an earlier run's results, or "not run: no section ran"."""
    if entry["status"] != "ok":
        return entry["status"]
    groups = section_counts(entry["sections"])
    sources = sorted({s[len(REDRAWN_FROM):].strip() for _, s in groups["redrawn"]})
    if groups["ran"]:
        return "ok" if not sources else f"ok; part {REDRAWN_FROM} {', '.join(sources)}"
    if sources:
        return f"{REDRAWN_FROM} {', '.join(sources)}"
    return "not run: no section ran"


def summarize(results: list[dict], out_dir: str) -> str:
    lines = ["# papermill batch", "", f"out: `{os.path.relpath(out_dir, ROOT)}`", "",
             "| notebook | status | seconds | ran | redrawn | not run | failed |", "|---|---|---|---|---|---|---|"]
    not_measured = []
    # a notebook papermill wrote into out_dir but whose run wrote no entry was stopped mid-run (killed, timed out)
    finished = {r["notebook"] for r in results}
    for stem in sorted({os.path.basename(p)[:-len(".ipynb")] for p in glob.glob(os.path.join(out_dir, "*.ipynb"))}
                       - finished):
        lines.append(f"| {stem} | did not finish: no entry (stopped mid-run) | | | | | |")
        not_measured.append((stem, "every section after the last executed cell", "did not finish"))
    for r in results:
        groups = section_counts(r["sections"])
        not_measured += [(r["notebook"], s, v) for key in ("redrawn", "not run", "failed") for s, v in groups[key]]
        lines.append(f"| {r['notebook']} | {notebook_status(r)} | {r['seconds']} | "
                     + " | ".join(str(len(groups[k])) for k in ("ran", "redrawn", "not run", "failed")) + " |")
    lines += ["", "## Sections that did not run (redrawn, not run or failed)", ""]
    lines += [f"- {nb} / {s}: {v}" for nb, s, v in not_measured] or ["- none: every section ran"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", default=None, help="run tag (folder under the out root); default <machine>-<date>")
    ap.add_argument("--out-root", default=os.path.join(ROOT, "papermill_runs"))
    ap.add_argument("--only", nargs="*", help="notebook prefixes to run, e.g. 01 03")
    ap.add_argument("--smoke", action="store_true", help="tiny parameters (what the tests run)")
    ap.add_argument("--params", default=None, help='JSON {"02": {"name": value}} of extra parameters per notebook')
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--log-output", action="store_true", help="stream each cell's output to stderr as it runs")
    ap.add_argument("--summarize", action="store_true", help="run nothing: rewrite SUMMARY.md from the tag's entries")
    args = ap.parse_args(argv)
    tag = args.tag or machine_tag()
    out_dir = os.path.join(args.out_root, tag)
    extra = json.loads(args.params) if args.params else {}
    if args.summarize:
        status = 0
    else:
        results = run(notebook_paths(args.only), out_dir, args.smoke, extra, progress=not args.no_progress,
                      log_output=args.log_output)
        status = 0 if all(r["status"] == "ok" for r in results) else 1
    # The summary covers every notebook run into this tag, also in parts (--only) or side by side.
    os.makedirs(out_dir, exist_ok=True)
    results = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out_dir, "*.batch.json")))]
    summary = summarize(results, out_dir)
    with open(os.path.join(out_dir, "SUMMARY.md"), "w") as fh:
        fh.write(summary)
    with open(os.path.join(out_dir, "summary.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    print("\n" + summary)
    return status


if __name__ == "__main__":
    sys.exit(main())
