"""bench/versions/README.md, the index of the lab's versions: every version file has exactly one row, every row names
a file that exists, and each row's notes file names that version (a row pointing at the wrong notes is caught). Red
twins: a folder with one file more, and an index with a row for a file that is gone, are each caught."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ROOT / "bench" / "versions"
SECTION = re.compile(r"^## .*\(bench/(\w+\.md)\)\s*$", re.M)
ROW = re.compile(r"^\| `(\w+\.py)` \|", re.M)


def index_rows(text: str) -> dict[str, list[str]]:
    """{version file: [the notes file of each section listing it]} from the index's tables."""
    rows: dict[str, list[str]] = {}
    cuts = [(m.start(), m.group(1)) for m in SECTION.finditer(text)] + [(len(text), None)]
    for (start, notes), (end, _) in zip(cuts, cuts[1:]):
        for name in ROW.findall(text, start, end):
            rows.setdefault(name, []).append(notes)
    return rows


def index_problems(text: str, files: set[str]) -> list[str]:
    rows = index_rows(text)
    problems = [f"{f}: no row" for f in sorted(files - set(rows))]
    problems += [f"{f}: a row, no file" for f in sorted(set(rows) - files)]
    problems += [f"{f}: {len(n)} rows" for f, n in sorted(rows.items()) if len(n) > 1]
    for f, notes in sorted(rows.items()):
        if f in files and not any(f in (ROOT / "bench" / n).read_text() for n in notes):
            problems.append(f"{f}: not named in bench/{notes[0]}")
    return problems


def test_every_version_has_one_row_and_every_row_a_file():
    text = (VERSIONS / "README.md").read_text()
    files = {p.name for p in VERSIONS.glob("*.py")}
    assert len(files) >= 20 and index_problems(text, files) == []
    assert index_problems(text, files | {"decode_gone.py"}) == ["decode_gone.py: no row"]  # red twin
    gone = sorted(files)[0]
    assert index_problems(text, files - {gone}) == [f"{gone}: a row, no file"]  # red twin
