"""A sliding layer's prologue (`fused_step_ops.sliding_prologue`: q_norm_rope, then kv_to_ring) as one launch.

What it tries (MODEL_DECODE_NOTES "Run 22: prediction"; written before any GPU run): inside the 31B's step a sliding
layer runs, between its merged q|k|v GEMM and the ring attention's first cuBLAS matmul, two small PDL kernels:
`q_norm_rope_rows` (B x 32 programs: q_norm and RoPE of each query head) and `kv_norm_rope_ring` (B x 16: k_norm and
RoPE of each key head, v_norm of each value head, both into the rings' slot). They read different columns of the
same GEMM output and write different tensors: nothing of the second waits on the first but the launch order. Under
PDL the second is launched early and waits for the first to complete, so the layer pays the first kernel's run and
the wait's release before the second runs, 50 times a step. Here one kernel runs both row kinds (program ids below
B x Hq take a query row, the others a KV row), so they run side by side and the matmul after waits for one kernel.

The rows are the library kernels' own bodies (`fused_step_kernels._q_row`, `_kv_row`, which `q_norm_rope_rows` and
`kv_norm_rope_ring` call): the outputs are bitwise the two launches' by construction, and the checks are the
library's (`fused_step_ops.q_rows_args`, `kv_rows_args`: a bad input raises before anything is launched).

Prediction: one launch and one PDL boundary fewer a sliding layer. The second kernel's exposed cost today is its run
(a 512-byte row from L2, a reduction, two row stores: ~0.5-1 us at 1-8 rows) plus the wait's release (~0.3-0.5 us,
run 20's price of a link between small kernels): ~1-1.5 us a layer, **-0.03 to -0.08 ms a step** (50 sliding
layers), the same at every context and about the same at batch 1 and 8 (the rows are one wave either way: 48 and
384 one-warp programs). On s25's record that moves 4K x 1 from 1.155x to ~1.150-1.153x and 32K x 1 from 1.151x to
~1.146-1.149x (met); 4K x 8 (1.160x) stays over. What proves it wrong: the probe's cells not faster by >= 0.02 ms
at 4K x 1 (the second kernel's run was hidden behind the first's tail, so the boundary is all there was and it
costs < 0.4 us), or the probe counting fewer than 50 one-launch prologues a step (the route did not take them).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_sliding_prologue_one_gpu.py` (bitwise the two launches at the 31B's
   sliding geometry at 1, 3, 8 rows into poisoned outputs; the synthetic model's graph generate() bitwise; a red twin);
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --prologue-ab` (label "one-launch prologue"; the calls it took are printed).
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch
from torch import nn

from foldkv import fused_step, fused_step_ops
from foldkv.fused_step_kernels import triton

if triton is not None:
    import triton.language as tl

    from foldkv.fused_step_kernels import _chain, _kv_row, _q_row

    @triton.jit
    def sliding_prologue_rows(x_ptr, q_w_ptr, q_cos_ptr, q_sin_ptr, y_ptr, q_heads, x_stride, q_n, q_eps,
                              k_ptr, v_ptr, k_w_ptr, k_cos_ptr, k_sin_ptr, ring_k_ptr, ring_v_ptr, slot_ptr, kv_heads,
                              k_stride, v_stride, window, kv_n, eps_k, eps_v, q_rows, D: tl.constexpr,
                              GDC: tl.constexpr = False):
        """Program r < q_rows: query row r (`q_norm_rope_rows`); else KV row r - q_rows (`kv_norm_rope_ring`)."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        if row < q_rows:
            _q_row(row, x_ptr, q_w_ptr, q_cos_ptr, q_sin_ptr, y_ptr, q_heads, x_stride, q_n, q_eps, D)
        else:
            _kv_row(row - q_rows, k_ptr, v_ptr, k_w_ptr, k_cos_ptr, k_sin_ptr, ring_k_ptr, ring_v_ptr, slot_ptr,
                    kv_heads, k_stride, v_stride, window, kv_n, eps_k, eps_v, D)


def sliding_prologue(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, slot: torch.Tensor,
                     *, red_skip_kv: bool = False) -> torch.Tensor:
    """`fused_step_ops.sliding_prologue` (same arguments, same outputs, bitwise) in one launch. `red_skip_kv` (the
    tests' red twin, never for use): the grid holds the query rows only, so the rings' slot is not written."""
    d = ring_k.shape[-1]
    out, q_args, dq = fused_step_ops.q_rows_args(q, attn.q_norm.weight, fused_step_ops.norm_eps(attn.q_norm), cos,
                                                 sin, q.shape[-1] // d)
    kv_rows, kv_args, dk = fused_step_ops.kv_rows_args(k, v, attn.k_norm.weight, fused_step_ops.norm_eps(attn.k_norm),
                                                       fused_step_ops.norm_eps(attn.v_norm), cos, sin, ring_k, ring_v,
                                                       slot)
    if dq != dk:
        from foldkv.validate import FoldKvInputError

        raise FoldKvInputError(f"q heads of {dq} and rings of {dk}: one head_dim for both")
    q_rows = out.shape[0] * out.shape[1]
    grid = (q_rows + (0 if red_skip_kv else kv_rows),)
    sliding_prologue_rows[grid](*q_args, *kv_args, q_rows, D=dq, num_warps=fused_step_ops._warps(dq),
                                **fused_step_ops._pdl(q))
    return out


@contextlib.contextmanager
def installed(red_skip_kv: bool = False) -> Iterator[dict]:
    """fused_step's sliding prologue as this one launch for the block (bench/model_decode_probe.py --prologue-ab);
    yields {"calls": n}, the prologues it ran."""
    if triton is None:
        raise RuntimeError("sliding_prologue_one needs Triton")
    took = {"calls": 0}

    def one(*a, **kw):
        took["calls"] += 1
        return sliding_prologue(*a, red_skip_kv=red_skip_kv, **kw)

    with mock.patch.object(fused_step, "sliding_prologue", one):
        yield took


__all__ = ["sliding_prologue", "installed"]
