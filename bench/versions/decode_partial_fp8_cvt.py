"""FP8 decode partial with TileLang's element conversion: the library's FP8 partial (`decode_partial_program(fp8=True)`,
registered params) whose e4m3 panels are converted to the gemms' bf16 tiles by `T.copy` (its `convert` hook point):
the conversion unit's `cvt.rn.f16x2.e4m3x2` then two `cvt.rn.bf16.f16` a pair of values. Run 1's partial; lost to
the integer conversion (`macros.convert_e4m3_macro`), the library's since run 2.

What it tried (bench/FP8_NOTES.md, run 1): an FP8 row reads 644 B a token-head instead of 1,280; converting each tile
on the consumer warpgroup (40,960 values a 64-token tile) was expected to hide under the halved bytes.

Prediction (run 1): single requests at 81K / 163K 0.60-0.70x the bf16 folded time; ragged batches 0.55-0.65x.

Outcome (run 1, H200, bench/fp8_runs/fp8_run1.json): wrong by 4x, 2.1-2.3x *slower* than bf16 folded (438.7 against
199.6 us at 163,336), ~5.3 us a tile against 2.4: the consumer, not the bytes, set the pace. Run 2 (fp8_run2.json)
timed it beside the integer conversion, which is 1.21-1.35x faster (438.5 against 338.1 us at 163,336). Until this
file, the library partial's `e4m3_convert="cvt"`.

    python bench/versions/decode_partial_fp8_cvt.py     # build here (sm_90a), print the CUDA size
    cd bench && python fp8_harness.py --arms fp8_cvt      # on the device, against the library's FP8 partial
"""

import functools

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import registry
from foldkv.kernels.decode_partial import FP8_PANEL, decode_partial_program
from foldkv.kernels.tl import compile_program
from foldkv.layout import KvFormat


def element_conversion_macro():
    """The partial's `convert` hook: each panel by TileLang's element conversion (exact: e4m3 values are bf16's)."""
    import tilelang.language as T

    @T.macro
    def convert_e4m3(convert):
        for conv in convert:
            T.copy(conv.stored, conv.tile[:, conv.col:conv.col + FP8_PANEL])

    return convert_e4m3


def program(geom: AttentionGeometry, **tiling):
    """The library's FP8 folded partial (its arguments, its registered params overridden by `tiling`) converting by
    TileLang's element conversion."""
    cfg = {**registry.get("decode_partial_folded_fp8").params, **tiling}
    return decode_partial_program(geom, KvFormat.FOLDED, **cfg, fp8=True, convert=element_conversion_macro())


@functools.lru_cache(maxsize=None)
def build(geom: AttentionGeometry = GEMMA4_31B, **tiling):
    """Compile it (a drop-in for `kernels={"decode_partial_folded_fp8": ...}` with `fp8_math="exact"`)."""
    return compile_program(program(geom, **tiling))


def main():
    kernel = build(GEMMA4_31B)
    print(f"decode_partial_folded_fp8, TileLang's element conversion: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
