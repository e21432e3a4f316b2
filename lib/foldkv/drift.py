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

from .model import ARM_SPECS, ArmUnavailable, check_arm_available, hook_global_attention, load_model, single_pass, walk
from .synthetic import describe_checkpoint, make_synthetic_checkpoint

PAIRS = (("ref-folded", "ref-split"), ("folded", "split"), ("split", "ref-split"), ("folded", "ref-folded"))
QUANTILES = (0.5, 0.9, 0.99, 1.0)
RESULTS_NAME = "drift_results.json"
PARTIAL_NAME = "drift_results.partial.json"


# --- set-up ------------------------------------------------------------------------------------------------------

def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
        synthetic_dir = synthetic_dir or tempfile.mkdtemp(prefix="foldkv_synthetic_")
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


def run_cell(model, hook, prompt_ids: torch.Tensor, steps: int, arms: Sequence[str], arm_status: dict[str, str],
             *, log=print) -> dict[str, Any]:
    """Walk the incumbent greedily, then every arm teacher-forced on the same tokens, and the incumbent's single pass
    over the same tokens. `arm_status` carries "not run: ..." across cells so an unavailable arm is tried once."""
    t0 = time.perf_counter()
    inc = walk(model, hook, "incumbent", prompt_ids, steps)
    full = torch.cat([prompt_ids.reshape(-1).cpu(), inc.fed])
    one = single_pass(model, hook, full, keep=steps + 1)
    cell: dict[str, Any] = {
        "length": int(prompt_ids.numel()),
        "steps": int(steps),
        "fed_tokens": inc.fed.tolist(),
        "incumbent_argmax": inc.logits.argmax(-1).tolist(),
        "margin": _margins(inc.logits),
        "neutral": _row_gaps(inc.logits, one),
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
            w = walk(model, hook, arm, prompt_ids, steps, feed=inc.fed)
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
            "prep": w.prep,
            "gap": gap,
            "argmax_equal": (w.logits.argmax(-1) == inc.logits.argmax(-1)).tolist(),
            "nan_steps": [s for s, g in enumerate(gap) if math.isnan(g)],
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
              attn_implementation: str = "sdpa", seed: int = 0, prep_backend: str = "auto",
              kernel_backend: str = "jit", poison: bool = True, synthetic_config: dict | None = None,
              out_dir: str | None = None, log=print) -> dict[str, Any]:
    """Run every cell, summarise, place the drift line, and write `out_dir/drift_results.json`.
    `lengths` / `sweep_lengths` None take `default_lengths(device)`."""
    for arm in arms:
        if arm not in ARM_SPECS:
            raise ValueError(f"unknown arm {arm!r}; expected some of {list(ARM_SPECS)}")
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    grid_default, sweep_default = default_lengths(dev)
    lengths = list(grid_default if lengths is None else lengths)
    sweep_lengths = list(sweep_default if sweep_lengths is None else sweep_lengths)
    model, tokenizer, info = prepare_model(model_path, device=dev, dtype=dt, seed=seed,
                                           attn_implementation=attn_implementation, synthetic_config=synthetic_config)
    pool_dt = None if ref_pool_dtype == "model" else resolve_dtype(ref_pool_dtype)
    hook = hook_global_attention(model, device=dev, ref_pool_dtype=pool_dt, prep_backend=prep_backend,
                                 kernel_backend=kernel_backend, poison=poison, scatter_seed=seed)
    info["global_layers"] = hook.global_layers
    info["geometry"] = {k: getattr(hook.runtime.layers[0].geometry, k) for k in
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
        cell.update(run_cell(model, hook, ids, steps, arms, arm_status, log=log))
        if out_dir is not None:  # after every cell, so a crash (a dead CUDA context) keeps the cells before it
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, PARTIAL_NAME), "w") as fh:
                json.dump(_json_safe({"model": info, "arm_status": arm_status, "cells": cells[: i + 1]}), fh)
        worst = {a: max(r["gap"]) for a, r in cell["arms"].items() if r["status"] == "ran"}
        log(f"cell {i} ({cell['group']}, prompt {cell['prompt_index']}, length {cell['length']}): neutral max"
            f" {max(cell['neutral']):.3g}; " + ", ".join(f"{a} max {g:.3g}" for a, g in worst.items()))
    results = {
        "model": info,
        "parameters": {"prompts": list(prompts), "lengths": list(lengths), "sweep_lengths": list(sweep_lengths),
                       "sweep_prompt": sweep_prompt, "steps": steps, "arms": list(arms), "device": str(dev),
                       "dtype": str(dt).replace("torch.", ""), "ref_pool_dtype": ref_pool_dtype, "seed": seed,
                       "prep_backend": prep_backend, "kernel_backend": kernel_backend, "poison": poison,
                       "page_size": hook.runtime.page_size, "synthetic_config": synthetic_config or {},
                       "attn_implementation": attn_implementation},
        "arm_status": {arm: arm_status.get(arm, "not run: no cell reached it") for arm in arms},
        "cells": cells,
        "seconds": time.perf_counter() - t0,
    }
    results["summary"] = summarize(results)
    results["drift_line"] = drift_line(results)
    hook.unhook()
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, RESULTS_NAME)
        with open(path, "w") as fh:
            json.dump(_json_safe(results), fh, indent=1)
        results["json_path"] = os.path.abspath(path)
        if os.path.exists(os.path.join(out_dir, PARTIAL_NAME)):
            os.remove(os.path.join(out_dir, PARTIAL_NAME))
    return results


# --- summaries -----------------------------------------------------------------------------------------------------

def _quantiles(values: Sequence[float]) -> dict[str, float]:
    vals = torch.tensor([v for v in values if v is not None and not math.isnan(v)], dtype=torch.float64)
    out = {"n": len(values), "nan": sum(1 for v in values if v is None or math.isnan(v))}
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
    """A drift line placed above everything measured, with the reasoning computed from the data.

    line = the 1-2-5 value at or above `headroom` x the largest gap of any arm against the incumbent (and of the
    neutral figure). The headroom is the margin for cells not run; the reasoning compares the line with the neutral
    spread and with the incumbent's top-1/top-2 margins (a step whose margin is below 2 x line could flip argmax
    under a drift of the line's size), and explains every argmax flip observed by its margin."""
    arms = [a for a in results["parameters"]["arms"] if a != "incumbent"]
    worst = {a: max(gaps_of(results, a)) for a in arms if gaps_of(results, a)}
    nan_arms = [a for a in worst if math.isnan(worst[a])]
    finite = {a: g for a, g in worst.items() if not math.isnan(g)}
    neutral = [g for g in gaps_of(results, "neutral") if not math.isnan(g)]
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
            med = float(torch.tensor([x for x in gaps_of(results, a) if not math.isnan(x)]).median())
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
        lines.append(f"NaN logits in {nan_arms}: those arms read unwritten (poisoned) rows or produced NaN; not bounded")
    return {"value": line, "headroom": headroom, "largest_gap": top, "per_arm_max": worst, "neutral_max": neutral_max,
            "steps_with_margin_below_2x_line": near, "flips": flips, "reasoning": lines}


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


def _json_safe(x):
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
