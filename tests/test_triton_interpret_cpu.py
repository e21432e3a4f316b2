"""The decode step's Triton kernels in Triton's interpreter, on CPU tensors: `foldkv.fused_step_ops`' launches (norms,
the residual tails with and without split partials, RoPE, GELU x up, the ring's masked softmax, a sliding layer's
prologue in one launch and as two, a prefill's q/k norm and RoPE in one pass), `foldkv.gemv`'s tensor-core GEMM and its
split sum, `foldkv.global_step`'s query and row kernels (after the model's norms and RoPE, and with them inside), and
the lab's (the read roof's streaming sum; bench/versions/ring_attention_one_launch.py; the greedy pick of
bench/versions/greedy_pick_fused.py, alone and inside a CPU generate()), each against what it replaces. The GPU tests
hold the compiled kernels to the same statements on the H200; these run everywhere Triton is installed (a CPU torch gets
the H200's Triton from scripts/install.sh), so a launch that passes a wrong stride, a moved host function that lost a
name, or a formula that left torch's rounding points fails in CI.

Triton's interpreter is chosen when a kernel is defined (`TRITON_INTERPRET=1` at import), so the kernels run in a
child pytest of this file (`test_the_kernels_in_the_interpreter`); in this process the others skip. Three things the
interpreter of Triton 3.6 (the H200's) does otherwise than the GPU are put right in the child, so that the statements
are the GPU's (`_as_on_the_gpu`): it multiplies bf16 tiles as their uint16 bits (tl.dot), it converts float32 to
bf16 by truncation where the GPU's `cvt.rn` rounds to nearest even (`.to(tl.bfloat16)`), and its float32 -> e4m3
conversion drops the rounding's carry into the exponent (124.3 becomes 64; the GPU's `cvt.rn.satfinite`: 128). Its `range` over a runtime
bound needs NumPy < 2.4 (scripts/install.sh pins it with Triton on a CPU torch).

Bounds, from where each op rounds:
- RMSNorm and the prologue: inputs on a grid (k/8, |k| <= 16) whose float32 sums of squares are exact in any order,
  so the kernel's and torch's float32 values are the same and the bf16 results bitwise; a second norm over a rounded
  residual (not on the grid) is held against the same formula over the kernel's own h: the two float32 sums differ by
  at most n 2^-24 of the sum, far below bf16's half ulp, so at most one rounding moves: <= ulp(ref).
- RoPE, the row moves and the fold: the same float32 products and roundings as torch: bitwise; an FP8 pool's row
  quantized with `foldkv.fp8.quantize_rows`' correctly rounded divisions (div_rn): bitwise.
- GELU x up and the softmax: exp in the interpreter (numpy) and in torch differ by float32 ulps, which can move one
  bf16 rounding: GELU <= (ulp(act) + |g| 2^-23) |up| + ulp(ref) (`_gelu_within`), the softmax <= ulp(ref).
- the one-launch ring attention: query and K on a grid where every float32 sum is exact, so its scores are torch's;
  the output within conftest's `ring_output_bound` of the float64 softmax (unrounded) and P.V over them, plus its
  rescales' float32 roundings.
- the GEMM: float32 accumulation against float64, |y - ref| <= ulp(ref) + K 2^-23 sum_k |x_k w_k| (test_gemv_gpu's).
Every kernel writes into an output poisoned with NaN (every element written) and has a red twin that must fail.

The child logs every kernel launch's specialisation (argument types, alignment, constexprs, warps, stages), and the
parent compiles each for sm_90a with Triton's own backend and ptxas (`conftest.triton_sm90`), with GDC on as well
where the kernel has it: a kernel the H200's JIT would refuse to build, or one that spills, fails here.

Reproduce: pytest tests/test_triton_interpret_cpu.py            (the child: TRITON_INTERPRET=1 pytest <this file>)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (GREEDY_PICK_CASES, ROW_FORMATS, NormStub, attention_norms, query_kernel_check,
                      require_module, row_store_check)

INSIDE = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's child process "
                                               "(test_the_kernels_in_the_interpreter)")
ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


def _as_on_the_gpu() -> None:
    """The interpreter's bf16 dot and float32 -> bf16 and -> e4m3 conversions made the GPU's (module docstring): bf16
    operands converted exactly to float32 before the float32 matmul (the tensor cores' exact products), and a float32
    value converted to bf16 or to e4m3 rounded to nearest even (torch's conversions, which are cvt.rn's; an e4m3
    conversion's value is clamped to +-448 before it by every caller, so satfinite never acts)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    def f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h.data
        return (h.data.astype(np.uint32) << 16).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        return ti.TensorHandle(np.matmul(f32(a), f32(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rne = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(BF16)
            return ti.TensorHandle(rne.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            rne = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e4m3fn)
            return ti.TensorHandle(rne.view(torch.uint8).numpy(), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    dot, cast = ti.InterpreterBuilder.create_dot, ti.InterpreterBuilder.cast_impl
    fp_to_fp = ti.InterpreterBuilder.create_fp_to_fp
    # (create_fp_trunc calls cast_impl)
    ti.InterpreterBuilder.create_dot, ti.InterpreterBuilder.cast_impl = create_dot, cast_impl
    ti.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    _INTERPRETER_OWN.update(dot=dot, cast=cast, fp_to_fp=fp_to_fp)


_INTERPRETER_OWN: dict = {}  # the interpreter's own create_dot and cast_impl (the shim's red twin)


LAUNCH_LOG = "FOLDKV_TRITON_LAUNCH_LOG"  # the child appends each kernel launch's specialisation here (JSON lines)
_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
                  torch.int32: "*i32", torch.int64: "*i64", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
                  torch.bool: "*i1", torch.float8_e4m3fn: "*fp8e4nv"}


def _record_launches(path: str) -> None:
    """Every grid launch of a module-level kernel in this process appended to `path` as its JIT would specialise it:
    a tensor a pointer of its dtype (divisible by 16 when its address is), an int i32 or i64 (divisible by 16 when it
    is), a float fp32, the tl.constexpr parameters by value (their defaults filled in), num_warps and num_stages.
    Kernels a test defines (`<locals>`) and constexpr values JSON cannot hold are left out."""
    import inspect
    import json

    from triton.runtime import interpreter as ti

    run = ti.InterpretedFunction.run
    written: set = set()

    def recorded(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if "<locals>" not in fn.__qualname__:
            params = inspect.signature(fn).parameters
            bound = dict(zip(params, args))
            bound.update({k: v for k, v in kwargs.items() if k in params})
            spec, ok = [], True
            for name, p in params.items():
                value = bound.get(name, p.default)
                if "constexpr" in str(p.annotation):
                    ok = ok and (value is None or isinstance(value, (bool, int, float, str)))
                    spec.append([name, "constexpr", value])
                elif isinstance(value, torch.Tensor):
                    spec.append([name, _POINTER_TYPES[value.dtype], value.data_ptr() % 16 == 0])
                elif isinstance(value, bool):
                    spec.append([name, "i1", False])
                elif isinstance(value, int):
                    spec.append([name, "i32" if -2 ** 31 <= value < 2 ** 31 else "i64", value % 16 == 0])
                elif isinstance(value, float):
                    spec.append([name, "fp32", False])
                else:
                    ok = False
            options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            line = json.dumps({"module": fn.__module__, "name": fn.__qualname__, "spec": spec, "options": options})
            if ok and line not in written:  # each specialisation once
                written.add(line)
                with open(path, "a") as fh:
                    fh.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    ti.InterpretedFunction.run = recorded


if INSIDE:
    _as_on_the_gpu()
    if os.environ.get(LAUNCH_LOG):
        _record_launches(os.environ[LAUNCH_LOG])

PARENT_TESTS = ("test_the_kernels_in_the_interpreter", "test_every_launched_kernel_compiles_for_the_h200")


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    """This file's tests in a child pytest under TRITON_INTERPRET=1 (the parent's two tests deselected there), its
    kernel launches logged (`_record_launches`): (the child's CompletedProcess, the log's path)."""
    if INSIDE:
        pytest.skip("this is the interpreter's own run")
    require_module("triton")
    import numpy
    import triton

    old_triton = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)
    if old_triton and tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter needs NumPy < 2.4 (range over a runtime bound), this is"
                    f" {numpy.__version__}; scripts/install.sh pins it beside a CPU torch")
    log = tmp_path_factory.mktemp("launches") / "launches.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **{LAUNCH_LOG: str(log)})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-W",
                        "ignore:Conversion of an array:DeprecationWarning", "-k",
                        " and ".join(f"not {name}" for name in PARENT_TESTS), __file__], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    return r, log


def test_the_kernels_in_the_interpreter(interpreter_run):
    r, _ = interpreter_run
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    # every test of the file but the parent's two ran and passed: "N passed, 2 deselected in ..." and nothing else
    assert re.fullmatch(r"=* ?\d+ passed, 2 deselected in [\d.]+s( \(.*\))? ?=*", summary), tail


def _compile_specs(log: Path) -> list[dict]:
    """The log's distinct specialisations, each as launched and, where the kernel has the constexpr GDC, once more
    with it on (the step's PDL path); a red twin's (a RED_* constexpr set) left out: never built for use."""
    import json

    seen, specs = set(), []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if any(n.startswith("RED_") and v for n, k, v in rec["spec"] if k == "constexpr"):
            continue
        variants = [rec["spec"]]
        if any(n == "GDC" for n, _, _ in rec["spec"]):
            variants.append([[n, k, True if n == "GDC" else v] for n, k, v in rec["spec"]])
        for spec in variants:
            key = json.dumps([rec["module"], rec["name"], spec, rec["options"]], sort_keys=True)
            if key not in seen:
                seen.add(key)
                specs.append(dict(rec, spec=spec))
    return specs


def _compile_failures(specs: list[dict]) -> list[str]:
    """Each spec compiled for sm_90a (conftest.triton_sm90): what failed to build or spilled, a line each."""
    import importlib

    from conftest import bench_version, triton_sm90

    failures = []
    for s in specs:
        module = s["module"]
        fn = getattr(bench_version(module.split(".", 1)[1]) if module.startswith("versions.")
                     else importlib.import_module(module), s["name"])
        signature = {n: k for n, k, _ in s["spec"] if k != "constexpr"}
        constexprs = {n: v for n, k, v in s["spec"] if k == "constexpr"}
        divisible = tuple(n for n, k, v in s["spec"] if k != "constexpr" and v is True)
        try:
            got = triton_sm90(fn, signature, constexprs, divisible, num_warps=s["options"].get("num_warps", 4),
                              num_stages=s["options"].get("num_stages"))
        except Exception as exc:  # noqa: BLE001 (every failure listed)
            failures.append(f"{module}.{s['name']} {constexprs}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        if got["spill_bytes"]:
            failures.append(f"{module}.{s['name']} {constexprs}: {got['spill_bytes']} bytes of spills")
    return failures


def test_every_launched_kernel_compiles_for_the_h200(interpreter_run):
    """Each kernel the interpreter ran, at each specialisation the tests launched (and with GDC on), compiled for
    sm_90a on this machine (conftest.triton_sm90: Triton's backend and its ptxas) with no spill: what the H200's JIT
    would build, so a construct the GPU backend refuses, or a tile that spills, fails here and not on the device.
    Red twin: one of those specialisations with its BLOCK made 3 (no power of two) is listed as failing."""
    r, log = interpreter_run
    assert r.returncode == 0 and log.exists(), "the interpreter's run failed or launched nothing"
    specs = _compile_specs(log)
    names = {(s["module"], s["name"]) for s in specs}
    assert ("foldkv.fused_step_kernels", "rms_norm_rows") in names and len(names) >= 10, sorted(names)
    failures = _compile_failures(specs)
    assert not failures, "\n".join(failures)
    norm = next(s for s in specs if s["name"] == "rms_norm_rows")
    twin = dict(norm, spec=[[n, k, 3 if n == "BLOCK" else v] for n, k, v in norm["spec"]])
    assert len(_compile_failures([twin])) == 1, "red twin: a block of 3 compiled"


@inside
def test_the_interpreter_converts_and_multiplies_as_the_gpu(monkeypatch):
    """With `_as_on_the_gpu`, a kernel's float32 -> bf16 store rounds to nearest even and a bf16 tl.dot multiplies the
    values (torch's results); the interpreter's own conversion and dot (the red twins) do not."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    @triton.jit
    def convert_and_dot(x_ptr, y_ptr, e_ptr, a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))
        tl.store(e_ptr + i, (tl.load(x_ptr + i) * 10.0).to(tl.float8e4nv))
        a = tl.load(a_ptr + i[:, None] * N + i[None, :])
        b = tl.load(b_ptr + i[:, None] * N + i[None, :])
        tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))

    x = torch.randn(16, generator=_gen(1)) * 3
    x[0] = 12.43  # x 10 = 124.3: e4m3's nearest is 128, a carry into the exponent
    a, b = _randn((16, 16), seed=2), _randn((16, 16), seed=3)

    def run():
        y, e, c = torch.empty(16, dtype=BF16), torch.empty(16, dtype=torch.float8_e4m3fn), torch.empty(16, 16)
        convert_and_dot[(1,)](x, y, e, a, b, c, N=16)
        e4m3 = (x * 10).clamp(-448, 448).to(torch.float8_e4m3fn)
        return (torch.equal(y, x.to(BF16)), torch.equal(e.view(torch.uint8), e4m3.view(torch.uint8)),
                bool(((c.double() - a.double() @ b.double()).abs() < 1e-4).all()))

    assert run() == (True, True, True)
    monkeypatch.setattr(ti.InterpreterBuilder, "cast_impl", _INTERPRETER_OWN["cast"])
    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", _INTERPRETER_OWN["dot"])
    monkeypatch.setattr(ti.InterpreterBuilder, "create_fp_to_fp", _INTERPRETER_OWN["fp_to_fp"])
    assert run() == (False, False, False), "the interpreter's own conversions and dot matched the GPU's"


# --- inputs ---------------------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grid(shape, seed: int) -> torch.Tensor:
    """bf16 values k/8, |k| <= 16, none zero: float32 sums of their squares are exact in any order (< 2^24 / 64)."""
    sign = torch.randint(0, 2, shape, generator=_gen(seed + 1)) * 2 - 1
    k = torch.randint(1, 17, shape, generator=_gen(seed)) * sign
    return (k / 8).to(BF16)


def _weight(n: int, seed: int) -> torch.Tensor:
    return (torch.randint(1, 64, (n,), generator=_gen(seed)) / 32).to(BF16)


def _randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(BF16)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    from foldkv.lab.gates.checks import bf16_ulp

    return bf16_ulp(x.double())


def _norm_ref(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """rms_norm_rows' formula in torch: float32, x * (1 / sqrt(sum(x^2) / n + eps)) [* w], rounded once."""
    xf = x.float()
    y = xf * (1.0 / torch.sqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps))
    return (y * w.float() if w is not None else y).to(x.dtype)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, 1, H, D] with cos/sin [B, 1, D]: torch's bf16 x * cos + rotate_half(x) * sin (each op rounded)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def _ops():
    from foldkv import fused_step_ops

    return fused_step_ops


# --- norms and the residual tails -----------------------------------------------------------------------------------
@inside
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("view", ["packed", "head_slice"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_rms_norm(rows, view, weighted):
    ops = _ops()
    n, heads = 64, 3
    full = _grid((rows, 1, heads + 2, n), seed=rows)  # a merged output's heads
    x = full[:, :, 1:1 + heads] if view == "head_slice" else full[:, :, :heads].contiguous()
    w = _weight(n, 5) if weighted else None
    assert view == "packed" or rows == 1 or not x.is_contiguous()  # a head slice read in place (_packed_rows)
    want = _norm_ref(x, w, 1e-6)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), want)
    assert not torch.equal(ops.rms_norm(x, w, 0.5), want), "red twin: another epsilon"


@inside
@pytest.mark.parametrize("tail", ["norm_add_norm", "norm_add_scale"])
@pytest.mark.parametrize("rows", [1, 5])
def test_norm_add(rows, tail):
    import step_twins as twins

    n = 96
    x, res = _grid((rows, 1, n), seed=10 + rows), _randn((rows, 1, n), seed=20 + rows)
    first, second = NormStub(n, 1, 1e-6), NormStub(n, 2, 1e-5)
    scalar = torch.tensor([0.75], dtype=BF16)
    h_want = res + _norm_ref(x, first.weight, 1e-6)  # torch's bf16 add: one rounding
    if tail == "norm_add_norm":
        h, y = twins.norm_add_norm(x, res, first, second)
        assert torch.equal(h, h_want)
        y_ref = _norm_ref(h, second.weight, 1e-5)  # the formula over the kernel's own h (not on the grid)
        assert bool(((y.double() - y_ref.double()).abs() <= _ulp(y_ref)).all())
        _, twin = twins.norm_add_norm(x, res, first, first)  # red twin: the first norm's weight in the second
        assert not bool(((twin.double() - y_ref.double()).abs() <= _ulp(y_ref)).all())
    else:
        h = twins.norm_add_scale(x, res, first, scalar)
        assert torch.equal(h, h_want * scalar)
        assert not torch.equal(twins.norm_add_scale(x, res, second, scalar), h_want * scalar), "red twin: other norm"


@inside
@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_add_reads_split_partials_as_split_sum_adds_them(rows, splits):
    from foldkv import gemv

    ops = _ops()
    n = 80
    parts = torch.randn(splits, rows, n, generator=_gen(splits)) * 0.3
    res = _randn((rows, 1, n), seed=30)
    first, second = NormStub(n, 3, 1e-6), NormStub(n, 4, 1e-6)
    summed = torch.full((rows, n), float("nan"), dtype=BF16)
    gemv.sum_partials(parts, summed, pdl=False)
    in_order = parts[0].clone()
    for p in parts[1:]:
        in_order += p
    assert torch.equal(summed, in_order.to(BF16))
    x = summed.view(rows, 1, n)
    want = ops._norm_add(x, res, first, second, None)
    poisoned = torch.full_like(x, float("nan"))  # x itself is not read when the partials are given
    got = ops._norm_add(poisoned, res, first, second, None, parts=parts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    twin = ops._norm_add(poisoned, res, first, second, None, parts=parts[:-1])  # red twin: one partial fewer
    assert not torch.equal(twin[0], want[0])


# --- RoPE, GELU x up, the masked softmax ----------------------------------------------------------------------------
@inside
@pytest.mark.parametrize("batch", [1, 4])
def test_rope(batch):
    ops = _ops()
    heads, d = 3, 32
    x = _randn((batch, 1, heads, d), seed=40)
    cos, sin = _randn((batch, 1, d), seed=41), _randn((batch, 1, d), seed=42)
    want = _rope_ref(x, cos, sin)
    assert torch.equal(ops.rope(x, cos, sin), want)
    assert not torch.equal(ops.rope(x, sin, cos), want), "red twin: cos and sin exchanged"


def _gelu_within(y: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """y against torch's tanh GELU in float32 rounded once, times up rounded once. The kernel's tanh (through exp)
    and torch's differ by at most ~4 float32 ulps of |t| <= 1 (2^-22), so act = 0.5 g (1 + t) by 0.5 |g| 2^-22 before
    its rounding (which moves by at most ulp(act)); the product's rounding adds ulp(ref)."""
    act = torch.nn.functional.gelu(gate.float(), approximate="tanh").to(BF16)
    ref = act * up
    slack = (_ulp(act) + gate.double().abs() * 2.0 ** -23) * up.double().abs() + _ulp(ref)
    return bool(((y.double() - ref.double()).abs() <= slack).all())


@inside
@pytest.mark.parametrize("n", [1, 1000, 3000])
@pytest.mark.parametrize("rows", [1, 3])
def test_gelu_mul(rows, n):
    ops = _ops()
    merged = _randn((rows, 1, 2 * n), seed=n + rows, scale=2.0)
    gate, up = merged[..., :n], merged[..., n:]  # the halves of a merged gate|up output, read in place
    y = ops.gelu_mul(gate, up)
    assert bool(y.isfinite().all()) and _gelu_within(y, gate, up)
    if n > 1:
        assert not _gelu_within(ops.gelu_mul(up, gate), gate, up), "red twin: gate and up exchanged"


@inside
@pytest.mark.parametrize("window", [1, 17, 64])
@pytest.mark.parametrize("batch", [1, 3])
def test_masked_softmax(batch, window):
    ops = _ops()
    scores = _randn((batch, 2, 3, window), seed=window, scale=4.0)
    mask = torch.rand(batch, window, generator=_gen(window)) > 0.4
    mask[:, 0] = True
    ref = torch.softmax(scores.float().masked_fill(~mask[:, None, None], float("-inf")), -1).to(BF16)

    def within(p):
        return bool(((p.double() - ref.double()).abs() <= _ulp(ref)).all())

    p = ops.masked_softmax(scores, mask, BF16)
    assert within(p) and bool((p[~mask[:, None, None].expand_as(p)] == 0).all())
    if not bool(mask.all()):
        assert not within(ops.masked_softmax(scores, torch.ones_like(mask), BF16)), "red twin: the mask ignored"


# --- a prefill's q and k head rows: the norm and RoPE in one pass ---------------------------------------------------
def _prefill_heads(batch: int, tokens: int, hq: int, hkv: int, d: int, seed: int, merged: bool):
    """q [B, T, hq, d] and k [B, T, hkv, d] as a prefill reads them: column slices of a merged q|k|v output (read in
    place at its token stride) or each projection's own packed output; cos/sin [B, T, d]."""
    x = _grid((batch, tokens, (hq + 2 * hkv) * d), seed=seed)
    q, k = x[..., :hq * d], x[..., hq * d:(hq + hkv) * d]
    if not merged:
        q, k = q.contiguous(), k.contiguous()
    cos, sin = _randn((batch, tokens, d), seed=seed + 1), _randn((batch, tokens, d), seed=seed + 2)
    return q.view(batch, tokens, hq, d), k.view(batch, tokens, hkv, d), cos, sin


def _transformers_norm_rope(x, w, eps, cos, sin):
    """transformers' Gemma4RMSNorm (float32, x * (mean(x^2) + eps)^-0.5 * w, rounded once) then its
    apply_rotary_pos_emb at unsqueeze_dim 2 (torch's bf16 ops: three roundings)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, apply_rotary_pos_emb

    norm = Gemma4RMSNorm(x.shape[-1], eps=eps)
    norm.weight.data = w.float()
    y = norm(x)
    return y, apply_rotary_pos_emb(y, cos, sin, unsqueeze_dim=2)


if INSIDE:  # (defined in the interpreter's child only: its launches all set a RED_* constexpr, never compiled)
    import triton
    import triton.language as tl

    from foldkv.fused_step_kernels import _inverse_norm, _rounded

    @triton.jit
    def norm_rope_twin_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, heads, x_stride, n, eps, D: tl.constexpr,
                            RED_UNROUNDED: tl.constexpr, RED_HALF: tl.constexpr):
        """`q_norm_rope_rows` from the library's row helpers with one thing wrong (`_norm_rope_twin`)."""
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        base = x_ptr + b * x_stride + (row % heads) * D
        inv = _inverse_norm(base, n, eps, D)
        c = tl.arange(0, D)
        half: tl.constexpr = D // 2
        p = (c + half) % D
        y = tl.load(base + c).to(tl.float32) * inv * tl.load(w_ptr + c).to(tl.float32)
        yp = tl.load(base + p).to(tl.float32) * inv * tl.load(w_ptr + p).to(tl.float32)
        if not RED_UNROUNDED:
            y = _rounded(y, tl.bfloat16)
            yp = _rounded(yp, tl.bfloat16)
        if RED_HALF:
            rot = tl.where(c >= half, -yp, yp)
        else:
            rot = tl.where(c < half, -yp, yp)
        cs = tl.load(cos_ptr + b * D + c).to(tl.float32)
        sn = tl.load(sin_ptr + b * D + c).to(tl.float32)
        out = _rounded(_rounded(y * cs, tl.bfloat16) + _rounded(rot * sn, tl.bfloat16), tl.bfloat16)
        tl.store(y_ptr + row * D + c, out.to(tl.bfloat16))


def _norm_rope_twin(x, w, eps, cos, sin, unrounded: bool, other_half: bool):
    """A one-pass norm and RoPE from the library's row helpers with one thing wrong: the normed row left in float32
    before RoPE (unrounded), or rotate_half's sign on the other half (other_half)."""
    assert unrounded or other_half, "a twin has one thing wrong"
    b, t, h, d = x.shape
    out = torch.full((b, t, h, d), float("nan"), dtype=x.dtype)
    norm_rope_twin_rows[(b * t * h,)](x, w, cos.contiguous(), sin.contiguous(), out, h,
                                      x.stride(1) if t > 1 else x.stride(0), d, eps, D=d, RED_UNROUNDED=unrounded,
                                      RED_HALF=other_half)
    return out


@inside
@pytest.mark.parametrize("merged", [True, False])
@pytest.mark.parametrize("batch,tokens", [(1, 5), (3, 4), (2, 1)])
def test_norm_rope_is_the_two_passes_and_transformers(batch, tokens, merged):
    """`norm_rope` (a prefill's q and k: `q_norm_rope_rows` over the chunk's tokens) bitwise `rms_norm` then `rope`,
    both read in place; against transformers' Gemma4RMSNorm and apply_rotary_pos_emb: the norm's float32 value is
    theirs up to its reciprocal square root (1/sqrt against pow -0.5: a float32 ulp), so a normed bf16 value is
    within one bf16 ulp of theirs (test_fused_step_gpu's bound) and RoPE carries it: |cos| ulp(y) + |sin| ulp(y')
    and one ulp of each rounded product and of the sum. Red twins: the normed row not rounded before RoPE, and the
    sign of rotate_half on the other half, are not the two passes."""
    ops = _ops()
    hq, hkv, d, eps = 4, 2, 32, 1e-6
    q, k, cos, sin = _prefill_heads(batch, tokens, hq, hkv, d, seed=70 + batch + tokens, merged=merged)
    for x, w in ((q, _weight(d, 71)), (k, _weight(d, 72))):
        assert merged == (not x.is_contiguous() or tokens * batch == 1)  # a merged output's slice read in place
        got = ops.norm_rope(x, w, eps, cos, sin)
        two = ops.rope(ops.rms_norm(x, w, eps), cos, sin)
        assert got.shape == x.shape and bool(got.isfinite().all())
        assert torch.equal(got, two)
        y, ref = _transformers_norm_rope(x, w, eps, cos, sin)
        half = d // 2
        y_partner = torch.cat([y[..., half:], y[..., :half]], dim=-1)
        c, s = cos[:, :, None].double(), sin[:, :, None].double()
        bound = (c.abs() * _ulp(y) + s.abs() * _ulp(y_partner) + _ulp(y * cos[:, :, None])
                 + _ulp(y_partner * sin[:, :, None]) + _ulp(ref))
        assert bool(((got.double() - ref.double()).abs() <= bound).all())
        assert not torch.equal(_norm_rope_twin(x, w, eps, cos, sin, unrounded=True, other_half=False), two), \
            "red twin: the normed row not rounded before RoPE"
        assert not torch.equal(_norm_rope_twin(x, w, eps, cos, sin, unrounded=False, other_half=True), two), \
            "red twin: rotate_half's sign on the other half"


@inside
def test_norm_rope_refuses_what_it_does_not_read_before_launching():
    from foldkv.validate import FoldKvInputError

    ops = _ops()
    q, _, cos, sin = _prefill_heads(2, 3, 4, 2, 32, seed=80, merged=True)
    w = _weight(32, 81)
    with pytest.raises(FoldKvInputError, match="cos/sin"):  # a table of one row for a batch: not the kernel's
        ops.norm_rope(q, w, 1e-6, cos[:1], sin[:1])
    with pytest.raises(FoldKvInputError, match="one token stride"):  # tokens of two strides
        ops.norm_rope(torch.cat([q, q], dim=1)[:, :3], w, 1e-6, cos, sin)
    with pytest.raises(FoldKvInputError, match="power of two"):
        ops.norm_rope(q[..., :24], w[:24], 1e-6, cos[..., :24], sin[..., :24])
    assert ops.norm_rope_refusal(q, w, cos, sin) is None


@inside
@pytest.mark.parametrize("op", ["rms_norm", "rope", "norm_rope"])
def test_an_op_writes_into_its_place_and_nowhere_else(op):
    """`out=` (a sliding layer's chunk rows in its cache's scratch, foldkv.sliding_cache): `rms_norm`, `rope` and
    `norm_rope` written into rows [W - 1, W - 1 + T) of a NaN-poisoned token-major scratch give bitwise their own
    outputs and leave every other row NaN. Red twin: the place one row off is not those rows."""
    ops = _ops()
    hq, hkv, d, eps, window, tokens = 4, 2, 32, 1e-6, 8, 5
    _, k, cos, sin = _prefill_heads(1, tokens, hq, hkv, d, seed=90, merged=True)
    w = _weight(d, 91)
    run = {"rms_norm": lambda **o: ops.rms_norm(k, w, eps, **o), "rope": lambda **o: ops.rope(k, cos, sin, **o),
           "norm_rope": lambda **o: ops.norm_rope(k, w, eps, cos, sin, **o)}[op]
    want = run()
    for shift in (0, 1):
        scratch = torch.full((1, window - 1 + tokens + 1, hkv, d), float("nan"), dtype=BF16)
        run(out=scratch[:, window - 1 + shift:window - 1 + shift + tokens])
        got = scratch[:, window - 1:window - 1 + tokens]
        if shift:
            assert not torch.equal(got, want), "red twin: the place one row off"
            continue
        assert torch.equal(got, want)
        assert bool(torch.cat([scratch[:, :window - 1], scratch[:, window - 1 + tokens:]], 1).isnan().all())


# --- a sliding layer's prologue -------------------------------------------------------------------------------------
def _prologue_inputs(batch: int, hq: int, hkv: int, d: int, seed: int):
    x = _grid((batch, 1, (hq + 2 * hkv) * d), seed=seed)  # a merged q|k|v output: the slices are read in place
    q, k, v = x[..., : hq * d], x[..., hq * d:(hq + hkv) * d], x[..., (hq + hkv) * d:]
    cos, sin = _randn((batch, 1, d), seed=seed + 1), _randn((batch, 1, d), seed=seed + 2)
    return q, k, v, cos, sin


@inside
@pytest.mark.parametrize("batch", [1, 3])
def test_q_norm_rope(batch):
    ops = _ops()
    hq, d = 4, 64
    q, _, _, cos, sin = _prologue_inputs(batch, hq, 2, d, seed=50)
    w = _weight(d, 51)
    want = _rope_ref(_norm_ref(q.view(batch, 1, hq, d), w, 1e-6), cos, sin).view(batch, hq, d)
    got = ops.q_norm_rope(q, w, 1e-6, cos, sin, hq)
    assert torch.equal(got, want)
    assert torch.equal(got, ops.rope(ops.rms_norm(q.view(batch, 1, hq, d), w, 1e-6), cos, sin).view(batch, hq, d))
    assert not torch.equal(ops.q_norm_rope(q, w, 1e-6, sin, cos, hq), want), "red twin: cos and sin exchanged"


@inside
@pytest.mark.parametrize("slot", [0, 5, 15])
@pytest.mark.parametrize("batch", [1, 3])
def test_kv_to_ring_writes_the_slot_and_nothing_else(batch, slot):
    import step_twins as twins

    hq, hkv, d, window = 4, 2, 64, 16
    _, k, v, cos, sin = _prologue_inputs(batch, hq, hkv, d, seed=60)
    w = _weight(d, 61)
    k_want = _rope_ref(_norm_ref(k.view(batch, 1, hkv, d), w, 1e-6), cos, sin)[:, 0]
    v_want = _norm_ref(v.view(batch, 1, hkv, d), None, 1e-5)[:, 0]

    def run(at):
        ring_k = torch.full((batch, hkv, window, d), float("nan"), dtype=BF16)
        ring_v = torch.full_like(ring_k, float("nan"))
        twins.kv_to_ring(k, v, w, 1e-6, 1e-5, cos, sin, ring_k, ring_v, torch.tensor([at]))
        return ring_k, ring_v

    ring_k, ring_v = run(slot)
    assert torch.equal(ring_k[:, :, slot], k_want) and torch.equal(ring_v[:, :, slot], v_want)
    others = [s for s in range(window) if s != slot]
    assert bool(ring_k[:, :, others].isnan().all() and ring_v[:, :, others].isnan().all()), "another slot written"
    twin_k, _ = run((slot + 1) % window)  # red twin: the row in the next slot
    assert not torch.equal(twin_k[:, :, slot], k_want)


# --- the tensor-core GEMM and its split sum -------------------------------------------------------------------------
def _gemv_bound(x, w, ref):
    mag = x.double().abs() @ w.double().abs().T
    return _ulp(ref) + x.shape[-1] * 2.0 ** -23 * mag


@inside
@pytest.mark.parametrize("shape", [(200, 256), (130, 1024), (64, 512)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemv_tc_within_the_float32_bound(rows, shape):
    from foldkv import gemv

    n, k = shape
    x = _randn((rows, k), seed=rows, scale=0.5)
    w = _randn((n, k), seed=k + n, scale=k ** -0.5)
    ref = x.double() @ w.double().T
    cfg = gemv.tc_config(n, k, rows)
    assert cfg is not None and (cfg["SPLIT"] > 1) == (k == 1024)  # the 1,024 column weight splits K in two

    def run(**twin):
        y = torch.full((rows, n), float("nan"), dtype=BF16)
        from foldkv.lab import pdl_checks

        (pdl_checks.tc_launch_twin if twin else gemv.tc_launch)(x, w, y, cfg, pdl=False, **twin)
        return y

    y = run()
    assert bool(y.isfinite().all()) and bool(((y.double() - ref).abs() <= _gemv_bound(x, w, ref)).all())
    short = k // cfg["SPLIT"] - cfg["BLOCK_K"]  # red twin: each program's range one tile short
    twin = run(k_split=short)
    assert not bool(((twin.double() - ref).abs() <= _gemv_bound(x, w, ref)).all())


# --- a global layer's query and row ---------------------------------------------------------------------------------
def _geom():
    from foldkv import GEMMA4_31B

    return GEMMA4_31B


def _heads(batch, heads, d, seed, extra=3):
    full = _randn((batch, 1, (heads + extra) * d), seed=seed)
    return full[..., : heads * d].view(batch, 1, heads, d).transpose(1, 2)  # strided, as the model hands it over


@inside
@pytest.mark.parametrize("fmt", ["folded", "split"])
@pytest.mark.parametrize("batch", [1, 3])
def test_global_query_is_fold_query(batch, fmt):
    from foldkv import global_step as gst
    from foldkv.prep import fold_query

    geom = _geom()
    hq, d = geom.num_q_heads, geom.head_dim
    q = _heads(batch, hq, d, seed=70 + batch)
    w = _weight(d, 71)
    want = fold_query(geom, fmt, q[:, :, 0], w, BF16)

    ok, twin = query_kernel_check(geom, fmt, batch, want,
                                  lambda out: gst.query_into(geom, fmt, q, w, out))
    assert ok
    assert not twin, "red twin: the rotated halves swapped"


@inside
@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("batch", [1, 3])
def test_global_row_is_rows_from_key_value_then_store_rows(batch, fmt):
    from foldkv import global_step as gst
    from foldkv.prep import rows_from_key_value, store_rows

    geom = _geom()
    hkv, d = geom.num_kv_heads, geom.head_dim
    key, value = _heads(batch, hkv, d, seed=80 + batch), _heads(batch, hkv, d, seed=90 + batch, extra=0)

    def reference(pool, pages, offsets):
        rows = rows_from_key_value(geom, pool.format, key[:, :, 0], value[:, :, 0], pool.layout.row_dtype)
        store_rows(pool, pages, offsets, rows, check_finite=False)

    ok, twin = row_store_check(geom, fmt, batch, "cpu", 80 + batch, reference,
                               lambda pool, pages, offsets: gst.row_into_pool(geom, pool, key, value, pages, offsets),
                               page_size=4)
    assert ok  # the slots hold the rows, every other row is unchanged
    assert not twin, "red twin: the row stored one offset off"


# --- lab versions of the step's kernels -----------------------------------------------------------------------------
@inside
@pytest.mark.parametrize("batch", [1, 3])
def test_the_one_launch_sliding_prologue_is_the_two_launches(batch):
    from conftest import sliding_prologue_without_kv, two_launch_prologue

    ops = _ops()
    hq, hkv, d, window, slot = 4, 2, 64, 8, 3
    q, k, v, cos, sin = _prologue_inputs(batch, hq, hkv, d, seed=100 + batch)
    attn = attention_norms(d)

    def rings():
        return (torch.full((batch, hkv, window, d), float("nan"), dtype=BF16),
                torch.full((batch, hkv, window, d), float("nan"), dtype=BF16))

    want_k, want_v = rings()
    want_q = two_launch_prologue(attn, q, k, v, cos, sin, want_k, want_v, torch.tensor([slot]))
    got_k, got_v = rings()
    got_q = ops.sliding_prologue(attn, q, k, v, cos, sin, got_k, got_v, torch.tensor([slot]))
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k.nan_to_num(7.0), want_k.nan_to_num(7.0))  # the slot bitwise, the other slots unwritten
    assert torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0))
    assert not bool(got_k[:, :, slot].isnan().any())
    twin_k, _ = rings()  # red twin: the KV rows left out of the grid
    sliding_prologue_without_kv(attn, q, k, v, cos, sin, twin_k, rings()[1], torch.tensor([slot]))
    assert not torch.equal(twin_k.nan_to_num(7.0), want_k.nan_to_num(7.0))


@inside
def test_the_stream_read_kernel_reads_around_a_capped_buffer():
    """The read roof's Triton streaming sum (`lab.bench.roofs`) over more blocks than its buffer holds wraps around
    it, and its partials sum to what was read."""
    from foldkv.lab import bench
    from foldkv.lab.bench import roofs

    run = roofs.stream_read_kernel()
    bufs, n_blocks = bench.stream_read_buffers(10 * 8192 + 5, "cpu", 3, max_bytes=4 * 8192)
    part = torch.full((6,), float("nan"))
    run(bufs[0], part, n_blocks)
    assert roofs._sum_error(part, bufs[0], n_blocks) <= roofs.SUM_TOL
    run(bufs[0], part)  # red twin: one pass over the buffer is not what the check expects of the byte count
    assert roofs._sum_error(part, bufs[0], n_blocks) > roofs.SUM_TOL


@inside
@pytest.mark.parametrize("fmt", ["folded", "split"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_fused_global_query_is_the_norm_rope_then_the_query_kernel(batch, fmt):
    from foldkv import global_step as gst

    ops = _ops()
    geom = _geom()
    hq, hkv, d = geom.num_q_heads, geom.num_kv_heads, geom.head_dim
    x = _randn((batch, 1, (hq + hkv) * d), seed=110 + batch)  # a merged q|k output: q read in place
    q = x[..., : hq * d]
    cos, sin = _randn((batch, 1, d), seed=111), _randn((batch, 1, d), seed=112)
    attn = attention_norms(d)
    roped = ops.rope(ops.rms_norm(q.view(batch, 1, hq, d), attn.q_norm.weight, 1e-6), cos, sin)
    want = torch.full((batch, hq, d), float("nan"), dtype=BF16)
    gst.query_into(geom, fmt, roped.transpose(1, 2), attn.k_norm.weight, want)
    ok, twin = query_kernel_check(geom, fmt, batch, want, lambda out: gst.query_from_projection(
        geom, fmt, q, attn, cos, sin, out))
    assert ok
    assert not twin, "red twin: the rotated halves swapped"


@inside
@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("batch", [1, 3])
def test_the_fused_global_row_is_the_norms_rope_then_the_row_kernel(batch, fmt):
    from foldkv import global_step as gst

    ops = _ops()
    geom = _geom()
    hq, hkv, d = geom.num_q_heads, geom.num_kv_heads, geom.head_dim
    x = _randn((batch, 1, (hq + hkv) * d), seed=120 + batch)
    k = x[..., hq * d:]  # k_eq_v: the value is the key projection's output before its norm
    cos, sin = _randn((batch, 1, d), seed=121), _randn((batch, 1, d), seed=122)
    attn = attention_norms(d)
    key = ops.rope(ops.rms_norm(k.view(batch, 1, hkv, d), attn.k_norm.weight, 1e-6), cos, sin).transpose(1, 2)
    value = ops.rms_norm(k.view(batch, 1, hkv, d), None, 1e-6).transpose(1, 2)
    ok, twin = row_store_check(
        geom, fmt, batch, "cpu", 120 + batch,
        lambda pool, pages, offsets: gst.row_into_pool(geom, pool, key, value, pages, offsets),
        lambda pool, pages, offsets: gst.row_from_projection(geom, pool, k, k, attn, cos, sin, pages, offsets), page_size=4)
    assert ok
    assert not twin, "red twin: the row stored one offset off"


def _ring_inputs(batch: int, hq: int, hkv: int, d: int, w: int, seed: int):
    """The query and K on a grid (k/64 and k/8: every score's float32 sum over d is exact in any order, so the
    kernel's rounded scores are torch's bitwise), V random; each sequence's live slots a wrapping run that holds slot
    0 (a dropped chunk 0 then drops live slots), one sequence with a single live slot."""
    q = (_grid((batch, hq, 1, d), seed).float() / 8).to(BF16)
    k = _grid((batch, hkv, w, d), seed + 2)
    v = _randn((batch, hkv, w, d), seed + 4)
    slots = torch.arange(w)
    m = torch.stack([((slots + (5 * i + 3) % n) % w) < n for i, n in enumerate([1, w // 2, w - 7][:batch])])
    return q, k, v, m.view(batch, 1, 1, w)


@inside
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("scaling", [1.0, 0.125])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_one_launch_ring_attention_within_its_bound(batch, scaling, splits):
    """bench/versions/ring_attention_one_launch.py over a window of four chunks (the last of 8 slots) at 1, 2 and 4
    splits: every output element written (a NaN-poisoned output), within `ring_output_bound` of the float64 softmax
    (unrounded) and P.V over torch's rounded scores (exact on the grid here, so only the kernel's P rounding, at most
    ulp(p_j), and its float32 rescales, (2 chunks + 8) 2^-24 relative, are left); the counters zero after every call.
    Red twins: a chunk left out and the mask ignored fall outside the bound; a combine that leaves its counter up
    makes the next call's combine never run (its output stays poisoned)."""
    import numpy

    from conftest import bench_version, ring_output_bound, ring_reference

    one = bench_version("ring_attention_one_launch")
    hq, hkv, d, w = 8, 2, 64, 200
    q, k, v, m = _ring_inputs(batch, hq, hkv, d, w, seed=130 + batch)
    group = hq // hkv
    scores = (q.reshape(batch, hkv, group, d).float() @ k.float().transpose(-1, -2)).to(BF16)
    if scaling != 1.0:
        scores = (scores.float() * scaling).to(BF16)

    def attend(red=None):
        scratch = {}
        out = torch.full((batch, 1, hq, d), float("nan"), dtype=BF16)
        one.ring_attend(q, k, v, m, scaling, splits=splits, pdl=False, out=out, scratch=scratch, _red=red)
        return out.reshape(batch, hkv, group, d).double(), scratch

    got, scratch = attend()
    assert scratch["plan"]["splits"] == splits and not bool(scratch["counters"].any())
    assert not bool(got.isnan().any()), "an output element left unwritten"
    p, ref = ring_reference(scores, v, m, rounded=False)
    bound = ring_output_bound(p, v, ref, extra=(2 * scratch["plan"]["chunks"] + 8) * 2.0 ** -24)
    assert bool(((got - ref).abs() <= bound).all()), f"max excess {((got - ref).abs() - bound).max().item():.3g}"
    for red in ("drop_chunk", "no_mask"):
        with numpy.errstate(invalid="ignore"):  # a row with no live slot left: NaN (outside the bound too)
            twin, _ = attend(red)
        assert not bool(((twin - ref).abs() <= bound).all()), f"red twin {red} stayed within the bound"
    if splits > 1:
        _, left_up = attend("no_reset")
        assert bool(left_up["counters"].all()), "red twin: the counters went back to 0"
        again, _ = attend()
        left_up["counters"].zero_()
        assert bool(again.isnan().all()), "red twin: a combine ran with its counter left up"


@inside
@pytest.mark.parametrize("case", GREEDY_PICK_CASES)
@pytest.mark.parametrize("vocab", [1000, 4097, 262144])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_two_launch_greedy_pick_is_the_library_pick(case, vocab, batch):
    """bench/versions/greedy_pick_fused.py's two kernels against `hf_loop.pick_tokens` on the same logits and
    processors (conftest.greedy_pick_case): the same int64 ids, into a poisoned output; the case's red twin
    (conftest.GREEDY_PICK_RED) picks another."""
    from conftest import GREEDY_PICK_RED, bench_version, greedy_pick_case
    from foldkv import hf_loop

    pick = bench_version("greedy_pick_fused")
    kw = greedy_pick_case(case, batch, vocab, seed=vocab + batch)
    want = hf_loop.pick_tokens(**kw)
    eos = pick.masked_eos(kw["input_ids"], kw["logits_processor"])
    assert eos == ((2, vocab - 3) if case == "eos_below_min" else ())

    def fused(red=None):
        out = torch.full((batch,), -(1 << 40), dtype=torch.long)
        pick.fused_pick(kw["logits"], pick.eos_table(eos, "cpu"), len(eos), kw["unfinished"], kw["pad_token_id"],
                        red=red, out=out)
        return out

    assert torch.equal(fused(), want), f"{fused().tolist()} where the library picks {want.tolist()}"
    if case in GREEDY_PICK_RED:
        assert not torch.equal(fused(GREEDY_PICK_RED[case]), want), f"red twin {GREEDY_PICK_RED[case]} picked the same"


@inside
def test_generate_with_the_two_launch_greedy_pick(tmp_path):
    """generate() on the tiny synthetic Gemma 4 (float32, a left-padded batch of 3, a static FoldKvCache: the thin
    loop) with bench/versions/greedy_pick_fused.py picking every token in the interpreter: the library's sequences
    for greedy with min_new_tokens, with EOS ids from the free run (one sequence finishing: the padding), and with an
    EOS the free run picked masked by min_new_tokens; the red twin that never masks EOS changes them."""
    import foldkv.hf  # noqa: F401
    from conftest import TINY_SYNTHETIC, bench_version, left_padded_batch
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword, load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    pick = bench_version("greedy_pick_fused")
    lengths, new = (5, 17, 11), 12
    ckpt = make_synthetic_checkpoint(tmp_path, seed=3, sliding_window=8, **TINY_SYNTHETIC)
    model = load_model(ckpt, dtype=torch.float32, attn_implementation="foldkv")
    ids, mask = left_padded_batch(lengths, TINY_SYNTHETIC["vocab_size"])

    def generate(**kw):
        cache = FoldKvCache(model, max_batch=4, max_tokens=max(lengths) + new, scatter_seed=5, decode_step="static")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             **{cache_keyword(model): cache}, **kw)
        return out[:, ids.shape[1]:]

    free = generate(min_new_tokens=new)
    calls = {"greedy": dict(min_new_tokens=new),
             "one_finishes": dict(eos_token_id=[int(free[0, 3])], pad_token_id=0),
             "eos_masked": dict(eos_token_id=[int(free[0, 2])], min_new_tokens=6, pad_token_id=0)}
    for name, kw in calls.items():
        want = generate(**kw)
        with pick.installed(interpreted=True) as took:
            got = generate(**kw)
        assert took["tokens"] == want.shape[1] and not took["refusals"], (name, dict(took))
        assert torch.equal(got, want), f"{name}: {got.tolist()} where the library's pick gives {want.tolist()}"
    assert (generate(**calls["one_finishes"])[0] == 0).any()  # sequence 0 padded after its EOS
    with pick.installed(red="no_eos_mask", interpreted=True):
        twin = generate(**calls["eos_masked"])
    assert not torch.equal(twin, generate(**calls["eos_masked"])), "a pick that never masks EOS changed nothing"
