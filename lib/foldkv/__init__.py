"""foldkv: folded KV pages for Gemma 4's k_eq_v global attention (layout, prep, references, generated kernels).

Shapes in the docstrings: T tokens, B requests, Hq query heads, Hkv KV heads, D head_dim, R rotated columns
(32, 4, 512, 128 for the 31B); a page row is row_width = 2D (split) or D + R (folded) wide. The entry points:
PagedKvPool / PagedKvLayout / BlockTable (pool.py), prep_and_store (prep.py), paged_attention_reference
(reference.py); the kernels' launchers are foldkv.kernels.decode.decode and foldkv.kernels.prefill.prefill.
"""

from .config import GEMMA4_31B, PRESETS, AttentionGeometry, ConfigError, geometry_from_config, resolve_geometry
from .layout import (
    KvFormat,
    rotated_columns,
    row_width,
    score_window,
    score_window_columns,
    unrotated_columns,
    value_window,
    value_window_columns,
    value_window_to_head,
)
from .pool import Allocation, BlockTable, PageHolder, PagedKvLayout, PagedKvPool, check_block_table
from .prep import prep_and_store, prep_query, prep_rows, prep_rows_and_query, rope_cos_sin
from .reference import check_pool_format, paged_attention_reference
from .validate import FoldKvInputError
from .moved import moved

__getattr__ = moved(__name__, {"floor": "the byte floor is the lab's analysis: foldkv.lab.byte_floor",
                               "fill_sequences": "foldkv.lab.gates.inputs.fill_sequences (the lab's pools)",
                               "folded_row_sources": "tests/conftest.py (only tests hold the column maps to it)",
                               "rows_to_head_order": "tests/test_layout_pool.py (only a test reads rows back)",
                               "dense_attention_reference": "foldkv.lab.gates.fold (only the fold's gate and tests)"})

__version__ = "0.1.0"
