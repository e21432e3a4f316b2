"""The lab's palette (`foldkv.lab.palette`): every arm of every registry has a style, arms that can share a figure
have colours of their own, and every figure function of the lab, drawn on the CPU (Agg) from small synthetic rows or
the committed run data, shows no two arms in one colour and no series outside the palette. Red twins: a palette where
two arms share a colour (lines, bars, scatter) is caught by the same check on the drawn figure; a series drawn without
the palette is caught; the fallback of unknown names never collides inside one figure and refuses past its colours."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import pytest

from conftest import require_module
from foldkv.layout import KvFormat
from foldkv.lab import palette
from foldkv.lab.bench import arms as bench_arms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _agg():
    require_module("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def _registries() -> dict[str, list[str]]:
    """Every group of names the lab draws side by side: one registry each, with what its figures add."""
    from foldkv.lab import model, model_decode, tp_model_decode

    return {
        "bench decode (notebook 04)": list(bench_arms.DECODE_ARMS) + ["target"],
        "bench prefill (notebook 04)": list(bench_arms.PREFILL_ARMS),
        "drift study (notebook 03)": [a for a in model.MODEL_ARMS if a != "incumbent"] + ["neutral", "drift line"],
        "model decode (notebook 05)": list(model_decode.MODEL_ARMS) + ["sdpa-static-compile", "floor"],
        "cache bytes (notebook 05)": ["dynamic-cache", "split", "folded"],
        "tensor parallel (notebook 06)": list(tp_model_decode.ARMS),
        "formats (notebooks 01, 02)": [f.value for f in KvFormat] + ["bound"],
        "incumbent": ["incumbent"],
    }


def test_every_registered_arm_has_a_style_and_each_registry_distinct_colours():
    for group, names in _registries().items():
        missing = [n for n in names if palette.canonical(n) is None]
        assert not missing, f"{group}: no palette entry for {missing}"
        by_colour: dict[str, set[str]] = {}
        for n in names:
            key = palette.canonical(n)
            by_colour.setdefault(palette.ARM_STYLES[key].color.lower(), set()).add(key)
        assert all(len(keys) == 1 for keys in by_colour.values()), (group, by_colour)


def test_aliases_and_fallback_colours():
    assert all(t in palette.ARM_STYLES for t in palette.ALIASES.values())
    assert not set(palette.ALIASES) & set(palette.ARM_STYLES)  # a name is an entry or an alias, not both
    entry_colours = {s.color.lower() for s in palette.ARM_STYLES.values()}
    assert len(set(palette.FALLBACK)) == len(palette.FALLBACK)
    assert not entry_colours & {c.lower() for c in palette.FALLBACK}
    # the families: torch black, reads dashed, one hue family per kernel kind
    assert palette.ARM_STYLES["torch"].color == "#000000" and palette.ARM_STYLES["read_folded"].linestyle == "--"
    fam = {n: s.family for n, s in palette.ARM_STYLES.items()}
    assert fam["folded_jit"] == fam["folded_aot"] != fam["split_jit"] != fam["fi_tc"] != fam["folded_fp8_jit"]


def test_fallback_never_collides_inside_a_figure_and_refuses_past_its_colours():
    st = palette.Styles()
    names = ["folded_jit", "arm_a", "fi_tc", "arm_b", "arm_c"]
    colours = [st.color(n) for n in names]
    assert len(set(colours)) == len(names)
    assert st.color("arm_a") == colours[1] and st.key("arm_a") == "arm_a" and st.key("foldkv-folded") == "folded_jit"
    again = palette.Styles()
    assert [again.color(n) for n in names] == colours  # deterministic: the same names in the same order
    with pytest.raises(ValueError, match="add entries"):
        for i in range(len(palette.FALLBACK) + 1):
            st.style(f"unknown_{i}")


# --- every figure function, drawn -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _bench_results() -> dict:
    """The newest committed notebook 04 results (the figures only read them)."""
    from foldkv.lab import bench

    found = bench.find_results(root=ROOT)
    assert found is not None, "no committed notebook 04 results under papermill_runs/"
    return bench.load_results(found["path"])


def _drift_results() -> dict:
    names = ["split", "folded", "folded-fp8", "ref-folded"]
    cells = [{"length": n, "neutral": [0.0, 0.1, 0.12], "arms": {a: {"status": "ran", "gap": [0.1 * (i + 1), 0.2, 0.3]}
                                                                 for i, a in enumerate(names)}}
             for n in (100, 1000)]
    return {"parameters": {"arms": names, "steps": 2}, "arm_status": {a: "ran" for a in names}, "cells": cells,
            "drift_line": {"value": 1.0}}


def _tpot_rows() -> list[dict]:
    from foldkv.lab import model_decode

    return [{"arm": a, "status": "ran", "context": n, "batch": b, "tpot_ms": 10.0 + i, "floor_ms": 9.0}
            for i, a in enumerate(model_decode.MODEL_ARMS) for n in (4096, 32768) for b in (1, 8)]


def _gate_rows() -> list[dict]:
    return [{"format": f, "kind": k, "tokens": t, "rel_fro": 1e-3, "max_abs": 1e-2}
            for f in ("split", "folded") for k in ("decode", "prefill") for t in (64, 4096)]


def _fp8_summary() -> dict:
    from foldkv.lab import fp8_accumulation as fa

    return {"bound_cells": [{"fresh_every": None, "signs": signs, "spread": spread, "steps": steps,
                             "measured_max": 1e-4 * steps * (spread + 1), "bound_min": 1e-3 * steps,
                             "bound_q50": 2e-3 * steps}
                            for signs in fa.SIGNS for spread in (0, 4, 8) for steps in (1, 4, 16)]}


def _figures() -> dict[str, callable]:
    """{name: a function drawing that figure (or its list of figures)} for every figure function of the lab."""
    from foldkv import GEMMA4_31B
    from foldkv.lab import drift, gates, generate_bench, model_decode, ttft
    from foldkv.lab.bench import plots

    return {
        "bench.decode_figure": lambda: plots.decode_figure(_bench_results(), redrawn_from="x"),
        "bench.memory_and_batch_figure": lambda: plots.memory_and_batch_figure(_bench_results()),
        "bench.targets_figure": lambda: plots.targets_figure(_bench_results()),
        "bench.drawn_figure": lambda: plots.drawn_figure(_bench_results()),
        "drift.plot_gap_distribution": lambda: drift.plot_gap_distribution(_drift_results()),
        "drift.plot_gap_vs_step_and_length": lambda: drift.plot_gap_vs_step_and_length(_drift_results()),
        "model_decode.plot_tpot": lambda: model_decode.plot_tpot(_tpot_rows()),
        "generate_bench.plot_cache_bytes": lambda: generate_bench.plot_cache_bytes(
            generate_bench.cache_bytes_rows(GEMMA4_31B, [4096, 65536])),
        "gates.plot_errors": lambda: gates.plot_errors(_gate_rows()),
        "gates.plot_fp8_wgmma_bound": lambda: gates.plot_fp8_wgmma_bound(_fp8_summary(), "committed"),
        "ttft.plot_ttft_over_floor": lambda: ttft.plot_ttft_over_floor(
            [{"arm": a, "prompt_tokens": n, "batch": b, "status": "ran", "ttft_over_floor": 1.5 + 0.1 * i}
             for i, a in enumerate(("foldkv-folded", "foldkv-fp8", "foldkv-split", "flashinfer", "sdpa"))
             for n in (4096, 32768) for b in (1, 4)]),
    }


@pytest.mark.parametrize("name", sorted(_figures()))
def test_every_figure_gives_each_arm_its_own_colour(name):
    fig = _figures()[name]()
    assert fig is not None
    gids = {a.get_gid() for ax in fig.axes for a in (*ax.lines, *ax.patches, *ax.collections)} - {None}
    assert len(gids) >= 2, f"{name}: the check would see nothing: no artist carries a palette gid"
    assert palette.colour_clashes(fig) == {}, name
    assert palette.unstyled(fig) == [], name
    fig.canvas.draw()  # the constrained layout and the outside legends lay out without error


def test_the_single_request_figure_names_each_issue_arm_apart():
    """The four arms that were two colours: fi_cuda / read_folded_fp8 and fi_tc / fi_tc_fp8."""
    from foldkv.lab.bench import plots

    fig = plots.decode_figure(_bench_results())
    colour = {a.get_gid(): palette._colours(a)[0] for a in fig.axes[0].lines if a.get_gid()}
    shown = [a for a in ("fi_cuda", "read_folded_fp8", "fi_tc", "fi_tc_fp8") if a in colour]
    assert len({colour[a] for a in shown}) == len(shown)
    assert fig.axes[2].get_yscale() == "log"


def test_the_ragged_batches_are_on_a_log_axis_with_labels_apart():
    from foldkv.lab.bench import plots

    fig = plots.memory_and_batch_figure(_bench_results())
    ax = fig.axes[1]
    assert ax.get_yscale() == "log"
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()]
    assert len(boxes) >= 2 and not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))


# --- red twins: the same check catches a palette that repeats a colour, and a series drawn outside it ----------------
def _recolour(monkeypatch, arm: str, like: str):
    monkeypatch.setitem(palette.ARM_STYLES, arm,
                        dataclasses.replace(palette.ARM_STYLES[arm], color=palette.ARM_STYLES[like].color))


@pytest.mark.parametrize("arm, like, draw", [
    ("fi_cuda", "read_folded_fp8", "bench.decode_figure"),            # lines
    ("fi_tc_fp8", "fi_tc", "bench.memory_and_batch_figure"),          # bars
    ("split_jit", "folded_jit", "gates.plot_errors"),                 # scatter collections, reached by alias
    ("ref-folded", "split_jit", "drift.plot_gap_distribution"),       # step histograms
])
def test_red_twin_shared_colour_is_caught(monkeypatch, arm, like, draw):
    _recolour(monkeypatch, arm, like)
    clashes = palette.colour_clashes(_figures()[draw]())
    assert any({arm, like} <= set(names) for names in clashes.values()), clashes


def test_red_twin_series_outside_the_palette_is_caught(_agg):
    fig, ax = _agg.subplots()
    st = palette.Styles()
    ax.plot([1, 2], [1, 2], label="folded_jit", **st.line("folded_jit"))
    ax.plot([1, 2], [2, 1], label="drawn by hand")  # matplotlib's own colour cycle
    assert palette.unstyled(fig) == ["drawn by hand"]
    ax.plot([1, 2], [3, 1], label="also by hand", color=st.color("folded_jit"), gid="mystery")
    assert palette.colour_clashes(fig) == {"#0072b2": ["folded_jit", "mystery"]}


def test_notebook_inline_plots_take_the_palette():
    """Notebooks 01 and 06 draw inline: every plot or bar call of theirs passes a palette style."""
    for nb in ("01_byte_floor", "06_tensor_parallel"):
        cells = json.load(open(os.path.join(ROOT, "notebooks", f"{nb}.ipynb")))["cells"]
        calls = [line for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
                 if ".plot(" in line or ".bar(" in line or ".scatter(" in line]
        assert calls, nb
        joined = "\n".join("".join(c["source"]) for c in cells)
        assert joined.count("**st.") >= len(calls), (nb, calls)
