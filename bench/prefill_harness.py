"""Prefill harness: one 8,192-token chunk at the end of a 163,336-token context, one layer (GQA 8, hd 512), our
generated split and folded prefill (each tiling in --tilings; a "-shared" suffix on a folded tiling = the
shared-tile version in bench/versions/prefill_shared_tiles.py) against FlashInfer's paged prefill (causal, hd512) on a
split pool of the same values, arms interleaved in one process by `foldkv.lab.bench.run_cell` (pools rotated past
L2, outputs poisoned and checked against the float64 reference before timing, median over rounds). Also times the
fused prep of the same chunk against the torch prep. Prints a table last: ms, TFLOP/s, % of the bf16 matmul rate
measured in the same run.

    python bench/prefill_harness.py --out $OUT/prefill.json        # on the H200 (source .devsite/env.sh first)
    python bench/prefill_harness.py --resources                     # CPU: registers / smem / spills per variant

FLOPs counted: 4 * C * (K - C/2) * 32 * 512 (causal chunk of C queries ending at K). Notes: bench/PREFILL_NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

import foldkv
from foldkv import KvFormat
from foldkv.lab.bench import ArmSpec, AttentionCase, generated_arm, measure_matmul_roof, run_cell, summarize
from foldkv.lab.checkout_stamp import provenance
from foldkv.lab.jsonsafe import jsonable
from foldkv.lab.report import environment
from versions import prefill_shared_tiles, prep_fused  # bench/versions/

GEOM = foldkv.GEMMA4_31B
DEFAULT_TILINGS = {"folded": ["bn64s1", "bn64s1-shared"], "split": ["bn64s1"]}


VERSIONS = {"shared": prefill_shared_tiles.build}  # tiling suffix -> a folded version's build(geom, **params)


def parse_tiling(tag: str) -> tuple[dict, str | None]:
    """'bn64s1' -> ({block_N: 64, num_stages: 1}, None: the library's kernel); 'bn64s1-shared' -> the same params and
    "shared": the version in bench/versions/prefill_shared_tiles.py, run through the launcher's `kernels=`."""
    m = re.fullmatch(r"bn(\d+)s(\d+)(?:-(\w+))?", tag)
    if not m or (m.group(3) and m.group(3) not in VERSIONS):
        raise SystemExit(f"tiling {tag!r} is not of the form bn<block_N>s<num_stages>[-{'|'.join(VERSIONS)}]")
    return {"block_N": int(m.group(1)), "num_stages": int(m.group(2))}, m.group(3)


def tiling_arm(fmt: KvFormat, tag: str) -> ArmSpec:
    """The generated prefill of tiling `tag` on a `fmt` pool, through the public launcher."""
    from foldkv.kernels.prefill import variant_name
    from foldkv.kernels.resolve import kernel_params

    params, version = parse_tiling(tag)
    if version and fmt is not KvFormat.FOLDED:
        raise SystemExit(f"tiling {tag!r} is a folded-only version")

    def version_kernels(case: AttentionCase) -> dict:
        asked = kernel_params(variant_name(fmt), {**params, "page_size": case.page_size})
        return {variant_name(fmt): VERSIONS[version](case.geom, **asked)}

    return ArmSpec(f"{fmt.value}_{tag}".replace("-", "_"), f"generated {fmt.value} prefill {tag} (JIT)", fmt.value,
                   False, generated_arm("prefill", fmt, "jit", params, kernels=version_kernels if version else None),
                   generated=True)


def time_prep(device, chunk: int, rounds: int = 20) -> dict:
    """Fused prep (bench/versions/prep_fused.py) vs torch prep of one chunk (T tokens into a folded and a split pool),
    CUDA events, median."""
    res = {}
    g = torch.Generator(device=device).manual_seed(0)
    for fmt in (KvFormat.FOLDED, KvFormat.SPLIT):
        pool = foldkv.PagedKvPool(foldkv.PagedKvLayout(GEOM, fmt, 64, chunk // 64 + 1), device=device, fill=0.0)
        table = pool.allocate([chunk])
        table_dev = table.to(device)
        request = torch.zeros(chunk, dtype=torch.int32, device=device)
        positions = torch.arange(chunk, dtype=torch.int32, device=device)
        q = torch.randn(chunk, GEOM.num_q_heads, GEOM.head_dim, generator=g, device=device).bfloat16()
        kv = torch.randn(chunk, GEOM.num_kv_heads, GEOM.head_dim, generator=g, device=device).bfloat16()
        w = torch.rand(GEOM.head_dim, generator=g, device=device) + 0.5
        arms = {"fused": lambda: prep_fused.prep_and_store_gpu(pool, table_dev, request, positions, q, kv, w, w),
                "torch": lambda: foldkv.prep_and_store(pool, table_dev, request, positions, q, kv, w, w)}
        samples = {k: [] for k in arms}
        for fn in arms.values():
            fn()
        torch.cuda.synchronize()
        for r in range(rounds):
            for k in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                arms[k]()
                b.record()
                torch.cuda.synchronize()
                samples[k].append(a.elapsed_time(b) * 1e3)
        res[fmt.value] = {k: summarize(v) for k, v in samples.items()}
    return res


def resources() -> None:
    """Registers / shared memory / spills of every prefill tiling and the prep kernels, from ptxas on this machine."""
    from foldkv.kernels import registry
    from foldkv.kernels.prefill import variant_name
    from foldkv.kernels.tl import require_tilelang

    def served(fmt: KvFormat):  # the registered kernel; a tag's param it does not take (folded's num_stages) is not its
        variant = registry.get(variant_name(fmt))
        return lambda geom, **params: variant.build(geom, **{k: v for k, v in params.items() if k in variant.params})

    tl_dir = os.path.dirname(require_tilelang().__file__)
    kernels = []
    for fmt in (KvFormat.FOLDED, KvFormat.SPLIT):
        for tag in DEFAULT_TILINGS[fmt.value]:
            params, version = parse_tiling(tag)
            build = VERSIONS[version] if version else served(fmt)
            kernels.append((f"prefill_{fmt.value}_{tag}", build(GEOM, **params)))
    for fmt in KvFormat:
        kernels.append((f"prep_{fmt.value}", prep_fused.build(GEOM, fmt)))
    for name, k in kernels:
        src = k.get_kernel_source()
        smem = max([int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)", src)] or [0])
        with tempfile.TemporaryDirectory() as d:
            cu = os.path.join(d, "k.cu")
            open(cu, "w").write(src)
            r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "--cubin", "-O3", "-Xptxas", "-v", "-w",
                                f"-I{tl_dir}/src", f"-I{tl_dir}/3rdparty/cutlass/include", "-o",
                                os.path.join(d, "k.cubin"), cu], capture_output=True, text=True)
        info = " ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                        if "registers" in line or "spill" in line)
        lb = re.search(r"__launch_bounds__\((\d+)", src)
        print(f"{name:28s} threads {lb.group(1) if lb else '?':>4s}  dyn smem >= {smem // 1024} KiB + last buffer | {info}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--context", type=int, default=163_336)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tilings", nargs="*", default=None, help="e.g. folded:bn64s1 split:bn32s2")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also the folded prefill over the FP8 pool, both ways of reading"
                    " its rows: the page gather then the bf16 prefill (folded_fp8_jit), converted in the attention"
                    " kernel (folded_fp8_in_kernel_jit)")
    ap.add_argument("--resources", action="store_true", help="CPU: ptxas report of every variant, then exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.resources:
        resources()
        return

    dev = torch.device("cuda")
    tilings = DEFAULT_TILINGS if not args.tilings else {}
    for t in args.tilings or []:
        f, tag = t.split(":")
        tilings.setdefault(f, []).append(tag)
    arms: list = [] if args.no_flashinfer else ["fi_prefill"]
    arms += [tiling_arm(fmt, tag) for fmt in (KvFormat.FOLDED, KvFormat.SPLIT) for tag in tilings.get(fmt.value, [])]
    arms += ["folded_fp8_jit", "folded_fp8_in_kernel_jit"] if args.fp8 else []

    roof = measure_matmul_roof(dev)
    print(f"bf16 matmul roof measured: {roof['tflops']:.0f} TFLOP/s", flush=True)
    case = AttentionCase([args.context], q_lens=[args.chunk], device=dev)
    cell = run_cell(f"prefill_{args.chunk}_at_{args.context}", "prefill", case, arms, rounds=args.rounds, warmup=1,
                    matmul_roof=roof, log=lambda s: print(s, flush=True))
    case.release()
    prep = time_prep(dev, args.chunk)
    result = {"env": environment(dev), "matmul_roof": roof, "cell": cell, "prep": prep}
    if args.out:
        result["provenance"] = provenance()  # commit, dirty flag, sha256 of each kernel built
        with open(args.out, "w") as fh:
            json.dump(jsonable(result), fh, indent=1, allow_nan=False)

    flops = cell["flops"]
    print(f"\n{args.chunk}-token chunk ending at {args.context}, one layer: {flops / 1e12:.2f} TFLOP counted")
    print(f"{'arm':22s} {'status':8s} {'median ms':>10s} {'p10-p90 ms':>16s} {'TFLOP/s':>8s} "
          f"{'%mm':>6s} {'rel err':>8s}  vs FlashInfer   (%mm: of the {roof['tflops']:.0f} TFLOP/s measured above)")
    fi = cell["arms"].get("fi_prefill", {})
    for name, a in cell["arms"].items():
        if a.get("status") != "ok":
            print(f"{name:22s} {a.get('status', '?'):8s} {a.get('reason', '')[:150]}")
            continue
        us = a["us"]
        tf = a["tflops"]["median"]
        vs = ""
        if fi.get("status") == "ok" and name != "fi_prefill":
            vs = f"x{fi['us']['median'] / us['median']:.2f} faster"
        print(f"{name:22s} {'ok':8s} {us['median'] / 1e3:10.2f} {us['p10'] / 1e3:7.2f}-{us['p90'] / 1e3:<8.2f} "
              f"{tf:8.1f} {a.get('pct_matmul_roof', float('nan')):6.1f} "
              f"{a['check']['rel_err']:8.2e}  {vs}")
    for fmt, r in prep.items():
        print(f"prep {fmt:7s} {args.chunk} tokens: fused {r['fused']['median']:.1f} us, torch {r['torch']['median']:.1f} us")


if __name__ == "__main__":
    sys.exit(main())
