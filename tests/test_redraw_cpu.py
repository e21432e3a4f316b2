"""Each notebook's GPU sections redrawn on a machine without CUDA from its run of record (`report.RecordRedraw`): the
numbers shown are the recorded ones, the sections say they were redrawn from which run at which commit, what is
derived from the numbers (notebook 02's verdict, 03's checks, 05's targets, 07's floors and targets) is computed
again from them and equals what that run derived (07: where a rule changed since the run, exactly what the earlier
rule gives, shown beside today's verdict), the figures carry the label and give each arm its own colour. Red twins: a
number changed in a record (with the index updated to its bytes, so only the derivation can catch it) fails the
section that derives from it; a recorded verdict that no rule change explains fails 07's targets; a record whose commit or bytes are not the index's stops the redraw before anything is shown; with CUDA
nothing is redrawn; a notebook without a run of record says so in one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from foldkv.lab.bench import results
from foldkv.lab.report import RecordRedraw, RunRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def agg():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def _redraw(notebook: str, tmp_path, root: str | None = None) -> RecordRedraw:
    return RecordRedraw(RunRecord(notebook, tmp_path / "out"), cuda=False, root=root)


def _altered_copy(tmp_path, notebook: str, name: str | None, edit, row: str | None = None) -> str:
    """A root holding the index and `notebook`'s run of record (or the run of the index `row` given in its place) with
    `edit` applied to file `name` (None: no edit), and the index's sha256 updated to the edited bytes: the index check
    passes, so only what derives from the numbers can catch it."""
    root = tmp_path / "repo"
    text = open(os.path.join(ROOT, results.RUNS_INDEX)).read()
    recorded = next(line for line in text.splitlines() if line.startswith(f"| {notebook} |"))
    row = row or recorded
    run = row.split("|")[2].strip()
    folder = root / results.RUNS_DIR / run
    folder.mkdir(parents=True)
    for n in results.redrawn_files(notebook):
        shutil.copy(os.path.join(ROOT, results.RUNS_DIR, run, n), folder / n)
    if name is not None:
        doc = json.loads((folder / name).read_text())
        edit(doc)
        (folder / name).write_text(json.dumps(doc, indent=1))
    digest = row.split("|")[4].strip()
    new = results.files_digest(str(folder), results.redrawn_files(notebook))[:results.DIGEST_CHARS]
    (root / results.RUNS_INDEX).write_text(text.replace(recorded, row.replace(digest, new)))
    return str(root)


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def _labelled(fig, run: str) -> bool:
    """The figure's title names the run of record and lies apart from every panel's title (drawn, laid out)."""
    fig.canvas.draw()
    top = fig._suptitle
    if top is None or f"from the run of record {run}, commit " not in top.get_text():
        return False
    box = top.get_window_extent()
    return not any(box.overlaps(ax.title.get_window_extent()) for ax in fig.axes if ax.get_title())


# --- notebook 02 -------------------------------------------------------------------------------------------------
def test_gates_redrawn_from_the_record_with_their_verdict_computed_again(tmp_path, agg):
    from foldkv.lab import gates
    from foldkv.lab.palette import colour_clashes

    redraw = _redraw("02_correctness_gates", tmp_path)
    run = results.run_of_record("02_correctness_gates")
    recorded = redraw.recorded["results"]
    shown = redraw.results("decode_gates", "prefill_gates")
    assert shown is recorded and redraw.record.sections["decode_gates"] == f"redrawn from {run}"
    table = gates.gates_tables(shown, ["jit", "aot"])
    first = recorded["gates"][0]
    assert f"| {first['case']} | {first['kind']} | {first['format']} |" in table
    assert redraw.caption("decode_gates").startswith(f"**Redrawn from the run of record {run}, commit ")
    fig = redraw.mark(gates.plot_errors(shown["gates"]), "decode_gates")
    assert _labelled(fig, run) and f"commit {redraw.source['commit'][:7]}" in fig.get_suptitle()
    assert colour_clashes(fig) == {}
    for section in ("prefill_last_row_vs_decode", "refusals", "graph_walk", "fp8_decode_gates", "fp8_needle",
                    "long_walk"):
        assert redraw.rows(section) == recorded[section]["rows"] and redraw.rows(section), section
    assert redraw.rows("sanitizer", "tools") == recorded["sanitizer"]["tools"]
    verdict = redraw.recompute(gates.record_verdict, "decode_gates", "the gates' verdict", "verdict")
    assert verdict == recorded["verdict"] and all(v["status"] == "pass" for v in verdict)
    assert redraw.record.sections["decode_gates"] == f"redrawn from {run}"
    mine = gates.record_verdict(redraw.record)  # this run's: the redrawn sections count neither way
    assert redraw.record.results["all_run_gates_pass"] is True
    assert {v["gate"]: v["status"] for v in mine}["refusals"] == f"redrawn from {run}"


def test_red_twin_a_gate_row_changed_in_the_record_fails_its_verdict(tmp_path):
    from foldkv.lab import gates

    def fail_one(doc):
        doc["results"]["gates"][3]["passed"] = False

    root = _altered_copy(tmp_path, "02_correctness_gates", "02_correctness_gates.record.json", fail_one)
    redraw = _redraw("02_correctness_gates", tmp_path, root)
    redraw.results("decode_gates", "prefill_gates")
    redraw.recompute(gates.record_verdict, "decode_gates", "the gates' verdict", "verdict")
    said = redraw.record.sections["decode_gates"]
    assert said.startswith("failed: the gates' verdict computed from the numbers of the run of record"), said
    assert "'FAIL' here, 'pass' recorded" in said


# --- notebook 03 -------------------------------------------------------------------------------------------------
def test_drift_arms_redrawn_with_their_checks_computed_again(tmp_path, agg):
    from foldkv.lab import drift
    from foldkv.lab.palette import colour_clashes

    redraw = _redraw("03_drift_study", tmp_path)
    run = results.run_of_record("03_drift_study")
    arms = ["arm:split", "arm:folded", "arm:folded-fp8", "pair:folded-fp8 vs ref-folded-fp8"]
    assert redraw.results(*arms)
    assert all(redraw.record.sections[a] == f"redrawn from {run}" for a in arms)
    study = redraw.document(drift.RESULTS_NAME)
    assert redraw.same_as_recorded("checks_of_record", "the drift checks", drift.check_study(study), study["checks"])
    assert "checks_of_record" not in redraw.record.sections
    assert "| split | ran |" in drift.summary_table(study)
    for fig in (drift.plot_gap_distribution(study), drift.plot_gap_vs_step_and_length(study)):
        redraw.mark(fig, *arms)
        assert _labelled(fig, run)
        assert colour_clashes(fig) == {}


def test_red_twin_a_gap_changed_in_the_drift_results_fails_the_checks(tmp_path):
    from foldkv.lab import drift

    def widen(doc):
        doc["cells"][0]["arms"]["folded"]["gap"] = [g * 4 for g in doc["cells"][0]["arms"]["folded"]["gap"]]

    root = _altered_copy(tmp_path, "03_drift_study", drift.RESULTS_NAME, widen)
    redraw = _redraw("03_drift_study", tmp_path, root)
    study = redraw.document(drift.RESULTS_NAME)
    assert not redraw.same_as_recorded("checks_of_record", "the drift checks", drift.check_study(study),
                                       study["checks"])
    assert redraw.record.sections["checks_of_record"].startswith("failed: the drift checks computed from")


# --- notebook 05 -------------------------------------------------------------------------------------------------
def test_generate_targets_computed_from_the_recorded_rows_equal_the_records(tmp_path, agg):
    from foldkv.lab import generate_targets, model_decode
    from foldkv.lab.palette import colour_clashes

    redraw = _redraw("05_generate", tmp_path)
    run = results.run_of_record("05_generate")
    rec = redraw.recorded["results"]
    decode = redraw.rows("decode_31b")
    assert decode == rec["decode_31b"]["rows"] and redraw.rows("step_kernels") == rec["step_kernels"]
    targets = generate_targets.targets(decode, redraw.rows("prefill_tail_31b"), redraw.rows("largest_batch_31b"),
                                       redraw.rows("largest_batch_31b", "both_fit"))
    assert redraw.derived("targets", targets, "decode_31b", what="the targets")
    assert redraw.record.sections["targets"] == f"redrawn from {run}"
    assert redraw.record.results["targets"]["targets"] == rec["targets"] == targets
    met = sum(t["met"] for t in targets)
    text = generate_targets.targets_markdown(targets, redraw.shown_from("decode_31b"))
    assert text.startswith(f"**{met} of {len(targets)} targets met** (from the run of record {run}, commit ")
    folded = next(r for r in decode if r["arm"] == "foldkv-folded" and r["status"] == "ran")
    line = next(t for t in targets if t["target"].startswith("folded TPOT / floor"))
    assert line["value"] == folded["tpot_over_floor"] and line["met"] == (folded["tpot_over_floor"] <= 1.15)
    assert redraw.rows("static_compile_31b") == []  # the run did not run it: said in one line, recorded
    assert redraw.record.sections["static_compile_31b"].startswith(f"not run: no CUDA device, and the run of record {run}")
    fig = redraw.mark(model_decode.plot_tpot(decode), "decode_31b")
    assert _labelled(fig, run) and colour_clashes(fig) == {}


def test_red_twin_a_tpot_changed_in_the_record_fails_the_targets(tmp_path):
    from foldkv.lab import generate_targets

    def faster(doc):  # folded at 4K x 1 made to meet its 1.15x bound
        row = doc["results"]["decode_31b"]["rows"][0]
        assert row["arm"] == "foldkv-folded" and row["tpot_over_floor"] > 1.15
        row["tpot_over_floor"] = 1.10

    root = _altered_copy(tmp_path, "05_generate", "05_generate.record.json", faster)
    redraw = _redraw("05_generate", tmp_path, root)
    targets = generate_targets.targets(redraw.rows("decode_31b"), redraw.rows("prefill_tail_31b"),
                                       redraw.rows("largest_batch_31b"), redraw.rows("largest_batch_31b", "both_fit"))
    assert not redraw.derived("targets", targets, "decode_31b", what="the targets")
    said = redraw.record.sections["targets"]
    assert said.startswith("failed: the targets computed from the numbers of the run of record") and "[0].met: True here, False recorded" in said


# --- every notebook -----------------------------------------------------------------------------------------------
def test_red_twin_a_label_on_every_panel_title_overlaps_its_neighbour(agg):
    """The check `_labelled` makes is able to fail: the long label put on each of two panels' titles (what notebook
    04's `mark_redrawn` does) runs into the next panel's; as the figure's own title it does not."""
    from foldkv.lab.bench.plots import mark_redrawn

    fig, axes = agg.subplots(1, 2, figsize=(14, 4.3), layout="constrained")
    for ax, title in zip(axes, ("relative Frobenius error", "max")):
        ax.set_title(title)
    mark_redrawn(fig, "the run of record h200-20261203-s19, commit 4f41dbe")
    fig.canvas.draw()
    left, right = (ax.title.get_window_extent() for ax in axes)
    assert left.overlaps(right)
    fig.suptitle("Redrawn from the run of record h200-x, commit 1234567 (not measured now)")
    for ax, title in zip(axes, ("relative Frobenius error", "max")):
        ax.set_title(title)
    assert _labelled(fig, "h200-x")


def test_a_record_whose_bytes_or_commit_are_not_the_indexs_is_not_redrawn(tmp_path):
    root = _altered_copy(tmp_path, "05_generate", "05_generate.record.json", lambda doc: None)
    index = os.path.join(root, results.RUNS_INDEX)
    text = open(index).read()
    row = next(line for line in text.splitlines() if line.startswith("| 05_generate |"))
    commit = row.split("|")[3].strip()
    open(index, "w").write(text.replace(row, row.replace(f"| {commit} |", "| 0000000 |")))
    with pytest.raises(results.RecordMismatchError, match="made at commit"):
        _redraw("05_generate", tmp_path, root)
    path = os.path.join(root, results.RUNS_DIR, results.run_of_record("05_generate"), "05_generate.record.json")
    open(index, "w").write(text)
    open(path, "a").write("\n")  # one byte more
    with pytest.raises(results.RecordMismatchError, match="hash to"):
        _redraw("05_generate", tmp_path, root)


def test_with_cuda_nothing_is_redrawn(tmp_path, agg):
    record = RunRecord("05_generate", tmp_path)
    record.ran("decode_31b", rows=[{"arm": "x"}])
    redraw = RecordRedraw(record, cuda=True)
    assert redraw.source is None and redraw.results("decode_31b") is record.results
    assert redraw.rows("prefill_31b") == [] and "prefill_31b" not in record.sections
    assert redraw.caption("decode_31b") == "" and redraw.shown_from("decode_31b") == ""
    fig, ax = agg.subplots()
    ax.set_title("measured now")
    assert _titles(redraw.mark(fig, "decode_31b")) == ["measured now"] and fig.get_suptitle() == ""
    assert redraw.derived("targets", [1], "decode_31b", what="t") and record.results["targets"] == [1]
    assert "measured now" in redraw.banner()


def test_a_notebook_without_a_run_of_record_says_so_in_one_line(tmp_path, capsys):
    nb = next(n for n, run in results.runs_of_record().items() if run is None)
    redraw = _redraw(nb, tmp_path)
    assert redraw.source is None and redraw.banner().count("\n") == 0
    assert redraw.banner().startswith(f"No CUDA device here. No run of record for {nb} yet")
    assert redraw.results("ttft_31b") == {} and redraw.record.sections["ttft_31b"] == "not run: no CUDA device"
    assert capsys.readouterr().out.strip() == results.no_record_line(nb)


# --- notebook 07 -------------------------------------------------------------------------------------------------
TTFT_SECTIONS = ("ttft_31b", "first_use_31b", "e2e_31b", "prefill_memory_31b")


def _ttft_redrawn(redraw):
    """What notebook 07's redraw computes from its run of record: the TTFT rows with each floor computed again, the
    targets of today's rules, and those held to the recorded ones (`ttft.against_record`)."""
    from foldkv.lab import gemma31b, prefill_floor, ttft

    shapes = prefill_floor.model_shapes(gemma31b.gemma4_31b_config())
    rows, e2e = redraw.rows("ttft_31b"), redraw.rows("e2e_31b")
    first_use, memory = redraw.rows("first_use_31b"), redraw.rows("prefill_memory_31b")
    section = redraw.recorded["results"]["ttft_31b"]
    again = ttft.with_e2e_ttft(ttft.with_floor(rows, shapes, section["matmul"]["tflops"], section["prefill_chunk"]),
                               e2e, shapes, section["matmul"]["tflops"], section["prefill_chunk"])
    floors_held = redraw.same_as_recorded("ttft_31b", "the floors and TTFT / floor", again[:len(rows)], rows)
    now = ttft.targets(again, first_use, e2e, memory)
    as_recorded, side = ttft.against_record(now, redraw.recorded["results"]["ttft_targets"], first_use)
    held = redraw.derived("ttft_targets", as_recorded, *TTFT_SECTIONS, what="the targets")
    return again, side, floors_held, held


def test_ttft_redrawn_with_floors_and_targets_computed_again(tmp_path, agg):
    """Notebook 07's run of record redrawn: every floor and target computed again from its rows equals the recorded
    one, and no rule has changed since it ran (each verdict shown once, as recorded)."""
    from foldkv.lab import ttft
    from foldkv.lab.palette import colour_clashes

    redraw = _redraw("07_time_to_first_token", tmp_path)
    run = results.run_of_record("07_time_to_first_token")
    rec = redraw.recorded["results"]
    rows, side, floors_held, held = _ttft_redrawn(redraw)
    assert floors_held and held, redraw.record.sections
    assert all(redraw.record.sections[s] == f"redrawn from {run}" for s in (*TTFT_SECTIONS, "ttft_targets"))
    assert rows == rec["ttft_31b"]["rows"], "every end-to-end prompt has its TTFT cell in this record: nothing added"
    assert redraw.record.results["ttft_targets"]["ttft_targets"] == rec["ttft_targets"]
    assert all(s["rule"] == "" and s["met_now"] == s["met_recorded"] for s in side)
    text = ttft.side_by_side_markdown(side, redraw.label)
    assert text.startswith("**29 of 35 targets met as recorded; under today's rules 29 met, 6 not met, 0 cannot be"
                           f" told from the run's data** (from the run of record {run}, commit ")
    assert "*Rule changed since the run:*" not in text
    assert redraw.caption("ttft_31b").startswith(f"**Redrawn from the run of record {run}, commit ")
    fig = redraw.mark(ttft.plot_ttft_over_floor(rows), "ttft_31b")
    assert _labelled(fig, run) and colour_clashes(fig) == {}


# notebook 07's first H200 run, recorded under the rules before the two changes `ttft.RULE_CHANGES` names
EARLIER_TTFT_RUN = ("| 07_time_to_first_token | h200-20261205 | 95a2626 | 28be3f247c3fb763 | the first H200 run, before"
                    " today's rules |")


def test_ttft_rule_changes_shown_for_an_earlier_run(tmp_path):
    """A run recorded under the earlier rules (h200-20261205, in the index's place): its two changed rules each named
    where they apply and the verdict shown both ways, the rest as recorded."""
    from foldkv.lab import ttft

    root = _altered_copy(tmp_path, "07_time_to_first_token", None, None, row=EARLIER_TTFT_RUN)
    redraw = _redraw("07_time_to_first_token", tmp_path, root)
    rows, side, floors_held, held = _ttft_redrawn(redraw)
    assert floors_held and held, redraw.record.sections
    e2e = next(s for s in side if "end-to-end lowest" in s["target"])
    assert (e2e["met_recorded"], e2e["met_now"]) == (True, False) and e2e["rule"] == ttft.RULE_CHANGES[
        "end-to-end alone"]["short"]
    first = [s for s in side if " first call at " in s["target"]]
    assert len(first) == 10 and all(s["met_now"] is None and s["rule"].startswith("steady state of 1 call")
                                    for s in first)
    assert all(s["rule"] == "" and s["met_now"] == s["met_recorded"] for s in side if s not in first and s is not e2e)
    text = ttft.side_by_side_markdown(side, redraw.label)
    assert text.startswith("**22 of 35 targets met as recorded; under today's rules 13 met, 12 not met, 10 cannot be"
                           " told from the run's data** (from the run of record h200-20261205, commit ")
    assert text.count("*Rule changed since the run:*") == 2


def _set_folded_4k(ttft_s=None, with_ratio=False):
    """An edit of the record's folded 4K TTFT to `ttft_s`, its TTFT / floor left as recorded or (`with_ratio`) made
    consistent with the recorded floor."""
    def edit(doc):
        row = doc["results"]["ttft_31b"]["rows"][0]
        assert (row["arm"], row["prompt_tokens"], row["batch"]) == ("foldkv-folded", 4096, 1)
        if ttft_s is not None:
            row["ttft_s"] = ttft_s
        if with_ratio:
            row["ttft_over_floor"] = ttft_s / row["floor_s"]
    return edit


def test_red_twin_a_ttft_changed_in_the_record_fails_its_floor(tmp_path):
    root = _altered_copy(tmp_path, "07_time_to_first_token", "07_time_to_first_token.record.json",
                         _set_folded_4k(ttft_s=0.45))  # TTFT / floor left as recorded: the floor check sees it
    redraw = _redraw("07_time_to_first_token", tmp_path, root)
    _, _, floors_held, _ = _ttft_redrawn(redraw)
    said = redraw.record.sections["ttft_31b"]
    assert not floors_held and said.startswith("failed: the floors and TTFT / floor computed from"), said
    assert "[0].ttft_over_floor" in said


def test_red_twin_a_ttft_changed_with_its_ratio_fails_the_targets(tmp_path):
    root = _altered_copy(tmp_path, "07_time_to_first_token", "07_time_to_first_token.record.json",
                         _set_folded_4k(ttft_s=0.6, with_ratio=True))  # past 1.6: not met now, met as recorded
    redraw = _redraw("07_time_to_first_token", tmp_path, root)
    _, _, floors_held, held = _ttft_redrawn(redraw)
    said = redraw.record.sections["ttft_targets"]
    assert floors_held and not held and said.startswith("failed: the targets computed from the numbers"), said
    assert "[0].met: False here, True recorded" in said


def test_red_twin_a_recorded_verdict_no_rule_change_explains_is_refused(tmp_path):
    """The rule changes excuse exactly the earlier rule's verdict: a floor verdict flipped in the record, or the
    end-to-end verdict recorded with a value the earlier rule never gave, fails the targets (in the earlier run, which
    the rule changes apply to)."""
    def flip_floor(doc):
        doc["results"]["ttft_targets"][0]["met"] = True

    def e2e_value(doc):
        t = next(t for t in doc["results"]["ttft_targets"] if "end-to-end lowest" in t["target"])
        t["value"] = 0.9

    for name, edit, where in (("floor", flip_floor, "[0].met: False here, True recorded"),
                              ("e2e", e2e_value, "[30].met: False here, True recorded")):
        root = _altered_copy(tmp_path / name, "07_time_to_first_token", "07_time_to_first_token.record.json", edit,
                             row=EARLIER_TTFT_RUN)
        redraw = _redraw("07_time_to_first_token", tmp_path / name, root)
        *_, held = _ttft_redrawn(redraw)
        said = redraw.record.sections["ttft_targets"]
        assert not held and where in said, (name, said)
