"""The drift study's run: the model (a checkpoint, or a synthetic one through the same loader), the cells of (prompt,
length), each cell's walks (the incumbent greedy, every arm teacher-forced on its tokens, the incumbent's single pass)
and the study over every cell into its JSON of results (what notebooks/03_drift_study.ipynb runs)."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
import traceback
import zlib
from typing import Any, Sequence

import torch

from ...validate import check_device
from ..arms import ArmUnavailable
from ..checkout_stamp import provenance
from ..jsonsafe import jsonable
from ..model import MODEL_ARMS, ArmSettings, check_arm_available, foldkv_implementation, load_model, single_pass, walk
from ..synthetic import describe_checkpoint, make_synthetic_checkpoint
from .checks import check_study
from .summary import drift_line, finite_max, summarize

PAIRS = (("ref-folded", "ref-split"), ("folded", "split"), ("split", "ref-split"), ("folded", "ref-folded"),
         ("ref-folded-fp8", "ref-folded"), ("folded-fp8", "ref-folded-fp8"), ("folded-fp8", "folded"),
         ("folded-fp8-exact", "ref-folded-fp8"), ("folded-fp8", "folded-fp8-exact"))
RESULTS_NAME = "drift_results.json"
PARTIAL_NAME = "drift_results.partial.json"


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
    from ...hf import global_geometry, global_layer_indices, text_model_of

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
