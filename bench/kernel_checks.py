"""One kernel alone: built with its registered params (or others), checked once against its reference, then timed.

    python bench/kernel_checks.py decode_partial [--format split]
    python bench/kernel_checks.py merge | prefill | dequant_pages

Each check builds the kernel, prints the size of its emitted CUDA and, on a machine with a CUDA device, one launch's
error against its reference (the float64 attention reference, torch's log-sum-exp merge, or the torch definition of
the gather, bit for bit) and its time a launch by TileLang's do_bench. Without a device it stops after the build. The
gates are the GPU tests; this is the quick look at one kernel while changing it (formerly each kernel module's
`main()`).
"""

from __future__ import annotations

import argparse
import sys

import torch

import foldkv
from foldkv.config import GEMMA4_31B
from foldkv.layout import KvFormat
from foldkv.lab.gates.inputs import fill_sequences


def built_on_device(label: str, kernel) -> bool:
    """What a check says first: `label` and the kernel's emitted CUDA size; then whether a CUDA device is here to
    check and time it on (if not, it says so)."""
    print(f"{label}: {len(kernel.get_kernel_source())} chars of CUDA")
    if not torch.cuda.is_available():
        print("no CUDA device: built, not checked or timed")
        return False
    return True


def check_then_time(label: str, kernel, setup) -> None:
    """`built_on_device`, then on the device `setup(device)` gives `(run, check)`: one `run()`, the line `check()`
    returns (the output against its reference), and `run` timed by TileLang's do_bench."""
    if not built_on_device(label, kernel):
        return
    from tilelang.profiler import do_bench  # TileLang's timer, in ms

    run, check = setup(torch.device("cuda"))
    run()
    print(check())
    print(f"{do_bench(run) * 1e3:.1f} us a launch")


def decode_partial(fmt: KvFormat | str = KvFormat.FOLDED, seq_len: int = 10602, **tiling):
    """The partial with the format's defaults (or `tiling`), checked on one whole-sequence chunk against the float64
    reference, then timed."""
    from foldkv.kernels.decode_partial import DEFAULTS, build_decode_partial
    from foldkv.kernels.macros import LN2

    fmt, geom = KvFormat.parse(fmt), GEMMA4_31B
    kernel = build_decode_partial(geom, fmt, **tiling)

    def setup(dev):
        pool = foldkv.PagedKvPool(foldkv.PagedKvLayout(geom, fmt, 64, -(-seq_len // 64)), device=dev)
        pool.data.copy_(torch.randn(pool.data.shape, device=dev).to(torch.bfloat16))
        table = pool.allocate([seq_len]).to(dev)
        query = (torch.randn(1, geom.num_q_heads, geom.head_dim, device=dev) * 0.05).to(torch.bfloat16)
        chunk = [torch.tensor([v], dtype=torch.int32, device=dev) for v in (0, 0, seq_len)]  # the whole sequence
        part_o = torch.full((1, geom.num_q_heads, geom.head_dim), float("nan"), device=dev)  # poisoned
        part_lse = torch.full((1, geom.num_q_heads), float("nan"), device=dev)
        want, want_lse = foldkv.paged_attention_reference(pool, query, table)

        def check():
            got = part_o[..., foldkv.value_window_to_head(geom, fmt).to(dev)].double()
            return (f"relative error {float((got - want).norm() / want.norm()):.2e}, max LSE error"
                    f" {float((part_lse.double() * LN2 - want_lse).abs().max()):.2e}")

        return lambda: kernel(query, pool.data, table.page_ids, *chunk, part_o, part_lse), check

    check_then_time(f"decode_partial_{fmt.value} {dict(DEFAULTS[fmt], **tiling)}", kernel, setup)


def merge(seq_len: int = 40002, chunk_tokens: int = 1024, merge_group: int = 8):
    """Both merges over the random partials of one request (the plan of `seq_len` tokens on a split pool), checked
    against torch's log-sum-exp merge, then timed as a pair with the two copies of the partials."""
    from foldkv.kernels.merge import LN2, build_merge_final, build_merge_groups
    from foldkv.kernels.plan import plan_decode
    from foldkv.pool import PagedKvLayout

    G = GEMMA4_31B
    groups, final = build_merge_groups(G), build_merge_final(G)

    def setup(dev):
        plan = plan_decode(PagedKvLayout(G, KvFormat.SPLIT, 64, 0), [seq_len], device=dev, chunk_tokens=chunk_tokens,
                           merge_group=merge_group)
        part_o, part_lse = torch.randn(plan.part_o.shape, device=dev), torch.randn(plan.part_lse.shape, device=dev) * 4
        weights = torch.softmax(part_lse.double() * LN2, dim=0)  # [C, Hq]: every chunk belongs to request 0
        want = (weights[..., None] * part_o.double()).sum(0)  # [Hq, D] head order (split: identity columns)
        want_lse = torch.logsumexp(part_lse.double() * LN2, dim=0)  # [Hq] natural log
        out = torch.empty(1, G.num_q_heads, G.head_dim, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(1, G.num_q_heads, device=dev)

        def run():
            plan.part_o.copy_(part_o)
            plan.part_lse.copy_(part_lse)
            groups(plan.part_o, plan.part_lse, plan.group_first, plan.group_count)
            final(plan.part_o, plan.part_lse, plan.group_first, plan.req_group_first, plan.req_group_count,
                  plan.value_head_column, out, lse)

        def check():
            return (f"{plan.num_chunks} partials: max |out - ref| {float((out[0].double() - want).abs().max()):.2e},"
                    f" max |lse - ref| {float((lse[0].double() - want_lse).abs().max()):.2e}")

        return run, check

    check_then_time("merge_groups + merge_final", final, setup)


def prefill(fmt: KvFormat | str = KvFormat.FOLDED, context: int = 16384, chunk: int = 2048, **tiling):
    """The served prefill of `fmt`'s bf16 pool (its registered variant: split's prefill_attention, folded's
    prefill_folded) with its registered params (or `tiling`); on a GPU, check one chunk at the end of `context` against
    the float64 reference and time it."""
    from foldkv.kernels import registry
    from foldkv.kernels.prefill import prefill as launch
    from foldkv.kernels.prefill import variant_name

    fmt = KvFormat.parse(fmt)
    variant = registry.get(variant_name(fmt))
    cfg = variant.arguments(tiling)
    kernel = variant.build(GEMMA4_31B, **tiling)
    if not built_on_device(f"prefill_{fmt.value} {cfg}", kernel):
        return kernel
    geom, dev = GEMMA4_31B, torch.device("cuda")
    torch.manual_seed(0)
    pool = foldkv.PagedKvPool(foldkv.PagedKvLayout(geom, fmt, 64, -(-context // 64)), device=dev)
    table = pool.allocate([context]).to(dev)
    kv = torch.randn(context, geom.num_kv_heads, geom.head_dim, device=dev)  # raw projections, prepped into rows
    fill_sequences(pool, table, [kv], torch.rand(geom.head_dim, device=dev) + 0.5)
    q_lens = torch.tensor([chunk], dtype=torch.int32)
    query = (torch.randn(chunk, geom.num_q_heads, geom.head_dim, device=dev) * 0.05).to(torch.bfloat16)
    run = lambda: launch(pool, query, table, q_lens, params=tiling)  # noqa: E731
    out, lse = run()
    want, want_lse = foldkv.paged_attention_reference(pool, query, table, q_lens, query_block=256)
    print(f"relative error {float((out.double() - want).norm() / want.norm()):.2e}, "
          f"max LSE error {float((lse.double() - want_lse).abs().max()):.2e}")
    from tilelang.profiler import do_bench  # TileLang's timer, in ms
    print(f"{do_bench(run):.2f} ms per {chunk}-token chunk at {context}")
    return kernel


def dequant_pages(tokens: int = 131072):
    """The gather over a `tokens`-token request's pages, checked element for element against torch's
    (`dequantize_rows_bf16` is its definition: none may differ), then timed."""
    from foldkv.fp8 import FP8_DTYPE, quantize_rows
    from foldkv.kernels import resolve
    from foldkv.kernels.dequant_pages import DEFAULTS, NAME, build, kernel_params
    from foldkv.lab.page_gather import bf16_pages_reference
    from foldkv.pool import PagedKvLayout, PagedKvPool

    geom = GEMMA4_31B

    def setup(dev):
        lay = PagedKvLayout.for_tokens(tokens, geometry=geom, format=KvFormat.FOLDED, dtype=FP8_DTYPE)
        q, s = quantize_rows(torch.randn(lay.num_pages, geom.num_kv_heads, lay.page_size, lay.row_width, device=dev))
        pool = PagedKvPool(lay, data=q, scales=s)
        table = pool.allocate([tokens], scatter_seed=0)
        src = table.page_ids[0].to(dev).contiguous()  # one request: its pages in order
        want = bf16_pages_reference(pool, table)[0].data.view(torch.int16)
        got = torch.empty(want.shape, dtype=torch.bfloat16, device=dev)
        kernel = resolve.kernel(NAME, geom, kernel_params(pool))
        return (lambda: kernel(pool.data, pool.scales, src, got),
                lambda: f"{int((got.view(torch.int16) != want).sum())} of {got.numel()} differ")

    check_then_time(f"{NAME} {DEFAULTS}", build(geom, **DEFAULTS), setup)


CHECKS = {"decode_partial": decode_partial, "merge": merge, "prefill": prefill, "dequant_pages": dequant_pages}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=list(CHECKS))
    ap.add_argument("--format", default=None, help="split or folded (decode_partial, prefill)")
    args = ap.parse_args(argv)
    CHECKS[args.kernel](**({"fmt": args.format} if args.format else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
