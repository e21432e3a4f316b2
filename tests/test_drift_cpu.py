"""The drift study's machinery on the CPU: the synthetic checkpoint through from_pretrained, the foldkv reference arms
(the model on attn_implementation "foldkv" with a FoldKvCache) against the model's own attention (and broken arms
caught), and the notebook run headless.

The model is the synthetic Gemma 4 shrunk further (hidden 64, vocab 128) but with the 31B global geometry (32 x 512
query heads, 4 KV heads, k_eq_v, proportional RoPE 0.25), so every global-layer shape is the real one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY_SYNTHETIC, require_module
from foldkv.pool import BlockTable

import foldkv
import foldkv.reference
from foldkv.layout import KvFormat, score_window

TINY = TINY_SYNTHETIC  # conftest: the `checkpoint` fixture is this model
# A float32 model against float32 pools: the only differences left are float32 reordering (the reference attention
# is float64): measured <= 1.7e-5 on logits of magnitude ~12 (lengths 1, 70, 200), the incumbent's own walk vs single
# pass <= 1.6e-5. 2e-4 leaves ~12x room; every broken arm below moves the logits by > 0.1 (measured 1 to 10).
FLOAT32_TOL = 2e-4
NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "03_drift_study.ipynb")


def _sha(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


@pytest.fixture(scope="module")
def model32(checkpoint):
    from foldkv.lab.model import load_model

    return load_model(checkpoint, dtype=torch.float32)


@pytest.fixture
def settings():
    from foldkv.lab.model import ArmSettings

    return ArmSettings(ref_pool_dtype=torch.float32, scatter_seed=11)


def _prompt(n: int, vocab: int = TINY["vocab_size"], seed: int = 5) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# --- the synthetic checkpoint ---------------------------------------------------------------------------------------

def test_synthetic_checkpoint_round_trip(checkpoint, model32, tmp_path):
    from safetensors.torch import load_file

    from foldkv.hf import global_layer_indices, text_model_of
    from foldkv.lab.synthetic import describe_checkpoint, make_synthetic_checkpoint

    assert sorted(os.listdir(checkpoint)) == ["config.json", "model.safetensors"]
    geom = foldkv.geometry_from_config(checkpoint)  # the config as written on disk, read the way foldkv reads a real one
    assert (geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.partial_rotary_factor, geom.rotary_width) == \
        (32, 4, 512, 0.25, 128)
    assert describe_checkpoint(checkpoint)["kind"] == "synthetic"

    # every stored tensor arrives unchanged through from_pretrained (bf16 on disk -> float32 exactly)
    stored = load_file(os.path.join(checkpoint, "model.safetensors"))
    state = model32.state_dict()
    assert set(stored) <= set(state)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor.float()), name

    text = text_model_of(model32)
    glob = global_layer_indices(text)
    assert glob == [1, 3]
    for i in glob:
        attn = text.layers[i].self_attn
        assert attn.head_dim == 512 and attn.q_proj.out_features == 32 * 512 and attn.k_proj.out_features == 4 * 512
        assert attn.v_proj is None  # k_eq_v
        w_k = attn.k_norm.weight.detach()
        assert float(w_k.std()) > 0.2 and float((w_k - 1).abs().min()) < float((w_k - 1).abs().max())
    # deterministic from the seed; another seed gives other weights
    same = make_synthetic_checkpoint(tmp_path / "same", seed=3, **TINY)
    other = make_synthetic_checkpoint(tmp_path / "other", seed=4, **TINY)
    assert _sha(os.path.join(same, "model.safetensors")) == _sha(os.path.join(checkpoint, "model.safetensors"))
    assert _sha(os.path.join(other, "model.safetensors")) != _sha(os.path.join(checkpoint, "model.safetensors"))


def test_synthetic_logits_are_not_degenerate(model32):
    with torch.no_grad():
        logits = model32(input_ids=_prompt(48)[None]).logits[0].float()  # [48, V]
    assert 1.0 < float(logits.std()) < 20.0
    assert len(set(logits.argmax(-1).tolist())) > 10  # the argmax is not one token
    top = logits.topk(2, dim=-1).values
    margins = top[:, 0] - top[:, 1]
    assert float(margins.min()) < 0.5 < float(margins.max())  # close calls exist, so the argmax claim is tested


# --- the arms on one model ------------------------------------------------------------------------------------------

def test_incumbent_walk_is_transformers_generate(model32):
    """The greedy incumbent walk (forward over a DynamicCache, argmax fed back) is generate()'s greedy decoding: the
    same tokens and the same logits."""
    from foldkv.lab.model import walk

    prompt, steps = _prompt(20, seed=8), 8
    inc = walk(model32, "incumbent", prompt, steps)
    assert 1 not in inc.logits.argmax(-1).tolist()  # no EOS (id 1): generate() would stop there
    out = model32.generate(input_ids=prompt[None], max_new_tokens=steps + 1, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    assert out.sequences[0, prompt.numel():-1].tolist() == inc.fed.tolist()
    assert float((torch.stack(out.logits)[:, 0].float() - inc.logits).abs().max()) <= FLOAT32_TOL


def test_arm_switch_keeps_weights_and_incumbent_unchanged(model32, settings, monkeypatch):
    """A foldkv arm's walk switches the model to "foldkv" and back: the weights, the implementation and the
    incumbent's walk are the same after it, also after a walk that fails half-way (its red twin)."""
    import foldkv.hf
    from foldkv.lab.model import walk

    keys = list(model32.state_dict())
    prompt = _prompt(20)
    plain = walk(model32, "incumbent", prompt, 2)
    folded = walk(model32, "ref-folded", prompt, 2, feed=plain.fed, settings=settings)
    assert type(folded.cache).__name__ == "FoldKvCache" and folded.attention == "reference"
    assert model32.config._attn_implementation == "sdpa" and list(model32.state_dict()) == keys
    after = walk(model32, "incumbent", prompt, 2)
    assert torch.equal(after.logits, plain.logits) and torch.equal(after.fed, plain.fed)

    def failing(*args, **kwargs):
        raise RuntimeError("a launcher failed")

    monkeypatch.setattr(foldkv.hf, "paged_attention_reference", failing)
    with pytest.raises(RuntimeError, match="a launcher failed"):
        walk(model32, "ref-folded", prompt, 2, feed=plain.fed, settings=settings)
    assert model32.config._attn_implementation == "sdpa"
    assert torch.equal(walk(model32, "incumbent", prompt, 2).logits, plain.logits)


@pytest.mark.parametrize("arm", ["ref-split", "ref-folded"])
@pytest.mark.parametrize("length", [1, 70])  # one token; past a page (64) so the walk spans scattered pages
def test_reference_arms_reproduce_incumbent_logits(model32, settings, arm, length):
    from foldkv.lab.model import walk

    model = model32
    steps = 3
    prompt = _prompt(length)
    inc = walk(model, "incumbent", prompt, steps)
    got = walk(model, arm, prompt, steps, feed=inc.fed, settings=settings)
    assert got.logits.shape == inc.logits.shape == (steps + 1, TINY["vocab_size"])
    gap = (got.logits - inc.logits).abs().amax(-1)  # [steps + 1]
    assert bool(torch.isfinite(got.logits).all())
    assert float(gap.max()) < FLOAT32_TOL, gap.tolist()
    assert torch.equal(got.logits.argmax(-1), inc.logits.argmax(-1))
    # the pool holds exactly the walk's tokens: every row written is finite, every other slot still holds the poison
    assert len(got.cache.global_layers) == 2
    for layer in got.cache.global_layers:
        pool, table = layer.pool, layer.host_table
        assert int(table.seq_lens[0]) == length + steps == layer.lengths[0]
        assert pool.format is (KvFormat.SPLIT if arm == "ref-split" else KvFormat.FOLDED)
        written = torch.zeros(pool.data.shape[:3], dtype=torch.bool)  # [pages, heads, slots]
        for pos in range(length + steps):
            written[int(table.page_ids[0, pos // pool.layout.page_size]), :, pos % pool.layout.page_size] = True
        assert bool(torch.isfinite(pool.data[written]).all())
        assert bool(torch.isnan(pool.data[~written]).all())


def _fold_without_w_k(monkeypatch):
    import foldkv.prep

    orig = foldkv.prep.fold_query
    monkeypatch.setattr(foldkv.prep, "fold_query", lambda geom, fmt, q, w, dtype: orig(geom, fmt, q, torch.ones_like(w), dtype))


def _values_left_in_window_order(monkeypatch):
    monkeypatch.setattr(foldkv.reference, "value_window_to_head", lambda geom, fmt: torch.arange(geom.head_dim))


def _values_read_from_key_window(monkeypatch):
    monkeypatch.setattr(foldkv.reference, "value_window", score_window)


@pytest.mark.parametrize("arm,breakage", [
    ("ref-folded", _fold_without_w_k),
    ("ref-folded", _values_left_in_window_order),
    ("ref-split", _values_read_from_key_window),
], ids=["fold-without-w_k", "value-window-order", "split-values-from-keys"])
def test_broken_arm_is_caught(model32, settings, monkeypatch, arm, breakage):
    """The comparison the study makes flags a wrong fold or a wrong column map by orders of magnitude."""
    from foldkv.lab.model import walk

    prompt = _prompt(40)
    inc = walk(model32, "incumbent", prompt, 2)
    breakage(monkeypatch)
    got = walk(model32, arm, prompt, 2, feed=inc.fed, settings=settings)
    gap = (got.logits - inc.logits).abs().amax(-1)
    assert float(gap.min()) > 100 * FLOAT32_TOL, gap.tolist()


def test_kernel_arms_refuse_cleanly_on_cpu(model32, settings):
    from foldkv.lab.arms import ArmUnavailable
    from foldkv.lab.model import walk

    for arm in ("split", "folded"):
        with pytest.raises(ArmUnavailable, match="CUDA"):
            walk(model32, arm, _prompt(4), 1, settings=settings)
    assert model32.config._attn_implementation == "sdpa"


def test_refuses_an_incumbent_the_foldkv_arms_cannot_stand_beside(checkpoint):
    """The foldkv arms' sliding layers run sdpa or eager; another incumbent is refused before the model loads."""
    from foldkv.lab.drift import run_study
    from foldkv.lab.model import foldkv_implementation

    assert (foldkv_implementation("sdpa"), foldkv_implementation("eager")) == ("foldkv", "foldkv_eager")
    with pytest.raises(ValueError, match="flash_attention_2"):
        run_study(model_path=checkpoint, prompts=["ab"], lengths=[4], steps=1, arms=["ref-folded"], device="cpu",
                  attn_implementation="flash_attention_2", log=lambda *_: None)


# --- the study's bookkeeping ----------------------------------------------------------------------------------------

def test_prompt_token_ids_are_deterministic_and_exact():
    from foldkv.lab.drift import prompt_token_ids

    a = prompt_token_ids("hello", 97, 128)
    assert a.shape == (97,) and a.dtype == torch.long and torch.equal(a, prompt_token_ids("hello", 97, 128))
    assert a[:5].tolist() == [3 + b % 125 for b in b"hello"]
    assert int(a.min()) >= 3 and int(a.max()) < 128
    assert not torch.equal(a, prompt_token_ids("world", 97, 128))


def test_summary_and_drift_line_from_data():
    from foldkv.lab.drift import drift_line, summarize

    cells = [
        {"margin": [1.0, 0.05, 2.0], "neutral": [0.0, 0.01, 0.02],
         "arms": {"ref-folded": {"status": "ran", "gap": [0.03, 0.04, 0.0], "argmax_equal": [True, False, True]}},
         "pairs": {}},
        {"margin": [3.0, 3.0, 3.0], "neutral": [0.0, 0.0, 0.03],
         "arms": {"ref-folded": {"status": "ran", "gap": [0.3, 0.01, 0.02], "argmax_equal": [True, True, True]}},
         "pairs": {}},
    ]
    results = {"parameters": {"arms": ["folded", "ref-folded"]}, "cells": cells,
               "arm_status": {"folded": "not run: no GPU", "ref-folded": "ran"}}
    summary = summarize(results)
    assert summary["folded"] == {"status": "not run: no GPU"}
    rf = summary["ref-folded"]
    assert (rf["argmax_equal"], rf["argmax_of"]) == (5, 6) and rf["gap"]["max"] == 0.3
    assert summary["neutral"]["gap"]["max"] == 0.03
    line = drift_line(results)
    assert line["value"] == 1.0  # 1-2-5 ceiling of 2 x 0.3
    assert line["value"] >= max(g for c in cells for g in c["arms"]["ref-folded"]["gap"])
    assert [(f["cell"], f["step"], f["explained"]) for f in line["flips"]] == [(0, 1, True)]


# --- the checks: each can fail ---------------------------------------------------------------------------------------

def _study(gaps: dict[str, list[list]], neutral: list[list], *, arm_eq=None, neutral_eq=None, pairs=None,
           dtype="float32") -> dict:
    """A results dict as run_study makes it: `gaps[arm][cell]` per step, the neutral per cell and step."""
    cells = []
    for i, nv in enumerate(neutral):
        n = len(nv)
        cells.append({"group": "grid", "prompt_index": 0, "length": 50 + i, "steps": n - 1, "margin": [1.0] * n,
                      "neutral": nv, "neutral_argmax_equal": (neutral_eq or {}).get(i, [True] * n),
                      "incumbent_nonfinite_steps": [], "logit_absmax": 12.0,
                      "arms": {a: {"status": "ran", "gap": g[i], "nonfinite_steps": [],
                                   "argmax_equal": (arm_eq or {}).get((a, i), [True] * n)} for a, g in gaps.items()},
                      "pairs": (pairs or {}).get(i, {})})
    return {"parameters": {"arms": list(gaps), "dtype": dtype}, "cells": cells,
            "arm_status": {a: "ran" for a in gaps}}


NEUTRAL = [[0.0, 1e-5, 2e-5, 1e-5], [1e-5, 2e-5, 1e-5, 3e-5]]
GOOD = [[1e-5, 2e-5, 1e-5, 3e-5], [2e-5, 1e-5, 4e-5, 2e-5]]


def test_finite_max_keeps_a_nan_at_any_step():
    from foldkv.lab.drift import finite_max

    assert max([0.1, float("nan"), 0.2]) == 0.2  # why finite_max exists: max() drops a NaN that is not first
    assert math.isnan(finite_max([0.1, float("nan"), 0.2])) and math.isnan(finite_max([0.1, None]))
    assert finite_max([0.1, float("inf")]) == float("inf") and finite_max([0.1, 0.3]) == 0.3


def test_checks_pass_a_clean_study():
    from foldkv.lab.drift import check_study

    checks = check_study(_study({"folded": GOOD}, NEUTRAL))
    assert checks["passed"] and checks["sections"]["folded"]["passed"] is True, checks
    assert checks["sections"]["folded"]["argmax"]["p"] == 1.0


def _poison_arm_gap(r, v):
    r["cells"][1]["arms"]["folded"]["gap"][2] = v


@pytest.mark.parametrize("where,poison,section,named", [
    ("arm gap NaN at a late step", lambda r: _poison_arm_gap(r, float("nan")), "folded", "cell 1 (grid, prompt 0, length 51), steps [2]"),
    ("arm gap None (a NaN read back from JSON)", lambda r: _poison_arm_gap(r, None), "folded", "cell 1"),
    ("arm gap Inf", lambda r: _poison_arm_gap(r, float("inf")), "folded", "steps [2]"),
    ("arm logit Inf (the gap finite)", lambda r: r["cells"][0]["arms"]["folded"]["nonfinite_steps"].append(3),
     "folded", "cell 0 (grid, prompt 0, length 50), steps [3]"),
    ("pair gap NaN", lambda r: r["cells"][0]["pairs"].update({"folded vs split": {"gap": [0.0, float("nan"), 0, 0]}}),
     "folded", "steps [1]"),
    ("incumbent neutral NaN", lambda r: r["cells"][1]["neutral"].__setitem__(3, float("nan")), "incumbent", "steps [3]"),
    ("incumbent margin NaN", lambda r: r["cells"][0]["margin"].__setitem__(1, float("nan")), "incumbent", "steps [1]"),
    ("incumbent logits Inf", lambda r: r["cells"][0]["incumbent_nonfinite_steps"].append(0), "incumbent", "steps [0]"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_nan_or_inf_anywhere_fails_its_section(where, poison, section, named):
    from foldkv.lab.drift import check_study

    results = _study({"folded": [list(g) for g in GOOD], "ref-folded": [list(g) for g in GOOD]},
                     [list(n) for n in NEUTRAL])
    poison(results)
    checks = check_study(results)
    sec = checks["sections"][section]
    assert sec["passed"] is False and not checks["passed"], (where, checks)
    assert any("NaN/Inf" in f and named in f for f in sec["failures"]), (where, sec["failures"])
    assert checks["sections"]["ref-folded"]["passed"] is True  # the clean arm is not blamed


@pytest.mark.parametrize("q,step", [("p50", None), ("max", (1, 3))])
def test_gap_check_fails_an_arm_past_two_neutrals(q, step):
    from foldkv.lab.drift import GAP_FACTOR, check_study, dtype_ulp

    slack = dtype_ulp("float32", 12.0)
    nmax = max(max(n) for n in NEUTRAL)
    if q == "max":  # exactly at the limit passes; one step past it fails
        at = [list(g) for g in GOOD]
        at[step[0]][step[1]] = GAP_FACTOR * nmax + slack
        assert check_study(_study({"folded": at}, NEUTRAL))["sections"]["folded"]["passed"]
        at[step[0]][step[1]] = GAP_FACTOR * nmax + 2 * slack + 1e-7
        broken = at
    else:  # every step 3x its neutral neighbourhood: the median moves
        broken = [[3 * 2e-5 + g for g in c] for c in GOOD]
    checks = check_study(_study({"folded": broken}, NEUTRAL))
    sec = checks["sections"]["folded"]
    assert sec["passed"] is False and any(f.startswith(f"gap {q}") for f in sec["failures"]), sec
    # the same numbers on an arm that is not gated are reported, not failed
    loose = check_study(_study({"ref-folded": broken}, NEUTRAL))["sections"]["ref-folded"]
    assert loose["passed"] is True and loose["not_gated_over"]


def test_argmax_check_fails_an_arm_that_flips_more_than_the_single_pass():
    from foldkv.lab.drift import check_study

    flips = {("folded", 0): [False, False, False, True], ("folded", 1): [True, True, True, True]}
    neutral_flips = {0: [True, True, False, True]}
    # 2 arm-only flips against 1 single-pass-only: chance
    assert check_study(_study({"folded": GOOD}, NEUTRAL, arm_eq=flips, neutral_eq=neutral_flips))["passed"]
    # 16 steps flipped by the arm alone, none by the single pass alone: P = 2^-16; the gaps themselves are small
    many = {("folded", i): [False] * 4 for i in range(4)}
    res = _study({"folded": [[1e-5] * 4] * 4}, [[2e-5] * 4] * 4, arm_eq=many)
    sec = check_study(res)["sections"]["folded"]
    assert sec["passed"] is False and sec["argmax"]["arm_only_flips"] == 16, sec
    assert any(f.startswith("argmax") for f in sec["failures"])


@pytest.mark.parametrize("run", ["h200-20261129-s2", "h200-20261201-s7"])
def test_committed_h200_study_passes_the_checks(run):
    """The committed H200 studies pass the checks as the code reads them now; s7 has the FP8 kernel arm, reported
    (its section passes, not gated) beside the gated bf16 kernel arms."""
    from foldkv.lab.drift import check_study, gated_arms

    path = os.path.join(os.path.dirname(__file__), os.pardir, "papermill_runs", run, "drift_results.json")
    with open(path) as fh:
        results = json.load(fh)
    checks = check_study(results)
    assert checks["passed"], checks
    for arm in gated_arms():
        assert checks["sections"][arm]["passed"] is True and checks["sections"][arm]["gated"]
    if "folded-fp8" in checks["sections"]:
        fp8 = checks["sections"]["folded-fp8"]
        assert fp8["passed"] is True and fp8["gated"] is False and fp8["not_gated_over"], fp8


def test_record_sections_fail_the_notebook_on_a_failed_check(tmp_path):
    from foldkv.lab.drift import check_study, record_sections
    from foldkv.lab.report import RunRecord

    results = _study({"folded": [list(g) for g in GOOD], "split": [list(g) for g in GOOD]}, NEUTRAL)
    results["parameters"]["arms"].append("ref-split")
    results["arm_status"]["ref-split"] = "not run: no GPU"
    results["checks"] = check_study(results)
    clean = record_sections(RunRecord("03_drift_study", tmp_path), results)
    assert clean == {"incumbent": "ran", "arm:folded": "ran", "arm:split": "ran", "arm:ref-split": "not run: no GPU"}
    _poison_arm_gap(results, float("nan"))
    results["checks"] = check_study(results)
    broken = record_sections(RunRecord("03_drift_study", tmp_path), results)
    assert broken["arm:folded"].startswith("failed: NaN/Inf logits: cell 1") and broken["arm:split"] == "ran"


def _is_decode(q_lens) -> bool:
    return q_lens is not None and int(q_lens.max()) == 1


def _decode_dropping_newest_key(monkeypatch):
    import foldkv.hf
    from foldkv.pool import BlockTable

    orig = foldkv.hf.paged_attention_reference

    def dropping(pool, query, table, q_lens=None, **kw):
        if _is_decode(q_lens):  # a decode: every key but the one just stored
            table, q_lens = BlockTable(table.page_ids, table.seq_lens - 1), None
        return orig(pool, query, table, q_lens, **kw)

    monkeypatch.setattr(foldkv.hf, "paged_attention_reference", dropping)


def _decode_nan_at_step_2(monkeypatch):
    import foldkv.hf

    orig = foldkv.hf.paged_attention_reference

    def nan_at(pool, query, table, q_lens=None, **kw):
        out, lse = orig(pool, query, table, q_lens, **kw)
        if _is_decode(q_lens) and int(table.seq_lens[0]) == STUDY_LENGTH + 2:  # the decode of step 2
            out = out.clone()
            out[0, 5, 7] = float("nan")
        return out, lse

    monkeypatch.setattr(foldkv.hf, "paged_attention_reference", nan_at)


STUDY_LENGTH = 40


@pytest.mark.parametrize("breakage", [None, _decode_dropping_newest_key, _decode_nan_at_step_2],
                         ids=["reference", "drops-newest-key", "nan-at-step-2"])
def test_study_checks_catch_a_broken_decode(checkpoint, monkeypatch, breakage):
    """The red twin on the model: float32 model and pools, the reference decode as the gated arm. As is it passes;
    with its newest key dropped it fails the gap check; with a NaN in one decode step's output it fails the finite
    check at that step."""
    from foldkv.lab.drift import run_study

    if breakage is not None:
        breakage(monkeypatch)
    res = run_study(model_path=checkpoint, prompts=["ab", "the cat"], lengths=[STUDY_LENGTH], sweep_lengths=[],
                    steps=3, arms=["ref-folded"], device="cpu", dtype="float32", seed=3, log=lambda *_: None)
    from foldkv.lab.drift import check_study

    sec = check_study(res, gated=["ref-folded"])["sections"]["ref-folded"]
    if breakage is None:
        assert sec["passed"] is True, sec
    elif breakage is _decode_dropping_newest_key:
        assert sec["passed"] is False and any(f.startswith("gap") for f in sec["failures"]), sec
        assert not any("NaN" in f for f in sec["failures"])
    else:
        assert sec["passed"] is False, sec
        assert any(f"length {STUDY_LENGTH}), steps [2" in f for f in sec["failures"]), sec["failures"]


# --- the notebook, headless -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_notebook_runs_headless(tmp_path):
    require_module("papermill")
    require_module("transformers")
    out_dir = tmp_path / "run"
    executed = tmp_path / "03_drift_study.ipynb"
    params = {"lengths": [5, 66], "sweep_lengths": [3], "steps": 2, "prompts": ["ab", "the cat"],
              "synthetic_config": TINY, "seed": 1, "out_dir": str(out_dir)}
    cmd = [sys.executable, "-m", "papermill", NOTEBOOK, str(executed), "--no-progress-bar", "-k", "python3"]
    for k, v in params.items():
        cmd += ["-y", json.dumps({k: v})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    with open(out_dir / "drift_results.json") as fh:
        res = json.load(fh)
    assert res["model"]["kind"] == "synthetic" and res["model"]["geometry"]["head_dim"] == 512
    assert len(res["cells"]) == 2 * 2 + 1
    for arm in ("split", "folded"):  # a CPU: the kernel arms say why they did not run
        assert res["arm_status"][arm].startswith("not run") and "CUDA" in res["arm_status"][arm]
    for arm in ("ref-split", "ref-folded"):
        assert res["arm_status"][arm] == "ran"
        assert res["summary"][arm]["argmax_of"] == len(res["cells"]) * 3
    for cell in res["cells"]:
        assert len(cell["neutral"]) == len(cell["margin"]) == len(cell["neutral_argmax_equal"]) == 3
        for arm in ("ref-split", "ref-folded"):
            gap = cell["arms"][arm]["gap"]
            assert len(gap) == 3 and all(g is not None and math.isfinite(g) for g in gap)
            assert cell["arms"][arm]["nonfinite_steps"] == []
        assert "ref-folded vs ref-split" in cell["pairs"]
    assert res["drift_line"]["reasoning"]
    assert res["checks"]["passed"], res["checks"]
    with open(out_dir / "03_drift_study.record.json") as fh:
        sections = json.load(fh)["sections"]
    assert sections["incumbent"] == sections["arm:ref-split"] == sections["arm:ref-folded"] == "ran", sections
    # a CPU: the kernel arms show the run of record's numbers (notebook 03's record in papermill_runs/README.md)
    assert sections["arm:folded"].startswith("redrawn from"), sections["arm:folded"]
    with open(executed) as fh:
        text = fh.read()
    assert "SYNTHETIC checkpoint" in text and "Arms that did not run here" in text and "Checks" in text


def test_kernel_arm_plumbing_with_stand_in_launchers(model32, settings, monkeypatch):
    """The kernel arms' path through the walk, on the CPU: the arm's FoldKvCache is a bf16 pool whose launchers are
    stand-ins that hold every call to the documented contract (bf16 pool and query, int32 tables, prefill q_lens,
    `backend=`) and answer with the float64 oracle rounded to bf16, as a kernel does (the decode through a stand-in of
    the cache's one DecodeWorkspace). The arm must then track the bf16-pool reference arm."""
    import foldkv.lab.model as fm

    calls = {"decode": 0, "prefill": 0}

    def check_common(pool, query, table, rows):
        assert pool.layout.dtype == torch.bfloat16 and query.dtype == torch.bfloat16
        assert query.shape == (rows, 32, 512)
        assert table.page_ids.dtype == torch.int32 and table.seq_lens.dtype == torch.int32

    def prefill_stand_in(pool, query, table, q_lens, *, backend):
        assert backend == "jit"
        assert q_lens.dtype == torch.int32 and q_lens.tolist() == [int(table.seq_lens[0])]
        check_common(pool, query, table, int(q_lens.sum()))
        calls["prefill"] += 1
        out, lse = foldkv.paged_attention_reference(pool, query, table, q_lens)
        return out.to(torch.bfloat16), lse.float()

    class WorkspaceStandIn:
        """DecodeWorkspace's part in an eager decode (`FoldKvCache.pool_attention`) on the CPU: the fold writes the
        query into `query`, `plan` takes the lengths and int32 page ids, `step` answers with the float64 oracle
        rounded to bf16, as the kernels do. Its lengths read as unknown after each step, so every layer plans anew
        (no `advance` to mirror)."""

        def __init__(self, n):
            self.max_batch, self.batch, self.lens = n, None, None
            self.query = torch.full((n, 32, 512), float("nan"), dtype=torch.bfloat16)

        @property
        def seq_lens(self):
            return self.lens

        def plan(self, lens, page_ids):
            self.batch, self.lens, self.page_ids = len(lens), tuple(lens), page_ids

        def step(self, pool, *, backend):
            assert backend == "jit"
            table = BlockTable(self.page_ids, torch.tensor(self.lens, dtype=torch.int32))
            query = self.query[:self.batch]
            check_common(pool, query, table, self.batch)
            calls["decode"] += 1
            self.lens = None
            out, lse = foldkv.paged_attention_reference(pool, query, table)
            return out.to(torch.bfloat16), lse.float()

    real_cache = fm.arm_cache

    def cache_on_stand_ins(model, arm, capacity, settings=None, batch=1):
        spec = fm.model_arm(arm)
        if spec.backend != "kernel":
            return real_cache(model, arm, capacity, settings, batch)
        # the reference arm's cache over a bf16 pool, routed as a CUDA cache routes (FoldKvCache refuses "kernel"
        # on the CPU)
        cache = real_cache(model, fm.MODEL_ARMS[f"ref-{spec.name}"], capacity,
                           fm.ArmSettings(ref_pool_dtype=torch.bfloat16, scatter_seed=settings.scatter_seed), batch)
        cache.attention, cache._kernels = "kernel", {"prefill": prefill_stand_in}
        workspaces = {}
        cache.decode_workspace = lambda n: workspaces.setdefault(n, WorkspaceStandIn(n))
        return cache

    monkeypatch.setattr(fm, "check_arm_available", lambda arm, device: None)
    monkeypatch.setattr(fm, "arm_cache", cache_on_stand_ins)
    prompt, steps = _prompt(70), 3
    inc = fm.walk(model32, "incumbent", prompt, steps)
    ker = fm.walk(model32, "folded", prompt, steps, feed=inc.fed, settings=settings)
    assert ker.attention == "kernel"
    n_global = len(ker.cache.global_layers)
    assert calls == {"decode": n_global * steps, "prefill": n_global}
    bf16 = fm.ArmSettings(ref_pool_dtype=torch.bfloat16, scatter_seed=settings.scatter_seed)
    ref = fm.walk(model32, "ref-folded", prompt, steps, feed=inc.fed, settings=bf16)
    # Same bf16 pool rows; the one difference is the attention output rounded to bf16 before o_proj. A wrong column
    # map moves it by > 1.
    gap = float((ker.logits - ref.logits).abs().max())
    assert gap < 0.1, gap
    assert bool(torch.isfinite(ker.logits).all())


@pytest.mark.parametrize("length", [1, 70])
def test_fp8_reference_arm_shows_the_format_drift(model32, settings, length):
    """The FP8 folded pool read dequantized by the float64 reference: finite logits, a gap to the bf16-free float32
    arm far above float32 reordering (e4m3's 3 fraction bits are visible) yet of the logits' own order at most, and
    its pool really is e4m3 with scales (the arm is not a bf16 pool under another name)."""
    from foldkv.fp8 import FP8_DTYPE
    from foldkv.lab.model import walk

    prompt = _prompt(length)
    ref = walk(model32, "ref-folded", prompt, 3, settings=settings)
    fp8 = walk(model32, "ref-folded-fp8", prompt, 3, feed=ref.fed, settings=settings)
    assert all(layer.pool.layout.dtype == FP8_DTYPE and layer.pool.scales is not None
               for layer in fp8.cache.global_layers)
    gap = (fp8.logits - ref.logits).abs().amax(-1)
    assert bool(torch.isfinite(fp8.logits).all())
    assert float(gap.max()) > 10 * FLOAT32_TOL, gap.tolist()
    assert float(gap.max()) < float(ref.logits.abs().max()), gap.tolist()


# --- the FP8 kernel arms: the tensor-core decode and "exact", each gated against the reference over its own pool ----

def test_fp8_kernel_arms_name_their_decode_partial():
    """`folded-fp8` is the FP8 pool's default decode, the tensor-core partial, named explicitly (a change of default
    does not change what the arm measures); `folded-fp8-exact` is the exact-conversion partial, a separate arm; both
    in notebook 03's default arms, each paired with the reference over the same FP8 pool."""
    from foldkv.lab import drift
    from foldkv.lab.model import MODEL_ARMS

    assert MODEL_ARMS["folded-fp8"].fp8_math == "tensor_cores"
    assert MODEL_ARMS["folded-fp8-exact"].fp8_math == "exact"
    assert all(spec.fp8_math is None for a, spec in MODEL_ARMS.items() if spec.pool_dtype is None)
    assert drift.gated_pairs() == (("folded-fp8", "ref-folded-fp8"), ("folded-fp8-exact", "ref-folded-fp8"))
    assert set(drift.gated_pairs()) <= set(drift.PAIRS) and ("folded-fp8", "folded-fp8-exact") in drift.PAIRS
    assert "folded-fp8" not in drift.gated_arms() and "folded-fp8-exact" not in drift.gated_arms()
    nb = json.load(open(os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "03_drift_study.ipynb")))
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    ns: dict = {}
    exec("".join(params["source"]), ns)
    assert {"folded-fp8", "folded-fp8-exact", "ref-folded-fp8"} <= set(ns["arms"])


@pytest.mark.parametrize("arm", ["folded-fp8", "folded-fp8-exact"])
def test_arm_cache_passes_the_arms_decode_partial(monkeypatch, arm):
    import foldkv.hf
    from foldkv.lab.model import MODEL_ARMS, arm_cache

    made = {}
    monkeypatch.setattr(foldkv.hf, "FoldKvCache", lambda model, **kw: made.update(kw) or "cache")
    assert arm_cache(object(), arm, 10) == "cache"
    assert made["fp8_math"] == MODEL_ARMS[arm].fp8_math and made["dtype"] == torch.float8_e4m3fn
    arm_cache(object(), "folded", 10)
    assert made["fp8_math"] is None  # a bf16 arm names none (FoldKvCache refuses "tensor_cores" on bf16)


def _fp8_study(pair_gaps: list[list], arm_gaps=GOOD, pair_eq=None, neutral=NEUTRAL) -> dict:
    """A study with the FP8 kernel arm, its reference, and the gated pair between them."""
    name = "folded-fp8 vs ref-folded-fp8"
    pairs = {i: {name: {"gap": list(g), "argmax_equal": (pair_eq or {}).get(i, [True] * len(g))}}
             for i, g in enumerate(pair_gaps)}
    return _study({"folded": [list(g) for g in arm_gaps], "folded-fp8": [list(g) for g in arm_gaps],
                   "ref-folded-fp8": [list(g) for g in arm_gaps]}, neutral, pairs=pairs)


def test_fp8_kernel_pair_is_judged_by_the_bf16_kernels_limits():
    """The pair's gap quantiles are held to exactly the limits the gated bf16 arm `folded` gets against the
    incumbent; far-off gaps of the FP8 arm against the incumbent (the format's drift) are reported, not failed."""
    from foldkv.lab.drift import check_study

    far = [[1.0] * 4] * 2  # the FP8 arm far from the incumbent: not gated
    checks = check_study(_study({"folded": [list(g) for g in GOOD], "folded-fp8": far, "ref-folded-fp8": far}, NEUTRAL,
                                pairs={i: {"folded-fp8 vs ref-folded-fp8": {"gap": list(g), "argmax_equal": [True] * 4}}
                                       for i, g in enumerate(GOOD)}))
    pair = checks["sections"]["folded-fp8 vs ref-folded-fp8"]
    assert pair["passed"] is True and pair["gated"] and checks["passed"], pair
    assert {q: v["limit"] for q, v in pair["gap"].items()} == \
        {q: v["limit"] for q, v in checks["sections"]["folded"]["gap"].items()}
    assert checks["sections"]["folded-fp8"]["passed"] is True and checks["sections"]["folded-fp8"]["not_gated_over"]


def test_fp8_kernel_pair_red_twin_fails_past_the_limit():
    """The red twin: the pair's gaps 3x past the neutral's neighbourhood fail the pair's section and the study (the
    same numbers as the arm's against the incumbent would not fail it); so do flips the single pass does not make."""
    from foldkv.lab.drift import check_study

    broken = [[3 * 2e-5 + g for g in c] for c in GOOD]
    checks = check_study(_fp8_study(broken))
    pair = checks["sections"]["folded-fp8 vs ref-folded-fp8"]
    assert pair["passed"] is False and not checks["passed"]
    assert any(f.startswith("gap p50") for f in pair["failures"]), pair
    # 12 steps flipped by the pair alone, none by the single pass alone: P = 2^-12; the gaps themselves are small
    small = [[1e-5] * 4] * 3
    flips = check_study(_fp8_study(small, arm_gaps=small, neutral=[[2e-5] * 4] * 3,
                                   pair_eq={i: [False] * 4 for i in range(3)}))
    pair = flips["sections"]["folded-fp8 vs ref-folded-fp8"]
    assert pair["passed"] is False and any(f.startswith("argmax") for f in pair["failures"]), pair


def test_fp8_kernel_pair_section_in_the_record(tmp_path):
    """In the notebook's record the pair is its own section: ran when both arms ran, not run (with the reason) when
    the kernel arm could not run (a CPU), failed on a failed check; absent when the study did not ask for both arms."""
    from foldkv.lab.drift import check_study, record_sections
    from foldkv.lab.report import RunRecord

    res = _fp8_study(GOOD)
    res["checks"] = check_study(res)
    assert record_sections(RunRecord("03_drift_study", tmp_path), res)["pair:folded-fp8 vs ref-folded-fp8"] == "ran"
    cpu = _study({"ref-folded-fp8": [list(g) for g in GOOD]}, NEUTRAL)
    cpu["parameters"]["arms"] += ["folded-fp8"]
    cpu["arm_status"]["folded-fp8"] = "not run: the generated kernels need a CUDA device"
    cpu["checks"] = check_study(cpu)
    sections = record_sections(RunRecord("03_drift_study", tmp_path), cpu)
    assert sections["pair:folded-fp8 vs ref-folded-fp8"].startswith("not run") and "CUDA" in \
        sections["pair:folded-fp8 vs ref-folded-fp8"]
    assert "pair:folded-fp8-exact vs ref-folded-fp8" not in sections  # folded-fp8-exact was not asked for
    bad = _fp8_study([[3 * 2e-5 + g for g in c] for c in GOOD])
    bad["checks"] = check_study(bad)
    assert record_sections(RunRecord("03_drift_study", tmp_path), bad)[
        "pair:folded-fp8 vs ref-folded-fp8"].startswith("failed: gap")
