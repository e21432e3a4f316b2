"""A process's first prompt through generate() on a FoldKvCache loads no Triton kernel: the cache's creation warmed
its prefill (`DecodeStep.warm_prefill`), so a chunked prefill (chunks of 300, 300 and 101 tokens: an odd last chunk)
right after it finds every glue kernel of `foldkv.fused_step_kernels` already in Triton's per-kernel cache
(`JITFunction.device_caches`: a specialisation enters it when it is compiled or loaded from the disk cache in this
process). Each case is a fresh Python process (what "first use" means); the synthetic Gemma 4 in bf16. Red twin: a
cache whose warm-ups do nothing (`DecodeStep.warm_prefill`, and `FoldKvCache.warm_generate`, whose two-token prompt
launches the glue kernels too) shows the first prompt loading kernels.

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_first_use_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
import torch, triton
import foldkv.hf  # registers "foldkv"
from foldkv import fused_step_kernels, hf_graph
from foldkv.hf import FoldKvCache
from foldkv.lab.model import cache_keyword, load_model

ckpt, warm = sys.argv[1], sys.argv[2] == "warm"
if not warm:  # the red twin: a cache whose warm-ups do nothing (the step's, and the generate() through it)
    hf_graph.DecodeStep.warm_prefill = lambda self, model: 0
    FoldKvCache.warm_generate = lambda self, model: False


def loaded():
    # each kernel's specialisations compiled or loaded in this process
    return {name: sum(len(c[0]) for c in fn.device_caches.values()) for name, fn in vars(fused_step_kernels).items()
            if isinstance(fn, triton.runtime.jit.JITFunction)}


model = load_model(ckpt, device="cuda", dtype=torch.bfloat16, attn_implementation="foldkv")
cache = FoldKvCache(model, max_batch=1, max_tokens=720)
torch.cuda.synchronize()
before = loaded()
g = torch.Generator(device="cuda").manual_seed(3)
ids = torch.randint(3, int(model.config.vocab_size), (1, 701), device="cuda", generator=g)
model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
               do_sample=False, prefill_chunk_size=300, **{cache_keyword(model): cache})
torch.cuda.synchronize()
print("LOADED " + json.dumps({"before": before, "after": loaded()}))
"""


def _first_prompt(ckpt: str, warm: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", CHILD, ckpt, warm], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("LOADED "))
    return json.loads(line[len("LOADED "):])


def test_the_first_prompt_of_a_process_loads_no_triton_kernel(tmp_path_factory, cuda_device):
    from conftest import require_module

    require_module("transformers")
    require_module("safetensors")
    from foldkv.lab.synthetic import make_synthetic_checkpoint
    from foldkv.step_options import in_force

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic_first_use"), seed=2)
    got = _first_prompt(ckpt, "warm")
    grown = {k: (got["before"][k], v) for k, v in got["after"].items() if v != got["before"][k]}
    assert not grown, f"kernels loaded inside the first prompt (before, after): {grown}"
    # the served prefill's kernels, warmed at the cache's creation: q and k normed and rotated in one pass by
    # default (the norm, then RoPE, with the option off)
    rope = "q_norm_rope_rows" if in_force().fuse_prefill_norm_rope else "rope_rows"
    for name in ("rms_norm_rows", rope, "gelu_mul_rows", "norm_add_rows"):
        assert got["before"][name] > 0, (name, got["before"])

    twin = _first_prompt(ckpt, "cold")  # red twin: no warm-up, the first prompt loads them
    assert any(v > twin["before"][k] for k, v in twin["after"].items()), twin
