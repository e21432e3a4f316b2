"""The decode step's projections at one row as a Triton GEMV launched under programmatic dependent launch (PDL).

At batch 1 a Gemma 4 decode step is 241 projection GEMVs (the 31B, merged q|k|v and gate|up: `fused_step.MERGE`)
with ~600 small kernels between them. Each GEMV loses its launch, its ramp and its tail; under PDL a kernel may be
launched before the kernel ahead of it has finished and waits (`gdc_wait`, PTX `griddepcontrol.wait`) before it
reads what that kernel wrote. The weights are written by no kernel of a step, so this GEMV's programs load their
first weight tile *before* the wait: the next projection's bytes stream during the previous kernel's tail and the
small kernels between (the measurements: bench/MODEL_DECODE_NOTES.md; the lab version bench/versions/gemv_pdl.py).
Measured on the H200 (bench/gemv_probe.py --rows 1, the 31B's 411 projections in one graph): this configuration
15.46 ms against cuBLAS merged's 15.62 and 15.79 for the same kernel without PDL; in the 31B's step at 4K x 1, 0.85 ms
less a token than cuBLAS's GEMVs.

The kernel (`gemv_pdl_rows`): ROWS = 2 whole weight rows a program, a register loop of BLOCK_K columns (float32
partial products, summed along K once at the end, rounded once to the output dtype), its first PREFETCH = 1 tile of
weight columns loaded before `gdc_wait()`; then `gdc_launch_dependents()` (the kernel after it may launch once every
program here has passed its wait); the head tile's partial sum is added last. Not bitwise cuBLAS: within the float32
accumulation bound |y - ref| <= ulp(ref) + K 2^-23 sum_k |x_k w_k| of float64 (tests/test_gemv_gpu.py).

`linear(x, weight, bias)` runs it for x of exactly one row (B*T == 1) against a contiguous bf16 weight on CUDA with a
Triton that has grid dependency control (`triton.language.extra.cuda.gdc_wait`); anything else is
`torch.nn.functional.linear` (the reason counted: `report()`). `foldkv.fused_step` routes the step's projections
through it: the merged groups (`merged_linear`), each attention's o_proj, each MLP's down_proj and the LM head.

PDL is a chain property: every kernel launched with PDL must wait before it reads anything a kernel of the step wrote
and before it stores (weights may load before); one that never waits could finish before its predecessor and break
the ordering of every kernel after it. fused_step's own Triton kernels (norms, RoPE, GELU, softmax, the sliding
prologue) take `pdl_kw(x)`: with PDL they trigger their dependents at their top and wait before their first load
(`fused_step_kernels._chain`); the instructions are no-ops without the launch attribute, but Triton compiles PDL and
plain launches as separate binaries, so the constexpr GDC and the launch option always go together. Their outputs are
bitwise their plain launches' (only the ordering changes). Kernels that are not Triton's (cuBLAS, torch, TileLang)
never trigger: a PDL kernel after one of them starts once it has exited (launch latency hidden, not its tail).

    PDL_GEMV = True                       # the switch (tests and bench/model_decode_probe.py --pdl-ab flip it)
    linear(x, weight)                     # x [..., K] of one row @ weight [N, K]^T; else F.linear
    refusal(x, weight)                    # None when linear() takes the kernel, else why not
    pdl_kw(x)                             # the launch keywords of fused_step's kernels ({} without PDL)
    report(), reset()                     # the calls that took the kernel, the refusals by reason
"""

from __future__ import annotations

from collections import Counter

import torch

PDL_GEMV = True  # False: every projection is F.linear and fused_step's kernels launch without PDL
ROWS = 2  # weight rows a program: under PDL two rows' shorter tail beat four (15.46 against 15.83 ms, the 411 GEMVs)
PREFETCH = 1  # weight tiles loaded before the wait: one beat none (the ramp) and two (registers cut residency)
TILE = 4096  # weight elements a program loads a step: 8 KB of bf16 (gemv_fma's, the read roof kernel's)
DTYPES = (torch.bfloat16,)

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

_CALLS: Counter = Counter()  # "kernel" and each refusal's reason: what linear() did since reset()


if HAS_GDC:

    @triton.jit
    def gemv_pdl_rows(x_ptr, w_ptr, y_ptr, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HEAD: tl.constexpr,
                      GDC: tl.constexpr, RED_X_EARLY: tl.constexpr = False):
        """y [N] = w [N, K] @ x [K] for this program's ROWS rows (N % ROWS == 0; HEAD and K - HEAD multiples of
        BLOCK_K). The first HEAD weight columns are loaded before the wait (GDC), consumed after it. RED_X_EARLY (a red
        twin for the lab's race check, never for use): the head's x loaded before the wait too."""
        rn = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        w_rows = w_ptr + rn[:, None] * K
        if HEAD > 0:
            rh = tl.arange(0, HEAD)
            w_head = tl.load(w_rows + rh[None, :], eviction_policy="evict_first")
            if RED_X_EARLY:
                x_head = tl.load(x_ptr + rh)
        if GDC:
            gdc_wait()
            gdc_launch_dependents()
        if HEAD > 0:
            if not RED_X_EARLY:
                x_head = tl.load(x_ptr + rh)  # issued before the loop, summed after it
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        for k0 in range(HEAD, K, BLOCK_K):
            w = tl.load(w_rows + k0 + rk[None, :], eviction_policy="evict_first").to(tl.float32)
            x = tl.load(x_ptr + k0 + rk).to(tl.float32)
            acc += w * x[None, :]
        y = tl.sum(acc, axis=1)
        if HEAD > 0:
            y += tl.sum(w_head.to(tl.float32) * x_head.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))


def config(n: int, k: int, rows: int = ROWS, prefetch: int = PREFETCH) -> dict | None:
    """ROWS, BLOCK_K, HEAD and num_warps for a weight [n, k]: BLOCK_K the largest power of two up to TILE / rows that
    divides k (the 31B's K = 5,376 = 21 x 256 takes 256, 21,504 takes 1,024, 8,192 and 16,384 take 2,048); HEAD =
    prefetch x BLOCK_K. None when nothing of at least 128 divides k, rows does not divide n, or the head is past k."""
    block_k = TILE // rows
    while block_k >= 128 and k % block_k:
        block_k //= 2
    if rows < 1 or n % rows or block_k < 128 or prefetch * block_k > k:
        return None
    # 16 elements a thread a step (two 16-byte loads), as the roof's kernel: 512 tile elements a warp, up to 8 warps
    return dict(ROWS=rows, BLOCK_K=block_k, HEAD=prefetch * block_k,
                num_warps=max(1, min(8, rows * block_k // 512)))


def operand_refusal(x_dtype: torch.dtype, w_dtype: torch.dtype, w_contiguous: bool, has_bias: bool) -> str | None:
    """What no GEMV kernel of the step takes, whatever its rows and tile (this one and the lab's versions): a bias,
    other dtypes than bf16 x bf16, a weight that is not contiguous."""
    if has_bias:
        return "a bias"
    if w_dtype not in DTYPES or x_dtype != w_dtype:
        return f"{x_dtype} x {w_dtype}, not bf16 x bf16"
    if not w_contiguous:
        return "the weight is not contiguous"
    return None


def shape_refusal(rows: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, w_contiguous: bool,
                  has_bias: bool) -> str | None:
    """The part of `refusal` that reads no device: None when a GEMV of `rows` rows against a weight [n, k] is the
    kernel's, else why not."""
    why = operand_refusal(x_dtype, w_dtype, w_contiguous, has_bias)
    if why is not None:
        return why
    if rows != 1:
        return "not one row" if rows > 1 else "no row"
    if config(n, k) is None:
        return f"no tile for a [{n}, {k}] weight"
    return None


def refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """None when `linear(x, weight, bias)` runs the kernel; else the reason it is F.linear (the switch, a bias, the
    dtypes, the layout, the rows, a shape without a tile, then the device and Triton's PDL support)."""
    if not PDL_GEMV:
        return "PDL_GEMV is off"
    return tensor_refusal(x, weight, bias, shape_refusal)


def tensor_refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shape_refusal_of) -> str | None:
    """A GEMV kernel's route on the tensors themselves (this one's and the lab's versions'): their shapes, then the
    kernel's `shape_refusal_of(rows, n, k, x_dtype, w_dtype, w_contiguous, has_bias)`, then the device and Triton's grid
    dependency control. None when the kernel takes the call."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return "not a projection's shapes"
    n, k = weight.shape
    why = shape_refusal_of(x.numel() // max(k, 1), n, k, x.dtype, weight.dtype, weight.is_contiguous(),
                           bias is not None)
    if why is not None:
        return why
    if x.device.type != "cuda" or weight.device != x.device:
        return "not on CUDA"
    if not HAS_GDC:
        return "no Triton with grid dependency control (gdc_wait)"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None, _red_x_early: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias): the PDL GEMV when `refusal` is None, else F.linear; each call counted
    (`report`). `out` ([1, N] contiguous, the kernel's route only): written in place."""
    why = refusal(x, weight, bias)
    _CALLS["kernel" if why is None else why] += 1
    if why is not None:
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    cfg = config(n, k)
    row = x.reshape(k)
    row = row if row.is_contiguous() else row.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    gemv_pdl_rows[(n // cfg["ROWS"],)](row, weight, y, k, GDC=True, RED_X_EARLY=_red_x_early, launch_pdl=True,
                                       **cfg)
    return y.view(*x.shape[:-1], n)


def pdl_kw(t: torch.Tensor) -> dict:
    """The keywords fused_step's kernels launch with: {GDC: True, launch_pdl: True} when PDL_GEMV is on, Triton has
    grid dependency control and `t` (the kernel's input) is on CUDA; else none (a plain launch of the plain build)."""
    if PDL_GEMV and HAS_GDC and t.is_cuda:
        return dict(GDC=True, launch_pdl=True)
    return {}


def report() -> dict:
    """{"kernel": calls that ran the PDL GEMV, "refusals": {reason: calls}} since `reset()` (host calls: a graph's
    replays call nothing; a captured step counts its warm-up and its capture)."""
    return {"kernel": _CALLS.get("kernel", 0), "refusals": {k: v for k, v in _CALLS.items() if k != "kernel"}}


def reset() -> None:
    _CALLS.clear()


__all__ = ["PDL_GEMV", "ROWS", "PREFETCH", "HAS_GDC", "config", "operand_refusal", "shape_refusal", "refusal",
           "tensor_refusal", "linear", "pdl_kw", "report", "reset"]
