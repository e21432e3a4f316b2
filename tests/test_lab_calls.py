"""scripts/lab_calls.sh, the device calls of the measurements whose predictions are written and not yet run: every
test file it names exists; its probe command parses and asks everything runs 22-25's commands ask
(bench/MODEL_DECODE_NOTES.md, conftest.probe_command_of_run), in one process; the harness arms and cases it names
exist. A name that drifted (a renamed test, a flag, an arm) fails here rather than in a device call."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import bench_script, probe_command_of_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "lab_calls.sh").read_text()


def _command(tool: str, script: str = SCRIPT) -> list[str]:
    """The arguments the script passes `tool` (continuation lines joined, up to the redirection)."""
    text = script.replace("\\\n", " ")
    m = re.search(rf"{re.escape(tool)} (.*?) >", text)
    assert m, f"no {tool} command in scripts/lab_calls.sh"
    return shlex.split(m.group(1))


def test_the_test_files_exist():
    named = re.findall(r"tests/\S+\.py", SCRIPT)
    assert len(named) >= 9 and all((ROOT / n).exists() for n in named), named


def _probe_misses(script: str) -> list:
    """What runs 22-25's probe commands ask that the script's probe command does not: (run, flags or cells)."""
    probe = bench_script("model_decode_probe").parser()
    got = vars(probe.parse_args(_command("bench/model_decode_probe.py", script)))
    default = vars(probe.parse_args([]))
    misses = []
    for run in (22, 23, 24, 25):
        want = vars(probe_command_of_run(run))
        flags = {k for k, v in want.items() if v is True} - {k for k, v in got.items() if v is True}
        cells = set(want["decode"]) - set(got["decode"])
        values = {k for k, v in want.items() if not isinstance(v, (bool, list)) and v != default[k] and got[k] != v}
        misses += [(run, m) for m in (flags, cells, values) if m]
    return misses


def test_the_probe_asks_what_runs_22_to_25_ask():
    assert _probe_misses(SCRIPT) == []
    assert _probe_misses(SCRIPT.replace(" --ring-one-ab", "")) == [(25, {"ring_one_ab"})]  # red twin


def test_the_harness_arms_and_cases_exist():
    fp8 = bench_script("fp8_harness")
    known = {a if isinstance(a, str) else a.name for a in fp8.ARMS}
    args = _command("fp8_harness.py")
    arms = args[args.index("--arms") + 1:args.index("--json")]
    assert "fp8_tc_vrot" in arms and set(arms) <= known, set(arms) - known
    plan = bench_script("plan_harness")
    args = _command("plan_harness.py")
    only = args[args.index("--only") + 1:args.index("--two-ctas")]
    assert set(only) <= set(plan.cases(draw_seeds=[920385503])), only
