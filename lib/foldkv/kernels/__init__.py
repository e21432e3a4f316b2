"""TileLang-generated kernels (decode partial + merges, prefill, prep) and their launchers.

Nothing here imports TileLang at module import: each generator calls `foldkv.kernels.tl.require_tilelang()` when
it builds, so `import foldkv` works on a machine without a GPU or TileLang.
"""
