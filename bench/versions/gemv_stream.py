"""The decode step's projections as a streaming GEMV in Triton: a few rows (tokens) against whole weight rows, one
program per 16-64 rows, every program resident at once so that they share the read and end together, float32
accumulation through one mma tile of rows, no split-K reduce.

What it tried: read the 31B's 61.4 GB of projection weights nearer the roof than cuBLAS's GEMVs (85% of it at one
row, with a split-K reduce after many of them), as the roof's own streaming kernel reads.
Prediction (bench/MODEL_DECODE_NOTES.md run 5): ~95% of the roof in a projection's body, ~15.4 ms for the step's 421
projections at one row against cuBLAS's ~16.3.
Measured (H200, `bench/gemv_probe.py`, the step's projections in one CUDA graph, roof 4,528 GB/s): 18.00 ms at one
row and 17.81 at eight (75-76% of the roof) against cuBLAS's 16.03 / 16.61 and cuBLAS on graph branches' 15.23 /
15.50; four programs an SM (8 KB tiles, three stages); 2 or 8 programs an SM, four stages, two stages or eight warps
no better (56-79%). Through generate() at 4K x 1: 21.36 ms a token against cuBLAS's 19.85. Lost to cuBLAS on graph
branches (`foldkv.fused_step`).

    gemv(x, weight)            # x [..., K] (at most 16 rows) @ weight [N, K]^T
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

@triton.jit
def gemv_rows(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """y [M, N] = x [M, K] @ w [N, K]^T for a few rows (M <= BLOCK_M), float32 accumulation, rounded once.
    One program streams BLOCK_N whole weight rows (N % BLOCK_N == 0, K % BLOCK_K == 0: no masks on the weight,
    16-byte loads); the grid is sized so that every program is resident at once and they share the read."""
    pid = tl.program_id(0).to(tl.int64)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    live = rm[:, None] < M
    w_at = w_ptr + rn[:, None] * K + rk[None, :]
    x_at = x_ptr + rm[:, None] * K + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        w = tl.load(w_at, eviction_policy="evict_first")
        x = tl.load(x_at, mask=live, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        w_at += BLOCK_K
        x_at += BLOCK_K
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=live)


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
    gemv_rows[grid](rows, weight, out, m, n, k, BLOCK_M=GEMV_MAX_ROWS, **cfg)
    return out.view(*x.shape[:-1], n)
