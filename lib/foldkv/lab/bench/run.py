"""One benchmark run as a results document: the environment, the roofs measured at its start (and end), its cells
(resumable from an earlier run split across commands), saved as strict JSON after every section."""

from __future__ import annotations

import datetime as _dt
import os
import time
from typing import Any, Callable, Sequence

import torch

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.lab.report import environment

from .case import AttentionCase
from .results import SCHEMA, load_results, save_results
from .roofs import measure_matmul_roof, measure_read_roof
from .clock import err_text
from .timing import run_cell


class BenchRun:
    """The results document of one notebook run, with the roofs measured at its start (and end)."""

    def __init__(self, device: torch.device | str, *, mode: str, params: dict, geom: AttentionGeometry = GEMMA4_31B,
                 log: Callable[[str], None] = print):
        self.device = torch.device(device)
        self.geom, self.log = geom, log
        self.results: dict[str, Any] = {
            "schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode, "params": params, "env": environment(self.device), "roof": {}, "cells": [],
        }

    @property
    def cells(self) -> list[dict]:
        return self.results["cells"]

    def resume(self, path: str) -> int:
        """Keep the cells of an earlier run of this notebook (a run split across commands by `sections`, each under
        the device's time limit): they are listed first, each tagged with the run it came from. Returns how many."""
        doc = load_results(path)
        kept = [dict(c, from_run=doc.get("created")) for c in doc.get("cells", [])]
        self.cells[:0] = kept
        self.results.setdefault("resumed_from", []).append(
            {"path": os.path.abspath(path), "created": doc.get("created"), "roof": doc.get("roof"),
             "env": doc.get("env"), "cells": len(kept)})
        return len(kept)

    def measure_roofs(self, *, read_bytes: int = 2 << 30, matmul_n: int = 8192, when: str = "start") -> dict:
        key = "read" if when == "start" else f"read_{when}"
        try:
            self.results["roof"][key] = measure_read_roof(self.device, read_bytes)
        except Exception as exc:
            self.results["roof"][key] = {"error": err_text(exc)}
        if when == "start":
            try:
                self.results["roof"]["matmul"] = measure_matmul_roof(self.device, matmul_n)
            except Exception as exc:
                self.results["roof"]["matmul"] = {"error": err_text(exc)}
        return self.results["roof"]

    def cell(self, cell: str, kind: str, seq_lens: Sequence[int], arms: Sequence[str], *, q_lens=None,
             rounds: int = 30, warmup: int = 3, seed: int = 0, case_kw: dict | None = None, **kw) -> dict:
        """Time one cell; failures of the whole cell (e.g. out of memory building inputs) are recorded, not raised."""
        t0 = time.perf_counter()
        case = None
        try:
            case = AttentionCase(seq_lens, q_lens=q_lens, device=self.device, geom=self.geom, seed=seed,
                                 **(case_kw or {}))
            res = run_cell(cell, kind, case, arms, rounds=rounds, warmup=warmup, roof=self.results["roof"].get("read"),
                           matmul_roof=self.results["roof"].get("matmul"), log=self.log, **kw)
        except Exception as exc:
            res = {"cell": cell, "kind": kind, "batch": len(seq_lens), "seq_lens": [int(n) for n in seq_lens],
                   "context": int(max(seq_lens)), "error": err_text(exc), "arms": {}, "speedup": {}}
            self.log(f"{cell}: cell failed: {res['error']}")
        finally:
            if case is not None:
                case.release()
            del case
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        res["wall_s"] = time.perf_counter() - t0
        self.cells[:] = [c for c in self.cells if c.get("cell") != cell]  # a re-measured cell replaces a resumed one
        self.cells.append(res)
        return res

    def save(self, path: str | os.PathLike) -> str:
        return save_results(self.results, path)
