"""A decoder layer's tail links (`foldkv.fused_step`: StepOptions tail_sums, tail_next_norm), on the CPU: the routes off
CUDA (`gemv.linear_unsummed` is F.linear with nothing left unsummed; a projection's `tail` is the projection itself),
the option read where the step runs, and the probe's command lines. The partials travel as values from the projection
to the norm that sums them (no hand-off through module attributes); the kernels and the whole step, bitwise the step
without the links, are tests/test_fused_step_gpu.py's and tests/test_gemv_gpu.py's. The model is the tiny synthetic
Gemma 4 of tests/test_fused_step_sliding_cpu.py (float32).

Reproduce: pytest tests/test_fused_step_tails_cpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import bench_script, probe_command_of_run, tiny_synthetic_model
from foldkv.lab.model import cache_keyword

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_synthetic_model(tmp_path_factory, "tails", sliding_window=8)


def test_off_cuda_the_tails_are_the_projections_themselves(model):
    from foldkv import fused_step as fs
    from foldkv import gemv
    from foldkv.step_options import StepOptions, using

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 1, 64, generator=g), torch.randn(32, 64, generator=g)
    y, parts = gemv.linear_unsummed(x, w)
    assert parts is None and torch.equal(y, torch.nn.functional.linear(x, w))
    step = fs.StepForward(model, StepOptions())
    mlp = model.model.layers[0].mlp
    act = torch.randn(1, 1, mlp.down_proj.in_features, generator=g)
    with torch.no_grad():
        for options in (StepOptions(), StepOptions(tail_sums=False)):
            with using(options):
                y, parts = step.down_proj[0].tail(act)
            assert parts is None and torch.equal(y, mlp.down_proj(act))


def test_the_cpu_step_is_the_layers_own_arithmetic(model):
    """The step's forward on the CPU (the modules' formulas, its loop) gives the model's own logits bitwise, with and
    without the tail options (they act on CUDA only); red twin: a layer scalar doubled moves them."""
    from foldkv import fused_step as fs
    from foldkv.hf import FoldKvCache
    from foldkv.step_options import StepOptions, using

    ids = torch.arange(3, 13)[None]
    kw = cache_keyword(model)

    def logits(run):
        cache = FoldKvCache(model, max_batch=1, max_tokens=16, scatter_seed=5, decode_step="static")
        with torch.no_grad():
            return run(cache)

    own = logits(lambda c: model(input_ids=ids, **{kw: c}).logits)
    step = fs.StepForward(model, StepOptions())
    for options in (StepOptions(), StepOptions(tail_sums=False, tail_next_norm=False)):
        with using(options):
            assert torch.equal(logits(lambda c: step.prefill(c, ids, None, None, 0).logits), own)
    scalar = model.model.layers[1].layer_scalar
    keep = scalar.clone()
    try:
        scalar.mul_(2)
        assert not torch.allclose(logits(lambda c: step.prefill(c, ids, None, None, 0).logits), own)
    finally:
        scalar.copy_(keep)


def test_run_20s_step_command_parses():
    args = probe_command_of_run(20)
    assert args.tails_ab and args.decode, args
    assert not bench_script("model_decode_probe").parser().parse_args([]).tails_ab


@pytest.mark.parametrize("text, want", [("4096:8", (4096, 8)), ("131072:1", (131072, 1)), ("4096", None),
                                        ("0:8", None), ("4k:8", None)])
def test_the_probe_parses_the_profiled_cell(text, want):
    ap = bench_script("model_decode_probe").parser()
    if want is None:  # red twins: a malformed cell is refused at the command line
        with pytest.raises(SystemExit):
            ap.parse_args(["--profile", "--profile-at", text])
        return
    assert ap.parse_args(["--profile", "--profile-at", text]).profile_at == want
    assert ap.parse_args(["--profile"]).profile_at == (4096, 1)
