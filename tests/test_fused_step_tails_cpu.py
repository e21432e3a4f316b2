"""A decoder layer's tail links (`foldkv.fused_step`: tail_sums, tail_next_norm), on the CPU: what fused_step marks on
entry (each fused layer's attention and MLP as read by its norms alone, each layer's next fused layer), that the marks
are plain attributes (no module registered under another) and are gone on exit, and the routes off CUDA:
`gemv.linear_unsummed` is F.linear with nothing left unsummed, `_tail_projection` the projection itself, and a
handed-off output that is not the one returned is an error, not a silent read of an unwritten tensor. The kernels and
the whole step, bitwise the step without the links, are tests/test_fused_step_gpu.py's and tests/test_gemv_gpu.py's.
The model is the tiny synthetic Gemma 4 of tests/test_fused_step_sliding_cpu.py (float32).

Reproduce: pytest tests/test_fused_step_tails_cpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import bench_script, probe_command_of_run, tiny_synthetic_model

ROOT = Path(__file__).resolve().parents[1]
MARKS = ("_foldkv_next", "_foldkv_input_normed", "_foldkv_tail", "_foldkv_unsummed")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_synthetic_model(tmp_path_factory, "tails", sliding_window=8)


def test_fused_step_marks_the_tails_and_takes_the_marks_back(model):
    from foldkv import fused_step as fs
    from foldkv.hf import text_model_of

    layers = list(text_model_of(model).layers)
    assert len(layers) >= 2 and fs.layer_modules(model) == layers
    names = [n for n, _ in model.named_modules()]
    with fs.fused_step(model) as n:
        assert n["tail_owners"] == 2 * len(layers) and n["next_norms"] == len(layers) - 1, n
        for a, b in zip(layers, layers[1:]):
            assert vars(a)["_foldkv_next"] is b
        assert "_foldkv_next" not in vars(layers[-1])
        assert all(vars(m.self_attn)["_foldkv_tail"] and vars(m.mlp)["_foldkv_tail"] for m in layers)
        assert [n for n, _ in model.named_modules()] == names  # plain attributes: no layer became another's child
    assert not any(k in vars(m) for m in model.modules() for k in MARKS)


def test_a_layer_left_out_breaks_the_chain_around_it(model, monkeypatch):
    from foldkv import fused_step as fs
    from foldkv.hf import text_model_of

    layers = list(text_model_of(model).layers)
    monkeypatch.setattr(fs, "layer_modules", lambda m: [x for i, x in enumerate(layers) if i != 1])
    with fs.fused_step(model) as n:
        assert n["next_norms"] == len(layers) - 3, n  # neither 0 -> 1 nor 1 -> 2
        assert "_foldkv_next" not in vars(layers[0]) and "_foldkv_tail" not in vars(layers[1].mlp)


def test_off_cuda_the_routes_are_the_projections_themselves(model):
    from foldkv import fused_step as fs
    from foldkv import gemv

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 1, 64, generator=g), torch.randn(32, 64, generator=g)
    y, parts = gemv.linear_unsummed(x, w)
    assert parts is None and torch.equal(y, torch.nn.functional.linear(x, w))
    mlp = fs.layer_modules(model)[0].mlp
    with fs.fused_step(model):
        act = torch.randn(1, 1, mlp.down_proj.in_features, generator=g)
        assert torch.equal(fs._tail_projection(mlp, mlp.down_proj, act), mlp.down_proj(act))
        assert fs._unsummed(mlp, act) is None


def test_a_handed_off_output_not_returned_is_an_error(model):
    from foldkv import fused_step as fs

    mlp = fs.layer_modules(model)[0].mlp
    y, other = torch.empty(1, 1, 8), torch.empty(1, 1, 8)
    vars(mlp)["_foldkv_unsummed"] = (y, torch.empty(2, 1, 8))
    assert fs._unsummed(mlp, y) is not None and "_foldkv_unsummed" not in vars(mlp)
    vars(mlp)["_foldkv_unsummed"] = (y, torch.empty(2, 1, 8))
    with pytest.raises(RuntimeError, match="another tensor"):
        fs._unsummed(mlp, other)  # red twin: the identity is checked


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
