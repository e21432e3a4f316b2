"""The sanitizer gate: scripts/sanitize_cases.py (one case of every kernel, both formats) under compute-sanitizer
memcheck, its whole log kept beside the run."""

from __future__ import annotations

import os
import subprocess
import sys

from ...provenance import checkout_root


def sanitizer_gate(run: bool, timeout_s: float, out_dir: str, record) -> None:
    """GPU gate: scripts/sanitize_cases.py (one case of every kernel, both formats) under compute-sanitizer memcheck;
    clean when it exits 0 with "ERROR SUMMARY: 0 errors". The whole log goes to
    `out_dir`/compute_sanitizer_memcheck.log. Records `sanitizer`: not run when `run` is False or without CUDA,
    failed on a timeout."""
    if not run:
        record.not_run("sanitizer", "not run: run_sanitizer=False")
    elif record.cuda_or_not_run("sanitizer"):
        log_path = os.path.join(out_dir, "compute_sanitizer_memcheck.log")
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", sys.executable,
               os.path.join(checkout_root(), "scripts", "sanitize_cases.py")]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = f"{exc.stdout or ''}{exc.stderr or ''}"
            text = (out if isinstance(out, str) else out.decode(errors="replace")) + f"\nTIMEOUT after {timeout_s} s"
            rc = None
        os.makedirs(out_dir, exist_ok=True)
        with open(log_path, "w") as fh:
            fh.write("$ " + " ".join(cmd) + "\n" + text)
        tail = [line for line in text.splitlines()
                if "ERROR SUMMARY" in line or "passed=" in line or " ran" in line or "TIMEOUT" in line]
        print("\n".join(tail[-12:]))
        if rc is None:
            record.failed("sanitizer", f"timed out after {timeout_s} s (log: {os.path.basename(log_path)})")
        else:
            clean = rc == 0 and any("ERROR SUMMARY: 0 errors" in line for line in tail)
            record.ran("sanitizer", returncode=rc, log=os.path.basename(log_path), passed=clean)
    print(record.sections["sanitizer"])
