"""bench/versions/global_step_triton.py without a GPU: the probe's --global-ab flag parses, installing restores the
library's attend (on exit, on an exception, on a subclass that inherits it), a call the kernels do not describe falls
back to the library with its reason counted, and an FP8 pool's reason names FP8."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import bench_version

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def gst():
    return bench_version("global_step_triton")


def test_the_probe_parses_global_ab():
    spec = importlib.util.spec_from_file_location("model_decode_probe", BENCH / "model_decode_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    args = probe.parser().parse_args(["--decode", "foldkv-folded:4096:1", "foldkv-split:4096:1", "--global-ab"])
    assert args.global_ab and args.decode == ["foldkv-folded:4096:1", "foldkv-split:4096:1"]
    assert not probe.parser().parse_args([]).global_ab


def test_install_patches_and_restores_decode_step_attend(gst):
    from foldkv.hf_graph import DecodeStep

    library = DecodeStep.attend
    with gst.installed() as route:
        assert DecodeStep.attend is not library and DecodeStep.attend._global_step_triton
        with pytest.raises(RuntimeError, match="already"):
            gst.install()
    assert DecodeStep.attend is library and route.calls == 0
    with pytest.raises(ZeroDivisionError):
        with gst.installed():
            1 / 0
    assert DecodeStep.attend is library
    state = gst.install()
    try:
        assert DecodeStep.attend is not library
    finally:
        state.uninstall()
    assert DecodeStep.attend is library


def test_a_subclass_gets_its_inherited_attend_back(gst):
    from foldkv.hf_graph import DecodeStep

    class Sub(DecodeStep):
        pass

    with gst.installed(Sub):
        assert "attend" in Sub.__dict__ and DecodeStep.attend is not Sub.attend
    assert "attend" not in Sub.__dict__ and Sub.attend is DecodeStep.attend


def test_an_undescribed_call_falls_back_with_its_reason(gst):
    class Stub:
        def attend(self, layer, module, query, key, value):
            return "library"

    x = torch.zeros(1, 32, 1, 512, dtype=torch.bfloat16)
    with gst.installed(Stub) as route:
        assert Stub().attend(None, None, x, x, x) == "library"
    want = "no Triton" if gst.triton is None else "not CUDA"
    assert route.report() == {"calls": 0, "refusals": {want: 1}}
    assert Stub().attend(None, None, x, x, x) == "library" and route.refusals[want] == 1  # uninstalled: not counted


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_the_pools_the_kernels_describe(gst, fmt):
    from foldkv import GEMMA4_31B
    from foldkv.fp8 import FP8_DTYPE
    from foldkv.pool import PagedKvLayout, PagedKvPool

    def pool(dtype, f=fmt):
        return PagedKvPool(PagedKvLayout(GEMMA4_31B, f, page_size=16, num_pages=2, dtype=dtype))

    assert gst.describe_pool(pool(torch.bfloat16)) is None
    assert "bfloat16" not in gst.describe_pool(pool(torch.float32)) and "float32" in gst.describe_pool(pool(torch.float32))
    fp8 = gst.describe_pool(pool(FP8_DTYPE, "folded"))
    assert fp8 is not None and "FP8" in fp8 and "quantized" in fp8


def test_the_column_maps(gst):
    from foldkv import GEMMA4_31B
    from foldkv.layout import folded_row_sources, score_window_columns

    score, row, fold_from, key_cols = gst.column_maps(GEMMA4_31B, "folded", torch.device("cpu"))
    is_key, head_col = folded_row_sources(GEMMA4_31B)
    assert torch.equal(row.long(), head_col) and key_cols == int(is_key.sum()) == fold_from == 128
    assert torch.equal(score.long(), score_window_columns(GEMMA4_31B, "folded")) and score.dtype == torch.int32
    score, row, fold_from, key_cols = gst.column_maps(GEMMA4_31B, "split", torch.device("cpu"))
    d = GEMMA4_31B.head_dim
    assert torch.equal(score.long(), torch.arange(d)) and torch.equal(row.long(), torch.arange(2 * d) % d)
    assert fold_from == key_cols == d
