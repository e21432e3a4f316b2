"""FP8 (e4m3) folded rows: which layout and scale granularity, by bytes against error (CPU, float64 references).

Lab notes (question, prediction, method, outcome, resources): bench/FP8_NOTES.md. The JSON this writes is committed as
bench/fp8_runs/format_choice.json.

Question. A folded row is [K_rot (128) | V_unrot (384) | V_rot (128)] = 640 columns per token and KV head. Which FP8
row reads the fewest bytes for an error we accept? Candidates (all e4m3, scale = amax / 448 of its group in float32,
round to nearest even by torch's cast; dequantized = e4m3 value x scale):
  (a) token:  640 columns e4m3, one fp32 scale per token x KV head                       644 B per token-head
  (b) col128: 640 columns e4m3, one fp32 scale per 128 columns (5 per token x head)      660 B
  (c) krot16: K_rot 128 columns kept bf16, the 512 V columns e4m3 with per-128 scales     784 B (FlashMLA-like)
  (d) page:   640 columns e4m3, one fp32 scale per page (64 tokens) x KV head            640.06 B
  (e) tensor: 640 columns e4m3, one fp32 scale for the whole layer (the split-KV anchors' per-tensor scale)
Against: bf16 folded rows (1280 B), the pool foldkv stores today, and bf16 split rows (2048 B).

Inputs (realistic for Gemma 4's k_eq_v global layer): raw kv ~ N(0, 1) with outlier channels (per KV head, 6 columns
x 8..24, three of them in the rotated set: the "massive activation" channels trained models have), and 1% of tokens
drawn with 3x the scale in a random direction; prep by the library's torch prep (`foldkv.prep_rows`, float32): V =
RMSNorm(kv) (RMS 1, no weight), K_rot = RoPE(V * w_k)[rot] with k_norm weights lognormal(0, 0.5) (synthetic.py's
spread) and two weights x4 on outlier columns; queries as synthetic.py draws them (q_norm weights (2.5 / sqrt(512)) x
lognormal(0, 0.3): score std of a few units), plus a peaked arm (score std x4). Lengths 4,096 and 65,536, one decode
query (the last position) per arm and seed.

Truth: the float32 prep rows rounded once to bf16 (the pool foldkv stores today); also the float32 rows unrounded, to
put the FP8 error beside bf16's own. Attention: float64 softmax(q.K) V over the rows as stored (dequantized), per KV
head, the folded query rounded to bf16 as the kernels get it. Reported per candidate: bytes per token (one layer, all
KV heads; the 10 global layers), tokens per GiB (all global layers), bytes / bf16 folded, row error (max |x^ - x| /
RMS of its row, the relative Frobenius error, per-element relative error median and p99 over |x| >= 0.1 RMS, by
window) and attention-output error (relative Frobenius and max |o^ - o| against the bf16-row output; LSE max |d|).

    PYTHONPATH=lib python bench/fp8_format_bench.py --json bench/fp8_runs/format_choice.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch

import foldkv
from foldkv import GEMMA4_31B, KvFormat, prep_query, prep_rows, rotated_columns

GIB = 1 << 30
E4M3_MAX = 448.0
PAGE = 64
CANDIDATES = ("token", "col128", "krot16", "page", "tensor")


def e4m3_round_trip(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x (float32) quantized with scale amax / 448 (amax broadcast against x) and dequantized, in float32."""
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def quantize(rows: torch.Tensor, how: str) -> tuple[torch.Tensor, float]:
    """rows [n, Hkv, 640] float32 -> (dequantized rows float32, bytes per token-head)."""
    n, h, w = rows.shape
    if how == "token":
        return e4m3_round_trip(rows, rows.abs().amax(-1, keepdim=True)), w + 4
    if how == "col128":
        g = rows.view(n, h, w // 128, 128)
        return e4m3_round_trip(g, g.abs().amax(-1, keepdim=True)).view(n, h, w), w + 4 * (w // 128)
    if how == "krot16":
        v = rows[..., 128:].reshape(n, h, 4, 128)
        vq = e4m3_round_trip(v, v.abs().amax(-1, keepdim=True)).view(n, h, 512)
        return torch.cat([rows[..., :128].bfloat16().float(), vq], -1), 2 * 128 + 512 + 4 * 4
    if how == "page":
        pages = -(-n // PAGE)
        pad = torch.zeros(pages * PAGE - n, h, w)
        g = torch.cat([rows, pad]).view(pages, PAGE, h, w)
        amax = g.abs().amax(dim=(1, 3), keepdim=True)
        return e4m3_round_trip(g, amax).view(-1, h, w)[:n], w + 4 / PAGE
    if how == "tensor":
        return e4m3_round_trip(rows, rows.abs().amax()), float(w)
    raise ValueError(how)


def make_inputs(n: int, seed: int, score_std: float):
    geom = GEMMA4_31B
    g = torch.Generator().manual_seed(seed)
    d, hkv = geom.head_dim, geom.num_kv_heads
    kv = torch.randn(n, hkv, d, generator=g)
    rot = rotated_columns(geom)
    for h in range(hkv):  # six outlier channels per head, three in the rotated set
        cols = torch.cat([rot[torch.randperm(rot.numel(), generator=g)[:3]],
                          torch.randperm(d, generator=g)[:3]])
        kv[:, h, cols] *= 8 + 16 * torch.rand(cols.numel(), generator=g)
    loud = torch.rand(n, generator=g) < 0.01  # 1% of tokens at 3x scale in their own direction
    kv[loud] = 3 * torch.randn(int(loud.sum()), hkv, d, generator=g)
    k_norm_w = torch.exp(0.5 * torch.randn(d, generator=g))
    k_norm_w[rot[torch.randperm(rot.numel(), generator=g)[:2]]] *= 4
    q = torch.randn(1, geom.num_q_heads, d, generator=g)
    q_norm_w = (score_std / math.sqrt(d)) * torch.exp(0.3 * torch.randn(d, generator=g))
    pos = torch.arange(n)
    rows = prep_rows(geom, KvFormat.FOLDED, kv, k_norm_w, pos, out_dtype=torch.float32)  # [n, Hkv, 640]
    query = prep_query(geom, KvFormat.FOLDED, q, q_norm_w, k_norm_w, pos[-1:], out_dtype=torch.bfloat16)
    return rows, query.double()[0]  # [n, Hkv, 640] float32, [Hq, 512] float64


def attention(rows: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 decode attention of query [Hq, 512] over rows [n, Hkv, 640] (any float dtype): (out [Hq, 512] in
    value-window order, lse [Hq]). Per KV head to keep memory at one head's rows."""
    geom = GEMMA4_31B
    hkv, grp = geom.num_kv_heads, geom.group_size
    outs, lses = [], []
    for h in range(hkv):
        r = rows[:, h].double()
        qh = query[h * grp:(h + 1) * grp]  # [g, 512]
        s = qh @ r[:, :512].T  # [g, n]
        lse = torch.logsumexp(s, -1)
        outs.append(torch.exp(s - lse[:, None]) @ r[:, 128:])
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def row_error(deq: torch.Tensor, truth: torch.Tensor) -> dict:
    rms = truth.double().pow(2).mean(-1, keepdim=True).sqrt()
    err = (deq.double() - truth.double()).abs()
    out = {"max_abs_over_row_rms": float((err / rms).max()),
           "rel_fro": float(err.norm() / truth.double().norm())}
    for name, cols in (("k_rot", slice(0, 128)), ("v", slice(128, 640))):
        t, e = truth[..., cols].double(), err[..., cols]
        big = t.abs() >= 0.1 * rms
        rel = (e[big] / t.abs()[big]).float()
        sample = rel[torch.randperm(rel.numel(), generator=torch.Generator().manual_seed(0))[:1_000_000]]
        out[f"{name}_rel_median"] = float(sample.median())
        out[f"{name}_rel_p99"] = float(torch.quantile(sample, 0.99))
        out[f"{name}_rel_max"] = float(rel.max())
    return out


def out_error(o, lse, o_ref, lse_ref) -> dict:
    return {"out_rel_fro": float((o - o_ref).norm() / o_ref.norm()), "out_max_abs": float((o - o_ref).abs().max()),
            "lse_max_abs": float((lse - lse_ref).abs().max())}


def bytes_row(name: str, per_token_head: float) -> dict:
    geom = GEMMA4_31B
    per_token = per_token_head * geom.num_kv_heads
    return {"bytes_per_token_head": per_token_head, "bytes_per_token_layer": per_token,
            "bytes_per_token_global_layers": per_token * geom.num_global_layers,
            "tokens_per_gib_global_layers": int(GIB // (per_token * geom.num_global_layers)),
            "over_bf16_folded": per_token_head / (2 * 640), "over_bf16_split": per_token_head / (2 * 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--score-stds", type=float, nargs="+", default=[2.5, 10.0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()
    results = []
    for n in args.lengths:
        for seed in args.seeds:
            for score_std in args.score_stds:
                rows, query = make_inputs(n, seed, score_std)
                truth = rows.bfloat16()
                o_ref, lse_ref = attention(truth, query)
                o_f32, lse_f32 = attention(rows, query)
                arm = {"tokens": n, "seed": seed, "score_std": score_std}
                results.append(arm | {"candidate": "bf16", **row_error(truth.float(), rows),
                                      **out_error(o_f32, lse_f32, o_ref, lse_ref), "note": "float32 rows vs bf16"})
                for how in CANDIDATES:
                    deq, _ = quantize(rows, how)
                    o, lse = attention(deq, query)
                    results.append(arm | {"candidate": how, **row_error(deq, truth.float()),
                                          **out_error(o, lse, o_ref, lse_ref),
                                          "out_rel_fro_vs_float32_rows": float((o - o_f32).norm() / o_f32.norm())})
                    print(f"n={n} seed={seed} std={score_std} {how:7s} out_rel_fro={results[-1]['out_rel_fro']:.3e}"
                          f" row_max/rms={results[-1]['max_abs_over_row_rms']:.3e}", flush=True)
                del rows, truth
    sizes = {"bf16_split": bytes_row("bf16_split", 2048), "bf16_folded": bytes_row("bf16_folded", 1280)}
    for how in CANDIDATES:
        sizes[how] = bytes_row(how, quantize(torch.randn(PAGE, 1, 640), how)[1])
    summary = {}
    for how in ("bf16",) + CANDIDATES:
        mine = [r for r in results if r["candidate"] == how]
        summary[how] = {k: max(r[k] for r in mine) for k in ("out_rel_fro", "out_max_abs", "lse_max_abs",
                                                             "max_abs_over_row_rms", "rel_fro", "v_rel_p99",
                                                             "k_rot_rel_p99")}
    record = {"bench": "fp8_format_bench", "torch": torch.__version__, "foldkv": foldkv.__version__,
              "machine": platform.machine(), "seconds": round(time.time() - t0, 1), "args": vars(args),
              "bytes": sizes, "summary_max_over_arms": summary, "arms": results}
    print(json.dumps({"bytes": sizes, "summary_max_over_arms": summary}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
