#!/usr/bin/env bash
# `make test`'s second pass: the tests whose subject is foldkv's transformers adapter, run again against another
# transformers than the environment's (the install gives the newest on PyPI; the H200 device runs 5.17).
#
#   bash scripts/transformers_pass.sh PYTHON VERSION [TEST ...]   (the tests below unless some are named)
#
# That transformers goes into .venv-transformers-VERSION/ (git-ignored) with `pip install --target --no-deps`, beside
# the environment, plus whatever it requires that the environment's packages do not satisfy (huggingface-hub < 2 for
# 5.17), each --no-deps too; pytest then runs with that folder first on PYTHONPATH and checks that transformers comes
# from there. A re-run with nothing changed (same script, same interpreter) installs nothing. The tests are the ones
# that exercise transformers' generate(), its Gemma 4 forward, its cache and mask interfaces, or its private API:
# tests/test_hf*_cpu.py, test_oracle_transformers.py, test_transformers_private_api.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: transformers_pass.sh PYTHON VERSION}
VERSION=${2:?usage: transformers_pass.sh PYTHON VERSION}
TESTS=(tests/test_hf_cpu.py tests/test_hf_step_cpu.py tests/test_hf_loop_cpu.py tests/test_hf_reset_cpu.py
       tests/test_oracle_transformers.py tests/test_transformers_private_api.py)
[ $# -gt 2 ] && TESTS=("${@:3}")
TARGET=.venv-transformers-$VERSION
T0=$SECONDS
say() { echo "[transformers $VERSION $((SECONDS - T0))s] $*"; }

stamp=$TARGET/.installed-$( (cat "$0"; "$PY" -c 'import sys; print(sys.prefix)') | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then
  say "up to date: $TARGET"
else
  say "pip install --target $TARGET --no-deps transformers==$VERSION"
  rm -rf "$TARGET"
  "$PY" -m pip install --quiet --target "$TARGET" --no-deps "transformers==$VERSION"
  for _ in 1 2 3 4; do  # what the target's packages require and neither the target nor the environment satisfies
    need=$(PYTHONPATH=$TARGET "$PY" - "$TARGET" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
need = []
for dist in md.distributions(path=[sys.argv[1]]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            ok = req.specifier.contains(md.version(req.name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
        if not ok:
            need.append(f"{req.name}{req.specifier}")
print(" ".join(sorted(set(need))))
EOF
)
    [ -z "$need" ] && break
    say "pip install --target $TARGET --no-deps $need (required, not satisfied by the environment)"
    # shellcheck disable=SC2086  # one word a requirement
    "$PY" -m pip install --quiet --upgrade --target "$TARGET" --no-deps $need
  done
  [ -z "$need" ] || { echo "[transformers $VERSION] error: still unsatisfied: $need" >&2; exit 1; }
  touch "$stamp"
fi

export PYTHONPATH=$PWD/$TARGET${PYTHONPATH:+:$PYTHONPATH}
seen=$("$PY" -c 'import foldkv, transformers, huggingface_hub as h; print(transformers.__version__, transformers.__file__, h.__version__, foldkv.__path__[0])')
read -r got file hub foldkv <<<"$seen"
[ "$got" = "$VERSION" ] && [[ "$file" == "$PWD/$TARGET/"* ]] \
  || { echo "[transformers $VERSION] error: the tests would import transformers $got from $file" >&2; exit 1; }
say "pytest against transformers $got (huggingface_hub $hub) from $TARGET, foldkv from $foldkv: ${TESTS[*]}"
"$PY" -m pytest -q -ra "${TESTS[@]}"
