"""The decode step's one-row projections as a streaming read with a multiply: no tensor cores, no shared memory.

What it tries: the read roof's own kernel (a Triton loop of 8 KB register loads, lab.bench.roofs) reaches the roof;
a GEMV at one row is that loop with one FMA per weight element (61.4 G FMAs a step: ~2 ms of the H200's CUDA cores,
under the 13.6 ms of the read). The stream GEMV (`gemv_stream.py`) ran its loads through the mma path's shared-memory
stages and reached 0.75 of the roof; this one keeps the tile in registers, as the roof's kernel does, and accumulates
ROWS x BLOCK_K float32 partial products, summed along K once at the end (float32, rounded once to the output dtype).
A program owns ROWS whole weight rows: small ROWS make short programs (a projection's tail is about one program's
time) at the cost of more of them.
Prediction (bench/MODEL_DECODE_NOTES.md run 6, written before any run): the roof's ~0.95 in a projection's body, a
tail of about one program's time (ROWS=4 over K=5,376: 43 KB, ~6 us at a shared read), so ~0.88-0.92 of the roof
for the step's 411 projections at one row, against cuBLAS on graph branches' 0.89: a win only with ROWS <= 4.
Outcome (bench/gemv_probe.py --rows 1 --arms ..., papermill_runs/h200-20261204-s21/gemv.log; MODEL_DECODE_NOTES run 6):
ROWS=2 alone 15.54 ms (0.87 of the roof), ROWS=4 on graph branches 15.15 ms against cuBLAS on branches' 15.18 and the
merged cuBLAS GEMVs' 14.57: a tie with the branches, behind the merge; not adopted. Rows > 1: F.linear (eight rows would need 8 FMAs a weight element, past the CUDA cores' rate).

    gemv(x, weight, rows_per_program=4)     # x [..., K] of one row @ weight [N, K]^T
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # weight elements a program loads per step: 8 KB of bf16, the roof kernel's step


@triton.jit
def gemv_fma_rows(x_ptr, w_ptr, y_ptr, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """y [N] = w [N, K] @ x [K] for the ROWS rows of this program (N % ROWS == 0, K % BLOCK_K == 0)."""
    rn = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    w_at = w_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_at + k0, eviction_policy="evict_first").to(tl.float32)
        x = tl.load(x_ptr + k0 + rk).to(tl.float32)
        acc += w * x[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def config(n: int, k: int, rows_per_program: int = 4) -> dict | None:
    """ROWS and BLOCK_K for a weight [n, k]: BLOCK_K the largest power of two up to TILE / ROWS that divides k (the
    31B's K = 5,376 = 21 x 256 takes 256); None when nothing of at least 128 divides it, or ROWS does not divide n."""
    block_k = TILE // rows_per_program
    while block_k >= 128 and k % block_k:
        block_k //= 2
    if n % rows_per_program or block_k < 128:
        return None
    # 16 elements a thread a step (two 16-byte loads), as the roof's kernel: 512 tile elements a warp, up to 8 warps
    return dict(ROWS=rows_per_program, BLOCK_K=block_k, num_warps=max(1, min(8, rows_per_program * block_k // 512)))


def gemv(x: torch.Tensor, weight: torch.Tensor, rows_per_program: int = 4,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T for one row of x on CUDA in bf16/fp16 (float32 accumulation, rounded once);
    anything else: F.linear. `out` ([1, N], contiguous): written in place (a test poisons it first)."""
    n, k = weight.shape
    cfg = config(n, k, rows_per_program)
    if (cfg is None or x.numel() != k or not x.is_cuda or x.dtype != weight.dtype
            or x.dtype not in (torch.bfloat16, torch.float16) or not weight.is_contiguous()):
        return torch.nn.functional.linear(x, weight)
    row = x.reshape(k).contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    gemv_fma_rows[(n // cfg["ROWS"],)](row, weight, y, k, **cfg)
    return y.view(*x.shape[:-1], n)
