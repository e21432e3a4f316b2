"""The decode step's projections at 1..16 rows as a tensor-core skinny GEMM in Triton under programmatic dependent
launch (PDL): weights are written by no kernel of a step, so a program loads its first weight tile before its wait and
the next projection's bytes stream during the previous kernel's tail. Not bitwise cuBLAS: within the float32
accumulation bound |y - ref| <= ulp(ref) + K 2^-23 sum_k |x_k w_k| (tests/test_gemv_gpu.py).
"""

from __future__ import annotations

import torch

from .kernels.plan import DEFAULT_SMS
from .step_options import in_force
from .moved import moved

MAX_ROWS = 16  # the tensor-core kernel's padded side: rows of x a launch takes
DTYPES = (torch.bfloat16,)
TC_BLOCK_M = 16  # x's rows padded to the MMA's small side
TC_BLOCK_N = 64  # weight rows a program: wgmma's m64 for one warpgroup
TC_BLOCK_K = 128  # weight columns a pipeline stage: 16 KB of weight at 64 rows
TC_STAGES = 4  # Triton's num_stages: three tiles in flight a program, ~100 KB: two programs an SM
TC_PREFETCH = 1  # weight tiles loaded before the wait
SMS = DEFAULT_SMS  # the H200's SMs (`kernels.plan`): a grid covers at least this many programs, split-K if need be
MIN_SPLIT_TILES = 4  # a K split keeps at least this many BLOCK_K tiles (the pipeline fills)
REDUCE_BLOCK = 1024  # split_sum's elements a program

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: linear() is F.linear
    triton = None
HAS_GDC = False
if triton is not None:
    try:  # Triton's grid dependency control (triton-lang/triton PR 6394; tutorial 11-programmatic-dependent-launch)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
        HAS_GDC = True
    except ImportError:
        pass

if HAS_GDC:

    @triton.jit
    def gemv_tc(x_ptr, w_ptr, y_ptr, ws_ptr, M, N, K, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, SPLIT: tl.constexpr, EVEN_N: tl.constexpr,
                GDC: tl.constexpr):
        """y [M, N] = x [M, K] @ w [N, K]^T (x, w, y contiguous; M <= BLOCK_M) for this program's BLOCK_N weight rows
        (program_id 0) and K range [pid1 K_SPLIT, (pid1 + 1) K_SPLIT) (program_id 1; K_SPLIT % BLOCK_K == 0).
        SPLIT == 1: y rounded once from float32; else the float32 partial into ws [SPLIT, M, N] (split_sum adds).
        PREFETCH: the range's first weight tile loaded before the wait (GDC); x only after it (the race check's red
        twin, which loads it before, is the lab's: `foldkv.lab.pdl_checks.gemv_tc_x_early`, made from this source)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        k_lo = pid_k.to(tl.int64) * K_SPLIT
        live_n = rn < N
        live_m = rm < M
        w_at = w_ptr + rn[:, None] * K + (k_lo + rk)[None, :]  # [BLOCK_N, BLOCK_K]
        x_at = x_ptr + rm[None, :] * K + (k_lo + rk)[:, None]  # [BLOCK_K, BLOCK_M]: x transposed, K contiguous
        if PREFETCH:
            if EVEN_N:
                w_head = tl.load(w_at, eviction_policy="evict_first")
            else:
                w_head = tl.load(w_at, mask=live_n[:, None], other=0.0, eviction_policy="evict_first")
        if GDC:
            gdc_wait()
            gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if PREFETCH:
            x_head = tl.load(x_at, mask=live_m[None, :], other=0.0)
            acc = tl.dot(w_head, x_head, acc=acc)
        for k0 in range(PREFETCH * BLOCK_K, K_SPLIT, BLOCK_K):
            if EVEN_N:
                w = tl.load(w_at + k0, eviction_policy="evict_first")
            else:
                w = tl.load(w_at + k0, mask=live_n[:, None], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_at + k0, mask=live_m[None, :], other=0.0)
            acc = tl.dot(w, xt, acc=acc)
        live = live_m[None, :] & live_n[:, None]
        if SPLIT == 1:
            tl.store(y_ptr + rm[None, :] * N + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=live)
        else:
            row = (pid_k * M + rm[None, :]).to(tl.int64)
            tl.store(ws_ptr + row * N + rn[:, None], acc, mask=live)

    @triton.jit
    def split_sum(ws_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
        """y [MN] = sum over s < SPLIT of ws [s, MN] (float32, in the order s = 0, 1, ...), rounded once to y's dtype.
        With GDC: its dependents may launch at once (the trigger first), the wait before its first load."""
        if GDC:
            gdc_launch_dependents()
            gdc_wait()
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < MN
        acc = tl.load(ws_ptr + offs, mask=live, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ws_ptr + s * MN + offs, mask=live, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=live)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tc_config(n: int, k: int, m: int, block_n: int = TC_BLOCK_N, block_k: int = TC_BLOCK_K, stages: int = TC_STAGES,
              split: int | None = None, prefetch: int = TC_PREFETCH, sms: int = SMS) -> dict | None:
    """gemv_tc's launch for a weight [n, k] at m rows of x, or None when it has none. BLOCK_K: the largest power of two
    up to block_k dividing k (>= 64); SPLIT (None: chosen): the smallest split of K's tiles that gives >= sms programs,
    each split >= MIN_SPLIT_TILES tiles. The keywords are the lab's variants (bench/gemv_probe.py)."""
    if not 1 <= m <= MAX_ROWS or n < 1 or block_n not in (64, 128) or prefetch not in (0, 1) or stages < 1:
        return None
    bk = block_k
    while bk >= 64 and k % bk:
        bk //= 2
    if bk < 64:
        return None
    tiles = k // bk
    if split is None:
        fits = [s for s in range(1, tiles + 1) if tiles % s == 0 and tiles // s >= min(MIN_SPLIT_TILES, tiles)
                and tiles // s >= prefetch]
        split = next((s for s in fits if _cdiv(n, block_n) * s >= sms), fits[-1] if fits else 1)
    if split < 1 or tiles % split or tiles // split < max(prefetch, 1):
        return None
    return dict(BLOCK_M=TC_BLOCK_M, BLOCK_N=block_n, BLOCK_K=bk, PREFETCH=prefetch, SPLIT=split,
                num_warps=4 if block_n == 64 else 8, num_stages=stages)


def tc_launch(xs: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, cfg: dict, pdl: bool = True, *,
              ws: torch.Tensor | None = None):
    """gemv_tc (and split_sum when cfg splits K) on x [m, K] (contiguous) into y [m, N]; returns the GEMM's compiled
    kernel. ws ([SPLIT, m, N] float32): the partials are left there unsummed, for a reader that sums them."""
    n, k = weight.shape
    m = xs.shape[0]
    split = cfg["SPLIT"]
    summed = ws is None
    ws = (y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=y.device)) if summed else ws
    kw = dict(launch_pdl=True) if pdl else {}
    compiled = gemv_tc[(_cdiv(n, cfg["BLOCK_N"]), split)](xs, weight, y, ws, m, n, k, k // split,
                                                          EVEN_N=n % cfg["BLOCK_N"] == 0, GDC=pdl, **cfg, **kw)
    if split > 1 and summed:
        sum_partials(ws, y, pdl)
    return compiled


def sum_partials(ws: torch.Tensor, y: torch.Tensor, pdl: bool = True) -> None:
    """y [m, N] = the float32 partials ws [SPLIT, m, N] added in the order 0, 1, ... and rounded once (`split_sum`)."""
    mn = ws.shape[1] * ws.shape[2]
    split_sum[(_cdiv(mn, REDUCE_BLOCK),)](ws, y, mn, SPLIT=ws.shape[0], BLOCK=REDUCE_BLOCK, GDC=pdl, num_warps=4,
                                          **(dict(launch_pdl=True) if pdl else {}))


def rows_refusal(rows: int, max_rows: int, x_dtype: torch.dtype, w_dtype: torch.dtype, w_contiguous: bool,
                 has_bias: bool) -> str | None:
    """What a kernel taking 1..max_rows rows of x refuses before its tile (this one and the lab's versions)."""
    if has_bias:
        return "a bias"
    if w_dtype not in DTYPES or x_dtype != w_dtype:
        return f"{x_dtype} x {w_dtype}, not bf16 x bf16"
    if not w_contiguous:
        return "the weight is not contiguous"
    if rows < 1:
        return "no row"
    if rows > max_rows:
        return f"{rows} rows, more than {max_rows}"
    return None


def shape_refusal(rows: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, w_contiguous: bool,
                  has_bias: bool) -> str | None:
    """The part of `refusal` that reads no device."""
    if (why := rows_refusal(rows, MAX_ROWS, x_dtype, w_dtype, w_contiguous, has_bias)) is not None:
        return why
    if tc_config(n, k, rows) is None:
        return f"no tile for a [{n}, {k}] weight"
    return None


def refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """None when `linear(x, weight, bias)` runs the kernel; else the reason it is F.linear."""
    if not in_force().pdl:
        return "StepOptions.pdl is off"
    return tensor_refusal(x, weight, bias, shape_refusal)


def tensor_refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shape_refusal_of) -> str | None:
    """A GEMV kernel's route on the tensors (this one's and the lab's versions'): their shapes, the kernel's
    `shape_refusal_of(rows, n, k, x_dtype, w_dtype, w_contiguous, has_bias)`, the device, Triton's GDC."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return "not a projection's shapes"
    n, k = weight.shape
    if (why := shape_refusal_of(x.numel() // max(k, 1), n, k, x.dtype, weight.dtype, weight.is_contiguous(),
                                bias is not None)) is not None:
        return why
    if x.device.type != "cuda" or weight.device != x.device:
        return "not on CUDA"
    if not HAS_GDC:
        return "no Triton with grid dependency control (gdc_wait)"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias): the tensor-core kernel when `refusal` is None, else F.linear.
    `out` ([rows, N] contiguous, the kernel's route only): written in place."""
    return _route(x, weight, bias, out, summed=True)[0]


def linear_unsummed(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear` for a reader that sums split partials itself: (y, None) with y written, or, when the kernel split K,
    (y unwritten, ws [SPLIT, rows, N]): float32 partials to add in order 0, 1, ... and round once (`sum_partials`)."""
    return _route(x, weight, bias, None, summed=False)


def _route(x, weight, bias, out, summed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear` and `linear_unsummed`: (y, ws), ws the unsummed partials (None when summed, unsplit or F.linear)."""
    if refusal(x, weight, bias) is not None:
        return torch.nn.functional.linear(x, weight, bias), None
    n, k = weight.shape
    m = x.numel() // k
    cfg = tc_config(n, k, m)
    xs = x.reshape(m, k)
    xs = xs if xs.is_contiguous() else xs.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    ws = None if summed or cfg["SPLIT"] == 1 else torch.empty(cfg["SPLIT"], m, n, dtype=torch.float32,
                                                               device=x.device)
    tc_launch(xs, weight, y, cfg, ws=ws)
    return y.view(*x.shape[:-1], n), ws


def pdl_kw(t: torch.Tensor) -> dict:
    """fused_step's kernels' launch keywords: {GDC: True, launch_pdl: True} when the options in force ask for PDL,
    Triton has grid dependency control and `t` is on CUDA; else {} (the plain build). The constexpr GDC (the kernel's
    wait, a separate binary) and the launch option always go together: a PDL launch without the wait would race."""
    if in_force().pdl and HAS_GDC and t.is_cuda:
        return dict(GDC=True, launch_pdl=True)
    return {}


_MOVED = {"operand_refusal": "foldkv.gemv.rows_refusal (its first reasons)",
          "PDL_GEMV": "pass StepOptions(pdl=...) (foldkv.step_options) where the step is made",
          "report": "foldkv.lab.pdl_checks.gemv_routes() counts the routes",
          "reset": "foldkv.lab.pdl_checks.gemv_routes() counts a block's routes"}


__getattr__ = moved(__name__, _MOVED)


__all__ = ["MAX_ROWS", "HAS_GDC", "tc_config", "tc_launch", "rows_refusal", "shape_refusal", "refusal",
           "tensor_refusal", "linear", "linear_unsummed", "sum_partials", "pdl_kw"]
