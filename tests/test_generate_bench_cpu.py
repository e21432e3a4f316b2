"""foldkv.lab.generate_bench on the CPU (notebook 05's measuring code): the computed cache bytes, the bytes a real
generate() holds against them (and a wrong formula caught), the timed generate() of every cache arm with the same
greedy tokens, the refusals and the failure bookkeeping.

The model is the synthetic Gemma 4 shrunk (hidden 64, vocab 128) with the 31B global geometry, as in test_hf_cpu.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_module

import foldkv
from foldkv import KvFormat

TINY = dict(hidden_size=64, intermediate_size=128, vocab_size=128)


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    require_module("transformers")
    require_module("safetensors")
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic_gb"), seed=3, **TINY)
    return load_model(ckpt, dtype=torch.float32)


def test_cache_bytes_rows_at_the_31b_geometry():
    from foldkv.lab.generate_bench import cache_bytes_rows

    rows = cache_bytes_rows(foldkv.GEMMA4_31B, [8192, 262144], batch=2)
    # by hand: 10 layers x 4 KV heads x 2 bytes per element; DynamicCache 2 x 512 elements per token, folded 640
    for r, n in zip(rows, (8192, 262144)):
        assert r["dynamic_bytes"] == 2 * n * 10 * 4 * 1024 * 2
        assert r["folded_bytes"] == 2 * n * 10 * 4 * 640 * 2  # whole pages: both contexts are multiples of 64
        assert r["split_bytes"] == r["dynamic_bytes"]
        assert r["folded_over_dynamic"] == 0.625 and r["saved_bytes"] == r["dynamic_bytes"] - r["folded_bytes"]
    assert rows[1]["dynamic_bytes"] == 40 * 2**30  # 20 GiB per sequence at 256K


def test_foldkv_cache_bytes_count_whole_pages():
    from foldkv.lab.generate_bench import foldkv_cache_bytes

    geom = foldkv.GEMMA4_31B
    one_page = foldkv_cache_bytes(geom, KvFormat.FOLDED, 64, layers=1)
    assert foldkv_cache_bytes(geom, KvFormat.FOLDED, 1, layers=1) == one_page == 64 * 4 * 640 * 2
    assert foldkv_cache_bytes(geom, KvFormat.FOLDED, 65, layers=1) == 2 * one_page


ARMS = ["sdpa", "foldkv-folded", "foldkv-split"]


@pytest.fixture(scope="module")
def bench(model32):
    from foldkv.lab.generate_bench import run_generate_bench

    lines = []
    res = run_generate_bench(model32, arms=ARMS + ["flash_attention_2"], prompt_lengths=[70], batches=[1, 2],
                             new_tokens=5, prefill_chunk=32, warmup_tokens=16, log=lines.append)
    res["log"] = lines
    return res


def test_every_cpu_arm_generates_the_same_tokens(bench, model32):
    assert bench["arm_status"]["flash_attention_2"].startswith("not run")
    assert {a: bench["arm_status"][a] for a in ARMS} == {a: "ran" for a in ARMS}
    runs = bench["runs"]
    assert [(r["arm"], r["batch"]) for r in runs] == [(a, b) for b in (1, 2) for a in ARMS]
    for r in runs:
        assert r["status"] == "ran" and r["agrees_with"] == "sdpa"
        assert r["agreed_steps"] == [5] * r["batch"], r  # float32: the reference pool attention is transformers'
        assert r["prefill_s"] > 0 and r["decode_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert 0 < r["decode_step_ms_p50"] <= r["decode_step_ms_max"] <= 1e3 * r["decode_s"]
        assert r["peak_bytes"] is None  # no CUDA: not measured
        assert len(r["tokens"]) == r["batch"] and all(len(t) == 5 for t in r["tokens"])
    assert model32.config._attn_implementation == "sdpa"  # switched back after every foldkv arm
    # the greedy tokens are generate()'s own: the same call without any of the bench's machinery
    from foldkv.lab.generate_bench import prompt_ids

    ids = prompt_ids(1, 70, TINY["vocab_size"])
    plain = model32.generate(input_ids=ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert plain[0, 70:].tolist() == runs[0]["tokens"][0]


def test_held_bytes_match_the_formulas(bench):
    from foldkv.lab.generate_bench import check_cache_bytes

    assert check_cache_bytes(bench["runs"]) == []
    by = {(r["arm"], r["batch"]): r["cache_bytes"] for r in bench["runs"]}
    # two global layers, float32 (the model's dtype, also the CPU pools'); a DynamicCache holds 70 + 5 - 1 tokens
    assert by[("sdpa", 1)] == 2 * 74 * 4 * 1024 * 4
    assert by[("foldkv-folded", 1)] == 2 * 2 * 64 * 4 * 640 * 4  # 75 tokens: two pages of 64
    assert by[("foldkv-split", 2)] == 2 * by[("foldkv-split", 1)]


def test_a_wrong_formula_is_caught(bench):
    """Red twin: the same runs held against a DynamicCache formula that forgets V (a K-only cache) fail the check."""
    import foldkv.lab.generate_bench as gb

    geom = foldkv.GEMMA4_31B
    right = gb.expected_cache_bytes(geom, "sdpa", batch=1, stored_tokens=74, max_tokens=75, page_size=64,
                                    dtype=torch.float32, layers=2)
    runs = [dict(r) for r in bench["runs"]]
    for r in runs:
        if r["arm"] == "sdpa":
            r["expected_cache_bytes"] //= 2
    bad = gb.check_cache_bytes(runs)
    assert len(bad) == 2 and all(b.startswith("sdpa at 70 tokens") for b in bad), bad
    assert right == bench["runs"][0]["cache_bytes"]


def test_foldkv_failures_fail_only_foldkv_arms():
    from foldkv.lab.generate_bench import foldkv_failures

    bench = {"arm_status": {"sdpa": "ran", "flash_attention_2": "failed: RuntimeError: head_dim 512",
                            "foldkv-folded": "ran"},
             "runs": [{"arm": "sdpa", "prompt_tokens": 131072, "batch": 8, "status": "failed: OutOfMemoryError: x"},
                      {"arm": "foldkv-folded", "prompt_tokens": 131072, "batch": 8, "status": "ran"}]}
    assert foldkv_failures(bench) == []
    bench["runs"].append({"arm": "foldkv-folded", "prompt_tokens": 32768, "batch": 1, "status": "failed: Boom: y"})
    bench["arm_status"]["foldkv-split"] = "failed: ImportError: z"
    assert foldkv_failures(bench) == ["foldkv-split: failed: ImportError: z",
                                      "foldkv-folded at 32768 tokens x 1: failed: Boom: y"]


def test_a_failing_cell_is_recorded_and_the_bench_goes_on(model32, monkeypatch):
    import foldkv.lab.generate_bench as gb

    real = gb.measure_generation

    def failing_at_batch_2(model, arm, **kw):
        if kw["batch"] == 2 and arm == "sdpa":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(model, arm, **kw)

    monkeypatch.setattr(gb, "measure_generation", failing_at_batch_2)
    res = gb.run_generate_bench(model32, arms=["sdpa", "foldkv-folded"], prompt_lengths=[20], batches=[1, 2],
                                new_tokens=2, prefill_chunk=64, warmup_tokens=8, log=lambda *_: None)
    status = [(r["arm"], r["batch"], r["status"].split(":")[0]) for r in res["runs"]]
    assert status == [("sdpa", 1, "ran"), ("foldkv-folded", 1, "ran"), ("sdpa", 2, "failed"),
                      ("foldkv-folded", 2, "ran")]
    assert "OutOfMemoryError" in res["runs"][2]["status"]
    assert res["runs"][3]["agrees_with"] == "foldkv-folded"  # the first arm that ran the cell
    assert gb.foldkv_failures(res) == []


def test_refusals(model32):
    from foldkv.lab.generate_bench import measure_generation

    with pytest.raises(ValueError, match="new_tokens=1"):
        measure_generation(model32, "sdpa", prompt_tokens=8, batch=1, new_tokens=1, prefill_chunk=8)
    with pytest.raises(ValueError, match="unknown arm 'foldkv'"):
        measure_generation(model32, "foldkv", prompt_tokens=8, batch=1, new_tokens=2, prefill_chunk=8)
