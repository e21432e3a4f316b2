"""bench/versions/step_glue_branch.py on the GPU: the step's device prologue and rotary tables on a side branch of
its graph, joined before their first consumer.

Bounds: the same kernels on the same inputs, only issued on another stream: the synthetic model's graph generate()
(folded and split pools, a left-padded batch of 8 whose rings wrap) gives torch.equal greedy tokens and logits with
and without the branch, and every captured step body took it. Red twin: the branch writing the ring slot one ahead
changes the logits (what the branch writes is what the step reads).

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_step_glue_branch_gpu.py -k folded
"""

from __future__ import annotations

import pytest
import torch

from conftest import bench_version, graph_generate, require_module, synthetic_gpu_models

pytestmark = pytest.mark.gpu
LENGTHS = (97, 300, 1000, 5, 64, 129, 700, 33)
NEW = 12


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_the_step_with_its_glue_on_a_branch(synthetic_model, fmt):
    require_module("triton")
    glue = bench_version("step_glue_branch")
    library = graph_generate(synthetic_model, LENGTHS, NEW, kv_format=fmt)
    with glue.installed() as took:
        got = graph_generate(synthetic_model, LENGTHS, NEW, kv_format=fmt)
    assert took["steps"] >= 2, took  # the warm-up and the capture (the replays run the graph)
    assert bool(torch.isfinite(got[1]).all())
    assert torch.equal(got[0], library[0]), "greedy tokens differ"
    assert torch.equal(got[1], library[1]), f"logits differ (max |gap| {(got[1] - library[1]).abs().max().item():.3g})"
    with glue.installed(red_next_slot=True):
        twin = graph_generate(synthetic_model, LENGTHS, NEW, kv_format=fmt)
    assert not torch.equal(twin[1], library[1]), "the branch's slot one ahead changed nothing"
