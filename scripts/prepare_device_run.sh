#!/usr/bin/env bash
# On the CPU machine, before scripts/device_run.sh: stage the device bundles, then build every kernel once for sm_90a
# into build/aot (the AOT build) and verify it; the same for one tensor-parallel rank's geometry (gemma-4-31b-tp2: 16
# query heads over 2 KV heads) into build/aot-tp2, which the per-rank GPU test loads (an AOT build serves one geometry:
# its manifest records it and the loader refuses a pool of another). The device compiles the JIT kernels itself, from an empty TileLang
# cache (scripts/device_run.sh), so notebook 02's "AOT == JIT" compares two independent compilations.
#   Carry: .devsite build/aot build/aot-tp2 build/checkout.json
#
# --shared-cache (the old mode, an option only): the AOT build also fills .tilelang_cache with the very cubins it
# writes, and the JIT kernels the GPU tests add are compiled into it here; the device then loads that cache
# (CACHE_MODE=shared bash scripts/device_run.sh TAG), so "AOT == JIT" compares one compilation through two loaders.
#   Carry: .devsite .tilelang_cache build/aot build/aot-tp2 build/checkout.json
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=0
for arg in "$@"; do
  case "$arg" in
    --shared-cache) SHARED=1 ;;
    *) echo "usage: $0 [--shared-cache]" >&2; exit 2 ;;
  esac
done
[ -f .devsite/env.sh ] || ../shared/device/stage.sh --peers
PY=$(bash scripts/install.sh --which)   # the interpreter `make install` set up (torch, TileLang, nvcc bindings)
rm -rf .tilelang_cache build/aot build/aot-tp2
if [ "$SHARED" = 1 ]; then
  export TILELANG_CACHE_DIR=$PWD/.tilelang_cache
  "$PY" -m foldkv aot build --arch sm_90a --out build/aot --fill-tilelang-cache
  # the extra variants the GPU tests (bench/versions, float32 prep) compile, into the same cache
  FOLDKV_JIT_CACHE_MODE=shared "$PY" scripts/jit_build_all.py
else
  "$PY" -m foldkv aot build --arch sm_90a --out build/aot
fi
"$PY" -m foldkv aot verify build/aot
"$PY" -m foldkv aot build --arch sm_90a --geometry gemma-4-31b-tp2 --out build/aot-tp2
"$PY" -m foldkv aot verify build/aot-tp2
# the device gets the working tree without .git: this stamp names the commit there (foldkv.lab.checkout_stamp)
"$PY" -c "from foldkv.lab.checkout_stamp import write_checkout_stamp; print('stamped', write_checkout_stamp())"
du -sh .devsite build/aot build/aot-tp2 $([ "$SHARED" = 1 ] && echo .tilelang_cache)
