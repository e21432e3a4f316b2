"""GPU gates of the FP8 folded decode (the default tensor-core partial and "exact"): the kernel against the float64
reference over the same dequantized rows on
hostile pools (NaN rows, NaN and Inf scales on unused pages), a rerun bit-identical, the graph workspace over an FP8
pool, and the needle at the start, middle and end of 4K / 64K / 200K keys with its red twin (a dropped needle must
fail) through the tensor-core partial, "exact" and a bf16 pool. Reproduce one case: FOLDKV_REQUIRE_GPU=1 pytest tests/test_fp8_gpu.py -k '<id>'."""

from __future__ import annotations

import pytest
import torch

from foldkv import KvFormat
from foldkv.fp8 import FP8_DTYPE
from foldkv.lab import gates

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lens", [(1,), (63,), (64,), (65,), (10_602,), (163_336,), (1, 97, 16_384, 54),
                                  (262_144, 1, 63, 64, 65)],
                         ids=["1", "63", "64", "65", "10602", "163336", "ragged4", "ragged-edges"])
@pytest.mark.parametrize("fp8_math", [None, "exact"], ids=["default-tensor-cores", "exact"])
def test_fp8_decode_against_float64(cuda_device, lens, fp8_math):
    """Both FP8 partials, each against its own bound (`run_case` picks it by the partial the arm resolves: the
    default tensor-core one with `gates.fp8_tc`'s terms, "exact" with the bf16 gate's)."""
    inputs = gates.make_inputs(gates.Case("fp8", lens), KvFormat.FOLDED, cuda_device, 4, dtype=FP8_DTYPE)
    res = gates.run_case(inputs, gates.decode_arm("jit", fp8_math=fp8_math))
    assert res["passed"], gates.summary_row(inputs.case, KvFormat.FOLDED, f"jit fp8 {fp8_math}", res)
    again = gates.run_case(inputs, gates.decode_arm("jit", fp8_math=fp8_math))["outputs"]
    assert torch.equal(again[0], res["outputs"][0]) and torch.equal(again[1], res["outputs"][1])


def test_fp8_graph_walk(cuda_device):
    res = gates.graph_walk(KvFormat.FOLDED, steps=32, max_batch=len(gates.WALK_LENGTHS) + 1, dtype=FP8_DTYPE,
                           device=cuda_device)
    bad = [r for r in res["steps"] if not r["passed"]]
    assert not bad, bad[:3]


# The needle's pools and decodes: the FP8 pool through the tensor-core partial (its default, named) and through
# "exact", and a bf16 pool (the bf16 decode the FP8 ones stand beside); (pool dtype, fp8_math, the partial that runs)
NEEDLE_POOLS = {"fp8-tensor-cores": (FP8_DTYPE, "tensor_cores", "tensor_cores"),
                "fp8-exact": (FP8_DTYPE, "exact", "exact"), "bf16": (torch.bfloat16, None, "bf16")}


@pytest.mark.parametrize("where", ["start", "middle", "end"])
@pytest.mark.parametrize("length", list(gates.NEEDLE_LENGTHS))
@pytest.mark.parametrize("pool", list(NEEDLE_POOLS))
def test_needle(cuda_device, pool, length, where):
    """The needle at the start, middle and end of 4K / 64K / 200K keys comes back through each decode, each held to
    its own derived bound (the tensor-core partial with `gates.fp8_tc`'s terms: `needle` adds them by the partial)."""
    dtype, fp8_math, partial = NEEDLE_POOLS[pool]
    position = {"start": 0, "middle": length // 2, "end": length - 1}[where]
    res = gates.needle(length, position, device=cuda_device, dtype=dtype, fp8_math=fp8_math)
    assert res["partial"] == partial
    assert res["passed"], {k: res[k] for k in ("partial", "kernel_ok", "kernel_max_abs", "leak_ok",
                                               "leak_max_over_bound", "e2e_ok", "e2e_max_abs", "e2e_max_over_bound",
                                               "needle_weight_min")}


@pytest.mark.parametrize("pool", list(NEEDLE_POOLS))
def test_needle_red_twin(cuda_device, pool):
    dtype, fp8_math, partial = NEEDLE_POOLS[pool]
    res = gates.needle(4096, 2048, device=cuda_device, dtype=dtype, fp8_math=fp8_math, drop_needle=True)
    assert res["partial"] == partial
    assert res["kernel_ok"], "the kernel still matches the reference over the changed pool"
    assert not res["e2e_ok"], res


def e4m3_conversion_program(source: str, rows: int = 64, cols: int = 128, threads: int = 128):
    """A one-CTA TileLang program that converts codes [rows, cols] e4m3 to out [rows, cols] bf16 through
    `macros.convert_e4m3_macro`, shared memory to shared memory as the decode does (`source`: the device code, or a
    deliberately broken copy of it for the red twin)."""
    import tilelang.language as T

    from foldkv.kernels import macros
    from foldkv.kernels.tl import prim_func

    convert = macros.convert_e4m3_macro(rows, cols, threads)

    @T.macro
    def e4m3_to_bf16(codes, out):
        with T.Kernel(1, threads=threads):
            T.import_source(source)
            stored = T.alloc_shared((rows, cols), "float8_e4m3")
            tile = T.alloc_shared((rows, cols), "bfloat16")
            T.copy(codes, stored)
            convert((macros.Convert(stored, tile, 0),))
            T.copy(tile, out)

    args = {"codes": T.Tensor((rows, cols), "float8_e4m3"), "out": T.Tensor((rows, cols), "bfloat16")}
    return prim_func("e4m3_to_bf16", args, lambda b: e4m3_to_bf16(b["codes"], b["out"]))


@pytest.mark.parametrize("source", ["library", "unscaled"])
def test_e4m3_conversion_exact(cuda_device, source):
    """The decode's e4m3 -> bf16 conversion (foldkv.kernels.macros) is bit-exact for every finite code, normal,
    subnormal and signed zero, against torch's conversion; its red twin (the same code without the multiply by 2^120)
    must differ."""
    import tilelang

    from foldkv.kernels import macros
    from foldkv.kernels.tl import pass_configs, target

    src = macros.E4M3_TO_BF16_SOURCE
    if source == "unscaled":
        assert src.count("0x7B807B80u") == 1
        src = src.replace("0x7B807B80u", "0x3F803F80u")  # times 1: every value off by 2^-120
    kernel = tilelang.compile(e4m3_conversion_program(src), target=target(),
                              pass_configs=pass_configs())
    gen = torch.Generator().manual_seed(0)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes, no NaN
    codes = finite[torch.randint(0, finite.numel(), (64, 128), generator=gen)]
    codes.view(-1)[: finite.numel()] = finite  # every code at least once
    codes = codes.view(FP8_DTYPE).to(cuda_device)
    out = torch.full((64, 128), float("nan"), dtype=torch.bfloat16, device=cuda_device)  # poisoned
    kernel(codes, out)
    want = codes.to(torch.bfloat16)
    same = out.view(torch.int16) == want.view(torch.int16)
    if source == "library":
        assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ, e.g. code " \
            f"{int(codes.view(torch.uint8)[~same][0])}: {float(out[~same][0])} != {float(want[~same][0])}"
    else:
        assert not bool(same[want != 0].any()), "the red twin (no 2^120 multiply) matched on a nonzero code"
