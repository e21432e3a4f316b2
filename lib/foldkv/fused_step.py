"""The decode step's small elementwise work as a few Triton kernels, swapped in for the step's forward only.

At batch 1 a Gemma 4 decode step is GEMVs plus ~30 small kernels a layer, each a few microseconds: an RMSNorm is seven
torch kernels, RoPE five (rotate_half's slice, negate, cat, two multiplies, an add), the residual tails three or four,
GELU x up two, the sliding ring's softmax four. `fused_step(model)` swaps, on the instances and for the duration of
the block (the step `foldkv.hf_graph` runs and captures), each of them for one kernel computing the same formula:
- `rms_norm`: Gemma4RMSNorm, y = x * (mean(x^2) + eps)^-0.5 [* weight] in float32, rounded once;
- `rope`: transformers' `apply_rotary_pos_emb` (unsqueeze_dim 2), x * cos + rotate_half(x) * sin with torch's three
  roundings (each product, then the sum) kept;
- `gelu_mul`: the MLP's act(gate) * up (tanh GELU), the activation rounded before the product as torch rounds it;
- the decoder layer's tails, `norm_add_norm` (post-attention norm, the residual add, the pre-feedforward norm: one
  pass over the row, two outputs) and `norm_add_scale` (post-feedforward norm, the residual add, the layer scalar);
- `masked_softmax`: the ring attention's float32 softmax of masked scores, rounded to the model dtype.
Rounding points are torch's, so most outputs are bitwise the modules'; a sum (of squares, of exponentials) reduced in
another order, or the tanh of another formula, may move a bf16 output by one ulp (the GPU tests bound each op).
Layers these formulas do not describe (a MoE block, per-layer inputs, another activation) keep their own forwards.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator

import torch
from torch import nn

_KERNELS: dict | None = None


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        from . import fused_step_kernels as k

        _KERNELS = dict(rms_norm=k.rms_norm_rows, norm_add=k.norm_add_rows, rope=k.rope_rows, gelu_mul=k.gelu_mul_flat,
                        softmax=k.masked_softmax_rows, gemv=k.gemv_rows)
    return _KERNELS


def _block(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


# --- the ops --------------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., n] -> x * (mean(x^2, -1) + eps)^-0.5 [* weight (n)], computed in float32, in x's dtype."""
    n = x.shape[-1]
    rows = _rows(x)
    out = torch.empty_like(rows)
    block = _block(n)
    _kernels()["rms_norm"][(rows.shape[0],)](rows, weight if weight is not None else rows, out, n, float(eps),
                                             HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape)


def _norm_args(norm: nn.Module | None) -> tuple:
    if norm is None:
        return None, 1e-6, False
    return (norm.weight if norm.with_scale else None), float(norm.eps), bool(norm.with_scale)


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, first: nn.Module,
                  second: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = residual + first(x), y = second(h), each rounded to x's dtype where the modules round."""
    return _norm_add(x, residual, first, second, None)


def norm_add_scale(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, scalar: torch.Tensor) -> torch.Tensor:
    """(residual + norm(x)) * scalar ([1] tensor), each rounded to x's dtype where torch rounds."""
    return _norm_add(x, residual, norm, None, scalar)[0]


def _norm_add(x, residual, first, second, scalar):
    n = x.shape[-1]
    rows, res = _rows(x), _rows(residual)
    h = torch.empty_like(rows)
    y = torch.empty_like(rows) if second is not None else h
    w1, eps1, has1 = _norm_args(first)
    w2, eps2, has2 = _norm_args(second)
    block = _block(n)
    _kernels()["norm_add"][(rows.shape[0],)](
        rows, res, w1 if has1 else rows, w2 if has2 else rows, h, y, scalar if scalar is not None else rows, n,
        eps1, eps2, HAS_W1=has1, HAS_W2=has2, SECOND=second is not None, SCALE=scalar is not None, BLOCK=block,
        num_warps=_warps(block))
    return h.view(x.shape), y.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with cos, sin [B, T, D] (all one dtype): x * cos + rotate_half(x) * sin, per head."""
    b, t, h, d = x.shape
    rows = _rows(x)
    out = torch.empty_like(rows)
    _kernels()["rope"][(rows.shape[0],)](rows, cos.contiguous(), sin.contiguous(), out, h, D=d,
                                         num_warps=_warps(d))
    return out.view(x.shape)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, rounded as torch rounds each (same shape and dtype)."""
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n, block = g.numel(), 1024
    _kernels()["gelu_mul"][(-(-n // block),)](g, u, out, n, BLOCK=block, num_warps=4)
    return out


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scores [B, ..., n] (any float dtype), mask [B, n] bool (True: attend; every row has one) -> the float32
    softmax of the masked scores, in `dtype`: scores.float().masked_fill(~mask, -inf).softmax(-1).to(dtype)."""
    n = scores.shape[-1]
    rows = _rows(scores)
    m = mask.reshape(mask.shape[0], n).contiguous()
    m = m.view(torch.uint8) if m.dtype == torch.bool else m  # a view, no copy
    out = torch.empty(rows.shape, dtype=dtype, device=rows.device)
    block = _block(n)
    _kernels()["softmax"][(rows.shape[0],)](rows, m, out, n, rows.shape[0] // m.shape[0], BLOCK=block,
                                            num_warps=_warps(block))
    return out.view(scores.shape)


GEMV_MAX_ROWS = 16  # rows (tokens) a step's projection may have for the streaming GEMV: one mma tile of rows
GEMV_TILE = 4096  # weight elements a program loads per step (BLOCK_N x BLOCK_K): 8 KB of bf16
GEMV_CTAS_PER_SM = 4  # programs resident per SM at three stages of 8 KB + the rows' tile


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemv_config(n: int, k: int, sms: int, ctas_per_sm: int = GEMV_CTAS_PER_SM) -> dict | None:
    """The streaming GEMV's tiling for a weight [n, k]: the narrowest BLOCK_N (16..64 rows) whose grid n / BLOCK_N is
    resident at once (sms x ctas_per_sm programs share the read and finish together; a weight too tall for that
    takes 64 rows a program), BLOCK_K = GEMV_TILE / BLOCK_N. None: no tiling divides the weight."""
    fits = [bn for bn in (16, 32, 64) if n % bn == 0 and k % (GEMV_TILE // bn) == 0]
    if not fits:
        return None
    bn = next((bn for bn in fits if n // bn <= sms * ctas_per_sm), fits[-1])
    return dict(BLOCK_N=bn, BLOCK_K=GEMV_TILE // bn, num_warps=4, num_stages=3)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T for at most GEMV_MAX_ROWS rows of x, float32 accumulation rounded once to x's
    dtype (F.linear's arithmetic; the sum's order differs). Other shapes, dtypes or devices: F.linear. `out`
    ([rows, N], contiguous): written in place (the tests poison it first)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    cfg = config or (gemv_config(n, k, _sms(x.device.index or 0)) if x.is_cuda else None)
    if (cfg is None or m > GEMV_MAX_ROWS or x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16)
            or not weight.is_contiguous() or not x.is_cuda):
        return torch.nn.functional.linear(x, weight)
    rows = rows if rows.is_contiguous() else rows.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    grid = (n // cfg["BLOCK_N"],)
    _kernels()["gemv"][grid](rows, weight, out, m, n, k, BLOCK_M=GEMV_MAX_ROWS, **cfg)
    return out.view(*x.shape[:-1], n)


# --- the swapped forwards -------------------------------------------------------------------------------------------

def _norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight if module.with_scale else None, module.eps)


def _linear_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return gemv(x, linear.weight)


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(gelu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


def _layer_forward(layer: nn.Module, hidden_states: torch.Tensor, per_layer_input=None, **kwargs) -> torch.Tensor:
    """Gemma4TextDecoderLayer.forward without a MoE block or per-layer inputs, its tails fused. Every keyword the
    model passes the layer (masks, positions, cache, shared KV states) goes on to self_attn, as the layer passes it."""
    x = layer.input_layernorm(hidden_states)
    x, _ = layer.self_attn(hidden_states=x, **kwargs)
    h, x = norm_add_norm(x, hidden_states, layer.post_attention_layernorm, layer.pre_feedforward_layernorm)
    x = layer.mlp(x)
    return norm_add_scale(x, h, layer.post_feedforward_layernorm, layer.layer_scalar)


def _rope_function(own):
    @functools.wraps(own)
    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim: int = 1):
        if (unsqueeze_dim == 2 and x.dim() == 4 and cos.shape == sin.shape == (x.shape[0], x.shape[1], x.shape[3])
                and x.dtype == cos.dtype == sin.dtype and x.shape[3] % 2 == 0 and x.shape[3] & (x.shape[3] - 1) == 0):
            return rope(x, cos, sin)
        return own(x, cos, sin, unsqueeze_dim)
    return apply_rotary_pos_emb


def norm_modules(model: nn.Module) -> list[nn.Module]:
    """The model's Gemma 4 RMSNorm modules (their class's name and the attributes the formula reads)."""
    return [m for m in model.modules()
            if type(m).__name__ == "Gemma4RMSNorm" and hasattr(m, "eps") and hasattr(m, "with_scale")]


def _tanh_gelu(act: nn.Module) -> bool:
    fn = getattr(act, "act", None)
    return (type(act).__name__ == "GELUTanh" and isinstance(fn, functools.partial)
            and fn.func is torch.nn.functional.gelu and fn.keywords.get("approximate") == "tanh")


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextMLP" and _tanh_gelu(m.act_fn)]


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """Decoder layers `_layer_forward` describes: no MoE block, no per-layer inputs, the four norms."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextDecoderLayer"
            and not getattr(m, "enable_moe_block", True) and not getattr(m, "hidden_size_per_layer_input", 1)
            and all(type(getattr(m, n, None)).__name__ == "Gemma4RMSNorm" for n in names)
            and isinstance(getattr(m, "layer_scalar", None), torch.Tensor) and m.layer_scalar.numel() == 1]


STEP_GEMVS = ("torch", "stream")
STEP_GEMV = "torch"  # the step's projections: "torch" (F.linear, cuBLAS) or "stream" (`gemv`)


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """The model's bias-free nn.Linear modules (the projections and the LM head)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.bias is None]


@contextlib.contextmanager
def fused_step(model: nn.Module, gemv: str | None = None) -> Iterator[dict]:
    """Within the block, `model`'s RMSNorms, MLPs, decoder layers and its attention's RoPE run the kernels above
    (forwards replaced on the instances; `apply_rotary_pos_emb` in the attention classes' modules), and with
    gemv="stream" (default STEP_GEMV) its projections the streaming GEMV; yields how many of each. Outside it,
    everything is as it was."""
    gemv = STEP_GEMV if gemv is None else gemv
    if gemv not in STEP_GEMVS:
        raise ValueError(f"gemv={gemv!r}: one of {STEP_GEMVS}")
    swapped: list[tuple[nn.Module, object]] = []
    if gemv == "stream":
        for m in linear_modules(model):
            swapped.append((m, functools.partial(_linear_forward, m)))
    for m in norm_modules(model):
        swapped.append((m, functools.partial(_norm_forward, m)))
    for m in mlp_modules(model):
        swapped.append((m, functools.partial(_mlp_forward, m)))
    layers = layer_modules(model)
    for m in layers:
        swapped.append((m, functools.partial(_layer_forward, m)))
    modules = {type(m).__module__ for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"}
    ropes = [(sys.modules[name], sys.modules[name].apply_rotary_pos_emb) for name in sorted(modules)
             if hasattr(sys.modules.get(name), "apply_rotary_pos_emb")]
    for m, forward in swapped:
        m.forward = forward
    for mod, own in ropes:
        mod.apply_rotary_pos_emb = _rope_function(own)
    counts = {"norms": sum(type(m).__name__ == "Gemma4RMSNorm" for m, _ in swapped),
              "mlps": sum(type(m).__name__ == "Gemma4TextMLP" for m, _ in swapped), "layers": len(layers),
              "rope": len(ropes), "linears": sum(isinstance(m, nn.Linear) for m, _ in swapped)}
    try:
        yield counts
    finally:
        for m, _ in swapped:
            del m.forward
        for mod, own in ropes:
            mod.apply_rotary_pos_emb = own


__all__ = ["fused_step", "gemv", "gemv_config", "linear_modules", "STEP_GEMV", "STEP_GEMVS", "rms_norm", "rope", "gelu_mul", "norm_add_norm", "norm_add_scale", "masked_softmax",
           "norm_modules", "mlp_modules", "layer_modules"]
