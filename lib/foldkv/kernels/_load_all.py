"""Import every kernel module so each registers its variants (no TileLang import happens here)."""

import importlib

for _mod in ("decode", "prefill", "prep_kernel"):
    try:
        importlib.import_module(f"{__package__}.{_mod}")
    except ModuleNotFoundError as exc:  # a module not written yet
        if exc.name != f"{__package__}.{_mod}":
            raise
