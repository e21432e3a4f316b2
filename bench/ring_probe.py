"""Lab notebook: a sliding layer's ring attention at the 31B's geometry, kernel against kernel and against a plain
read of its bytes (MODEL_DECODE_NOTES run 30's first measurement; written before any GPU run).

Question: the library's ring attention (`hf_graph.ring_attention`: cuBLAS's q.K^T, the fused masked softmax, cuBLAS's
P.V) reads the batch-8 rings at ~82% of the roof and the one-row rings at ~1/3 of it. Does a decode kernel built for
this read them near the roof? FlashInfer's paged decode takes the rings as they are: [B, Hkv, W, d] is its HND layout
with one W-slot page a sequence (indptr 0..B, page ids 0..B-1, every slot live). Arms, per batch:
- library: `hf_graph.ring_attention` (scaling 1.0, Gemma 4's);
- fi_decode / fi_decode_tc: FlashInfer's BatchDecodeWithPagedKVCacheWrapper on CUDA cores / on tensor cores, in its
  CUDA-graph mode, planned once (the page table never changes);
- read: the read roof's kernel (`roofs.stream_read_kernel`) over the same K and V bytes.
Each arm is one CUDA graph over a plan's layers' rings (their bytes together past L2: ROTATE_BYTES), replays
interleaved over the arms, the median per layer. Checks, before timing: every attention's output poisoned (NaN),
then written whole, within `within`'s bound of the float64 attention of its layer; the read's partial sums against
the float64 sum of what it read (`read_check`).

Prediction (the notes): library ~11 us (B = 1), ~38-40 us (B = 8) a layer; read ~3.7 / ~30-31; FlashInfer's CUDA-core
decode ~5-7 / ~32-35. <= 1.1x the read at B = 8 says a decode kernel of our own is worth building (run 30).

    python3 bench/ring_probe.py --batches 1 8            # on the H200 (source .devsite/env.sh first)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import types

import torch

from l2_prefix_probe import _graph, _replay_us  # bench/: a graph's warm-up and capture, one timed replay

HQ, HKV, D, WINDOW, SCALING = 32, 16, 256, 1024, 1.0  # the 31B's sliding layers (conftest.RING_GEOMETRIES["31b"])
ROTATE_BYTES = 1 << 30  # the layers' rings together: far past the 50 MB L2
ARMS = ("library", "fi_decode", "fi_decode_tc", "read")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--rounds", type=int, default=15)
    return ap


def plan(batch: int, hkv: int = HKV, window: int = WINDOW, d: int = D) -> dict:
    """The layers a batch's graph rotates over (their rings together >= ROTATE_BYTES, at least 4) and the K + V bytes
    a layer reads; a batch < 1 is refused (ValueError) before anything is allocated."""
    if batch < 1:
        raise ValueError(f"batch {batch}: at least one sequence")
    layer_bytes = 2 * batch * hkv * window * d * 2
    return {"layers": max(4, math.ceil(ROTATE_BYTES / layer_bytes)), "layer_bytes": layer_bytes}


def within(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float = SCALING) -> dict:
    """out [B, Hq, d] against the float64 attention of q [B, Hq, d] over rings k, v [B, Hkv, W, d] (every slot live,
    query head h on KV head h // group): each element within (2^-6 + 2^-8 max|s|) (P|V|) of it, the bound of bf16
    scores (|ds| <= 2^-9 |s| moves p_j by <= 2^-8 max|s| relative), bf16 P (2^-8 relative) and a bf16 output (|o| <=
    P|V|, one ulp 2^-7 relative). {"ok", "worst" (max |err| / bound), "written" (no element left NaN)}."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qq = q.double().reshape(b, hkv, hq // hkv, d)
    s = scaling * qq @ k.double().transpose(-1, -2)
    p = torch.softmax(s, dim=-1)
    ref = (p @ v.double()).reshape(b, hq, d)
    pv = (p @ v.double().abs()).reshape(b, hq, d)
    bound = (2.0 ** -6 + 2.0 ** -8 * float(s.abs().max())) * pv + 2.0 ** -133
    err = (out.double() - ref).abs()
    written = bool(torch.isfinite(out).all())
    worst = float((err / bound).max()) if written else float("inf")
    return {"ok": written and worst <= 1.0, "worst": worst, "written": written}


def read_check(partials: torch.Tensor, v: torch.Tensor) -> dict:
    """The read arm's check: its partial sums against the float64 sum of the V it read last (`roofs._sum_error`)."""
    from foldkv.lab.bench.roofs import SUM_TOL, _sum_error

    err = _sum_error(partials, v.reshape(-1))
    return {"ok": err <= SUM_TOL, "worst": err / SUM_TOL, "written": bool(torch.isfinite(partials).all())}


def _layers(batch: int, n: int, dev, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """n layers of (query [B, Hq, d], ring K, ring V [B, Hkv, W, d]) bf16: scores of unit spread (q, k ~ N(0, 1/4)
    at d = 256), values N(0, 1); never zeros."""
    g = torch.Generator(device=dev).manual_seed(seed + batch)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)

    return [(randn(batch, HQ, D, scale=0.25), randn(batch, HKV, WINDOW, D, scale=0.25), randn(batch, HKV, WINDOW, D))
            for _ in range(n)]


def _arm_calls(arm: str, layers, outs, dev) -> tuple[list, object]:
    """One callable a layer for `arm`, writing its output into outs[i] ([B, Hq, d]); what must stay alive."""
    from foldkv import hf_graph
    from foldkv.hf_graph import RingMask

    b = layers[0][0].shape[0]
    if arm == "library":
        module = types.SimpleNamespace(scaling=SCALING)
        mask = RingMask(torch.ones(b, 1, 1, WINDOW, dtype=torch.bool, device=dev))

        def call(i):  # P.V straight into the output (its `out=`): no copy in the timed graph
            q, k, v = layers[i]
            hf_graph.ring_attention(module, q[:, :, None], k, v, mask, out=outs[i].view(b, HKV, HQ // HKV, D))
        return [lambda i=i: call(i) for i in range(len(layers))], mask
    if arm == "read":
        from foldkv.lab.bench.roofs import stream_read_kernel

        read, parts = stream_read_kernel(), torch.empty(4 * 132, dtype=torch.float32, device=dev)

        def read_layer(i):  # its check: the partials of the last read (V) sum to V's float64 sum
            _, k, v = layers[i]
            read(k.view(-1), parts)
            read(v.view(-1), parts)
        return [lambda i=i: read_layer(i) for i in range(len(layers))], parts
    from foldkv.lab.bench.peers import FLASHINFER_WORKSPACE_BYTES, import_flashinfer

    fi = import_flashinfer()
    i32 = dict(dtype=torch.int32, device=dev)
    indptr, indices = torch.arange(b + 1, **i32), torch.arange(b, **i32)
    last = torch.full((b,), WINDOW, **i32)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "HND", use_cuda_graph=True, use_tensor_cores=arm == "fi_decode_tc",
        paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
        paged_kv_last_page_len_buffer=last.clone())
    wrapper.plan(indptr, indices, last, HQ, HKV, D, WINDOW, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                 sm_scale=SCALING)
    return ([lambda i=i: wrapper.run(layers[i][0], (layers[i][1], layers[i][2]), out=outs[i])
             for i in range(len(layers))], (wrapper, workspace))


def measure_batch(batch: int, arms: list[str], rounds: int, dev, roof_gbps: float) -> list[dict]:
    p = plan(batch)
    layers = _layers(batch, p["layers"], dev)
    rows, graphs, keep = [], {}, []
    for arm in arms:
        outs = [torch.full((batch, HQ, D), float("nan"), dtype=torch.bfloat16, device=dev) for _ in layers]
        try:
            calls, held = _arm_calls(arm, layers, outs, dev)
        except Exception as exc:  # noqa: BLE001 (an arm that cannot run says why; the others go on)
            rows.append({"batch": batch, "arm": arm, "status": f"not run: {type(exc).__name__}: {str(exc)[:160]}"})
            continue
        keep.append(held)
        calls[0]()
        torch.cuda.synchronize(dev)
        check = read_check(held, layers[0][2]) if arm == "read" else within(outs[0], *layers[0])
        if not check["ok"]:
            rows.append({"batch": batch, "arm": arm, "status": f"failed its check: {check}"})
            continue
        graphs[arm] = _graph(lambda calls=calls: [c() for c in calls], dev)
        rows.append({"batch": batch, "arm": arm, "status": "ok", "check": check, "us": []})
    timed = [r for r in rows if r["status"] == "ok"]
    for _ in range(rounds):  # interleaved
        for r in timed:
            r["us"].append(_replay_us(graphs[r["arm"]], dev) / p["layers"])
    for r in timed:
        r["us_layer"] = statistics.median(r.pop("us"))
        r["floor_us"] = p["layer_bytes"] / (roof_gbps * 1e3)
        r["x_floor"] = r["us_layer"] / r["floor_us"]
        print(f"B={batch} {r['arm']:<14} {r['us_layer']:7.2f} us a layer  {r['x_floor']:5.2f}x the bytes at the roof"
              f"  check worst {r['check']['worst']:.3f}", flush=True)
    for r in rows:
        if r["status"] != "ok":
            print(f"B={batch} {r['arm']:<14} {r['status']}", flush=True)
    return rows


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    plans = {b: plan(b) for b in args.batches}  # refusals before the GPU
    from foldkv.lab.bench.roofs import measure_read_roof
    from foldkv.provenance import provenance

    dev = torch.device("cuda")
    roof = measure_read_roof(dev)
    print(f"roof {roof['gbps']:.0f} GB/s; layers {dict((b, p['layers']) for b, p in plans.items())}", flush=True)
    rows = [r for b in args.batches for r in measure_batch(b, args.arms, args.rounds, dev, roof["gbps"])]
    text = json.dumps({"provenance": provenance(), "roof": roof, "rows": rows}, indent=1, default=str)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "ring_probe.json"), "w").write(text)
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not run") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
