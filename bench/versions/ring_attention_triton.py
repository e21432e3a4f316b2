"""A sliding layer's decode attention over its ring as one Triton kernel: q.K^T, the masked softmax and P.V.

What it tried (written for the s22 run): `ring.ring_attention` is three launches a sliding layer (cuBLAS's q.K^T,
`fused_step.masked_softmax`, cuBLAS's P.V); with the prologue (`fused_step.q_norm_rope`, `kv_to_ring`) this would
make a sliding layer's attention three kernels instead of ten. The kernel keeps every rounding point of
ring_attention (scores rounded to bf16, times scaling rounded, the float32 softmax rounded, P.V accumulated in float32
and rounded once); a program is one (sequence, KV head): its GROUP query rows padded to 16 for tl.dot against all W
ring slots, K loaded 16 columns at a time ([16, W] tiles: 32-byte pieces of each row), `splits` programs a head each
recomputing the scores and writing d / splits output columns.
Prediction (bench/MODEL_DECODE_NOTES.md run 8): ~0.6 ms a step saved on the 31B at 4K x 1, the risk being this
kernel at batch 1 (16 KV heads: few CTAs).
Outcome (`bench/model_decode_probe.py --sliding-ab`, papermill_runs/h200-20261204-s22/probe_sliding.*): the step
with the three kernels is 1.0 ms slower at 4K x 1 (device 19.33 against 18.33 ms), 2.2 at 4K x 8, 2.3 at 128K x 8:
this kernel costs ~20-45 us a layer where cuBLAS's two matmuls and the softmax take ~11. Its K loads are [16, W]
tiles of 32-byte row pieces, and each program streams a whole head's K (512 KB) through one SM. The library keeps
the prologue kernels and ring_attention's three launches. Not pursued further here: a split over the window with a
second pass for the softmax's normalisation would need a fourth launch.
Its GPU test against float64 at ring_attention's rounding points passed (the red twin "scores' rounding left out" did
not separate at those inputs: pytest_sliding.log of that run).

    python3 bench/versions/ring_attention_triton.py      # repo root, lib on PYTHONPATH: checks against ring_attention, times both
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foldkv.fused_step_kernels import _rounded
from foldkv.fused_step_ops import _block, _check_head_dim

RING_SPLITS_MAX = 4  # most programs a KV head


@triton.jit
def ring_attention_rows(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, heads_kv, window, scaling, GROUP: tl.constexpr,
                        GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, W_BLOCK: tl.constexpr,
                        SCALE: tl.constexpr, SPLIT: tl.constexpr):
    """One decode token's attention over a ring for KV head program_id(0) = b * heads_kv + kv: its GROUP query
    rows (heads kv * GROUP + r of q [B, heads_kv * GROUP, D], padded to GROUP_PAD >= 16 rows for tl.dot) against
    the window slots of K/V [B, heads_kv, window, D] (packed), mask [B, window] (uint8, 1: attend). As
    ring.ring_attention rounds: scores accumulated in float32 over D, rounded to the model dtype (torch's bf16
    matmul output); times scaling rounded again (SCALE); masked float32 softmax rounded to the model dtype;
    P.V accumulated in float32 over the window, rounded once. program_id(1) of SPLIT computes output columns
    [id * D / SPLIT, (id + 1) * D / SPLIT) (each recomputes the same scores: bitwise the same P)."""
    bh = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    b = bh // heads_kv
    out_ty = o_ptr.dtype.element_ty
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    slots = tl.arange(0, W_BLOCK)
    slot_ok = slots < window
    q_rows = (bh * GROUP + rows.to(tl.int64)) * D
    kv_rows = (bh * window + slots.to(tl.int64)) * D
    acc = tl.zeros((GROUP_PAD, W_BLOCK), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + q_rows[:, None] + dd[None, :], mask=row_ok[:, None], other=0.0)
        kt = tl.load(k_ptr + kv_rows[None, :] + dd[:, None], mask=slot_ok[None, :], other=0.0)
        acc = tl.dot(q, kt, acc)
    s = _rounded(acc, out_ty)
    if SCALE:
        s = _rounded(s * scaling, out_ty)
    live = tl.load(m_ptr + b * window + slots, mask=slot_ok, other=0) != 0
    s = tl.where((live & slot_ok)[None, :], s, float("-inf"))
    e = tl.exp(s - tl.max(s, axis=1)[:, None])
    p = _rounded(e / tl.sum(e, axis=1)[:, None], out_ty).to(out_ty)
    width: tl.constexpr = D // SPLIT
    for j in range(0, width, BLOCK_D):
        dd = part * width + j + tl.arange(0, BLOCK_D)
        v = tl.load(v_ptr + kv_rows[:, None] + dd[None, :], mask=slot_ok[:, None], other=0.0)
        o = tl.dot(p, v)
        tl.store(o_ptr + q_rows[:, None] + dd[None, :], _rounded(o, out_ty).to(out_ty), mask=row_ok[:, None])


def ring_splits(programs: int, d: int, device: torch.device) -> int:
    """Programs a KV head for `ring_attend`: doubled (up to RING_SPLITS_MAX, each a slice of >= 16 output columns)
    while the B x Hkv heads fill under half the SMs. Each recomputes its head's scores (K read again, from L2)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    splits = 1
    while splits * 2 <= RING_SPLITS_MAX and programs * splits * 2 <= sms and d // (splits * 2) >= 16:
        splits *= 2
    return splits


def ring_attend(q: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, mask: torch.Tensor, scaling: float,
                splits: int | None = None) -> torch.Tensor:
    """ring.ring_attention for one decode token in one kernel: q [B, Hq, d] packed (head h = kv * group + r),
    rings [B, Hkv, W, d] packed, mask [B, 1, 1, W] bool (True: attend; every row has one) -> [B, 1, Hq, d].
    Rounding points are ring_attention's: scores q.K^T accumulated in float32 and rounded to the model dtype (as
    torch's bf16 matmul returns them), times `scaling` rounded again when it is not 1.0, the masked softmax in float32
    rounded to the model dtype, P.V accumulated in float32 and rounded once. Only the order of the float32 sums
    differs (over d for a score, over W for the softmax's sum and for P.V): a score is torch's bitwise where its
    float32 sum is exact in any order (within one bf16 ulp plus d 2^-23 sum|q k| otherwise), a probability then within
    one bf16 ulp, and the output within sum_j ulp(p_j)|v_j| + W 2^-23 sum_j |p_j v_j| plus its own rounding (the
    GPU tests hold these bounds). `splits` programs a KV head (None: `ring_splits`), each computing d / splits output
    columns from the same scores: the output does not depend on it."""
    from foldkv.validate import FoldKvInputError

    b, hkv, w, d = ring_k.shape
    hq = q.shape[1] if q.dim() == 3 else -1
    _check_head_dim(d)
    if (q.dim() != 3 or q.shape != (b, hq, d) or hq % hkv or not q.is_contiguous() or ring_v.shape != ring_k.shape
            or not ring_k.is_contiguous() or not ring_v.is_contiguous() or not q.dtype == ring_k.dtype == ring_v.dtype):
        raise FoldKvInputError(f"ring_attend: q {tuple(q.shape)} {q.dtype} against rings {tuple(ring_k.shape)}"
                               f" {ring_k.dtype} / {tuple(ring_v.shape)} {ring_v.dtype}: packed, one dtype, whole"
                               " query groups")
    if mask.shape != (b, 1, 1, w) or mask.dtype != torch.bool:
        raise FoldKvInputError(f"ring mask: expected [{b}, 1, 1, {w}] bool, got {tuple(mask.shape)} {mask.dtype}")
    group = hq // hkv
    w_block, g_pad = _block(w), max(16, _block(group))
    if w_block * g_pad > 16384:
        raise FoldKvInputError(f"ring_attend holds a [{g_pad}, {w_block}] score tile; window {w} x group {group}"
                               " is past it")
    splits = ring_splits(b * hkv, d, q.device) if splits is None else int(splits)
    if splits < 1 or d % (splits * 16):
        raise FoldKvInputError(f"splits={splits}: each program takes a multiple of 16 of the {d} columns")
    m = mask.reshape(b, w).contiguous().view(torch.uint8)  # a view, no copy
    out = torch.empty((b, 1, hq, d), dtype=q.dtype, device=q.device)
    scaling = float(scaling)
    ring_attention_rows[(b * hkv, splits)](
        q, ring_k, ring_v, m, out, hkv, w, scaling, GROUP=group, GROUP_PAD=g_pad, D=d, BLOCK_D=16, W_BLOCK=w_block,
        SCALE=scaling != 1.0, SPLIT=splits, num_warps=8, num_stages=2)
    return out


def main(batch: int = 1, hq: int = 32, hkv: int = 16, d: int = 256, window: int = 1024, reps: int = 200) -> None:
    """Checks ring_attend against ring.ring_attention (within 2 bf16 ulps of the output here), then times both
    (CUDA events over `reps` launches each, 50 layers' rings rotated so they come from DRAM)."""
    from foldkv.masks import RingMask
    from foldkv.ring import ring_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    layers = 50
    q = torch.randn(batch, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    ks = [torch.randn(batch, hkv, window, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    vs = [torch.randn(batch, hkv, window, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    mask = torch.ones(batch, 1, 1, window, dtype=torch.bool, device="cuda")
    module = torch.nn.Module()
    module.scaling = 1.0
    want = ring_attention(module, q[:, :, None], ks[0], vs[0], RingMask(mask))[0]
    got = ring_attend(q, ks[0], vs[0], mask, 1.0)
    err = (got.float() - want.float()).abs().max().item()
    print(f"max |ring_attend - ring_attention| = {err:.3g}")
    for name, fn in (("ring_attention (cuBLAS x2 + softmax)", lambda i: ring_attention(
            module, q[:, :, None], ks[i], vs[i], RingMask(mask))), ("ring_attend (one kernel)", lambda i: ring_attend(
            q, ks[i], vs[i], mask, 1.0))):
        for i in range(layers):
            fn(i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for r in range(reps):
            fn(r % layers)
        b.record()
        b.synchronize()
        print(f"{name}: {1e3 * a.elapsed_time(b) / reps:.1f} us a layer (eager launches)")


if __name__ == "__main__":
    main()
