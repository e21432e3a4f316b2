"""One way to turn a lab result into strict JSON: what every saved record (run records, benchmark results, the drift
study) passes through before `json.dump(..., allow_nan=False)`."""

from __future__ import annotations

import enum
import math
import os
from typing import Any


def jsonable(obj: Any) -> Any:
    """`obj` as plain JSON values, recursively: dict keys -> str; lists, tuples and sets -> lists; NaN and +-inf ->
    None (strict JSON has no NaN); torch tensors and numpy arrays -> (nested) lists; numpy / torch scalars ->
    Python numbers (`.item()`); enums -> their `.value`; paths -> str; anything else -> `str(obj)`."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k.value if isinstance(k, enum.Enum) else k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "tolist") and hasattr(obj, "shape"):  # torch.Tensor, numpy.ndarray, numpy scalars
        return jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return jsonable(obj.item())
    return str(obj)
