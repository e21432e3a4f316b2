#!/usr/bin/env bash
# On the CPU machine, before scripts/device_run.sh: stage the device bundles, then build every kernel once for sm_90a
# into build/aot (the AOT build) and, from the same compilation, into .tilelang_cache (what the JIT loads there), so
# the device spends no time in nvcc and "AOT == JIT" compares one compilation. Carry: .devsite .tilelang_cache build/aot
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .devsite/env.sh ] || ../shared/device/stage.sh --peers
rm -rf .tilelang_cache build/aot
export TILELANG_CACHE_DIR=$PWD/.tilelang_cache
python3 -m foldkv aot build --arch sm_90a --out build/aot --fill-tilelang-cache
python3 -m foldkv aot verify build/aot
# the decode partials' other operand order, which tests/test_decode_gpu.py also runs, and (DECODE_HARNESS=1) the
# version-3 arms of bench/decode_harness.py
DECODE_HARNESS=${DECODE_HARNESS:-0} python3 - <<'PY'
import os
from foldkv import GEMMA4_31B as g
from foldkv.kernels import decode_partial_folded as f, decode_partial_split as s
s.build_decode_partial_split(g, operand_order="head_major", block_n=32, num_stages=2)
f.build_decode_partial_folded(g, operand_order="head_major", block_n=32, num_stages=3)
if os.environ["DECODE_HARNESS"] == "1":
    s.build_decode_partial_split(g, operand_order="token_major", block_n=64, num_stages=1, query_tma=False)
    f.build_decode_partial_folded(g, operand_order="token_major", block_n=64, num_stages=2, query_tma=False)
PY
du -sh .devsite .tilelang_cache build/aot
