#!/usr/bin/env bash
# Install foldkv and everything its tests and notebooks use into the current Python (a venv or conda env if one is
# active). A torch already present is kept (GPU users install their CUDA torch first); otherwise the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=build/.installed-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && "$PY" -c "import foldkv, torch, papermill, tilelang" 2>/dev/null; then
  exit 0
fi
echo "[install] $($PY --version) at $(command -v $PY)"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] no torch found: installing torch==2.13.0 (this machine kind's CPU build; a GPU user installs a CUDA torch first)"
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,notebooks,kernels,aot]"
mkdir -p build && touch "$stamp"
echo "[install] done: torch $("$PY" -c 'import torch; print(torch.__version__)'), tilelang $("$PY" -c 'import tilelang; print(tilelang.__version__)' 2>/dev/null | tail -1)"
