"""The host side of `foldkv.fused_step_kernels`: each elementwise op of the step as one launch (its checks, its
output, its PDL keywords)."""

from __future__ import annotations

import torch
from torch import nn

from . import gemv
from .transformers_compat import norm_eps
from .validate import FoldKvInputError

_KERNELS: dict | None = None


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        from . import fused_step_kernels as k

        _KERNELS = dict(rms_norm=k.rms_norm_rows, norm_add=k.norm_add_rows, rope=k.rope_rows, gelu_mul=k.gelu_mul_rows,
                        softmax=k.masked_softmax_rows, q_norm_rope=k.q_norm_rope_rows,
                        sliding_prologue=k.sliding_prologue_rows)
    return _KERNELS


def _pdl(x: torch.Tensor) -> dict:
    """A kernel's launch keywords under programmatic dependent launch (`foldkv.gemv.pdl_kw`; {} when off)."""
    return gemv.pdl_kw(x)


def _block(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _destination(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An op's packed output of `shape` in like's dtype and device: a new tensor, or `out` (a caller's place: a sliding
    cache's scratch rows) viewed as `shape`; FoldKvInputError, before any launch, where `out` is not such a place."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    numel = torch.Size(shape).numel()
    if not out.is_contiguous() or out.numel() != numel or out.dtype != like.dtype or out.device != like.device:
        raise FoldKvInputError(f"out {tuple(out.shape)} {out.dtype} on {out.device} (strides {out.stride()}):"
                               f" expected a packed tensor of {numel} {like.dtype} elements on {like.device}")
    return out.view(shape)


# --- the ops --------------------------------------------------------------------------------------------------------

def _packed_rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(inner_rows, outer_stride) when x [..., m, n] is an [outer, m, n] view with packed [m, n] blocks (the last dim
    contiguous, rows n apart, the leading dims one uniform stride): a head-split slice of a merged projection's
    output. None otherwise."""
    if x.dim() < 2 or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return None
    lead = [(size, stride) for size, stride in zip(x.shape[:-2], x.stride()[:-2]) if size != 1]
    if any(outer != inner * size for (_, outer), (size, inner) in zip(lead, lead[1:])):
        return None
    return x.shape[-2], (lead[-1][1] if lead else 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., n] -> x * (mean(x^2, -1) + eps)^-0.5 [* weight (n)], computed in float32, in x's dtype (packed; into
    `out` when given, `_destination`). x may be a strided view whose [heads, n] blocks are packed (`_packed_rows`):
    read in place, no copy."""
    n = x.shape[-1]
    packed = None if x.is_contiguous() else _packed_rows(x)
    if packed is None:  # row r at r * n: one inner row an outer block, so the kernel sees no row count (a prefill's
        src = _rows(x)  # length would otherwise be a Triton specialization: a build per new divisibility)
        inner, outer = 1, n
    else:
        src, (inner, outer) = x, packed
    rows = x.numel() // n
    out = _destination(out, (rows, n), x)
    block = _block(n)
    _kernels()["rms_norm"][(rows,)](src, weight if weight is not None else out, out, n, inner, outer, float(eps),
                                    HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=_warps(block), **_pdl(x))
    return out.view(x.shape)


def _norm_args(norm: nn.Module | None) -> tuple:
    if norm is None:
        return None, 1e-6, False
    return (norm.weight if norm.with_scale else None), norm_eps(norm), bool(norm.with_scale)


def _norm_add(x, residual, first, second, scalar, parts=None):
    """norm_add_rows; parts: x's float32 split partials [P, rows, n] (x itself unwritten, not read)."""
    n = x.shape[-1]
    res = _rows(residual)
    src = _rows(x) if parts is None else parts
    h = torch.empty(res.shape, dtype=x.dtype, device=x.device)
    y = torch.empty_like(h) if second is not None else h
    w1, eps1, has1 = _norm_args(first)
    w2, eps2, has2 = _norm_args(second)
    block = _block(n)
    _kernels()["norm_add"][(res.shape[0],)](
        src, res, w1 if has1 else h, w2 if has2 else h, h, y, scalar if scalar is not None else h, n,
        eps1, eps2, res.numel(), HAS_W1=has1, HAS_W2=has2, SECOND=second is not None, SCALE=scalar is not None,
        BLOCK=block, PARTS=0 if parts is None else parts.shape[0], num_warps=_warps(block), **_pdl(x))
    return h.view(x.shape), y.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, H, D] with cos, sin [B, T, D] (all one dtype): x * cos + rotate_half(x) * sin, per head (into `out`
    when given, `_destination`)."""
    b, t, h, d = x.shape
    out = _destination(out, (x.numel() // d, d), x)
    rows = _rows(x)
    _kernels()["rope"][(rows.shape[0],)](rows, cos.contiguous(), sin.contiguous(), out, h, D=d,
                                         num_warps=_warps(d), **_pdl(x))
    return out.view(x.shape)


def norm_rope_refusal(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor) -> str | None:
    """Why `norm_rope` does not take these (None: it does); each reason names what it takes."""
    if x.dim() != 4:
        return f"head rows [B, T, H, D] expected, got {tuple(x.shape)}"
    b, t, h, d = x.shape
    if (why := head_dim_refusal(d)) is not None:
        return why
    if weight is None or weight.shape != (d,):
        return "no weight of the head's width"
    if cos.shape != (b, t, d) or sin.shape != cos.shape or not x.dtype == cos.dtype == sin.dtype:
        return f"cos/sin {tuple(cos.shape)} {cos.dtype}: expected [{b}, {t}, {d}] {x.dtype}"
    if x.stride(3) != 1 or (h > 1 and x.stride(2) != d) or (b > 1 and t > 1 and x.stride(0) != t * x.stride(1)):
        return f"head rows not packed at one token stride (strides {x.stride()})"
    return None


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, H, D] head rows (read in place), weight [D], cos/sin [B, T, D] -> RoPE(RMSNorm(x) * weight) packed,
    in one pass (`q_norm_rope` with the B * T tokens as its batch), bitwise `rms_norm` then `rope`; into `out` when
    given (`_destination`). Raises FoldKvInputError where `norm_rope_refusal` says."""
    if (why := norm_rope_refusal(x, weight, cos, sin)) is not None:
        raise FoldKvInputError(f"norm_rope: {why}")
    b, t, h, d = x.shape
    token_stride = x.stride(1) if t > 1 else x.stride(0)  # (row b * T + t at that stride: checked above)
    rows = x.as_strided((b * t, 1, h * d), (token_stride, h * d, 1))  # the B * T tokens as q_norm_rope's batch
    return q_norm_rope(rows, weight, eps, cos.reshape(b * t, 1, d), sin.reshape(b * t, 1, d), h,
                       out=out).view(b, t, h, d)


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [rows, n] with its last dim contiguous (a view where the rows have one stride, else a copy)."""
    rows = x.reshape(-1, x.shape[-1])  # (reshape: view's strides wherever a view exists)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, rounded as torch rounds each (same shape and dtype; the output packed). gate and up may
    be row-strided views (the halves of a merged gate|up output): read in place."""
    g, u = _row_view(gate), _row_view(up)
    rows, n = g.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    block = 1024
    _kernels()["gelu_mul"][(rows, -(-n // block))](g, u, out, n, g.stride(0), u.stride(0), BLOCK=block, num_warps=4,
                                                    **_pdl(gate))
    return out.view(gate.shape)


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
                                            num_warps=_warps(block), **_pdl(scores))
    return out.view(scores.shape)


# --- a sliding layer's decode step before its ring attention: one kernel ------------------------------------------
# The norms, RoPE and ring writes (7 launches) as one; the ring attention stays cuBLAS's batched matmuls around the
# fused softmax: the Triton versions tried were slower on the 31B (bench/versions/ring_attention_*.py).


def _head_rows(x: torch.Tensor, heads: int, d: int, name: str) -> int:
    """x [B, 1, heads * d]'s row stride (a projection's output or a merged one's columns; its last dim contiguous)."""
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != heads * d or x.stride(2) != 1:
        raise FoldKvInputError(f"{name}: expected [B, 1, {heads} * {d}] with its last dim contiguous, got"
                               f" {tuple(x.shape)} strides {x.stride()}")
    return x.stride(0)


def _rope_table(t: torch.Tensor, b: int, d: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    if t.shape != (b, 1, d) or t.dtype != dtype:
        raise FoldKvInputError(f"{name}: expected [{b}, 1, {d}] {dtype}, got {tuple(t.shape)} {t.dtype}")
    return t.contiguous()


def head_dim_refusal(d: int) -> str | None:
    """Why the ring kernels do not take this head_dim (None: a power of two >= 16)."""
    return None if d >= 16 and d & (d - 1) == 0 else f"head_dim {d}: the ring kernels take a power of two >= 16"


def _check_head_dim(d: int) -> None:
    if (why := head_dim_refusal(d)) is not None:
        raise FoldKvInputError(why)


def q_rows_args(q: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                heads: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple, int]:
    """`q_norm_rope`'s checks (FoldKvInputError) and its kernel's arguments: (out [B, heads, d], the row args, d)."""
    b, d = q.shape[0], weight.shape[0]
    _check_head_dim(d)
    stride = _head_rows(q, heads, d, "q")
    cos, sin = _rope_table(cos, b, d, q.dtype, "cos"), _rope_table(sin, b, d, q.dtype, "sin")
    out = _destination(out, (b, heads, d), q)
    return out, (q, weight, cos, sin, out, heads, stride, d, float(eps)), d


def q_norm_rope(q: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                heads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, 1, heads * d] (read in place), weight [d], cos/sin [B, 1, d] -> RoPE(Gemma4RMSNorm(q per head)) as
    [B, heads, d] packed, bitwise `rms_norm` followed by `rope`."""
    out, args, d = q_rows_args(q, weight, eps, cos, sin, heads, out)
    _kernels()["q_norm_rope"][(out.shape[0] * heads,)](*args, D=d, num_warps=_warps(d), **_pdl(q))
    return out


def kv_rows_args(k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor, k_eps: float, v_eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor,
                 slot: torch.Tensor) -> tuple[int, tuple, int]:
    """The KV rows' checks (FoldKvInputError) and arguments (rows B * Hkv, the row args, d): RoPE(k_norm(k)) and
    v_norm(v) (k, v [B, 1, Hkv * d] read in place) into rings [B, Hkv, W, d] at slot ([1] int64, read on the device)."""
    b, hkv, w, d = ring_k.shape
    _check_head_dim(d)
    ks, vs = _head_rows(k, hkv, d, "k"), _head_rows(v, hkv, d, "v")
    if (ring_v.shape != ring_k.shape or not ring_k.is_contiguous() or not ring_v.is_contiguous()
            or ring_k.dtype != k.dtype or ring_v.dtype != v.dtype or k.shape[0] != b or v.shape[0] != b
            or k_weight.shape != (d,)):
        raise FoldKvInputError(f"rings {tuple(ring_k.shape)} {ring_k.dtype} / {tuple(ring_v.shape)} {ring_v.dtype}"
                               f" (packed) for k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}")
    if slot.shape != (1,) or slot.dtype != torch.long or slot.device != ring_k.device:
        raise FoldKvInputError(f"slot: expected a [1] int64 tensor on {ring_k.device}, got {tuple(slot.shape)}"
                               f" {slot.dtype} on {slot.device}")
    cos, sin = _rope_table(cos, b, d, k.dtype, "cos"), _rope_table(sin, b, d, k.dtype, "sin")
    return b * hkv, (k, v, k_weight, cos, sin, ring_k, ring_v, slot, hkv, ks, vs, w, d, float(k_eps),
                     float(v_eps)), d


def sliding_prologue(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """A sliding layer's decode step before its ring attention, from its projections' outputs q, k, v [B, 1, H * d]:
    `q_norm_rope` (returned, [B, Hq, d]) and the KV rows into the rings (`kv_rows_args`) in one launch, bitwise the
    two launches (tests/step_twins.py's `kv_to_ring` after `q_norm_rope`); both checks run first."""
    d = ring_k.shape[-1]
    out, q_args, dq = q_rows_args(q, attn.q_norm.weight, norm_eps(attn.q_norm), cos, sin, q.shape[-1] // d)
    kv_rows, kv_args, dk = kv_rows_args(k, v, attn.k_norm.weight, norm_eps(attn.k_norm), norm_eps(attn.v_norm), cos,
                                        sin, ring_k, ring_v, slot)
    if dq != dk:
        raise FoldKvInputError(f"q heads of {dq} and rings of {dk}: one head_dim for both")
    q_rows = out.shape[0] * out.shape[1]
    _kernels()["sliding_prologue"][(q_rows + kv_rows,)](*q_args, *kv_args, q_rows, D=dq, num_warps=_warps(dq),
                                                        **_pdl(q))
    return out
