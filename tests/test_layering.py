"""The runtime (`foldkv`: config, layout, pool, prep, reference, floor, validate, provenance, kernels, aot) never imports
the lab (`foldkv.lab`): checked statically on every runtime file's imports and by importing every runtime module in a
process where `foldkv.lab` cannot be imported. No modules of the package (runtime and lab) import each other in a
circle (a static scan of every import, those inside functions included, relative ones resolved): layers import one
way. Each check has a red twin that it must catch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lib" / "foldkv"
LAB = "foldkv.lab"


def _is_lab(name: str) -> bool:
    return name == LAB or name.startswith(LAB + ".")


def _package_of(module: str) -> str:
    """The package relative imports in `module` (a dotted name; a package's own file ends in ".__init__") resolve
    against."""
    return module[: -len(".__init__")] if module.endswith(".__init__") else module.rsplit(".", 1)[0]


def _import_targets(node: ast.AST, package: str) -> list[str]:
    """The dotted names one AST node imports (`import a.b`, `from .x import y` resolved against `package`, as the
    module and as module.name, and `importlib.import_module("...")` / `__import__("...")` of a literal name)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)]) if node.level - 1 < len(parts) else ""
        else:
            base = ""
        target = ".".join(p for p in (base, node.module or "") if p)
        return [target] + [f"{target}.{a.name}" for a in node.names]
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                 or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
        return [node.args[0].value]
    return []


def lab_imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported name) for every import of foldkv.lab in `source`, the text of module `module` (a dotted name,
    e.g. "foldkv.kernels.decode", which relative imports resolve against), including `importlib.import_module("...")`
    and `__import__("...")` of a literal name."""
    package = _package_of(module)
    found = []
    for node in ast.walk(ast.parse(source)):
        found += [(node.lineno, n) for n in _import_targets(node, package) if _is_lab(n)]
    return sorted(set(found))


def runtime_files_importing_lab(package_dir: Path) -> list[str]:
    """"path:line: name" for every import of foldkv.lab in a file of the package at `package_dir` outside its lab/."""
    hits = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir)
        if rel.parts[0] == "lab":
            continue
        module = ".".join((package_dir.name, *rel.with_suffix("").parts))
        hits += [f"{rel}:{line}: {name}" for line, name in lab_imports(path.read_text(), module)]
    return hits


def runtime_modules(package_dir: Path = PACKAGE) -> list[str]:
    """Every module of the runtime package, by dotted name (packages by their own name), lab/ left out."""
    mods = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        if rel.parts[0] == "lab":
            continue
        parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
        mods.append(".".join(("foldkv", *parts)))
    return mods


# --- the static check ------------------------------------------------------------------------------------------------
def test_no_runtime_file_imports_the_lab():
    assert (PACKAGE / "lab" / "__init__.py").is_file(), "the lab package is not where this test looks"
    assert runtime_files_importing_lab(PACKAGE) == []


@pytest.mark.parametrize("module,source", [
    ("foldkv.pool", "from foldkv.lab import gates"),
    ("foldkv.pool", "import foldkv.lab.report as r"),
    ("foldkv.pool", "from foldkv import lab"),
    ("foldkv.pool", "from .lab.report import RunRecord"),
    ("foldkv.pool", "from . import lab"),
    ("foldkv.kernels.decode", "def f():\n    from ..lab import drift"),
    ("foldkv.aot.__init__", "from ..lab.jsonsafe import jsonable"),
    ("foldkv.pool", "import importlib\nm = importlib.import_module('foldkv.lab.gates')"),
], ids=["absolute", "import-as", "from-package", "relative", "relative-package", "nested-relative",
        "package-init", "import_module"])
def test_the_check_flags_every_form_of_a_lab_import(module, source):
    assert lab_imports(source, module), f"{source!r} in {module} imports the lab, the check missed it"


@pytest.mark.parametrize("module,source", [
    ("foldkv.pool", "from .layout import KvFormat"),
    ("foldkv.pool", "import foldkv.labels"),
    ("foldkv.kernels.decode", "from ..layout import KvFormat\nfrom .lab import x"),  # foldkv.kernels.lab is no lab
    ("foldkv.pool", "s = 'foldkv.lab is the lab'"),
], ids=["runtime", "prefix", "other-package", "string"])
def test_the_check_passes_what_is_not_a_lab_import(module, source):
    assert lab_imports(source, module) == []


def test_the_check_flags_a_runtime_file_that_imports_the_lab(tmp_path):
    """Red twin on files: a runtime module importing the lab is flagged; the same import inside lab/ is not."""
    pkg = tmp_path / "foldkv"
    (pkg / "lab").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    (pkg / "__init__.py").write_text("from .layout import KvFormat\n")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "decode.py").write_text("import torch\n\n\ndef f():\n    from ..lab.report import RunRecord\n")
    (pkg / "lab" / "__init__.py").write_text("")
    (pkg / "lab" / "gates.py").write_text("from foldkv.lab.report import RunRecord\nfrom ..pool import PagedKvPool\n")
    assert runtime_files_importing_lab(pkg) == [f"{os.path.join('kernels', 'decode.py')}:5: foldkv.lab.report",
                                                f"{os.path.join('kernels', 'decode.py')}:5: foldkv.lab.report.RunRecord"]


# --- no import circle inside the lab ---------------------------------------------------------------------------------
def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in (getattr(test, "id", None), getattr(test, "attr", None))


def _run_time_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (annotations only: never imported when it runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node) if not _is_type_checking(c)]


def import_graph(package_dir: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the package at `package_dir` (dotted name `package`) it imports, by dotted name (a
    package by its own name). Every import counts, at the top or inside a function; `from p import m` of a
    submodule m is an edge to m alone (not to p's __init__, which a submodule's own package always is mid-import)."""
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        name = ".".join((package, *parts))
        files[name[: -len(".__init__")] if parts[-1] == "__init__" else name] = (path, name)
    graph = {}
    for mod, (path, name) in files.items():
        edges = set()
        for node in _run_time_nodes(ast.parse(path.read_text())):
            targets = _import_targets(node, _package_of(name))
            if isinstance(node, ast.ImportFrom):  # [module, module.name...]: the submodules named, else the module
                subs = [t for t in targets[1:] if t in files]
                targets = subs or targets[:1]
            edges |= {t for t in targets if t in files and t != mod}
        graph[mod] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of `graph`: each strongly connected set of two or more modules, sorted (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_lab_has_no_import_circle():
    graph = import_graph(PACKAGE / "lab", LAB)
    assert {"foldkv.lab.bench.arms", "foldkv.lab.bench.timing"} <= set(graph), "the scan found no lab modules"
    assert graph["foldkv.lab.bench.run"] >= {"foldkv.lab.bench.timing", "foldkv.lab.report"}
    assert import_circles(graph) == []


def test_the_circle_check_finds_a_circle(tmp_path):
    """Red twin: a tiny package where a -> b at the top, b -> c inside a function, c -> a through `from . import a`
    is one circle; d -> a only under TYPE_CHECKING, e -> its package's __init__ -> e's sibling f, are none."""
    pkg = tmp_path / "lab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import f\n")
    (pkg / "a.py").write_text("from .b import thing\n")
    (pkg / "b.py").write_text("def g():\n    from .c import other\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import thing\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "e.py").write_text("from . import f\nimport lab.d\n")
    (pkg / "sub" / "f.py").write_text("x = 1\n")
    graph = import_graph(pkg, "lab")
    assert graph["lab.d"] == set() and graph["lab.sub.e"] == {"lab.sub.f", "lab.d"}
    assert import_circles(graph) == [["lab.a", "lab.b", "lab.c"]]
    (pkg / "sub" / "f.py").write_text("from .. import sub\nfrom ..sub import e\n")  # f -> sub's __init__, f <-> e
    assert import_circles(import_graph(pkg, "lab")) == [["lab.a", "lab.b", "lab.c"], ["lab.sub.e", "lab.sub.f"]]


def circle_edges(graph: dict[str, set[str]], circle: list[str]) -> list[str]:
    """"a -> b" for every import between two modules of one circle (what to cut), sorted."""
    inside = set(circle)
    return [f"{a} -> {b}" for a in sorted(circle) for b in sorted(graph[a] & inside)]


def _circles_text(graph: dict[str, set[str]]) -> str:
    return "\n".join(f"circle {c}: " + ", ".join(circle_edges(graph, c)) for c in import_circles(graph))


def test_the_package_has_no_import_circle():
    """Every module of foldkv, the lab included: the runtime's layers import one way (a lower layer is handed what it
    needs: objects, callbacks), the lab likewise; a circle is printed with the imports inside it."""
    graph = import_graph(PACKAGE, "foldkv")
    assert {"foldkv.hf", "foldkv.hf_graph", "foldkv.fused_step", "foldkv.lab.bench.arms"} <= set(graph)
    assert {"foldkv.hf_graph", "foldkv.hf_loop"} <= graph["foldkv.hf"], "the scan found none of hf's imports"
    assert graph["foldkv.fused_step"] >= {"foldkv.ring", "foldkv.global_step"}
    assert import_circles(graph) == [], "import circles (every import, inside functions too):\n" + _circles_text(graph)


def test_the_package_circle_check_finds_a_planted_circle(tmp_path):
    """Red twin: a runtime package whose decode step imports its adapter inside a function (`from ..hf import x`, two
    levels up) while the adapter imports the step at the top, is one circle, printed with both imports; the lab module
    importing both adds none."""
    pkg = tmp_path / "foldkv"
    (pkg / "step").mkdir(parents=True)
    (pkg / "lab").mkdir()
    (pkg / "__init__.py").write_text("from .layout import KvFormat\n")
    (pkg / "layout.py").write_text("KvFormat = 1\n")
    (pkg / "hf.py").write_text("from .step.run import DecodeStep\nfrom .layout import KvFormat\n")
    (pkg / "step" / "__init__.py").write_text("")
    (pkg / "step" / "run.py").write_text("from ..layout import KvFormat\n\n\ndef f():\n    from ..hf import x\n")
    (pkg / "lab" / "__init__.py").write_text("")
    (pkg / "lab" / "arms.py").write_text("from foldkv import hf\nfrom ..step import run\n")
    graph = import_graph(pkg, "foldkv")
    assert import_circles(graph) == [["foldkv.hf", "foldkv.step.run"]]
    assert circle_edges(graph, ["foldkv.hf", "foldkv.step.run"]) == ["foldkv.hf -> foldkv.step.run",
                                                                    "foldkv.step.run -> foldkv.hf"]
    assert "foldkv.step.run -> foldkv.hf" in _circles_text(graph)
    (pkg / "step" / "run.py").write_text("from ..layout import KvFormat\n")  # the back edge gone: no circle
    assert import_circles(import_graph(pkg, "foldkv")) == []


# --- the import check --------------------------------------------------------------------------------------------------
_BLOCKED = textwrap.dedent("""
    import importlib, json, sys

    class NoLab:  # any import of foldkv.lab in this process is an error
        def find_spec(self, name, path=None, target=None):
            if name == "foldkv.lab" or name.startswith("foldkv.lab."):
                raise ImportError("the runtime imported " + name)

    sys.meta_path.insert(0, NoLab())
    import foldkv
    for name in json.loads(sys.argv[1]):
        importlib.import_module(name)
    print(json.dumps({"foldkv": foldkv.__file__, "lab_loaded": sorted(m for m in sys.modules if m.startswith("foldkv.lab"))}))
""")


def _run_blocked(modules: list[str]) -> subprocess.CompletedProcess:
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", _BLOCKED, json.dumps(modules)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_every_runtime_module_imports_without_the_lab():
    import json

    modules = runtime_modules()
    assert {"foldkv", "foldkv.provenance", "foldkv.kernels.decode", "foldkv.aot.build"} <= set(modules), modules
    proc = _run_blocked(modules)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(seen["foldkv"]).resolve().is_relative_to(PACKAGE), f"imported another foldkv: {seen['foldkv']}"
    assert seen["lab_loaded"] == []


def test_the_import_check_catches_a_lab_import():
    """Red twin: in the same blocked process, importing a lab module fails, so a runtime module that did would too."""
    proc = _run_blocked(["foldkv.provenance", "foldkv.lab.report"])
    assert proc.returncode != 0 and "the runtime imported foldkv.lab" in proc.stderr, proc.stderr[-3000:]
