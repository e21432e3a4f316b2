"""AOT build: every registered kernel variant -> its emitted CUDA source, the cubin nvcc compiles from it with the
JIT's flags, and one manifest.json saying how to launch each cubin without TileLang.

While the build runs, TileLang's nvcc is the build's (`device_compiles_through_aot`), so the same bytes are the JIT
kernel's cubin and the AOT file; tests/test_aot_cpu.py holds `nvcc_command` to TileLang's own (0.1.15,
`tilelang.contrib.nvcc.compile_cuda`). The launch (grid, block, shared memory, argument order, TMA descriptors) is read
from the kernel's IR by TileLang's NVRTC-wrapper parser (`extract`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterable

from ..config import AttentionGeometry, resolve_geometry
from ..kernels import registry
from ..kernels.registry import KernelVariant, json_value
from ..kernels.tl import require_tilelang
from ..provenance import checkout_state

from .verify import (MANIFEST_NAME, MANIFEST_VERSION, geometry_record, manifest_problems, merge_barrier_problems,
                     sha256_bytes)

# --- pass configs -> nvcc flags ------------------------------------------------------------------------------------
# Mapped to nvcc options by TileLang's device-compile callback (cuda/backend.py).
FLAG_PASS_CONFIGS = ("tl.enable_fast_math", "tl.ptxas_register_usage_level", "tl.device_compile_flags")
# Read only by lowering / code generation passes: their effect is in the emitted source. Listed by hand (not taken
# from the enum) so that a key a future TileLang adds is refused until someone checks where it acts.
LOWERING_ONLY_PASS_CONFIGS = frozenset("""
    tl.Simplify transitively_prove_inequalities convert_boolean_to_and_of_ors apply_constraints_to_boolean_branches
    propagate_knowns_to_prove_conditional propagate_knowns_to_simplify_expressions enable_simplify_let_inline
    tl.disable_buffer_init_check tl.disable_data_race_check tl.disable_prelower_semantic_check
    tl.disable_warp_specialized tl.enable_auto_schedule tl.enable_auto_warp_specialization tl.emit_line_directives
    tl.config_index_bitwidth tl.enable_reducer_plan_verbose tl.layout_cost_model tl.reducer_force_baseline
    tl.disable_tma_lower tl.disable_safe_memory_legalize tl.disable_vectorize_256 tl.enable_fp32x2_reduction
    tl.enable_async_copy tl.enable_lower_ldgstg tl.enable_lower_ldgstg_predicated
    tl.enable_vectorize_planner_verbose tl.disable_wgmma tl.debug_merge_shared_memory_allocations
    tl.enable_aggressive_shared_memory_merge tl.disable_shared_memory_reuse tl.disable_shuffle_elect
    tl.disable_loop_unswitching tl.loop_unswitching_allow_non_trivial_else
    tl.if_stmt_binding_inline_replayable_binds tl.disable_thread_storage_sync tl.force_let_inline
    tl.ast_print_enable tl.layout_visualization_enable tl.layout_visualization_formats
    tl.storage_rewrite_detect_inplace tir.enable_equiv_terms_in_cse_tir tirx.disable_cse_tir tirx.Simplify
    tirx.disable_storage_rewrite tirx.disable_vectorize tirx.use_async_copy tirx.enable_debug tirx.merge_static_smem
    tirx.noalias tl.disable_out_of_bound_warning tl.enable_dump_ir tl.dump_ir_path tl.pass_profile
    tl.pass_profile_threshold_ms
""".split())
# Refused on purpose: a custom lowering pass is Python we cannot record; kernels_output_dir changes where nvcc reads
# the source (so the -lineinfo file name), which we do not reproduce.
REFUSED_PASS_CONFIGS = {
    "tirx.add_lower_pass": "a custom lowering pass cannot be recorded in a manifest",
    "cuda.kernels_output_dir": "it changes nvcc's source path (and so the line info) in a way the AOT build does not copy",
}


class AotBuildError(RuntimeError):
    """The AOT build cannot reproduce the JIT exactly (or a kernel fails a check); nothing is written for it."""


class NvccUnavailable(AotBuildError):
    """TileLang finds no nvcc: the build cannot run here (a reason to skip, not a failure of the kernels)."""


def classify_pass_configs(pass_configs: dict) -> tuple[dict, dict]:
    """Split pass configs into (flag configs, lowering-only configs); raise AotBuildError on any other key."""
    flags, lowering = {}, {}
    for key, value in pass_configs.items():
        key = getattr(key, "value", key)
        if key in FLAG_PASS_CONFIGS:
            flags[key] = value
        elif key in LOWERING_ONLY_PASS_CONFIGS:
            lowering[key] = value
        elif key in REFUSED_PASS_CONFIGS:
            raise AotBuildError(f"pass config {key!r} is not supported by the AOT build: {REFUSED_PASS_CONFIGS[key]}")
        else:
            raise AotBuildError(
                f"pass config {key!r} has no known nvcc mapping: the AOT build cannot prove it compiles what the JIT"
                " compiles (add it to FLAG_PASS_CONFIGS with its flag, or to LOWERING_ONLY_PASS_CONFIGS after checking"
                " that only lowering passes read it)"
            )
    return flags, lowering


def _device_compile_flag_tokens(value: Any) -> list[str]:
    """TL_DEVICE_COMPILE_FLAGS as TileLang splits it (each string shlex-split)."""
    flags = [value] if isinstance(value, str) else value or []
    return [t for flag in flags for t in (shlex.split(flag) if isinstance(flag, str) else [str(flag)])]


def nvcc_options(pass_configs: dict, *, template_dir: str, cutlass_dir: str) -> list[str]:
    """The options TileLang's device-compile callback passes to nvcc after `--cubin -O3 -lineinfo -arch=...`."""
    flags, _ = classify_pass_configs(pass_configs)
    options = ["-std=c++20", "-I" + template_dir, "-I" + cutlass_dir]
    options += _device_compile_flag_tokens(flags.get("tl.device_compile_flags"))
    if bool(flags.get("tl.enable_fast_math", False)):
        options.append("--use_fast_math")
    level = flags.get("tl.ptxas_register_usage_level")
    if level is not None:
        options.append(f"--ptxas-options=--register-usage-level={int(level)}")
    return options


SM_ARCH = r"sm_[0-9]+[a-z]?"  # an nvcc -arch token such as sm_90a


def nvcc_command(nvcc: str, ccbin: str, arch: str, options: list[str], src: str, out: str) -> list[str]:
    """The full command, in the order `tilelang.contrib.nvcc.compile_cuda` builds it (cubin, single arch)."""
    if not re.fullmatch(SM_ARCH, arch):
        raise AotBuildError(f"arch {arch!r} is not an SM token such as 'sm_90a'")
    return [nvcc, f"-ccbin={ccbin}", "--cubin", "-O3", "-lineinfo", f"-arch={arch}", *options, "-o", out, src]


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release [0-9.]+, V([0-9.]+)", out)
    if not m:
        raise AotBuildError(f"cannot read the nvcc version from {out!r}")
    return m.group(1)


# --- extraction from one JIT kernel --------------------------------------------------------------------------------
def _pyexpr(expr) -> str:
    from tilelang.jit.adapter.utils import pythonic_expr

    return pythonic_expr(expr, None, ignore_cast=True, floor_div_op="//")


def extract(jit_kernel) -> tuple[str, dict, dict]:
    """A compiled TileLang JIT kernel's source, its pass configs, and the manifest fields that say how to launch it
    (params, dynamic_symbols, out_idx, launches, tensor_maps)."""
    require_tilelang()
    from tilelang import tvm
    from tilelang.engine.lower import lower_with_context
    from tilelang.jit.abi import prepare_tvm_ffi_callee_allocated_outputs
    from tilelang.jit.adapter.nvrtc.wrapper import TLNVRTCSourceWrapper
    from tilelang.jit.adapter.utils import match_declare_kernel, parse_function_call_args, parse_tma_descriptor_args

    if getattr(jit_kernel, "execution_backend", None) != "tvm_ffi":
        raise AotBuildError(
            f"kernel was built with execution backend {getattr(jit_kernel, 'execution_backend', None)!r}; the AOT build"
            " reproduces the default tvm_ffi backend's nvcc compile only"
        )
    jit_source = jit_kernel.get_kernel_source()
    pass_configs = dict(jit_kernel.pass_configs or {})
    if jit_kernel.compile_flags:  # JITKernel folds compile_flags into TL_DEVICE_COMPILE_FLAGS the same way
        cur = pass_configs.get("tl.device_compile_flags")
        cur = [] if cur is None else [cur] if isinstance(cur, str) else list(cur)
        pass_configs["tl.device_compile_flags"] = [*cur, *jit_kernel.compile_flags]
    classify_pass_configs(pass_configs)

    out_idx = list(getattr(jit_kernel.adapter, "result_idx", None) or [])
    func, _ = prepare_tvm_ffi_callee_allocated_outputs(
        jit_kernel.prim_func, out_idx or None,
        supports_callee_allocated_outputs=jit_kernel.execution_backend_spec.supports_callee_allocated_outputs,
    )
    # Host IR (TMA descriptor arguments, which host values feed which kernel parameter) comes from a re-lowering.
    with tvm.transform.PassContext(opt_level=3, config=pass_configs), jit_kernel.target:
        art = lower_with_context(func, jit_kernel.backend_context)
    # Device IR: the JIT's own when it was compiled in this process (it is what produced jit_source). Lowering is not
    # deterministic across processes (e.g. which of two reduction workspaces gets which name), so a kernel TileLang
    # loaded from its disk cache is accepted only if the re-lowering reproduces its source byte for byte.
    jit_artifact = getattr(jit_kernel, "artifact", None)
    if jit_artifact is not None and jit_artifact.device_mod is not None:
        device_mod = jit_artifact.device_mod
        _check_same_launch(device_mod, art.device_mod)
    elif art.kernel_source == jit_source:
        device_mod = art.device_mod
    else:
        raise AotBuildError(
            "the JIT kernel came from TileLang's cache and re-lowering it gives a different source; build the kernel"
            " fresh (the AOT build disables TileLang's cache while it builds)"
        )

    captured: dict = {}

    class _Capture(TLNVRTCSourceWrapper):
        def create_dispatch_func(self, code, function_informations):
            captured["infos"] = function_informations
            return super().create_dispatch_func(code, function_informations)

        def generate_tma_descriptor_args(self, desc_name_map, desc_name_var_map):
            if self.tma_descriptor_args:
                captured["tma"] = parse_tma_descriptor_args(
                    self.tma_descriptor_args, desc_name_map, desc_name_var_map, self._pythonic_expr)
                captured["desc_names"] = dict(desc_name_map)
            return super().generate_tma_descriptor_args(desc_name_map, desc_name_var_map)

    mod = tvm.IRModule({func.attrs["global_symbol"]: func})
    w = _Capture(mod, jit_source, jit_kernel.target, device_mod, art.host_mod, pass_configs)
    if any((w.l2_persistent_map or {}).values()):
        raise AotBuildError("kernel uses an L2 persistent access window; the AOT loader does not set one up")

    prim = w.prim_func
    # JIT-level parameters, in call order.
    params = []
    seen_dyn: dict[str, dict] = {}
    for i, p in enumerate(prim.params):
        if p in prim.buffer_map:
            b = prim.buffer_map[p]
            shape = [int(s) if isinstance(s, tvm.tirx.IntImm) else _pyexpr(s) for s in b.shape]
            strides = [int(s) if isinstance(s, tvm.tirx.IntImm) else _pyexpr(s) for s in b.strides]
            params.append({"name": b.name, "data": b.data.name, "kind": "tensor", "dtype": str(b.dtype),
                           "shape": shape, "strides": strides})
            for axis, sizes in (("dim", b.shape), ("stride", b.strides)):  # a symbol is bound by its first size
                for d, s in enumerate(sizes):
                    if isinstance(s, tvm.tirx.Var) and s.name not in seen_dyn:
                        seen_dyn[s.name] = {"name": s.name, "dtype": str(s.dtype), "param": i, axis: d}
        else:
            params.append({"name": p.name, "kind": "scalar", "dtype": str(p.dtype)})
    dyn = list(seen_dyn.values())
    for sym, dtype in w.get_dynamic_symbolic_set(prim):
        if sym not in seen_dyn:
            raise AotBuildError(f"dynamic symbol {sym} is not bound by any tensor shape")

    data_to_param = {p["data"]: p["name"] for p in params if p["kind"] == "tensor"}
    scalar_names = {p["name"] for p in params if p["kind"] == "scalar"} | set(seen_dyn)
    desc_names = captured.get("desc_names", {})

    infos = captured.get("infos") or {}
    if not infos:
        raise AotBuildError("no device kernel launch found in the host IR")
    # Argument order and kinds come from the kernel's C declaration, as TileLang's own launchers read them.
    fargs = [{"name": p["data"] if p["kind"] == "tensor" else p["name"],
              "type": "ptr" if p["kind"] == "tensor" else p["dtype"]} for p in params]
    fargs += [{"name": d["name"], "type": d["dtype"]} for d in dyn if d["name"] not in {a["name"] for a in fargs}]
    launches = []
    for fname in w.function_names:
        if fname not in infos:
            continue
        info = infos[fname]
        if w.use_cooperative_groups.get(fname):
            raise AotBuildError(f"{fname} uses a cooperative launch; the AOT loader does not do those")
        n_kparams = len(device_mod[fname].params)
        declaration = jit_source[match_declare_kernel(jit_source, fname + "("):].split(";")[0]
        call = parse_function_call_args(declaration, fargs, info["function_params"], dict(desc_names), {},
                                        lambda n, t: (n, t))
        args = []
        for name, typ in call:
            if typ == "ptr":
                args.append({"kind": "pointer", "param": data_to_param[name]})
            elif typ == "None":
                args.append({"kind": "tensor_map", "name": name})
            elif name in scalar_names:
                args.append({"kind": "scalar", "name": name, "dtype": typ})
            else:
                raise AotBuildError(f"{fname}: kernel argument {name!r} is neither a tensor, a scalar nor a TMA map")
        if len(args) != n_kparams:
            raise AotBuildError(f"{fname}: parsed {len(args)} arguments for {n_kparams} kernel parameters")
        smem = info["dynamic_smem_buf"]
        launches.append({
            "symbol": fname,
            "grid": [_pyexpr(x) for x in info["grid_info"]],
            "block": [_pyexpr(x) for x in info["block_info"]],
            "dynamic_smem_bytes": 0 if smem is None else int(smem),
            "cluster_dims": w.cluster_dims.get(fname),
            "pdl": fname in (w.pdl_sync_map or {}),
            "args": args,
        })

    tensor_maps = []
    for t in captured.get("tma", []) or []:
        if t.is_img2col:
            raise AotBuildError(f"TMA descriptor {t.handle_name} is im2col; the AOT loader encodes tiled maps only")
        addr = t.global_address
        if addr not in data_to_param:
            raise AotBuildError(f"TMA descriptor {t.handle_name} addresses {addr!r}, not a tensor parameter")
        tensor_maps.append({
            "name": t.handle_name, "param": data_to_param[addr], "dtype": int(t.dtype), "rank": t.tensor_rank,
            "global_dim": t.global_dim, "global_stride": t.global_stride, "box_dim": t.box_dim,
            "element_strides": t.element_strides, "interleave": int(t.interleave), "swizzle": int(t.swizzle),
            "l2_promotion": int(t.l2_promotion), "oob_fill": int(t.oob_fill),
        })
    return jit_source, pass_configs, {"params": params, "dynamic_symbols": dyn, "out_idx": out_idx,
                                      "launches": launches, "tensor_maps": tensor_maps}


def _launch_record(device_mod) -> dict:
    """Per device function: thread extents, dynamic shared memory, cluster dims and parameter names, as strings."""
    rec = {}
    for gv, f in device_mod.functions.items():
        attrs = f.attrs or {}
        ext = {str(k): _pyexpr(v) for k, v in (attrs.get("thread_extent") or {}).items()}
        rec[gv.name_hint] = (ext, str(attrs.get("dyn_shared_memory_buf")), str(attrs.get("cluster_dims")),
                             [str(getattr(p, "name", p)) for p in f.params])
    return rec


def _check_same_launch(jit_device_mod, relowered_device_mod) -> None:
    a, b = _launch_record(jit_device_mod), _launch_record(relowered_device_mod)
    if a != b:
        raise AotBuildError(f"re-lowering changed the launch (JIT {a} vs re-lowered {b}); refusing to guess")


def build_fresh(variant: KernelVariant, geom: AttentionGeometry, compiled_order: list[str],
                fill_tilelang_cache: bool = False):
    """The variant's JIT kernel, compiled during this call through `device_compiles_through_aot` (its source's sha256
    in `compiled_order` past its length on entry): its cubin is the one the build writes, and it carries the device IR
    that produced its source. A kernel from a cache (the builder's or TileLang's) never reached this build's nvcc: it
    is compiled again from its PrimFunc with TileLang's cache off, or refused under `fill_tilelang_cache` (which
    leaves that cache on, so it receives the very cubins the build writes)."""
    tilelang = require_tilelang()
    from tilelang.env import env as tl_env

    def compiled_here(kernel, since: int) -> bool:
        art = getattr(kernel, "artifact", None)
        return (art is not None and art.device_mod is not None
                and sha256_bytes(kernel.get_kernel_source().encode()) in compiled_order[since:])

    was_enabled = tl_env.is_cache_enabled()
    if not fill_tilelang_cache:
        tl_env.disable_cache()
    try:
        since = len(compiled_order)
        kernel = variant.build(geom)
        if compiled_here(kernel, since):
            return kernel
        if fill_tilelang_cache:
            raise AotBuildError(
                f"{variant.name}: the builder handed out a kernel compiled before this build (this process built it"
                " already, or TileLang's cache holds it); filling TileLang's cache needs a fresh process and an empty"
                " TILELANG_CACHE_DIR, so that the cache receives the cubin this build writes")
        since = len(compiled_order)  # TileLang's cache is off here: this compiles, bypassing memory and disk
        kernel = tilelang.compile(
            kernel.prim_func, out_idx=list(getattr(kernel.adapter, "result_idx", None) or []) or None,
            execution_backend=kernel.execution_backend, target=kernel.target,
            pass_configs=dict(kernel.pass_configs or {}), compile_flags=kernel.compile_flags,
        )
        if not compiled_here(kernel, since):
            raise AotBuildError(f"{variant.name}: a fresh compile with TileLang's cache off did not go through the"
                                " AOT nvcc")
        return kernel
    finally:
        if was_enabled:
            tl_env.enable_cache()


# --- the build -----------------------------------------------------------------------------------------------------
def find_nvcc() -> str | None:
    """The nvcc TileLang's JIT would run (its CUDA_HOME resolution), or None when there is none."""
    require_tilelang()
    from tilelang.contrib.nvcc import get_nvcc_compiler

    try:
        nvcc = get_nvcc_compiler()
    except RuntimeError:  # TileLang found no CUDA installation
        return None
    return nvcc if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK) else None


def _toolchain() -> dict:
    """nvcc, host compiler and include dirs exactly as TileLang's JIT resolves them (NvccUnavailable without nvcc)."""
    require_tilelang()
    from tilelang.contrib.cc import get_cplus_compiler
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    nvcc = find_nvcc()
    if nvcc is None:
        raise NvccUnavailable("no nvcc: TileLang finds none (set CUDA_HOME to a CUDA toolkit, or put nvcc on PATH)")
    return {"nvcc": nvcc, "ccbin": get_cplus_compiler(), "template_dir": TILELANG_TEMPLATE_PATH,
            "cutlass_dir": CUTLASS_INCLUDE_DIR, "nvcc_version": nvcc_version(nvcc)}


def compile_cubin(source: str, arch: str, options: list[str], tc: dict) -> bytes:
    """nvcc the source to a cubin. The source file's path is named after its sha256 and its mtime fixed (the cubin's
    line info records both), so the same source, options and nvcc give the same bytes on every build."""
    digest = sha256_bytes(source.encode())[:16]
    with _locked_fixed_dir(os.path.join(tempfile.gettempdir(), f"foldkv_aot_{digest}")) as work, \
            tempfile.TemporaryDirectory(prefix="foldkv_aot_out_") as out_dir:
        src = os.path.join(work, "tvm_kernels.cu")
        with open(src, "w") as fh:
            fh.write(source)
        os.utime(src, (SOURCE_MTIME, SOURCE_MTIME))  # the line info records the source's mtime too
        out = os.path.join(out_dir, "tvm_kernels.cubin")
        cmd = nvcc_command(tc["nvcc"], tc["ccbin"], arch, options, src, out)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise AotBuildError(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
        with open(out, "rb") as fh:
            return fh.read()


SOURCE_MTIME = 1_000_000_000  # 2001-09-09: any fixed time


@contextlib.contextmanager
def _locked_fixed_dir(path: str):
    """The folder `path` (a fixed name: the cubin records it), made for one nvcc run and removed after it. An
    exclusive flock on the folder serialises processes compiling the same source, so none removes it under another;
    a process that gets the lock on a folder already removed (and maybe made again) starts over."""
    import fcntl

    while True:
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                current = False
            if current:
                try:
                    yield path
                finally:
                    shutil.rmtree(path, ignore_errors=True)
                return
        finally:
            os.close(fd)  # releases the lock


@contextlib.contextmanager
def device_compiles_through_aot(arch: str, tc: dict, store: dict, order: list):
    """While active, each JIT compile of this arch in the process runs `nvcc_command` with the options its pass configs
    give; the cubin is kept in `store` (sha256 of the source -> (cubin, options)), the sha256 appended to `order`.
    TileLang's own callback is put back afterwards."""
    import tvm_ffi
    from tilelang.cuda.backend import tilelang_callback_cuda_compile as tilelang_compile
    from tilelang.contrib.nvcc import get_target_arch_and_code, get_target_code_list

    name = "tilelang_callback_cuda_compile"

    def compile_for_aot(code, target, pass_config=None):
        target_arch, target_code = get_target_arch_and_code(target)
        if f"sm_{target_arch}" != arch or len(get_target_code_list(target_code)) > 1:
            return tilelang_compile(code, target, pass_config)  # not a kernel of this build
        cfg = {str(k): v for k, v in dict(pass_config or {}).items()}
        options = nvcc_options(cfg, template_dir=tc["template_dir"], cutlass_dir=tc["cutlass_dir"])
        cubin = compile_cubin(code, arch, options, tc)
        digest = sha256_bytes(code.encode())
        store[digest] = (cubin, options)
        order.append(digest)
        return bytearray(cubin)

    tvm_ffi.register_global_func(name, f=compile_for_aot, override=True)
    try:
        yield store
    finally:
        tvm_ffi.register_global_func(name, f=tilelang_compile, override=True)


def _portable_options(options: list[str], tc: dict) -> list[str]:
    """Options as recorded in the manifest: machine paths replaced by names, so two machines' builds compare."""
    return [o.replace(tc["template_dir"], "$TL_TEMPLATES").replace(tc["cutlass_dir"], "$CUTLASS") for o in options]


def build(
    out_dir: str | os.PathLike,
    *,
    arch: str = "sm_90a",
    geometry: AttentionGeometry | str | None = None,
    variants: Iterable[KernelVariant] | None = None,
    log: Callable[[str], None] | None = print,
    fill_tilelang_cache: bool = False,
) -> dict:
    """Generate, check and compile every variant (default: all registered ones) into `out_dir`; return the manifest.
    Nothing is written for a build that fails: files go to a staging folder that replaces `out_dir` at the end."""
    from .. import __version__ as foldkv_version
    from ..kernels.tl import target as tl_target

    geom = resolve_geometry(geometry)
    variants = list(registry.all_variants() if variants is None else variants)
    if not variants:
        raise AotBuildError("no kernel variants are registered")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise AotBuildError(f"duplicate variant names: {names}")
    tc = _toolchain()
    tilelang = require_tilelang()
    log = log or (lambda s: None)

    out_dir = os.fspath(out_dir)
    _check_out_dir(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".aot_stage_", dir=parent)
    t_start = time.perf_counter()
    try:
        target_arch = str(tl_target(arch).attrs["arch"])
        entries, compiled, compiled_order = [], {}, []
        with device_compiles_through_aot(target_arch, tc, compiled, compiled_order):
            for v in variants:
                t0 = time.perf_counter()
                kernel = build_fresh(v, geom, compiled_order, fill_tilelang_cache)
                target = getattr(kernel, "target", None)
                k_arch = str(target.attrs.get("arch")) if target is not None and "arch" in target.attrs else None
                if k_arch != target_arch:
                    raise AotBuildError(f"{v.name}: the builder compiled for {k_arch}, the AOT build is for {target_arch}"
                                        " (builders use foldkv.kernels.tl.target(): set FOLDKV_CUDA_ARCH to the"
                                        " same arch)")
                source, pass_configs, launch = extract(kernel)
                if v.in_place_merge:  # the build refuses to write an in-place merge that fails the check
                    barrier = merge_barrier_problems(v.name, source, [ln["symbol"] for ln in launch["launches"]])
                    if barrier:
                        raise AotBuildError("; ".join(barrier))
                options = nvcc_options(pass_configs, template_dir=tc["template_dir"], cutlass_dir=tc["cutlass_dir"])
                src_bytes = source.encode()
                got = compiled.get(sha256_bytes(src_bytes))
                if got is None:
                    raise AotBuildError(f"{v.name}: the JIT compile of this source did not go through the AOT nvcc")
                cubin, jit_options = got
                if jit_options != options:
                    raise AotBuildError(f"{v.name}: the JIT compile saw nvcc options {jit_options}, the kernel's pass"
                                        f" configs give {options}")
                if not re.fullmatch(r"[A-Za-z0-9_.-]+", v.name):
                    raise AotBuildError(f"variant name {v.name!r} is not a safe file name")
                for suffix, data in ((".cu", src_bytes), (".cubin", cubin)):
                    with open(os.path.join(stage, v.name + suffix), "wb") as fh:
                        fh.write(data)
                _, lowering = classify_pass_configs(pass_configs)
                entries.append({
                    "name": v.name,
                    "family": v.family,
                    "format": None if v.format is None else getattr(v.format, "value", str(v.format)),
                    "in_place_merge": bool(v.in_place_merge),
                    "barrier_checked": bool(v.in_place_merge),
                    "variant_params": json_value(v.params),
                    "source": v.name + ".cu",
                    "cubin": v.name + ".cubin",
                    "source_sha256": sha256_bytes(src_bytes),
                    "cubin_sha256": sha256_bytes(cubin),
                    "pass_configs": json_value(pass_configs),
                    "lowering_only_pass_configs": sorted(lowering),
                    "nvcc_options": _portable_options(options, tc),
                    **launch,
                })
                log(f"[aot] {v.name}: generated and compiled in {time.perf_counter() - t0:.1f}s, {len(cubin)} B cubin")
        formats = sorted({e["format"] for e in entries if e["format"] is not None})
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "foldkv_version": foldkv_version,
            "tilelang_version": tilelang.__version__,
            "nvcc_version": tc["nvcc_version"],
            "arch": target_arch,
            "nvcc_command": nvcc_command("nvcc", "<c++>", target_arch, ["<nvcc_options>"], "<name>.cu", "<name>.cubin"),
            "execution_backend_reproduced": "tvm_ffi",
            "geometry": geometry_record(geom),
            "geometry_name": geom.name,
            "formats": formats,
            "kernels": entries,
            "build_seconds": round(time.perf_counter() - t_start, 1),
            "provenance": checkout_state(),  # the commit and dirty flag of the code the kernels were generated from
        }
        problems = manifest_problems(manifest)  # what verify and the loader would refuse, refused before writing
        if problems:
            raise AotBuildError("the build's manifest would not verify: " + "; ".join(problems))
        with open(os.path.join(stage, MANIFEST_NAME), "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=False)
            fh.write("\n")
        _check_out_dir(out_dir)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(stage, out_dir)
        stage = None
        log(f"[aot] wrote {len(entries)} kernels to {out_dir} in {manifest['build_seconds']}s")
        return manifest
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)


def _check_out_dir(out_dir: str) -> None:
    """Only an empty folder or a previous build (it has a manifest) may be replaced."""
    if os.path.exists(out_dir) and not (
            os.path.isdir(out_dir) and (not os.listdir(out_dir) or os.path.exists(os.path.join(out_dir, MANIFEST_NAME)))):
        raise AotBuildError(f"{out_dir} exists and is not an AOT build folder; refusing to overwrite it")
