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
(Notebook 06 runs the three on a machine of two GPUs: `gpu_steps`, `run_steps`; `PART=tp bash scripts/device_run.sh`.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .model_decode import parse_cell
from .tp_generate import finish, gather, load_model, world

ARMS = ("foldkv-folded", "foldkv-fp8", "foldkv-split")
DEFAULT_CELLS = ("32768:8", "32768:16", "131072:8", "131072:16")  # context:batch
LARGEST_CONTEXT = 131072
LARGEST_TRIES = 4
MARGIN_GIB = 6  # activations, logits and the graph's pool at the largest batch (notebook 05's margin)


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
    """`model_decode.largest_batch_run` per arm from the memory the emptiest rank has free, a batch taken only when
    every rank ran it (one rank out of memory: one sequence fewer on all)."""
    from . import model_decode as md

    torch.cuda.empty_cache()
    free = min_over_ranks(torch.cuda.mem_get_info()[0])
    return [{**md.largest_batch_run(model, arm, context, free_bytes=free, margin_bytes=MARGIN_GIB * 2**30,
                                    read_gbps=roof_gbps, seed=seed, tries=LARGEST_TRIES,
                                    everywhere=lambda ok: bool(min_over_ranks(int(ok))), log=log),
             "free_bytes": free} for arm in arms]


# --- what a card holds at TP 1 and TP n (computed) ---------------------------------------------------------------

def rank_weight_bytes(ranks: int) -> int:
    """Bytes of the 31B's weights one of `ranks` ranks holds under transformers' plan: every matrix (the projections,
    the tied embedding / LM head) split `ranks` ways, the norms and scalars whole (counted on the meta device)."""
    from transformers import Gemma4ForCausalLM

    from .gemma31b import _text_config, gemma4_31b_config

    with torch.device("meta"):
        model = Gemma4ForCausalLM(_text_config(gemma4_31b_config(), "sdpa")).to(torch.bfloat16)
    return sum(p.numel() * p.element_size() // (ranks if p.dim() == 2 else 1) for p in model.parameters())


def capacity_rows(ranks_list: Sequence[int], context: int, *, card_bytes: int, margin_bytes: int,
                  arms: Sequence[str] = ARMS) -> list[dict]:
    """Per TP size and pool: what one rank holds (its weight shards, a `context`-token sequence's KV of its heads:
    `model_decode.kv_bytes_read`) and the largest batch of such sequences every card holds, (card - weights - margin)
    / KV a sequence; `per_cards`: sequences max(ranks_list) cards serve (TP n: one model a group of n cards)."""
    from ..config import GEMMA4_31B
    from .gemma31b import gemma4_31b_config
    from .model_decode import kv_bytes_read, model_arm

    cfg = gemma4_31b_config()
    sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
    cards = max(ranks_list)
    if any(cards % r for r in ranks_list):
        raise ValueError(f"TP sizes {list(ranks_list)}: each must divide the largest ({cards} cards)")
    rows = []
    for ranks in ranks_list:
        geom = GEMMA4_31B.per_rank(ranks)
        weights = rank_weight_bytes(ranks)
        width = cfg["num_key_value_heads"] // ranks * cfg["head_dim"]
        for arm in arms:
            per_seq = kv_bytes_read(geom, model_arm(arm), global_layers=geom.num_global_layers,
                                    sliding_widths=[width] * sliding, window=cfg["sliding_window"], elem=2,
                                    context=context - 1, batch=1)
            largest = max(0, (card_bytes - weights - margin_bytes) // per_seq)
            rows.append({"ranks": ranks, "arm": arm, "rank_weight_bytes": weights, "rank_kv_bytes_per_seq": per_seq,
                         "largest_batch": largest, "per_cards": largest * (cards // ranks)})
    return rows


# --- the three runs notebook 06 makes on a machine of `ranks` GPUs ---------------------------------------------------

@dataclass(frozen=True)
class Step:
    name: str  # "checkpoint", "tp1", "tp<ranks>"
    argv: tuple[str, ...]
    env: dict[str, str]
    out: str | None  # the JSON it writes


def gpu_steps(checkpoint_dir: str, out_dir: str, *, ranks: int, cells: Sequence[tuple[int, int]],
              arms: Sequence[str], new_tokens: int, prompt_tokens: int, largest_context: int, seed: int) -> list[Step]:
    """The random 31B written once (skipped when `checkpoint_dir` holds it), its tokens at TP 1 on one GPU, then
    torchrun over `ranks` GPUs (NCCL, NVLink multicast off): tokens, decode cells, the largest batch."""
    py = sys.executable
    common = ["--arms", *arms, "--new-tokens", str(new_tokens), "--prompt-tokens", str(prompt_tokens),
              "--seed", str(seed)]
    steps = []
    me = "foldkv.lab.tp_model_decode"
    if not os.path.exists(os.path.join(checkpoint_dir, "model.safetensors.index.json")):
        steps.append(Step("checkpoint", (py, "-m", me, "--write-checkpoint", checkpoint_dir, "--seed", str(seed)),
                          {}, None))
    tp1 = os.path.join(out_dir, "tp1.json")
    steps.append(Step("tp1", (py, "-m", me, checkpoint_dir, *common, "--cells", "--largest-context", "0",
                              "--out", tp1), {"CUDA_VISIBLE_DEVICES": "0"}, tp1))
    tpn = os.path.join(out_dir, f"tp{ranks}.json")
    steps.append(Step(f"tp{ranks}", (py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                                     "-m", me, checkpoint_dir, *common, "--cells",
                                     *[f"{n}:{b}" for n, b in cells], "--largest-context", str(largest_context),
                                     "--out", tpn), {"NCCL_NVLS_ENABLE": "0"}, tpn))
    return steps


def run_steps(steps: Sequence[Step], log_dir: str, *, timeout_s: float, log=print) -> dict[str, dict]:
    """Run each step in turn (its output into log_dir/<name>.log), printing when each starts and ends; stops at the
    first that fails. Returns {name: {"rc", "seconds", "result" (its JSON) or "tail" (the log's end)}}."""
    import subprocess

    done: dict[str, dict] = {}
    for step in steps:
        path = os.path.join(log_dir, f"{step.name}.log")
        log(f"[{step.name}] {' '.join(step.argv[1:])}")
        t0 = time.perf_counter()
        with open(path, "w") as fh:
            try:
                rc = subprocess.run(step.argv, env={**os.environ, **step.env}, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        r: dict[str, Any] = {"rc": rc, "seconds": time.perf_counter() - t0, "log": path}
        with open(path) as fh:
            r["tail"] = fh.read()[-2000:]
        if rc == 0 and step.out:
            with open(step.out) as fh:
                r["result"] = json.load(fh)
        done[step.name] = r
        log(f"[{step.name}] rc {rc} in {r['seconds']:.0f} s")
        if rc != 0:
            break
    return done


def decode_table_rows(result: dict) -> list[dict]:
    """One row a decode cell of a run: the slowest rank's TPOT (a step waits for every rank) and its floor."""
    rows = []
    for cell in result["decode"]:
        ranks = [r for r in cell["ranks"] if r.get("status") == "ran"]
        row = {"arm": cell["arm"], "context": cell["context"], "batch": cell["batch"], "status": cell["status"]}
        if ranks and len(ranks) == len(cell["ranks"]):
            slow = max(ranks, key=lambda r: r["tpot_ms"])
            row.update(tpot_ms=slow["tpot_ms"], tpot_p90_ms=slow["tpot_p90_ms"], floor_ms=slow["floor_ms"],
                       tpot_over_floor=slow["tpot_ms"] / slow["floor_ms"], host_share=slow["host_share"],
                       decode_tokens_per_s=1e3 * cell["batch"] / slow["tpot_ms"],
                       rank_weight_gb=slow["weight_bytes"] / 1e9, rank_kv_gb=slow["kv_bytes"] / 1e9,
                       rank_peak_gib=max(r["memory"]["peak"] for r in ranks) / 2**30)
        rows.append(row)
    return rows


def agreement_rows(tp1: dict, tpn: dict) -> list[dict]:
    """Per arm: greedy steps of the real prompt that TP n agrees with TP 1 on (`model_decode.agreed_steps`), beside
    the neutral figure (folded against split in the same run)."""
    from .model_decode import agreed_steps

    first = {c["arm"]: c["ranks"][0] for c in tp1["prefill"] if c["status"] == "ran"}
    rows = []
    for c in tpn["prefill"]:
        base = first.get(c["arm"])
        r = {"arm": c["arm"], "status": c["status"], "steps": len(c["ranks"][0].get("tokens") or [])}
        if c["status"] == "ran" and base is not None:
            r["agreed_with_tp1"] = agreed_steps(c["ranks"][0]["tokens"], base["tokens"])
        rows.append(r)
    for name, run in (("tp1", tp1), (f"tp{tpn['world_size']}", tpn)):
        rows.append({"arm": f"neutral: folded vs split ({name})", "status": "ran" if "neutral_agreed_steps" in run
                     else "n/a", "agreed_with_tp1": run.get("neutral_agreed_steps")})
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
    finish()
    return result


if __name__ == "__main__":
    main()
