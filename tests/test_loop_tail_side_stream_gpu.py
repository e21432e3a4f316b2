"""bench/versions/loop_tail_side_stream.py on the GPU: generate()'s thin loop with each token's stop check on a side
stream, against the library's thin loop (`foldkv.hf_loop.decode_loop`).

Bounds: the same kernels on the same inputs, only the check issued on another stream: the synthetic model's graph
generate() (bf16, a left-padded batch of 8 whose rings wrap) gives torch.equal sequences with and without the version:
greedy with min_new_tokens (the cells' call), greedy with EOS ids taken from the free run so that one sequence, then
all, finish early (the padding after an EOS, the stop and the step run ahead taken back), and sampling from one seed.
The version took every thin token's check (its count), and the library's loop ran as many thin steps and rewinds.
Red twin: the side stream not waiting for the token ids, so the check reads them before the argmax wrote them: the
sequences differ.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_loop_tail_side_stream_gpu.py -k all_finish
"""

from __future__ import annotations

import pytest
import torch

from conftest import (THIN_LOOP_CALLS, THIN_LOOP_LENGTHS, THIN_LOOP_NEW, THIN_LOOP_PAD, bench_version,
                      synthetic_gpu_models, thin_loop_generate)

pytestmark = pytest.mark.gpu
LENGTHS, NEW, PAD = THIN_LOOP_LENGTHS, THIN_LOOP_NEW, THIN_LOOP_PAD
CALLS = THIN_LOOP_CALLS


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


def _generate(model, seed=None, **kw):
    return thin_loop_generate(model, LENGTHS, NEW, seed=seed, **kw)


@pytest.mark.parametrize("call", list(CALLS))
def test_the_loop_with_its_check_on_a_side_stream(synthetic_model, call):
    side = bench_version("loop_tail_side_stream")
    kw = CALLS[call](synthetic_model)
    want, want_steps = _generate(synthetic_model, seed=11, **kw)
    with side.installed() as took:
        got, steps = _generate(synthetic_model, seed=11, **kw)
    assert want_steps["thin"] >= 1 and steps == want_steps, (steps, want_steps)
    assert took["tokens"] >= want_steps["thin"], (took, want_steps)
    assert got.shape == want.shape and torch.equal(got, want), f"{got} where the library's loop gives {want}"
    if call == "all_finish":
        assert want.shape[1] < NEW and steps["rewound"] == 1  # stopped early, the step run ahead taken back
    if call == "one_finishes":
        assert (want[0] == PAD).any()  # sequence 0 padded after its EOS


def test_a_check_that_does_not_wait_for_the_ids_is_seen(synthetic_model):
    side = bench_version("loop_tail_side_stream")
    want, _ = _generate(synthetic_model, do_sample=False, min_new_tokens=NEW)
    with side.installed(red_no_ids_wait=True):
        twin, _ = _generate(synthetic_model, do_sample=False, min_new_tokens=NEW)
    assert not torch.equal(twin, want), "a check reading the ids before the argmax wrote them changed nothing"
