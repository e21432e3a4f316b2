"""The generated kernels inside a Gemma 4 forward pass (synthetic checkpoint, bf16, on the GPU): the kernel arms run,
never read a poisoned row, and stay as close to their torch reference arm as bf16 arithmetic allows.

Bound used below, per walk: a kernel arm and its reference arm (both a FoldKvCache, bf16 pools: the reference arm's
pool dtype is the bf16 model's) store the same rows and fold the same query, and differ only in the attention's
arithmetic (bf16 tensor cores, fp32 accumulation, vs float64 rounded once to bf16). Downstream, that is the same
kind of bf16 reordering as the incumbent's own walk vs single pass (the neutral figure), so the kernel-vs-reference
gap is held to
    max(2 x neutral max, 2 x reference-vs-incumbent max, 4 bf16 ulps of the largest |logit|).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import require_hopper, require_module, require_tilelang

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    require_hopper()
    require_tilelang()
    require_module("transformers")
    require_module("safetensors")
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic_gpu"), seed=2)
    return load_model(ckpt, device="cuda", dtype=torch.bfloat16)


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@pytest.mark.parametrize("length", [97, 1000])  # awkward, and past 15 pages of 64
@pytest.mark.parametrize("fmt", ["split", "folded"])
def test_kernel_arm_tracks_its_reference_in_the_model(gpu_model, cuda_device, fmt, length):
    from foldkv.lab.model import ArmSettings, single_pass, walk

    steps = 8
    settings = ArmSettings(scatter_seed=length)
    prompt = torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(length))
    inc = walk(gpu_model, "incumbent", prompt, steps)
    neutral = (single_pass(gpu_model, torch.cat([prompt, inc.fed]), steps + 1) - inc.logits).abs().max()
    ref = walk(gpu_model, f"ref-{fmt}", prompt, steps, feed=inc.fed, settings=settings)
    ker = walk(gpu_model, fmt, prompt, steps, feed=inc.fed, settings=settings)
    assert ker.attention == "kernel" and ref.attention == "reference"
    assert bool(torch.isfinite(ker.logits).all()), "NaN logits: a kernel read a poisoned (unwritten) pool row"
    # the pool holds exactly the walk's tokens, nothing past them was written
    for layer in ker.cache.global_layers:
        data, table, page = layer.pool.data, layer.host_table, layer.pool.layout.page_size
        written = torch.zeros(data.shape[:3], dtype=torch.bool, device=data.device)
        for pos in range(length + steps):
            written[int(table.page_ids[0, pos // page]), :, pos % page] = True
        assert bool(torch.isfinite(data[written]).all()) and bool(torch.isnan(data[~written]).all())
    ref_gap = float((ref.logits - inc.logits).abs().max())
    bound = max(2 * float(neutral), 2 * ref_gap, 4 * _bf16_ulp(float(inc.logits.abs().max())))
    gap = (ker.logits - ref.logits).abs().amax(-1)  # [steps + 1]
    assert float(gap.max()) <= bound, (gap.tolist(), bound)


def test_study_runs_every_arm_on_the_gpu(cuda_device, tmp_path):
    """The notebook's driver with small parameters: every arm runs here, and the results say so."""
    require_module("transformers")
    from foldkv.lab.drift import run_study

    res = run_study(model_path=None, prompts=["the quick brown fox", "def f(x):"], lengths=[61, 700],
                    sweep_lengths=[129, 193], steps=4, arms=["split", "folded", "ref-split", "ref-folded"],
                    device=str(cuda_device), out_dir=str(tmp_path), log=lambda *_: None)
    assert res["model"]["kind"] == "synthetic" and res["model"]["device"].startswith("cuda")
    assert res["arm_status"] == {a: "ran" for a in ("split", "folded", "ref-split", "ref-folded")}, res["arm_status"]
    for arm in ("split", "folded"):
        assert res["summary"][arm]["argmax_of"] == len(res["cells"]) * 5
        assert not res["summary"][arm]["failed_cells"]
        assert res["summary"][arm]["gap"]["nonfinite"] == 0
        assert res["checks"]["sections"][arm]["passed"] is True, res["checks"]["sections"][arm]
    assert "folded vs split" in res["summary"] and "folded vs ref-folded" in res["summary"]
    assert res["checks"]["passed"], res["checks"]
