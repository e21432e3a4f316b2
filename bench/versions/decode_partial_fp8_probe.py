"""FP8 folded decode partial with its conversion cut down: a timing probe, WRONG output by design.

Lab notebook (bench/FP8_NOTES.md, run 6). Question: of the library FP8 partial's ~3.3 us per 64-token tile (against
~1.26 us for its bytes at the read roof and ~2.5 us for the bf16 folded tile), how much is the e4m3 -> bf16
conversion and how much the rest of the consumer's tile (two SS gemms, the online softmax, the barriers)? Run 5 (A
from registers) removed the shared-memory tiles and cost the same, so the split is not known from the timings so far.

Two probes, each the library's kernel (`decode_partial_program(fp8=True)`, registered params) with only the body
of `macros.E4M3_TO_BF16_SOURCE`'s per-run function replaced; the calls, their named barrier 7 and the proxy fence
stay, so `cuda_checks.check_e4m3_conversion` still passes and the schedule is the library's:
  - "copy": the run's 8-byte shared load and 16-byte shared store stay (the bytes are copied, not converted): the
    shared-memory traffic without the integer ops and the multiply;
  - "skip": nothing is loaded or stored (the bf16 tiles keep whatever they held): the consumer's tile without the
    conversion at all, i.e. the gemm + softmax + barrier chain over e4m3 TMA loads.
Both give wrong attention (the harness flags them and times them anyway). With the pool's pages held in L2 (the
harness's --resident-pages) the DRAM stream is out of the way too, and the tile time is the consumer's alone.
Prediction (before the run): skip ~1.6-2.0 us per tile at DRAM (bound by the gemm chain, not the 1.26 us of bytes),
copy ~2.4-2.8, the library 3.3; so a conversion-free consumer would still miss the 0.55x-of-bf16 target (~1.4 us)
unless the gemm chain overlaps across tiles too.
"""

from __future__ import annotations

import contextlib

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import build_decode_partial_fp8

_HEAD = "__device__ __forceinline__ void foldkv_e4m3x8_to_bf16_one(const void* src, void* dst) {\n"
BODIES = {
    "copy": """  const uint2 in = *reinterpret_cast<const uint2*>(src);
  *reinterpret_cast<uint4*>(dst) = make_uint4(in.x, in.y, in.x, in.y);
""",
    "skip": "",
}


def probe_source(kind: str) -> str:
    """The library's conversion source with the per-run function's body (from its head to the closing brace in
    column 0) replaced by probe `kind` ("copy" or "skip")."""
    src = macros.E4M3_TO_BF16_SOURCE
    if _HEAD not in src:
        raise RuntimeError("macros.E4M3_TO_BF16_SOURCE changed: its per-run function is not where this probe looks")
    start = src.index(_HEAD) + len(_HEAD)
    end = src.index("\n}\n", start) + 1
    return src[:start] + BODIES[kind] + src[end:]


@contextlib.contextmanager
def _conversion_source(source: str):
    saved = macros.E4M3_TO_BF16_SOURCE
    macros.E4M3_TO_BF16_SOURCE = source  # read by decode_partial_program while it traces
    try:
        yield
    finally:
        macros.E4M3_TO_BF16_SOURCE = saved


def build(geom: AttentionGeometry, kind: str, **tiling):
    """Compile the probe `kind` ("copy" or "skip") of the library's FP8 partial (its argument list: a drop-in for
    `kernels={"decode_partial_folded_fp8": ...}` with `fp8_math="exact"`)."""
    with _conversion_source(probe_source(kind)):
        return build_decode_partial_fp8(geom, "folded", **tiling)
