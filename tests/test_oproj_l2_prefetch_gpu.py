"""bench/versions/oproj_l2_prefetch.py on the GPU: each sliding o_proj's first rows read into L2 on a branch beside
one row's ring attention, against the library's step.

Bounds: the read writes only its partial sums, so the step is the library's bitwise: the synthetic model's graph
generate() (bf16, one sequence of 300 tokens whose 128-slot ring wraps; batch 1, the version's only batch) gives
torch.equal tokens and logits with and without it, and every sliding layer's capture took the prefetch (its count).
The read read what it was meant to: its partials sum to the float64 sum of the last sliding o_proj's prefix blocks
(`roofs._sum_error` within the float32 sum's bound, `_read_bound`); red twin: the same partials against one block fewer are outside it. A batch of two
is refused with its reason and is the library's step too.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_oproj_l2_prefetch_gpu.py -k tokens
"""

from __future__ import annotations

import pytest
import torch

from conftest import bench_version, graph_generate, synthetic_gpu_models

pytestmark = pytest.mark.gpu
NEW = 6


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


def _sliding_layers(model) -> int:
    return sum(t == "sliding_attention" for t in model.config.get_text_config().layer_types)


def _read_bound(blocks: int, programs: int) -> float:
    """The float32 sum's relative error bound for the stream read of `blocks` blocks by `programs` programs: each of a
    program's BLOCK lanes adds its ceil(blocks / programs) values in turn, then tl.sum's tree of log2(BLOCK) levels,
    each add within 2^-24 of the running |sum| (the partials are then added in float64)."""
    from foldkv.lab.bench.roofs import STREAM_BLOCK

    return (-(-blocks // programs) + STREAM_BLOCK.bit_length() - 1) * 2.0 ** -24


def test_the_step_with_the_prefetch_is_the_library_step_and_reads_its_prefix(synthetic_model):
    from foldkv.lab.bench.roofs import _sum_error

    pre = bench_version("oproj_l2_prefetch")
    want = graph_generate(synthetic_model, (300,), NEW)
    with pre.installed() as state:
        got = graph_generate(synthetic_model, (300,), NEW)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "the step changed with the prefetch"
    assert state.calls >= _sliding_layers(synthetic_model) and not state.refusals, state.report()
    torch.cuda.synchronize()
    w, blocks = state.last
    partials = pre._partials(w.device)
    bound = _read_bound(blocks, partials.numel())
    assert blocks >= 2 and _sum_error(partials, w.view(-1), blocks) <= bound
    assert _sum_error(partials, w.view(-1), blocks - 1) > bound, "red twin: one block fewer passed the sum"


def test_a_batch_of_two_is_the_library_step(synthetic_model):
    pre = bench_version("oproj_l2_prefetch")
    want = graph_generate(synthetic_model, (300, 97), NEW)
    with pre.installed() as state:
        got = graph_generate(synthetic_model, (300, 97), NEW)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert state.calls == 0 and set(state.refusals) == {f"batch 2 > {pre.MAX_BATCH} (the rings keep DRAM busy)"}
