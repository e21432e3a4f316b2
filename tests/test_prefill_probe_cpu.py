"""bench/prefill_probe.py's cells on the CPU: ARM:PROMPT[:BATCH[:CHUNK]][@FIELD=0|1,...], the step options after @ an
arm of their own in the ttft rotation (its label) and a valid `StepOptions` over the served ones. Red twins: a field
StepOptions does not have, and a value other than 0 or 1, are refused before any model is built.

Reproduce: pytest tests/test_prefill_probe_cpu.py
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from conftest import bench_script
from foldkv.step_options import StepOptions


def test_a_cell_with_step_options_is_an_arm_of_its_own():
    probe = bench_script("prefill_probe")
    plain = probe._cell("foldkv-folded:32768", 4096)
    assert plain == {"arm": "foldkv-folded", "prompt": 32768, "batch": 1, "chunk": 4096, "options": {},
                     "label": "foldkv-folded"}
    ab = probe._cell("foldkv-folded:32768:2:8192@merge_prefill=0,fuse_prefill_norm_rope=1", 4096)
    assert (ab["arm"], ab["prompt"], ab["batch"], ab["chunk"]) == ("foldkv-folded", 32768, 2, 8192)
    assert ab["options"] == {"merge_prefill": False, "fuse_prefill_norm_rope": True}
    assert ab["label"] == "foldkv-folded@merge_prefill=0,fuse_prefill_norm_rope=1" != plain["label"]
    assert dataclasses.replace(StepOptions(), **ab["options"]).merge_prefill is False


@pytest.mark.parametrize("bad", ["foldkv-folded:4096@merge_prefil=0", "foldkv-folded:4096@merge_prefill=2",
                                 "foldkv-folded:4096@merge_prefill"])
def test_a_cell_with_an_unknown_option_or_value_is_refused(bad):
    probe = bench_script("prefill_probe")
    with pytest.raises(argparse.ArgumentTypeError, match="StepOptions field"):
        probe._cell(bad, 4096)
