"""The runtime (`foldkv`: config, layout, pool, prep, reference, floor, validate, provenance, kernels, aot) never imports
the lab (`foldkv.lab`): checked statically on every runtime file's imports and by importing every runtime module in a
process where `foldkv.lab` cannot be imported. Each check has a red twin that it must catch."""

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


def lab_imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported name) for every import of foldkv.lab in `source`, the text of module `module` (a dotted name,
    e.g. "foldkv.kernels.decode", which relative imports resolve against), including `importlib.import_module("...")`
    and `__import__("...")` of a literal name."""
    is_package = module.endswith(".__init__")
    package = module.rsplit(".", 1)[0] if not is_package else module[: -len(".__init__")]
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)]) if node.level - 1 < len(parts) else ""
            else:
                base = ""
            target = ".".join(p for p in (base, node.module or "") if p)
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
            names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if _is_lab(n)]
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
