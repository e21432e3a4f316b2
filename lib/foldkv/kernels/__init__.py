"""TileLang-generated kernels (decode partial + merges, prefill, the FP8 page gather) and their launchers.

Nothing here imports TileLang at module import: each generator calls `foldkv.kernels.tl.require_tilelang()` when
it builds, so `import foldkv` works on a machine without a GPU or TileLang.
"""

from ..moved import moved

__getattr__ = moved(__name__, {"prep_kernel": "the fused TileLang prep is a lab version, bench/versions/prep_fused.py"
                                              " (the runtime folds and stores with foldkv.global_step.fold_and_store)"})
