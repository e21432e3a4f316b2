"""The one launch path, on the CPU: `foldkv.kernels.resolve.kernel` builds through the registered builder with the
registered params (overridable by name), caches by (name, geometry, params, backend), refuses an unknown backend or
param, and for "aot" refuses every param that differs from what the active build's manifest recorded (page size
included) before loading anything. The registry is a written-out list: reading it imports no kernel module."""

from __future__ import annotations

import subprocess
import sys

import pytest

import foldkv
from foldkv import FoldKvInputError, KvFormat
from foldkv.aot import AotMismatchError
from foldkv.kernels import registry, resolve

GEOM = foldkv.GEMMA4_31B
OTHER_GEOM = foldkv.AttentionGeometry(num_q_heads=16, num_kv_heads=2)


@pytest.fixture(autouse=True)
def empty_cache():
    resolve.clear_cache()
    yield
    resolve.clear_cache()


# --- the registry ------------------------------------------------------------------------------------------------------
def test_reading_the_registry_imports_no_kernel_module():
    code = ("import sys\n"
            "from foldkv.kernels import registry\n"
            "names = [v.name for v in registry.all_variants()]\n"
            "assert len(names) == 12 and registry.get('prefill_split').params['page_size'] == 64, names\n"
            "loaded = [m for m in sys.modules if m.startswith('foldkv.kernels.') and m != 'foldkv.kernels.registry']\n"
            "assert not loaded, loaded\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_every_builder_takes_the_registered_params():
    """Each variant's builder accepts each of its params by name (and `fmt` when it has a format), so
    `KernelVariant.build` and the resolver can pass every one of them."""
    import inspect

    for v in registry.all_variants():
        sig = inspect.signature(v.build_function())
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        wanted = set(v.params) | ({"fmt"} if v.format is not None else set())
        missing = [p for p in wanted if p not in sig.parameters and not takes_any]
        assert not missing, f"{v.name}: builder {v.builder} does not take {missing}"


# --- jit: the builder, the params, the cache -----------------------------------------------------------------------------
@pytest.fixture
def counting_variant(monkeypatch):
    """A registered variant whose builder returns a fresh object per call and records its arguments."""
    calls = []

    def builder(geom, *, fmt, page_size, tiles):
        calls.append((geom, fmt, page_size, tiles))
        return object()

    variant = registry.KernelVariant("test_counting", "test", KvFormat.FOLDED, builder, {"page_size": 64, "tiles": 2})
    monkeypatch.setitem(registry._BY_NAME, variant.name, variant)
    return variant, calls


def test_jit_builds_with_the_registered_params_and_caches(counting_variant):
    _, calls = counting_variant
    first = resolve.kernel("test_counting", GEOM)
    assert calls == [(GEOM, KvFormat.FOLDED, 64, 2)]
    assert resolve.kernel("test_counting", GEOM, {"page_size": 64}) is first  # the same params, spelled out
    assert resolve.kernel("test_counting", GEOM, backend="jit") is first
    assert len(calls) == 1


@pytest.mark.parametrize("change", ["page_size", "tiles", "geometry"])
def test_jit_builds_again_for_other_params_or_geometry(counting_variant, change):
    _, calls = counting_variant
    first = resolve.kernel("test_counting", GEOM)
    geom, params = (OTHER_GEOM, None) if change == "geometry" else (GEOM, {change: 128})
    other = resolve.kernel("test_counting", geom, params)
    assert other is not first and len(calls) == 2
    assert calls[1] == (geom, KvFormat.FOLDED, 128 if change == "page_size" else 64, 128 if change == "tiles" else 2)


def test_refuses_unknown_param_and_backend_before_building(counting_variant):
    _, calls = counting_variant
    with pytest.raises(FoldKvInputError, match=r"test_counting has no parameter \['block_n'\]"):
        resolve.kernel("test_counting", GEOM, {"block_n": 32})
    with pytest.raises(FoldKvInputError, match=r"unknown backend 'cuda'; known: \['jit', 'aot'\]"):
        resolve.kernel("test_counting", GEOM, backend="cuda")
    assert calls == []


def test_launch_kernels_takes_an_override_and_resolves_the_rest(counting_variant):
    _, calls = counting_variant
    mine = lambda *args: None  # noqa: E731
    got = resolve.launch_kernels(("merge_final", "test_counting"), GEOM, kernels={"merge_final": mine})
    assert got[0] is mine and calls == [(GEOM, KvFormat.FOLDED, 64, 2)]
    with pytest.raises(FoldKvInputError, match="this launch uses"):
        resolve.launch_kernels(("test_counting",), GEOM, kernels={"merge_final": mine})


# --- aot: every param against the manifest --------------------------------------------------------------------------------
class FakeBuild:
    """What the resolver reads of an AotBuild: the manifest, the folder, and `kernel(...)` (recorded)."""

    def __init__(self, variant_params: dict, dir: str = "/fake/build"):
        self.dir = dir
        self.manifest = {"kernels": [{"name": n, "variant_params": dict(p)} for n, p in variant_params.items()]}
        self.names = list(variant_params)
        self.loads = []

    def kernel(self, name, *, geometry=None, fmt=None, page_size=None):
        self.loads.append((name, geometry, fmt, page_size))
        return ("aot", self.dir, name)


@pytest.fixture
def active(monkeypatch):
    """Make a FakeBuild of the registered params the active AOT build; returns a setter for another one."""
    from foldkv import aot

    holder = {}

    def use(build):
        holder["build"] = build
        return build

    monkeypatch.setattr(aot, "active_build", lambda: holder["build"])
    use(FakeBuild({v.name: v.params for v in registry.all_variants()}))
    return use


def _other_value(value):
    return "float32" if isinstance(value, str) else value * 2


@pytest.mark.parametrize("name", [v.name for v in registry.all_variants()])
def test_aot_loads_a_kernel_built_with_the_asked_params(active, name):
    build = active(FakeBuild({v.name: v.params for v in registry.all_variants()}))
    variant = registry.get(name)
    got = resolve.kernel(name, GEOM, backend="aot")
    assert got == ("aot", build.dir, name)
    assert build.loads == [(name, GEOM, variant.format, variant.params.get("page_size"))]
    assert resolve.kernel(name, GEOM, dict(variant.params), backend="aot") is got and len(build.loads) == 1


@pytest.mark.parametrize("name", [v.name for v in registry.all_variants()])
def test_aot_refuses_every_param_the_manifest_did_not_record(active, name):
    """The red twins: each param asked with another value than the build's is refused, naming it, before loading."""
    build = active(FakeBuild({v.name: v.params for v in registry.all_variants()}))
    for param, value in registry.get(name).params.items():
        asked = _other_value(value)
        with pytest.raises(AotMismatchError, match=f"{param} built {value!r}, asked {asked!r}"):
            resolve.kernel(name, GEOM, {param: asked}, backend="aot")
    assert build.loads == []


def test_aot_refuses_a_pool_page_size_other_than_the_builds(active):
    build = active(FakeBuild({"prefill_folded": dict(registry.get("prefill_folded").params, page_size=128)}))
    with pytest.raises(AotMismatchError, match="prefill_folded in /fake/build does not match: page_size built 128,"
                                               " asked 64"):
        resolve.kernel("prefill_folded", GEOM, backend="aot")
    assert build.loads == []


def test_aot_refuses_a_manifest_with_other_param_names(active):
    params = registry.get("merge_groups").params
    active(FakeBuild({"merge_groups": {}}))
    with pytest.raises(AotMismatchError, match="threads not recorded in the manifest"):
        resolve.kernel("merge_groups", GEOM, backend="aot")
    active(FakeBuild({"merge_groups": dict(params, unroll=8)}))
    with pytest.raises(AotMismatchError, match="unroll built 8, which this version of merge_groups does not have"):
        resolve.kernel("merge_groups", GEOM, backend="aot")
    active(FakeBuild({"merge_final": params}))
    with pytest.raises(AotMismatchError, match="has no kernel 'merge_groups'"):
        resolve.kernel("merge_groups", GEOM, backend="aot")


def test_aot_cache_follows_the_active_build(active):
    first = active(FakeBuild({"merge_final": registry.get("merge_final").params}, dir="/one"))
    assert resolve.kernel("merge_final", GEOM, backend="aot") == ("aot", "/one", "merge_final")
    second = active(FakeBuild({"merge_final": registry.get("merge_final").params}, dir="/two"))
    assert resolve.kernel("merge_final", GEOM, backend="aot") == ("aot", "/two", "merge_final")
    assert len(first.loads) == len(second.loads) == 1
