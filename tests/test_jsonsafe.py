"""`foldkv.lab.jsonsafe.jsonable`: every saved JSON (run records, drift results) goes through it, as strict JSON."""

import json
import math

import pytest
import torch

from foldkv import KvFormat
from foldkv.lab.jsonsafe import jsonable


def test_jsonable_writes_strict_json():
    raw = {KvFormat.FOLDED: [math.nan, -math.inf, 1.5], "tensor": torch.tensor([[1.0, math.nan], [2.0, 3.0]]),
           "scalar": torch.tensor(2), "int": torch.tensor(7, dtype=torch.int32), "format": KvFormat.SPLIT,
           "dtype": torch.bfloat16, "pair": (1, 2), 3: True, "none": None}
    with pytest.raises((TypeError, ValueError)):  # the red twin: as is, it is no strict JSON
        json.dumps(raw, allow_nan=False)
    out = jsonable(raw)
    assert json.loads(json.dumps(out, allow_nan=False)) == out
    assert out == {"folded": [None, None, 1.5], "tensor": [[1.0, None], [2.0, 3.0]], "scalar": 2, "int": 7,
                   "format": "split", "dtype": "torch.bfloat16", "pair": [1, 2], "3": True, "none": None}
    assert type(out["format"]) is str and type(out["int"]) is int


def test_jsonable_numpy_values():
    np = pytest.importorskip("numpy")
    out = jsonable({"a": np.array([1.0, np.nan]), "b": np.float32(0.5), "c": np.bool_(True), "d": np.int64(3)})
    assert out == {"a": [1.0, None], "b": 0.5, "c": True, "d": 3}
    json.dumps(out, allow_nan=False)
