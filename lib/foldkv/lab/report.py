"""What a notebook records: its sections (ran / not run and why), its numbers as JSON, and tables for display."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from typing import Any, Iterable, Sequence

import torch

from ..provenance import provenance
from .jsonsafe import jsonable

NOT_RUN_NO_CUDA = "not run: no CUDA device"
REDRAWN_FROM = "redrawn from"  # a section's status "redrawn from <run>": shown again from that run, not measured now


def environment(device: torch.device | str | None = None) -> dict:
    """Where a result was made: enough to tell an H200 run from a CPU one. `device` (default: the CUDA device if torch
    sees one, else the CPU) is described by name, and a CUDA device by its capability, SM count and memory. Which
    code made it is `provenance()`, saved beside this. Versions: torch, CUDA, TileLang, FlashInfer; the active AOT
    build folder."""
    from .bench.arms import aot_build_dir

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    env: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "tilelang": _installed_version("tilelang"),  # the installed version, without importing TileLang
        "flashinfer": _installed_version("flashinfer-python") or _installed_version("flashinfer"),
        "aot_build": aot_build_dir(),
        "device_type": dev.type,
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(device_name=props.name, capability=list(torch.cuda.get_device_capability(dev)),
                   sms=props.multi_processor_count, memory_bytes=props.total_memory)
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()})"
    return env


def _installed_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


class RunRecord:
    """A notebook's record: `sections` maps a section name to "ran", "redrawn from <run>" (results of an earlier run
    shown again, nothing measured now), "failed: ..." or "not run: <reason>".

    `save()` writes `<out_dir>/<notebook>.record.json`; the batch driver reads every record's sections to say plainly
    which GPU sections did not run. (Notebooks with a richer results file of their own write that beside it.)
    """

    def __init__(self, notebook: str, out_dir: str | os.PathLike, parameters: dict | None = None):
        self.notebook = notebook
        self.out_dir = os.fspath(out_dir)
        self.data: dict[str, Any] = {
            "notebook": notebook,
            "parameters": parameters or {},
            "environment": environment(),
            "sections": {},
            "results": {},
        }

    @property
    def sections(self) -> dict:
        return self.data["sections"]

    @property
    def results(self) -> dict:
        return self.data["results"]

    def ran(self, section: str, **results: Any) -> None:
        self.sections[section] = "ran"
        if results:
            self.results.setdefault(section, {}).update(results)

    def redrawn(self, section: str, source_run: str, **results: Any) -> None:
        """The section shows the results of `source_run` (a run tag, e.g. h200-20261129-s2): nothing measured now."""
        if not str(source_run).strip():
            raise ValueError(f"{section}: redrawn from which run? source_run is empty")
        self.sections[section] = f"{REDRAWN_FROM} {source_run}"
        if results:
            self.results.setdefault(section, {}).update(results)

    def not_run(self, section: str, reason: str) -> None:
        self.sections[section] = reason if reason.startswith("not run") else f"not run: {reason}"

    def failed(self, section: str, error: str) -> None:
        self.sections[section] = f"failed: {error}"

    def cuda_or_not_run(self, section: str) -> bool:
        """True if a CUDA device is here; otherwise record the section as not run and return False."""
        if torch.cuda.is_available():
            return True
        self.not_run(section, NOT_RUN_NO_CUDA)
        return False

    def path(self) -> str:
        return os.path.join(self.out_dir, f"{self.notebook}.record.json")

    def save(self) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        self.data["provenance"] = provenance()
        with open(self.path(), "w") as fh:
            json.dump(jsonable(self.data), fh, indent=1, allow_nan=False)
        return self.path()

    def summary(self) -> str:
        width = max([len(s) for s in self.sections] + [7])
        return "\n".join(f"{name:<{width}}  {status}" for name, status in self.sections.items())


def markdown_table(rows: Iterable[dict], columns: Sequence[str] | dict[str, str], formats: dict[str, str] | None = None) -> str:
    """A Markdown table of `rows` (dicts). `columns` is a list of keys or {key: header}; `formats` {key: format spec}."""
    cols = dict(columns) if isinstance(columns, dict) else {c: c for c in columns}
    formats = formats or {}
    lines = ["| " + " | ".join(cols.values()) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = []
        for key in cols:
            value = row.get(key, "")
            spec = formats.get(key)
            cells.append(format(value, spec) if spec and isinstance(value, (int, float)) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
