"""Import every kernel module so each registers its variants (no TileLang import happens here)."""

from . import decode_partial, merge, prefill_attention, prep_kernel  # noqa: F401
