"""The FP8 folded decode partial that converts each e4m3 tile to bf16 tiles before bf16 gemms: the library's FP8
partial from runs 1 to 11 (bench/FP8_NOTES.md), replaced by lib/foldkv/kernels/decode_partial_fp8.py (FP8 wgmma for
both gemms, runs 12-14: 1.9x faster). Kept as the baseline of those runs' arms (`fp8_cvt`, `fp8_t256`, the probes of
decode_partial_fp8_probe.py, `fp8_rb2`) and of the RS version's params.

Its program is `foldkv.kernels.decode_partial.decode_partial_program(fp8=True)`: the bf16 folded partial's schedule
with the row's five e4m3 panels converted by the consumer into the bf16 K_rot / V_unrot / V_rot tiles
(`macros.convert_e4m3_macro`, the FP8 prefill's conversion too), two consumer warpgroups, two stages.
"""

from __future__ import annotations

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import decode_partial_program
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

# its registered params until run 12: two stages of the 40 KB e4m3 tiles and one set of their bf16 copies (80 KB); two
# consumer warpgroups (each converts half of a tile: 1.31x faster than one); reduce_batch = the 2 queries a thread holds
DEFAULTS = dict(page_size=64, block_n=64, num_stages=2, threads=256, block_h=16, reduce_batch=2)


def build(geom: AttentionGeometry, fmt: KvFormat | str = KvFormat.FOLDED, **tiling):
    """Compile (JIT) the conversion partial with DEFAULTS overridden by `tiling` (a drop-in for
    `kernels={"decode_partial_folded_fp8": ...}`); its conversion barriers are checked on the emitted CUDA."""
    tilelang = require_tilelang()
    fmt = KvFormat.parse(fmt)
    cfg = {**DEFAULTS, **tiling}

    @tilelang.jit(target=target(), pass_configs=pass_configs())
    def decode_partial_fp8(page_size, block_n, num_stages, threads, block_h, e4m3_convert="bits", reduce_batch=1):
        return decode_partial_program(geom, fmt, page_size=page_size, block_n=block_n, num_stages=num_stages,
                                      threads=threads, block_h=block_h, fp8=True, e4m3_convert=e4m3_convert,
                                      reduce_batch=reduce_batch)

    kernel = decode_partial_fp8(**cfg)
    if cfg.get("e4m3_convert", "bits") == "bits":
        from foldkv.kernels.cuda_checks import check_opaque_shared_writes

        check_opaque_shared_writes(f"decode_partial_{fmt.value}_fp8", kernel.get_kernel_source(),
                                   macros.CONVERT_BARRIER_ID)
    return kernel
