"""The sanitizer gate: scripts/sanitize_cases.py (one small case of every kernel, every pool) under compute-sanitizer's
memcheck, racecheck and synccheck, side by side (each its own process: the tools are slow on the host, not the
GPU), each whole log kept beside the run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from ...provenance import checkout_root

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
# The summary line each tool prints last: "ERROR SUMMARY: N errors" (memcheck, synccheck); racecheck prints
# "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" and, on the H200's toolkit, no ERROR SUMMARY.
_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_HAZARDS = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def sanitizer_command(tool: str, backend: str = "jit") -> list[str]:
    """The command line of one tool over scripts/sanitize_cases.py (a nonzero exit on any error it reports)."""
    if tool not in SANITIZER_TOOLS:
        raise ValueError(f"sanitizer tool {tool!r}: expected one of {SANITIZER_TOOLS}")
    extra = ["--racecheck-report", "all"] if tool == "racecheck" else []  # hazards and their analysis
    return ["compute-sanitizer", "--tool", tool, *extra, "--error-exitcode", "1", sys.executable,
            os.path.join(checkout_root(), "scripts", "sanitize_cases.py"), "--backend", backend]


def sanitizer_verdict(tool: str, text: str, returncode: int | None) -> dict:
    """What one tool's log says: clean only when the process exited 0 and its summary reports no error (racecheck:
    its hazard summary reports no hazard, and an ERROR SUMMARY, where it prints one, no error); `summary` is the
    summary lines found (none: the tool did not finish)."""
    errors = [int(m) for m in _ERRORS.findall(text)]
    hazards = [tuple(int(x) for x in m) for m in _HAZARDS.findall(text)]
    if tool == "racecheck":
        clean = (returncode == 0 and bool(hazards) and hazards[-1][0] == 0
                 and (not errors or errors[-1] == 0))
    else:
        clean = returncode == 0 and bool(errors) and errors[-1] == 0
    summary = [line.strip() for line in text.splitlines() if "SUMMARY" in line]
    return {"tool": tool, "returncode": returncode, "clean": clean, "errors": errors[-1] if errors else None,
            "hazards": hazards[-1][0] if hazards else None, "summary": summary[-2:]}


def _run_tools(tools, timeout_s: float, out_dir: str, backend: str) -> list[dict]:
    procs = {}
    os.makedirs(out_dir, exist_ok=True)
    for tool in tools:
        cmd = sanitizer_command(tool, backend)
        log = open(os.path.join(out_dir, f"compute_sanitizer_{tool}.log"), "w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        procs[tool] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), log, time.time())
    results = []
    deadline = time.time() + timeout_s
    for tool, (proc, log, t0) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        seconds = time.time() - t0
        log.write(f"\nTIMEOUT after {timeout_s} s\n" if rc is None else "")
        log.close()
        with open(log.name) as fh:
            text = fh.read()
        results.append(dict(sanitizer_verdict(tool, text, rc), log=os.path.basename(log.name), seconds=seconds,
                            timed_out=rc is None))
    return results


def sanitizer_gate(run: bool, timeout_s: float, out_dir: str, record, tools=SANITIZER_TOOLS,
                   backend: str = "jit") -> None:
    """GPU gate: scripts/sanitize_cases.py under each of `tools`, run side by side within `timeout_s`; each tool's
    whole log goes to `out_dir`/compute_sanitizer_<tool>.log. Records `sanitizer` (ran: passed when every tool is
    clean, with each tool's verdict; not run when `run` is False or without CUDA; failed when a tool timed out)."""
    if not run:
        record.not_run("sanitizer", "not run: run_sanitizer=False")
    elif record.cuda_or_not_run("sanitizer"):
        results = _run_tools(tools, timeout_s, out_dir, backend)
        for r in results:
            print(f"{r['tool']:9s} rc={r['returncode']} clean={r['clean']} {r['seconds']:.0f} s  "
                  + " | ".join(r["summary"]))
        late = [r["tool"] for r in results if r["timed_out"]]
        if late:
            record.failed("sanitizer", f"{', '.join(late)} timed out after {timeout_s} s (logs beside the run)")
            record.results["sanitizer"] = {"tools": results}
        else:
            record.ran("sanitizer", tools=results, passed=all(r["clean"] for r in results))
    print(record.sections["sanitizer"])
