"""The drift study's bookkeeping: cells of (prompt, length), the walks per arm, the gaps against the incumbent, the
neutral figure, summaries, the drift line, and the JSON of results (what notebooks/03_drift_study.ipynb runs).

Definitions (per cell and step s = 0..steps; step 0 is the prefill's last position, step s >= 1 the s-th decode):
- gap[arm][s]      = max over the vocabulary of |logits_arm - logits_incumbent|, both teacher-forced on the same
                     tokens (the incumbent's greedy continuation), so every arm sees the same inputs.
- argmax_equal     = argmax(logits_arm) == argmax(logits_incumbent).
- neutral[s]       = max |walk - single pass| of the incumbent itself: its step-by-step logits against one prefill
                     over the same tokens. The size of gap the model's own arithmetic already produces by changing
                     nothing but the order of operations; an arm's gap is judged beside it.
- margin[s]        = top-1 minus top-2 logit of the incumbent: an argmax flip needs 2 * gap >= margin.
- pairs            = the same max |Δ| between two arms (folded vs split, kernel vs its torch reference).

The checks (`check_study`, per arm; a failed check fails the arm's section of the notebook's record):
- finite (every arm): every logit of every arm at every step is finite (and the incumbent's own logits, margins and
  neutral); a NaN or Inf anywhere fails, with the cell and step named.
- gap (kernel arms over bf16 pools, `gated_arms`): the arm's gap distribution is no worse than the neutral figure
  allows (see `GAP_FACTOR`).
- argmax (the same arms): the arm's argmax disagrees with the incumbent no more often than the incumbent's own single
  pass does, beyond what chance allows (see `ARGMAX_ALPHA`).
The FP8 arms (`folded-fp8`, `ref-folded-fp8`) get the same figures, reported, not gated (their format's drift).
The drift line (`drift_line`) is descriptive: it is placed above what was measured, so it is no check.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
import traceback
import zlib
from typing import Any, Sequence

import torch

from ..provenance import provenance
from ..validate import check_device
from .arms import ArmUnavailable
from .jsonsafe import jsonable
from .model import MODEL_ARMS, ArmSettings, check_arm_available, foldkv_implementation, load_model, single_pass, walk
from .synthetic import describe_checkpoint, make_synthetic_checkpoint

PAIRS = (("ref-folded", "ref-split"), ("folded", "split"), ("split", "ref-split"), ("folded", "ref-folded"),
         ("ref-folded-fp8", "ref-folded"), ("folded-fp8", "ref-folded-fp8"), ("folded-fp8", "folded"))
QUANTILES = (0.5, 0.9, 0.99, 1.0)

# The gap check. The neutral figure |walk - single pass| is the distance between two orderings of the incumbent's own
# arithmetic. An arm that is "a reordering, no less accurate than the incumbent" sits, like the single pass, one such
# distance from the walk; by the triangle inequality |arm - walk| <= |arm - single| + |single - walk|, i.e. at most two
# neutral distances even in the worst alignment. So each of the arm's gap quantiles (p50, p90, max) must be at most
# GAP_FACTOR x the neutral quantile, plus GAP_SLACK_ULPS ulp of the model dtype at the largest |logit|: gaps are
# differences of logits rounded to that dtype, so two samples' quantiles can differ by one quantum, and a neutral of
# exactly 0 (walk and single pass bit-identical) would otherwise allow no rounding at all. Not fitted to a run; on the
# H200 with the notebook's defaults (bf16, 14 cells x 17 steps; neutral p50/p90/max 0.156/0.188/0.25, |logit| <= 16.5,
# so limits 0.438/0.5/0.625) the kernel arms reach at most 0.188/0.219/0.3125, and the same reference decode with its
# newest key dropped reaches 0.211/0.558/1.75 and fails (p90 and max).
# Gated: the kernel arms (MODEL_ARMS backend "kernel"). The torch reference arms are measured against the same limits
# but not gated: on a CPU the incumbent's walk and single pass are often bit-identical in bf16 (neutral p50 = 0), so
# the neutral does not gauge the bf16 roundings a float64 reference rounded once to bf16 makes elsewhere.
GAP_FACTOR = 2.0
GAP_SLACK_ULPS = 1
GAP_QUANTILES = ("p50", "p90", "max")
# The argmax check: McNemar's exact test, steps where the arm flips the incumbent's argmax and the single pass does
# not (b) against the reverse (c). Under "the arm is another reordering like the single pass" b ~ Binomial(b + c, 1/2);
# the arm fails when P(X >= b) < ARGMAX_ALPHA (one-sided: only more flips are a fault). With b + c = 10 flips all the
# arm's, P = 2^-10 < 1e-3: a handful of near-tie flips, which both orderings make, never fails it.
ARGMAX_ALPHA = 1e-3
RESULTS_NAME = "drift_results.json"
PARTIAL_NAME = "drift_results.partial.json"


# --- set-up ------------------------------------------------------------------------------------------------------

def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(device)


def resolve_dtype(dtype: str | torch.dtype = "auto") -> torch.dtype:
    """'auto' is bfloat16 on every device: the dtype the model is served in and the kernels' pools store."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.bfloat16 if dtype == "auto" else getattr(torch, str(dtype))


def prepare_model(model_path: str | None, *, device: torch.device, dtype: torch.dtype, seed: int = 0,
                  attn_implementation: str = "sdpa", synthetic_dir: str | None = None,
                  synthetic_config: dict | None = None):
    """(model, tokenizer or None, info). `model_path` None makes a synthetic checkpoint (in a temp dir, not the repo;
    `synthetic_config` overrides its small dimensions) and loads it through the same from_pretrained path a real
    checkpoint takes."""
    if model_path is None:
        if synthetic_dir is None:  # a temp dir, removed once the model is in memory (info["path"] names it)
            with tempfile.TemporaryDirectory(prefix="foldkv_synthetic_") as tmp:
                return prepare_model(None, device=device, dtype=dtype, seed=seed, attn_implementation=attn_implementation,
                                     synthetic_dir=tmp, synthetic_config=synthetic_config)
        model_path = make_synthetic_checkpoint(synthetic_dir, seed=seed, **(synthetic_config or {}))
    model = load_model(model_path, device=device, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = None
    info = describe_checkpoint(model_path)
    if info["kind"] != "synthetic":
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
        except Exception as exc:  # a checkpoint without tokenizer files: prompts become byte ids
            info["tokenizer_error"] = f"{type(exc).__name__}: {exc}"
    import transformers

    info.update({
        "class": type(model).__name__,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "attn_implementation": attn_implementation,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None,
    })
    return model, tokenizer, info


def prompt_token_ids(prompt: str, length: int, vocab_size: int, tokenizer=None) -> torch.Tensor:
    """`length` token ids [length] int64 that start with the prompt.

    With a tokenizer: the prompt's tokens, repeated until long enough (a long document of real text). Without (the
    synthetic model): the prompt's UTF-8 bytes as ids 3.., then a pseudo-random continuation seeded by the prompt, so
    long cells are not a short period repeated."""
    if length < 1:
        raise ValueError(f"length {length} must be >= 1")
    if tokenizer is not None:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        body = tokenizer(" " + prompt, add_special_tokens=False)["input_ids"] or ids
        while len(ids) < length:
            ids = ids + body
        return torch.tensor(ids[:length], dtype=torch.long)
    ids = [3 + b % (vocab_size - 3) for b in prompt.encode()][:length]
    if len(ids) < length:
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        ids += torch.randint(3, vocab_size, (length - len(ids),), generator=g).tolist()
    return torch.tensor(ids, dtype=torch.long)


# --- one cell ------------------------------------------------------------------------------------------------------

def _row_gaps(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return (a.float() - b.float()).abs().amax(dim=-1).tolist()  # [steps + 1]; NaN propagates (amax keeps NaN)


def _margins(logits: torch.Tensor) -> list[float]:
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def _nonfinite_steps(logits: torch.Tensor) -> list[int]:
    """Steps (rows) holding any NaN or Inf logit."""
    return torch.nonzero(~torch.isfinite(logits.float()).all(dim=-1)).flatten().tolist()


def run_cell(model, settings: ArmSettings | None, prompt_ids: torch.Tensor, steps: int, arms: Sequence[str],
             arm_status: dict[str, str], *, log=print) -> dict[str, Any]:
    """Walk the incumbent greedily, then every arm teacher-forced on the same tokens, and the incumbent's single pass
    over the same tokens. `settings`: the foldkv arms' cache settings. `arm_status` carries "not run: ..." across
    cells so an unavailable arm is tried once."""
    t0 = time.perf_counter()
    inc = walk(model, "incumbent", prompt_ids, steps)
    full = torch.cat([prompt_ids.reshape(-1).cpu(), inc.fed])
    one = single_pass(model, full, keep=steps + 1)
    cell: dict[str, Any] = {
        "length": int(prompt_ids.numel()),
        "steps": int(steps),
        "fed_tokens": inc.fed.tolist(),
        "incumbent_argmax": inc.logits.argmax(-1).tolist(),
        "margin": _margins(inc.logits),
        "neutral": _row_gaps(inc.logits, one),
        "neutral_argmax_equal": (one.argmax(-1) == inc.logits.argmax(-1)).tolist(),
        "incumbent_nonfinite_steps": sorted(set(_nonfinite_steps(inc.logits)) | set(_nonfinite_steps(one))),
        "logit_absmax": float(inc.logits.float().abs().amax()),
        "arms": {},
        "pairs": {},
        "seconds": {"incumbent": time.perf_counter() - t0},
    }
    logits = {}
    for arm in arms:
        if arm == "incumbent":
            continue
        if arm_status.get(arm, "").startswith(("not run", "error (skipped")):
            continue
        t1 = time.perf_counter()
        try:
            w = walk(model, arm, prompt_ids, steps, feed=inc.fed, settings=settings)
        except ArmUnavailable as exc:
            arm_status[arm] = f"not run: {exc}"
            log(f"  {arm}: {arm_status[arm]}")
            continue
        except Exception as exc:  # a kernel that fails inside the model: recorded, the study goes on
            msg = f"error: {type(exc).__name__}: {exc}"
            if arm_status.get(arm, "").startswith("error"):  # failed twice without ever running: stop trying it
                arm_status[arm] = f"error (skipped in later cells): {type(exc).__name__}: {exc}"
            else:
                arm_status.setdefault(arm, msg)
            cell["arms"][arm] = {"status": msg, "traceback": traceback.format_exc(limit=6)}
            log(f"  {arm}: {msg}")
            continue
        arm_status.setdefault(arm, "ran")
        logits[arm] = w.logits
        gap = _row_gaps(w.logits, inc.logits)
        cell["arms"][arm] = {
            "status": "ran",
            "attention": w.attention,
            "gap": gap,
            "argmax_equal": (w.logits.argmax(-1) == inc.logits.argmax(-1)).tolist(),
            "nonfinite_steps": _nonfinite_steps(w.logits),
        }
        cell["seconds"][arm] = time.perf_counter() - t1
    for a, b in PAIRS:
        if a in logits and b in logits:
            cell["pairs"][f"{a} vs {b}"] = {
                "gap": _row_gaps(logits[a], logits[b]),
                "argmax_equal": (logits[a].argmax(-1) == logits[b].argmax(-1)).tolist(),
            }
    return cell


# --- the study -----------------------------------------------------------------------------------------------------

def build_cells(prompts: Sequence[str], lengths: Sequence[int], sweep_lengths: Sequence[int] = (),
                sweep_prompt: int = 0) -> list[dict[str, Any]]:
    """The grid (every prompt x every length) then the sweep (one prompt over lengths a page apart)."""
    cells = [{"group": "grid", "prompt_index": p, "length": int(n)} for p in range(len(prompts)) for n in lengths]
    cells += [{"group": "sweep", "prompt_index": int(sweep_prompt), "length": int(n)} for n in sweep_lengths]
    return cells


DEFAULT_LENGTHS = {"cuda": ([100, 1000, 4000], [1000 + 64 * k for k in range(1, 6)]),
                   "cpu": ([61, 130, 250], [33, 97, 161])}


def default_lengths(device: torch.device) -> tuple[list[int], list[int]]:
    """(grid lengths, sweep lengths a page apart) sized for the device: long on a GPU, short enough for a CPU to
    run the float64 reference attention in minutes."""
    grid, sweep = DEFAULT_LENGTHS["cuda" if device.type == "cuda" else "cpu"]
    return list(grid), list(sweep)


def run_study(*, model_path: str | None, prompts: Sequence[str], lengths: Sequence[int] | None, steps: int,
              arms: Sequence[str], sweep_lengths: Sequence[int] | None = (), sweep_prompt: int = 0,
              device: str = "auto", dtype: str = "auto", ref_pool_dtype: str = "model",
              attn_implementation: str = "sdpa", seed: int = 0, kernel_backend: str = "jit", poison: bool = True,
              synthetic_config: dict | None = None, out_dir: str | None = None, log=print) -> dict[str, Any]:
    """Run every cell, summarise, place the drift line, and write `out_dir/drift_results.json`.
    `lengths` / `sweep_lengths` None take `default_lengths(device)`. The incumbent is the model loaded with
    `attn_implementation` ("sdpa" or "eager") and transformers' DynamicCache; the other arms are the same model on
    foldkv's implementation of the same sliding attention with a FoldKvCache (see `foldkv.lab.model`)."""
    for arm in arms:
        if arm not in MODEL_ARMS:
            raise ValueError(f"unknown arm {arm!r}; expected some of {list(MODEL_ARMS)}")
    foldkv_implementation(attn_implementation)  # refuses an incumbent the foldkv arms cannot stand beside
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    grid_default, sweep_default = default_lengths(dev)
    lengths = list(grid_default if lengths is None else lengths)
    sweep_lengths = list(sweep_default if sweep_lengths is None else sweep_lengths)
    model, tokenizer, info = prepare_model(model_path, device=dev, dtype=dt, seed=seed,
                                           attn_implementation=attn_implementation, synthetic_config=synthetic_config)
    from ..hf import global_geometry, global_layer_indices, text_model_of

    pool_dt = None if ref_pool_dtype == "model" else resolve_dtype(ref_pool_dtype)
    settings = ArmSettings(ref_pool_dtype=pool_dt, kernel_backend=kernel_backend, poison=poison, scatter_seed=seed)
    text_model = text_model_of(model)
    info["global_layers"] = global_layer_indices(text_model)
    geom = global_geometry(text_model, text_model.layers[info["global_layers"][0]].self_attn)
    info["geometry"] = {k: getattr(geom, k) for k in
                        ("num_q_heads", "num_kv_heads", "head_dim", "partial_rotary_factor", "rope_theta")}
    vocab = int(model.get_output_embeddings().weight.shape[0])
    arm_status: dict[str, str] = {}
    for arm in arms:  # the reason an arm cannot run here is known before any cell
        try:
            check_arm_available(arm, dev)
        except ArmUnavailable as exc:
            arm_status[arm] = f"not run: {exc}"
    log(f"model: {info['kind']} {info['path']} ({info['class']}, {info['dtype']} on {info['device_name']})")
    for arm, st in arm_status.items():
        log(f"arm {arm}: {st}")
    cells = build_cells(prompts, lengths, sweep_lengths, sweep_prompt)
    t0 = time.perf_counter()
    for i, cell in enumerate(cells):
        ids = prompt_token_ids(prompts[cell["prompt_index"]], cell["length"], vocab, tokenizer)
        cell.update(run_cell(model, settings, ids, steps, arms, arm_status, log=log))
        if out_dir is not None:  # after every cell, so a crash (a dead CUDA context) keeps the cells before it
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, PARTIAL_NAME), "w") as fh:
                json.dump(jsonable({"model": info, "arm_status": arm_status, "cells": cells[: i + 1]}), fh, allow_nan=False)
        worst = {a: finite_max(r["gap"]) for a, r in cell["arms"].items() if r["status"] == "ran"}
        log(f"cell {i} ({cell['group']}, prompt {cell['prompt_index']}, length {cell['length']}): neutral max"
            f" {finite_max(cell['neutral']):.3g}; " + ", ".join(f"{a} max {g:.3g}" for a, g in worst.items()))
    results = {
        "model": info,
        "parameters": {"prompts": list(prompts), "lengths": list(lengths), "sweep_lengths": list(sweep_lengths),
                       "sweep_prompt": sweep_prompt, "steps": steps, "arms": list(arms), "device": str(dev),
                       "dtype": str(dt).replace("torch.", ""), "ref_pool_dtype": ref_pool_dtype, "seed": seed,
                       "kernel_backend": kernel_backend, "poison": poison,
                       "page_size": settings.page_size, "synthetic_config": synthetic_config or {},
                       "attn_implementation": attn_implementation},
        "arm_status": {arm: arm_status.get(arm, "not run: no cell reached it") for arm in arms},
        "cells": cells,
        "seconds": time.perf_counter() - t0,
    }
    results["summary"] = summarize(results)
    results["drift_line"] = drift_line(results)
    results["checks"] = check_study(results)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, RESULTS_NAME)
        results["provenance"] = provenance()  # commit, dirty flag, sha256 of every kernel the study ran
        with open(path, "w") as fh:
            json.dump(jsonable(results), fh, indent=1, allow_nan=False)
        results["json_path"] = os.path.abspath(path)
        if os.path.exists(os.path.join(out_dir, PARTIAL_NAME)):
            os.remove(os.path.join(out_dir, PARTIAL_NAME))
    return results


# --- summaries -----------------------------------------------------------------------------------------------------

def _is_finite(x) -> bool:
    return x is not None and math.isfinite(x)


def finite_max(values: Sequence[float | None]) -> float:
    """The max of `values`, NaN when any is NaN or None (a NaN written to JSON reads back as None). Python's max()
    keeps a NaN only when it comes first, so a NaN at any later step would otherwise vanish from a maximum."""
    vals = [math.nan if v is None else float(v) for v in values]
    if any(math.isnan(v) for v in vals):
        return math.nan
    return max(vals, default=math.nan)


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    """Quantiles of the finite values; `nonfinite` counts the rest (NaN, Inf, None), which the checks fail on."""
    vals = torch.tensor([v for v in values if _is_finite(v)], dtype=torch.float64)
    out = {"n": len(values), "nonfinite": sum(1 for v in values if not _is_finite(v))}
    for q in QUANTILES:
        key = "max" if q == 1.0 else f"p{q * 100:g}"
        out[key] = float(torch.quantile(vals, q)) if vals.numel() else float("nan")
    return out


def gaps_of(results: dict, series: str) -> list[float]:
    """Every step's gap of one series over all cells: an arm name, a pair name ('a vs b'), or 'neutral'."""
    out: list[float] = []
    for cell in results["cells"]:
        if series == "neutral":
            out += cell["neutral"]
        elif series in cell.get("arms", {}) and cell["arms"][series]["status"] == "ran":
            out += cell["arms"][series]["gap"]
        elif series in cell.get("pairs", {}):
            out += cell["pairs"][series]["gap"]
    return out


def summarize(results: dict) -> dict[str, Any]:
    """Per arm (and pair, and neutral): gap quantiles over every cell and step, argmax agreement overall and per cell."""
    arms = [a for a in results["parameters"]["arms"] if a != "incumbent"]
    pairs = sorted({p for c in results["cells"] for p in c.get("pairs", {})})
    summary: dict[str, Any] = {"neutral": {"gap": _quantiles(gaps_of(results, "neutral"))}}
    for name in arms + pairs:
        eq, per_cell, failed = [], [], []
        for i, cell in enumerate(results["cells"]):
            rec = cell.get("arms", {}).get(name) or cell.get("pairs", {}).get(name)
            if rec is not None and rec.get("status", "ran") != "ran":
                failed.append(i)
            if rec is None or rec.get("status", "ran") != "ran":
                continue
            eq += rec["argmax_equal"]
            per_cell.append({"cell": i, "equal": int(sum(rec["argmax_equal"])), "of": len(rec["argmax_equal"])})
        if not eq:
            summary[name] = {"status": results["arm_status"].get(name, "not run")}
            continue
        summary[name] = {
            "status": results["arm_status"].get(name, "ran"),
            "gap": _quantiles(gaps_of(results, name)),
            "argmax_equal": int(sum(eq)),
            "argmax_of": len(eq),
            "argmax_agreement": sum(eq) / len(eq),
            "per_cell": per_cell,
            "failed_cells": failed,
        }
    return summary


def _nice_ceil(x: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is >= x."""
    if not x > 0 or math.isinf(x):
        return x
    e = math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if m * 10**e >= x * (1 - 1e-12):
            return float(m * 10**e)
    return float(10 ** (e + 1))


def drift_line(results: dict, headroom: float = 2.0) -> dict[str, Any]:
    """A drift line placed above everything measured, with the reasoning computed from the data. It describes the
    run; it is no check (it sits above every finite gap by construction): `check_study` is.

    line = the 1-2-5 value at or above `headroom` x the largest gap of any arm against the incumbent (and of the
    neutral figure). The headroom is the margin for cells not run; the reasoning compares the line with the neutral
    spread and with the incumbent's top-1/top-2 margins (a step whose margin is below 2 x line could flip argmax
    under a drift of the line's size), and explains every argmax flip observed by its margin."""
    arms = [a for a in results["parameters"]["arms"] if a != "incumbent"]
    worst = {a: finite_max(gaps_of(results, a)) for a in arms if gaps_of(results, a)}
    nan_arms = [a for a in worst if not math.isfinite(worst[a])]
    finite = {a: g for a, g in worst.items() if math.isfinite(g)}
    neutral = [g for g in gaps_of(results, "neutral") if _is_finite(g)]
    neutral_max = max(neutral) if neutral else float("nan")
    top = max(list(finite.values()) + ([neutral_max] if neutral else []), default=float("nan"))
    line = _nice_ceil(headroom * top)
    margins = [m for c in results["cells"] for m in c["margin"]]
    near = sum(1 for m in margins if m < 2 * line)
    flips = []
    for i, cell in enumerate(results["cells"]):
        for arm, rec in cell.get("arms", {}).items():
            if rec.get("status") != "ran":
                continue
            for s, ok in enumerate(rec["argmax_equal"]):
                if not ok:
                    flips.append({"cell": i, "arm": arm, "step": s, "margin": cell["margin"][s], "gap": rec["gap"][s],
                                  "explained": cell["margin"][s] <= 2 * rec["gap"][s] + 1e-6})
    lines = []
    if finite:
        a_max = max(finite, key=finite.get)
        lines.append(f"largest gap of any arm vs the incumbent: {finite[a_max]:.3g} ({a_max}); per arm: "
                     + ", ".join(f"{a} {g:.3g}" for a, g in finite.items()))
    if neutral:
        neutral_med = float(torch.tensor(neutral).median())
        lines.append(f"neutral (incumbent walk vs its own single pass): median {neutral_med:.3g}, max {neutral_max:.3g}"
                     + (" (bit-identical here: this model's walk and single pass round the same way)"
                        if neutral_max == 0 else ""))
        for a, g in finite.items():
            med = float(torch.tensor([x for x in gaps_of(results, a) if _is_finite(x)]).median())
            if neutral_max > 0 and neutral_med > 0:
                lines.append(f"{a}: median gap {med:.3g} = {med / neutral_med:.3g} x the neutral median;"
                             f" max {g:.3g} = {g / neutral_max:.3g} x the neutral max")
            else:
                lines.append(f"{a}: median gap {med:.3g}, max {g:.3g} (no neutral spread to scale by)")
    lines.append(f"line = 1-2-5 ceiling of {headroom:g} x {top:.3g} = {line:.3g}: above every measured gap")
    if margins:
        lines.append(f"{near} of {len(margins)} steps ({100 * near / len(margins):.1f}%) have an incumbent top-1/top-2"
                     f" margin below 2 x line = {2 * line:.3g}: only there could a drift of the line's size flip argmax"
                     f" (smallest margin {min(margins):.3g})")
    if flips:
        unexplained = [f for f in flips if not f["explained"]]
        lines.append(f"{len(flips)} argmax flips, every one at a margin <= 2 x its gap" if not unexplained else
                     f"{len(flips)} argmax flips, {len(unexplained)} at a margin above 2 x the gap (inconsistent: check)")
    else:
        lines.append("no argmax flip in any arm that ran")
    if nan_arms:
        lines.append(f"NaN/Inf logits in {nan_arms}: those arms read unwritten (poisoned) rows or produced NaN;"
                     " not bounded (the finite check fails them)")
    return {"value": line, "headroom": headroom, "largest_gap": top, "per_arm_max": worst, "neutral_max": neutral_max,
            "steps_with_margin_below_2x_line": near, "flips": flips, "reasoning": lines}


# --- the checks ----------------------------------------------------------------------------------------------------

def dtype_ulp(dtype: str | torch.dtype, x: float) -> float:
    """The spacing of `dtype` numbers at |x|: eps x 2^floor(log2 |x|) (bf16: 2^-7 at [1, 2)); 0 at x == 0."""
    dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    return torch.finfo(dt).eps * 2.0 ** math.floor(math.log2(abs(x))) if x else 0.0


def binomial_tail(b: int, n: int) -> float:
    """P(X >= b) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(b, n + 1)) / 2**n if n else 1.0


def _where(cell: dict, i: int) -> str:
    return f"cell {i} ({cell.get('group', '?')}, prompt {cell.get('prompt_index', '?')}, length {cell['length']})"


def gated_arms() -> tuple[str, ...]:
    """The arms the gap and argmax checks gate: the generated kernels over bf16 pools. The FP8 kernel arm is measured
    against the same limits but not gated: its pool's format errs ~10x bf16 (bench/FP8_NOTES.md), which the neutral
    figure (two orderings of bf16 arithmetic) does not gauge; its own kernel error is the pair folded-fp8 /
    ref-folded-fp8 (the same FP8 rows, read by the kernels and by the float64 reference)."""
    return tuple(a for a, spec in MODEL_ARMS.items() if spec.backend == "kernel" and spec.pool_dtype is None)


def check_study(results: dict, gated: Sequence[str] | None = None) -> dict[str, Any]:
    """The study's checks, per section: `incumbent` (its logits, margins and neutral gaps finite) and each arm that
    ran (finite; and for the arms in `gated`, default `gated_arms()`, gap and argmax: see the module docstring and
    GAP_FACTOR / ARGMAX_ALPHA; other arms get those figures too, marked not gated). Returns {"sections": {name:
    {"passed": True | False | None, "failures": [...], ...}}, "passed": ...}; None: the arm never ran (its status
    says why), so nothing was checked. Reads results as run_study returns them or as drift_results.json holds them."""
    gated = gated_arms() if gated is None else tuple(gated)
    cells = results["cells"]
    dtype = results["parameters"].get("dtype", "bfloat16")
    sections: dict[str, Any] = {}

    bad_inc = []
    for i, cell in enumerate(cells):
        steps = set(cell.get("incumbent_nonfinite_steps", []))
        steps |= {s for key in ("margin", "neutral") for s, v in enumerate(cell[key]) if not _is_finite(v)}
        if "logit_absmax" in cell and not _is_finite(cell["logit_absmax"]):
            steps |= set(range(cell["steps"] + 1))
        if steps:
            bad_inc.append(f"NaN/Inf in the incumbent's logits or neutral gap: {_where(cell, i)}, steps {sorted(steps)}")
    sections["incumbent"] = {"passed": not bad_inc, "failures": bad_inc}

    neutral = _quantiles(gaps_of(results, "neutral"))
    absmax = [c["logit_absmax"] for c in cells if _is_finite(c.get("logit_absmax"))]
    slack = GAP_SLACK_ULPS * dtype_ulp(dtype, max(absmax)) if absmax else 0.0
    slack_note = (f"{GAP_SLACK_ULPS} {dtype} ulp at the largest |logit| {max(absmax):.3g}" if absmax else
                  "0: the results record no logit magnitude (a stricter limit, not a looser one)")
    neutral_argmax = all("neutral_argmax_equal" in c for c in cells)

    for arm in [a for a in results["parameters"]["arms"] if a != "incumbent"]:
        ran = [(i, c, c["arms"][arm]) for i, c in enumerate(cells) if c.get("arms", {}).get(arm, {}).get("status") == "ran"]
        errored = [i for i, c in enumerate(cells) if arm in c.get("arms", {}) and c["arms"][arm].get("status") != "ran"]
        if not ran:
            sections[arm] = {"passed": None if not errored else False,
                             "failures": [f"errored in cells {errored}"] if errored else [],
                             "status": results.get("arm_status", {}).get(arm, "not run")}
            continue
        failures = [f"errored in cells {errored}: {cells[errored[0]]['arms'][arm]['status']}"] if errored else []
        for i, cell, rec in ran:
            steps = set(rec.get("nonfinite_steps", rec.get("nan_steps", [])))
            steps |= {s for s, g in enumerate(rec["gap"]) if not _is_finite(g)}
            for name, pair in cell.get("pairs", {}).items():
                if arm in name.split(" vs "):
                    steps |= {s for s, g in enumerate(pair["gap"]) if not _is_finite(g)}
            if steps:
                failures.append(f"NaN/Inf logits: {_where(cell, i)}, steps {sorted(steps)}")
        over = []  # gap and argmax findings: failures for a gated arm, notes for another
        q_arm = _quantiles([g for _, _, rec in ran for g in rec["gap"]])
        gap = {}
        for q in GAP_QUANTILES:
            limit = GAP_FACTOR * neutral[q] + slack if math.isfinite(neutral[q]) else slack
            gap[q] = {"arm": q_arm[q], "neutral": neutral[q], "limit": limit}
            if not q_arm[q] <= limit:
                over.append(f"gap {q} {q_arm[q]:.4g} > {GAP_FACTOR:g} x neutral {q} {neutral[q]:.4g}"
                                f" + slack {slack:.3g} = {limit:.4g}")
        if neutral_argmax:
            b = sum(1 for _, c, rec in ran for a, n in zip(rec["argmax_equal"], c["neutral_argmax_equal"]) if n and not a)
            c_ = sum(1 for _, c, rec in ran for a, n in zip(rec["argmax_equal"], c["neutral_argmax_equal"]) if a and not n)
            p = binomial_tail(b, b + c_)
            argmax = {"arm_only_flips": b, "neutral_only_flips": c_, "p": p}
            if p < ARGMAX_ALPHA:
                over.append(f"argmax: {b} steps flipped by the arm alone against {c_} by the single pass alone"
                                f" (P = {p:.2g} < {ARGMAX_ALPHA:g} under 'the arm is another reordering')")
        else:
            argmax = "not checked: the results record no single-pass argmax (neutral_argmax_equal)"
        if arm in gated:
            failures += over
        sections[arm] = {"passed": not failures, "failures": failures, "gap": gap, "argmax": argmax,
                         "gated": arm in gated, "not_gated_over": [] if arm in gated else over}
    return {"gap_factor": GAP_FACTOR, "slack": slack, "slack_note": slack_note, "argmax_alpha": ARGMAX_ALPHA,
            "neutral": neutral, "sections": sections,
            "passed": all(v["passed"] is not False for v in sections.values())}


def checks_table(checks: dict) -> str:
    """Markdown: per section pass / FAIL / not checked, the gap quantiles against their limits, the argmax test."""
    rows = ["| section | result | gap p50 / p90 / max (limit) | argmax: arm-only vs neutral-only flips (P) | failures |",
            "|---|---|---|---|---|"]
    for name, sec in checks["sections"].items():
        result = {True: "pass", False: "FAIL", None: "not checked"}[sec["passed"]]
        gap = " / ".join(f"{v['arm']:.3g} ({v['limit']:.3g})" for v in sec["gap"].values()) if "gap" in sec else ""
        am = sec.get("argmax", "")
        am = f"{am['arm_only_flips']} vs {am['neutral_only_flips']} (P {am['p']:.2g})" if isinstance(am, dict) else am
        why = "; ".join(sec["failures"]) or sec.get("status", "")
        if "gated" in sec and not sec["gated"]:
            result += " (gap, argmax not gated)"
            why = "; ".join([why] * bool(why) + [f"not gated: {x}" for x in sec["not_gated_over"]])
        rows.append(f"| {name} | {result} | {gap} | {am} | {why} |")
    return "\n".join(rows)


def record_sections(record, results: dict) -> dict[str, str]:
    """Write the study's sections into a `foldkv.lab.report.RunRecord`: `incumbent` and `arm:<name>` each "ran", "not run:
    ..." or "failed: ..." (an arm that errored, or any failed check; the failures named). Returns the sections."""
    checks = results.get("checks") or check_study(results)
    inc = checks["sections"]["incumbent"]
    if inc["passed"]:
        record.ran("incumbent")
    else:
        record.failed("incumbent", "; ".join(inc["failures"]))
    for arm, status in results["arm_status"].items():
        sec = checks["sections"].get(arm, {})
        if status.startswith("not run"):
            record.not_run(f"arm:{arm}", status)
        elif sec.get("passed") is False:
            record.failed(f"arm:{arm}", "; ".join(sec["failures"]))
        elif status == "ran":
            record.ran(f"arm:{arm}", gap=sec.get("gap"), argmax=sec.get("argmax"), gated=sec.get("gated"))
        else:
            record.failed(f"arm:{arm}", status)
    return dict(record.sections)


# --- presentation helpers -------------------------------------------------------------------------------------------

def cell_table(results: dict, index: int) -> str:
    """A markdown table of one cell: per step the incumbent's margin, the neutral gap, each arm's gap (with '✗' when
    its argmax differs from the incumbent's)."""
    cell = results["cells"][index]
    ran = [a for a, r in cell["arms"].items() if r.get("status") == "ran"]
    head = ["step", "margin", "neutral"] + ran + list(cell.get("pairs", {}))
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in range(cell["steps"] + 1):
        vals = [str(s) if s else "0 (prefill)", f"{cell['margin'][s]:.3g}", f"{cell['neutral'][s]:.3g}"]
        for a in ran:
            r = cell["arms"][a]
            vals.append(f"{r['gap'][s]:.3g}" + ("" if r["argmax_equal"][s] else " ✗"))
        for p, r in cell.get("pairs", {}).items():
            vals.append(f"{r['gap'][s]:.3g}" + ("" if r["argmax_equal"][s] else " ✗"))
        rows.append("| " + " | ".join(vals) + " |")
    not_ran = {a: r["status"] for a, r in cell["arms"].items() if r.get("status") != "ran"}
    title = (f"**cell {index}** ({cell['group']}): prompt {cell['prompt_index']}, length {cell['length']}, "
             f"{cell['steps']} decode steps" + (f"; failed: {not_ran}" if not_ran else ""))
    return title + "\n\n" + "\n".join(rows)


def summary_table(results: dict) -> str:
    """Markdown: per series the gap quantiles and argmax agreement (arms, pairs, neutral)."""
    rows = ["| series | status | argmax agree | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|---|"]
    for name, rec in results["summary"].items():
        if "gap" not in rec:
            rows.append(f"| {name} | {rec.get('status', '')} | | | | | |")
            continue
        q = rec["gap"]
        agree = f"{rec['argmax_equal']}/{rec['argmax_of']}" if "argmax_equal" in rec else "-"
        status = rec.get("status", "") if name != "neutral" else "incumbent walk vs single pass"
        rows.append(f"| {name} | {status} | {agree} | {q['p50']:.3g} | {q['p90']:.3g} | {q['p99']:.3g} | {q['max']:.3g} |")
    return "\n".join(rows)


def model_summary(results: dict) -> str:
    """Markdown: which model ran (a synthetic checkpoint says so), its geometry and software, each arm's status and
    the cells."""
    from .. import __version__

    info, p = results["model"], results["parameters"]
    kind = (f"a SYNTHETIC checkpoint (seed {info['seed']}; random weights, 31B global-attention geometry)"
            if info["kind"] == "synthetic" else "the checkpoint at " + info["path"])
    lines = [f"**Model:** {kind}", "",
             f"`{info['class']}` from `{info['path']}`: {info['num_hidden_layers']} layers ({len(info['global_layers'])}"
             f" global: {info['global_layers']}), hidden {info['hidden_size']}, vocab {info['vocab_size']}; global"
             f" geometry {info['geometry']}",
             f"dtype {info['dtype']} on {info['device']} ({info['device_name']}); transformers {info['transformers']},"
             f" torch {info['torch']}, foldkv {__version__}, incumbent attention `{info['attn_implementation']}`", "",
             "**Arms:**"]
    lines += [f"- `{arm}`: {status}" for arm, status in results["arm_status"].items()]
    not_run = [a for a, s in results["arm_status"].items() if s != "ran"]
    lines += ["", f"Arms that did not run here: {not_run if not_run else 'none'}"]
    lines += ["", f"Cells: {len(results['cells'])} (grid {len(p['prompts'])} prompts x lengths {p['lengths']};"
              f" sweep of prompt {p['sweep_prompt']} at {p['sweep_lengths']}), {p['steps']} decode steps each."]
    return "\n".join(lines)


def agreement_per_cell(results: dict) -> str:
    """One line per series: its argmax agreement with the incumbent in every cell, and the cells where it failed."""
    lines = []
    for name, rec in results["summary"].items():
        if "per_cell" in rec:
            failed = f"  failed cells: {rec['failed_cells']}" if rec.get("failed_cells") else ""
            lines.append(f"{name:28s} argmax agreement per cell: "
                         + " ".join(f"{c['cell']}:{c['equal']}/{c['of']}" for c in rec["per_cell"]) + failed)
    return "\n".join(lines)


def drift_line_text(results: dict) -> str:
    """Markdown: the drift line, its reasoning, and a table of every argmax flip."""
    dl = results["drift_line"]
    text = f"**Drift line: max |Δ logit| ≤ {dl['value']:.3g}**\n\n" + "\n".join(f"- {r}" for r in dl["reasoning"])
    if dl["flips"]:
        text += "\n\n" + "\n".join(["| cell | arm | step | margin | gap |", "|---|---|---|---|---|"] +
                                   [f"| {f['cell']} | {f['arm']} | {f['step']} | {f['margin']:.3g} | {f['gap']:.3g} |"
                                    for f in dl["flips"]])
    return text


def checks_text(checks: dict) -> str:
    """Markdown: the neutral quantiles and slack the limits are built from, then `checks_table`."""
    n = checks["neutral"]
    return (f"neutral gap p50 / p90 / max: {n['p50']:.3g} / {n['p90']:.3g} / {n['max']:.3g}; slack {checks['slack']:.3g}"
            f" ({checks['slack_note']})\n\n" + checks_table(checks))


# --- plots ----------------------------------------------------------------------------------------------------------

def _plot_series(results: dict) -> tuple[dict[str, list], float, float]:
    """({series: gaps} for every arm that ran and the neutral, the floor zero gaps are drawn at, the drift line)."""
    ran = [a for a in results["parameters"]["arms"] if results["arm_status"].get(a) == "ran"]
    series = {a: gaps_of(results, a) for a in ran}
    series["neutral"] = gaps_of(results, "neutral")
    positive = [g for v in series.values() for g in v if _is_finite(g) and g > 0]
    floor = min(positive) / 2 if positive else 1e-8  # a log axis has no 0: exact zeros are drawn at this floor
    return series, floor, results["drift_line"]["value"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"matplotlib is not installed ({exc}): plots skipped, the tables hold every number")
        return None
    return plt


def plot_gap_distribution(results: dict, path: str | None = None):
    """Histogram and CDF (log scale) of every series' gaps, with the drift line; saved to `path` when given. Returns
    the figure, or None when matplotlib is missing or no gap is finite."""
    series, floor, line = _plot_series(results)
    finite = [g for v in series.values() for g in v if _is_finite(g)]
    plt = _pyplot() if finite else None
    if plt is None:
        return None
    import matplotlib.ticker

    print(f"zero gaps drawn at {floor:.3g}; drift line {line:.3g}")
    fig, (ax_h, ax_c) = plt.subplots(1, 2, figsize=(13, 4.5))
    lo, hi = math.log10(floor), math.log10(max(max(finite), line)) + 0.1
    bins = torch.logspace(lo, hi, 40).tolist()
    for name, v in series.items():
        style = dict(color="k", lw=2.5) if name == "neutral" else {}
        xs = sorted(max(g, floor) for g in v if _is_finite(g))
        ax_h.hist(xs, bins=bins, histtype="step", label=f"{name} (n={len(v)})", **style)
        ax_c.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name, **style)
    for ax in (ax_h, ax_c):
        ax.set_xscale("log")
        ax.axvline(line, color="r", ls="--", label=f"drift line {line:.3g}")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("max |Δ logit| vs incumbent (neutral: walk vs single pass)")
    ax_h.set_ylabel("steps")
    ax_c.set_ylabel("fraction of steps ≤ x")
    ax_h.set_title("histogram")
    ax_c.set_title("CDF")
    ax_c.legend(fontsize=8)
    return _laid_out(fig, path)


def _laid_out(fig, path: str | None):
    """The figure laid out, saved to `path` when given (the run folder keeps the PNG), returned."""
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig


def plot_gap_vs_step_and_length(results: dict, path: str | None = None):
    """Per series: the max (and, dotted, the median over cells) gap at each decode step, and the max gap over the
    steps at each prompt length, with the drift line; saved to `path` when given. Returns the figure, or None when
    matplotlib is missing or no gap is finite."""
    series, floor, line = _plot_series(results)
    steps = results["parameters"]["steps"]
    plt = _pyplot() if any(_is_finite(g) for v in series.values() for g in v) else None
    if plt is None:
        return None
    fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name in series:
        per_step: list[list[float]] = [[] for _ in range(steps + 1)]
        per_len: dict[int, list[float]] = {}
        for c in results["cells"]:
            v = c["neutral"] if name == "neutral" else (c["arms"].get(name, {}).get("gap") or [])
            for s, g in enumerate(v):
                if _is_finite(g):
                    per_step[s].append(max(g, floor))
                    per_len.setdefault(c["length"], []).append(max(g, floor))
        style = dict(color="k", lw=2.5) if name == "neutral" else {}
        xs = [s for s in range(steps + 1) if per_step[s]]
        ax_s.plot(xs, [max(per_step[s]) for s in xs], marker="o", label=f"{name} max", **style)
        ax_s.plot(xs, [sorted(per_step[s])[len(per_step[s]) // 2] for s in xs], ls=":", color=ax_s.lines[-1].get_color())
        lengths = sorted(per_len)
        ax_l.plot(lengths, [max(per_len[n]) for n in lengths], marker="o", label=f"{name} max over steps", **style)
    for ax in (ax_s, ax_l):
        ax.set_yscale("log")
        ax.axhline(line, color="r", ls="--", label=f"drift line {line:.3g}")
        ax.set_ylabel("max |Δ logit|")
    ax_s.set_xlabel("step (0 = prefill's last row; dotted = median over cells)")
    ax_l.set_xlabel("prompt length (tokens)")
    ax_l.set_xscale("log")
    ax_s.legend(fontsize=8)
    return _laid_out(fig, path)
