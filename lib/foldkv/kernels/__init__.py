"""TileLang-generated kernels and their launchers; TileLang is imported only when a kernel is built."""

from ..moved import moved

__getattr__ = moved(__name__, {"prep_kernel": "the fused TileLang prep is a lab version, bench/versions/prep_fused.py"
                                              " (the runtime folds and stores with foldkv.global_step.fold_and_store)"})
