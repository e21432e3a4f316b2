"""The library's PDL GEMV (foldkv.gemv) for a few rows of x: x [M, K] (M = 1..8) @ W [N, K]^T, each weight row read
once against all M rows of x.

Question: at batch 8 the decode step's 241 projections are cuBLAS's GEMVs (foldkv.gemv refuses: "not one row"), and
the 31B's 4K x 8 cell is 19.05 ms against a floor of 15.44 (1.234x; the target 1.15x, MODEL_DECODE_NOTES run 12). At
one row the library's Triton GEMV under programmatic dependent launch saved 0.85 ms of the step (runs 11-12: its first
weight tile loaded before `gdc_wait`, the chain's launches and ramps hidden). Does the same kernel, carrying M rows of
x, read the weights as well at M = 2..8, so the same chain can replace cuBLAS at batch 2..8?

Design (`gemv_m_rows`): gemv_pdl.gemv_pdl_rows' program (ROWS whole weight rows, a register loop of BLOCK_K columns, float32
products summed along K once at the end, rounded once to bf16) with M exact (a constexpr, one build per M: nothing is
padded or masked) and one float32 accumulator tile (ROWS, BLOCK_K) per row of x: ROWS x M partial sums for each
column a thread owns. The weight tile is loaded once per step and multiplied against the M rows of x (x is M x K x 2
bytes, <= 344 KB: it stays in L2 and mostly in L1; each program reads all of it). The first weight tile is loaded
before `gdc_wait()` (PREFETCH = 1, gemv's), then `gdc_launch_dependents()`; the loop keeps the next weight tile in
flight while it multiplies the current one (a register double buffer: at M = 8 the accumulators leave few warps an
SM, and the second tile doubles each thread's bytes in flight for 4 x ROWS registers). x is loaded after the wait, tile
by tile. The tile: BLOCK_K = 256 x warps (a thread's 8 consecutive columns of all ROWS rows: the x it loads and
converts serves ROWS weight rows), at most 2,048 columns (8 warps) for M <= 2 and 512 (2 warps) above (smaller
programs where registers allow fewer an SM). Reused from the library: `foldkv.gemv` (HAS_GDC, the grid dependency
control instructions, its dtype / bias / layout refusals), `foldkv.lab.pdl_checks` (the race check's producer and
its bitwise comparison, the PTX scan).

Registers (the argument of MODEL_DECODE_NOTES run 13): a thread holds 8 x ROWS x M float32 accumulators, 8 x M x values
(bf16, converted to float32 as used), two weight tiles (2 x 4 x ROWS registers of packed bf16) and ~30 of addresses
and loop state. ROWS = 2 at M = 8: 128 + 32-64 + 16 + 30 ~ 210-240 of the 255 a thread may have (no spill, ~8 warps an
SM); ROWS = 4 at M = 8: 256 accumulators alone: it spills. ROWS = 2 at M = 2: ~90 (as many warps as the one-row
kernel's). And the CUDA cores: a weight element costs M FMAs + one conversion + M / ROWS x conversions, ~13
instructions at M = 8, ROWS = 2: ~12 ms of the H200's issue rate for the step's 30.7 G weight elements, against a 13.9
ms read. `kernel_stats` reads n_regs / n_spills off the compiled kernels (the probe records them).

Prediction (bench/MODEL_DECODE_NOTES.md run 13, written before any run): at M = 2 a tie with cuBLAS merged (as the
one-row kernel at M = 1); at M = 8 slower than cuBLAS merged by ~1.3x (CUDA-core issue and registers, not bytes); ROWS
= 4 at M = 8 spills.
Outcome (run 13, s24): at 8 rows the merged step's 241 GEMVs took 44.24 ms against cuBLAS merged's 15.23 (2.9x; the
prediction said ~1.34x): ~8 warps an SM hide neither the loads nor the FMAs. Lost; the library takes the tensor-core
kernel (`foldkv.gemv.gemv_tc`) at 1..16 rows. Kept as the control.

    linear(x, weight, rows=2, prefetch=1, pdl=True)   # x [..., K] of 1..8 rows @ weight [N, K]^T; else F.linear
    refusal(x, weight, ...), shape_refusal(m, n, k, ...) # None when linear() takes the kernel, else why not
    config(n, k, m, rows, prefetch)                      # the launch's constexprs and warps, None without a tile
    bound_check(y, x, w)                                 # against float64: the float32-accumulation bound
    race_check(m, rows, graph), ptx_order(m, rows)       # PDL: the wait holds / no x load before it (lab.pdl_checks)
    kernel_stats(k, m, rows)                             # n_regs, n_spills of the build for [*, k] at m rows
"""

from __future__ import annotations

from collections import Counter

import torch

from foldkv import gemv as lib

MAX_M = 8  # rows of x a launch takes (the decode step's batch up to 8)
ROWS = 2  # weight rows a program (gemv_pdl.ROWS, the one-row GEMV's; the probe's arms try 1, 2, 4)
PREFETCH = 1  # weight tiles loaded before the wait: 1 (gemv_pdl.PREFETCH) or 0
HAS_GDC = lib.HAS_GDC
triton = lib.triton

_CALLS: Counter = Counter()  # "kernel" and each refusal's reason since reset()


if HAS_GDC:
    import triton.language as tl

    from foldkv.gemv import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _x_tile(x_ptr, j, K, cols):
        """Row j of x [M, K] (contiguous rows), columns `cols`, as float32."""
        return tl.load(x_ptr + j * K + cols).to(tl.float32)

    @triton.jit
    def _fma_row(acc, wf, x_ptr, j, K, cols):
        """acc + wf * x[j, cols] (float32 products of bf16 values: exact; the add rounds)."""
        return acc + wf * _x_tile(x_ptr, j, K, cols)[None, :]

    @triton.jit
    def _store_row(y_ptr, j, N, rn, acc):
        """y[j, rn] = the row sums of acc, rounded once to y's dtype."""
        tl.store(y_ptr + j * N + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))

    @triton.jit
    def _tile(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, wf, x_ptr, K, cols, M: tl.constexpr):
        """One weight tile (float32) against the M rows of x: each accumulator j < M gains wf * x[j, cols]."""
        acc0 = _fma_row(acc0, wf, x_ptr, 0, K, cols)
        if M > 1:
            acc1 = _fma_row(acc1, wf, x_ptr, 1, K, cols)
        if M > 2:
            acc2 = _fma_row(acc2, wf, x_ptr, 2, K, cols)
        if M > 3:
            acc3 = _fma_row(acc3, wf, x_ptr, 3, K, cols)
        if M > 4:
            acc4 = _fma_row(acc4, wf, x_ptr, 4, K, cols)
        if M > 5:
            acc5 = _fma_row(acc5, wf, x_ptr, 5, K, cols)
        if M > 6:
            acc6 = _fma_row(acc6, wf, x_ptr, 6, K, cols)
        if M > 7:
            acc7 = _fma_row(acc7, wf, x_ptr, 7, K, cols)
        return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7

    @triton.jit
    def gemv_m_rows(x_ptr, w_ptr, y_ptr, N, K, M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREFETCH: tl.constexpr, GDC: tl.constexpr, RED_X_EARLY: tl.constexpr = False):
        """y [M, N] = x [M, K] @ w [N, K]^T for this program's ROWS weight rows (N % ROWS == 0, K % BLOCK_K == 0;
        x, w, y contiguous). PREFETCH: the first weight tile loaded before the wait (GDC). The loop loads tile t + 1
        before it multiplies tile t. RED_X_EARLY (a red twin for the race check, never for use): x's first tile of
        row 0 loaded before the wait too, and used."""
        rn = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        w_rows = w_ptr + rn[:, None] * K
        rk = tl.arange(0, BLOCK_K)
        if PREFETCH:
            w_cur = tl.load(w_rows + rk[None, :], eviction_policy="evict_first")
        if RED_X_EARLY:
            x_early = tl.load(x_ptr + rk).to(tl.float32)
        if GDC:
            gdc_wait()
            gdc_launch_dependents()
        if not PREFETCH:
            w_cur = tl.load(w_rows + rk[None, :], eviction_policy="evict_first")
        acc0 = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        acc4 = acc0
        acc5 = acc0
        acc6 = acc0
        acc7 = acc0
        if RED_X_EARLY:  # the red twin: row 0's first tile from the x loaded before the wait
            acc0 = acc0 + w_cur.to(tl.float32) * x_early[None, :]
        for k0 in range(0, K - BLOCK_K, BLOCK_K):
            w_next = tl.load(w_rows + (k0 + BLOCK_K) + rk[None, :], eviction_policy="evict_first")
            wf = w_cur.to(tl.float32)
            if RED_X_EARLY:
                first = k0 == 0
                acc0_keep = acc0
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                                                                   wf, x_ptr, K, k0 + rk, M)
            if RED_X_EARLY:
                acc0 = tl.where(first, acc0_keep, acc0)  # row 0's first tile was taken from x_early
            w_cur = w_next
        wf = w_cur.to(tl.float32)
        if RED_X_EARLY:
            acc0_keep = acc0
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                                                               wf, x_ptr, K, (K - BLOCK_K) + rk, M)
        if RED_X_EARLY:
            acc0 = tl.where(K == BLOCK_K, acc0_keep, acc0)  # one tile only: it was the first
        _store_row(y_ptr, 0, N, rn, acc0)
        if M > 1:
            _store_row(y_ptr, 1, N, rn, acc1)
        if M > 2:
            _store_row(y_ptr, 2, N, rn, acc2)
        if M > 3:
            _store_row(y_ptr, 3, N, rn, acc3)
        if M > 4:
            _store_row(y_ptr, 4, N, rn, acc4)
        if M > 5:
            _store_row(y_ptr, 5, N, rn, acc5)
        if M > 6:
            _store_row(y_ptr, 6, N, rn, acc6)
        if M > 7:
            _store_row(y_ptr, 7, N, rn, acc7)


def config(n: int, k: int, m: int, rows: int = ROWS, prefetch: int = PREFETCH) -> dict | None:
    """The launch's constexprs for a weight [n, k] at m rows of x: BLOCK_K the largest power of two up to 2,048 (m <= 2)
    or 512 (m > 2) that divides k, at least 256 (a warp's 32 x 8 columns); num_warps = BLOCK_K / 256 (a thread owns 8
    columns of all ROWS rows). None when m is not 1..MAX_M, rows is not a power of two dividing n, prefetch is not
    0 or 1, or no tile divides k."""
    if not 1 <= m <= MAX_M or rows < 1 or rows & (rows - 1) or n % rows or prefetch not in (0, 1):
        return None
    block_k = 2048 if m <= 2 else 512
    while block_k >= 256 and k % block_k:
        block_k //= 2
    if block_k < 256:
        return None
    return dict(M=m, ROWS=rows, BLOCK_K=block_k, PREFETCH=prefetch, num_warps=block_k // 256)


def accumulator_registers(m: int, rows: int) -> int:
    """float32 accumulators a thread holds: 8 columns x ROWS rows x M rows of x."""
    return 8 * rows * m


def shape_refusal(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, w_contiguous: bool,
                  has_bias: bool, rows: int = ROWS, prefetch: int = PREFETCH) -> str | None:
    """None when a GEMV of m rows against a weight [n, k] is this kernel's, else why not: the library's refusals for
    the bias, the dtypes, the layout and the rows (`foldkv.gemv.rows_refusal`), then the tile."""
    why = lib.rows_refusal(m, MAX_M, x_dtype, w_dtype, w_contiguous, has_bias)
    if why is not None:
        return why
    if config(n, k, m, rows, prefetch) is None:
        return f"no tile for a [{n}, {k}] weight at {rows} rows a program"
    return None


def refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = ROWS,
            prefetch: int = PREFETCH) -> str | None:
    """None when `linear(x, weight, bias, rows=rows, prefetch=prefetch)` runs the kernel; else why it is F.linear."""
    return lib.tensor_refusal(x, weight, bias, lambda *a: shape_refusal(*a, rows, prefetch))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rows: int = ROWS,
           prefetch: int = PREFETCH, pdl: bool = True, out: torch.Tensor | None = None,
           _red_x_early: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T: the kernel when `refusal` is None (pdl: launched with launch_pdl and waiting,
    else the plain build and launch), else F.linear; each call counted (`report`). `out` ([M, N] contiguous, the
    kernel's route only): written in place."""
    why = refusal(x, weight, bias, rows, prefetch)
    _CALLS["kernel" if why is None else why] += 1
    if why is not None:
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    m = x.numel() // k
    cfg = config(n, k, m, rows, prefetch)
    xs = x.reshape(m, k)
    xs = xs if xs.is_contiguous() else xs.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    kw = dict(launch_pdl=True) if pdl else {}  # only passed when set, as gemv_pdl's launches
    gemv_m_rows[(n // rows,)](xs, weight, y, n, k, GDC=pdl, RED_X_EARLY=_red_x_early, **cfg, **kw)
    return y.view(*x.shape[:-1], n)


def report() -> dict:
    return {"kernel": _CALLS.get("kernel", 0), "refusals": {k: v for k, v in _CALLS.items() if k != "kernel"}}


def reset() -> None:
    _CALLS.clear()


# --- checks (GPU) ----------------------------------------------------------------------------------------------------
def bound_check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, chunk: int = 16384) -> dict:
    """y [..., N] against float64 x [..., K] @ w [N, K]^T, element by element: |y - ref| <= ulp_bf16(ref) + K 2^-23
    sum_k |x_k w_k| (the float32-accumulation bound of tests/test_gemv_gpu.py); in chunks of weight rows (the LM head's
    float64 copy would be 11 GB). {"within", "finite", "worst": the largest |y - ref| / bound}."""
    k = x.shape[-1]
    xd = x.reshape(-1, k).double()
    yd = y.reshape(xd.shape[0], -1).double()
    worst, finite = 0.0, bool(torch.isfinite(y).all())
    for a in range(0, w.shape[0], chunk):
        wd = w[a:a + chunk].double()
        ref = xd @ wd.T
        ulp = torch.pow(2.0, torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7).double()
        bound = ulp + k * 2.0 ** -23 * (xd.abs() @ wd.abs().T)
        worst = max(worst, float(((yd[:, a:a + chunk] - ref).abs() / bound).max()))
    return dict(within=finite and worst <= 1.0, finite=finite, worst=worst)


def _consumer(m: int, rows: int, prefetch: int = PREFETCH):
    """pdl_checks.race_check's consumer factory: make(k, n, red) -> consume(x [m, k]), the weight seeded (the same
    weight for the reference and the checked launch)."""
    def make(k: int, n: int, red: bool):
        g = torch.Generator(device="cuda").manual_seed(7)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        return lambda x: linear(x.view(m, k), w, rows=rows, prefetch=prefetch, pdl=True, _red_x_early=red)
    make.__name__ = f"gemv_m_rows(M={m}, ROWS={rows})"
    return make


def race_check(m: int = 8, rows: int = ROWS, graph: bool = False, k: int = 5376, n: int = 4096) -> dict:
    """foldkv.lab.pdl_checks.race_check with this kernel as the consumer of m rows: ok (the wait holds) and red_caught
    (the red twin, x's first tile of row 0 loaded before the wait, is wrong: PDL launched it early)."""
    from foldkv.lab import pdl_checks

    return dict(pdl_checks.race_check(_consumer(m, rows), k=k, n=n, graph=graph, rows=m), m=m, rows=rows)


def ptx_order(m: int = 8, rows: int = ROWS, k: int = 5376, n: int = 4096, red_x_early: bool = False) -> dict:
    """The PDL build's global loads before its first `griddepcontrol.wait` (foldkv.lab.pdl_checks' scan): the
    prefetched weight tile only (ROWS x BLOCK_K x 2 bytes / (16 bytes x threads) loads a thread); more with the red
    twin (its x load)."""
    from foldkv.lab import pdl_checks

    dev = torch.device("cuda")
    x = torch.ones(m, k, dtype=torch.bfloat16, device=dev)
    w = torch.ones(n, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    cfg = config(n, k, m, rows)
    compiled = gemv_m_rows[(n // rows,)](x, w, y, n, k, GDC=True, RED_X_EARLY=red_x_early, launch_pdl=True, **cfg)
    waits, before = pdl_checks.loads_before_wait(compiled.asm["ptx"])
    return dict(m=m, rows=rows, red_x_early=red_x_early, waits=waits, loads_before_wait=len(before),
                weight_loads_expected=rows * cfg["BLOCK_K"] * 2 // (32 * cfg["num_warps"] * 16), loads=before[:8])


def kernel_stats(k: int, m: int, rows: int = ROWS, prefetch: int = PREFETCH, pdl: bool = True) -> dict:
    """The registers and spills of the build a [*, k] weight at m rows takes (compiled by one launch on a [rows, k]
    weight: N is a runtime argument)."""
    dev = torch.device("cuda")
    cfg = config(rows, k, m, rows, prefetch)
    x = torch.zeros(m, k, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(rows, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(m, rows, dtype=torch.bfloat16, device=dev)
    kw = dict(launch_pdl=True) if pdl else {}
    compiled = gemv_m_rows[(1,)](x, w, y, rows, k, GDC=pdl, **cfg, **kw)
    return dict(k=k, m=m, rows=rows, n_regs=getattr(compiled, "n_regs", None),
                n_spills=getattr(compiled, "n_spills", None), accumulators=accumulator_registers(m, rows), **cfg)


__all__ = ["MAX_M", "ROWS", "PREFETCH", "HAS_GDC", "config", "accumulator_registers", "shape_refusal", "refusal",
           "linear", "report", "reset", "bound_check", "race_check", "ptx_order", "kernel_stats"]
