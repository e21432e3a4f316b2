"""Tensor parallelism over KV heads on the CPU: transformers' tp_plan="auto" under torchrun (gloo), foldkv serving each
rank's heads, tokens equal to the one-process run; and the per-rank geometry and its refusals.

Reproduce a run by hand (the tiny synthetic checkpoint: python -c "from foldkv.lab.synthetic import
make_synthetic_checkpoint as m; m('/tmp/ck', seed=3, hidden_size=64, intermediate_size=128, vocab_size=128)"):
    python -m foldkv.lab.tp_generate /tmp/ck --out one.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m foldkv.lab.tp_generate /tmp/ck --out tp2.json
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import require_module
from foldkv.config import GEMMA4_31B, PRESETS, ConfigError


def run_generate(checkpoint: str, out: Path, *, ranks: int, prompt_shift: int = 0, extra: tuple[str, ...] = ()) -> dict:
    """foldkv.lab.tp_generate in a subprocess: plain for 1 rank, under torchrun for more."""
    from foldkv.lab.tp_generate import launch

    return launch(checkpoint, out, ranks=ranks, args=("--prompt-shift", str(prompt_shift), *extra))


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory) -> dict[str, dict]:
    require_module("accelerate")  # transformers' tp_plan needs it (the test extra installs it)
    d = tmp_path_factory.mktemp("tp")
    return {"one": run_generate(checkpoint, d / "one.json", ranks=1),
            "tp2": run_generate(checkpoint, d / "tp2.json", ranks=2),
            "one_other_prompt": run_generate(checkpoint, d / "other.json", ranks=1, prompt_shift=1),
            # the fixed-address decode step (rings, the global layers through DecodeStep), and a decode after caches
            # filled without a prefill (notebook 05's decode cells), at both world sizes
            "one_static": run_generate(checkpoint, d / "one_static.json", ranks=1, extra=STATIC_FILLED),
            "tp2_static": run_generate(checkpoint, d / "tp2_static.json", ranks=2, extra=STATIC_FILLED)}


FILLED = (300, 3)  # context, batch: past the synthetic model's 128-token window
STATIC_FILLED = ("--decode-step", "static", "--filled", *map(str, FILLED))


@pytest.mark.slow
@pytest.mark.parametrize("kv_format", ["folded", "split"])
def test_tp2_tokens_equal_one_process(runs, kv_format):
    one, tp2 = runs["one"]["formats"][kv_format], runs["tp2"]["formats"][kv_format]
    assert runs["tp2"]["world_size"] == 2
    assert tp2["tokens"] == one["tokens"], f"{kv_format}: TP 2 {tp2['tokens']} != one process {one['tokens']}"


@pytest.mark.slow
@pytest.mark.parametrize("kv_format", ["folded", "split"])
def test_tp2_tokens_red_twin_another_prompt_differs(runs, kv_format):
    # the equality above can fail: the same run on prompts one token id up gives other tokens
    other, tp2 = runs["one_other_prompt"]["formats"][kv_format], runs["tp2"]["formats"][kv_format]
    assert other["tokens"] != tp2["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_format", ["folded", "split"])
def test_tp2_each_rank_holds_only_its_kv_heads(runs, kv_format):
    (whole,) = runs["one"]["formats"][kv_format]["ranks"]
    ranks = runs["tp2"]["formats"][kv_format]["ranks"]
    assert (whole["num_q_heads"], whole["num_kv_heads"]) == (32, 4)
    assert len(ranks) == 2
    for r in ranks:
        assert (r["num_q_heads"], r["num_kv_heads"], r["head_dim"]) == (16, 2, 512)
        assert 2 * r["pool_bytes"] == whole["pool_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_format", ["folded", "split"])
def test_tp2_static_step_tokens_equal_one_process(runs, kv_format):
    one, tp2 = runs["one"]["formats"][kv_format], runs["tp2_static"]["formats"][kv_format]
    assert runs["tp2_static"]["decode_step"] == "static" and runs["tp2_static"]["world_size"] == 2
    assert tp2["tokens"] == one["tokens"], f"{kv_format}: TP 2, static step {tp2['tokens']} != {one['tokens']}"
    # red twin: another prompt's tokens are not these
    assert runs["one_other_prompt"]["formats"][kv_format]["tokens"] != tp2["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_format", ["folded", "split"])
def test_tp2_filled_cache_decodes_and_each_rank_reads_its_shards(runs, kv_format):
    """fill_cache under tensor parallelism fills each rank's heads (whole heads there: the decode after it raises
    a shape error), and the step's floor counts what a rank reads: half the KV, its weight shards."""
    (whole,) = runs["one_static"]["formats"][kv_format]["filled"]["ranks"]
    filled = runs["tp2_static"]["formats"][kv_format]["filled"]
    context, batch = FILLED
    assert (filled["context"], filled["batch"]) == (context, batch)
    tokens = filled["tokens"]
    assert len(tokens) == batch and all(len(t) == 8 and all(0 <= x < 128 for x in t) for t in tokens)
    assert len(filled["ranks"]) == 2
    for r in filled["ranks"]:
        assert 2 * r["step_kv_bytes"] == whole["step_kv_bytes"]
        assert r["weight_bytes"] < whole["weight_bytes"] <= sum(x["weight_bytes"] for x in filled["ranks"])
        # red twin: the parameters counted whole (a DTensor's own size) claim the rank reads the whole model
        assert r["whole_weight_bytes"] == whole["weight_bytes"] != r["weight_bytes"]


class FakeAttention(nn.Module):
    """A global attention module whose q_proj / k_proj hold `q_heads` / `kv_heads` heads of 512 rows (a shard)."""

    def __init__(self, q_rows: int, k_rows: int):
        super().__init__()
        self.layer_idx = 5
        self.q_proj = nn.Linear(1, q_rows, bias=False, device="meta")
        self.k_proj = nn.Linear(1, k_rows, bias=False, device="meta")


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_tensor_parallel_ranks_reads_the_shard(ranks):
    from foldkv.hf import tensor_parallel_ranks

    d = GEMMA4_31B.head_dim
    attn = FakeAttention(32 * d // ranks, 4 * d // ranks)
    assert tensor_parallel_ranks(attn, GEMMA4_31B) == ranks
    local = GEMMA4_31B.per_rank(ranks)
    assert (local.num_q_heads, local.num_kv_heads, local.group_size) == (32 // ranks, 4 // ranks, 8)


@pytest.mark.parametrize("q_heads,kv_heads,why", [
    (4, 0.5, "half a KV head a rank (8 ranks)"),
    (8, 2, "q_proj split 4 ways, k_proj 2 ways"),
    (16, 4, "query groups split from their KV heads (k_proj whole)"),
    (10.5, 1.5, "partial heads (a 3-way split of 32 / 4 heads)"),
])
def test_tensor_parallel_ranks_refuses_a_plan_that_splits_a_group(q_heads, kv_heads, why):
    from foldkv.hf import tensor_parallel_ranks

    d = GEMMA4_31B.head_dim
    attn = FakeAttention(int(q_heads * d), int(kv_heads * d))
    with pytest.raises(ConfigError, match="whole KV heads on each rank with their query groups"):
        tensor_parallel_ranks(attn, GEMMA4_31B)


@pytest.mark.parametrize("ranks", [0, 3, 8])
def test_per_rank_refuses_ranks_not_dividing_the_kv_heads(ranks):
    with pytest.raises(ConfigError, match="whole KV heads"):
        GEMMA4_31B.per_rank(ranks)


def test_tp2_preset_is_one_rank_of_the_31b():
    geom = PRESETS["gemma-4-31b-tp2"]
    assert (geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.group_size) == (16, 2, 512, 8)
    assert geom.rotary_pairs == GEMMA4_31B.rotary_pairs and geom.name == "gemma-4-31b-tp2"


def test_a_rank_killed_by_a_signal_is_run_again_once(monkeypatch, tmp_path):
    """`tp_generate.launch`: a run whose rank died of a signal (torchrun's failure report) runs again, once, and the
    result says so; red twins: a rank's Python error is not run again, and a second death raises with the ranks'
    own output last."""
    import json
    import subprocess

    from foldkv.lab import tp_generate

    died = ("Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 7)\n"
            "  traceback : Signal 6 (SIGABRT) received by PID 7\n")
    out = tmp_path / "tp.json"

    def runs(*results):
        calls = []

        def fake(cmd, **kw):
            rc, stderr = results[len(calls)]
            calls.append(cmd)
            if rc == 0:
                out.write_text(json.dumps({"formats": {}}))
            return subprocess.CompletedProcess(cmd, rc, stdout="", stderr=stderr)
        monkeypatch.setattr(subprocess, "run", fake)
        return calls

    calls = runs((1, died), (0, ""))
    got = tp_generate.launch("ck", out, ranks=2)
    assert len(calls) == 2 and got["launch_retries"] == ["rank 1 died of SIGABRT"]
    calls = runs((1, "[rank1]: ValueError: tokens differ\n"), (0, ""))
    with pytest.raises(RuntimeError, match="ValueError: tokens differ"):
        tp_generate.launch("ck", out, ranks=2)
    assert len(calls) == 1
    calls = runs((1, "[rank1]: something\n" + died), (1, "[rank1]: something\n" + died))
    with pytest.raises(RuntimeError, match=r"the ranks' output:\n\[rank1\]: something$"):
        tp_generate.launch("ck", out, ranks=2)
    assert len(calls) == 2
