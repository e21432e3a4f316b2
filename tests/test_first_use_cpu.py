"""What the prefill of generate() on a FoldKvCache does once per process or once per prompt length, on the CPU.

- A FoldKvCache with kernel attention resolves (builds or loads) the prefill kernels its global layers will launch at
  its creation (`FoldKvCache._load_kernels`), exactly those `prefill` resolves for its pool (bf16 folded and split,
  FP8 with its page gather), so a process's first prompt does not import TileLang and elaborate and load them inside
  its time to first token. Red twin: a `_load_kernels` that resolves nothing (what it did before) is caught.
- The TileLang prefill program bakes no length: every dim of its arguments that depends on the prompt (queries,
  pages, batch, tiles) is a dynamic variable, so one kernel serves every length. Red twin: a program with a static
  query count is caught by the same check.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_module, require_tilelang
from foldkv.kernels import prefill as prefill_launcher
from foldkv.kernels import resolve


@pytest.fixture(scope="module")
def model(checkpoint):
    import foldkv.hf  # noqa: F401  (registers "foldkv")
    from foldkv.lab.model import load_model

    return load_model(checkpoint, dtype=torch.float32, attn_implementation="foldkv")


def _recorded(monkeypatch) -> list:
    calls = []

    def record(name, geometry, params=None, backend="jit"):
        calls.append((name, geometry, dict(params or {}), backend))
        return lambda *args: None

    monkeypatch.setattr(resolve, "kernel", record)
    return calls


@pytest.mark.parametrize("fmt,dtype", [("folded", torch.bfloat16), ("split", torch.bfloat16),
                                       ("folded", torch.float8_e4m3fn)])
def test_cache_resolves_its_prefill_kernels_at_creation(model, monkeypatch, fmt, dtype):
    from foldkv.hf import FoldKvCache

    cache = FoldKvCache(model, max_batch=2, max_tokens=96, kv_format=fmt, dtype=dtype, attention="reference")
    pool = cache.global_layers[0].pool
    want = [(n, pool.geometry, p, "jit") for n, p in prefill_launcher.kernel_params(pool).items()]
    assert [w[0] for w in want] == list(prefill_launcher.launch_names(pool))
    calls = _recorded(monkeypatch)
    cache._load_kernels()  # what creation runs for attention="kernel" (on CUDA only)
    assert calls == want
    assert all(c[2]["page_size"] == pool.layout.page_size for c in calls)

    # red twin: the loader before, which only imported the launchers, resolves nothing at creation
    calls.clear()
    monkeypatch.setattr(FoldKvCache, "resolve_prefill_kernels", lambda self, pool: None)
    cache._load_kernels()
    assert calls != want


def test_flashinfer_cache_resolves_no_foldkv_prefill(model, monkeypatch):
    from foldkv.lab.flashinfer_model import FlashInferCache

    cache = FlashInferCache(model, max_batch=1, max_tokens=64, attention="reference")
    calls = _recorded(monkeypatch)
    cache.resolve_prefill_kernels(cache.global_layers[0].pool)
    assert calls == []


def length_dims(func) -> dict[str, list[bool]]:
    """For each buffer argument of a TIR prim_func: which of its dims are dynamic (a variable, not a constant)."""
    from tvm import tirx

    return {str(p.name).removesuffix("_handle"): [not isinstance(d, tirx.IntImm) for d in func.buffer_map[p].shape]
            for p in func.params if p in func.buffer_map}


# the dims of the prefill's arguments a prompt sets: query rows, pages, batch, max pages, tiles
PROMPT_DIMS = {"Q": [True, False, False], "Pool": [True, False, False, False], "PageIds": [True, True],
               "SeqLens": [True], "QStart": [True], "QLens": [True], "TileReq": [True], "TileTok": [True],
               "Out": [True, False, False], "Lse": [True, False]}


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_prefill_program_bakes_no_length(fmt):
    require_tilelang()
    from foldkv.config import GEMMA4_31B
    from foldkv.kernels.prefill_attention import prefill_program

    assert length_dims(prefill_program(GEMMA4_31B, fmt)) == PROMPT_DIMS


def test_a_static_length_is_caught():
    require_tilelang()
    import tilelang.language as T

    @T.prim_func
    def static_rows(Q: T.Tensor((4096, 32, 512), "bfloat16"), QLens: T.Tensor((1,), "int32")):
        with T.Kernel(1, threads=32):
            T.evaluate(0)

    dims = length_dims(static_rows)
    assert dims["Q"] != PROMPT_DIMS["Q"]
