"""FP8 wgmma's accumulation on the H200, characterised against float64: how many bits each add keeps, and where a
float32 promotion is needed.

Question. The FP8 tensor-core decode partial (bench/versions/decode_partial_fp8_mma.py) adds its score gemm's 16 k32
steps (head_dim 512) into one float32 accumulator fragment. A fresh accumulator per 4 steps cut its LSE error 1.5-3x
(bench/FP8_NOTES.md, run 16b), so the accumulation inside FP8 wgmma keeps fewer bits than float32 (DeepSeek-V3,
section 3.3.2, reads ~14 on Hopper). A kernel bound for FP8 MMA decodes needs that number measured, not quoted.

Method.
  - A kernel (`program` / `build`): C = A B^T with A [64, K] and B [N, K] e4m3 in shared memory, one T.gemm (one
    wgmma m64nNk32 on sm_90a) per k32 step, K = 32 x steps, all steps into ONE float32 accumulator fragment as the
    decode partial does; or (`fresh_every=f`) a fresh accumulator every f steps, each added into a float32 sum in
    registers: the promotion a kernel would pay for.
  - Inputs (`draw_operands`): e4m3 values never zero, magnitudes 2^u with u uniform over [-spread/2, spread/2 + 1)
    (the spread in binades, so products span ~2 x spread binades), signs mixed or all positive; steps 1-16
    (K = 32-512, the decode's range). The reference is float64: e4m3 x e4m3 products are exact there, and so is
    their sum (a few dozen bits wide at these spreads).
  - The model (`simulate`), applied in float64 to the same inputs. Each k32 step is one fused add of 33 addends:
    the accumulator and the step's 32 exact products. Every addend is kept to the grid 2^(e - b + 1), where
    2^e <= the largest |addend| of that add < 2^(e + 1) (the accumulator included: the running sum's exponent once
    it dominates), i.e. the largest addend keeps b significant bits and the rest are aligned to it; kept by
    round-to-nearest-even ("nearest") or toward zero ("truncate"); the aligned sum is exact, then rounded to float32
    the same way. b = 24 is float32's width.
  - The fit (`fit`): for each mode and b, the simulated error distribution over every cell (spread, signs, steps,
    accumulator grouping) against the measured one: error e = (C - ref) / sum_k |a_k b_k|, compared by its median
    and 99th percentile of |e| (log ratio) and its sign bias mean(e) / mean|e| (which tells truncation from
    rounding on all-positive inputs: truncation is always low there). The (mode, b) of the least distance is the rule;
    each mode's best distance is reported, so "which fits" is a comparison, not an assumption.
  - Where promotion is needed (`steps_table`): the measured error of one accumulator against a fresh one per k32
    step, by steps: if the one accumulator's error grows with steps while the fresh one's does not, the loss is in
    the accumulator's adds, and every k32 step needs its own float32 add to undo it.

Outcome on the H200 (papermill_runs/h200-20261204-s21/: fp8_accumulation.json, fp8acc.log; 32 trials a cell, seed 0,
66 cells). The fit's distance picked "nearest, b = 13" (770; truncate b = 13: 833), but that is the distance's
artefact: a cell whose measured error is exactly 0 while the model's is not (or the reverse) costs ~300 a statistic
(the log against the 2^-40 floor), and a handful of all-positive spread-0 cells decide the sum. Cell by cell the rule
is TRUNCATE, b = 14, the model as written (every addend of a step's fused add, the accumulator and each of the 32
products, truncated to the grid 2^(e - 14) of the add's largest addend):
  - mixed signs: distance 1.8 over the 33 mixed cells (nearest b = 14: 4.3; nearest b = 13: 286);
  - all positive, one accumulator, 2 steps or more (the running sum is then the largest addend): the model's median,
    p99 and max match the measured ones within 10% (20% at 2 steps), sign bias -1 as measured (spread 0, 16 steps:
    measured 4.23e-3 / 4.93e-3 / 5.81e-3, model 4.20e-3 / 4.91e-3 / 5.81e-3; spread 8, 16 steps: 6.38e-3 / 8.20e-3 /
    9.55e-3 against 6.38e-3 / 8.20e-3 / 9.55e-3). The fitted "nearest, b = 13" under-reads these cells' medians 2.4-14x:
    on positive sums every product is cut to the accumulator's grid and each one loses up to a grid step, always low, so
    the error grows per ADDEND (32 a step), not per add;
  - what the model misses, within the bound's margin: the single-step positive cells (spread 4: measured median
    3.9e-5 where the model's is 0; spread 8: 1.4e-4 against 1.6e-4), and, with a fresh accumulator every 1 or 4
    steps, all positive, spreads 0 and 4, a slightly larger measured error (up to 7e-5 of sum|a b| where the model
    gives 0-3e-5): a unit or two of the products' last place lost where the model loses none.

The accumulation bound it feeds (`accumulation_bound`), derived from that rule and worst case per addend: in an add
whose largest |addend| is M, the grid is 2^(e - b) <= 2^(1 - b) M; truncating (or rounding) one addend loses less than
one grid step and at most the addend itself, so the step's 32 products lose <= min(sum_k |p_k|, 32 x 2^(1 - b) M)
and the accumulator <= min(|acc|, 2^(1 - b) M); the aligned sum's float32 rounding adds <= 2^-23 |result|. M is
bounded from the float64 reference: max(|exact partial sum| + the error so far, an upper bound on the step's largest
|product|), and the bound is carried step by step (the error so far enters the next step's M). Against this data
(`bound_table`, tests/test_fp8_accumulation_cpu.py) at b = 14, the bound relative to sum|a b| over each cell's 2048
outputs against the cell's measured max (17 of the 66 cells measure exactly 0): its smallest value is above the
measured max in 64 cells (positive one-accumulator cells 1.07-93x, positive fresh-accumulator cells 1.5-97x, mixed
1.9-55x), and its 1st percentile is at least 1.26x the measured max in every cell. The two others (spread 8, all
positive, 1 and 2 steps: the measured max is 0.92x and 0.84x the bound's smallest value, 1.39x and 1.26x its 1st
percentile) hold output by output on the rule's model, which stays within 0.37 of the bound on every output of every
cell. On the worst positive cell (spread 8, 16 steps, measured max 9.55e-3) the bound's smallest value is 2.13e-2
(2.2x). The earlier term (2^-b x the running sum of |products| per add: one rounding per add, no per-addend count)
does not hold: at b = 13 it is 7.5e-4 there (0.079x the measured max), and it is below the measured max on mixed cells
of spread 8 too (0.27x at one step). The new term is looser than that one, and the looseness is motivated by this
data alone: the positive cells lose per addend. At b + 4 = 18, or with one grid step a add (no per-addend count), the
bound fails the positive cells (the tests' red twins).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func's annotations

import functools
import math
from typing import Iterable, Optional, Sequence

import torch

from .arms import ArmUnavailable

M, K_STEP = 64, 32  # wgmma's M for one warpgroup, and the K of one FP8 wgmma instruction
N_DEFAULT = 16  # the decode partial's score gemm: N = 16 query rows (8 heads, hi and lo parts)
STEPS = (1, 2, 4, 8, 16)  # K = 32 .. 512: head_dim 512 is 16 steps
SPREADS = (0, 4, 8)  # binades of each operand's magnitudes
SIGNS = ("mixed", "positive")
MODES = ("nearest", "truncate")
BITS = tuple(range(8, 25))
MAX_SPREAD = 12  # 2^-6 is e4m3's smallest normal: wider spreads would reach subnormals or zero
FP8 = torch.float8_e4m3fn


# --- the kernel -----------------------------------------------------------------------------------------------------
def program(steps: int, n: int = N_DEFAULT, fresh_every: Optional[int] = None):
    """The prim_func: c[t] = a[t] @ b[t]^T over `trials` (dynamic) CTAs of 128 threads, a [trials, 64, 32 steps],
    b [trials, n, 32 steps] e4m3, c [trials, 64, n] float32. Every k32 step is its own shared panel pair and T.gemm
    (one wgmma k32), into one fragment; `fresh_every` f: the fragment restarts every f steps and is added into a
    float32 sum in registers."""
    from foldkv.kernels.tl import require_tilelang

    require_tilelang()
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    fresh = fresh_every or steps
    if steps < 1 or steps % fresh:
        raise ValueError(f"fresh_every {fresh_every} must divide steps {steps}")
    k = K_STEP * steps
    trials = T.dynamic("trials")
    e4m3, f32 = "float8_e4m3", "float32"

    @T.prim_func
    def fp8_accumulation(a: T.Tensor((trials, M, k), e4m3), b: T.Tensor((trials, n, k), e4m3),
                         c: T.Tensor((trials, M, n), f32)):
        with T.Kernel(trials, threads=128) as t:
            # one panel per step, named (a list: TileLang would otherwise number buffers bound to a loop variable in
            # an order that changes from process to process), K-major as the decode's e4m3 panels are
            a_s = [IRBuilder.name(f"a_{s}", T.alloc_shared((M, K_STEP), e4m3)) for s in range(steps)]
            b_s = [IRBuilder.name(f"b_{s}", T.alloc_shared((n, K_STEP), e4m3)) for s in range(steps)]
            acc = T.alloc_fragment((M, n), f32)
            total = T.alloc_fragment((M, n), f32)
            T.clear(total)
            for s in list(range(steps)):  # a Python list: range() would be a device loop
                T.copy(a[t, 0:M, s * K_STEP:(s + 1) * K_STEP], a_s[s])
                T.copy(b[t, 0:n, s * K_STEP:(s + 1) * K_STEP], b_s[s])
            for s in list(range(steps)):
                T.gemm(a_s[s], b_s[s], acc, transpose_B=True, clear_accum=(s % fresh == 0))
                if s % fresh == fresh - 1:  # the promotion: the group's accumulator into float32 registers
                    for i, j in T.Parallel(M, n):
                        total[i, j] += acc[i, j]
            T.copy(total, c[t, 0:M, 0:n])

    return fp8_accumulation


@functools.lru_cache(maxsize=None)
def build(steps: int, n: int = N_DEFAULT, fresh_every: Optional[int] = None):
    """The compiled kernel for sm_90a (foldkv's target and pass configs); nvcc builds it without a GPU."""
    from foldkv.kernels.tl import pass_configs, require_tilelang, target

    tilelang = require_tilelang()
    return tilelang.compile(program(steps, n, fresh_every), target=target(), pass_configs=pass_configs())


# --- inputs and the float64 reference -------------------------------------------------------------------------------
def draw_operands(trials: int, steps: int, spread: int, signs: str = "mixed", n: int = N_DEFAULT, *,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """a [trials, 64, 32 steps], b [trials, n, 32 steps] float8_e4m3fn on the CPU, never zero: |x| = 2^u rounded to
    e4m3, u uniform over [-spread/2, spread/2 + 1); signs "mixed" (each +-1 at random) or "positive"."""
    if not 0 <= spread <= MAX_SPREAD:
        raise ValueError(f"spread {spread} outside [0, {MAX_SPREAD}] (e4m3's normal range)")
    if signs not in SIGNS:
        raise ValueError(f"signs {signs!r}: one of {SIGNS}")

    def one(rows: int) -> torch.Tensor:
        u = torch.rand(trials, rows, K_STEP * steps, generator=generator, dtype=torch.float64)
        x = torch.exp2(u * (spread + 1) - spread / 2)
        if signs == "mixed":
            x = torch.where(torch.rand(x.shape, generator=generator) < 0.5, -x, x)
        return x.to(FP8)

    return one(M), one(n)


def products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[trials, 64, n, K] float64: every product a[t, i, k] b[t, j, k], exact (two 4-bit significands)."""
    return a.double()[:, :, None, :] * b.double()[:, None, :, :]


def reference(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a b^T, |a| |b|^T) [trials, 64, n] float64, both exact (sums of exact products well inside 53 bits)."""
    a64, b64 = a.double(), b.double()
    return a64 @ b64.transpose(1, 2), a64.abs() @ b64.abs().transpose(1, 2)


# --- the model ------------------------------------------------------------------------------------------------------
def _keep(x: torch.Tensor, ulp: torch.Tensor, mode: str) -> torch.Tensor:
    q = x / ulp  # exact: ulp is a power of two
    return (torch.round(q) if mode == "nearest" else torch.trunc(q)) * ulp


def _to_float32(x: torch.Tensor, mode: str) -> torch.Tensor:
    y = x.float().double()  # round to nearest even
    if mode == "truncate":  # one float32 step toward zero where rounding went away from it
        away = y.abs() > x.abs()
        y = torch.where(away, torch.nextafter(y.float(), torch.zeros_like(y.float())).double(), y)
    return y


def fused_add(acc: torch.Tensor, step_products: torch.Tensor, bits: int, mode: str) -> torch.Tensor:
    """One k32 step of the model: acc [...] and the step's products [..., 32] (float64) aligned to the largest
    addend's exponent e, each kept to the grid 2^(e - bits + 1), summed exactly, rounded to float32 (`mode`)."""
    addends = torch.cat([acc[..., None], step_products], dim=-1)
    _, e = torch.frexp(addends.abs().amax(dim=-1, keepdim=True))  # largest = m 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(addends[..., :1]), e - bits)
    return _to_float32(_keep(addends, ulp, mode).sum(dim=-1), mode)


def simulate(prods: torch.Tensor, bits: int, mode: str = "nearest", fresh_every: Optional[int] = None) -> torch.Tensor:
    """The model's C [trials, 64, n] float64 from `products` [..., K]: each k32 step a `fused_add` into the running
    accumulator; with `fresh_every` f, the accumulator restarts every f steps and is added into a float32 sum
    (round to nearest: the kernel's own float32 add)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    steps = prods.shape[-1] // K_STEP
    fresh = fresh_every or steps
    total = torch.zeros(prods.shape[:-1], dtype=torch.float64, device=prods.device)
    acc = torch.zeros_like(total)
    for s in range(steps):
        if s % fresh == 0:
            acc = torch.zeros_like(total)
        acc = fused_add(acc, prods[..., s * K_STEP:(s + 1) * K_STEP], bits, mode)
        if s % fresh == fresh - 1:
            total = (total + acc).float().double()
    return total


# --- the bound -------------------------------------------------------------------------------------------------------
BITS_KEPT = 14  # truncate, b = 14: the rule the H200's cells follow (papermill_runs/h200-20261204-s21/, docstring)
F32_ULP = 2.0**-23  # a float32 rounding (nearest or toward zero) moves a value by < 2^-23 of it


def accumulation_bound(signed: torch.Tensor, abs_sums: torch.Tensor, largest: torch.Tensor, bits: int = BITS_KEPT,
                       fresh_every: Optional[int] = None, lanes: int = K_STEP) -> torch.Tensor:
    """A worst-case bound on one accumulator's error [...] (float64) under the rule "each add truncates every addend
    to b bits below its largest addend" (module docstring), from per-step quantities of the exact products [..., T]:
    `signed` the step's sum, `abs_sums` its sum of |products|, `largest` an upper bound on its largest |product|.
    Step t: M = max(|exact partial sum| + error so far, largest_t); loss <= min(abs_sums_t, lanes 2^(1-b) M) for the
    products + min(|partial| + error, 2^(1-b) M) for the accumulator + 2^-23 |result|. `fresh_every` f: the
    accumulator restarts every f steps and is added into a float32 total (one more 2^-23 rounding of the total)."""
    steps = signed.shape[-1]
    fresh = fresh_every or steps
    unit = 2.0 ** (1 - bits)
    shape = signed.shape[:-1]
    total_exact = torch.zeros(shape, dtype=torch.float64, device=signed.device)
    total_err = torch.zeros_like(total_exact)
    part, err = torch.zeros_like(total_exact), torch.zeros_like(total_exact)
    for t in range(steps):
        if t % fresh == 0:
            part, err = torch.zeros_like(total_exact), torch.zeros_like(total_exact)
        acc = part.abs() + err  # >= the accumulator's |value|
        grid = unit * torch.maximum(acc, largest[..., t].double())
        loss = torch.minimum(abs_sums[..., t].double(), lanes * grid) + torch.minimum(acc, grid)
        part = part + signed[..., t].double()
        err = err + loss + F32_ULP * (part.abs() + err + loss)
        if t % fresh == fresh - 1:
            total_exact = total_exact + part
            total_err = total_err + err
            if fresh < steps:  # the promotion: a float32 add into the total
                total_err = total_err + F32_ULP * (total_exact.abs() + total_err)
    return total_err


def step_sums(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per output and k32 step [trials, 64, n, steps] float64, exact: the products' sum, their |sum|'s bound (sum of
    |products|), and max|a| x max|b| over the step's columns (>= its largest |product|)."""
    steps = a.shape[-1] // K_STEP
    a64 = a.double().view(*a.shape[:-1], steps, K_STEP)
    b64 = b.double().view(*b.shape[:-1], steps, K_STEP)
    signed = torch.einsum("timk,tjmk->tijm", a64, b64)
    abs_sums = torch.einsum("timk,tjmk->tijm", a64.abs(), b64.abs())
    largest = a64.abs().amax(-1)[:, :, None, :] * b64.abs().amax(-1)[:, None, :, :]
    return signed, abs_sums, largest


def bound_table(result: dict, bits: int = BITS_KEPT, **bound_kw) -> list[dict]:
    """Per measured cell of a characterisation's JSON (`characterise`, same trials / n / seed: the operands are drawn
    again): the measured max relative error, the bound relative to sum|a b| over the cell's outputs (smallest, 1st
    percentile, median), and the margins smallest / measured max and 1st percentile / measured max. `bound_kw`:
    passed to `accumulation_bound` (lanes)."""
    steps = sorted({r["steps"] for r in result["cells"]})
    spreads = sorted({r["spread"] for r in result["cells"]})
    signs = [s for s in SIGNS if any(r["signs"] == s for r in result["cells"])]
    fresh = sorted({r["fresh_every"] for r in result["cells"] if r["fresh_every"] is not None})
    cells = grid_cells(result["trials"], steps, spreads, signs, [None, *fresh], result["n"], result["seed"])
    rows = []
    for cell, row in zip(cells, result["cells"]):
        key = tuple(row[k] for k in ("spread", "signs", "steps", "fresh_every"))
        if key != tuple(cell[k] for k in ("spread", "signs", "steps", "fresh_every")):
            raise ValueError(f"cell {key} is not the grid's next cell: a different grid or order")
        signed, abs_sums, largest = step_sums(cell["a"], cell["b"])
        rel = (accumulation_bound(signed, abs_sums, largest, bits, cell["fresh_every"], **bound_kw)
               / abs_sums.sum(-1)).flatten()
        q01, q50 = torch.quantile(rel, torch.tensor([0.01, 0.5], dtype=rel.dtype)).tolist()
        meas = row["measured_max"]
        rows.append({"spread": key[0], "signs": key[1], "steps": key[2], "fresh_every": key[3],
                     "measured_max": meas, "bound_min": float(rel.min()), "bound_q01": q01, "bound_q50": q50,
                     "margin_min": _ratio(float(rel.min()), meas), "margin_q01": _ratio(q01, meas)})
    return rows


# --- statistics and the fit -----------------------------------------------------------------------------------------
def error_stats(c: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor) -> dict:
    """e = (c - ref) / sum|a b| per output: median and 99th percentile of |e|, its largest, and the sign bias
    mean(e) / mean|e| (-1: always low, as truncation on positive sums is; ~0: unbiased)."""
    e = ((c.double() - ref) / abs_sum).flatten()
    mag = e.abs()
    mean_abs = float(mag.mean())
    q50, q99 = torch.quantile(mag, torch.tensor([0.5, 0.99], dtype=mag.dtype, device=mag.device)).tolist()
    return {"q50": q50, "q99": q99, "max": float(mag.max()),
            "bias": float(e.mean()) / mean_abs if mean_abs > 0 else 0.0}


_FLOOR = 2.0**-40  # below any error a kept add of <= 24 bits makes: an exact result counts as that, not as -inf


def distance(sim: dict, meas: dict) -> float:
    """How far one cell's simulated error statistics are from the measured ones: squared log ratios of the median
    and the 99th percentile, plus the squared difference of the sign bias."""
    return (math.log((sim["q50"] + _FLOOR) / (meas["q50"] + _FLOOR)) ** 2
            + math.log((sim["q99"] + _FLOOR) / (meas["q99"] + _FLOOR)) ** 2 + (sim["bias"] - meas["bias"]) ** 2)


def fit(cells: Sequence[dict], bits: Iterable[int] = BITS, modes: Sequence[str] = MODES) -> dict:
    """The rule that fits: each cell a dict with "a", "b" (e4m3 operands), "c" (measured, float32) and
    "fresh_every" (None: one accumulator). For every (mode, b): the model on the same inputs, its error statistics,
    the summed `distance` over cells. Returns {"mode", "bits", "distance", "by_mode": {mode: {"bits", "distance"}},
    "grid": [{"mode", "bits", "distance"}], "measured": [stats per cell], "simulated": [stats per cell at the fit]}."""
    bits = list(bits)
    grid = {(m, b): 0.0 for m in modes for b in bits}
    measured, simulated_at = [], {}
    for i, cell in enumerate(cells):
        prods = products(cell["a"], cell["b"])
        ref, abs_sum = reference(cell["a"], cell["b"])
        meas = error_stats(cell["c"], ref.to(cell["c"].device), abs_sum.to(cell["c"].device))
        measured.append(meas)
        for key in grid:
            sim = error_stats(simulate(prods, key[1], key[0], cell.get("fresh_every")), ref, abs_sum)
            grid[key] += distance(sim, meas)
            simulated_at[(i, key)] = sim
        del prods
    best = min(grid, key=grid.get)
    by_mode = {m: min(((b, grid[(m, b)]) for b in bits), key=lambda x: x[1]) for m in modes}
    return {"mode": best[0], "bits": best[1], "distance": grid[best],
            "by_mode": {m: {"bits": b, "distance": d} for m, (b, d) in by_mode.items()},
            "grid": [{"mode": m, "bits": b, "distance": d} for (m, b), d in grid.items()],
            "measured": measured, "simulated": [simulated_at[(i, best)] for i in range(len(cells))]}


def synthetic_cells(bits: int, mode: str, *, trials: int = 2, steps: Sequence[int] = (1, 4, 16),
                    spreads: Sequence[int] = (0, 6), signs: Sequence[str] = SIGNS, fresh_every: Sequence = (None,),
                    seed: int = 0, n: int = N_DEFAULT) -> list[dict]:
    """Cells whose "measured" C is the model's own (b = `bits`, `mode`), float32: what the fit must give back."""
    return [dict(cell, c=simulate(products(cell["a"], cell["b"]), bits, mode, cell["fresh_every"]).float())
            for cell in grid_cells(trials, steps, spreads, signs, fresh_every, n, seed)]


def grid_cells(trials: int, steps: Sequence[int], spreads: Sequence[int], signs: Sequence[str],
               fresh_every: Sequence, n: int, seed: int) -> list[dict]:
    """The cells of a grid, operands drawn in its order from one seeded generator: per (spread, signs, steps) one
    draw, shared by each grouping in `fresh_every` (None: one accumulator) that is shorter than and divides steps."""
    g = torch.Generator().manual_seed(seed)
    cells = []
    for spread in spreads:
        for sign in signs:
            for st in steps:
                a, b = draw_operands(trials, st, spread, sign, n, generator=g)
                cells += [dict(spread=spread, signs=sign, steps=st, fresh_every=f, a=a, b=b) for f in fresh_every
                          if f is None or (f < st and st % f == 0)]
    return cells


# --- on the device --------------------------------------------------------------------------------------------------
def require_sm90(device) -> torch.device:
    """The device, or ArmUnavailable with the reason (the kernel is wgmma: sm_90a only)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ArmUnavailable(f"FP8 wgmma needs a CUDA device (this run is on {dev})")
    if torch.cuda.get_device_capability(dev) < (9, 0):
        raise ArmUnavailable(f"FP8 wgmma needs sm_90 (Hopper), found {torch.cuda.get_device_name(dev)}")
    return dev


def measure(a: torch.Tensor, b: torch.Tensor, fresh_every: Optional[int], device) -> tuple[torch.Tensor, bool]:
    """The kernel's C (float32, on the CPU) over a, b, and whether every output was written (C is NaN first)."""
    steps = a.shape[-1] // K_STEP
    kernel = build(steps, b.shape[1], fresh_every)
    c = torch.full((a.shape[0], M, b.shape[1]), float("nan"), dtype=torch.float32, device=device)
    kernel(a.to(device), b.to(device), c)
    torch.cuda.synchronize(device)
    return c.cpu(), bool(torch.isfinite(c).all())


def output_bound_check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, fresh_every: Optional[int],
                       bits: int = BITS_KEPT) -> dict:
    """The measured C [trials, 64, n] against `accumulation_bound` output by output (what a cell's quantiles cannot
    say): the largest |C - ref| / bound over the cell's outputs ("bound_over_max", <= 1 holds; an exact output
    counts 0) and how many outputs exceed their bound ("bound_outputs_over"; a NaN output counts as over)."""
    ref, _ = reference(a, b)
    err = (c.double().to(ref.device) - ref).abs()
    bound = accumulation_bound(*step_sums(a, b), bits, fresh_every)
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    return {"bound_over_max": float(ratio.max()), "bound_outputs_over": int((~(ratio <= 1)).sum())}


def characterise(device="cuda", steps: Sequence[int] = STEPS, spreads: Sequence[int] = SPREADS,
                 signs: Sequence[str] = SIGNS, fresh_every: Sequence[int] = (1, 4), trials: int = 32,
                 n: int = N_DEFAULT, bits: Iterable[int] = BITS, seed: int = 0,
                 bound_bits: Optional[int] = BITS_KEPT) -> dict:
    """Measure every cell (spread x signs x steps, one accumulator and each `fresh_every` that divides the steps),
    fit the rule over all of them, and tabulate error against steps. Raises ArmUnavailable off sm_90.
    `bound_bits`: each cell's outputs also checked one by one against `accumulation_bound` at that b
    (`output_bound_check`: "bound_over_max", "bound_outputs_over" per cell); None skips it.
    Returns {"status": "ran", "cells": [...], "fit": {...}, "all_written": bool}; the simulation runs on `device`."""
    dev = require_sm90(device)
    cells = []
    for cell in grid_cells(trials, steps, spreads, signs, [None, *fresh_every], n, seed):
        c, written = measure(cell["a"], cell["b"], cell["fresh_every"], dev)
        cells.append(dict(cell, a=cell["a"].to(dev), b=cell["b"].to(dev), c=c.to(dev), written=written))
    result = fit(cells, bits)
    rows = []
    for cell, meas, sim in zip(cells, result.pop("measured"), result.pop("simulated")):
        rows.append({**{k: cell[k] for k in ("spread", "signs", "steps", "fresh_every", "written")},
                     **{f"measured_{k}": v for k, v in meas.items()}, **{f"model_{k}": v for k, v in sim.items()}})
        if bound_bits is not None:
            rows[-1].update(output_bound_check(cell["a"], cell["b"], cell["c"], cell["fresh_every"], bound_bits))
    return {"status": "ran", "cells": rows, "fit": result, "all_written": all(c["written"] for c in cells),
            "trials": trials, "n": n, "seed": seed, "bound_bits": bound_bits}


# --- tables ---------------------------------------------------------------------------------------------------------
def steps_table(result: dict) -> list[dict]:
    """Per (spread, signs, steps): the measured median / p99 relative error of one accumulator and of a fresh one per
    k32 step (fresh_every 1), and their ratio: where the one accumulator's error grows, promotion is needed."""
    by = {(r["spread"], r["signs"], r["steps"], r["fresh_every"]): r for r in result["cells"]}
    rows = []
    for (spread, sign, st, f), r in by.items():
        if f is not None:
            continue
        fresh = by.get((spread, sign, st, 1))
        rows.append({"spread": spread, "signs": sign, "steps": st, "one_q50": r["measured_q50"],
                     "one_q99": r["measured_q99"], "model_q50": r["model_q50"],
                     "fresh1_q50": fresh["measured_q50"] if fresh else float("nan"),
                     "fresh1_q99": fresh["measured_q99"] if fresh else float("nan"),
                     "ratio_q50": _ratio(r["measured_q50"], fresh["measured_q50"]) if fresh else float("nan")})
    return rows


def _ratio(x: float, y: float) -> float:
    """x / y, with an exact y (an error of 0) giving inf for x > 0 and 1 for x == 0."""
    return x / y if y > 0 else (math.inf if x > 0 else 1.0)


def markdown(result: dict) -> str:
    """The fit's line and the error-against-steps table, in Markdown (notebook 02, the probe)."""
    from .report import markdown_table

    f = result["fit"]
    modes = "; ".join(f"{m}: best b = {v['bits']} (distance {v['distance']:.3g})" for m, v in f["by_mode"].items())
    head = (f"Fit: **{f['mode']}, b = {f['bits']} bits kept per add** (largest addend's exponent; distance "
            f"{f['distance']:.3g}). {modes}. All outputs written: {result['all_written']}.")
    cols = {"spread": "spread (binades)", "signs": "signs", "steps": "k32 steps", "one_q50": "one acc. median",
            "one_q99": "one acc. p99", "model_q50": "model median", "fresh1_q50": "fresh per step median",
            "fresh1_q99": "fresh per step p99", "ratio_q50": "one / fresh (median)"}
    fmt = {k: ".3g" for k in cols if k not in ("spread", "signs", "steps")}
    return head + "\n\n" + markdown_table(steps_table(result), cols, fmt)
