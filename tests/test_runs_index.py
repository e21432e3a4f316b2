"""papermill_runs/README.md, the index of committed runs, held to the folder: every run folder has one row and every
row a folder, every notebook exactly one run of record (a folder that holds that notebook executed, or "none"), and
the folder READMEs describe their run rather than narrate how it was made; red twins: a row without a folder, a
folder without a row, a notebook named twice, a run of record that does not hold its notebook."""

from __future__ import annotations

import glob
import os
import re
import shutil

import pytest

from foldkv.lab.bench import results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(os.path.basename(p)[:-len(".ipynb")] for p in glob.glob(os.path.join(ROOT, "notebooks",
                                                                                       "[0-9][0-9]_*.ipynb")))
OLDER_HEADING = "## Older runs still cited"


def _folders(root: str) -> set[str]:
    runs = os.path.join(root, results.RUNS_DIR)
    return {d for d in os.listdir(runs) if os.path.isdir(os.path.join(runs, d)) and not d.startswith((".", "_"))}


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
