"""The results document of a benchmark run on disk: its schema, strict-JSON save with provenance, load, where a run
writes (never over a committed run), and which earlier run a machine without a GPU redraws: each notebook's run of
record, read from the index of committed runs (`RUNS_INDEX`, `runs_of_record`), with the commit and the sha256 of the
files a redraw reads that the index names for it, both checked before anything is shown (`record_source`)."""

from __future__ import annotations

import glob as _glob
import hashlib
import json
import os
import re
import subprocess

import torch

from foldkv.provenance import checkout_root

from ..checkout_stamp import provenance
from ..jsonsafe import jsonable

SCHEMA = "foldkv.bench/1"
RESULTS_NAME = "04_benchmarks.json"
RESULTS_GLOB = f"papermill_runs/*/{RESULTS_NAME}"  # where the committed runs are, relative to the checkout
RUNS_DIR = "papermill_runs"
RUNS_INDEX = f"{RUNS_DIR}/README.md"  # the index: each notebook's run of record, each older run's one line
RECORD_HEADING = "## Runs of record"
NO_RUN = "none"  # a notebook's run of record that has not been made yet
DIGEST_CHARS = 16  # the index's sha256 of a run of record's files, its first 16 hex digits
# The files of a run a notebook's redraw reads (default: its record, `<notebook>.record.json`); the index's sha256
# column covers exactly these, so a number changed in any of them is caught before it is shown.
REDRAWN_FILES = {
    "03_drift_study": ("03_drift_study.record.json", "drift_results.json"),
    "04_benchmarks": (RESULTS_NAME,),
}
# Fields renamed since a committed run wrote them (old name -> new name): a redraw reads them under the new name, so
# the current tables and verdicts read an older run of record's numbers (the gates' fixed tolerance is named the
# specified bound, no longer "the issue's").
RENAMED_FIELDS = {"over_issue_bound": "over_specified_bound", "issue_bound_ok": "specified_bound_ok"}


def renamed_fields(doc):
    """`doc` (parsed JSON) with every RENAMED_FIELDS key also under its new name (the old one kept, a new one present
    already left as it is)."""
    if isinstance(doc, list):
        return [renamed_fields(x) for x in doc]
    if isinstance(doc, dict):
        out = {k: renamed_fields(v) for k, v in doc.items()}
        for old, new in RENAMED_FIELDS.items():
            if old in out and new not in out:
                out[new] = out[old]
        return out
    return doc


class RecordMismatchError(ValueError):
    """A run of record whose files are not what the index names: another commit, or other bytes (numbers altered)."""


def resolve_mode(mode: str) -> str:
    """"auto" -> "gpu" with a CUDA device, else "redraw"; "gpu", "redraw" and "cpu" (the harness on the CPU with the
    torch arms and a host clock: pipeline checks only, not a benchmark) pass through."""
    mode = str(mode).lower()
    if mode == "auto":
        return "gpu" if torch.cuda.is_available() else "redraw"
    if mode not in ("gpu", "redraw", "cpu"):
        raise ValueError(f"mode {mode!r}: expected auto, gpu, redraw or cpu")
    if mode == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("mode='gpu' but torch sees no CUDA device (use 'auto' to redraw instead)")
    return mode


def save_results(results: dict, path: str | os.PathLike) -> str:
    """Write a results document as strict JSON (`jsonable`: NaN -> null), with the provenance of the code at save
    time (commit, dirty flag, sha256 of every kernel this process built or loaded)."""
    results["provenance"] = provenance()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(jsonable(results), fh, indent=1, allow_nan=False)
    return path


def load_results(path: str | os.PathLike) -> dict:
    with open(path) as fh:
        doc = json.load(fh)
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    return doc


def _tracked(paths: list[str], root: str) -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--", *paths], cwd=root, capture_output=True, text=True, timeout=20)
        if out.returncode != 0:
            return set()
        return {os.path.abspath(os.path.join(root, p)) for p in out.stdout.split()}
    except Exception:
        return set()


def results_path(out_dir: str | None, name: str = RESULTS_NAME, *, root: str | None = None) -> tuple[str, str]:
    """Where a run writes its JSON: `out_dir`/name (relative to the repo root), or papermill_runs/_scratch (ignored
    by git) when out_dir is empty. A path git already tracks (a committed run) is never overwritten: the file goes
    to _scratch instead. Returns (path, a sentence saying where and why)."""
    root = root or checkout_root()
    scratch = os.path.join(root, "papermill_runs", "_scratch", name)
    if not out_dir:
        return scratch, f"out_dir not given: writing to the git-ignored {scratch}"
    d = out_dir if os.path.isabs(out_dir) else os.path.join(root, out_dir)
    path = os.path.abspath(os.path.join(d, name))
    if path in _tracked([path], root):
        return scratch, f"{path} is a committed run and is never overwritten: writing to {scratch} instead"
    return path, f"writing to {path}"


def find_results(results_glob: str = RESULTS_GLOB, *, root: str | None = None, require_gpu: bool = True,
                 device_contains: str | None = "H200") -> dict | None:
    """The newest results document matching `results_glob` (relative to the repo root unless absolute) that is a
    full GPU run (not smoke) on a device whose name contains `device_contains`; git-tracked (committed) files win
    over untracked ones. Returns {"path", "committed", "results"} or None."""
    root = root or checkout_root()
    pattern = results_glob if os.path.isabs(results_glob) else os.path.join(root, results_glob)
    paths = sorted(os.path.abspath(p) for p in _glob.glob(pattern, recursive=True))
    tracked = _tracked(paths, root)
    found = []
    for p in paths:
        try:
            doc = load_results(p)
        except Exception:
            continue
        if require_gpu and (doc.get("mode") != "gpu" or doc.get("params", {}).get("smoke")):
            continue
        name = str(doc.get("env", {}).get("device_name", ""))
        if device_contains and device_contains.lower() not in name.lower():
            continue
        found.append((p in tracked, doc.get("created", ""), p, doc))
    if not found:
        return None
    committed, _, path, doc = max(found, key=lambda f: (f[0], f[1]))
    return {"path": path, "committed": committed, "results": doc}


def index_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table under `heading` (a line of its own)."""
    lines = text.splitlines()
    if heading not in lines:
        return []
    rows, seen_table = [], False
    for line in lines[lines.index(heading) + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            if seen_table:
                break
            continue
        seen_table = True
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells and not set(cells[0]) <= set("-: "):
            rows.append(cells)
    return rows[1:]  # the header row first


def record_rows(root: str | None = None, index: str = RUNS_INDEX) -> dict[str, list[str]]:
    """{notebook: its row's cells} of the index's RECORD_HEADING table (notebook | run of record | commit | sha256 |
    what it holds). A notebook named twice is refused (ValueError), as is an index without that table (LookupError)
    or a row that names no run (write NO_RUN for none yet)."""
    root = root or checkout_root()
    path = index if os.path.isabs(index) else os.path.join(root, index)
    with open(path) as fh:
        rows = index_rows(fh.read(), RECORD_HEADING)
    if not rows:
        raise LookupError(f"{path}: no table under {RECORD_HEADING!r}")
    out: dict[str, list[str]] = {}
    for cells in rows:
        if len(cells) < 2 or not cells[1]:
            raise ValueError(f"{path}: row {cells} names no run of record (write {NO_RUN!r} for none yet)")
        if cells[0] in out:
            raise ValueError(f"{path}: notebook {cells[0]} has two runs of record ({out[cells[0]][1]}, {cells[1]})")
        out[cells[0]] = cells
    return out


def runs_of_record(root: str | None = None, index: str = RUNS_INDEX) -> dict[str, str | None]:
    """{notebook: its run of record (a folder under papermill_runs/), or None where the index says NO_RUN}, read from
    the index's RECORD_HEADING table (`record_rows`): the one place a redraw looks up which run to show."""
    return {nb: None if cells[1] == NO_RUN else cells[1] for nb, cells in record_rows(root, index).items()}


def run_of_record(notebook: str, *, root: str | None = None) -> str:
    """The run of record of `notebook` (e.g. "04_benchmarks") by the index; LookupError when it has none."""
    run = runs_of_record(root).get(notebook)
    if not run:
        raise LookupError(f"{RUNS_INDEX}: {notebook} has no run of record")
    return run


def no_record_line(notebook: str, *, root: str | None = None) -> str | None:
    """One line saying `notebook` has no run of record yet (nothing to redraw), or None when it has one."""
    if runs_of_record(root).get(notebook):
        return None
    return f"No run of record for {notebook} yet ({RUNS_INDEX} says {NO_RUN!r}): its GPU sections have nothing to redraw."


def record_file(notebook: str, name: str, *, root: str | None = None) -> str:
    """The path of file `name` in `notebook`'s run of record (relative to the checkout)."""
    return os.path.join(RUNS_DIR, run_of_record(notebook, root=root), name)


def redrawn_files(notebook: str) -> tuple[str, ...]:
    """The files of a run that `notebook`'s redraw reads (what the index's sha256 covers)."""
    return REDRAWN_FILES.get(notebook, (f"{notebook}.record.json",))


def files_digest(folder: str, names: tuple[str, ...]) -> str:
    """sha256 over `names` in `folder` (each name, a NUL, its bytes, in the order given): the index's sha256 column
    is its first DIGEST_CHARS hex digits."""
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0")
        with open(os.path.join(folder, name), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _provenance_of(doc: dict) -> tuple[str | None, bool | None]:
    prov = doc.get("provenance") or {}
    return prov.get("git_commit") or (doc.get("env") or {}).get("git_commit"), prov.get("dirty")


def record_source(notebook: str, *, root: str | None = None) -> dict:
    """`notebook`'s run of record, checked against the index before anything of it is shown: every file its redraw
    reads is there, hashes to the index's sha256 and names the index's commit in its provenance. Returns {"notebook",
    "run", "commit" (the full hash the files name), "dirty", "device", "paths" (name -> absolute path), "docs"
    (name -> the parsed JSON, old field names also under `RENAMED_FIELDS`' new ones), "committed" (every file
    tracked by git), "label"}. LookupError when the notebook has no run of record; RecordMismatchError (every
    problem named) when the files are not what the index says."""
    root = root or checkout_root()
    run = run_of_record(notebook, root=root)
    cells = record_rows(root)[notebook]
    folder = os.path.join(root, RUNS_DIR, run)
    names = redrawn_files(notebook)
    want_commit = cells[2] if len(cells) > 2 else ""
    want_digest = cells[3] if len(cells) > 3 else ""
    problems = []
    if not re.fullmatch(r"[0-9a-f]{7,40}", want_commit):
        problems.append(f"the index names no commit for {run} (column 3: {want_commit!r})")
    if not re.fullmatch(rf"[0-9a-f]{{{DIGEST_CHARS}}}", want_digest):
        problems.append(f"the index names no sha256 for {run} (column 4: {want_digest!r})")
    missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
    if missing:
        raise RecordMismatchError(f"{RUNS_INDEX}: {notebook}'s run of record {run} lacks {missing}")
    digest = files_digest(folder, names)[:DIGEST_CHARS]
    if want_digest and digest != want_digest:
        problems.append(f"{run}'s {', '.join(names)} hash to {digest}, the index says {want_digest}: "
                        "the files were changed after the index named them")
    docs, dirty = {}, False
    for n in names:
        with open(os.path.join(folder, n)) as fh:
            docs[n] = renamed_fields(json.load(fh))
        commit, d = _provenance_of(docs[n])
        dirty = dirty or bool(d)
        if want_commit and not str(commit).startswith(want_commit):
            problems.append(f"{run}/{n} was made at commit {str(commit)[:12]}, the index says {want_commit}")
    if problems:
        raise RecordMismatchError(f"{RUNS_INDEX}: {notebook}'s run of record does not match the index: "
                                  + "; ".join(problems))
    first = docs[names[0]]
    commit = _provenance_of(first)[0]
    device = (first.get("environment") or first.get("env") or {}).get("device_name")
    paths = {n: os.path.abspath(os.path.join(folder, n)) for n in names}
    label = f"from the run of record {run}, commit {str(commit)[:7]}" + (" (dirty)" if dirty else "")
    return {"notebook": notebook, "run": run, "commit": commit, "dirty": dirty, "device": device, "paths": paths,
            "docs": docs, "committed": set(paths.values()) <= _tracked(list(paths.values()), root), "label": label}


def notebook_record(notebook: str, *, root: str | None = None) -> dict:
    """`notebook`'s record (`report.RunRecord`'s JSON: sections, results) in its run of record, checked against the
    index (`record_source`): {"run", "path" (absolute), "committed", "record", "source"}."""
    source = record_source(notebook, root=root)
    name = f"{notebook}.record.json"
    if name not in source["paths"]:
        raise LookupError(f"{notebook}'s redraw reads {list(source['paths'])}, not its record")
    return {"run": source["run"], "path": source["paths"][name], "committed": source["committed"],
            "record": source["docs"][name], "source": source}


def record_results(*, root: str | None = None) -> dict:
    """Notebook 04's run of record's results, as `open_results` gives them (what a machine without a GPU redraws),
    checked against the index first (`record_source`)."""
    source = record_source("04_benchmarks", root=root)
    return open_results(source["paths"][RESULTS_NAME], root=root)


def open_results(path: str, *, root: str | None = None) -> dict:
    """An explicitly named results document to redraw: {"path", "committed", "results"} (no filtering: the banner
    says what it is)."""
    root = root or checkout_root()
    p = os.path.abspath(path if os.path.isabs(path) else os.path.join(root, path))
    return {"path": p, "committed": p in _tracked([p], root), "results": load_results(p)}


def run_name(path: str | os.PathLike) -> str:
    """The run a results file belongs to: the name of its folder (its tag under papermill_runs/, e.g. h200-20261129-s2)."""
    return os.path.basename(os.path.dirname(os.path.abspath(os.fspath(path))))


def git_commit_of(results: dict) -> str | None:
    """The commit a results document was measured with (its provenance; older documents kept it in env)."""
    return (results.get("provenance") or {}).get("git_commit") or results.get("env", {}).get("git_commit")


def redraw_banner(found: dict | None, results_glob: str) -> str:
    if found is None:
        return (f"No CUDA device here, and no H200 results matched {results_glob!r}: nothing to redraw. "
                "Run this notebook on the H200 (mode='gpu') to produce them.")
    r = found["results"]
    state = "committed" if found["committed"] else "NOT committed (untracked file)"
    what = "H200" if "h200" in str(r.get("env", {}).get("device_name", "")).lower() else "NON-H200"
    kind = f"mode={r.get('mode')!r}" + (", smoke" if r.get("params", {}).get("smoke") else "")
    return (f"REDRAWING (nothing below was measured now): the {what} results ({kind}) of {r.get('created')} from "
            f"{found['path']} ({state}, device {r.get('env', {}).get('device_name')}, "
            f"git {str(git_commit_of(r))[:10]}).")
