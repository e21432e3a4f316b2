"""AOT build / verify / loader checks on the CPU (no GPU): nvcc flags equal TileLang's own, build + verify of a tiny
in-place test kernel registered only here, tampered builds refused, the barrier check refusing a kernel, the
loader's geometry/arch/format/page-size refusals, and `import foldkv.aot` needing neither TileLang nor cuda-python.

The full build of every registered kernel runs through the CLI in `test_cli_builds_every_registered_variant`
(marked slow: it compiles each kernel twice, once by the JIT and once by nvcc for the cubin).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import require_module, require_tilelang, skip_or_fail

from foldkv import GEMMA4_31B, AttentionGeometry, FoldKvInputError, KvFormat
from foldkv.aot import (AotBuild, AotMismatchError, AotVerifyError, arch_runs_on, check_build_matches, read_manifest,
                        verify)
from foldkv.aot.loader import eval_size

TEST_KERNEL_COLS = 128


def require_nvcc() -> None:
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        skip_or_fail("nvcc is not installed")


def require_tilelang_and_nvcc() -> None:
    require_tilelang()
    require_nvcc()


# --- a tiny in-place kernel, registered only in these tests ---------------------------------------------------------
def inplace_test_program(barrier: bool = True):
    """Each row r: thread t reads buf[r, t] and buf[r, 0] (thread 0's column), then stores buf[r, t]. Thread 0's
    store would race the other threads' read of buf[r, 0] without the barrier: a minimal in-place merge. (The exp2
    is there so that fast math changes the code: the flag comparison below must be able to fail.)"""
    from foldkv.kernels.tl import require_tilelang as req

    req()
    import tilelang.language as T

    rows = T.dynamic("rows")

    @T.prim_func
    def aot_test_inplace(buf: T.Tensor((rows, TEST_KERNEL_COLS), "float32"), scale: T.float32):
        with T.Kernel(rows, threads=TEST_KERNEL_COLS) as r:
            tx = T.get_thread_binding(0)
            acc = T.alloc_var("float32")
            acc = T.exp2(buf[r, tx] * scale) + buf[r, 0]
            if barrier:
                T.sync_threads()
            buf[r, tx] = acc

    return aot_test_inplace


def build_inplace_test_kernel(geom: AttentionGeometry, barrier: bool = True):
    from foldkv.kernels.tl import pass_configs, require_tilelang as req, target

    tilelang = req()
    return tilelang.compile(inplace_test_program(barrier), target=target(), pass_configs=pass_configs())


def inplace_variants(barrier: bool = True):
    from foldkv.kernels.registry import KernelVariant

    return [KernelVariant("aot_test_inplace", "test", None,
                          lambda g, cols: build_inplace_test_kernel(g, barrier=barrier), in_place_merge=True,
                          params={"cols": TEST_KERNEL_COLS})]


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """One AOT build of the test kernel, shared by the tests below (each tampering test copies it first)."""
    require_tilelang_and_nvcc()
    from foldkv.aot.build import build

    out = tmp_path_factory.mktemp("aot") / "tiny"
    t0 = time.perf_counter()
    manifest = build(out, arch="sm_90a", variants=inplace_variants(), log=None)
    manifest["_test_seconds"] = time.perf_counter() - t0
    return out, manifest


def _copy(build_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(build_dir, dst)
    return dst


# --- nvcc flags ------------------------------------------------------------------------------------------------------
def test_every_tilelang_pass_config_is_mapped_lowering_only_or_refused():
    require_tilelang()
    from tilelang.transform import PassConfigKey

    from foldkv.aot.build import FLAG_PASS_CONFIGS, LOWERING_ONLY_PASS_CONFIGS, REFUSED_PASS_CONFIGS

    unclassified = [k.value for k in PassConfigKey
                    if k.value not in FLAG_PASS_CONFIGS and k.value not in LOWERING_ONLY_PASS_CONFIGS
                    and k.value not in REFUSED_PASS_CONFIGS]
    assert unclassified == []


@pytest.mark.parametrize("key", ["tl.some_future_codegen_switch", "cuda.kernels_output_dir", "tirx.add_lower_pass"])
def test_unmappable_pass_config_is_an_error(key):
    from foldkv.aot.build import AotBuildError, nvcc_options

    with pytest.raises(AotBuildError, match=key.replace(".", r"\.")):
        nvcc_options({"tl.enable_fast_math": False, key: 1}, template_dir="/t", cutlass_dir="/c")


@pytest.mark.parametrize("configs", [
    {"tl.enable_fast_math": False},
    {"tl.enable_fast_math": True},
    {"tl.ptxas_register_usage_level": 7, "tl.disable_tma_lower": True},
    {"tl.device_compile_flags": ["-DFOLDKV_TEST=1", "--extra-device-vectorization"]},
    {"tl.device_compile_flags": "-DA=1 -DB=2", "tl.enable_fast_math": True},
], ids=["default", "fast_math", "ptxas_level", "flag_list", "flag_string"])
def test_nvcc_command_equals_tilelangs_own(configs, monkeypatch):
    """TileLang's device-compile callback with these pass configs runs exactly the command the AOT build runs (the
    callback's nvcc call is intercepted; only the temp file paths differ)."""
    require_tilelang()
    import tilelang.contrib.nvcc as tl_nvcc
    from tilelang.cache.cuda_binary_cache import CUDABinaryCache
    from tilelang.cuda.backend import tilelang_callback_cuda_compile

    from foldkv.aot.build import _toolchain, nvcc_command, nvcc_options
    from foldkv.kernels.tl import target

    tc = _toolchain()  # before Popen is intercepted (it runs nvcc --version)
    captured = {}

    class _Stop(Exception):
        pass

    def fake_popen(cmd, *a, **k):
        captured["cmd"] = list(cmd)
        raise _Stop()

    monkeypatch.setattr(CUDABinaryCache, "load", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(tl_nvcc.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(tl_nvcc, "get_nvcc_compiler", lambda: "NVCC")
    with pytest.raises(_Stop):
        tilelang_callback_cuda_compile("// code\n", target(), configs)
    monkeypatch.undo()
    tl_cmd = captured["cmd"]
    ours = nvcc_command("NVCC", tc["ccbin"], "sm_90a",
                        nvcc_options(configs, template_dir=tc["template_dir"], cutlass_dir=tc["cutlass_dir"]),
                        "SRC", "OUT")

    def strip_paths(cmd):  # the -o target and the source file are temp paths
        i = cmd.index("-o")
        return cmd[:i] + cmd[i + 3:]

    assert strip_paths(tl_cmd) == strip_paths(ours)
    assert tl_cmd[-1].endswith(".cu") and tl_cmd[tl_cmd.index("-o") + 1].endswith(".cubin")


# --- build + verify ----------------------------------------------------------------------------------------------
def test_build_writes_source_cubin_and_manifest(tiny_build):
    out, manifest = tiny_build
    assert sorted(os.listdir(out)) == ["aot_test_inplace.cu", "aot_test_inplace.cubin", "manifest.json"]
    assert manifest["arch"] == "sm_90a"
    assert manifest["tilelang_version"] == "0.1.15"
    assert manifest["nvcc_version"].count(".") == 2
    assert manifest["geometry"]["num_q_heads"] == GEMMA4_31B.num_q_heads
    (k,) = manifest["kernels"]
    assert k["in_place_merge"] and k["barrier_checked"]
    assert [p["name"] for p in k["params"]] == ["buf", "scale"]
    assert k["params"][0]["shape"] == ["rows", TEST_KERNEL_COLS] and k["params"][0]["dtype"] == "float32"
    assert k["dynamic_symbols"] == [{"name": "rows", "dtype": "int32", "param": 0, "dim": 0}]
    (launch,) = k["launches"]
    assert launch["grid"] == ["rows", "1", "1"] and launch["block"] == [str(TEST_KERNEL_COLS), "1", "1"]
    assert [a["kind"] for a in launch["args"]].count("pointer") == 1
    assert {a.get("name") for a in launch["args"] if a["kind"] == "scalar"} == {"scale", "rows"}
    assert k["nvcc_options"][:3] == ["-std=c++20", "-I$TL_TEMPLATES", "-I$CUTLASS"]
    with open(out / "aot_test_inplace.cu") as fh:
        src = fh.read()
    assert "__syncthreads()" in src and launch["symbol"] in src
    assert read_manifest(out) == {k_: v for k_, v in manifest.items() if k_ != "_test_seconds"}
    print(f"tiny AOT build: {manifest['_test_seconds']:.1f}s")


def test_build_source_is_the_jits_source(tiny_build):
    """The .cu written is byte for byte the source the JIT compiled for the same kernel."""
    out, _ = tiny_build
    kernel = build_inplace_test_kernel(GEMMA4_31B)
    with open(out / "aot_test_inplace.cu") as fh:
        assert fh.read() == kernel.get_kernel_source()


def elf_sections(data: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF (a cubin). Lets two cubins be compared on their code
    (`.text.<kernel>`) and kernel info (`.nv.info*`, `.nv.constant*`) while ignoring line info, which records the path
    and mtime of the source file nvcc read."""
    import struct

    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    out = {}
    for h in headers:
        name = names[h[0]:names.index(b"\0", h[0])].decode()
        out[name] = b"" if h[1] == 8 else data[h[4]:h[4] + h[5]]  # SHT_NOBITS holds no bytes
    return out


def code_sections(data: bytes) -> dict[str, bytes]:
    """The sections of a cubin that decide what runs: kernel code, kernel info, constant banks, shared layout."""
    return {k: v for k, v in elf_sections(data).items()
            if k.startswith((".text.", ".nv.info", ".nv.constant", ".nv.shared", ".nv.global"))}


def test_cubin_code_equals_tilelangs_own_compile_of_the_source(tiny_build, monkeypatch):
    """TileLang's device-compile callback (its own flags, its cache bypassed) on the written source gives a cubin
    whose code, kernel info and constant banks equal the AOT cubin's (only the line info, which records the source
    path, differs). With fast math on, the code differs: the comparison can fail. Recompiling the source with the
    build's command gives the same bytes (reproducible build)."""
    require_tilelang_and_nvcc()
    from tilelang.cache.cuda_binary_cache import CUDABinaryCache
    from tilelang.cuda.backend import tilelang_callback_cuda_compile

    from foldkv.aot.build import _toolchain, compile_cubin, nvcc_options
    from foldkv.kernels.tl import pass_configs, target

    out, manifest = tiny_build
    (k,) = manifest["kernels"]
    source = (out / k["source"]).read_text()
    cubin = (out / k["cubin"]).read_bytes()
    monkeypatch.setattr(CUDABinaryCache, "load", classmethod(lambda cls, *a, **kw: None))
    monkeypatch.setattr(CUDABinaryCache, "save", classmethod(lambda cls, *a, **kw: None))
    tl_cubin = bytes(tilelang_callback_cuda_compile(source, target(), pass_configs()))
    assert code_sections(tl_cubin) == code_sections(cubin)
    assert tl_cubin != cubin  # the line info differs (TileLang compiles from a random temp path)
    fast = bytes(tilelang_callback_cuda_compile(source, target(), {**pass_configs(), "tl.enable_fast_math": True}))
    assert code_sections(fast) != code_sections(cubin)
    tc = _toolchain()
    again = compile_cubin(source, "sm_90a", nvcc_options(pass_configs(), template_dir=tc["template_dir"],
                                                          cutlass_dir=tc["cutlass_dir"]), tc)
    assert again == cubin


def test_verify_accepts_the_build(tiny_build):
    out, manifest = tiny_build
    assert verify(out)["kernels"][0]["cubin_sha256"] == manifest["kernels"][0]["cubin_sha256"]
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "verify", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "ok: 1 kernels" in res.stdout


@pytest.mark.parametrize("target", ["cubin", "source"])
def test_verify_refuses_a_changed_file(tiny_build, tmp_path, target):
    out, _ = tiny_build
    d = _copy(out, tmp_path)
    path = d / ("aot_test_inplace.cubin" if target == "cubin" else "aot_test_inplace.cu")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    path.write_bytes(bytes(data))
    with pytest.raises(AotVerifyError, match=path.name.replace(".", r"\.") + ".*changed after the build"):
        verify(d)
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "verify", str(d)], capture_output=True, text=True)
    assert res.returncode == 1 and "changed after the build" in res.stderr
    with pytest.raises(AotVerifyError):  # the loader refuses it before loading anything
        AotBuild(d)


def test_verify_refuses_missing_extra_and_non_cubin_files(tiny_build, tmp_path):
    out, _ = tiny_build
    d = _copy(out, tmp_path)
    (d / "aot_test_inplace.cubin").unlink()
    (d / "stray.cubin").write_bytes(b"\x7fELF")
    with pytest.raises(AotVerifyError) as exc:
        verify(d)
    assert "aot_test_inplace.cubin is missing" in str(exc.value) and "stray.cubin is in the build folder" in str(exc.value)

    d2 = _copy(out, tmp_path / "b")
    fake = b"not an elf" * 10
    (d2 / "aot_test_inplace.cubin").write_bytes(fake)
    m = json.loads((d2 / "manifest.json").read_text())
    import hashlib

    m["kernels"][0]["cubin_sha256"] = hashlib.sha256(fake).hexdigest()  # a manifest rewritten to match the fake
    (d2 / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(AotVerifyError, match="not an ELF"):
        verify(d2)


def _with_edited_source(build_dir, tmp_path, edit):
    """A copy of the build whose test kernel's source is `edit(source)`, its manifest hash updated to match."""
    import hashlib

    d = _copy(build_dir, tmp_path)
    src = edit((d / "aot_test_inplace.cu").read_text())
    (d / "aot_test_inplace.cu").write_text(src)
    m = json.loads((d / "manifest.json").read_text())
    m["kernels"][0]["source_sha256"] = hashlib.sha256(src.encode()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def test_verify_refuses_a_manifest_whose_merge_source_fails_the_barrier_check(tiny_build, tmp_path):
    """A source edited to drop the barrier, with the manifest hash updated to match, still fails verify."""
    d = _with_edited_source(tiny_build[0], tmp_path, lambda src: src.replace("__syncthreads();", "", 1))
    with pytest.raises(AotVerifyError, match="barrier check"):
        verify(d)


def test_verify_refuses_a_source_with_an_unguarded_producer_loop(tiny_build, tmp_path):
    """A warp-specialised producer branch without the producer guard (kernels.producer_guard), added to a source
    whose manifest hash is updated to match, fails verify."""
    branch = "\nif (((int)threadIdx.x) < 128) {\n    tl::warpgroup_reg_dealloc<24>();\n    mbarrier[0].wait(0);\n  }\n"
    d = _with_edited_source(tiny_build[0], tmp_path, lambda src: src + branch)
    with pytest.raises(AotVerifyError, match="producer guard check fails: .*without the guard"):
        verify(d)


def test_build_refuses_an_in_place_kernel_without_barrier(tmp_path):
    require_tilelang_and_nvcc()
    from foldkv.aot.build import AotBuildError, build

    out = tmp_path / "broken"
    with pytest.raises(AotBuildError, match="aot_test_inplace.*barrier"):
        build(out, variants=inplace_variants(barrier=False), log=None)
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".aot_stage_")] == []  # staging removed


def _handed_out_before_the_build(barrier: bool = True):
    """A variant whose builder hands out a kernel compiled before the build started (by TileLang's own nvcc), as a
    memoised builder does after a notebook cell has already built it: the case that made notebook 02 fail."""
    from foldkv.kernels.registry import KernelVariant

    earlier = build_inplace_test_kernel(GEMMA4_31B, barrier=barrier)
    variant = KernelVariant("aot_test_inplace", "test", None, lambda g, cols: earlier, in_place_merge=True,
                            params={"cols": TEST_KERNEL_COLS})
    return earlier, variant


def test_build_compiles_its_own_kernel_when_the_builder_hands_out_an_earlier_one(tmp_path, tiny_build):
    """The build does not take a kernel compiled before it (in this process or from a cache): it compiles the
    variant again through its own nvcc, and writes the same source and the same cubin as a build from scratch.
    Its nvcc work folder is gone afterwards."""
    require_tilelang_and_nvcc()
    import hashlib
    import tempfile

    from foldkv.aot.build import build

    earlier, variant = _handed_out_before_the_build()
    manifest = build(tmp_path / "b", arch="sm_90a", variants=[variant], log=None)
    (k,) = manifest["kernels"]
    source = earlier.get_kernel_source()
    assert k["source_sha256"] == hashlib.sha256(source.encode()).hexdigest()
    (tiny,) = tiny_build[1]["kernels"]
    assert (k["source_sha256"], k["cubin_sha256"]) == (tiny["source_sha256"], tiny["cubin_sha256"])
    verify(tmp_path / "b")
    work = os.path.join(tempfile.gettempdir(), f"foldkv_aot_{k['source_sha256'][:16]}")
    assert not os.path.exists(work), f"the build left its nvcc folder {work}"


def test_filling_tilelangs_cache_refuses_a_kernel_compiled_before_the_build(tmp_path):
    """With fill_tilelang_cache the cache must receive the build's own cubin, so a kernel the builder compiled
    earlier is refused (nothing written), not silently stored beside a cubin it does not match."""
    require_tilelang_and_nvcc()
    from foldkv.aot.build import AotBuildError, build

    _, variant = _handed_out_before_the_build()
    with pytest.raises(AotBuildError, match="compiled before this build"):
        build(tmp_path / "b", arch="sm_90a", variants=[variant], log=None, fill_tilelang_cache=True)
    assert not (tmp_path / "b").exists()


def test_build_without_nvcc_says_so_before_writing(tmp_path, monkeypatch):
    """No nvcc: NvccUnavailable (what notebook 02 records as "not run: no nvcc"), raised before anything is
    written; it is an AotBuildError, so a caller that does not single it out still sees a build error."""
    require_tilelang()
    import importlib

    build_module = importlib.import_module("foldkv.aot.build")  # the module (foldkv.aot.build is the function)
    monkeypatch.setattr(build_module, "find_nvcc", lambda: None)
    with pytest.raises(build_module.NvccUnavailable, match="no nvcc"):
        build_module.build(tmp_path / "b", arch="sm_90a", variants=inplace_variants(), log=None)
    assert issubclass(build_module.NvccUnavailable, build_module.AotBuildError)
    assert os.listdir(tmp_path) == []


def test_verify_refuses_a_launch_the_loader_cannot_make(tiny_build):
    """The loader launches with cuLaunchKernel only: a launch record asking for a cluster or a programmatic dependent
    launch is refused by verify (and so by the loader and the build). Red twin: the record as built passes."""
    from foldkv.aot.verify import manifest_problems

    _, manifest = tiny_build
    assert manifest_problems(manifest) == []
    for key, value in (("pdl", True), ("cluster_dims", [2, 1, 1])):
        broken = json.loads(json.dumps(manifest))
        broken["kernels"][0]["launches"][0][key] = value
        assert any("programmatic dependent launch" in p for p in manifest_problems(broken)), key


def test_manifest_records_the_commit_it_was_built_from(tiny_build):
    from foldkv.provenance import checkout_root

    _, manifest = tiny_build
    made = manifest["provenance"]
    head = subprocess.run(["git", "-C", checkout_root(), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert made["git_commit"] == head.stdout.strip() and isinstance(made["dirty"], bool)


def test_records_list_the_kernels_built_and_loaded(tiny_build, tmp_path, monkeypatch):
    """A record saved after a JIT builder handed out a kernel lists the sha256 of its CUDA source; after the AOT
    loader handed out a kernel, the manifest's sha256 of its source and cubin. Before, neither (the red twin)."""
    require_tilelang_and_nvcc()
    import hashlib

    from foldkv.kernels import registry
    from foldkv.lab.report import RunRecord

    monkeypatch.setattr(registry, "_HANDED_OUT", {})
    out, manifest = tiny_build
    (entry,) = manifest["kernels"]

    def saved_kernels(name):
        with open(RunRecord(name, tmp_path).save()) as fh:
            return json.load(fh)["provenance"]["kernels"]

    assert saved_kernels("before") == []
    builder = registry.hands_out("aot_test_{flavour}")(
        lambda geom, flavour="inplace": build_inplace_test_kernel(geom))
    kernel = builder(GEMMA4_31B)
    AotBuild(out).kernel("aot_test_inplace")
    kernels = {(k["name"], k["backend"]): k for k in saved_kernels("after")}
    jit = kernels[("aot_test_inplace", "jit")]
    assert jit["source_sha256"] == hashlib.sha256(kernel.get_kernel_source().encode()).hexdigest()
    assert jit["arguments"] == {"geom": GEMMA4_31B.name, "flavour": "inplace"}
    aot = kernels[("aot_test_inplace", "aot")]
    assert (aot["source_sha256"], aot["cubin_sha256"]) == (entry["source_sha256"], entry["cubin_sha256"])
    assert aot["built_from_commit"] == manifest["provenance"]["git_commit"]


def test_build_refuses_to_overwrite_a_folder_that_is_not_a_build(tmp_path):
    require_tilelang_and_nvcc()
    from foldkv.aot.build import AotBuildError, build

    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(AotBuildError, match="not an AOT build folder"):
        build(out, variants=inplace_variants(), log=None)
    assert (out / "notes.txt").read_text() == "mine"


# --- loader checks (no GPU) ---------------------------------------------------------------------------------------
def _manifest_for(geom=GEMMA4_31B, arch="sm_90a", formats=("folded", "split"), page_size=64) -> dict:
    from foldkv.aot.build import geometry_record

    return {
        "arch": arch, "geometry": geometry_record(geom), "formats": list(formats),
        "kernels": [{"name": f"decode_partial_{f}", "format": f, "variant_params": {"page_size": page_size}}
                    for f in formats] + [{"name": "merge_groups", "format": None, "variant_params": {}}],
    }


def test_loader_accepts_the_matching_build():
    m = _manifest_for()
    check_build_matches(m, geometry=GEMMA4_31B, fmt="folded", capability=(9, 0), page_size=64,
                        kernel="decode_partial_folded")
    check_build_matches(m, geometry=GEMMA4_31B, fmt=KvFormat.SPLIT, kernel="merge_groups")


@pytest.mark.parametrize("other", [
    AttentionGeometry(num_q_heads=16, num_kv_heads=2),
    AttentionGeometry(head_dim=256, partial_rotary_factor=0.25),
    AttentionGeometry(rope_theta=10_000.0),
], ids=["heads", "head_dim", "theta"])
def test_loader_refuses_a_build_for_another_geometry(other):
    m = _manifest_for(geom=other)
    with pytest.raises(AotMismatchError, match="geometry differs") as exc:
        check_build_matches(m, geometry=GEMMA4_31B)
    assert isinstance(exc.value, FoldKvInputError)


def test_loader_refuses_another_format_arch_or_page_size():
    m = _manifest_for(formats=("split",))
    with pytest.raises(AotMismatchError, match="format 'folded' not built"):
        check_build_matches(m, fmt="folded")
    m = _manifest_for()
    with pytest.raises(AotMismatchError, match="is for format 'split'"):
        check_build_matches(m, fmt="folded", kernel="decode_partial_split")
    for cap in [(8, 0), (10, 0), (9, 1)]:
        with pytest.raises(AotMismatchError, match="build is for sm_90a"):
            check_build_matches(m, capability=cap)
    with pytest.raises(AotMismatchError, match="page size 64, the pool has 32"):
        check_build_matches(m, page_size=32, kernel="decode_partial_folded")
    with pytest.raises(AotMismatchError, match="no kernel 'prefill_folded'"):
        check_build_matches(m, kernel="prefill_folded")


def check_pool_matches(manifest: dict, pool, *, kernel: str | None = None) -> None:
    """`check_build_matches` against a PagedKvPool's geometry, format and page size."""
    lay = pool.layout
    check_build_matches(manifest, geometry=lay.geometry, fmt=lay.format, page_size=lay.page_size, kernel=kernel)


def test_loader_checks_a_pool():
    from foldkv.pool import PagedKvLayout, PagedKvPool

    pool = PagedKvPool(PagedKvLayout(GEMMA4_31B, KvFormat.FOLDED, page_size=32, num_pages=2))
    with pytest.raises(AotMismatchError, match="page size 64, the pool has 32"):
        check_pool_matches(_manifest_for(), pool, kernel="decode_partial_folded")
    other = PagedKvPool(PagedKvLayout(AttentionGeometry(num_q_heads=16, num_kv_heads=2), KvFormat.FOLDED, num_pages=1))
    with pytest.raises(AotMismatchError, match="num_q_heads built 32, pool 16"):
        check_pool_matches(_manifest_for(), other)


def test_arch_rules():
    assert arch_runs_on("sm_90a", (9, 0))
    assert not arch_runs_on("sm_90a", (9, 1)) and not arch_runs_on("sm_90a", (10, 0))
    assert arch_runs_on("sm_90", (9, 0)) and not arch_runs_on("sm_90", (8, 9)) and not arch_runs_on("sm_80", (9, 0))


def test_size_expressions_are_data_not_code():
    assert eval_size("(n + 63) // 64", {"n": 65}) == 2
    assert eval_size("max(a, 1) * 4 - b % 3", {"a": 0, "b": 5}) == 2
    for bad in ["__import__('os').getcwd()", "n.bit_length()", "[n][0]", "lambda: 1", "m + 1"]:
        with pytest.raises(AotVerifyError):
            eval_size(bad, {"n": 3})


def test_aot_kernel_refuses_bad_arguments_before_touching_the_driver(tiny_build):
    import torch

    out, _ = tiny_build
    k = AotBuild(out).kernel("aot_test_inplace")
    with pytest.raises(FoldKvInputError, match="takes 2 arguments"):
        k.bind([torch.zeros(3, TEST_KERNEL_COLS)])
    with pytest.raises(FoldKvInputError, match="dtype torch.float64"):
        k.bind([torch.zeros(3, TEST_KERNEL_COLS, dtype=torch.float64), 1.0])
    with pytest.raises(FoldKvInputError, match="expected a CUDA device"):
        k.bind([torch.zeros(3, TEST_KERNEL_COLS), 1.0])
    with pytest.raises(FoldKvInputError, match="scale must be a Python float32 scalar"):
        k.bind([torch.zeros(3, TEST_KERNEL_COLS), torch.ones(())])


@pytest.fixture(scope="module")
def fp8_prefill_build(tmp_path_factory):
    """An AOT build of the registered FP8 folded prefill alone (one JIT build and one nvcc compile)."""
    require_tilelang_and_nvcc()
    from foldkv.aot.build import build
    from foldkv.kernels import registry

    out = tmp_path_factory.mktemp("aot") / "prefill_fp8"
    manifest = build(out, arch="sm_90a", variants=[registry.get("prefill_folded_fp8")], log=None)
    return out, manifest


def test_fp8_prefill_manifest_entry(fp8_prefill_build):
    """The FP8 prefill's manifest entry: its registered params, its arguments in the launcher's order with the e4m3
    pool and the float32 scales right after it, a TMA map for each of them; the build verifies, and the loader refuses
    a bf16 pool handed to it and a build asked for another page size (the red twins)."""
    import torch

    from foldkv.kernels import registry

    out, manifest = fp8_prefill_build
    (k,) = manifest["kernels"]
    assert (k["name"], k["family"], k["format"]) == ("prefill_folded_fp8", "prefill", "folded")
    assert k["variant_params"] == registry.get("prefill_folded_fp8").params
    args = [(p["name"], p["dtype"]) for p in k["params"] if p["kind"] == "tensor"]
    assert args == [("Q", "bfloat16"), ("Pool", "float8_e4m3"), ("Scales", "float32"), ("PageIds", "int32"),
                    ("SeqLens", "int32"), ("QStart", "int32"), ("QLens", "int32"), ("TileReq", "int32"),
                    ("TileTok", "int32"), ("Out", "bfloat16"), ("Lse", "float32")]
    mapped = {t["param"] for t in k["tensor_maps"]}
    assert {"Pool", "Scales"} <= mapped
    assert verify(out)["kernels"][0]["cubin_sha256"] == k["cubin_sha256"]
    check_build_matches(manifest, fmt="folded", page_size=64, kernel="prefill_folded_fp8")
    with pytest.raises(AotMismatchError, match="page size 64, the pool has 32"):
        check_build_matches(manifest, page_size=32, kernel="prefill_folded_fp8")
    kernel = AotBuild(out).kernel("prefill_folded_fp8")
    sizes = dict(Tq=9, NP=3, B=2, MP=4, NT=2)
    tensors = [torch.zeros([eval_size(x, sizes) for x in p["shape"]], dtype=_aot_dtype(p["dtype"]))
               for p in k["params"] if p["kind"] == "tensor"]
    tensors[1] = tensors[1].to(torch.bfloat16)  # a bf16 pool where the kernel reads e4m3
    with pytest.raises(FoldKvInputError, match="Pool has dtype torch.bfloat16, expected float8_e4m3"):
        kernel.bind(tensors)


@pytest.fixture(scope="module")
def dequant_pages_build(tmp_path_factory):
    """An AOT build of the page gather alone (one JIT build and one nvcc compile)."""
    require_tilelang_and_nvcc()
    from foldkv.aot.build import build
    from foldkv.kernels import registry

    out = tmp_path_factory.mktemp("aot") / "dequant_pages"
    return out, build(out, arch="sm_90a", variants=[registry.get("dequant_pages_folded_fp8")], log=None)


def test_dequant_pages_manifest_entry(dequant_pages_build):
    """The page gather's manifest entry: its registered params and its arguments in the launcher's order (e4m3 pool,
    float32 scales, int32 page list, bf16 output); the build verifies; the loader refuses a bf16 pool handed to it
    (the red twin)."""
    import torch

    from foldkv.kernels import registry

    out, manifest = dequant_pages_build
    (k,) = manifest["kernels"]
    assert (k["name"], k["family"], k["format"]) == ("dequant_pages_folded_fp8", "dequant_pages", "folded")
    assert k["variant_params"] == registry.get("dequant_pages_folded_fp8").params
    args = [(p["name"], p["dtype"]) for p in k["params"] if p["kind"] == "tensor"]
    assert args == [("Pool", "float8_e4m3"), ("PoolScales", "float32"), ("SrcPages", "int32"), ("Out", "bfloat16")]
    assert verify(out)["kernels"][0]["cubin_sha256"] == k["cubin_sha256"]
    kernel = AotBuild(out).kernel("dequant_pages_folded_fp8")
    sizes = dict(NP=3, N=2)
    tensors = [torch.zeros([eval_size(x, sizes) for x in p["shape"]], dtype=_aot_dtype(p["dtype"]))
               for p in k["params"] if p["kind"] == "tensor"]
    tensors[0] = tensors[0].to(torch.bfloat16)
    with pytest.raises(FoldKvInputError, match="Pool has dtype torch.bfloat16, expected float8_e4m3"):
        kernel.bind(tensors)


def _aot_dtype(name: str):
    from foldkv.aot.loader import _torch_dtype

    return _torch_dtype(name)


def test_active_build_needs_a_folder(monkeypatch):
    from foldkv import aot

    monkeypatch.delenv(aot.AOT_DIR_ENV, raising=False)
    aot.use_build(None)
    with pytest.raises(FoldKvInputError, match="needs an AOT build"):
        aot.aot_kernel("merge_groups")


def test_resolver_checks_every_param_against_a_real_manifest(tiny_build, monkeypatch):
    """`resolve.kernel(..., backend="aot")` on a real build: the kernel built with the asked params loads (once: the
    cache), one asked with another value of a param the manifest recorded is refused before loading (the red twin)."""
    from foldkv import aot
    from foldkv.kernels import registry, resolve

    out, manifest = tiny_build
    (variant,) = inplace_variants()
    monkeypatch.setitem(registry._BY_NAME, variant.name, variant)
    assert manifest["kernels"][0]["variant_params"] == {"cols": TEST_KERNEL_COLS}
    resolve.clear_cache()
    aot.use_build(out)
    try:
        k = resolve.kernel("aot_test_inplace", GEMMA4_31B, backend="aot")
        assert k.name == "aot_test_inplace"
        assert resolve.kernel("aot_test_inplace", GEMMA4_31B, {"cols": TEST_KERNEL_COLS}, backend="aot") is k
        with pytest.raises(AotMismatchError, match=f"cols built {TEST_KERNEL_COLS}, asked {2 * TEST_KERNEL_COLS}"):
            resolve.kernel("aot_test_inplace", GEMMA4_31B, {"cols": 2 * TEST_KERNEL_COLS}, backend="aot")
    finally:
        aot.use_build(None)
        resolve.clear_cache()


def test_importing_foldkv_aot_needs_neither_tilelang_nor_cuda_python():
    """A blocker refuses any import of tilelang, tvm or cuda.bindings; foldkv, foldkv.aot and the loader's checks
    still import and work. No import cycle: foldkv.aot imports no launcher, the launchers import no foldkv.aot (the
    resolver imports it when it is first asked for an AOT kernel)."""
    code = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('tilelang', 'tvm') or name.startswith(('cuda.bindings', 'cuda.cuda')):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import foldkv, foldkv.aot
launchers = ('foldkv.kernels.decode', 'foldkv.kernels.prefill', 'foldkv.kernels.resolve')
assert not [m for m in launchers if m in sys.modules], [m for m in launchers if m in sys.modules]
from foldkv.aot import check_build_matches, AotMismatchError
for m in list(sys.modules):
    if m.startswith('foldkv.aot'):
        del sys.modules[m]
from foldkv.kernels import decode, prefill, resolve
assert not [m for m in sys.modules if m.startswith('foldkv.aot')]
assert resolve.BACKENDS == ('jit', 'aot')
try:
    check_build_matches({'arch': 'sm_90a', 'formats': ['split'], 'geometry': {}, 'kernels': []}, fmt='folded')
except AotMismatchError:
    pass
else:
    raise SystemExit('no refusal')
bad = [m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm') or m.startswith('cuda.bindings')]
assert not bad, bad
print('ok')
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_package_level_build_and_verify_are_the_functions(tiny_build):
    """`foldkv.aot.build(...)` / `foldkv.aot.verify(dir)` (what the gates notebook calls) are the functions, while
    `from foldkv.aot.build import ...` still reaches the module."""
    from foldkv import aot
    from foldkv.aot.build import build as build_fn, nvcc_options  # noqa: F401

    out, manifest = tiny_build
    assert aot.build is build_fn
    assert aot.verify(out)["kernels"][0]["name"] == "aot_test_inplace"
    assert aot.manifest_summary(aot.read_manifest(out))["kernels"] == ["aot_test_inplace"]


def test_cli_help_lists_build_and_verify():
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "build" in res.stdout and "verify" in res.stdout


def test_cli_builds_for_a_ranks_geometry(tmp_path):
    """`python -m foldkv aot build --geometry gemma-4-31b-tp2` (how scripts/prepare_device_run.sh makes build/aot-tp2,
    one tensor-parallel rank's kernels; here one small variant of them): the manifest records the rank's geometry, the
    kernel is specialised on its 16 query heads, `aot verify` passes, and the loader takes the build for a rank's pool
    and refuses it for the 31B's (red twin)."""
    require_tilelang_and_nvcc()
    from foldkv import PRESETS
    from foldkv.aot.build import geometry_record

    out = tmp_path / "tp2"
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "build", "--arch", "sm_90a", "--geometry",
                          "gemma-4-31b-tp2", "--only", "merge_final", "--out", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    manifest = verify(out)
    tp2 = PRESETS["gemma-4-31b-tp2"]
    assert manifest["geometry"] == geometry_record(tp2) and manifest["geometry_name"] == "gemma-4-31b-tp2"
    (entry,) = manifest["kernels"]
    assert {p["name"]: p["shape"] for p in entry["params"]}["out"] == ["batch", 16, 512]
    assert entry["launches"][0]["grid"][1] == "16"  # one CTA per (request, query head) of the rank
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "verify", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    check_build_matches(manifest, geometry=tp2, kernel="merge_final")
    with pytest.raises(AotMismatchError, match="geometry differs.*num_q_heads built 16, pool 32"):
        check_build_matches(manifest, geometry=GEMMA4_31B)


@pytest.mark.slow
def test_cli_builds_every_registered_variant(tmp_path):
    """`python -m foldkv aot build --arch sm_90a --out DIR` over every registered kernel, then `aot verify DIR`."""
    require_tilelang_and_nvcc()
    from foldkv.kernels import registry

    names = sorted(v.name for v in registry.all_variants())
    out = tmp_path / "all"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "build", "--arch", "sm_90a", "--out", str(out)],
                         capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-4000:]
    manifest = verify(out)
    assert sorted(k["name"] for k in manifest["kernels"]) == names
    assert set(manifest["formats"]) == {"split", "folded"}
    merges = [k for k in manifest["kernels"] if k["in_place_merge"]]
    assert merges and all(k["barrier_checked"] for k in merges)
    for k in manifest["kernels"]:
        assert k["launches"] and all(ln["grid"] and ln["block"] for ln in k["launches"])
    res = subprocess.run([sys.executable, "-m", "foldkv", "aot", "verify", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    print(f"aot build of {len(names)} kernels: {seconds:.0f}s")
    _launch_every_kernel_on_a_recording_driver(out)


def _launch_every_kernel_on_a_recording_driver(out) -> None:
    """Each real manifest entry, with CPU tensors of its declared shapes (every dynamic size 3), through the loader's
    launch against the recording driver: every size expression evaluates, every TMA map encodes with well-typed
    arguments, every kernel gets one well-formed cuLaunchKernel with as many arguments as its parameters."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return
    import torch

    from foldkv.aot import loader
    from foldkv.aot.loader import _torch_dtype

    build = AotBuild(out)
    for name in build.names:
        k = build.kernel(name)
        env = {d["name"]: 3 for d in k.entry["dynamic_symbols"]}
        values = {}
        for p in k.params:
            if p["kind"] == "tensor":
                values[p["name"]] = torch.zeros([eval_size(x, env) for x in p["shape"]], dtype=_torch_dtype(p["dtype"]))
            else:  # scalars: an int one is also a size symbol, as in bind()
                v = 1 if p["dtype"].startswith(("int", "uint")) else 1.0
                values[p["name"]] = v
                if isinstance(v, int):
                    env.setdefault(p["name"], v)
        drv = RecordingDriver()
        old = loader._driver
        loader._driver = lambda: drv
        try:
            k.launch(values, env, 0, 0)
        finally:
            loader._driver = old
        launches = [c for c in drv.calls if c[0] in ("cuLaunchKernel", "cuLaunchKernelEx")]
        assert len(launches) == len(k.entry["launches"]), name
        programmatic = drv.real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        for (call, args), ln in zip(launches, k.entry["launches"]):
            params = args[9] if call == "cuLaunchKernel" else args[2]
            assert len(params[0]) == len(ln["args"]), name
            # a kernel that waits on griddepcontrol is launched as a programmatic dependent launch, no other is
            pdl = call == "cuLaunchKernelEx" and any(a.id == programmatic for a in args[0].attrs)
            assert pdl == bool(ln["pdl"]), name
        assert len([c for c in drv.calls if c[0] == "cuTensorMapEncodeTiled"]) == len(k.entry["tensor_maps"]), name


# --- the loader's driver calls, against a recording stand-in for cuda.bindings.driver -----------------------------
class RecordingDriver:
    """cuda.bindings.driver with every cu* function replaced by a recorder that checks its argument types against
    the real binding types and answers CUDA_SUCCESS; types and enums are the real ones (so a misspelt enum member or
    a wrong constructor fails here, without a GPU)."""

    def __init__(self, fail: dict | None = None):
        from cuda.bindings import driver as real

        self.real = real
        self.calls: list[tuple] = []
        self.fail = fail or {}  # function name -> CUresult it returns

    def __getattr__(self, name):
        real = self.real
        if not name.startswith("cu") or name in ("cuuint32_t", "cuuint64_t"):
            return getattr(real, name)
        getattr(real, name)  # the function must exist in the real bindings
        ok = real.CUresult.CUDA_SUCCESS
        answers = {
            "cuDeviceGet": lambda i: (ok, real.CUdevice(i)),
            "cuDevicePrimaryCtxRetain": lambda dev: (ok, real.CUcontext(0x1000)),
            "cuCtxGetCurrent": lambda: (ok, real.CUcontext(0)),
            "cuModuleLoadData": lambda image: (ok, real.CUmodule(0x2000)),
            "cuModuleGetFunction": lambda mod, sym: (ok, real.CUfunction(0x3000)),
            "cuTensorMapEncodeTiled": lambda *a: (ok, real.CUtensorMap()),
        }
        checks = {
            "cuDeviceGet": lambda i: isinstance(i, int),
            "cuDevicePrimaryCtxRetain": lambda dev: isinstance(dev, real.CUdevice),
            "cuCtxSetCurrent": lambda ctx: isinstance(ctx, real.CUcontext),
            "cuModuleLoadData": lambda image: isinstance(image, int) and image != 0,
            "cuModuleGetFunction": lambda mod, sym: isinstance(mod, real.CUmodule) and isinstance(sym, bytes),
            "cuFuncSetAttribute": lambda fn, attr, v: (isinstance(fn, real.CUfunction)
                                                       and isinstance(attr, real.CUfunction_attribute)
                                                       and isinstance(v, int)),
            "cuTensorMapEncodeTiled": lambda dt, rank, addr, dims, strides, box, es, il, sw, l2, oob: (
                isinstance(dt, real.CUtensorMapDataType) and len(dims) == rank and len(strides) == rank - 1
                and len(box) == rank and len(es) == rank
                and all(isinstance(x, real.cuuint64_t) for x in dims + strides)
                and all(isinstance(x, real.cuuint32_t) for x in box + es)
                and isinstance(il, real.CUtensorMapInterleave) and isinstance(sw, real.CUtensorMapSwizzle)
                and isinstance(l2, real.CUtensorMapL2promotion) and isinstance(oob, real.CUtensorMapFloatOOBfill)),
            "cuLaunchKernel": lambda fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra: (
                isinstance(fn, real.CUfunction) and isinstance(stream, real.CUstream)
                and all(isinstance(x, int) and x > 0 for x in (gx, gy, gz, bx, by, bz))
                and isinstance(params, tuple) and len(params) == 2 and len(params[0]) == len(params[1])),
            "cuLaunchKernelEx": lambda cfg, fn, params, extra: (
                isinstance(cfg, real.CUlaunchConfig) and isinstance(fn, real.CUfunction)
                and cfg.numAttrs == len(cfg.attrs) and cfg.gridDimX > 0 and cfg.blockDimX > 0
                and isinstance(params, tuple) and len(params) == 2 and len(params[0]) == len(params[1])),
        }

        def call(*args):
            if name in self.fail:
                self.calls.append((name, args))
                return (self.fail[name],) + ((None,) if name in answers else ())
            if name == "cuGetErrorName":
                return (ok, args[0].name.encode())
            if name in checks:
                assert checks[name](*args), f"{name} called with {args}"
            self.calls.append((name, args))
            return answers[name](*args) if name in answers else (ok,)

        return call


def test_loader_driver_calls_with_a_recording_driver(tiny_build, monkeypatch):
    """The launch of a decode-like entry (a TMA map over a dynamic dim, 141 KB of dynamic shared memory, pointer and
    int32 arguments in the kernel's own order) makes the expected driver calls with well-typed arguments; the module
    is loaded once per device; a second call only launches."""
    require_module("cuda.bindings")
    import ctypes

    import torch

    from foldkv.aot import loader

    out, _ = tiny_build
    build = AotBuild(out)
    entry = {
        "name": "fake_decode", "out_idx": [], "cubin": "aot_test_inplace.cubin",
        "cubin_sha256": build.manifest["kernels"][0]["cubin_sha256"],
        "params": [{"name": "pool", "data": "pool", "kind": "tensor", "dtype": "bfloat16",
                    "shape": ["num_pages", 4, 64, 640], "strides": []},
                   {"name": "part_o", "data": "part_o", "kind": "tensor", "dtype": "float32",
                    "shape": ["num_chunks", 32, 512], "strides": []}],
        "dynamic_symbols": [{"name": "num_pages", "dtype": "int32", "param": 0, "dim": 0},
                            {"name": "num_chunks", "dtype": "int32", "param": 1, "dim": 0}],
        "tensor_maps": [{"name": "pool_desc", "param": "pool", "dtype": 9, "rank": 4,
                         "global_dim": ["640", "64", "4", "num_pages"], "global_stride": ["2", "1280", "81920", "327680"],
                         "box_dim": ["64", "32", "1", "1"], "element_strides": ["1", "1", "1", "1"],
                         "interleave": 0, "swizzle": 3, "l2_promotion": 2, "oob_fill": 0}],
        "launches": [{"symbol": "fake_decode_kernel", "grid": ["num_chunks", "4", "1"], "block": ["256", "1", "1"],
                      "dynamic_smem_bytes": 141312, "cluster_dims": None, "pdl": False,
                      "args": [{"kind": "pointer", "param": "part_o"}, {"kind": "tensor_map", "name": "pool_desc"},
                               {"kind": "scalar", "name": "num_chunks", "dtype": "int32"}]}],
    }
    drv = RecordingDriver()
    monkeypatch.setattr(loader, "_driver", lambda: drv)
    k = loader.AotKernel(build, entry)
    pool, part_o = torch.zeros(3, 4, 64, 640, dtype=torch.bfloat16), torch.zeros(5, 32, 512)
    values, env = {"pool": pool, "part_o": part_o}, {"num_pages": 3, "num_chunks": 5}
    k.launch(values, env, 0, 0)
    names = [c[0] for c in drv.calls]
    assert names == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent", "cuCtxSetCurrent",
                     "cuModuleLoadData", "cuModuleGetFunction", "cuFuncSetAttribute", "cuTensorMapEncodeTiled",
                     "cuCtxGetCurrent", "cuCtxSetCurrent", "cuLaunchKernel"]
    enc = dict(drv.calls)["cuTensorMapEncodeTiled"]
    assert enc[2] == pool.data_ptr() and [int(x) for x in enc[3]] == [640, 64, 4, 3]
    assert [int(x) for x in enc[4]] == [1280, 81920, 327680]  # the element stride is implicit
    launch = drv.calls[-1][1]
    assert launch[1:8] == (5, 4, 1, 256, 1, 1, 141312)
    (vals, types) = launch[9]
    assert vals[0] == part_o.data_ptr() and types[0] is ctypes.c_void_p
    assert isinstance(vals[1], drv.real.CUtensorMap) and types[1] is None
    assert vals[2] == 5 and types[2] is ctypes.c_int32
    drv.calls.clear()
    k.launch(values, env, 0, 0)  # module cached: encode the map, make the context current, launch
    assert [c[0] for c in drv.calls] == ["cuTensorMapEncodeTiled", "cuCtxGetCurrent", "cuCtxSetCurrent",
                                         "cuLaunchKernel"]


def test_loader_reports_a_driver_error_by_name(tiny_build, monkeypatch):
    require_module("cuda.bindings")
    import torch

    from foldkv.aot import AotLaunchError, loader

    out, _ = tiny_build
    build = AotBuild(out)
    drv = RecordingDriver(fail={"cuModuleLoadData": RecordingDriver().real.CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU})
    monkeypatch.setattr(loader, "_driver", lambda: drv)
    k = build.kernel("aot_test_inplace")
    with pytest.raises(AotLaunchError, match="cuModuleLoadData failed: CUDA_ERROR_NO_BINARY_FOR_GPU"):
        k.launch({"buf": torch.zeros(2, TEST_KERNEL_COLS), "scale": 1.5}, {"rows": 2}, 0, 0)
    assert "cuLaunchKernel" not in [c[0] for c in drv.calls]
    # a working driver: the tiny kernel's own launch (float scalar, dynamic int32 symbol, no dynamic shared memory)
    drv = RecordingDriver()
    monkeypatch.setattr(loader, "_driver", lambda: drv)
    k.launch({"buf": torch.zeros(2, TEST_KERNEL_COLS), "scale": 1.5}, {"rows": 2}, 0, 0)
    names = [c[0] for c in drv.calls]
    assert "cuFuncSetAttribute" not in names and names[-1] == "cuLaunchKernel"
    vals, types = drv.calls[-1][1][9]
    import ctypes

    assert dict(zip(vals[1:], types[1:])) == {1.5: ctypes.c_float, 2: ctypes.c_int32}
