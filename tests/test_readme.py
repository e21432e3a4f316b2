"""The documents' code runs as written: every ```python block of README.md and DEVELOPERS.md, in order, in one
namespace, in a fresh interpreter that sees no GPU; every `make` target a ```bash block names is a Makefile rule.

Kernel calls sit behind `if device == "cuda":`. Where that test is false they are not skipped: the body runs too and
must stop at the launcher's device refusal (FoldKvInputError "... runs on CUDA ..."). Every launcher checks all its
other arguments first, so a wrong shape, dtype, table or signature in a document's kernel call fails here on a CPU.
On a GPU (`gpu` marker) the same blocks run with the kernels for real.

Run as a script (`python tests/test_readme.py README.md ...`) it executes the files' python blocks; the tests do
that in a subprocess, so the blocks cannot lean on what the test process imported.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "DEVELOPERS.md")
DEVICE_REFUSAL = re.compile(r"runs on (a )?CUDA")
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
MAKE_CALL = re.compile(r"^\s*(?:\w+=\S*\s+)*make\s+([\w.-]+)", re.M)
MAKE_RULE = re.compile(r"^([\w.-]+)\s*:(?!=)", re.M)
HANG_GUARD_S = 600  # stops a hang, nothing more: the README's blocks take seconds on a CPU (a GPU run also compiles)


# --- extraction ---------------------------------------------------------------------------------------------------
def code_blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """(line number of the block's first code line, code) of each ```lang fenced block, in document order."""
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang]


def make_targets_called(code: str) -> list[str]:
    """Targets of the `make TARGET` command lines of a shell block (`VAR=x make TARGET` too)."""
    return MAKE_CALL.findall(code)


def makefile_rules(text: str) -> set[str]:
    """Targets a Makefile defines a rule for (`target: deps`; `VAR := x` is not a rule)."""
    return set(MAKE_RULE.findall(text))


def cuda_guards(code: str) -> int:
    """Top-level `if device == "cuda":` statements of a block."""
    return sum(_is_device_guard(node) for node in ast.parse(code).body)


# --- running --------------------------------------------------------------------------------------------------------
def _is_device_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and not node.orelse and ast.unparse(node.test) == "device == 'cuda'"


def _exec(body: list[ast.stmt], source: str, ns: dict) -> None:
    exec(compile(ast.Module(body=body, type_ignores=[]), source, "exec"), ns)


def run_blocks(blocks: list[tuple[str, int, str]]) -> int:
    """Execute (source, first line, code) blocks in order in one namespace; tracebacks name the document's lines.

    A top-level `if device == "cuda":` whose test is false has its body run anyway, and that body must raise the
    launcher's device refusal; anything else it raises propagates, and finishing without a refusal is an error.
    Returns the number of guarded bodies stopped at the device refusal.
    """
    from foldkv import FoldKvInputError

    ns: dict = {"__name__": "__main__"}
    refused = 0
    for source, line, code in blocks:
        tree = ast.parse(code, filename=source)
        ast.increment_lineno(tree, line - 1)
        for node in tree.body:
            if not _is_device_guard(node) or eval(compile(ast.Expression(node.test), source, "eval"), ns):
                _exec([node], source, ns)
                continue
            try:
                _exec(node.body, source, ns)
            except FoldKvInputError as exc:
                if not DEVICE_REFUSAL.search(str(exc)):
                    raise
                refused += 1
                continue
            raise AssertionError(
                f"{source}:{node.lineno}: the body of `if device == \"cuda\":` ran on device={ns.get('device')!r} and"
                " reached no launcher's device refusal: put only kernel calls behind that guard"
            )
    return refused


def main(paths: list[str]) -> int:
    blocks = [(Path(p).name, line, code) for p in paths for line, code in code_blocks(Path(p).read_text(), "python")]
    refused = run_blocks(blocks)
    print(f"ran {len(blocks)} python blocks; {refused} guarded kernel calls stopped at the device refusal")
    return 0


def run_documents(paths: list[Path], cwd: Path, *, hide_gpu: bool) -> subprocess.CompletedProcess:
    """`main` over the documents in a fresh interpreter importing this checkout's foldkv."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "lib"), os.environ.get("PYTHONPATH")])))
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, str(Path(__file__).resolve()), *map(str, paths)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


def _documents() -> list[Path]:
    return [REPO / d for d in DOCS if (REPO / d).exists()]


# --- the documents ----------------------------------------------------------------------------------------------------
def test_readme_has_python_blocks_that_parse():
    blocks = code_blocks((REPO / "README.md").read_text(), "python")
    assert blocks, "README.md holds no ```python block: the extractor or the README changed"
    for doc in _documents():
        for line, code in code_blocks(doc.read_text(), "python"):
            ast.parse(code, filename=f"{doc.name}:{line}")


def test_python_blocks_run_on_cpu(tmp_path):
    docs = _documents()
    guards = sum(cuda_guards(code) for d in docs for _, code in code_blocks(d.read_text(), "python"))
    res = run_documents(docs, tmp_path, hide_gpu=True)
    assert res.returncode == 0, f"a document's python block failed on the CPU:\n{res.stdout}\n{res.stderr[-4000:]}"
    want = f"{guards} guarded kernel calls stopped at the device refusal"
    assert want in res.stdout, f"expected '{want}' (every guarded kernel call checked on the CPU):\n{res.stdout}"


@pytest.mark.gpu
def test_python_blocks_run_with_kernels_on_gpu(tmp_path):
    res = run_documents(_documents(), tmp_path, hide_gpu=False)
    assert res.returncode == 0, f"a document's python block failed on the GPU:\n{res.stdout}\n{res.stderr[-4000:]}"
    for line in ("prefill kernel vs float64:", "decode kernel vs float64:", "0 guarded kernel calls"):
        assert line in res.stdout, f"the README's kernel calls did not run ('{line}' missing):\n{res.stdout}"


def test_bash_blocks_name_existing_make_targets():
    rules = makefile_rules((REPO / "Makefile").read_text())
    called = [(d.name, t) for d in _documents() for _, code in code_blocks(d.read_text(), "bash")
              for t in make_targets_called(code)]
    assert called, "README.md names no `make` target in a ```bash block: the extractor or the README changed"
    missing = [(doc, t) for doc, t in called if t not in rules]
    assert not missing, f"make targets the documents name but the Makefile does not define: {missing}"


# --- red twins: the extractor and the runner catch what they are for --------------------------------------------
SAMPLE = """# title
```python
a = 1
```
text
```bash
make test   # comment
FOO=1 make nosuch
```
```
plain = 'not python'
```
```python
b = a + 1
```
"""


def test_extractor_finds_each_block_with_its_line():
    assert code_blocks(SAMPLE, "python") == [(3, "a = 1\n"), (14, "b = a + 1\n")]
    assert [t for _, c in code_blocks(SAMPLE, "bash") for t in make_targets_called(c)] == ["test", "nosuch"]
    rules = makefile_rules("X := 1\n.PHONY: test\ntest: install\n\tpytest\ninstall:\n\tpip\n")
    assert {"test", "install"} <= rules and "X" not in rules
    assert "nosuch" not in rules


def test_runner_fails_on_a_broken_block(tmp_path):
    # the README's old block: names a caller never defined
    doc = tmp_path / "broken.md"
    doc.write_text("intro\n```python\nimport foldkv\nquery = foldkv.prep_and_store(pool, table, request)\n```\n")
    res = run_documents([doc], tmp_path, hide_gpu=True)
    assert res.returncode != 0, f"a block with undefined names ran:\n{res.stdout}"
    assert "NameError" in res.stderr and 'broken.md", line 4' in res.stderr, res.stderr[-2000:]


GUARDED = """import torch, foldkv
from foldkv.kernels.decode import decode
device = "cpu"
pool = foldkv.PagedKvPool(foldkv.PagedKvLayout.for_tokens(64, format="folded"), device=device)
table = pool.allocate([10])
if device == "cuda":
    out, lse = decode(pool, torch.zeros({shape}, dtype=torch.bfloat16), table)
"""


@pytest.mark.parametrize("shape, error", [
    ("1, 32, 512", None),  # the right call: stops at the device refusal
    ("1, 32, 256", "query has shape"),  # a wrong argument behind the guard is caught on the CPU
], ids=["right_call", "wrong_query_shape"])
def test_runner_checks_guarded_kernel_calls(shape, error):
    from foldkv import FoldKvInputError

    blocks = [("guarded.md", 1, GUARDED.format(shape=shape))]
    if error is None:
        assert run_blocks(blocks) == 1
    else:
        with pytest.raises(FoldKvInputError, match=error):
            run_blocks(blocks)


def test_runner_refuses_a_guard_that_holds_no_kernel_call():
    with pytest.raises(AssertionError, match="reached no launcher's device refusal"):
        run_blocks([("guarded.md", 1, 'device = "cpu"\nif device == "cuda":\n    x = 1\n')])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
