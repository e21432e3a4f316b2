"""Launch AOT cubins through the CUDA driver API (cuda-python, imported on first load; never TileLang): `AotBuild`, a
verified build folder, and `AotKernel`, a manifest entry callable like the JIT kernel of its variant (the same
arguments, checked as TileLang's host code checks them, launched on torch's current stream); `check_build_matches`
refuses a build made for another geometry, arch, format or page size (no GPU needed)."""

from __future__ import annotations

import ast
import ctypes
import operator
import os
import threading
from typing import Any, Sequence

from ..config import AttentionGeometry
from ..kernels.registry import note_kernel
from ..layout import KvFormat
from ..validate import FoldKvInputError
from .verify import AotVerifyError, geometry_record, sha256_bytes, verify


class AotMismatchError(FoldKvInputError):
    """The AOT build was made for another geometry, arch, format or page size than the pool/device it is used with."""


class AotLaunchError(RuntimeError):
    """A CUDA driver call failed while loading or launching an AOT kernel."""


# --- checks that need no GPU ---------------------------------------------------------------------------------------
def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether a cubin for `arch` ('sm_90a', 'sm_90') runs on a device of compute capability `capability`: an
    arch-specific one on exactly that capability, plain SASS on the same major and a minor >= built."""
    tok = arch.removeprefix("sm_")
    specific = tok.endswith("a") or tok.endswith("f")
    digits = tok.rstrip("af")
    if not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"arch {arch!r} is not an SM token")
    major, minor = int(digits[:-1]), int(digits[-1])
    if specific:
        return tuple(capability) == (major, minor)
    return capability[0] == major and capability[1] >= minor


def check_build_matches(
    manifest: dict,
    *,
    geometry: AttentionGeometry | None = None,
    fmt: KvFormat | str | None = None,
    capability: tuple[int, int] | None = None,
    page_size: int | None = None,
    kernel: str | None = None,
) -> None:
    """Raise AotMismatchError unless the build was made for this geometry, format, device capability and page size
    (each checked only when given; `kernel` narrows the format/page-size checks to one variant)."""
    problems = []
    if geometry is not None:
        want = geometry_record(geometry)
        have = manifest.get("geometry") or {}
        diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        extra = sorted(set(have) - set(want))
        if diff or extra:
            problems.append("geometry differs: " + ", ".join(f"{k} built {b!r}, pool {p!r}" for k, (b, p) in diff.items())
                            + (f"; build has unknown fields {extra}" if extra else ""))
    entries = manifest.get("kernels", [])
    if kernel is not None:
        entries = [k for k in entries if k.get("name") == kernel]
        if not entries:
            problems.append(f"the build has no kernel {kernel!r} (it has {[k.get('name') for k in manifest.get('kernels', [])]})")
    if fmt is not None:
        fmt = KvFormat.parse(fmt).value
        if fmt not in (manifest.get("formats") or []):
            problems.append(f"format {fmt!r} not built (the build has {manifest.get('formats')})")
        problems += [f"kernel {k['name']} is for format {k.get('format')!r}, the pool is {fmt!r}" for k in entries
                     if kernel is not None and k.get("format") not in (None, fmt)]
    if capability is not None:
        arch = manifest.get("arch", "")
        try:
            ok = arch_runs_on(arch, capability)
        except ValueError as exc:
            ok, arch = False, f"{arch} ({exc})"
        if not ok:
            problems.append(f"build is for {arch}, the device is sm_{capability[0]}{capability[1]}")
    if page_size is not None:
        for k in entries:
            ps = (k.get("variant_params") or {}).get("page_size")
            if ps is not None and int(ps) != int(page_size):
                problems.append(f"kernel {k['name']} was built for page size {ps}, the pool has {page_size}")
    if problems:
        raise AotMismatchError("AOT build does not match: " + "; ".join(problems))


# --- launch-size expressions ----------------------------------------------------------------------------------------
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
           ast.NotEq: operator.ne}


def eval_size(expr: str | int, env: dict[str, int]) -> int:
    """Evaluate a manifest size expression (integers, names of dynamic symbols / scalar args, + - * // %, min, max,
    comparisons, and/or). Anything else is refused: a manifest is data, never code."""
    if isinstance(expr, int):
        return expr

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, bool)):
            return int(n.value)
        if isinstance(n, ast.Name):
            if n.id not in env:
                raise AotVerifyError(f"size expression {expr!r} uses {n.id!r}, which is not a bound symbol")
            return env[n.id]
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("min", "max") and not n.keywords:
            return (min if n.func.id == "min" else max)(*(ev(a) for a in n.args))
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _CMPOPS:
            return int(_CMPOPS[type(n.ops[0])](ev(n.left), ev(n.comparators[0])))
        if isinstance(n, ast.BoolOp):
            vals = [ev(v) for v in n.values]
            return int(all(vals) if isinstance(n.op, ast.And) else any(vals))
        raise AotVerifyError(f"size expression {expr!r} has an unsupported element {ast.dump(n)[:60]}")

    try:
        tree = ast.parse(str(expr), mode="eval")
    except SyntaxError as exc:
        raise AotVerifyError(f"size expression {expr!r} does not parse: {exc}") from None
    return int(ev(tree.body))


# --- cuda-python ---------------------------------------------------------------------------------------------------
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # the aot extra pins cuda-bindings>=12.6, which has this layout
        raise ImportError("the AOT loader needs cuda-python's driver bindings: pip install 'foldkv[aot]'"
                          " (cuda-bindings)") from exc
    return driver


def _ok(result, what: str):
    """Unpack a cuda-python (CUresult, *values) tuple, raising AotLaunchError on an error code."""
    drv = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        try:
            name = drv.cuGetErrorName(err)[1]
            name = name.decode() if isinstance(name, bytes) else name
        except Exception:  # the name is a nicety; the code is in the message anyway
            name = "?"
        raise AotLaunchError(f"{what} failed: {name} ({err})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "float64": "float64",
                 "int8": "int8", "uint8": "uint8", "int16": "int16", "int32": "int32", "int64": "int64", "bool": "bool",
                 "float8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}  # TileLang's e4m3 is torch's e4m3fn
_CTYPES = {"int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64,
           "int16": ctypes.c_int16, "uint16": ctypes.c_uint16, "int8": ctypes.c_int8, "uint8": ctypes.c_uint8,
           "float32": ctypes.c_float, "float64": ctypes.c_double, "bool": ctypes.c_bool}


def _torch_dtype(name: str):
    import torch

    if name not in _TORCH_DTYPES:
        raise AotVerifyError(f"tensor dtype {name!r} has no torch equivalent here")
    return getattr(torch, _TORCH_DTYPES[name])


class _DeviceModule:
    """One cubin loaded into one device's primary context, with its functions (`smem`: each kernel symbol's dynamic
    shared memory bytes)."""

    def __init__(self, cubin: bytes, smem: dict[str, int], device_index: int):
        drv = _driver()
        _ok(drv.cuInit(0), "cuInit")
        dev = _ok(drv.cuDeviceGet(device_index), "cuDeviceGet")
        # torch's runtime API works in the device's primary context; load into that same context.
        self.context = _ok(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._make_current()
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # kept alive with the module
        self.module = _ok(drv.cuModuleLoadData(ctypes.addressof(self._image)), "cuModuleLoadData")
        self.functions = {}
        for sym, size in smem.items():
            fn = _ok(drv.cuModuleGetFunction(self.module, sym.encode()), f"cuModuleGetFunction({sym})")
            if size > 48 * 1024:  # above the default 48 KiB a kernel must opt in
                _ok(drv.cuFuncSetAttribute(fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           size), f"cuFuncSetAttribute({sym}, max dynamic smem {size})")
            self.functions[sym] = fn

    def _make_current(self) -> None:
        drv = _driver()
        cur = _ok(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur is None or int(cur) != int(self.context):
            _ok(drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")


class AotKernel:
    """One manifest entry made callable: `kernel(*args)` like the JIT kernel (returns the outputs it allocates when
    the variant has callee-allocated outputs, else None)."""

    def __init__(self, build: "AotBuild", entry: dict):
        self.build = build
        self.entry = entry
        self.name = entry["name"]
        self.params = entry["params"]
        self.out_idx = list(entry.get("out_idx") or [])
        self.in_params = [i for i in range(len(self.params)) if i not in self.out_idx]
        self._modules: dict[int, _DeviceModule] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AotKernel({self.name}, {[p['name'] for p in self.params]})"

    # binding ------------------------------------------------------------------------------------------------------
    def bind(self, args: Sequence[Any]) -> tuple[dict[str, Any], dict[str, int], Any]:
        """Check the call's arguments and bind the dynamic symbols: (values by param name, size env, device)."""
        import torch

        if len(args) != len(self.in_params):
            names = [self.params[i]["name"] for i in self.in_params]
            raise FoldKvInputError(f"{self.name} takes {len(self.in_params)} arguments {names}, got {len(args)}")
        values: dict[str, Any] = {}
        env: dict[str, int] = {}
        tensors = []  # (param, argument) of every tensor argument
        for i, a in zip(self.in_params, args):
            p = self.params[i]
            if p["kind"] == "scalar":
                if isinstance(a, torch.Tensor) or not isinstance(a, (int, float, bool)):
                    raise FoldKvInputError(f"{self.name}: argument {p['name']} must be a Python {p['dtype']} scalar")
                values[p["name"]] = a
                if p["dtype"].startswith(("int", "uint")):
                    env[p["name"]] = int(a)
                continue
            if not isinstance(a, torch.Tensor):
                raise FoldKvInputError(f"{self.name}: argument {p['name']} must be a torch.Tensor")
            if a.dtype != _torch_dtype(p["dtype"]):
                raise FoldKvInputError(f"{self.name}: {p['name']} has dtype {a.dtype}, expected {p['dtype']}")
            if a.dim() != len(p["shape"]):
                raise FoldKvInputError(f"{self.name}: {p['name']} has {a.dim()} dims, expected {len(p['shape'])}")
            if not p.get("strides") and not a.is_contiguous():
                raise FoldKvInputError(f"{self.name}: {p['name']} must be contiguous")
            values[p["name"]] = a
            tensors.append((p, a))
        device = tensors[0][1].device if tensors else None
        for p, a in tensors:  # devices last, so every other refusal can be tested without a GPU
            if a.device.type != "cuda":
                raise FoldKvInputError(f"{self.name}: {p['name']} is on {a.device}, expected a CUDA device")
            if a.device != device:
                raise FoldKvInputError(f"{self.name}: {p['name']} is on {a.device}, the other tensors on {device}")
        for sym in self.entry.get("dynamic_symbols", []):
            p = self.params[sym["param"]]
            if sym["param"] in self.out_idx:
                raise AotVerifyError(f"{self.name}: dynamic symbol {sym['name']} is bound only by an output")
            t = values[p["name"]]
            env[sym["name"]] = int(t.shape[sym["dim"]]) if "dim" in sym else int(t.stride(sym["stride"]))
        for p, t in tensors:  # every dimension must agree with the declared shape under the bound symbols
            want = [eval_size(s, env) for s in p["shape"]]
            if list(t.shape) != want:
                raise FoldKvInputError(f"{self.name}: {p['name']} has shape {list(t.shape)}, expected {want}"
                                       f" ({p['shape']} with {env})")
            if p.get("strides"):  # like TileLang's host check: a stride matters only where the size is not 1
                strides = [eval_size(s, env) for s in p["strides"]]
                bad = [d for d, (n, st) in enumerate(zip(want, strides)) if n != 1 and t.stride(d) != st]
                if bad:
                    raise FoldKvInputError(f"{self.name}: {p['name']} has strides {list(t.stride())}, the kernel"
                                           f" was built for {strides} (make it contiguous)")
        return values, env, device

    # launching ----------------------------------------------------------------------------------------------------
    def _module(self, device_index: int) -> _DeviceModule:
        mod = self._modules.get(device_index)
        if mod is None:
            with self._lock:
                mod = self._modules.get(device_index)
                if mod is None:
                    smem = {ln["symbol"]: int(ln["dynamic_smem_bytes"]) for ln in self.entry["launches"]}
                    mod = _DeviceModule(self.build.cubin_bytes(self.entry), smem, device_index)
                    self._modules[device_index] = mod
        return mod

    def _tensor_map(self, tm: dict, values: dict, env: dict):
        drv = _driver()
        t = values[tm["param"]]
        rank = int(tm["rank"])
        return _ok(drv.cuTensorMapEncodeTiled(
            drv.CUtensorMapDataType(tm["dtype"]), rank, t.data_ptr(),
            [drv.cuuint64_t(eval_size(x, env)) for x in tm["global_dim"]],
            [drv.cuuint64_t(eval_size(x, env)) for x in tm["global_stride"]][1:],  # driver takes rank-1 byte strides
            [drv.cuuint32_t(eval_size(x, env)) for x in tm["box_dim"]],
            [drv.cuuint32_t(eval_size(x, env)) for x in tm["element_strides"]],
            drv.CUtensorMapInterleave(tm["interleave"]), drv.CUtensorMapSwizzle(tm["swizzle"]),
            drv.CUtensorMapL2promotion(tm["l2_promotion"]), drv.CUtensorMapFloatOOBfill(tm["oob_fill"]),
        ), f"cuTensorMapEncodeTiled({tm['name']})")

    def __call__(self, *args):
        import torch

        values, env, device = self.bind(args)
        if device is None:
            raise FoldKvInputError(f"{self.name}: no tensor argument gives the device")
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._modules:
            check_build_matches(self.build.manifest, capability=torch.cuda.get_device_capability(idx))
        outs = []
        for i in self.out_idx:
            p = self.params[i]
            t = torch.empty([eval_size(s, env) for s in p["shape"]], dtype=_torch_dtype(p["dtype"]), device=device)
            values[p["name"]] = t
            outs.append(t)
        self.launch(values, env, idx, torch.cuda.current_stream(device).cuda_stream)
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else outs

    def launch(self, values: dict[str, Any], env: dict[str, int], device_index: int, stream_handle: int) -> None:
        """Load the cubin into the device's context (first time), encode the TMA maps, launch every device kernel in
        order on `stream_handle` (`values`/`env` from `bind`)."""
        mod = self._module(device_index)
        drv = _driver()
        maps = {tm["name"]: self._tensor_map(tm, values, env) for tm in self.entry.get("tensor_maps", [])}
        stream = drv.CUstream(stream_handle)
        mod._make_current()
        for ln in self.entry["launches"]:
            grid = [eval_size(x, env) for x in ln["grid"]]
            block = [eval_size(x, env) for x in ln["block"]]
            if min(grid) <= 0:
                continue  # an empty grid has no work (TileLang's launcher would fail it on the driver)
            vals, types = [], []
            for a in ln["args"]:
                if a["kind"] == "pointer":
                    vals.append(values[a["param"]].data_ptr())
                    types.append(ctypes.c_void_p)
                elif a["kind"] == "scalar":
                    v = values.get(a["name"], env.get(a["name"]))
                    vals.append(v)
                    types.append(_CTYPES[a["dtype"]])
                elif a["kind"] == "tensor_map":
                    vals.append(maps[a["name"]])
                    types.append(None)  # a cuda-python object: passed by its address
                else:
                    raise AotVerifyError(f"{self.name}: unknown kernel argument kind {a['kind']!r}")
            fn = mod.functions[ln["symbol"]]
            smem = int(ln["dynamic_smem_bytes"])
            _ok(drv.cuLaunchKernel(fn, *grid, *block, smem, stream, (tuple(vals), tuple(types)), 0),
                f"cuLaunchKernel({ln['symbol']})")  # no cluster, no PDL: verify refuses a launch that needs them


class AotBuild:
    """A verified AOT build folder (hashes checked when opened) and its kernels."""

    def __init__(self, build_dir: str | os.PathLike):
        self.dir = os.fspath(build_dir)
        self.manifest = verify(self.dir)
        self._entries = {k["name"]: k for k in self.manifest["kernels"]}
        self._kernels: dict[str, AotKernel] = {}

    def __repr__(self) -> str:
        return f"AotBuild({self.dir!r}, {self.manifest['arch']}, formats {self.manifest['formats']}, {len(self._entries)} kernels)"

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def cubin_bytes(self, entry: dict) -> bytes:
        path = os.path.join(self.dir, entry["cubin"])
        with open(path, "rb") as fh:
            data = fh.read()
        if sha256_bytes(data) != entry["cubin_sha256"]:  # changed since the build was opened
            raise AotVerifyError(f"{path} changed after the build was verified; refusing to load it")
        return data

    def kernel(self, name: str, *, geometry: AttentionGeometry | None = None, fmt: KvFormat | str | None = None,
               page_size: int | None = None) -> AotKernel:
        """The AOT kernel of variant `name`, after checking the build against the caller's geometry/format/page size."""
        if name not in self._entries:
            raise AotMismatchError(f"the AOT build in {self.dir} has no kernel {name!r}; it has {self.names}")
        check_build_matches(self.manifest, geometry=geometry, fmt=fmt, page_size=page_size, kernel=name)
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = AotKernel(self, self._entries[name])
            entry, built_from = self._entries[name], self.manifest.get("provenance") or {}
            note_kernel(name, "aot", entry["source_sha256"], cubin_sha256=entry["cubin_sha256"],
                        aot_dir=os.path.abspath(self.dir), built_from_commit=built_from.get("git_commit"),
                        built_from_dirty=built_from.get("dirty"))
        return k


# --- the active build, for the launchers' backend="aot" --------------------------------------------------------------
_ACTIVE: dict[str, AotBuild] = {}
AOT_DIR_ENV = "FOLDKV_AOT_DIR"


def use_build(build_dir: str | os.PathLike | None) -> AotBuild | None:
    """Make `build_dir` the build that backend="aot" launchers use (None: forget it, fall back to $FOLDKV_AOT_DIR)."""
    _ACTIVE.clear()
    if build_dir is None:
        return None
    _ACTIVE["build"] = AotBuild(build_dir)
    return _ACTIVE["build"]


def active_build() -> AotBuild:
    b = _ACTIVE.get("build")
    if b is None:
        path = os.environ.get(AOT_DIR_ENV)
        if not path:
            raise FoldKvInputError(
                f"backend='aot' needs an AOT build: call foldkv.aot.use_build(DIR) or set {AOT_DIR_ENV}"
                " (make one with `python -m foldkv aot build --arch sm_90a --out DIR`)"
            )
        b = _ACTIVE["build"] = AotBuild(path)
    return b


def aot_kernel(name: str, geometry: AttentionGeometry | None = None, fmt: KvFormat | str | None = None,
               page_size: int | None = None) -> AotKernel:
    """What a launcher calls for backend="aot": the variant's AOT kernel from the active build, checked against the
    geometry / format / page size it is about to be used with."""
    return active_build().kernel(name, geometry=geometry, fmt=fmt, page_size=page_size)
