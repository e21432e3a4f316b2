"""Notebook 05's decode cells for the 31B architecture under transformers' tensor parallelism: one process a GPU under
torchrun, the model sharded by `tp_plan="auto"` as it loads (q/k/v and gate/up colwise, o_proj and down_proj rowwise
with their all-reduce over NCCL), each rank's FoldKvCache holding its KV heads (2 of 4 global, 8 of 16 sliding at TP 2)
and decoding through its own one-graph step.

Rank 0 writes one JSON file:
- `prefill`: per arm, the greedy tokens of one real prompt (batch 1) and its TTFT, every rank's row: what a TP 1 run
  of the same checkpoint is compared with (`model_decode.agreed_steps`), beside the neutral figure (folded against
  split within one run, `neutral_agreed_steps`);
- `decode`: per cell (context x batch) and arm, every rank's row of `model_decode.measure_decode`: TPOT (median and p90),
  the rank's byte floor (its weight shards plus the KV its heads read, over the read roof that rank measured in this
  process) and TPOT / floor, peak memory by component, the host's share of a step;
- `largest`: per arm, the largest batch of `largest_context`-token sequences every rank holds (computed from the memory
  the emptiest rank has free, then run: one sequence fewer after an out-of-memory, at most `LARGEST_TRIES` times).
Run alone (no torchrun) it is the TP 1 run on one GPU. The checkpoint comes from `--write-checkpoint`: the random 31B
that `gemma31b.build_gemma4_31b` makes (the same draws), as safetensors shards, since transformers' tensor parallelism
shards a checkpoint as it reads it.

    python -m foldkv.lab.tp_model_decode --write-checkpoint /tmp/g31          # one GPU, 61.4 GB of shards
    CUDA_VISIBLE_DEVICES=0 python -m foldkv.lab.tp_model_decode /tmp/g31 --cells --largest-context 0 --out tp1.json
    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m foldkv.lab.tp_model_decode /tmp/g31 --out tp2.json
(`scripts/lab_calls.sh` PART=tp2 runs the three on a two-GPU machine.)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from .tp_generate import gather, load_model, world

ARMS = ("foldkv-folded", "foldkv-fp8", "foldkv-split")
DEFAULT_CELLS = ("32768:8", "32768:16", "131072:8", "131072:16")  # context:batch
LARGEST_CONTEXT = 131072
LARGEST_TRIES = 4
MARGIN_GIB = 6  # activations, logits and the graph's pool at the largest batch (notebook 05's margin)


def parse_cell(text: str) -> tuple[int, int]:
    """"CONTEXT:BATCH" -> (context, batch), both positive integers."""
    parts = text.split(":")
    try:
        context, batch = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cell {text!r}: expected CONTEXT:BATCH, e.g. 32768:8") from None
    if context < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f"cell {text!r}: context and batch must be positive")
    return context, batch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", help="the checkpoint folder (--write-checkpoint makes one)")
    p.add_argument("--write-checkpoint", metavar="DIR", help="write the random 31B into DIR (one GPU) and stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--cells", nargs="*", type=parse_cell, default=[parse_cell(c) for c in DEFAULT_CELLS],
                   metavar="CONTEXT:BATCH", help="decode cells (none: only the prompt's tokens)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps a cell (the first, capturing, untimed)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="the real prompt whose greedy tokens are compared")
    p.add_argument("--prompt-new-tokens", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--largest-context", type=int, default=LARGEST_CONTEXT, help="0: no largest-batch cells")
    p.add_argument("--out", help="the JSON file rank 0 writes (required unless --write-checkpoint)")
    return p


def require_gpus(ranks: int) -> None:
    """Refuse before any model is loaded: one CUDA device a rank."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < ranks:
        raise SystemExit(f"tp_model_decode needs one CUDA device a rank: {ranks} rank(s), {have} device(s) visible"
                         " (the CPU path of tensor parallelism is foldkv.lab.tp_generate)")


def min_over_ranks(value: int) -> int:
    """The smallest `value` of every rank (the value itself in one process)."""
    _, size = world()
    if size == 1:
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def by_rank(rows_of_each_rank: list[list[dict]]) -> list[dict]:
    """[[rank 0's rows], [rank 1's rows], ...] -> one entry a row: its cell's keys and every rank's row."""
    out = []
    for rows in zip(*rows_of_each_rank):
        first = rows[0]
        out.append({"arm": first.get("arm"), "context": first.get("context", first.get("prompt_tokens")),
                    "batch": first.get("batch", 1), "status": first["status"] if all(r["status"] == first["status"]
                                                                               for r in rows) else "ranks differ",
                    "ranks": list(rows)})
    return out


def largest_cells(model, arms, context: int, roof_gbps: float, seed: int, log) -> list[dict]:
    from . import model_decode as md

    torch.cuda.empty_cache()
    free = min_over_ranks(torch.cuda.mem_get_info()[0])
    rows = []
    for arm in arms:
        want = md.largest_batch(model, arm, context, free_bytes=free, margin_bytes=MARGIN_GIB * 2**30)
        row: dict[str, Any] = {"arm": arm, "context": context, "computed_batch": want, "free_bytes": free,
                               "status": "not run"}
        for b in range(want, max(want - LARGEST_TRIES, 0), -1):
            [r] = md.run_cells(md.measure_decode, [dict(model=model, arm_name=arm, context=context, batch=b,
                                                        new_tokens=12, read_gbps=roof_gbps, seed=seed)], log=log)
            ok = min_over_ranks(int(r["status"] == "ran"))  # every rank ran it, or the batch is one too many
            row.update({k: v for k, v in r.items() if k != "tokens"})
            if ok:
                row["largest_batch"] = b
                break
        rows.append(row)
    return rows


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict | None:
    args = parser().parse_args(argv)
    rank, size = world()
    if args.write_checkpoint:
        require_gpus(1)
        from .gemma31b import count_parameters, write_gemma4_31b_checkpoint

        t0 = time.perf_counter()
        write_gemma4_31b_checkpoint(args.write_checkpoint, seed=args.seed, device="cuda")
        print(f"[tp_model_decode] the random 31B ({count_parameters():,} parameters, seed {args.seed}) written to"
              f" {args.write_checkpoint} in {time.perf_counter() - t0:.1f} s")
        return None
    if not args.checkpoint or not args.out:
        raise SystemExit("tp_model_decode: a checkpoint folder and --out are needed (or --write-checkpoint DIR)")
    require_gpus(size)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import foldkv.hf  # noqa: F401  (registers "foldkv")
    from . import model_decode as md
    from .bench.roofs import measure_read_roof
    from .gemma31b import weight_bytes

    log = print if rank == 0 else (lambda _: None)
    t0 = time.perf_counter()
    model = load_model(args.checkpoint, dtype=torch.bfloat16, attn_implementation="foldkv",
                       device="cuda" if size == 1 else None)
    log(f"[tp_model_decode] world {size}: loaded in {time.perf_counter() - t0:.1f} s, rank 0 holds"
        f" {weight_bytes(model) / 1e9:.1f} GB of weights")
    roof = measure_read_roof("cuda")
    prefill = md.run_cells(md.measure_prefill, [
        dict(model=model, arm_name=a, prompt_tokens=args.prompt_tokens, new_tokens=args.prompt_new_tokens,
             prefill_chunk=args.prefill_chunk, seed=args.seed) for a in args.arms], log=log)
    decode = md.run_cells(md.measure_decode, [
        dict(model=model, arm_name=a, context=n, batch=b, new_tokens=args.new_tokens, read_gbps=roof["gbps"],
             seed=args.seed) for n, b in args.cells for a in args.arms], log=log)
    largest = (largest_cells(model, args.arms, args.largest_context, roof["gbps"], args.seed, log)
               if args.largest_context else [])
    result = {"world_size": size, "checkpoint": os.path.abspath(args.checkpoint), "seed": args.seed,
              "roof": gather(roof), "weight_bytes": gather(weight_bytes(model)),
              "prefill": by_rank(gather(prefill)), "decode": by_rank(gather([{k: v for k, v in r.items() if k != "tokens"}
                                                                              for r in decode])),
              "largest": by_rank(gather(largest))}
    if rank == 0:
        folded = next((r["ranks"][0].get("tokens") for r in result["prefill"] if r["arm"] == "foldkv-folded"), None)
        split = next((r["ranks"][0].get("tokens") for r in result["prefill"] if r["arm"] == "foldkv-split"), None)
        if folded and split:
            result["neutral_agreed_steps"] = md.agreed_steps(folded, split)  # folded against split, this run
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        log(f"[tp_model_decode] wrote {args.out}")
    if size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
