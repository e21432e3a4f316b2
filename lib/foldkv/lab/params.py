"""Notebook parameters: read each value papermill injects into the kind the notebook declares, and refuse a value out
of range before the notebook does any work.

papermill's CLI (`-p name value`) turns "True"/"False"/"None" and numbers into Python values and passes everything
else as a string, so a list or a mapping arrives as its text (`-p context_lengths "[2048, 4096]"`). A string given
for a list, mapping, number or bool is read as JSON first, then as a Python literal, then (lists whose items are
numbers or names only) as comma-separated items: `"[2048, 4096]"`, `"(2048, 4096)"` and `"2048,4096"` are the same
list. Values already of the right kind (papermill's `-y` YAML, `execute_notebook(parameters=...)`) pass unchanged.

Every notebook's setup cell starts with `globals().update(read_parameters("<notebook>", globals()))`; a refusal
raises ParameterError there, naming the parameter, the value and what is accepted.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..config import GEMMA4_31B, AttentionGeometry, ConfigError, geometry_from_config, resolve_geometry
from ..layout import KvFormat
from ..validate import FoldKvInputError


class ParameterError(FoldKvInputError):
    """A notebook parameter refused before any work: the message names the parameter and says what is accepted."""


KINDS = ("int", "float", "bool", "str", "list", "dict")


@dataclass(frozen=True)
class Param:
    """What one notebook parameter accepts.

    kind: one of KINDS; item: the kind of a list's items. optional: None is accepted. choices: the accepted values of a
    str (or of each str item). also: strings accepted beside a number (bandwidth "measure"). positive / at_least: the
    lower bound of a number (or of each number item). tokens: a token count, at most the geometry's max_position.
    exists: a path that must exist ("" accepted as "not given"). split_commas: a list may be given as "a,b,c"
    (never for free text such as prompts, which may hold commas).
    """

    kind: str
    item: str | None = None
    optional: bool = False
    choices: tuple | Callable[[], tuple] | None = None
    also: tuple = ()
    positive: bool = False
    at_least: float | None = None
    tokens: bool = False
    exists: str | None = None  # "dir", "file" or "any"
    split_commas: bool = True
    nonempty: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS or (self.kind == "list") != (self.item is not None):
            raise ValueError(f"Param kind={self.kind!r} item={self.item!r}: a list names its item kind, nothing else does")

    def choice_values(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices


# ----------------------------------------------------------------------------------------------------------------
# Reading one value
# ----------------------------------------------------------------------------------------------------------------
def _literal(text: str) -> Any:
    """JSON first (true/false/null), then a Python literal (tuples, single quotes, True/None). Raises ValueError."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(f"not JSON and not a Python literal: {text!r}") from None


def _scalar(name: str, value: Any, kind: str, also: tuple = ()) -> Any:
    """One int / float / bool / str value, from a value of that kind or from its text."""
    if isinstance(value, str) and value in also:
        return value
    if kind == "str":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # papermill's -p turns a name like "2026" into a number
        raise ParameterError(f"{name}: {value!r} is not a string")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.strip().lower() in ("true", "1", "yes")
        raise ParameterError(f"{name}: {value!r} is not a bool (give True or False)")
    # numbers
    text = value
    if isinstance(value, str):
        try:
            value = _literal(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        extra = f" or one of {list(also)}" if also else ""
        raise ParameterError(f"{name}: {text!r} is not a{'n int' if kind == 'int' else ' number'}{extra}")
    if kind == "int":
        if isinstance(value, float) and not (math.isfinite(value) and value == int(value)):
            raise ParameterError(f"{name}: {text!r} is not a whole number")
        return int(value)
    if not math.isfinite(float(value)):
        raise ParameterError(f"{name}: {text!r} is not a finite number")
    return float(value)


def parse_value(name: str, value: Any, spec: Param) -> Any:
    """`value` as the kind `spec` declares (see the module docstring for how strings are read). Raises ParameterError
    naming `name`; checks no range (see `check_value`)."""
    if value is None or (isinstance(value, str) and value.strip() in ("None", "null")
                         and (spec.kind != "str" or spec.optional)):
        if spec.optional:
            return None
        raise ParameterError(f"{name}: None is not accepted; expected a {_kind_text(spec)}")
    if spec.kind == "dict":
        if isinstance(value, str):
            try:
                value = _literal(value.strip())
            except ValueError:
                raise ParameterError(f"{name}: cannot read {value!r} as a mapping (give JSON, e.g. "
                                     "'{\"hidden_size\": 64}')") from None
        if not isinstance(value, Mapping):
            raise ParameterError(f"{name}: {value!r} is not a mapping")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ParameterError(f"{name}: keys must be strings; got {bad!r}")
        return dict(value)
    if spec.kind != "list":
        return _scalar(name, value, spec.kind, spec.also)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "(")):
            try:
                value = _literal(text)
            except ValueError:
                raise ParameterError(f"{name}: cannot read {text!r} as a list (give JSON, e.g. '[1, 2]')") from None
            if not isinstance(value, (list, tuple)):
                raise ParameterError(f"{name}: {text!r} is not a list")
        elif spec.split_commas:  # "2048, 4096" or a lone "folded"; each item is read as its kind below
            value = [v.strip() for v in text.split(",") if v.strip()]
        else:  # free text (a prompt may hold commas): the whole string is one item
            value = [value]
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
        items = [value]  # papermill's -p gives a lone number as a number
    else:
        raise ParameterError(f"{name}: {value!r} is not a list of {spec.item}")
    return [_scalar(f"{name}[{i}]", v, spec.item) for i, v in enumerate(items)]


def _kind_text(spec: Param) -> str:
    return f"list of {spec.item}" if spec.kind == "list" else spec.kind


def _resolve_path(path: str) -> str | None:
    """The path as given (relative to the working directory) or relative to the repository root; None if neither."""
    from ..provenance import checkout_root

    for p in (path, os.path.join(checkout_root(), path)):
        if os.path.exists(p):
            return p
    return None


def check_value(name: str, value: Any, spec: Param, geom: AttentionGeometry) -> None:
    """Refuse a parsed value out of its range: choices, bounds, token counts past `geom.max_position`, missing paths."""
    if value is None:
        return
    if spec.kind == "list":
        if spec.nonempty and not value:
            raise ParameterError(f"{name}: the list is empty")
        values = value
    else:
        values = [value]
    choices = spec.choice_values()
    for v in values:
        if isinstance(v, str) and v in spec.also:
            continue
        if choices is not None and v not in choices:
            raise ParameterError(f"{name}: unknown value {v!r}; expected {'some' if spec.kind == 'list' else 'one'}"
                                 f" of {list(choices)}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if spec.positive and v <= 0:
                raise ParameterError(f"{name}: {v} is not positive")
            if spec.at_least is not None and v < spec.at_least:
                raise ParameterError(f"{name}: {v} is below {spec.at_least:g}")
            if spec.tokens and v > geom.max_position:
                raise ParameterError(f"{name}: {v} is past the model's max_position {geom.max_position} ({geom.name})")
        if spec.exists and isinstance(v, str) and v:
            found = _resolve_path(v)
            ok = found is not None and (spec.exists == "any" or (os.path.isdir(found) if spec.exists == "dir"
                                                                  else os.path.isfile(found)))
            if not ok:
                raise ParameterError(f"{name}: {v!r} is not an existing {'directory' if spec.exists == 'dir' else 'file'}"
                                     if spec.exists != "any" else f"{name}: {v!r} does not exist")


# ----------------------------------------------------------------------------------------------------------------
# Every notebook's parameters
# ----------------------------------------------------------------------------------------------------------------
def _format_names() -> tuple:
    return tuple(f.value for f in KvFormat)


def _bench_decode_arms() -> tuple:
    from .bench import DECODE_ARMS

    return tuple(DECODE_ARMS)


def _bench_prefill_arms() -> tuple:
    from .bench import PREFILL_ARMS

    return tuple(PREFILL_ARMS)


def _serving_cases() -> tuple:
    from .bench import SERVING_CASES

    return SERVING_CASES


def _drawn_shapes() -> tuple:
    from .bench.drawn import DRAWN_SHAPES

    return DRAWN_SHAPES


def _drift_arms() -> tuple:
    from .model import MODEL_ARMS

    return tuple(a for a in MODEL_ARMS if a != "incumbent")  # the incumbent always runs


def _incumbent_implementations() -> tuple:
    from .model import INCUMBENT_IMPLEMENTATIONS

    return INCUMBENT_IMPLEMENTATIONS


def _model_arms() -> tuple:
    from .model_decode import MODEL_ARMS

    return tuple(MODEL_ARMS)


_DTYPES = ("float32", "float64", "bfloat16", "float16")


def _tp_arms() -> tuple:
    from .tp_model_decode import ARMS

    return ARMS


TOKENS = Param("list", "int", positive=True, tokens=True, nonempty=True)
OUT_DIR = Param("str")

SPECS: dict[str, dict[str, Param]] = {
    "01_byte_floor": {
        "geometry": Param("str"),
        "context_lengths": TOKENS,
        "sweep": TOKENS,
        "batch": Param("int", positive=True),
        "bandwidth_gbps": Param("float", also=("measure",), positive=True),
        "memory_budget_gib": Param("float", positive=True),
        "page_size": Param("int", positive=True),
        "out_dir": OUT_DIR,
    },
    "02_correctness_gates": {
        "formats": Param("list", "str", choices=_format_names, nonempty=True),
        "case_set": Param("str", choices=("full", "smoke")),
        "seed": Param("int", at_least=0),
        "backends": Param("list", "str", choices=("jit", "aot"), nonempty=True),
        "aot_dir": Param("str", optional=True, exists="dir"),
        "run_sanitizer": Param("bool"),
        "sanitizer_timeout_s": Param("float", positive=True),
        "out_dir": OUT_DIR,
    },
    "03_drift_study": {
        "model_path": Param("str", optional=True, exists="dir"),
        "prompts": Param("list", "str", split_commas=False, nonempty=True),
        "lengths": Param("list", "int", optional=True, positive=True, tokens=True, nonempty=True),
        "sweep_lengths": Param("list", "int", optional=True, positive=True, tokens=True),
        "sweep_prompt": Param("int", at_least=0),
        "steps": Param("int", positive=True),
        "arms": Param("list", "str", choices=_drift_arms),
        "device": Param("str"),
        "dtype": Param("str", choices=("auto",) + _DTYPES),
        "ref_pool_dtype": Param("str", choices=("model",) + _DTYPES),
        "kernel_backend": Param("str", choices=("jit", "aot")),
        "attn_implementation": Param("str", choices=_incumbent_implementations),
        "poison": Param("bool"),
        "synthetic_config": Param("dict"),
        "seed": Param("int", at_least=0),
        "out_dir": OUT_DIR,
    },
    "04_benchmarks": {
        "mode": Param("str", choices=("auto", "gpu", "redraw", "cpu")),
        "smoke": Param("bool"),
        "out_dir": OUT_DIR,
        "results_glob": Param("str"),
        "redraw_from": Param("str", exists="file"),
        "single_lengths": TOKENS,
        "sweep_lengths": TOKENS,
        "batch_cases": Param("list", "str", choices=_serving_cases, nonempty=True),
        "drawn_shapes": Param("list", "str", choices=_drawn_shapes),
        "drawn_singles": Param("int", at_least=0),
        "draw_seed": Param("int", at_least=-1),
        "decode_arms": Param("list", "str", choices=_bench_decode_arms, nonempty=True),
        "prefill_arms": Param("list", "str", choices=_bench_prefill_arms),
        "prefill_chunk": Param("int", positive=True),
        "prefill_contexts": Param("list", "int", positive=True, tokens=True),
        "rounds": Param("int", positive=True),
        "prefill_rounds": Param("int", positive=True),
        "warmup": Param("int", at_least=0),
        "target_sample_us": Param("float", positive=True),
        "rotate_bytes": Param("int", at_least=0),
        "read_roof_bytes": Param("int", positive=True),
        "seed": Param("int", at_least=0),
        "sections": Param("list", "str", choices=("single", "sweep", "batch", "drawn", "hosttime", "prefill")),
        "host_time_batches": Param("list", "int", positive=True, nonempty=True),
        "resume_from": Param("str", exists="file"),
        "aot_dir": Param("str", exists="dir"),
    },
    "05_generate": {
        "geometry": Param("str"),
        "contexts": TOKENS,
        "bytes_batch": Param("int", positive=True),
        "page_size": Param("int", positive=True),
        "arms": Param("list", "str", choices=_model_arms, nonempty=True),
        "decode_contexts": TOKENS,
        "decode_batches": Param("list", "int", positive=True, nonempty=True),
        "agreement_prompts": TOKENS,
        "new_tokens": Param("int", at_least=4),
        "prefill_chunk": Param("int", positive=True),
        "largest_context": Param("int", positive=True, tokens=True),
        "prefill_tail_contexts": TOKENS,
        "prefill_tail_batch": Param("int", positive=True),
        "prefill_tail_chunk": Param("int", positive=True),
        "prefill_tail_arms": Param("list", "str", choices=_model_arms, nonempty=True),
        "compile_prompt": Param("int", at_least=0),
        "seed": Param("int", at_least=0),
        "out_dir": OUT_DIR,
    },
    "06_tensor_parallel": {
        "ranks": Param("int", at_least=2),
        "capacity_context": Param("int", positive=True, tokens=True),
        "card_gib": Param("float", positive=True),
        "margin_gib": Param("float", at_least=0),
        "arms": Param("list", "str", choices=_tp_arms, nonempty=True),
        "decode_contexts": TOKENS,
        "decode_batches": Param("list", "int", positive=True, nonempty=True),
        "new_tokens": Param("int", at_least=4),
        "prompt_tokens": Param("int", positive=True, tokens=True),
        "largest_context": Param("int", at_least=0, tokens=True),
        "checkpoint_dir": Param("str"),
        "step_timeout_s": Param("int", positive=True),
        "seed": Param("int", at_least=0),
        "out_dir": OUT_DIR,
    },
    "07_time_to_first_token": {
        "ttft_cells": Param("list", "str", nonempty=True),
        "ttft_arms": Param("list", "str", choices=_model_arms, nonempty=True),
        "ttft_rounds": Param("int", positive=True),
        "first_use_lengths": Param("list", "int", positive=True, tokens=True),
        "first_use_arms": Param("list", "str", choices=_model_arms, nonempty=True),
        "e2e_prompt": Param("int", at_least=0, tokens=True),
        "e2e_new_tokens": Param("int", at_least=2),
        "e2e_arms": Param("list", "str", choices=_model_arms, nonempty=True),
        "prefill_memory_context": Param("int", at_least=0, tokens=True),
        "prefill_memory_batches": Param("list", "int", positive=True, nonempty=True),
        "prefill_chunk": Param("int", positive=True),
        "seed": Param("int", at_least=0),
        "out_dir": OUT_DIR,
    },
}


def _geometry_01(values: dict) -> AttentionGeometry:
    try:
        return resolve_geometry(values["geometry"])
    except ConfigError as exc:  # its message names the presets and says a config.json path is accepted
        raise ParameterError(f"geometry: {exc}") from None


def _geometry_03(values: dict) -> AttentionGeometry:
    """The served model's geometry: the checkpoint's config.json, or the synthetic checkpoint's config (which also
    refuses an unknown `synthetic_config` key here, before a checkpoint is written)."""
    if values["model_path"] is not None:
        try:
            return geometry_from_config(values["model_path"])
        except ConfigError as exc:
            raise ParameterError(f"model_path: {exc}") from None
    return _synthetic_geometry(values["synthetic_config"])


def _synthetic_geometry(synthetic_overrides: dict) -> AttentionGeometry:
    """The synthetic checkpoint's geometry with `synthetic_overrides`; an unknown key or a bad value is refused here,
    before a checkpoint is written."""
    from .synthetic import make_synthetic_checkpoint, synthetic_config

    overrides = dict(synthetic_overrides)
    checkpoint_keys = [k for k in inspect.signature(make_synthetic_checkpoint).parameters
                       if k not in ("out_dir", "seed", "config_overrides")]
    config_keys = list(inspect.signature(synthetic_config).parameters)
    unknown = sorted(set(overrides) - set(checkpoint_keys) - set(config_keys))
    if unknown:
        raise ParameterError(f"synthetic_config: unknown key(s) {unknown}; expected some of {config_keys + checkpoint_keys}")
    try:
        cfg = synthetic_config(**{k: v for k, v in overrides.items() if k in config_keys})
        return geometry_from_config(cfg, name="synthetic")
    except (ConfigError, ValueError, TypeError) as exc:
        raise ParameterError(f"synthetic_config: {exc}") from None


def _cross_03(values: dict, geom: AttentionGeometry) -> None:
    # a cell's walk holds its prompt and then one token per decode step
    for name in ("lengths", "sweep_lengths"):
        for n in values[name] or ():
            if n + values["steps"] > geom.max_position:
                raise ParameterError(f"{name}: {n} + steps {values['steps']} is past the model's max_position"
                                     f" {geom.max_position} ({geom.name})")
    if values["sweep_prompt"] >= len(values["prompts"]):
        raise ParameterError(f"sweep_prompt: {values['sweep_prompt']} is not an index of the {len(values['prompts'])}"
                             " prompts")
    try:
        torch.device(values["device"]) if values["device"] != "auto" else None
    except (RuntimeError, ValueError) as exc:
        raise ParameterError(f"device: {values['device']!r} is not a device ('auto', 'cpu', 'cuda', 'cuda:0'): {exc}") from None


def _cross_06(values: dict, geom: AttentionGeometry) -> None:
    try:
        geom.per_rank(values["ranks"])
    except ConfigError as exc:  # says why: whole KV heads a rank
        raise ParameterError(f"ranks: {exc}") from None


def _cross_07(values: dict, geom: AttentionGeometry) -> None:
    """ttft_cells read as PROMPT:BATCH[:ROUNDS] within the model's positions; first_use_lengths new to the notebook's
    process: distinct, and none a prompt length the sections before it prefill (each arm's warm-up, ttft_cells,
    e2e_prompt)."""
    import argparse

    from .ttft import WARMUP_CELL, parse_cells

    try:
        cells, _ = parse_cells(values["ttft_cells"], values["ttft_rounds"])
    except argparse.ArgumentTypeError as exc:
        raise ParameterError(f"ttft_cells: {exc} (here PROMPT:BATCH or PROMPT:BATCH:ROUNDS)") from None
    prompts = [prompt for prompt, _ in cells]
    for text, prompt in zip(values["ttft_cells"], prompts):
        if prompt > geom.max_position:
            raise ParameterError(f"ttft_cells: {text!r}: {prompt} is past the model's max_position {geom.max_position}"
                                 f" ({geom.name})")
    lengths = values["first_use_lengths"]
    run_before = {WARMUP_CELL[0]} | set(prompts) | {values["e2e_prompt"]}
    repeated = sorted({n for n in lengths if lengths.count(n) > 1} | (set(lengths) & run_before))
    if repeated:
        raise ParameterError(f"first_use_lengths: {repeated} not new to the process (repeated, or a prompt length of"
                             f" the arms' warm-up ({WARMUP_CELL[0]}), ttft_cells or e2e_prompt)")


GEOMETRY: dict[str, Callable[[dict], AttentionGeometry]] = {"01_byte_floor": _geometry_01, "03_drift_study": _geometry_03,
                                                             "05_generate": _geometry_01}
CROSS_CHECKS: dict[str, Callable[[dict, AttentionGeometry], None]] = {"03_drift_study": _cross_03,
                                                                      "06_tensor_parallel": _cross_06,
                                                                      "07_time_to_first_token": _cross_07}


def read_parameters(notebook: str, namespace: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of `notebook` (a key of SPECS) read from `namespace` (the notebook's globals after papermill's
    injected cell) into its declared kind and range-checked; returns {name: value}. Raises ParameterError."""
    if notebook not in SPECS:
        raise ParameterError(f"no parameter specs for notebook {notebook!r}; known: {sorted(SPECS)}")
    specs = SPECS[notebook]
    missing = [n for n in specs if n not in namespace]
    if missing:
        raise ParameterError(f"{notebook}: parameters {missing} are not defined (is the parameters cell run?)")
    values = {name: parse_value(name, namespace[name], spec) for name, spec in specs.items()}
    geom = GEOMETRY.get(notebook, lambda v: GEMMA4_31B)(values)
    for name, spec in specs.items():
        check_value(name, values[name], spec, geom)
    if notebook in CROSS_CHECKS:
        CROSS_CHECKS[notebook](values, geom)
    return values
