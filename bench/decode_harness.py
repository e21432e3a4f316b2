"""Decode harness: one request at the 31B shape, one layer, end to end (partial + merges), median of CUDA-graph
replays with inputs rotated past L2, arms interleaved in one run. Prints a table: us, GB/s, % of the read roof.

Arms: our generated kernels on a folded pool and on a split pool (tags: a partial tiling such as tm64s2 = the library
partial; hm32s3 = the head-major order of bench/versions/decode_partial_head_major.py; a 'v3' suffix = the query load
by all threads of bench/versions/decode_partial_query_all_threads.py), and FlashInfer's
paged decode (tensor-core and CUDA-core paths) on a split pool of the same bytes (its HND layout:
[pages, 2, Hkv, page, D]). Each arm is checked against a float32 torch reference before it is timed.

    python bench/decode_harness.py                   # on the H200 (source .devsite/env.sh first for FlashInfer)
    python bench/decode_harness.py --resources       # CPU: registers / shared memory / spills per variant (nvcc)

Lab notes (prediction, outcome, resource report) are in bench/DECODE_NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import torch

import foldkv
from foldkv import KvFormat, PagedKvLayout, PagedKvPool
from foldkv.kernels import decode as dec
from foldkv.kernels import decode_partial, merge
from versions import decode_partial_head_major, decode_partial_query_all_threads  # bench/versions/

GEOM = foldkv.GEMMA4_31B
READ_ROOF_GBS = 4469.0  # streaming read roof measured on this H200 (shared/device/README.md)
L2_BYTES = 60 << 20
LENGTHS = (10602, 40002, 81653, 163336)
DEFAULT_TILINGS = {"folded": ["tm64s2", "tm64s2v3"], "split": ["tm64s1", "tm64s1v3"]}


def parse_tiling(tag: str) -> tuple:
    """'tm64s2' -> (the library partial's builder, block_n=64, num_stages=2); 'hm32s3' -> the head-major version's
    builder; a 'v3' suffix (token-major only) -> the version whose query is loaded by all threads."""
    v3 = tag.endswith("v3")
    tag = tag[:-2] if v3 else tag
    order, (bn, st) = tag[:2], tag[2:].split("s")
    if order not in ("tm", "hm") or (v3 and order != "tm"):
        raise SystemExit(f"tiling {tag!r}: expected tm<block_n>s<stages>[v3] or hm<block_n>s<stages>")
    build = (decode_partial_head_major.build if order == "hm" else
             decode_partial_query_all_threads.build if v3 else decode_partial.build_decode_partial)
    return build, dict(block_n=int(bn), num_stages=int(st))


def build_partial(fmt: KvFormat, tag: str):
    build, tiling = parse_tiling(tag)
    return build(GEOM, fmt, **tiling)


def smem_bytes(fmt: KvFormat, block_n: int, num_stages: int, **_) -> int:
    """Shared memory of a partial CTA: the K/V stages, the padded query (16 x 512 bf16) and P (16 x N bf16)."""
    width = foldkv.row_width(GEOM, fmt)
    return num_stages * block_n * width * 2 + 16 * GEOM.head_dim * 2 + 16 * block_n * 2


def kernels_for(fmt: KvFormat, tag: str) -> dict:
    """The launcher's `kernels=` for tiling `tag`: its partial kernel; the merges come from the library's resolver."""
    return {dec.partial_kernel_name(fmt): build_partial(fmt, tag)}


# --- inputs ----------------------------------------------------------------------------------------------------
def make_rotations(fmt: KvFormat, length: int, device, gen):
    """One pool holding `rot` disjoint scattered copies of a request's pages, with rot block tables and queries, so
    consecutive steps read different bytes and the working set is over 4x the L2."""
    lay = PagedKvLayout(GEOM, fmt, 64, 0)
    bytes_one = length * lay.bytes_per_token
    rot = max(2, math.ceil(4 * L2_BYTES / bytes_one))
    pages = lay.pages_for(length)
    pool = PagedKvPool(lay.with_pages(rot * pages), device=device)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen, device=device, dtype=torch.float32)
                    .to(torch.bfloat16))  # random rows, never zeros
    perm = torch.randperm(rot * pages, generator=torch.Generator().manual_seed(length)).to(torch.int32)
    tables = [foldkv.BlockTable(perm[i * pages:(i + 1) * pages][None].contiguous().to(device),
                                torch.tensor([length], dtype=torch.int32, device=device)) for i in range(rot)]
    queries = [(torch.randn(1, GEOM.num_q_heads, GEOM.head_dim, generator=gen, device=device) * 0.05)
               .to(torch.bfloat16) for _ in range(rot)]
    return pool, tables, queries, bytes_one


def torch_reference(pool, query, table):
    """float32 decode of one request: rows [n, Hkv, W] -> out [1, Hq, D] head order."""
    rows = pool.gather(table, 0).float()  # [n, Hkv, W]
    g = GEOM.group_size
    keys = rows[..., foldkv.score_window(GEOM, pool.format)]  # [n, Hkv, D]
    vals = rows[..., foldkv.value_window(GEOM, pool.format)]  # [n, Hkv, D] value-window order
    q = query.float().view(GEOM.num_kv_heads, g, GEOM.head_dim)  # [Hkv, g, D]
    p = torch.softmax(torch.einsum("hgd,nhd->hgn", q, keys), -1)  # [Hkv, g, n]
    o = torch.einsum("hgn,nhd->hgd", p, vals).reshape(1, GEOM.num_q_heads, GEOM.head_dim)  # [1, Hq, D]
    return o[..., foldkv.value_window_to_head(GEOM, pool.format).to(o.device)]


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# --- arms ------------------------------------------------------------------------------------------------------
def foldkv_arm(fmt, tag, length, device, gen):
    pool, tables, queries, nbytes = make_rotations(fmt, length, device, gen)
    kernels = kernels_for(fmt, tag)
    plan = dec.plan_decode(pool.layout, [length], device=device)
    out = torch.empty(1, GEOM.num_q_heads, GEOM.head_dim, dtype=torch.bfloat16, device=device)
    lse = torch.empty(1, GEOM.num_q_heads, dtype=torch.float32, device=device)
    o, _ = dec.decode(pool, queries[0], tables[0], plan=plan, kernels=kernels)  # checked call, compiles
    err = rel_err(o, torch_reference(pool, queries[0], tables[0]))
    steps = [lambda i=i: dec.decode(pool, queries[i], tables[i], plan=plan, out=out, lse=lse, kernels=kernels,
                                    check=False) for i in range(len(tables))]
    info = f"{plan.num_chunks} chunks x {plan.chunk_tokens} tok, {plan.num_groups} groups"
    return steps, nbytes, err, info, pool


def partial_only_arm(fmt, tag, length, device, gen):
    """The partial kernel alone (no merges): end to end minus this is what the two merges cost."""
    pool, tables, queries, nbytes = make_rotations(fmt, length, device, gen)
    plan = dec.plan_decode(pool.layout, [length], device=device)
    partial = build_partial(fmt, tag)
    steps = [lambda i=i: partial(queries[i], pool.data, tables[i].page_ids, plan.chunk_req, plan.chunk_start,
                                 plan.chunk_len, plan.part_o, plan.part_lse) for i in range(len(tables))]
    return steps, nbytes, float("nan"), "partial kernel only", pool


def stream_read_arm(fmt, length, device, gen):
    """No attention at all: the Triton streaming sum of foldkv.bench (the read-roof kernel) over the bytes a decode
    step of `fmt` reads at `length`, rotated past L2 like the other arms. What any single kernel reading those
    bytes costs here: the floor plus one launch, ramp and drain."""
    from foldkv.bench import _triton_stream_read

    lay = PagedKvLayout(GEOM, fmt, 64, 0)
    nbytes = length * lay.bytes_per_token
    elems = -(-nbytes // 2 // 4096) * 4096  # whole 4096-element blocks
    rot = max(2, math.ceil(4 * L2_BYTES / nbytes))
    bufs = [torch.randn(elems, generator=gen, device=device).to(torch.bfloat16) for _ in range(rot)]
    part = torch.empty(torch.cuda.get_device_properties(device).multi_processor_count * 4, dtype=torch.float32,
                       device=device)
    run = _triton_stream_read()
    run(bufs[0], part)
    err = abs(float(part.sum()) - float(bufs[0].float().sum())) / max(1.0, float(bufs[0].float().abs().sum()))
    steps = [lambda b=b: run(b, part) for b in bufs]
    return steps, nbytes, err, f"{elems * 2 / 1e6:.1f} MB streamed", bufs


def flashinfer_arms(length, device, gen):
    """FlashInfer tensor-core and CUDA-core paged decode on an HND split pool of the same bytes, rotated too."""
    import flashinfer

    page, hkv, hq, d = 64, GEOM.num_kv_heads, GEOM.num_q_heads, GEOM.head_dim
    pages = -(-length // page)
    nbytes = length * hkv * 2 * d * 2
    rot = max(2, math.ceil(4 * L2_BYTES / nbytes))
    kv = torch.randn(rot * pages, 2, hkv, page, d, generator=gen, device=device).to(torch.bfloat16)
    perm = torch.randperm(rot * pages, generator=torch.Generator().manual_seed(length + 1)).to(torch.int32).to(device)
    queries = [(torch.randn(1, hq, d, generator=gen, device=device) * 0.05).to(torch.bfloat16) for _ in range(rot)]
    indptr = torch.tensor([0, pages], dtype=torch.int32, device=device)
    last = torch.tensor([length - (pages - 1) * page], dtype=torch.int32, device=device)
    arms = {}
    for tc in (True, False):
        wrappers = []
        for i in range(rot):
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tc)
            w.plan(indptr, perm[i * pages:(i + 1) * pages].contiguous(), last, hq, hkv, d, page,
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=1.0)
            wrappers.append(w)
        o = wrappers[0].run(queries[0], kv)
        # float32 reference for rotation 0
        idx = perm[:pages].long()
        k = kv[idx, 0].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:length].float()  # [n, Hkv, D]
        v = kv[idx, 1].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:length].float()
        q = queries[0].float().view(hkv, hq // hkv, d)
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", q, k), -1)
        ref = torch.einsum("hgn,nhd->hgd", p, v).reshape(1, hq, d)
        steps = [lambda i=i, ws=wrappers: ws[i].run(queries[i], kv) for i in range(rot)]
        arms["flashinfer_tc" if tc else "flashinfer_cuda_core"] = (steps, nbytes, rel_err(o, ref), "HND split", kv)
    return arms


# --- timing ----------------------------------------------------------------------------------------------------
def capture(steps):
    """A CUDA graph that runs every rotation once; None when the arm cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in steps:  # warm-up outside the capture (allocator, lazy init)
            s()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            for s in steps:
                s()
    except Exception as exc:  # noqa: BLE001 - reported, the arm falls back to eager timing
        print(f"    graph capture failed ({type(exc).__name__}: {str(exc)[:120]}): timing eager launches")
        torch.cuda.synchronize()
        return None
    return graph


def time_arms(arms: dict, rounds: int) -> dict:
    """Interleaved rounds: each round times one replay (all rotations) of every arm; median us per step."""
    runners = {}
    for name, (steps, *_rest) in arms.items():
        graph = capture(steps)
        runners[name] = ((lambda g=graph: g.replay()) if graph is not None
                         else (lambda ss=steps: [s() for s in ss]), len(steps), graph is not None)
    for run, _, _ in runners.values():  # warm the clocks
        for _ in range(5):
            run()
    torch.cuda.synchronize()
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, (run, n, _) in runners.items():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop) * 1e3 / n)
    return {name: (statistics.median(t), min(t), runners[name][2]) for name, t in times.items()}


def bench(lengths, tilings, rounds, with_flashinfer, out_json, partial_only=(), stream_read=()):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for length in lengths:
        arms = {}
        for fmt_name, tags in tilings.items():
            fmt = KvFormat.parse(fmt_name)
            for tag in tags:
                steps, nbytes, err, info, keep = foldkv_arm(fmt, tag, length, device, gen)
                arms[f"{fmt.value}_{tag}"] = (steps, nbytes, err, info, keep)
        for spec in partial_only:
            fmt_name, tag = spec.split(":")
            arms[f"{fmt_name}_{tag}_partial"] = partial_only_arm(KvFormat.parse(fmt_name), tag, length, device, gen)
        for fmt_name in stream_read:
            arms[f"stream_read_{fmt_name}_bytes"] = stream_read_arm(KvFormat.parse(fmt_name), length, device, gen)
        if with_flashinfer:
            try:
                arms.update(flashinfer_arms(length, device, gen))
            except Exception as exc:  # noqa: BLE001 - the peer arm is reported missing, not silently dropped
                print(f"  FlashInfer arms failed at {length}: {type(exc).__name__}: {exc}")
        timed = time_arms(arms, rounds)
        for name, (med, best, graphed) in timed.items():
            nbytes, err, info = arms[name][1], arms[name][2], arms[name][3]
            floor = nbytes / (READ_ROOF_GBS * 1e3)  # us
            rows.append(dict(length=length, arm=name, us=med, best_us=best, floor_us=floor, gbs=nbytes / (med * 1e3),
                             roof_pct=100 * floor / med, rel_err=err, graph=graphed, info=info))
            print(f"  {length:>7} {name:<24} {med:8.1f} us  rel_err {err:.2e}  {info}", flush=True)
        del arms
        torch.cuda.empty_cache()
    if out_json:  # the rows with the code they measured (commit, dirty flag, sha256 of each kernel built)
        from foldkv.provenance import provenance

        with open(out_json, "w") as fh:
            json.dump({"provenance": provenance(), "rows": rows}, fh, indent=1)
    print(f"\n{'tokens':>7} {'arm':<24} {'us':>8} {'floor':>7} {'GB/s':>7} {'%roof':>6} {'rel_err':>8} graph")
    for r in rows:
        print(f"{r['length']:>7} {r['arm']:<24} {r['us']:8.1f} {r['floor_us']:7.1f} {r['gbs']:7.0f} "
              f"{r['roof_pct']:6.1f} {r['rel_err']:8.1e} {'y' if r['graph'] else 'n'}")
    return rows


# --- resource report (CPU) ---------------------------------------------------------------------------------------
def resources(tilings):
    """nvcc -Xptxas -v on each variant's emitted CUDA: registers, stack, spills; shared memory from the tiling."""
    from tilelang.contrib.nvcc import default_compile_options, get_nvcc_compiler

    todo = [(f"decode_partial_{f}_{t}", build_partial(KvFormat.parse(f), t),
             smem_bytes(KvFormat.parse(f), **parse_tiling(t)[1])) for f, tags in tilings.items() for t in tags]
    todo += [("merge_groups", merge.build_merge_groups(GEOM), 0), ("merge_final", merge.build_merge_final(GEOM), 0)]
    for name, kernel, smem in todo:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.cu")
            with open(src, "w") as fh:
                fh.write(kernel.get_kernel_source())
            cmd = [get_nvcc_compiler(), "-cubin", "-O3", "-arch=sm_90a", "-Xptxas=-v", "-o",
                   os.path.join(tmp, "k.cubin"), src] + default_compile_options()
            res = subprocess.run(cmd, capture_output=True, text=True)
        info = [ln.strip() for ln in res.stderr.splitlines() if "ptxas info    : Used" in ln or "spill" in ln]
        print(f"{name}: dynamic smem {smem} B; " + "; ".join(info))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    ap.add_argument("--folded", nargs="*", default=DEFAULT_TILINGS["folded"], help="folded tilings, e.g. tm64s2 hm64s2 tm64s2v3")
    ap.add_argument("--split", nargs="*", default=DEFAULT_TILINGS["split"], help="split tilings, e.g. tm64s1 hm32s2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--partial-only", nargs="*", default=["folded:tm64s2", "split:tm64s1"],
                    help="format:tiling arms timed without the merges")
    ap.add_argument("--stream-read", nargs="*", default=[], choices=["folded", "split"],
                    help="a plain streaming read of the bytes a decode of that format reads (the per-kernel floor)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--resources", action="store_true", help="print the resource report (CPU, nvcc) and exit")
    args = ap.parse_args(argv)
    tilings = {"folded": args.folded, "split": args.split}
    if args.resources:
        return resources(tilings)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --resources on a CPU machine")
    bench(args.lengths, tilings, args.rounds, not args.no_flashinfer, args.json, args.partial_only,
          args.stream_read)


if __name__ == "__main__":
    main()
