"""The prefill's compute floor (`foldkv.lab.prefill_floor`) against what the model itself does, on the CPU.

- Projections and LM head: torch's FlopCounterMode over a forward of a tiny synthetic Gemma 4 (eager attention,
  logits_to_keep=1 as generate() asks) counts every Linear's matmul; the floor's counts must equal them.
- Attention: the counter sees eager attention's two full matmuls (every query-key pair, masked or not: 4 d per pair
  and head). The floor's per-pair cost times the pairs of the mask the model's own forward hands each layer (counted
  from the mask tensor) must equal the floor's attention, layer type by layer type.
- Pair counts at sizes a forward cannot reach (4,096, 10,602) against transformers' own mask functions.
- The 31B: the issue's 0.25 / 2.33 / 13.5 PFLOP at 4K / 32K / 128K, and Linear weights + LM head + the 1-D parameters
  (norms, scalars) = the model's parameter count.
Red twins: a floor that counts all T^2 pairs of a causal layer, one that slides no window, and one with the LM head on
every token are caught by the same checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import require_module
from foldkv.lab import prefill_floor as pf

WINDOW = 64
SIZES = (1, 63, 65, 130)


@pytest.fixture(scope="module")
def tiny():
    require_module("transformers")
    from foldkv.lab.gemma31b import _text_config
    from foldkv.lab.synthetic import synthetic_config
    from transformers import Gemma4ForCausalLM

    cfg = synthetic_config(vocab_size=160, hidden_size=64, intermediate_size=96,
                           layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=WINDOW,
                           sliding_head_dim=16, sliding_kv_heads=2, num_q_heads=4, global_kv_heads=1,
                           global_head_dim=512, dtype="float32")
    cfg.pop("foldkv_synthetic", None)
    torch.manual_seed(0)
    return Gemma4ForCausalLM(_text_config(cfg, "eager")).eval()


def counted(model, tokens: int) -> dict:
    """What the model does on a prompt of `tokens`: FlopCounterMode's Linear and LM head FLOPs, its attention
    matmuls' FLOPs per layer, and the pairs each layer's mask allows (from the mask the layer was handed)."""
    from torch.utils.flop_counter import FlopCounterMode

    masks = {}

    def keep_mask(module, args, kwargs):
        masks[module.layer_idx] = kwargs.get("attention_mask")

    text = model.model
    hooks = [layer.self_attn.register_forward_pre_hook(keep_mask, with_kwargs=True) for layer in text.layers]
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    flops = counter.get_flop_counts()
    root = type(model).__name__

    def total(name: str, op: str | None = None) -> int:
        return sum(n for o, n in flops.get(f"{root}.{name}", {}).items() if op is None or str(o) == op)

    linear_names = [n for n, m in text.named_modules() if isinstance(m, torch.nn.Linear)]
    attention = [total(f"model.layers.{i}.self_attn", "aten.bmm") for i in range(len(text.layers))]
    pairs = []
    for i in range(len(text.layers)):
        m = masks[i]
        allowed = torch.ones(tokens, tokens, dtype=torch.bool) if m is None else (
            m[0, 0] if m.dtype == torch.bool else m[0, 0] == 0)
        pairs.append(int(allowed.sum()))
    return {"linear": sum(total(f"model.{n}") for n in linear_names), "lm_head": total("lm_head"),
            "attention": attention, "pairs": pairs}


def mismatches(model, tokens: int, flops: pf.PrefillFlops) -> list[str]:
    """Where `flops` (a floor of a prompt of `tokens` on `model`) disagrees with what the model does."""
    got = counted(model, tokens)
    shapes = pf.model_shapes(model)
    out = []
    if flops.projections != got["linear"]:
        out.append(f"projections {flops.projections} != counted {got['linear']}")
    if flops.lm_head != got["lm_head"]:
        out.append(f"lm head {flops.lm_head} != counted {got['lm_head']}")
    want = {"global": 0, "sliding": 0}
    for a, dense, pairs in zip(shapes.attention, got["attention"], got["pairs"]):
        per_pair = dense // (tokens * tokens)  # eager computes every pair
        if per_pair != pf.ATTENTION_FLOPS_PER_PAIR_PER_DIM * a.heads * a.head_dim:
            out.append(f"per-pair cost {per_pair} != 4 x {a.heads} x {a.head_dim}")
        want["global" if a.window is None else "sliding"] += per_pair * pairs
    if flops.global_attention != want["global"]:
        out.append(f"global attention {flops.global_attention} != the masks' {want['global']}")
    if flops.sliding_attention != want["sliding"]:
        out.append(f"sliding attention {flops.sliding_attention} != the masks' {want['sliding']}")
    return out


@pytest.mark.parametrize("tokens", SIZES)
def test_floor_equals_what_the_model_counts(tiny, tokens):
    assert mismatches(tiny, tokens, pf.prefill_flops(tiny, tokens)) == []


def test_red_twins_are_caught(tiny, monkeypatch):
    tokens = 65  # past the window: every twin differs here
    right = pf.prefill_flops(tiny, tokens)
    head_every_token = dataclasses.replace(right, lm_head=right.lm_head * tokens)
    assert any("lm head" in m for m in mismatches(tiny, tokens, head_every_token))
    with monkeypatch.context() as m:
        m.setattr(pf, "causal_pairs", lambda n: n * n)  # every T^2 pair
        assert any("global attention" in x for x in mismatches(tiny, tokens, pf.prefill_flops(tiny, tokens)))
    with monkeypatch.context() as m:
        m.setattr(pf, "window_pairs", lambda n, w: n * (n + 1) // 2)  # no window
        assert any("sliding attention" in x for x in mismatches(tiny, tokens, pf.prefill_flops(tiny, tokens)))


def _mask_pairs(mask_function, n: int, block: int = 1024) -> int:
    """Allowed pairs of positions 0..n-1 under a transformers mask function, counted block by block."""
    kv = torch.arange(n)
    total = 0
    for q0 in range(0, n, block):
        q = torch.arange(q0, min(q0 + block, n))
        total += int(mask_function(0, 0, q[:, None], kv[None, :]).sum())
    return total


@pytest.mark.parametrize("n", (1, 63, 65, 1024, 1025, 4096, 10_602))
def test_pairs_equal_transformers_masks(n):
    require_module("transformers")
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    assert pf.causal_pairs(n) == _mask_pairs(causal_mask_function, n)
    for window in (64, 1024):
        assert pf.window_pairs(n, window) == _mask_pairs(sliding_window_causal_mask_function(window), n)
    assert n == 1 or _mask_pairs(causal_mask_function, n) != n * n  # the all-pairs twin differs past one token


def test_the_31b_floor_is_the_issue_figure():
    require_module("transformers")
    from foldkv.lab.gemma31b import PARAMETERS_31B, gemma4_31b_config, meta_model

    model = meta_model(gemma4_31b_config())
    shapes = pf.model_shapes(model)
    one_d = sum(p.numel() for p in model.parameters() if p.dim() <= 1)  # norms and layer scalars: no matmul
    assert shapes.linear_weights + shapes.lm_head_weights + one_d == PARAMETERS_31B  # tied head = the embedding
    assert {(a.heads, a.head_dim, a.window) for a in shapes.attention} == {(32, 256, 1024), (32, 512, None)}
    assert sum(a.window is None for a in shapes.attention) == 10
    for tokens, pflop in ((4096, 0.25), (32_768, 2.33), (131_072, 13.5)):
        total = pf.prefill_flops(shapes, tokens).total
        assert round(total / 1e15, 2 if pflop < 10 else 1) == pflop
    # at the issue's 790 TFLOP/s: 0.32 / 2.94 / 17.1 s
    assert [round(pf.floor_seconds(pf.prefill_flops(shapes, t).total, 790), 2) for t in (4096, 32_768)] == [0.32, 2.94]
    assert round(pf.floor_seconds(pf.prefill_flops(shapes, 131_072).total, 790), 1) == 17.1
    assert pf.prefill_flops(gemma4_31b_config(), 4096).total == pf.prefill_flops(shapes, 4096).total  # config path


@pytest.mark.parametrize("tokens,chunk", [(1, 8192), (63, 8), (65, 64), (4096, 4096), (10_602, 4096), (12_001, 8192),
                                          (130, 1)])
def test_chunks_sum_to_the_prompt(tiny, tokens, chunk):
    shapes = pf.model_shapes(tiny)
    f = pf.prefill_flops(shapes, tokens, batch=3, chunk=chunk)
    assert len(f.chunks) == -(-tokens // chunk)
    assert sum(f.chunks) == f.total
    whole = pf.prefill_flops(shapes, tokens, batch=3)
    assert (whole.projections, whole.global_attention, whole.sliding_attention, whole.lm_head) == (
        f.projections, f.global_attention, f.sliding_attention, f.lm_head)
    assert whole.total == 3 * pf.prefill_flops(shapes, tokens).total
    # a chunk is the prompt up to its end less the prompt before it (LM head in the last one only)
    first_two = min(2 * chunk, tokens)
    if len(f.chunks) > 2:
        ends = [pf.prefill_flops(shapes, e, batch=3) for e in (chunk, first_two)]
        assert f.chunks[1] == ends[1].total - ends[0].total


@pytest.mark.parametrize("kwargs", [dict(prompt_tokens=0), dict(prompt_tokens=4, batch=0), dict(prompt_tokens=4, chunk=0),
                                    dict(prompt_tokens=2.5), dict(prompt_tokens=True)])
def test_bad_input_refused(tiny, kwargs):
    with pytest.raises(ValueError):
        pf.prefill_flops(tiny, **kwargs)


def test_floor_seconds():
    assert pf.floor_seconds(790e12, 790) == pytest.approx(1.0)
    for bad in (0, -1, None):
        with pytest.raises(ValueError):
            pf.floor_seconds(1e12, bad)


def test_prefill_floor_measures_the_rate_in_the_same_run(tiny, monkeypatch):
    from foldkv.lab.bench import roofs

    asked = []
    monkeypatch.setattr(roofs, "measure_matmul_roof", lambda device: asked.append(device) or {"tflops": 500.0})
    got = pf.prefill_floor(tiny, 65, chunk=32, device="cpu")
    total = pf.prefill_flops(tiny, 65).total
    assert asked == ["cpu"] and got["tflops"] == 500.0
    assert got["floor_s"] == pytest.approx(total / 500e12)
    assert sum(got["chunk_floor_s"]) == pytest.approx(got["floor_s"]) and len(got["chunk_floor_s"]) == 3
    assert pf.prefill_floor(tiny, 65, roof={"tflops": 250.0})["floor_s"] == pytest.approx(total / 250e12)
    assert asked == ["cpu"]  # a given roof is not measured again
