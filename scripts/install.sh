#!/usr/bin/env bash
# Install foldkv and everything its tests and notebooks use into an isolated Python, saying which one and each step.
#
# The interpreter, first match wins (`--which` prints it; the Makefile runs pytest and the batch with that one):
#   PYTHON=/path/to/python     the one you name: `make test PYTHON=/path/to/python`
#   an active venv             $VIRTUAL_ENV/bin/python
#   an active conda env        $CONDA_PREFIX/bin/python (not conda's base env: that is the machine's Python)
#   otherwise                  .venv/bin/python, made here with `python3 -m venv .venv` (git-ignored)
# torch: a torch already in that environment is kept (GPU users install their CUDA build first); otherwise
# $TORCH_CPU, the CPU build CI runs.
#
#   bash scripts/install.sh           install; a re-run with nothing changed says "up to date" in about a second
#   bash scripts/install.sh --which   print the interpreter and exit
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TORCH_CPU="torch==2.13.0"   # the only place the fallback torch is named (pyproject states the supported range)
# A CPU build of torch brings no Triton; this one is the H200's (a CUDA torch brings its own and it is kept), so the
# step's Triton kernels run in Triton's interpreter on CPU tensors (tests/test_triton_interpret_cpu.py). Its
# interpreter's range() over a runtime bound converts a one-element array to an int, which NumPy 2.4 refuses.
TRITON_CPU=("triton==3.6.0" "numpy<2.4")
EXTRAS="test,notebooks,kernels,aot"
MIN_PYTHON="3.10"

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON; WHY="named by PYTHON=$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=$VIRTUAL_ENV/bin/python; WHY="the active venv $VIRTUAL_ENV"
elif [ -n "${CONDA_PREFIX:-}" ] && [ "${CONDA_DEFAULT_ENV:-base}" != base ]; then
  PY=$CONDA_PREFIX/bin/python; WHY="the active conda env ${CONDA_DEFAULT_ENV} ($CONDA_PREFIX)"
else
  PY=$ROOT/.venv/bin/python; WHY="this repo's .venv: no venv or conda env active, no PYTHON given"
fi
if [ "${1:-}" = "--which" ]; then
  echo "$PY"
  exit 0
fi

T0=$SECONDS
say() { echo "[install $((SECONDS - T0))s] $*"; }
fail() { echo "[install] error: $*" >&2; exit 1; }
version_ok() { "$1" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$MIN_PYTHON'.split('.'))))"; }

if [ "$PY" = "$ROOT/.venv/bin/python" ] && [ ! -x "$PY" ]; then
  command -v python3 >/dev/null || fail "no python3 on PATH to make .venv from; pass PYTHON=/path/to/python (>= $MIN_PYTHON)"
  version_ok python3 || fail "python3 on PATH is $(python3 --version 2>&1); foldkv needs >= $MIN_PYTHON: pass PYTHON=/path/to/python"
  say "making .venv with $(python3 --version 2>&1) ($(command -v python3)): python3 -m venv .venv"
  python3 -m venv .venv || { rm -rf .venv; fail "python3 -m venv failed (on Debian/Ubuntu: apt install python3-venv);\
 or activate an env of your own, or pass PYTHON=/path/to/python"; }
fi
[ -x "$PY" ] || command -v "$PY" >/dev/null || fail "$PY ($WHY) is not an executable Python"
version_ok "$PY" || fail "$PY is $("$PY" --version 2>&1); foldkv needs Python >= $MIN_PYTHON"

# Up to date: same pyproject, same install script, same interpreter, and foldkv imported from this checkout's lib/.
stamp=build/.installed-$( (cat pyproject.toml scripts/install.sh; "$PY" -c 'import sys; print(sys.prefix)') \
  | sha256sum | cut -c1-16)
installed() {
  "$PY" - "$ROOT/lib" <<'EOF'
import importlib.util as u, os, sys
spec = u.find_spec("foldkv")
here = spec is not None and os.path.realpath(spec.origin).startswith(os.path.realpath(sys.argv[1]) + os.sep)
sys.exit(0 if here and all(u.find_spec(m) for m in ("torch", "tilelang", "papermill", "pytest")) else 1)
EOF
}
if [ -f "$stamp" ] && installed 2>/dev/null; then
  say "up to date: $PY ($WHY), torch $("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
  exit 0
fi

say "installing into $PY ($WHY), $("$PY" --version 2>&1)"
torch_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ -n "$torch_version" ]; then
  say "torch $torch_version is already in this environment: kept"
else
  say "no torch in this environment: pip install $TORCH_CPU (the CPU build; a GPU user installs a CUDA torch first)"
  "$PY" -m pip install "$TORCH_CPU"
fi
if "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
  say "a CPU torch: pip install ${TRITON_CPU[*]} (the kernels' interpreter; a CUDA torch brings its own Triton)"
  "$PY" -m pip install "${TRITON_CPU[@]}"
fi
say "pip install -e .[$EXTRAS] (foldkv from lib/, editable, with what its tests and notebooks use)"
"$PY" -m pip install -e ".[$EXTRAS]"

say "checking the imports"
versions=$("$PY" -c 'import foldkv, torch, papermill, tilelang; print(f"torch {torch.__version__}, tilelang {tilelang.__version__}, foldkv from {foldkv.__path__[0]}")' 2>/dev/null | tail -1) \
  || fail "foldkv, torch, papermill or tilelang does not import in $PY after the install"
installed || fail "foldkv in $PY does not import from $ROOT/lib (another checkout installed? pip uninstall foldkv, then re-run)"
mkdir -p build && touch "$stamp"
say "done: $versions"
