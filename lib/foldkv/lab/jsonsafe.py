"""One JSON cleaner for every file the lab saves: `jsonable(obj)` turns a result into plain, strict JSON values."""

from __future__ import annotations

import enum
import math
from typing import Any


def jsonable(obj: Any) -> Any:
    """`obj` as values `json.dump(..., allow_nan=False)` writes: dicts (keys as strings, an enum key as its value),
    lists (from lists, tuples, sets, tensors and arrays), str, int, bool, None and finite floats.

    A NaN or infinite float becomes None (strict JSON has no NaN; a reader takes None as "not finite", as
    `drift.finite_max` does). A tensor or array becomes nested lists, a torch or numpy scalar its Python value, an enum
    its value. Anything else is written as its str() (a dtype, a device, a path), so a record never fails to save."""
    if isinstance(obj, enum.Enum):  # before str and int: a str- or int-valued enum is written as its plain value
        return jsonable(obj.value)
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {_key(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    tolist = getattr(obj, "tolist", None)  # torch.Tensor, numpy arrays and scalars
    if callable(tolist) and hasattr(obj, "dtype"):
        return jsonable(tolist())
    item = getattr(obj, "item", None)  # other scalar wrappers
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)


def _key(key: Any) -> str:
    if isinstance(key, enum.Enum):
        key = key.value
    return key if isinstance(key, str) else str(key)
