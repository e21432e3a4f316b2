"""Notebook parameters (foldkv.lab.params): papermill's `-p` text read into each parameter's kind, and every out-of-range
value refused with a message that names the parameter. The notebooks themselves run in tests/test_notebooks.py."""

from __future__ import annotations

import json
import os

import pytest

from foldkv import GEMMA4_31B
from foldkv.lab.params import SPECS, Param, ParameterError, parse_value, read_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _defaults(notebook: str) -> dict:
    """The notebook's parameters cell, executed: its defaults as a fresh kernel would hold them."""
    with open(os.path.join(ROOT, "notebooks", f"{notebook}.ipynb")) as fh:
        nb = json.load(fh)
    cells = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{notebook}: expected one cell tagged 'parameters', found {len(cells)}"
    namespace: dict = {}
    exec("".join(cells[0]["source"]), namespace)
    namespace.pop("__builtins__")
    return namespace


INTS = Param("list", "int")
NAMES = Param("list", "str")
TEXT = Param("list", "str", split_commas=False)


@pytest.mark.parametrize("spec,value,want", [
    (INTS, "[2048, 1000000]", [2048, 1000000]),           # JSON
    (INTS, "(2048, 4096)", [2048, 4096]),                 # a Python literal
    (INTS, "2048, 4096", [2048, 4096]),                   # comma-separated
    (INTS, "1e3", [1000]),                                 # one item, a whole float
    (INTS, 4096, [4096]),                                  # papermill's -p gives a lone number as a number
    (INTS, [1, 2.0], [1, 2]),                              # already a list (-y YAML, execute_notebook)
    (NAMES, '["folded"]', ["folded"]),
    (NAMES, "['split', 'folded']", ["split", "folded"]),
    (NAMES, "folded", ["folded"]),
    (NAMES, "split,folded", ["split", "folded"]),
    (TEXT, "the cat, the dog", ["the cat, the dog"]),      # free text keeps its commas
    (TEXT, '["a, b", "c"]', ["a, b", "c"]),
    (Param("dict"), '{"hidden_size": 64}', {"hidden_size": 64}),
    (Param("dict"), "{'hidden_size': 64, 'dtype': None}", {"hidden_size": 64, "dtype": None}),
    (Param("dict"), {}, {}),
    (Param("bool"), "true", True),
    (Param("bool"), "False", False),
    (Param("bool"), 1, True),
    (Param("int"), "12", 12),
    (Param("int"), 3.0, 3),
    (Param("float"), "2.5", 2.5),
    (Param("float"), 3, 3.0),
    (Param("float", also=("measure",)), "measure", "measure"),
    (Param("str"), 2026, "2026"),                          # -p out_dir 2026 arrives as a number
    (Param("str", optional=True), "None", None),
    (Param("list", "int", optional=True), None, None),
])
def test_parse_reads_papermill_text(spec, value, want):
    got = parse_value("p", value, spec)
    assert got == want and type(got) is type(want), f"{value!r} -> {got!r}, expected {want!r}"


@pytest.mark.parametrize("spec,value,message", [
    (INTS, "[1, 2", "p: cannot read '[1, 2' as a list"),
    (INTS, "[1, 'x']", "p[1]: 'x' is not an int"),
    (INTS, "1.5", "p[0]: '1.5' is not a whole number"),
    (INTS, {"a": 1}, "is not a list of int"),
    (Param("dict"), "{", "p: cannot read '{' as a mapping"),
    (Param("dict"), "[1, 2]", "p: [1, 2] is not a mapping"),
    (Param("dict"), "{1: 2}", "keys must be strings"),
    (Param("bool"), "maybe", "p: 'maybe' is not a bool"),
    (Param("bool"), 2, "p: 2 is not a bool"),
    (Param("int"), "abc", "p: 'abc' is not an int"),
    (Param("int"), True, "p: True is not an int"),
    (Param("float"), "nan", "p: 'nan' is not a number"),
    (Param("float"), float("inf"), "is not a finite number"),
    (Param("float", also=("measure",)), "measured", "or one of ['measure']"),
    (Param("str"), ["a"], "p: ['a'] is not a string"),
    (Param("list", "int"), None, "p: None is not accepted"),
])
def test_parse_refuses_what_it_cannot_read(spec, value, message):
    with pytest.raises(ParameterError) as exc:
        parse_value("p", value, spec)
    assert message in str(exc.value), str(exc.value)


@pytest.mark.parametrize("notebook", sorted(SPECS))
def test_spec_covers_the_parameters_cell_and_its_defaults_pass(notebook):
    defaults = _defaults(notebook)
    assert set(defaults) == set(SPECS[notebook]), (
        f"{notebook}: parameters cell and foldkv.lab.params.SPECS differ: {sorted(set(defaults) ^ set(SPECS[notebook]))}")
    assert read_parameters(notebook, defaults) == defaults


# Every override below is given as text, as papermill's `-p name value` passes it.
@pytest.mark.parametrize("notebook,overrides,want", [
    ("01_byte_floor", {"context_lengths": "[2048, 4096]", "bandwidth_gbps": "measure", "batch": "2"},
     {"context_lengths": [2048, 4096], "bandwidth_gbps": "measure", "batch": 2}),
    ("02_correctness_gates", {"formats": '["folded"]', "backends": "jit", "run_sanitizer": "false"},
     {"formats": ["folded"], "backends": ["jit"], "run_sanitizer": False}),
    ("03_drift_study", {"lengths": "[5, 66]", "synthetic_config": '{"hidden_size": 64}', "arms": '["ref-folded"]'},
     {"lengths": [5, 66], "synthetic_config": {"hidden_size": 64}, "arms": ["ref-folded"]}),
    ("04_benchmarks", {"sections": '["single"]', "decode_arms": "torch,fi_tc", "smoke": "true", "rounds": "5"},
     {"sections": ["single"], "decode_arms": ["torch", "fi_tc"], "smoke": True, "rounds": 5}),
    ("05_generate", {"decode_contexts": "[32768, 131072]", "arms": "sdpa,foldkv-split", "decode_batches": "8",
                     "largest_context": "65536"},
     {"decode_contexts": [32768, 131072], "arms": ["sdpa", "foldkv-split"], "decode_batches": [8],
      "largest_context": 65536}),
    ("06_tensor_parallel", {"decode_contexts": "32768,131072", "arms": "foldkv-folded", "ranks": "4",
                            "largest_context": "0"},
     {"decode_contexts": [32768, 131072], "arms": ["foldkv-folded"], "ranks": 4, "largest_context": 0}),
    ("07_time_to_first_token", {"ttft_cells": "4096:1,131072:4:3", "ttft_rounds": "2", "first_use_lengths": "4099, 4101",
                                "e2e_prompt": "0", "prefill_memory_batches": "1,4", "e2e_arms": "foldkv-folded,sdpa",
                                "ttft_arms": '["foldkv-folded", "sdpa"]'},
     {"ttft_cells": ["4096:1", "131072:4:3"], "ttft_rounds": 2, "first_use_lengths": [4099, 4101], "e2e_prompt": 0,
      "prefill_memory_batches": [1, 4], "e2e_arms": ["foldkv-folded", "sdpa"], "ttft_arms": ["foldkv-folded", "sdpa"]}),
])
def test_read_parameters_reads_text_overrides(notebook, overrides, want):
    got = read_parameters(notebook, {**_defaults(notebook), **overrides})
    assert {k: got[k] for k in want} == want


MAX = GEMMA4_31B.max_position  # 262,144


@pytest.mark.parametrize("notebook,overrides,message", [
    # a context past the model's max_position
    ("01_byte_floor", {"context_lengths": "[2048, 1000000]"},
     "context_lengths: 1000000 is past the model's max_position 262144 (gemma-4-31b)"),
    ("01_byte_floor", {"sweep": f"[{MAX + 1}]"}, f"sweep: {MAX + 1} is past the model's max_position"),
    ("03_drift_study", {"lengths": f"[{MAX - 15}]"}, f"lengths: {MAX - 15} + steps 16 is past the model's max_position"),
    ("04_benchmarks", {"single_lengths": "[1000000]"}, "single_lengths: 1000000 is past the model's max_position"),
    ("04_benchmarks", {"prefill_contexts": f"[{MAX + 1}]"}, "prefill_contexts: 262145 is past"),
    # non-positive lengths and counts
    ("01_byte_floor", {"context_lengths": "[0, 97]"}, "context_lengths: 0 is not positive"),
    ("03_drift_study", {"sweep_lengths": "[-3]"}, "sweep_lengths: -3 is not positive"),
    ("04_benchmarks", {"rounds": "0"}, "rounds: 0 is not positive"),
    ("01_byte_floor", {"memory_budget_gib": "-1"}, "memory_budget_gib: -1.0 is not positive"),
    ("04_benchmarks", {"single_lengths": "[]"}, "single_lengths: the list is empty"),
    # unknown names
    ("02_correctness_gates", {"formats": '["folded", "paged"]'},
     "formats: unknown value 'paged'; expected some of ['split', 'folded']"),
    ("02_correctness_gates", {"case_set": "tiny"}, "case_set: unknown value 'tiny'; expected one of ['full', 'smoke']"),
    ("02_correctness_gates", {"backends": "jit,tvm"}, "backends: unknown value 'tvm'"),
    ("03_drift_study", {"arms": '["folded", "incumbent"]'}, "arms: unknown value 'incumbent'"),
    ("03_drift_study", {"synthetic_config": '{"hiden_size": 64}'}, "synthetic_config: unknown key(s) ['hiden_size']"),
    ("03_drift_study", {"sweep_prompt": "3"}, "sweep_prompt: 3 is not an index of the 3 prompts"),
    ("03_drift_study", {"device": "gpu"}, "device: 'gpu' is not a device"),
    ("04_benchmarks", {"decode_arms": "torch,fi_tensor"}, "decode_arms: unknown value 'fi_tensor'"),
    ("04_benchmarks", {"batch_cases": "uniform8,uniform256"},
     "batch_cases: unknown value 'uniform256'; expected some of ['uniform8', 'uniform32'"),
    ("04_benchmarks", {"batch_cases": "[]"}, "batch_cases: the list is empty"),
    ("04_benchmarks", {"prefill_arms": '["fi_prefill", "torch"]'}, "prefill_arms: unknown value 'torch'"),
    ("04_benchmarks", {"sections": '["single", "prefil"]'}, "sections: unknown value 'prefil'"),
    ("04_benchmarks", {"mode": "fast"}, "mode: unknown value 'fast'"),
    ("01_byte_floor", {"geometry": "gemma-4-13b"}, "geometry: unknown geometry 'gemma-4-13b': not a preset (gemma-4-31b, gemma-4-31b-tp2)"),
    # paths that do not exist
    ("02_correctness_gates", {"aot_dir": "/nonexistent/aot"}, "aot_dir: '/nonexistent/aot' is not an existing directory"),
    ("04_benchmarks", {"redraw_from": "papermill_runs/none/04_benchmarks.json"}, "redraw_from: 'papermill_runs/none"),
    ("03_drift_study", {"model_path": "/nonexistent/model"}, "model_path: no config.json at '/nonexistent/model'"),
    ("03_drift_study", {"attn_implementation": "flash_attention_2"}, "attn_implementation: unknown value"),
    ("05_generate", {"contexts": f"[{MAX + 1}]"}, f"contexts: {MAX + 1} is past the model's max_position"),
    ("05_generate", {"decode_contexts": "[0]"}, "decode_contexts: 0 is not positive"),
    ("05_generate", {"new_tokens": "3"}, "new_tokens: 3 is below 4"),
    ("05_generate", {"arms": '["sdpa", "eager"]'}, "arms: unknown value 'eager'"),
    ("05_generate", {"largest_context": f"{MAX + 1}"}, f"largest_context: {MAX + 1} is past the model's max_position"),
    ("06_tensor_parallel", {"arms": '["foldkv-folded", "sdpa"]'}, "arms: unknown value 'sdpa'"),
    ("06_tensor_parallel", {"ranks": "1"}, "ranks: 1 is below 2"),
    ("06_tensor_parallel", {"ranks": "3"}, "ranks: 3 tensor-parallel ranks over 4 KV heads"),
    ("06_tensor_parallel", {"capacity_context": f"{MAX + 1}"}, f"capacity_context: {MAX + 1} is past the model's max_position"),
    ("07_time_to_first_token", {"ttft_cells": "4096"}, "ttft_cells: cell '4096': expected CONTEXT:BATCH"),
    ("07_time_to_first_token", {"ttft_cells": "4096:0"}, "ttft_cells: cell '4096:0': context and batch must be positive"),
    ("07_time_to_first_token", {"ttft_cells": f"{MAX + 1}:1"}, f"ttft_cells: '{MAX + 1}:1': {MAX + 1} is past the model's"),
    ("07_time_to_first_token", {"ttft_rounds": "0"}, "ttft_rounds: 0 is not positive"),
    ("07_time_to_first_token", {"ttft_cells": "4096:1:0"}, "ttft_cells: cell '4096:1:0': its rounds must be a positive"),
    ("07_time_to_first_token", {"ttft_cells": "4096:1:5,4096:1"}, "ttft_cells: cell '4096:1': 4096:1 is given twice"),
    ("07_time_to_first_token", {"ttft_arms": "foldkv-folded,eager"}, "ttft_arms: unknown value 'eager'"),
    ("07_time_to_first_token", {"first_use_lengths": "4099,4099"}, "first_use_lengths: [4099] not new to the process"),
    ("07_time_to_first_token", {"first_use_lengths": "4096,4099"}, "first_use_lengths: [4096] not new to the process"),
    ("07_time_to_first_token", {"first_use_lengths": "256,4099"}, "first_use_lengths: [256] not new to the process"),
    ("07_time_to_first_token", {"e2e_arms": "foldkv-folded,eager"}, "e2e_arms: unknown value 'eager'"),
    ("07_time_to_first_token", {"e2e_new_tokens": "1"}, "e2e_new_tokens: 1 is below 2"),
    ("07_time_to_first_token", {"prefill_memory_context": f"{MAX + 1}"}, f"prefill_memory_context: {MAX + 1} is past the model"),
])
def test_read_parameters_refuses_out_of_range(notebook, overrides, message):
    with pytest.raises(ParameterError) as exc:
        read_parameters(notebook, {**_defaults(notebook), **overrides})
    assert message in str(exc.value), str(exc.value)


@pytest.mark.parametrize("max_position", [4096, MAX])
def test_context_bound_is_the_geometry_max_position(tmp_path, max_position):
    """The bound comes from the geometry the notebook serves (a config.json here), not a constant: its
    max_position is accepted, one past it refused."""
    from foldkv.lab.synthetic import synthetic_config

    cfg = dict(synthetic_config(), max_position_embeddings=max_position)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    base = {**_defaults("01_byte_floor"), "geometry": str(tmp_path), "sweep": "[1024]"}
    assert read_parameters("01_byte_floor", {**base, "context_lengths": f"[{max_position}]"})["context_lengths"] == [
        max_position]
    with pytest.raises(ParameterError, match=f"context_lengths: {max_position + 1} is past the model's max_position"
                                             f" {max_position}"):
        read_parameters("01_byte_floor", {**base, "context_lengths": f"[97, {max_position + 1}]"})


def test_unknown_notebook_and_missing_parameter_are_refused():
    with pytest.raises(ParameterError, match="no parameter specs for notebook '05_x'"):
        read_parameters("05_x", {})
    defaults = _defaults("02_correctness_gates")
    del defaults["formats"]
    with pytest.raises(ParameterError, match=r"parameters \['formats'\] are not defined"):
        read_parameters("02_correctness_gates", defaults)
