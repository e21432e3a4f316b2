"""papermill_runs/README.md, the index of committed runs, held to the folder: every run folder has one row and every
row a folder, every notebook exactly one run of record (a folder that holds that notebook executed, or "none"), and
the folder READMEs describe their run rather than narrate how it was made, and each run of record's files are what
its row names (the commit in their provenance, the sha256 of the files its redraw reads); red twins: a row without a
folder, a folder without a row, a notebook named twice, a run of record that does not hold its notebook, a number
changed in a run of record's file, a commit the files do not name, a row without a commit or sha256."""

from __future__ import annotations

import glob
import os
import re
import json
import shutil
import subprocess

import pytest

from foldkv.lab.bench import results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(os.path.basename(p)[:-len(".ipynb")] for p in glob.glob(os.path.join(ROOT, "notebooks",
                                                                                       "[0-9][0-9]_*.ipynb")))
OLDER_HEADING = "## Older runs still cited"


def _folders(root: str) -> set[str]:
    """The run folders under `root` the index is for: the committed ones. A folder git ignores is a local run's (the
    batch on a machine without CUDA writes papermill_runs/cpu-<date>/, .gitignore's), not one to index."""
    runs = os.path.join(root, results.RUNS_DIR)
    found = {d for d in os.listdir(runs) if os.path.isdir(os.path.join(runs, d)) and not d.startswith((".", "_"))}
    return found - _ignored(root, found)


def _ignored(root: str, names: set[str]) -> set[str]:
    """Those of the run folders `names` that git ignores under `root` (none where `root` is not a git checkout)."""
    if not names or not os.path.exists(os.path.join(root, ".git")):
        return set()
    paths = "\n".join(f"{results.RUNS_DIR}/{n}/" for n in sorted(names))
    out = subprocess.run(["git", "-C", root, "check-ignore", "--stdin"], input=paths, capture_output=True, text=True)
    return {os.path.basename(p.rstrip("/")) for p in out.stdout.split()}


def index_problems(root: str) -> list[str]:
    """What is wrong with the index under `root` against its run folders (empty: it holds)."""
    with open(os.path.join(root, results.RUNS_INDEX)) as fh:
        text = fh.read()
    try:
        record = results.runs_of_record(root)
    except (LookupError, ValueError) as exc:
        return [str(exc)]
    older = [cells[0] for cells in results.index_rows(text, OLDER_HEADING)]
    problems = []
    notebooks = sorted(os.path.basename(p)[:-len(".ipynb")]
                       for p in glob.glob(os.path.join(root, "notebooks", "[0-9][0-9]_*.ipynb")))
    if sorted(record) != notebooks:
        problems.append(f"runs of record for {sorted(record)}, notebooks {notebooks}")
    for nb, run in record.items():
        if run and not os.path.exists(os.path.join(root, results.RUNS_DIR, run, f"{nb}.ipynb")):
            problems.append(f"{nb}'s run of record {run} does not hold {nb}.ipynb")
    rows = [r for r in record.values() if r] + older
    folders = _folders(root)
    dup = sorted({r for r in older if older.count(r) > 1} | (set(older) & set(record.values())))
    if dup:
        problems.append(f"runs with two rows: {dup}")
    if set(rows) - folders:
        problems.append(f"rows without a folder: {sorted(set(rows) - folders)}")
    if folders - set(rows):
        problems.append(f"folders without a row: {sorted(folders - set(rows))}")
    return problems


def test_the_index_holds_every_run_folder_and_each_notebooks_run_of_record():
    assert index_problems(ROOT) == []
    record = results.runs_of_record()
    assert sorted(record) == NOTEBOOKS
    assert record["04_benchmarks"] == results.run_name(results.record_results()["path"])


def _copy(tmp_path) -> str:
    root = tmp_path / "repo"
    (root / results.RUNS_DIR).mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, results.RUNS_INDEX), root / results.RUNS_INDEX)
    shutil.copytree(os.path.join(ROOT, "notebooks"), root / "notebooks")
    for run in _folders(ROOT):  # the folders, each with the notebooks it holds (empty files: names are what counts)
        (root / results.RUNS_DIR / run).mkdir()
        for p in glob.glob(os.path.join(ROOT, results.RUNS_DIR, run, "*.ipynb")):
            (root / results.RUNS_DIR / run / os.path.basename(p)).write_text("")
    assert index_problems(str(root)) == []
    return str(root)


def test_red_twins_a_row_without_a_folder_and_a_folder_without_a_row(tmp_path):
    root = _copy(tmp_path)
    gone = sorted(_folders(root))[0]
    shutil.rmtree(os.path.join(root, results.RUNS_DIR, gone))
    assert index_problems(root) == [f"rows without a folder: {[gone]}"]
    os.makedirs(os.path.join(root, results.RUNS_DIR, gone))
    os.makedirs(os.path.join(root, results.RUNS_DIR, "h200-20990101"))
    assert index_problems(root) == ["folders without a row: ['h200-20990101']"]


def test_a_local_run_folder_is_not_a_committed_run(tmp_path):
    """The batch's own run on a machine without CUDA (papermill_runs/cpu-<date>/, which git ignores) beside the
    committed runs: the index holds, so the two README commands run in turn on one clone. Red twin: without the
    repo's .gitignore the same folder is a folder without a row."""
    root = _copy(tmp_path)
    subprocess.run(["git", "init", "-q", root], check=True)
    os.makedirs(os.path.join(root, results.RUNS_DIR, "cpu-20990101"))
    assert index_problems(root) == ["folders without a row: ['cpu-20990101']"]  # the red twin: no .gitignore yet
    shutil.copy(os.path.join(ROOT, ".gitignore"), os.path.join(root, ".gitignore"))
    assert index_problems(root) == []
    os.makedirs(os.path.join(root, results.RUNS_DIR, "h200-20990101"))
    assert index_problems(root) == ["folders without a row: ['h200-20990101']"]


def test_red_twins_a_notebook_named_twice_and_a_run_of_record_without_its_notebook(tmp_path):
    root = _copy(tmp_path)
    index = os.path.join(root, results.RUNS_INDEX)
    text = open(index).read()
    line = next(l for l in text.splitlines() if l.startswith("| 04_benchmarks |"))
    open(index, "w").write(text.replace(line, line + "\n" + line.replace(results.run_of_record("04_benchmarks"),
                                                                         "h200-20261129")))
    assert "04_benchmarks has two runs of record" in index_problems(root)[0]
    open(index, "w").write(text.replace(line, line.replace(results.run_of_record("04_benchmarks"),
                                                           results.run_of_record("02_correctness_gates"))))
    assert any("does not hold 04_benchmarks.ipynb" in p for p in index_problems(root))
    open(index, "w").write(text.replace(results.RECORD_HEADING, "## Runs"))
    assert "no table under" in index_problems(root)[0]
    open(index, "w").write(text)
    with pytest.raises(LookupError, match="no run of record"):
        results.run_of_record("06_tensor_parallel", root=root)


NARRATION = re.compile(r"\bsessions?\b", re.IGNORECASE)


def test_folder_readmes_describe_the_run_without_narrating_sessions():
    readmes = sorted(glob.glob(os.path.join(ROOT, results.RUNS_DIR, "*", "README.md")))
    assert len(readmes) == len(_folders(ROOT)), "a run folder without a README"
    said = [f"{os.path.relpath(p, ROOT)}: {line.strip()[:80]}" for p in readmes for line in open(p)
            if NARRATION.search(line)]
    assert said == []
    assert NARRATION.search("Twenty-fifth session, on one H200.")  # red twin: the sentence the check is for


def test_each_run_of_record_is_the_commit_and_the_bytes_its_row_names():
    for nb, run in results.runs_of_record().items():
        if run is None:
            assert results.no_record_line(nb).startswith(f"No run of record for {nb} yet")
            with pytest.raises(LookupError, match="no run of record"):
                results.record_source(nb)
            continue
        source = results.record_source(nb)
        assert source["run"] == run and source["committed"], nb
        assert source["label"].startswith(f"from the run of record {run}, commit {source['commit'][:7]}")
        assert sorted(source["paths"]) == sorted(results.redrawn_files(nb))
        assert results.no_record_line(nb) is None


def _run_copy(tmp_path, notebook: str) -> str:
    """The index and `notebook`'s run of record (the files its redraw reads) under a fresh root."""
    root = tmp_path / "repo"
    run = results.run_of_record(notebook)
    (root / results.RUNS_DIR / run).mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, results.RUNS_INDEX), root / results.RUNS_INDEX)
    for name in results.redrawn_files(notebook):
        shutil.copy(os.path.join(ROOT, results.RUNS_DIR, run, name), root / results.RUNS_DIR / run / name)
    assert results.record_source(notebook, root=str(root))["run"] == run
    return str(root)


def test_red_twins_a_changed_number_a_commit_the_files_do_not_name_and_a_row_without_them(tmp_path):
    root = _run_copy(tmp_path, "05_generate")
    run = results.run_of_record("05_generate")
    path = os.path.join(root, results.RUNS_DIR, run, "05_generate.record.json")
    index = os.path.join(root, results.RUNS_INDEX)
    text = open(index).read()
    row = next(l for l in text.splitlines() if l.startswith("| 05_generate |"))
    commit, digest = [c.strip() for c in row.split("|")[3:5]]
    doc = json.load(open(path))
    doc["results"]["decode_31b"]["rows"][0]["tpot_ms"] *= 0.9  # a number changed after the run
    json.dump(doc, open(path, "w"), indent=1)
    with pytest.raises(results.RecordMismatchError, match=f"hash to [0-9a-f]{{16}}, the index says {digest}"):
        results.record_source("05_generate", root=root)
    altered = results.files_digest(os.path.dirname(path), ("05_generate.record.json",))[:16]
    open(index, "w").write(text.replace(row, row.replace(digest, altered)))
    assert results.record_source("05_generate", root=root)["run"] == run  # the index names the new bytes: accepted
    open(index, "w").write(text.replace(row, row.replace(digest, altered).replace(commit, "1234567")))
    with pytest.raises(results.RecordMismatchError, match=f"made at commit {commit}.*the index says 1234567"):
        results.record_source("05_generate", root=root)
    open(index, "w").write(text.replace(row, row.replace(f"| {commit} | {digest} |", "| - | - |")))
    with pytest.raises(results.RecordMismatchError, match="names no commit.*names no sha256"):
        results.record_source("05_generate", root=root)
    os.remove(path)
    open(index, "w").write(text)
    with pytest.raises(results.RecordMismatchError, match="lacks"):
        results.record_source("05_generate", root=root)
