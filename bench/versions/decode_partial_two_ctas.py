"""Decode partial, two CTAs an SM: the library's partial (`decode_partial_program`) with one stage a CTA and the SM's
registers shared by two CTAs (`macros.share_sm_registers_macro` as its `prologue` hook: the producer warpgroup at 24
registers a thread after setmaxnreg, the consumer the rest), so two tiles' chains and loads are in flight an SM; its
plan balances 2 x SMs CTAs a wave (`plan_decode(num_sms=264)` on the H200). Lost.

What it tried (bench/DECODE_NOTES.md, runs 11 and 23): does a second tile's chain (its gemms, the softmax and their
barriers) on the same SM bring the cost of a tile under one chain's (issue 15's two-tiles-in-flight design,
bench/FP8_NOTES.md); and on the H100, is a CTA's turnover at the end of its piece hidden under the other's stream?

Prediction: run 11 (H200), ~0.9-1.1 us a tile in L2 (one CTA: 1.6), the same in DRAM at 163,336; run 23 (H100, cause
B), within 5% of the library on every batch but short256 (0.05-0.15x better there).

Outcome: run 11 (bench/decode_runs/run11_dram.*): 1.42 us a tile in L2 (109.7 against 123.0 us at 163,336, plan for
264), nothing gained in DRAM (197.4 / 194.0 us at 163,336, 231.3 / 233.4 on uniform8), slower at 10,602 and 40,002.
Run 23 (bench/decode_runs/run23_h100_multiwave.tgz): no help (1.30-1.44x the read against the library's 1.28-1.42x).
Until this file, the library partial's `ctas_per_sm`; the FP8 tensor-core partial, served with two CTAs an SM, has its
own.

    python bench/versions/decode_partial_two_ctas.py      # build here (sm_90a), print the CUDA size
    python bench/multiwave_probe.py --out $OUT             # on the device: arm folded_2cta (fp8_harness: folded_2cta_w*)
"""

import functools

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import DEFAULTS, decode_partial_program
from foldkv.kernels.tl import compile_program
from foldkv.layout import KvFormat

CTAS_PER_SM = 2
NUM_STAGES = 1  # 104 KB of shared memory a CTA at one stage (folded): two stages of two CTAs do not fit


def program(geom: AttentionGeometry, fmt: KvFormat | str = KvFormat.FOLDED, ctas_per_sm: int = CTAS_PER_SM,
            **tiling):
    """The library partial (its arguments, its DEFAULTS with NUM_STAGES, overridden by `tiling`), `ctas_per_sm` CTAs
    an SM; not the fused step (its tail waits for the chunks of a wave of one CTA an SM)."""
    fmt = KvFormat.parse(fmt)
    cfg = {**DEFAULTS[fmt], "num_stages": NUM_STAGES, **tiling}
    return decode_partial_program(geom, fmt, **cfg,
                                  prologue=macros.share_sm_registers_macro(ctas_per_sm, cfg["threads"]))


@functools.lru_cache(maxsize=None)
def build(geom: AttentionGeometry, fmt: KvFormat | str = KvFormat.FOLDED, ctas_per_sm: int = CTAS_PER_SM, **tiling):
    """Compile it (a drop-in for `kernels={"decode_partial_<fmt>": ...}`, planned for ctas_per_sm x SMs a wave)."""
    return compile_program(program(geom, fmt, ctas_per_sm, **tiling))


def main():
    kernel = build(GEMMA4_31B)
    print(f"decode_partial_folded, {CTAS_PER_SM} CTAs an SM: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
