"""The library's folded prefill (`prefill_folded`: two stages of the row, batched reductions, the lazy max) with the
causal mask applied only to the key tiles that cross the CTA's diagonal. Same arguments and outputs as the library's
prefill_folded.

What it tries (bench/PREFILL_NOTES.md, "Prediction: the causal mask on the diagonal tiles only"): the library masks
every 64-key tile (`macros.mask_scores_macro`: per score, the key's position against its row's, a select to -inf)
between Q.K and the softmax, where the tensor cores are idle. A CTA's rows (8 tokens x 8 heads) sit at positions
pos0 + tok0 .. pos0 + tok0 + 7 (rows past the chunk repeat its last token, at a later position still), so a tile whose
last key is at or before pos0 + tok0 keeps every score: the mask is the identity there, and keys past the sequence
(at n_kv = pos0 + q_len or later) are never in such a tile. A 4,096-query chunk at 32K of context walks ~450-510 key
tiles a CTA, of which one or two cross the diagonal. Per tile the mask is 16 scores a consumer thread (64 x 64 over
256): the row's position (a division by 8, a min, an add, computed once a row), the key's, a compare and a select:
~40-60 instructions a thread, 8 warps over 4 schedulers, ~100-120 issue cycles of a ~3,000-cycle tile (the lazy-max
library's ~63% of the matmul rate on the H100: ~2,950 cycles a tile at 1.83 GHz).

Prediction (written before any GPU run): 2-4% faster than the library's folded prefill at 32K and at 8K of context
(the same saving a tile; the diagonal tiles are few at both). No gain: the selects were issued beside the other
warpgroup's exp2 and its wait at the row reduction's barrier (off the critical path), or nvcc had already hoisted
the compare out of the tiles it could prove whole (the emitted CUDA of the library then shows no per-tile compare
of the scores).

    python bench/versions/prefill_folded_diagonal_mask.py   # build here (sm_90a), print the CUDA size and the mask's branch
    python bench/prefill_kernel_probe.py --out $OUT          # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.prefill_attention import DEFAULTS, check_geometry, prefill_program
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat


def diagonal_mask_macro(block_N: int):
    """The library's mask (`macros.mask_scores_macro`) on the tiles that cross the diagonal only (module docstring)."""
    import tilelang.language as T

    mask_scores = macros.mask_scores_macro()

    @T.macro
    def mask(scores, keep, k, first_pos):  # k: the key tile (the loop's own name, which TileLang would rename)
        if (k + 1) * block_N - 1 > first_pos:
            mask_scores(scores, keep)

    return mask


def tiling_of(params: dict) -> dict:
    """The library prefill's registered params (the harnesses pass them through) with `params` over them."""
    return {**DEFAULTS, **params}


def program(geom: AttentionGeometry = GEMMA4_31B, **tiling):
    """The TileLang prim_func: the library's folded program with the diagonal-only mask."""
    cfg = tiling_of(tiling)
    return prefill_program(geom, KvFormat.FOLDED, **cfg, mask=diagonal_mask_macro(cfg["block_N"]))


def build(geom: AttentionGeometry = GEMMA4_31B, *, arch: str | None = None, **tiling):
    """Compile the diagonal-mask folded prefill (the library prefill's params)."""
    check_geometry(geom, KvFormat.FOLDED)
    tilelang = require_tilelang()
    cfg = tiling_of(tiling)

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prefill_folded_diagonal_mask(page_size, block_N, num_stages, threads, reduce_batch, max_slack_log2):
        return program(geom, page_size=page_size, block_N=block_N, num_stages=num_stages, threads=threads,
                       reduce_batch=reduce_batch, max_slack_log2=max_slack_log2)

    return prefill_folded_diagonal_mask(cfg["page_size"], cfg["block_N"], cfg["num_stages"], cfg["threads"],
                                        cfg["reduce_batch"], cfg["max_slack_log2"])


def main():
    kernel = build(GEMMA4_31B)
    src = kernel.get_kernel_source()
    print(f"prefill_folded diagonal mask {tiling_of({})}: {len(src)} chars of CUDA")


if __name__ == "__main__":
    main()
