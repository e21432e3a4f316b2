#!/usr/bin/env bash
# The H200 run behind papermill_runs/h200-*/: the GPU tests and the papermill batch (scripts/run_batch.py), in one
# device call. Correctness work runs side by side (GPU tests, notebooks 01-03, a smoke pass of 04 that also builds
# FlashInfer's JIT modules); the benchmarks notebook then runs alone so nothing else shares the GPU while it times.
#
#   bash scripts/device_run.sh TAG      # on the device machine, repo root, .devsite/.tilelang_cache/build/aot carried
# Results: papermill_runs/TAG/ (tarred to $OUT/runs.tgz) and the logs in $OUT.
set -u
TAG=${1:-h200-$(date +%Y%m%d)}
OUTD=${OUT:-/tmp/foldkv_out}
mkdir -p "$OUTD"
source .devsite/env.sh
export PYTHONPATH=$PWD/lib:$PYTHONPATH TILELANG_CACHE_DIR=$PWD/.tilelang_cache FOLDKV_AOT_DIR=$PWD/build/aot
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUTD/gpu.txt"
t0=$(date +%s)
A=${PHASE_A_S:-300}; B=${PHASE_B_S:-250}

(FOLDKV_REQUIRE_GPU=1 FOLDKV_GATE_CASES=smoke FOLDKV_AOT_TEST_DIR=$PWD/build/aot timeout $A \
   python3 -m pytest -m gpu -q -ra -p no:cacheprovider > "$OUTD/pytest_gpu.log" 2>&1; echo "pytest rc=$?" >> "$OUTD/pytest_gpu.log") &
(timeout $A python3 -m papermill notebooks/04_benchmarks.ipynb /tmp/04_smoke.ipynb -k python3 -p mode gpu -p smoke True \
   -p out_dir /tmp/nb04_smoke -p aot_dir build/aot > "$OUTD/nb04_smoke.log" 2>&1; echo "smoke rc=$?" >> "$OUTD/nb04_smoke.log") &
timeout $A python3 scripts/run_batch.py --tag "$TAG" --only 01 02 03 --no-progress \
   --params '{"02": {"aot_dir": "build/aot"}, "03": {"kernel_backend": "jit"}}' > "$OUTD/batch_a.log" 2>&1
echo "batch A rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$OUTD/batch_a.log"
wait
echo "phase A done at $(( $(date +%s) - t0 )) s"

timeout $B python3 scripts/run_batch.py --tag "$TAG" --only 04 --no-progress \
   --params '{"04": {"mode": "gpu", "aot_dir": "build/aot", "rounds": 15, "prefill_rounds": 4,
              "sweep_lengths": [1024, 4096, 16384, 65536, 262144], "prefill_contexts": [16384, 81653, 163336]}}' \
   > "$OUTD/batch_b.log" 2>&1
echo "batch B rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$OUTD/batch_b.log"
tar -czf "$OUTD/runs.tgz" papermill_runs/"$TAG"
tail -5 "$OUTD/pytest_gpu.log"; cat papermill_runs/"$TAG"/SUMMARY.md 2>/dev/null
