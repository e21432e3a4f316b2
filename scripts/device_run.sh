#!/usr/bin/env bash
# The H200 run behind papermill_runs/h200-*/: the GPU tests and the papermill batch (scripts/run_batch.py), in one
# device call. First TileLang's JIT compiles every kernel the run uses into a fresh, empty cache on this machine
# (scripts/jit_build_all.py, timed: $OUT/jit_build.json, also in notebook 02's record); the AOT cubins come from the
# CPU machine (build/aot), so "AOT == JIT" compares two independent compilations. Then correctness work runs side by
# side (GPU tests; notebooks 01+02 and 03; a smoke pass of 04 that also builds FlashInfer's JIT modules), loading the
# JIT kernels from that cache; the benchmarks notebook then runs alone, so nothing else shares the GPU while it times.
# Prepare on the CPU machine first: scripts/prepare_device_run.sh.
#
#   bash scripts/device_run.sh TAG      # on the device machine, repo root; carried: .devsite build/aot build/aot-tp2
#                                       # build/checkout.json
#   CACHE_MODE=shared bash scripts/device_run.sh TAG   # option: load the carried .tilelang_cache that
#                                       # `prepare_device_run.sh --shared-cache` filled from the AOT build (one compilation)
# Results: papermill_runs/TAG/ (tarred to $OUT/runs.tgz) and this part's logs ($OUT/logs_part<PART>.tgz): two files of
# the 8 a reply brings back. The tree is laid anew each call: unpack runs.tgz here between calls, so that the next
# call's summary sees every notebook. Before the first call: scripts/device_tree.sh hold (the 64 MiB cap).
# Time caps (seconds): JIT_S for the JIT compiles, PHASE_A_S for the side-by-side phase, PHASE_B_S for notebook 04,
# C for notebook 05 (alone: it times generate()), D for notebook 07 (alone: it times the first token). Each PART is
# one device call under its 600 s: PART=1 the GPU tests, 01, 03 and a smoke 04 side by side; PART=2 notebook 02 alone
# (its full-length gates need the card's memory), then 04 alone (PART=2a: 02 only, PART=2b: 04 only, when the two do
# not fit one call); PART=3 notebook 05 alone; PART=4 notebook 07 alone (its defaults ~485 s after ~71 s of JIT: its
# intro's estimate from its run of record; D 510 s, ~5% above it, so JIT + D stays under the call's 600 s);
# PART=tp notebook 06 alone on a machine of two GPUs (not in PART=all); each part compiles the JIT kernels first.
# PART=all (default) runs the others in turn.
set -u
TAG=${1:-h200-$(date +%Y%m%d)}
OUTD=${OUT:-/tmp/foldkv_out}
mkdir -p "$OUTD"
source .devsite/env.sh
CACHE_MODE=${CACHE_MODE:-fresh}
if [ "$CACHE_MODE" = shared ]; then
  [ -d .tilelang_cache ] || { echo "CACHE_MODE=shared needs the carried .tilelang_cache (prepare_device_run.sh --shared-cache)"; exit 2; }
  JIT_CACHE=$PWD/.tilelang_cache
else
  JIT_CACHE=$(mktemp -d /tmp/foldkv_jit_cache_XXXXXX)  # fresh and empty: never the carried one
  trap 'rm -rf "$JIT_CACHE"' EXIT
fi
export PYTHONPATH=$PWD/lib:$PYTHONPATH TILELANG_CACHE_DIR=$JIT_CACHE FOLDKV_AOT_DIR=$PWD/build/aot
export FOLDKV_JIT_CACHE_MODE=$CACHE_MODE FOLDKV_JIT_BUILD_RECORD=$OUTD/jit_build.json
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUTD/gpu.txt"
t0=$(date +%s)
J=${JIT_S:-120}; A=${PHASE_A_S:-450}; B=${PHASE_B_S:-450}  # the GPU suite ~450 s; notebook 04 ~380 s with its drawn
# cells on a fresh machine, FlashInfer's JIT modules built in its first section (s20: 330 s stopped it in its prefill)
BATCH="python3 scripts/run_batch.py --tag $TAG --no-progress --log-output"  # cell output in each batch_*.log
# BATCH_PARAMS: run_batch's --params, JSON without spaces ({"07":{...}}): a run shorter than the defaults
[ -n "${BATCH_PARAMS:-}" ] && BATCH="$BATCH --params $BATCH_PARAMS"

timeout $J python3 scripts/jit_build_all.py --record "$FOLDKV_JIT_BUILD_RECORD" > "$OUTD/jit_build.log" 2>&1
echo "jit build rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/jit_build.log")"

PART=${PART:-all}
if [ "$PART" = all ] || [ "$PART" = 1 ]; then
(FOLDKV_REQUIRE_GPU=1 FOLDKV_GATE_CASES=smoke FOLDKV_AOT_TEST_DIR=$PWD/build/aot \
   FOLDKV_AOT_TP2_TEST_DIR=$PWD/build/aot-tp2 timeout $A \
   python3 -m pytest -m gpu -v -ra --tb=short -p no:cacheprovider > "$OUTD/pytest_gpu.log" 2>&1; echo "pytest rc=$?" >> "$OUTD/pytest_gpu.log") &
(timeout $A python3 scripts/run_batch.py --only 04 --smoke --out-root /tmp/smoke --tag s --no-progress \
   --params '{"04": {"mode": "gpu", "aot_dir": "build/aot"}}' > "$OUTD/nb04_smoke.log" 2>&1) &
(timeout $A $BATCH --only 03 --params '{"03": {"kernel_backend": "jit"}}' > "$OUTD/batch_03.log" 2>&1) &
timeout $A $BATCH --only 01 > "$OUTD/batch_01.log" 2>&1
wait
echo "phase A (GPU tests, 01, 03, 04 smoke) done at $(( $(date +%s) - t0 )) s"
fi

if [ "$PART" = all ] || [ "$PART" = 2 ] || [ "$PART" = 2a ]; then
# alone: its full-length gates hold ~85 GB at their peak
timeout $A $BATCH --only 02 --params '{"02": {"aot_dir": "build/aot", "sanitizer_timeout_s": 240}}' > "$OUTD/batch_02.log" 2>&1
echo "batch 02 rc=$? at $(( $(date +%s) - t0 )) s"
fi
if [ "$PART" = all ] || [ "$PART" = 2 ] || [ "$PART" = 2b ]; then
# alone: nothing else shares the GPU while it times
timeout $B $BATCH --only 04 --params '{"04": {"mode": "gpu", "aot_dir": "build/aot",
   "prefill_contexts": [16384, 81653, 163336]}}' \
   > "$OUTD/batch_04.log" 2>&1
echo "batch 04 rc=$? at $(( $(date +%s) - t0 )) s"
fi

if [ "$PART" = all ] || [ "$PART" = 3 ]; then  # alone: it times generate()
timeout ${C:-200} $BATCH --only 05 > "$OUTD/batch_05.log" 2>&1
echo "batch 05 rc=$? at $(( $(date +%s) - t0 )) s"
fi
if [ "$PART" = all ] || [ "$PART" = 4 ]; then  # alone: it times the first token
timeout ${D:-510} $BATCH --only 07 > "$OUTD/batch_07.log" 2>&1
echo "batch 07 rc=$? at $(( $(date +%s) - t0 )) s"
fi
if [ "$PART" = tp ]; then  # a machine of two GPUs (nvidia-h200-x2): notebook 06 alone, its three runs in turn
NCCL_NVLS_ENABLE=0 timeout ${TP_S:-560} $BATCH --only 06 > "$OUTD/batch_06.log" 2>&1
echo "batch 06 rc=$? at $(( $(date +%s) - t0 )) s"
fi
$BATCH --summarize > /dev/null 2>&1
cp "$FOLDKV_JIT_BUILD_RECORD" papermill_runs/"$TAG"/jit_build_part$PART.json 2>/dev/null
tar -czf "$OUTD/runs.tgz" papermill_runs/"$TAG"
tail -4 "$OUTD/pytest_gpu.log" 2>/dev/null; cat papermill_runs/"$TAG"/SUMMARY.md 2>/dev/null
# a device call's reply brings back at most 8 files from $OUT: this part's logs travel as one
logs=$(cd "$OUTD" && ls gpu.txt jit_build.json jit_build.log pytest_gpu.log nb04_smoke.log batch_*.log 2>/dev/null || true)
if [ -n "$logs" ]; then
  (cd "$OUTD" && tar -czf "logs_part$PART.tgz" $logs && rm -f $logs)
fi
