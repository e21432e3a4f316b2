"""Greedy `generate()` of a Gemma 4 through a FoldKvCache, in one process or under tensor parallelism.

Run alone it is the one-process reference; under `torchrun` the model is loaded with transformers' own tensor
parallelism (`tp_plan="auto"`: q_proj / k_proj colwise, o_proj rowwise and its all-reduce), so each rank's cache holds
only its KV heads. Rank 0 writes one JSON file: per pool format the new tokens and the geometry each rank's global
layers were served with (every rank's, gathered). What `tests/test_tp_cpu.py` compares, and what a two-GPU run starts
from.

    python -m foldkv.lab.tp_generate CKPT --out one.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m foldkv.lab.tp_generate CKPT --out tp2.json
    ... --decode-step static --filled 300 3    # the fixed-address step; a decode after caches filled to 300 tokens

On the CPU the process group is gloo (transformers' choice for a CPU model) and the cache's attention is the float64
reference; on CUDA it is NCCL and the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence

import torch

# A left-padded batch: a short prompt behind padding, and a full-width one (pad id 0).
PROMPTS: tuple[tuple[int, ...], ...] = ((0, 0, 0, 5, 6, 7, 8, 9), (3, 4, 5, 6, 7, 8, 9, 10))


def launch(checkpoint: str, out: str | os.PathLike, *, ranks: int, args: Sequence[str] = (),
           timeout: float = 600, signal_retries: int = 1) -> dict[str, Any]:
    """This module on the CPU in a subprocess (plain for one rank, under torchrun with gloo for more; CUDA hidden) over
    `checkpoint`, writing `out`; returns what rank 0 wrote, with `launch_retries`: the runs before it that a rank's
    death by a signal ended (each said in a line). Such a run (on a loaded 2-core machine gloo's ranks have died of
    SIGABRT) is run again up to `signal_retries` times; any other failure, or a death past them, raises RuntimeError
    with the ranks' own output last (where a notebook's one-line tail shows it)."""
    import subprocess
    import sys

    lib = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
           if ranks > 1 else [sys.executable])
    cmd = run + ["-m", "foldkv.lab.tp_generate", checkpoint, "--out", os.fspath(out), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([lib, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    retries = []
    while True:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            break
        died = _signal_death(proc.stderr)
        if died and len(retries) < signal_retries:
            retries.append(died)
            continue
        ranks_said = "\n".join(ln for ln in proc.stderr.splitlines() if ln.startswith("[rank"))[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}; earlier runs: {retries or 'none'}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\nthe ranks' output:\n{ranks_said}")
    with open(out) as f:
        return {**json.load(f), "launch_retries": retries}


def _signal_death(stderr: str) -> str | None:
    """torchrun's line for a rank that a signal ended ("rank 1 ... Signal 6 (SIGABRT) received"), else None."""
    import re

    found = re.search(r"rank\s*:\s*(\d+).*?Signal (\d+) \((SIG\w+)\) received", stderr, re.S)
    return f"rank {found.group(1)} died of {found.group(3)}" if found else None


def world() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; (0, 1) in a plain process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def load_model(checkpoint: str, *, dtype: torch.dtype, attn_implementation: str, device: str | None = None):
    """The model, whole in one process, sharded by transformers' `tp_plan="auto"` under torchrun."""
    import foldkv.hf  # noqa: F401  (registers the foldkv attention implementations)
    from transformers import AutoModelForCausalLM

    _, size = world()
    kw: dict[str, Any] = {"tp_plan": "auto"} if size > 1 else {}
    if device is not None and size == 1:
        kw["device_map"] = device
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation=attn_implementation, **kw)


def served_geometry(cache) -> dict[str, int]:
    """The heads this process's global layers are served with (all global layers agree)."""
    geoms = {(layer.geometry.num_q_heads, layer.geometry.num_kv_heads, layer.geometry.head_dim)
             for layer in cache.global_layers}
    if len(geoms) != 1:
        raise AssertionError(f"global layers served with different geometries: {sorted(geoms)}")
    (hq, hkv, d), = geoms
    return {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "pool_bytes": cache.pool_bytes()}


def finish() -> None:
    """Every rank reaches this point before the process group goes (a plain process: nothing to do)."""
    if world()[1] > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order ([obj] in a plain process)."""
    _, size = world()
    if size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def generate_tokens(model, kv_format: str, *, new_tokens: int, prompt_shift: int = 0,
                    decode_step: str | None = None) -> dict[str, Any]:
    """Greedy new tokens of PROMPTS (each real token id + prompt_shift) through a FoldKvCache of `kv_format`
    (`decode_step`: FoldKvCache's; None: its default)."""
    from foldkv.hf import FoldKvCache

    device = next(model.parameters()).device
    ids = torch.tensor(PROMPTS, device=device)
    mask = (ids != 0).long()
    ids = torch.where(mask.bool(), ids + prompt_shift, ids)
    cache = FoldKvCache(model, max_batch=ids.shape[0], max_tokens=ids.shape[1] + new_tokens, kv_format=kv_format,
                        max_new_tokens=new_tokens, decode_step=decode_step)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         past_key_values=cache)
    return {"tokens": out[:, ids.shape[1]:].tolist(), "ranks": gather(served_geometry(cache))}


def step_accounting(model, kv_format: str, *, context: int, batch: int) -> dict[str, int]:
    """What one decode step of this process reads at `context` tokens a sequence (notebook 05's floor, per rank):
    its weights (`gemma31b.weight_bytes`: the local shards) and its KV (`model_decode.step_kv_bytes`: its heads);
    `whole_weight_bytes` counts every parameter whole (DTensor sizes), what a rank does not read."""
    from foldkv.lab import model_decode
    from foldkv.lab.gemma31b import weight_bytes

    return {"weight_bytes": weight_bytes(model),
            "whole_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "step_kv_bytes": model_decode.step_kv_bytes(model, model_decode.model_arm(f"foldkv-{kv_format}"),
                                                        context, batch)}


def filled_decode(model, kv_format: str, *, context: int, batch: int, new_tokens: int,
                  decode_step: str | None = None, seed: int = 0) -> list[list[int]]:
    """Greedy new tokens after a cache filled to `context` tokens a sequence without a prefill
    (`model_decode.filled_prompt`, as notebook 05's decode cells start): this rank's heads, random rows."""
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model_decode import filled_prompt

    cache = FoldKvCache(model, max_batch=batch, max_tokens=context + 1 + new_tokens, kv_format=kv_format,
                        max_new_tokens=new_tokens, decode_step=decode_step)
    ids = filled_prompt(cache, model, context, batch, seed=seed)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, past_key_values=cache)
    return out[:, context + 1:].tolist()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a Gemma 4 checkpoint folder (the synthetic one: foldkv.lab.synthetic)")
    p.add_argument("--formats", nargs="+", default=["folded", "split"], choices=["folded", "split"])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attn", default="foldkv_eager", choices=["foldkv", "foldkv_eager"],
                   help="the attention implementation (sliding layers: eager or sdpa)")
    p.add_argument("--prompt-shift", type=int, default=0, help="add this to every real prompt token (another prompt)")
    p.add_argument("--decode-step", default=None, choices=["eager", "static", "graph"],
                   help="FoldKvCache's decode_step (default: its own; 'static' is the fixed-address step on any device)")
    p.add_argument("--filled", type=int, nargs=2, default=None, metavar=("CONTEXT", "BATCH"),
                   help="also decode after caches filled to CONTEXT tokens for BATCH sequences without a prefill, and"
                        " record what each rank's step reads there")
    p.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    args = p.parse_args(argv)

    rank, size = world()
    model = load_model(args.checkpoint, dtype=getattr(torch, args.dtype), attn_implementation=args.attn)
    result: dict[str, Any] = {"world_size": size, "prompts": [list(x) for x in PROMPTS],
                              "prompt_shift": args.prompt_shift, "decode_step": args.decode_step, "formats": {}}
    for fmt in args.formats:
        r = result["formats"][fmt] = generate_tokens(model, fmt, new_tokens=args.new_tokens,
                                                     prompt_shift=args.prompt_shift, decode_step=args.decode_step)
        if args.filled:
            context, batch = args.filled
            r["filled"] = {"context": context, "batch": batch,
                           "tokens": filled_decode(model, fmt, context=context, batch=batch,
                                                   new_tokens=args.new_tokens, decode_step=args.decode_step),
                           "ranks": gather(step_accounting(model, fmt, context=context, batch=batch))}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        for fmt, r in result["formats"].items():
            print(f"[tp_generate] world {size} {fmt}: tokens {r['tokens']}; rank 0 serves"
                  f" {r['ranks'][0]['num_q_heads']} q / {r['ranks'][0]['num_kv_heads']} KV heads")
    finish()
    return result


if __name__ == "__main__":
    main()
