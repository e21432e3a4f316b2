"""Decode partial with an L2 prefetch of the page tile `distance` tiles ahead: the library's partial
(`decode_partial_program`) with one `cp.async.bulk.prefetch.L2` of the whole 80 KB (page, KV head) tile by the first
consumer thread at the top of each tile (its `loaded` and `source` hook points); bf16 rows, one page a tile. Lost.

What it tried (bench/DECODE_NOTES.md, run 23, cause A): on the H100 the folded partial of multi-wave plans runs at
1.28-1.42x the plain read of its bytes. If that is a per-tile latency of pages scattered over GBs (the address's
translation, the first access to a DRAM row), asking for the tile a tile or two before the producer's TMA does hides
it, with no shared memory.

Prediction (written before the run): `folded_prefetch2` 1.10-1.18x, `folded_prefetch3` <= 1.12x the read on the
batches of 3-8 GB, the single request within 2% of the library; no help if the cost is the rate of translations.

Outcome (run 23, H100, bench/decode_runs/run23_h100_multiwave.tgz): worse, 2 tiles ahead +0.03 and 3 ahead +0.25
of the read on the batches (1.32-1.45x and 1.56-1.63x against the library's 1.28-1.42x; the single request 1.085x /
1.192x against 1.040x): L2 traffic added, nothing hidden. Cause A was wrong (pages in order cost what scattered ones
do); the loss is in the 80 KB tile's own read on that card. Until this file, the library partial's `prefetch_tiles`.

    python bench/versions/decode_partial_l2_prefetch.py     # build here (sm_90a), print the CUDA size
    python bench/multiwave_probe.py --out $OUT               # on the device: arms folded_prefetch2, folded_prefetch3
"""

import functools

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels.decode_partial import DEFAULTS, decode_partial_program
from foldkv.kernels.tl import compile_program
from foldkv.layout import KvFormat, row_width

# one bulk prefetch of a contiguous 16-byte aligned range (sm_90)
L2_PREFETCH_SOURCE = r"""
__device__ __forceinline__ void foldkv_prefetch_l2(const void* base, long long element, int bytes) {
  if ((threadIdx.x & 127) == 0) {  // bf16 elements: 2 bytes each
    const char* src = reinterpret_cast<const char*>(base) + 2 * element;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(src), "r"(bytes) : "memory");
  }
}
"""


def prefetch_macro(geom: AttentionGeometry, fmt: KvFormat, page_size: int, block_n: int, distance: int):
    """The partial's `loaded` hook: the page tile `distance` tiles ahead, whole (page_size x width, contiguous)."""
    import tilelang.language as T

    hkv, width = geom.num_kv_heads, row_width(geom, fmt)

    @T.macro
    def loaded(pool, page_ids, req, kvh, tok, k, n_tok):
        if (k + distance) * block_n < n_tok:
            ahead = page_ids[req, (tok + distance * block_n) // page_size]
            T.call_extern("handle", "foldkv_prefetch_l2", pool.data,
                          (T.cast(ahead, "int64") * hkv + kvh) * (page_size * width), page_size * width * 2)

    return loaded


def program(geom: AttentionGeometry, fmt: KvFormat | str = KvFormat.FOLDED, distance: int = 2, **tiling):
    """The library partial (its arguments, its DEFAULTS overridden by `tiling`) prefetching `distance` tiles ahead;
    refused over FP8 rows or where a tile is not one page (the prefetch is a whole page tile)."""
    fmt = KvFormat.parse(fmt)
    cfg = {**DEFAULTS[fmt], **tiling}
    if distance < 1 or cfg.pop("fp8", False) or cfg["page_size"] != cfg["block_n"]:
        raise ValueError("L2 prefetch: bf16 rows and one page a tile only, at least one tile ahead")
    return decode_partial_program(geom, fmt, **cfg, source=L2_PREFETCH_SOURCE,
                                  loaded=prefetch_macro(geom, fmt, cfg["page_size"], cfg["block_n"], distance))


@functools.lru_cache(maxsize=None)
def build(geom: AttentionGeometry, fmt: KvFormat | str = KvFormat.FOLDED, distance: int = 2, **tiling):
    """Compile the prefetching partial (a drop-in for `kernels={"decode_partial_<fmt>": ...}`)."""
    return compile_program(program(geom, fmt, distance, **tiling))


def main():
    for distance in (2, 3):
        kernel = build(GEMMA4_31B, KvFormat.FOLDED, distance)
        print(f"decode_partial_folded, L2 prefetch {distance} tiles ahead: {len(kernel.get_kernel_source())} chars")


if __name__ == "__main__":
    main()
