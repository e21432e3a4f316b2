"""The decode step's projections at 2..16 rows of x as a tensor-core skinny GEMM under programmatic dependent launch:
x [M, K] (M padded to 16) @ W [N, K]^T, the weight the MMA's large side, the batch its small one.

Question: at batch 8 the step's 241 merged projections are cuBLAS's (foldkv.gemv refuses: "not one row"), 14.90 ms
for the 61.4 GB at 0.911 of the roof (s21, run 6), and cuBLAS kernels never trigger their PDL dependents, so the
chain's boundaries keep their gaps (run 11: 1.26-2.61 us a boundary). The CUDA-core M-row GEMV
(`gemv_pdl_rows.py`, run 13) predicts its own loss at 8 rows: 13 instructions a weight element. On the tensor cores a
weight element costs a sixteenth of one MMA lane-op whatever M <= 16 is: the kernel is load-bound at every M. Does a
Triton tensor-core kernel read the weights as well as cuBLAS does, so that the step's chain can be PDL at batch 8?

Design (`gemv_tc`): each program owns BLOCK_N = 64 weight rows (the wgmma's M = 64 of one warpgroup, 4 warps) and one
K range (K_SPLIT columns, SPLIT ranges a weight), and loops over it in BLOCK_K = 128 steps:
acc [BLOCK_N, 16] += tl.dot(w [BLOCK_N, BLOCK_K], xT [BLOCK_K, 16]), bf16 operands, float32 accumulation; x's rows
>= M masked to zero (never read: a masked lane loads nothing), so one build serves M = 1..16 (M a runtime argument).
The first weight tile (PREFETCH = 1: 64 x 128 x 2 = 16 KB a program, 32 registers a thread) is loaded into registers
*before* `gdc_wait()`; then `gdc_launch_dependents()` (gemv.py's order); x only after the wait; the loop is Triton's
software pipeline (num_stages = 4: three weight tiles of 16 KB in flight a program, cp.async into shared memory).
SPLIT = 1: the output rounded once to bf16 and stored for the M real rows only, transposed back to [M, N]. SPLIT > 1:
each program stores its float32 partial into a workspace [SPLIT, M, N] and a second PDL kernel (`split_sum`: it
triggers at its top and waits before its first load, as fused_step's small kernels) sums the SPLIT partials in a fixed
order and rounds once: no atomics, so a PDL launch is bitwise its plain launch.

Why split-K, and only there (`config`): the grid must cover the H200's 132 SMs (a program streams one SM's share; an
SM without a program reads nothing). N / 64 programs cover them for the wide weights (q|k|v 256, global q|k 288,
gate|up 672, the LM head 4,096), not for the three weights whose N is the hidden size: o_proj (sliding, global) and
down_proj, N = 5,376: 84 programs. BLOCK_N below 64 leaves wgmma (m64: Triton falls back to mma.sync, the operand
path of gemv_stream.py, run 5: 0.75-0.78 of the roof), so those take SPLIT = the smallest divisor of K / BLOCK_K
that brings the grid to >= 132 programs: 2 (168 programs; K = 8,192 / 16,384 / 21,504 -> 32 / 64 / 84 tiles a
split), 120 of the step's 241 GEMVs, each one small reduce (8 x 5,376 x 2 float32 read, 86 KB written at 8 rows).
The unmerged 411 projections (the probe's `pdl_tc` arms) split their narrow ones too (q 8,192 -> 2, k / v 4,096 -> 3,
global k 2,048 -> 6). A split keeps >= MIN_SPLIT_TILES tiles (the pipeline fills) and the prefetched head.
Shared memory: 4 stages x (16 KB weight + 4 KB x) = 80 KB (+ the head's 16 KB if Triton stages it for the MMA) -> two
programs an SM (228 KB), 264 resident slots: every grid of the merged step but gate|up's (672) and the LM head's
(4,096) is resident at once, so its programs share the read and end together.

Numerics: the tensor cores' products of bf16 are exact; their float32 sums (aligned to the largest term, truncated:
Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021) lose at most one float32 ulp of a partial bounded by
sum_k |x_k w_k| per term, the split's fixed-order adds one more each (the count stays <= K), and the result is rounded
once to bf16: |y - ref| <= ulp(ref) + K 2^-23 sum_k |x_k w_k| of float64, the bound the library GEMV and the M-row
version are held to (`bound_check`: gemv_pdl_rows'). Not bitwise cuBLAS.

Reused: `foldkv.gemv` (HAS_GDC, gdc_wait / gdc_launch_dependents, its bias / dtype / layout refusals), the M-row
version `gemv_pdl_rows` (its float64 bound check), `foldkv.lab.pdl_checks` (the race check's producer and bitwise
comparison, the PTX scan).

Prediction (bench/MODEL_DECODE_NOTES.md run 14, written before any run): the merged step's 241 GEMMs (+ 120 split
reduces) at 8 rows ~16.0 ms (14.6-17.5) against cuBLAS merged's ~14.9: a loss of ~7% (a body at ~0.88 of the roof,
~2 us a boundary under PDL); break-even for the step only if the body reads at >= ~0.92; the same at 2 and 4 rows,
+2-4% at 16 (x's L2 re-reads).
Variants prepared after it (MODEL_DECODE_NOTES runs 17-19, not measured yet): `tail_fit` (two stages where the
default grid's last wave is a small tail: the global q|k) and `fixup`: split_sum folded into the GEMM, the last of a row
tile's SPLIT programs to arrive (an int32 counter a row tile, acq_rel atomics, set back to zero by that program) sums
the float32 partials in split_sum's order and rounds once, so it is bitwise the default and 120 launches fewer a step.
And `linear_gelu`: the MLP's down_proj with its input gelu_mul(gate, up) made in the GEMM's x loads from the merged
gate|up output (gelu_mul_rows' formula and roundings: bitwise the two kernels), 60 launches fewer a step.
`gemv_tc_lab` is a copy of the library kernel's body with the two options (a lab version's own file would copy it
too; what wins goes into the library's kernel as a constexpr and the copy goes).
Outcome (run 14, s24): 14.69 ms at 8 rows against cuBLAS merged's 15.23 in the same process (0.925 of the roof),
14.55 / 14.72 / 14.78 at 2 / 4 / 16 rows (cuBLAS 15.13 / 15.34 / 15.50); no split 15.47, 128-row tiles 15.34, plain
launches 14.87. The kernel, its configuration and its launch are now the library's (`foldkv.gemv`: gemv_tc,
split_sum, tc_config, tc_launch) for 1..16 rows; this file keeps the lab's variants and checks around them.

    linear(x, weight, pdl=True, **over)           # x [..., K] of 1..16 rows @ weight [N, K]^T; else F.linear
    refusal(x, weight, ...), shape_refusal(m, n, k, ...)   # None when linear() takes the kernel, else why not
    config(n, k, m, block_n=, block_k=, stages=, split=, prefetch=)   # the launch, None without a tile
    programs(n, cfg), smem_estimate(cfg), ctas_per_sm(cfg), launches(n, cfg)   # what the grid and the SM hold
    bound_check(y, x, w)                          # against float64 (gemv_pdl_rows')
    race_check(m, graph), ptx_order(m)            # PDL: the wait holds / no x load before it (lab.pdl_checks)
    kernel_stats(n, k, m)                         # n_regs, n_spills, shared bytes, wgmma in the PTX
    linear_gelu(gate, up, weight, **over)         # down_proj(gelu_mul(gate, up)), the activation in the x loads
    installed(fixup=, gelu=)                      # the step with those options (model_decode_probe --lab-ab)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import torch

from foldkv import gemv as lib
from foldkv.lab import pdl_checks
from versions import gemv_pdl_rows as rows_version

MAX_M = lib.MAX_ROWS  # rows of x a launch takes: the MMA's small side, padded to BLOCK_M
BLOCK_M = lib.TC_BLOCK_M
BLOCK_N = lib.TC_BLOCK_N  # weight rows a program: wgmma's m64 for one warpgroup
BLOCK_K = lib.TC_BLOCK_K  # weight columns a pipeline stage: 16 KB of weight a stage at BLOCK_N = 64
STAGES = lib.TC_STAGES  # Triton's num_stages: three tiles in flight a program
PREFETCH = lib.TC_PREFETCH  # weight tiles loaded before the wait: 1 or 0
SMS = lib.SMS  # the H200's SMs: the grid covers at least this many programs
MIN_SPLIT_TILES = lib.MIN_SPLIT_TILES  # a K split keeps at least this many BLOCK_K tiles
SMEM_PER_SM = 228 * 1024  # the H200's shared memory an SM (each resident CTA also reserves 1 KB)
SMEM_PER_CTA = 227 * 1024  # the most one CTA may have
HAS_GDC = lib.HAS_GDC
triton = lib.triton
bound_check = rows_version.bound_check  # the float32-accumulation bound against float64, in chunks of weight rows

# The probe's variants of the configuration (`config` keywords): the default, a wider K tile, fewer stages, a
# taller tile (two warpgroups), no split-K (the N = 5,376 weights at 84 programs).
TAIL_FILL = 0.4  # tail_fit: a last wave holding under this share of the resident slots is a tail worth removing
VARIANTS = {"": {}, "_k256": dict(block_k=256, stages=3), "_s3": dict(stages=3), "_s2": dict(stages=2),
            "_tailfit": dict(tail_fit=True), "_fixup": dict(fixup=True), "_n128": dict(block_n=128),
            "_nosplit": dict(split=1)}

_CALLS: Counter = Counter()  # "kernel" and each refusal's reason since reset()


if HAS_GDC:
    import triton.language as tl

    from foldkv.gemv import gdc_launch_dependents, gdc_wait

    from foldkv.fused_step_kernels import _rounded

    @triton.jit
    def _x_tile(x_ptr, u_ptr, off, live, GELU: tl.constexpr):
        """x's tile at `off` ([BLOCK_K, BLOCK_M] offsets, rows past M masked to 0), or with GELU the MLP's down_proj
        input made on the fly from its gate and up tiles: fused_step_kernels.gelu_mul_rows' formula and roundings."""
        if GELU:
            g = tl.load(x_ptr + off, mask=live, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + off, mask=live, other=0.0).to(tl.float32)
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # tanh(inner), as gelu_mul_rows
            act = _rounded(0.5 * g * (1.0 + t), tl.bfloat16)
            return _rounded(act * u, tl.bfloat16).to(tl.bfloat16)
        else:
            return tl.load(x_ptr + off, mask=live, other=0.0)

    @triton.jit
    def gemv_tc_lab(x_ptr, u_ptr, X_STRIDE, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, SPLIT: tl.constexpr,
                    EVEN_N: tl.constexpr, GDC: tl.constexpr, FIXUP: tl.constexpr, GELU: tl.constexpr,
                    RED_X_EARLY: tl.constexpr = False):
        """foldkv.gemv.gemv_tc's body (the same loads, wait, MMA loop and stores: a copy, see the header; x's rows at
        X_STRIDE) with two options. GELU: x is made from the gate rows at x_ptr and the up rows at u_ptr (`_x_tile`),
        so the MLP's gelu_mul kernel goes. FIXUP (SPLIT > 1): split_sum folded in: after its partial is stored, each
        program counts itself in on its row tile's counter (cnt [cdiv(N, BLOCK_N)] int32, zero between calls); the
        last of the SPLIT to arrive sums the partials in the order s = 0, 1, ... (split_sum's), rounds once, stores y
        and sets the counter back to 0."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        k_lo = pid_k.to(tl.int64) * K_SPLIT
        live_n = rn < N
        live_m = rm < M
        w_at = w_ptr + rn[:, None] * K + (k_lo + rk)[None, :]
        x_off = rm[None, :].to(tl.int64) * X_STRIDE + (k_lo + rk)[:, None]  # [BLOCK_K, BLOCK_M]: x transposed
        if PREFETCH:
            if EVEN_N:
                w_head = tl.load(w_at, eviction_policy="evict_first")
            else:
                w_head = tl.load(w_at, mask=live_n[:, None], other=0.0, eviction_policy="evict_first")
            if RED_X_EARLY:
                x_head = _x_tile(x_ptr, u_ptr, x_off, live_m[None, :], GELU)
        if GDC:
            gdc_wait()
            gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if PREFETCH:
            if not RED_X_EARLY:
                x_head = _x_tile(x_ptr, u_ptr, x_off, live_m[None, :], GELU)
            acc = tl.dot(w_head, x_head, acc=acc)
        for k0 in range(PREFETCH * BLOCK_K, K_SPLIT, BLOCK_K):
            if EVEN_N:
                w = tl.load(w_at + k0, eviction_policy="evict_first")
            else:
                w = tl.load(w_at + k0, mask=live_n[:, None], other=0.0, eviction_policy="evict_first")
            xt = _x_tile(x_ptr, u_ptr, x_off + k0, live_m[None, :], GELU)
            acc = tl.dot(w, xt, acc=acc)
        live = live_m[None, :] & live_n[:, None]
        if SPLIT == 1:
            tl.store(y_ptr + rm[None, :] * N + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=live)
        else:
            row = (pid_k * M + rm[None, :]).to(tl.int64)
            tl.store(ws_ptr + row * N + rn[:, None], acc, mask=live)
            if FIXUP:
                tl.debug_barrier()  # every thread's partial issued before the one release below
                arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLIT - 1:
                    tot = tl.load(ws_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], mask=live, other=0.0,
                                  cache_modifier=".cg")
                    for s in tl.static_range(1, SPLIT):
                        tot += tl.load(ws_ptr + (s * M + rm[None, :]).to(tl.int64) * N + rn[:, None], mask=live,
                                       other=0.0, cache_modifier=".cg")
                    tl.store(y_ptr + rm[None, :] * N + rn[:, None], tot.to(y_ptr.dtype.element_ty), mask=live)
                    tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")

_cdiv = lib._cdiv
_COUNTERS: dict = {}  # the fixup's row-tile counters, one buffer a weight (data_ptr, device): zero between calls


def counters(weight: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The fixup's counters for `weight` (int32 [cdiv(N, BLOCK_N)], zeros; made once a weight, so that launches on
    different weights never share one, and kept: each call leaves them at zero)."""
    key = (weight.data_ptr(), weight.device, cfg["BLOCK_N"])
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(_cdiv(weight.shape[0], cfg["BLOCK_N"]), dtype=torch.int32, device=weight.device)
    return _COUNTERS[key]


def launch(xs: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, cfg: dict, pdl: bool = True, *,
           red_x_early: bool = False, k_split: int | None = None, m: int | None = None,
           reduce_splits: int | None = None, grid: tuple | None = None, cnt: torch.Tensor | None = None,
           up: torch.Tensor | None = None):
    """The kernels on x [m, K] into y [m, N]: `foldkv.gemv.tc_launch` (with a red twin's keyword
    `foldkv.lab.pdl_checks.tc_launch_twin`); or `gemv_tc_lab`
    with cfg["FIXUP"] (a split weight, the `_fixup` variant: no split_sum; reduce_splits then the SPLIT the kernel is
    told, the red twin one more than the grid's never arrives; `cnt` its counters, default `counters(weight)`) and/or
    `up` given (xs the gate rows and up the up rows, one row stride: x = gelu_mul(gate, up) made in the kernel)."""
    if not cfg.get("FIXUP") and up is None:
        cfg = {k: v for k, v in cfg.items() if k != "FIXUP"}
        twins = dict(k_split=k_split, m=m, reduce_splits=reduce_splits, grid=grid)
        if red_x_early or any(v is not None for v in twins.values()):  # the red twins: the lab's copy of the kernel
            twins["red_x_early"] = red_x_early
            return pdl_checks.tc_launch_twin(xs, weight, y, cfg, pdl, **twins)
        return lib.tc_launch(xs, weight, y, cfg, pdl)
    n, k = weight.shape
    m = xs.shape[0] if m is None else m
    kw = {key: v for key, v in cfg.items() if key != "FIXUP"}
    split = kw["SPLIT"]
    fixup = bool(cfg.get("FIXUP"))
    ws = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=y.device)
    grid = (_cdiv(n, kw["BLOCK_N"]), split) if grid is None else grid
    told = split if reduce_splits is None else reduce_splits
    pdl_kw = dict(launch_pdl=True) if pdl else {}
    compiled = gemv_tc_lab[grid](xs, xs if up is None else up, xs.stride(0), weight, y, ws,
                                 (counters(weight, cfg) if cnt is None else cnt) if fixup else y, m, n, k,
                                 k // split if k_split is None else k_split, EVEN_N=n % kw["BLOCK_N"] == 0, GDC=pdl,
                                 FIXUP=fixup, GELU=up is not None, RED_X_EARLY=red_x_early,
                                 **dict(kw, SPLIT=told if fixup else split), **pdl_kw)
    if split > 1 and not fixup:
        pdl_checks.sum_partials_twin(ws, y, told, pdl)
    return compiled


def config(n: int, k: int, m: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K, stages: int = STAGES,
           split: int | None = None, prefetch: int = PREFETCH, sms: int = SMS, tail_fit: bool = False,
           fixup: bool = False) -> dict | None:
    """The launch for a weight [n, k] at m rows of x (`foldkv.gemv.tc_config`, the keywords the probe's variants).
    tail_fit (MODEL_DECODE_NOTES run 17): where the grid's last wave would hold under TAIL_FILL of the resident slots,
    two stages instead (60 KB a program: three an SM) when that holds the whole grid in one wave. fixup (run 18): a
    split weight's partials summed by the last program of its row tile (`gemv_tc_lab`, FIXUP in the launch), no
    split_sum."""
    cfg = lib.tc_config(n, k, m, block_n=block_n, block_k=block_k, stages=stages, split=split, prefetch=prefetch,
                        sms=sms)
    if fixup and cfg is not None and cfg["SPLIT"] > 1:
        cfg = dict(cfg, FIXUP=True)
    if not tail_fit or cfg is None:
        return cfg
    grid, slots = programs(n, cfg), sms * ctas_per_sm(cfg)
    if 0 < grid % slots < TAIL_FILL * slots:
        two = lib.tc_config(n, k, m, block_n=block_n, block_k=block_k, stages=2, split=split, prefetch=prefetch,
                            sms=sms)
        if two is not None and programs(n, two) <= sms * ctas_per_sm(two):
            return two
    return cfg


def programs(n: int, cfg: dict) -> int:
    """The GEMM's grid: cdiv(n, BLOCK_N) row tiles x SPLIT K ranges."""
    return _cdiv(n, cfg["BLOCK_N"]) * cfg["SPLIT"]


def launches(cfg: dict) -> int:
    """Kernels a GEMV launches: the GEMM, and split_sum when it splits K (none with the fixup)."""
    return 1 + (cfg["SPLIT"] > 1 and not cfg.get("FIXUP"))


def smem_estimate(cfg: dict) -> int:
    """Shared memory a program is expected to take: num_stages buffers of the weight tile and x's tile, and the
    prefetched head's weight tile staged once for the MMA (an upper estimate; kernel_stats reads the build's)."""
    w_tile = cfg["BLOCK_N"] * cfg["BLOCK_K"] * 2
    x_tile = cfg["BLOCK_K"] * cfg["BLOCK_M"] * 2
    return cfg["num_stages"] * (w_tile + x_tile) + cfg["PREFETCH"] * (w_tile + x_tile)


def ctas_per_sm(cfg: dict, smem: int | None = None) -> int:
    """Programs an SM holds by shared memory (each CTA reserves 1 KB more): 0 when one does not fit."""
    smem = smem_estimate(cfg) if smem is None else smem
    return 0 if smem > SMEM_PER_CTA else SMEM_PER_SM // (smem + 1024)


def shape_refusal(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, w_contiguous: bool,
                  has_bias: bool, **over) -> str | None:
    """None when a GEMV of m rows against a weight [n, k] is this kernel's, else why not: the library's refusals for
    the bias, the dtypes, the layout and the rows (`foldkv.gemv.rows_refusal`), then the tile (`over`: config's
    keywords)."""
    why = lib.rows_refusal(m, MAX_M, x_dtype, w_dtype, w_contiguous, has_bias)
    if why is not None:
        return why
    if config(n, k, m, **over) is None:
        return f"no tile for a [{n}, {k}] weight ({over or 'the default configuration'})"
    return None


def refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **over) -> str | None:
    """None when `linear(x, weight, bias, **over)` runs the kernel; else why it is F.linear."""
    return lib.tensor_refusal(x, weight, bias, lambda *a: shape_refusal(*a, **over))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = True,
           out: torch.Tensor | None = None, _red_x_early: bool = False, **over) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T: the kernel when `refusal` is None (pdl: launched with launch_pdl and waiting,
    else the plain builds and launches), else F.linear; each call counted (`report`). `out` ([M, N] contiguous, the
    kernel's route only): written in place. `over`: config's keywords (the probe's variants)."""
    why = refusal(x, weight, bias, **over)
    _CALLS["kernel" if why is None else why] += 1
    if why is not None:
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    m = x.numel() // k
    cfg = config(n, k, m, **over)
    xs = x.reshape(m, k)
    xs = xs if xs.is_contiguous() else xs.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    launch(xs, weight, y, cfg, pdl, red_x_early=_red_x_early)
    return y.view(*x.shape[:-1], n)


def linear_gelu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, *, pdl: bool = True,
                out: torch.Tensor | None = None, **over) -> torch.Tensor:
    """weight applied to gelu_mul(gate, up) (the MLP's down_proj of its activation) with the activation made inside
    the GEMM's x loads (`gemv_tc_lab` GELU): gate and up [..., K] with one row stride (the halves of a merged gate|up
    output). What the kernel does not take (`refusal` on gate, or gate and up at other strides): fused_step.gelu_mul
    (off CUDA torch's tanh GELU) then foldkv.gemv.linear, the library's two steps. `over`: config's keywords
    (fixup=True with it)."""
    from foldkv import fused_step, fused_step_ops

    why = refusal(gate, weight, None, **over)
    g, u = (fused_step_ops._row_view(t) for t in (gate, up)) if why is None else (gate, up)
    if why is None and (gate.shape != up.shape or (g.shape[0] > 1 and g.stride(0) != u.stride(0))):
        why = "gate and up not one row stride"  # (one row: its stride is never used)
    _CALLS["kernel" if why is None else why] += 1
    if why is not None:  # the library's kernel on CUDA; torch's tanh GELU elsewhere (what the MLP computes there)
        act = (fused_step.gelu_mul(gate, up) if gate.is_cuda and lib.HAS_GDC else
               torch.nn.functional.gelu(gate, approximate="tanh") * up)
        return lib.linear(act, weight)
    n, k = weight.shape
    m = g.shape[0]
    y = torch.empty(m, n, dtype=gate.dtype, device=gate.device) if out is None else out
    launch(g, weight, y, config(n, k, m, **over), pdl, up=u)
    return y.view(*gate.shape[:-1], n)


@contextlib.contextmanager
def installed(fixup: bool = False, gelu: bool = False, tail_fit: bool = False):
    """The decode step with this version's options (bench/model_decode_probe.py --lab-ab): fixup, every projection
    the library's kernel takes run with the `_fixup` ending; tail_fit, with `config`'s tail_fit (both patch
    foldkv.gemv.linear); gelu, each merged MLP's
    down_proj made from its gate|up output by `linear_gelu` (fused_step.StepForward._mlp patched: in effect for
    every step's forward run inside this block). Yields the calls each took."""
    from foldkv import fused_step

    took = Counter()
    served, own_mlp = lib.linear, fused_step.StepForward._mlp

    opts = dict(fixup=fixup, tail_fit=tail_fit)

    def linear(x, weight, bias=None, **kw):
        if lib.refusal(x, weight, bias) is None:
            n, k = weight.shape
            cfg, plain = config(n, k, x.numel() // k, **opts), lib.tc_config(n, k, x.numel() // k)
            took["fixup"] += cfg.get("FIXUP", False)
            took["tail_fit"] += cfg["num_stages"] != plain["num_stages"]
            return globals()["linear"](x, weight, bias, out=kw.get("out"), **opts)
        return served(x, weight, bias, **kw)

    def mlp_forward(step, i, x, merged=True):
        group = step.gate_up[i]
        if group.merged is None or not merged:  # (merged False: a prefill's groups split, StepOptions.merge_prefill)
            return own_mlp(step, i, x, merged)
        took["gelu"] += 1
        return linear_gelu(*group(x), step.layers[i].mlp.down_proj.weight, **opts), None

    with contextlib.ExitStack() as stack:
        if fixup or tail_fit:
            stack.enter_context(mock.patch.object(lib, "linear", linear))
        if gelu:
            stack.enter_context(mock.patch.object(fused_step.StepForward, "_mlp", mlp_forward))
        yield took


def report() -> dict:
    return {"kernel": _CALLS.get("kernel", 0), "refusals": {k: v for k, v in _CALLS.items() if k != "kernel"}}


def reset() -> None:
    _CALLS.clear()


# --- checks (GPU) ----------------------------------------------------------------------------------------------------
def _consumer(m: int, **over):
    """pdl_checks.race_check's consumer factory: make(k, n, red) -> consume(x [m, k]), the weight seeded (the same
    weight for the reference and the checked launch)."""
    def make(k: int, n: int, red: bool):
        g = torch.Generator(device="cuda").manual_seed(7)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        return lambda x: linear(x.view(m, k), w, pdl=True, _red_x_early=red, **over)
    make.__name__ = f"gemv_tc(M={m}{''.join(f', {a}={b}' for a, b in over.items())})"
    return make


def race_check(m: int = 8, graph: bool = False, k: int = 5376, n: int = 4096, **over) -> dict:
    """foldkv.lab.pdl_checks.race_check with this kernel as the consumer of m rows (a [4096, 5376] weight: 64 row
    tiles, SPLIT 3, so split_sum is in the chain too): ok (the wait holds) and red_caught (the red twin, x's first
    tile loaded before the wait, is wrong: PDL launched it early)."""
    from foldkv.lab import pdl_checks

    return dict(pdl_checks.race_check(_consumer(m, **over), k=k, n=n, graph=graph, rows=m), m=m,
                split=config(n, k, m, **over)["SPLIT"])


def ptx_order(m: int = 8, k: int = 5376, n: int = 4096, red_x_early: bool = False, **over) -> dict:
    """foldkv.lab.pdl_checks.ptx_order of this configuration (`over`: config's keywords): the PDL build's global loads
    before its first wait (the prefetched weight tile only, no cp.async); more loads with the red twin (its x tile)."""
    from foldkv.lab import pdl_checks

    return pdl_checks.ptx_order(m, k, n, red_x_early, cfg=config(n, k, m, **over))


def kernel_stats(n: int, k: int, m: int, pdl: bool = True, **over) -> dict:
    """The build a weight [n, k] at m rows takes (compiled by a launch of one program on an unwritten [n, k] weight:
    the output is never read): n_regs, n_spills, shared bytes (against smem_estimate), whether the PTX multiplies with
    wgmma (Hopper's MMA from shared memory) or mma.sync."""
    dev = torch.device("cuda")
    cfg = config(n, k, m, **over)
    x = torch.zeros(m, k, dtype=torch.bfloat16, device=dev)
    w = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    cnt = torch.zeros(_cdiv(n, cfg["BLOCK_N"]), dtype=torch.int32, device=dev)  # one program: never the last
    compiled = launch(x, w, y, cfg, pdl, grid=(1, 1), cnt=cnt)
    ptx = compiled.asm["ptx"]
    shared = getattr(getattr(compiled, "metadata", None), "shared", None)
    return dict(n=n, k=k, m=m, n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None),
                shared=shared, smem_estimate=smem_estimate(cfg),
                ctas_per_sm=ctas_per_sm(cfg, shared) if isinstance(shared, int) else None,
                wgmma="wgmma" in ptx, mma_sync="mma.sync" in ptx, programs=programs(n, cfg), **cfg)


__all__ = ["MAX_M", "BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "PREFETCH", "SMS", "HAS_GDC", "VARIANTS", "config",
           "programs", "launches", "smem_estimate", "ctas_per_sm", "shape_refusal", "refusal", "launch", "linear",
           "report", "reset", "bound_check", "race_check", "ptx_order", "kernel_stats"]
