"""scripts/lab_calls.sh, the device calls of the measurements whose predictions are written and not yet run: every
test file it names exists; the harness arms and cases it names exist. A name that drifted (a renamed test, an arm, a
case) fails here rather than in a device call; red twins: a missing file and an unknown arm are caught."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import bench_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "lab_calls.sh").read_text()


def _commands(tool: str, script: str = SCRIPT) -> list[list[str]]:
    """The arguments of every command the script runs `tool` with (continuation lines joined, up to the
    redirection)."""
    text = script.replace("\\\n", " ")
    found = [shlex.split(m.group(1)) for m in re.finditer(rf"{re.escape(tool)} (.*?) >", text)]
    assert found, f"no {tool} command in scripts/lab_calls.sh"
    return found


def _command(tool: str, script: str = SCRIPT) -> list[str]:
    """The arguments of the first command the script runs `tool` with."""
    return _commands(tool, script)[0]


def _missing_files(script: str) -> list[str]:
    named = re.findall(r"tests/\S+\.py", script)
    assert named, "no test file named"
    return [n for n in named if not (ROOT / n).exists()]


def test_the_test_files_exist():
    assert _missing_files(SCRIPT) == []
    assert _missing_files(SCRIPT.replace("test_fp8_tc_vrot_gpu", "test_gone_gpu")) == ["tests/test_gone_gpu.py"]


def test_the_harness_arms_and_cases_exist():
    fp8 = bench_script("fp8_harness")
    known = {a if isinstance(a, str) else a.name for a in fp8.ARMS}
    args = _command("fp8_harness.py")
    arms = args[args.index("--arms") + 1:args.index("--json")]
    assert "fp8_tc_vrot" in arms and set(arms) <= known, set(arms) - known
    assert "fp8_tc_gone" not in known  # red twin: an arm the harness lacks would be seen
    plan = bench_script("plan_harness")
    args = _command("plan_harness.py")
    only = args[args.index("--only") + 1:args.index("--two-ctas")]
    assert set(only) <= set(plan.cases(draw_seeds=[920385503])), only


def test_the_probe_command_parses():
    probe = bench_script("model_decode_probe").parser()
    args = probe.parse_args(_command("model_decode_probe.py"))
    assert args.loop_tail_ab and args.greedy_pick_ab and args.l2_prefetch_ab and args.global_prologue_ab
    assert "foldkv-folded:4096:8" in args.decode
    twin = SCRIPT.replace("--loop-tail-ab", "--loop-gone-ab")  # red twin: a flag the probe lacks
    with pytest.raises(SystemExit):
        probe.parse_args(_command("model_decode_probe.py", twin))


def test_the_probe_prints_the_loops_share_of_a_token():
    """The probe's per-cell line carries TPOT - device step (what runs 26 and 29 predict), n/a where a cell has none."""
    probe = bench_script("model_decode_probe")
    assert probe._between_steps({"tpot_ms": 16.07, "device_step_ms": 15.972415924072266}) == "0.098"
    assert probe._between_steps({"tpot_ms": 16.07, "device_step_ms": None}) == "n/a"


def test_the_ring_probe_command_parses():
    probe = bench_script("ring_probe").parser()
    args = probe.parse_args(_command("ring_probe.py"))
    assert args.batches == [1, 8] and args.arms == ["ring_cublas", "split_jit", "split_graph", "read_split"]
    with pytest.raises(SystemExit):  # red twin: an arm the probe lacks
        probe.parse_args(["--arms", "ring_cublas", "cublas_gone"])



def _unknown_flags(tool: str, source: str, script: str = SCRIPT) -> list[str]:
    """The flags any command of the script passes `tool` that its argparse source does not declare."""
    declared = set(re.findall(r'add_argument\("(--[\w-]+)"', source))
    return [a for args in _commands(tool, script) for a in args if a.startswith("--") and a not in declared]


@pytest.mark.parametrize("tool", ["prefill_kernel_probe.py", "multiwave_probe.py", "window_kernel_probe.py"])
def test_the_kernel_probe_flags_exist(tool):
    source = (ROOT / "bench" / tool).read_text()
    assert _unknown_flags(tool, source) == []
    twin = SCRIPT.replace(f"{tool} --out", f"{tool} --gone-flag x --out")  # red twin: a flag the probe lacks
    assert set(_unknown_flags(tool, source, twin)) == {"--gone-flag"}


def _parts(script: str = SCRIPT) -> tuple[list[str], list[str]]:
    """(the PARTs the script's header describes, the PARTs it has a block for), each sorted."""
    described = re.findall(r"^#   PART=(\w+)  ", script, re.M)  # a description: two spaces after the name
    blocks = re.findall(r'^if \[ "\$PART" = (\w+) \]', script, re.M)
    return sorted(described), sorted(blocks)


def test_every_part_is_described_and_run():
    described, blocks = _parts()
    assert described == blocks and "tile_sweep" in blocks, (described, blocks)
    twin = SCRIPT.replace('if [ "$PART" = tile_sweep ]', 'if [ "$PART" = tile_swept ]')  # red twin: a block renamed
    described, blocks = _parts(twin)
    assert described != blocks


def test_the_tile_sweep_call_runs_the_sweep():
    """PART=tile_sweep runs the probe's sweep (not its cells) and writes into $OUT; the sweep's bookkeeping holds
    (every layout reads exactly the denominator's bytes: tests/test_multiwave_probe_cpu.py)."""
    sweeps = [args for args in _commands("multiwave_probe.py") if "--tile-sweep" in args]
    assert len(sweeps) == 1 and sweeps[0][sweeps[0].index("--out") + 1] == "$OUTD", sweeps
    twin = SCRIPT.replace("--tile-sweep --out", "--out")  # red twin: the flag dropped runs the cells instead
    assert not [args for args in _commands("multiwave_probe.py", twin) if "--tile-sweep" in args]
    notes = (ROOT / "bench" / "DECODE_NOTES.md").read_text()
    section = notes[notes.index("## Run 24: the tile sweep"):]
    named = re.findall(r"PART=(\w+) bash scripts/lab_calls\.sh", section)
    assert named and set(named) <= set(_parts()[1]), named  # the notes' command is a PART the script runs


def test_the_prefill_probe_cells_parse():
    """Every cell the script gives bench/prefill_probe.py parses, step options included (an option StepOptions lacks
    would be refused here, not on the device); red twin: a misspelt option is refused."""
    import argparse

    probe = bench_script("prefill_probe")
    cells = [c for args in _commands("$P") for c in args if re.match(r"(\$N|\$S|foldkv-[a-z0-9]+):", c)]  # P: the probe
    options = [c for c in cells if "@" in c]
    assert options, "no cell with step options"
    for cell in cells:
        probe._cell(cell.replace("$N", "foldkv-folded").replace("$S", "foldkv-split").replace("$L", "1:8192"), 4096)
    with pytest.raises(argparse.ArgumentTypeError):
        probe._cell("foldkv-folded:32768@merge_prefil=0", 4096)
