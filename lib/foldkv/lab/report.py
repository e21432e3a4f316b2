"""What a notebook records: its sections (ran / redrawn / not run and why), its numbers as JSON, tables for display,
and what a GPU section shows where it cannot run (`RecordRedraw`: the run of record's numbers, labelled)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from typing import Any, Iterable, Sequence

import torch

from .checkout_stamp import provenance
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


class RecordRedraw:
    """What a notebook's GPU sections show on a machine without CUDA: the numbers its run of record recorded
    (`bench.results.record_source`: the run the index names, its files checked against the index's commit and sha256
    first), drawn by the same table and figure code as a measured run, each labelled "from the run of record <run>,
    commit <hash>". Nothing is recomputed as if measured: a section shows the recorded numbers, and what is derived
    from them (targets, verdicts) is computed here from those numbers and held to what the run itself derived
    (`same_as_recorded`: a difference fails the section).

    With CUDA (`cuda` None: torch's answer) it is inert: `results` gives this run's results, captions and marks are
    empty. Without CUDA and without a run of record (the index says "none") every call says so in one line and gives
    nothing. A run of record that does not match the index stops here (`RecordMismatchError`), before anything is
    shown."""

    def __init__(self, record: "RunRecord", *, cuda: bool | None = None, root: str | None = None):
        from .bench import results as _results

        self.record = record
        self.redrawing = not (torch.cuda.is_available() if cuda is None else cuda)
        self.source: dict | None = None
        self.missing = None  # the one line said when there is no run of record
        if self.redrawing:
            self.missing = _results.no_record_line(record.notebook, root=root)
            if self.missing is None:
                self.source = _results.record_source(record.notebook, root=root)

    @property
    def recorded(self) -> dict:
        """The run of record's record (`<notebook>.record.json`: sections, results), {} without one."""
        if self.source is None:
            return {}
        return self.source["docs"].get(f"{self.record.notebook}.record.json", {})

    def document(self, name: str) -> dict:
        """Another file of the run of record that the redraw reads (checked with the record), e.g. drift_results.json."""
        if self.source is None:
            return {}
        return self.source["docs"][name]

    @property
    def label(self) -> str:
        """ "from the run of record <run>, commit <hash>" ("" when nothing is redrawn)."""
        return self.source["label"] if self.source else ""

    def banner(self) -> str:
        """One line for the top of the GPU sections: what is shown and from where."""
        if not self.redrawing:
            return "A CUDA device is here: the GPU sections below are measured now."
        if self.source is None:
            return f"No CUDA device here. {self.missing}"
        s = self.source
        return (f"No CUDA device here: the GPU sections below are redrawn {s['label']} ({s['device']}; "
                f"{', '.join(s['paths'])}{'' if s['committed'] else ', NOT committed'}): nothing in them was "
                "measured now.")

    def _ran_here(self, sections) -> bool:
        return any(self.record.sections.get(s) == "ran" or str(self.record.sections.get(s, "")).startswith("failed")
                   for s in sections)

    def results(self, *sections: str) -> dict:
        """The results to show for `sections`: this run's when any of them ran (or failed) here or a CUDA device is
        here; else the run of record's, each section that ran there recorded here as redrawn from it (and one that
        did not said in one line, and recorded as not run); {} when there is nothing to show."""
        if not self.redrawing or self._ran_here(sections):
            return self.record.results
        if self.source is None:
            for s in sections:
                if s not in self.record.sections:
                    self.record.not_run(s, NOT_RUN_NO_CUDA)
            print(self.missing)
            return {}
        had, recorded = self.recorded.get("sections", {}), self.recorded.get("results", {})
        shown = False
        for s in sections:
            status = had.get(s) or ("ran" if s in recorded else None)  # results kept without a section: ran
            if status == "ran":
                self.record.redrawn(s, self.source["run"], redrawn_from=self.where())
                shown = True
            else:
                said = f"the run of record {self.source['run']} " + (f"has no {s}" if status is None
                                                                       else f"has {s} {status!r}")
                self.record.not_run(s, f"{NOT_RUN_NO_CUDA}, and {said}")
                print(f"{s}: {said}.")
        return self.recorded.get("results", {}) if shown else {}

    def rows(self, section: str, key: str = "rows") -> list:
        """`results(section)[section][key]` (a section recorded as a list is its rows), [] when there is none."""
        res = self.results(section).get(section)
        if isinstance(res, list):
            return res
        return list((res or {}).get(key) or [])

    def where(self) -> dict:
        s = self.source or {}
        return {"run": s.get("run"), "commit": s.get("commit"), "paths": list((s.get("paths") or {}).values())}

    def shown_from(self, *sections: str) -> str:
        """Whose numbers `sections` show: "" when measured now, else the label (a section redrawn here)."""
        redrawn = [s for s in sections if str(self.record.sections.get(s, "")).startswith(REDRAWN_FROM)]
        return self.label if redrawn else ""

    def caption(self, *sections: str) -> str:
        """Markdown to put before a redrawn section's table: "**Redrawn from the run of record <run>, commit <hash>**
        (nothing measured now)." and a blank line; "" when the sections were measured now."""
        label = self.shown_from(*sections)
        return f"**Redrawn {label}** ({self.source['device']}; nothing measured now).\n\n" if label else ""

    def mark(self, fig, *sections: str):
        """`fig`'s title (one line above its panels, laid out by its constrained layout, apart from every panel's own
        title) says "Redrawn from the run of record <run>, commit <hash> (not measured now)" when `sections` were
        redrawn; a measured figure is left as it is. Returns the figure."""
        label = self.shown_from(*sections)
        if fig is not None and label:
            old = fig.get_suptitle()
            fig.suptitle((f"{old}: " if old else "") + f"Redrawn {label} (not measured now)")
        return fig

    def same_as_recorded(self, section: str, what: str, recomputed, recorded) -> bool:
        """Hold what this notebook computed from the run of record's numbers (`recomputed`) to what that run computed
        from them (`recorded`): equal, or `section` fails here naming the first difference (numbers altered after the
        run, or a rule changed since: either way the redraw is not the run's). True when equal or nothing is
        redrawn."""
        if self.source is None or recomputed == recorded:
            return True
        self.record.failed(section, f"{what} computed from the numbers of the run of record {self.source['run']} "
                                    f"differ from what that run recorded ({_first_difference(recomputed, recorded)})")
        print(self.record.sections[section])
        return False

    def derived(self, key: str, value, *sections: str, what: str) -> bool:
        """Keep `value`, computed here from the numbers of `sections`: as this run's `results[key]` when they were
        measured now; when they were redrawn, as section `key` redrawn from the run of record, held to what that run
        recorded as `results[key]` (`same_as_recorded`)."""
        if not self.shown_from(*sections):
            self.record.results[key] = value
            return True
        self.record.redrawn(key, self.source["run"], redrawn_from=self.where(), **{key: value})
        return self.same_as_recorded(key, what, value, self.recorded.get("results", {}).get(key))

    def recompute(self, fn, section: str, what: str, key: str):
        """`fn(record)` over a copy of the run of record's record (a verdict function computing from its numbers),
        its value held to what the run recorded as `results[key]` (a difference fails `section` here); None when
        nothing is redrawn."""
        if self.source is None:
            return None
        import copy

        again = RunRecord.__new__(RunRecord)
        again.notebook, again.out_dir, again.data = self.record.notebook, "", copy.deepcopy(self.recorded)
        value = fn(again)
        self.same_as_recorded(section, what, value, self.recorded.get("results", {}).get(key))
        return value


def _first_difference(a, b, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path or 'list'}: {len(a)} items here, {len(b)} recorded"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path or 'value'}: {a!r} here, {b!r} recorded"


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
