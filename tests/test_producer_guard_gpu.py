"""GPU test of the hazard the producer guard removes (foldkv.kernels.producer_guard; bench/DECODE_NOTES.md run 19):
the fused split step at 8,192 tokens with producer warps 1-3 held back 200 us after their register deallocation, as a
slow wake-up would. Without the guard they enter the loop after the consumers have finished it and wait on an empty
barrier for a phase that never comes: the launch never ends (the red twin). With the guard they skip the loop and the
step completes, equal bit for bit to the library's. Each twin runs in its own process (a hung launch is ended by
ending its process), built with TileLang's cache off so the delay is compiled in.

    FOLDKV_REQUIRE_GPU=1 python -m pytest tests/test_producer_guard_gpu.py -v
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

DELAY = "if (((int)threadIdx.x) >= 32) { __nanosleep(200000); }  // the test's slow producer warps"
WAIT_S = 10  # the step takes ~20 us; a launch still running after this long is hung


@pytest.mark.parametrize("variant,expect", [("guarded", "completed equal"), ("unguarded", "hung")])
def test_slow_producer_warps(cuda_device, variant, expect):
    proc = subprocess.run([sys.executable, __file__, variant], capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == expect, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _twin(variant: str) -> str:
    import tilelang
    import torch
    import tvm_ffi

    import foldkv
    from foldkv import KvFormat
    from foldkv.kernels import decode_partial, producer_guard
    from foldkv.kernels.decode import decode, plan_decode
    from foldkv.lab import gates

    dev = torch.device("cuda")
    inputs = gates.make_inputs(gates.Case("1x8192", (8192,)), KvFormat.SPLIT, dev, 0)
    plan = plan_decode(inputs.pool.layout, inputs.case.seq_lens, device=dev)
    assert plan.fused
    ref = decode(inputs.pool, inputs.query, inputs.table, plan=plan, fused=True)  # the library's step
    torch.cuda.synchronize()

    guard = tvm_ffi.get_global_func(producer_guard.POSTPROC)  # installed by the library's build above

    def slow_producer_warps(code, target):
        if variant == "guarded":
            code = str(guard(code, target))
        else:
            code = code.replace(producer_guard.MARK, "// (unmarked: the guard leaves it alone)")
        dealloc = code.index("tl::warpgroup_reg_dealloc<")
        at = code.index("\n", dealloc) + 1
        return code[:at] + "    " + DELAY + "\n" + code[at:]

    tvm_ffi.register_global_func(producer_guard.POSTPROC, f=slow_producer_warps, override=True)
    tilelang.disable_cache()
    kernel = decode_partial.build_decode_fused.__wrapped__(foldkv.GEMMA4_31B, KvFormat.SPLIT)  # no registry check
    assert DELAY in kernel.get_kernel_source()
    assert (producer_guard.GUARD in kernel.get_kernel_source()) == (variant == "guarded")
    out, lse = decode(inputs.pool, inputs.query, inputs.table, plan=plan, fused=True,
                      kernels={"decode_fused_split": kernel})
    t0 = time.monotonic()
    while not torch.cuda.current_stream().query():
        if time.monotonic() - t0 > WAIT_S:
            return "hung"
        time.sleep(0.01)
    return "completed " + ("equal" if torch.equal(out, ref[0]) and torch.equal(lse, ref[1]) else "different")


if __name__ == "__main__":  # one twin, in its own process: prints its outcome last
    outcome = _twin(sys.argv[1])
    print(outcome, flush=True)
    os._exit(0)  # also with a launch still running: ending the process ends it
