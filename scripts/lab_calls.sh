#!/usr/bin/env bash
# The lab's measurements whose predictions are written and not yet run on the H200, a device call a PART (each under
# the call's 600 s), logs and JSON into $OUT. The predictions and what proves each wrong are in the notes:
#   PART=tests    the GPU tests of the pending versions and of the library code not yet run on the GPU (~3-4 min)
#   PART=probe    the 31B step at 4K x 1, 4K x 8, 32K x 1: the library, its global prologue off (run 23's A/B), the
#                 stop check on a side stream (bench/MODEL_DECODE_NOTES.md run 26), the ring attention on two
#                 branches (run 28), the greedy pick in two launches (run 29), o_proj's first rows read into L2
#                 beside the ring attention (run 27); then o_proj at one row with an L2-resident weight prefix
#                 (run 27's first measurement, bench/l2_prefix_probe.py) (~4-5 min)
#   PART=ring     a sliding layer's ring attention against foldkv's and FlashInfer's decode and a plain read of its
#                 bytes at batch 1 and 8 (run 30's first measurement, bench/ring_probe.py; foldkv's arms first, in
#                 case FlashInfer compiles for long) (~2-4 min: beside notebook 05's call)
#   PART=kernels  the FP8 version's GPU test, then the FP8 partial over a pre-transposed V_rot and the FP8 step's
#                 merges (bench/FP8_NOTES.md run 21), then many short requests at two CTAs an SM
#                 (bench/DECODE_NOTES.md run 22) and the 31B step's global decode shapes (run 22b) (~6-8 min)
#   PART=step_ab  the GPU tests of the runtime that the layering, the reset and the fused prefill touched, then the
#                 31B decode step at 4K x 1, 32K x 8 and 128K x 8 at the commit before the layering (its lib/ and bench/
#                 carried in $BEFORE, .before/ by default: `git archive ba2118d lib bench | tar -x -C .before`) and at this one, in turn
#                 (~5-6 min; AB_TESTS, AB_CELLS: other test files and cells; AB_JIT_S: the kernels built side by side
#                 first, under that cap)
#   PART=prefill  time to first token of the 31B through generate(): every arm's kernels built into an empty cache
#                 (warm), first use in a fresh process with warm caches (new prompt lengths, then under cProfile: where
#                 it goes), one profiled 16K prefill by component, steady-state TTFT at 4K and 32K (every arm,
#                 rotated) and 128K (folded) (bench/prefill_probe.py; bench/PREFILL_NOTES.md "Time to first token")
#                 (~7-9 min)
#   PART=prefill_ab  the prefill's two step options (merge_prefill off, fuse_prefill_norm_rope on) against the served
#                 prefill at 32K (folded, rotated, 3 rounds; bench/PREFILL_NOTES.md's two predictions), their GPU tests,
#                 the served 16K profile by component, and the short last chunk's first use under cProfile (4,096 then
#                 4,100 tokens, twice) (~5-6 min)
#   PART=ttft_ab  the served prefill at this commit against the commit whose lib/ and bench/ are carried in .before/
#                 (`git archive <rev> lib bench | tar -x -C .before`): time to first token of 32,768 and 4,100 tokens
#                 (folded, 3 rounds, each side in its own process; this side also 32,768 with `sliding_scratch` on;
#                 AB_TTFT_CELLS and AB_ROUNDS: other cells, as the same cells on both sides), first use in a fresh process (4,096 and 4,100 twice,
#                 then new lengths), the 16K profile by component, then the GPU tests of the prefill's path
#                 (bench/PREFILL_NOTES.md "Prediction: a prefill without host syncs...") (~8-9 min)
#   PART=prefill_kernels  the global prefill's versions (two stages, batched reductions, lazy rescale) against the
#                 library's folded and split prefill: checked against float64, then a 4,096-query chunk over 8K and 32K
#                 against the in-run matmul rate (bench/prefill_kernel_probe.py; bench/PREFILL_NOTES.md) (~3-4 min)
#   PART=multiwave  the folded decode partial of multi-wave plans against split's and their plain reads, with the
#                 versions that test each cause (bench/multiwave_probe.py; bench/DECODE_NOTES.md run 23): on the H100,
#                 where folded runs 1.33-1.52x its read (~4-5 min)
#   PART=tile_sweep  the paged read alone (no attention, no TileLang) of tiles at 40-320 KB, one stream or a page's
#                 four, page-major or head-major in groups of four pages, today's tile padded or at split's addresses,
#                 each against the streaming read of the same bytes in one interleaved cell (bench/multiwave_probe.py
#                 --tile-sweep; bench/DECODE_NOTES.md run 24): on the H100 (~1 min)
#   PART=window_kernel  the sliding layers' prefill attention as a TileLang kernel
#                 (bench/versions/window_attention_tilelang.py): its GPU test against float64 (hostile cases, a red
#                 twin), then bench/window_kernel_probe.py: the same cases per arm, then a 4,096-query chunk at S =
#                 4,096 and 5,119 against FlashAttention-2's window (bench/PREFILL_NOTES.md "Prediction: the sliding
#                 window as a TileLang kernel") (~3-5 min: three kernels built, each case checked a head at a time)
#   PART=scratch_ab  the sliding layers' K/V in one scratch (`sliding_scratch`) against the served concatenation: the
#                 GPU tests of the stores' aligned uploads and of the scratch, then TTFT at 32K (3 rounds) and 128K (1
#                 round), folded, rotated; the 16K profile of both; then the process's first prompt located: a fresh
#                 process's 4,096 twice under cProfile, and again with every CUDA module loaded at start
#                 (CUDA_MODULE_LOADING=EAGER: if its first prompt pays nothing, lazy module loading is what it paid)
#                 (bench/PREFILL_NOTES.md "Prediction (written before its run): the sliding layers' prefill K/V...") (~8-9 min)
#   PART=runtime_check  after a change of the runtime's host code: the kernels built side by side first (jit_build_all,
#                 JIT_S), the GPU tests of what changed (RC_TESTS), then a fresh process's first prompts under the
#                 profiler (`prefill_probe.py first --launches`: the longest launch calls of each prompt and the kernel
#                 each launched) and the served TTFT at 4K and 32K (folded, 3 rounds; RC_CELLS: more ARM:PROMPT cells,
#                 the arms rotated; RC_ROUNDS rounds, 3) and, with RC_LONG cells, those once each, without the untimed
#                 call (LONG_S) (~8-9 min)
#   PART=prefill_version  a folded prefill version of bench/versions/ (VERSION, default prefill_folded_seesaw_async;
#                 its probe arm PV_ARM, default seesaw_async) against the library: the kernel probe's gate and its two
#                 cells, then TTFT through generate() at 32K and 128K (PV_CELLS) with the version served
#                 (bench/serve_version.py) and without it, each its own process, then the GPU prefill and hf tests with
#                 it served (the wrapper prints each build, -s) (~7-9 min on the H200)
# (The 31B step's runs 22-25 were measured at 9f9ef77: papermill_runs/h200-20261205-s27.)
# Prepare on the CPU machine first: scripts/prepare_device_run.sh (carry .devsite build/aot build/checkout.json).
#
#   PART=kernels bash scripts/lab_calls.sh    # on the device machine, repo root
set -u
OUTD=${OUT:-/tmp/foldkv_out}
mkdir -p "$OUTD"
source .devsite/env.sh
JIT_CACHE=$(mktemp -d /tmp/foldkv_jit_cache_XXXXXX)
trap 'rm -rf "$JIT_CACHE"' EXIT
export PYTHONPATH=$PWD/lib:$PYTHONPATH TILELANG_CACHE_DIR=$JIT_CACHE FOLDKV_AOT_DIR=$PWD/build/aot PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUTD/gpu.txt"
cp build/checkout.json "$OUTD/" 2>/dev/null  # the commit (the device copy's own git metadata can be stale)
t0=$(date +%s)
PART=${PART:-tests}
BEFORE=${BEFORE:-.before}  # the earlier commit's lib/ and bench/ of the A/B parts (ttft_ab, step_ab)

if [ "$PART" = tests ]; then
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-540} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    tests/test_fused_step_gpu.py tests/test_fused_step_sliding_gpu.py tests/test_global_prologue_gpu.py \
    tests/test_global_step_gpu.py tests/test_loop_tail_side_stream_gpu.py \
    tests/test_ring_attention_branched_gpu.py tests/test_greedy_pick_fused_gpu.py tests/test_oproj_l2_prefetch_gpu.py \
    > "$OUTD/pytest_lab.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/pytest_lab.log")"
fi

if [ "$PART" = probe ]; then
  timeout ${PROBE_S:-420} python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 \
    foldkv-folded:32768:1 --global-prologue-ab --loop-tail-ab --ring-branch-ab --greedy-pick-ab --l2-prefetch-ab \
    > "$OUTD/probe_lab.log" 2>&1
  echo "probe rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "^(library|global|stop|ring|greedy|o_proj)" "$OUTD/probe_lab.log" | head -30  # probe.json: the probe writes it into $OUT
  timeout ${L2_S:-120} python3 bench/l2_prefix_probe.py > "$OUTD/l2_prefix.log" 2>&1  # run 27's first measurement
  echo "l2 prefix rc=$? at $(( $(date +%s) - t0 )) s"; tail -12 "$OUTD/l2_prefix.log"
fi

if [ "$PART" = ring ]; then
  timeout ${RING_S:-120} python3 bench/ring_probe.py --batches 1 8 --arms ring_cublas split_jit split_graph read_split \
    > "$OUTD/ring_probe_foldkv.log" 2>&1
  echo "ring probe (foldkv, read) rc=$? at $(( $(date +%s) - t0 )) s"; tail -10 "$OUTD/ring_probe_foldkv.log"
  timeout ${RING_FI_S:-150} python3 bench/ring_probe.py --batches 1 8 > "$OUTD/ring_probe.log" 2>&1
  echo "ring probe rc=$? at $(( $(date +%s) - t0 )) s"; tail -10 "$OUTD/ring_probe.log"
fi

if [ "$PART" = kernels ]; then
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-150} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    tests/test_fp8_tc_vrot_gpu.py > "$OUTD/pytest_kernels.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/pytest_kernels.log")"
  (cd bench && timeout ${FP8_S:-300} python3 fp8_harness.py --no-flashinfer --rounds 5 --single 81653 163336 \
     --batches uniform8 uniform32 --arms folded_jit folded_fp8_jit fp8_tc_vrot fp8_tc_partial_only read_folded \
     read_folded_fp8 --json "$OUTD/fp8_vrot.json" > "$OUTD/fp8_vrot.log" 2>&1
   echo "fp8 vrot rc=$? at $(( $(date +%s) - t0 )) s"
   timeout ${FP8_L2_S:-90} python3 fp8_harness.py --no-flashinfer --rounds 5 --single 163336 --batches \
     --resident-pages 32 --arms folded_jit folded_fp8_jit fp8_tc_vrot --json "$OUTD/fp8_vrot_l2.json" \
     > "$OUTD/fp8_vrot_l2.log" 2>&1
   echo "fp8 vrot L2 rc=$? at $(( $(date +%s) - t0 )) s"
   timeout ${PLAN_S:-200} python3 plan_harness.py --rounds 10 --draw 920385503 \
     --only drawn920385503/short_many step4k_x8 step4k_x1 step32k_x1 drawn920385503/uniform24 uniform128 longtail64 \
     --two-ctas --host-batches \
     --json "$OUTD/plan_2cta.json" > "$OUTD/plan_2cta.log" 2>&1
   echo "plan 2cta rc=$? at $(( $(date +%s) - t0 )) s")
  tail -12 "$OUTD/fp8_vrot.log" "$OUTD/fp8_vrot_l2.log" "$OUTD/plan_2cta.log"
fi

if [ "$PART" = prefill ]; then  # one TileLang cache for the call's processes: warm fills it, the others find it warm
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-150} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    tests/test_prefill_fused_gpu.py tests/test_fused_step_gpu.py tests/test_first_use_gpu.py > "$OUTD/prefill_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/prefill_pytest.log")"
  P="python3 bench/prefill_probe.py --out $OUTD"
  N=foldkv-folded; S=foldkv-split; L=1:8192  # the first-use cells: chunks of 8,192 (a new length is the last chunk's)
  FIRST="$N:12000:$L $N:12000:$L $S:12001:$L $N:12001:$L $N:17000:$L $S:17000:$L $N:4096 $N:4100 $S:4100 $N:12002:$L"
  timeout ${WARM_S:-120} $P warm --arms $N $S foldkv-fp8 flashinfer sdpa > "$OUTD/prefill_warm.log" 2>&1
  echo "warm rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ +[0-9]+:" "$OUTD/prefill_warm.log"
  timeout ${FIRST_S:-50} $P first --cells $FIRST > "$OUTD/prefill_first.log" 2>&1
  echo "first rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ +[0-9]+:" "$OUTD/prefill_first.log"
  timeout ${PROF_S:-45} $P profile --cells $N:16384 --trace trace16k.json.gz > "$OUTD/prefill_profile.log" 2>&1
  echo "profile rc=$? at $(( $(date +%s) - t0 )) s"; grep chunk "$OUTD/prefill_profile.log"
  TT="$N:4096 $S:4096 foldkv-fp8:4096 flashinfer:4096 sdpa:4096 $N:32768 $S:32768 foldkv-fp8:32768 flashinfer:32768"
  timeout ${TTFT_S:-150} $P ttft --rounds 2 --budget-s 140 --cells $TT sdpa:32768 > "$OUTD/prefill_ttft.log" 2>&1
  echo "ttft rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul" "$OUTD/prefill_ttft.log"
  mv "$OUTD/prefill_ttft_window_fused.json" "$OUTD/prefill_ttft_4k32k.json" 2>/dev/null
  timeout ${UNFUSED_S:-45} $P ttft --glue unfused --rounds 2 --cells $N:4096 $N:32768 \
    > "$OUTD/prefill_ttft_unfused.log" 2>&1  # transformers' modules for the glue: what served before, same call
  echo "ttft (unfused glue) rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round" "$OUTD/prefill_ttft_unfused.log"
  timeout ${LONG_S:-50} $P ttft --rounds 1 --no-untimed --cells $N:131072 > "$OUTD/prefill_ttft128k.log" 2>&1
  echo "ttft 128K rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round" "$OUTD/prefill_ttft128k.log"
  (cd "$OUTD" && tar -czf prefill_logs.tgz prefill_*.log prefill_*.json && rm -f prefill_*.log prefill_*.json)
fi

if [ "$PART" = prefill_ab ]; then  # one TileLang cache: the ttft cells build the prefill kernels, the rest load them
  P="python3 bench/prefill_probe.py --out $OUTD"; N=foldkv-folded
  timeout ${AB_TTFT_S:-200} $P ttft --rounds 3 --budget-s 190 --cells $N:32768 $N:32768@fuse_prefill_norm_rope=1 \
    $N:32768@merge_prefill=0 $N:32768@merge_prefill=0,fuse_prefill_norm_rope=1 > "$OUTD/prefill_ab_ttft.log" 2>&1
  echo "ttft A/B rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul" "$OUTD/prefill_ab_ttft.log"
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-120} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    tests/test_prefill_fused_gpu.py tests/test_first_use_gpu.py > "$OUTD/prefill_ab_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/prefill_ab_pytest.log")"
  timeout ${PROF_S:-60} $P profile --cells $N:16384 $N:16384@merge_prefill=0,fuse_prefill_norm_rope=1 \
    > "$OUTD/prefill_ab_profile.log" 2>&1
  echo "profile rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "chunk|did not" "$OUTD/prefill_ab_profile.log"
  timeout ${FIRST_S:-50} $P first --cprofile --cells $N:4096 $N:4100 $N:4096 $N:4100 > "$OUTD/prefill_ab_first.log" 2>&1
  echo "first rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ +[0-9]+:" "$OUTD/prefill_ab_first.log"
fi

if [ "$PART" = ttft_ab ]; then  # one TileLang cache: the first process builds the prefill kernels, the rest load them
  N=foldkv-folded
  for side in after before; do
    if [ $side = before ]; then PP="$PWD/$BEFORE/lib:${PYTHONPATH#$PWD/lib:}"; B=$BEFORE/bench; else PP=$PYTHONPATH; B=bench; fi
    mkdir -p "$OUTD/$side"
    S=""; [ $side = after ] && S="$N:32768@sliding_scratch=1"  # this commit's option, in the same rotation
    PYTHONPATH=$PP timeout ${AB_S:-130} python3 $B/prefill_probe.py --out "$OUTD/$side" ttft --rounds ${AB_ROUNDS:-3} \
      --cells ${AB_TTFT_CELLS:-$N:32768 $S $N:4100} > "$OUTD/ttft_ab_$side.log" 2>&1
    echo "$side rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul" "$OUTD/ttft_ab_$side.log"
  done
  timeout ${FIRST_S:-60} python3 bench/prefill_probe.py --out "$OUTD" first --cells $N:4096 $N:4100 $N:4096 $N:4100 \
    $N:5000 $N:300 $N:12001:1:8192 > "$OUTD/ttft_ab_first.log" 2>&1
  echo "first rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ +[0-9]+:" "$OUTD/ttft_ab_first.log"
  timeout ${PROF_S:-50} python3 bench/prefill_probe.py --out "$OUTD" profile --cells $N:16384 \
    > "$OUTD/ttft_ab_profile.log" 2>&1
  echo "profile rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "chunk|did not" "$OUTD/ttft_ab_profile.log"
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-170} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    ${AB_TESTS:-tests/test_prefill_fused_gpu.py tests/test_first_use_gpu.py tests/test_sliding_cache_gpu.py tests/test_hf_gpu.py} \
    > "$OUTD/ttft_ab_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/ttft_ab_pytest.log")"
fi

if [ "$PART" = step_ab ]; then  # one TileLang cache: the second commit's unchanged kernels load from it
  if [ -n "${AB_JIT_S:-}" ]; then  # the kernels the tests build, side by side first (else each test compiles in turn)
    timeout $AB_JIT_S python3 scripts/jit_build_all.py > "$OUTD/step_ab_jit.log" 2>&1
    echo "jit build rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/step_ab_jit.log")"
  fi
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-170} python3 -m pytest -q ${AB_X--x} -ra --tb=short -p no:cacheprovider \
    ${AB_TESTS:-tests/test_hf_gpu.py tests/test_fused_step_gpu.py tests/test_prefill_fused_gpu.py \
    tests/test_window_attention_gpu.py} -k "not against_float64" > "$OUTD/step_ab_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/step_ab_pytest.log")"
  CELLS="--decode ${AB_CELLS:-foldkv-folded:4096:1 foldkv-folded:32768:8 foldkv-folded:131072:8}"  # notebook 05's cells of the 1% check
  for side in before after; do
    if [ $side = before ]; then PP="$PWD/$BEFORE/lib:${PYTHONPATH#$PWD/lib:}"; B=$BEFORE/bench; else PP=$PYTHONPATH; B=bench; fi
    PYTHONPATH=$PP timeout ${AB_S:-150} python3 $B/model_decode_probe.py $CELLS > "$OUTD/step_ab_$side.log" 2>&1
    echo "$side rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "foldkv-folded [0-9]+ x [0-9]+: TPOT" "$OUTD/step_ab_$side.log"
  done
fi

if [ "$PART" = prefill_kernels ]; then
  timeout ${PK_S:-260} python3 bench/prefill_kernel_probe.py --out "$OUTD" > "$OUTD/prefill_kernel_probe.log" 2>&1
  echo "prefill kernels rc=$? at $(( $(date +%s) - t0 )) s"; tail -${TAIL:-30} "$OUTD/prefill_kernel_probe.log"
fi

if [ "$PART" = multiwave ]; then
  timeout ${MW_S:-330} python3 bench/multiwave_probe.py --out "$OUTD" --budget-s ${MW_BUDGET_S:-240} \
    > "$OUTD/multiwave_probe.log" 2>&1
  echo "multiwave rc=$? at $(( $(date +%s) - t0 )) s"; tail -${TAIL:-60} "$OUTD/multiwave_probe.log"
fi

if [ "$PART" = tile_sweep ]; then
  timeout ${TS_S:-100} python3 bench/multiwave_probe.py --tile-sweep --out "$OUTD" --rounds ${TS_ROUNDS:-20} \
    > "$OUTD/tile_sweep.log" 2>&1
  echo "tile sweep rc=$? at $(( $(date +%s) - t0 )) s"; tail -${TAIL:-30} "$OUTD/tile_sweep.log"
fi

if [ "$PART" = window_kernel ]; then  # one TileLang cache: the test builds the kernels, the probe loads them
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-240} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    tests/test_window_kernel_gpu.py > "$OUTD/window_kernel_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/window_kernel_pytest.log")"
  timeout ${WK_S:-300} python3 bench/window_kernel_probe.py --out "$OUTD" > "$OUTD/window_kernel_probe.log" 2>&1
  echo "window kernel probe rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "FAIL|rror|^  T=|built|check done|matmul|done at" "$OUTD/window_kernel_probe.log" | tail -${TAIL:-40}
fi

if [ "$PART" = scratch_ab ]; then  # one TileLang cache: the tests build the prefill kernels, the rest load them
  N=foldkv-folded; P="python3 bench/prefill_probe.py --out $OUTD"
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-150} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    tests/test_first_use_gpu.py tests/test_sliding_cache_gpu.py > "$OUTD/scratch_ab_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/scratch_ab_pytest.log")"
  timeout ${AB_S:-110} $P ttft --rounds 3 --cells $N:32768 $N:32768@sliding_scratch=1 > "$OUTD/scratch_ab_32k.log" 2>&1
  echo "32K rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul" "$OUTD/scratch_ab_32k.log"
  mkdir -p "$OUTD/first"
  timeout ${FIRST_S:-45} $P first --cprofile --cells $N:4096 $N:4096 > "$OUTD/scratch_ab_first.log" 2>&1
  echo "first rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ +[0-9]+:" "$OUTD/scratch_ab_first.log"
  CUDA_MODULE_LOADING=EAGER timeout ${FIRST_S:-45} python3 bench/prefill_probe.py --out "$OUTD/first" first \
    --cells $N:4096 $N:4096 > "$OUTD/scratch_ab_first_eager.log" 2>&1
  echo "first (eager modules) rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ +[0-9]+:" "$OUTD/scratch_ab_first_eager.log"
  timeout ${PROF_S:-60} $P profile --cells $N:16384 $N:16384@sliding_scratch=1 > "$OUTD/scratch_ab_profile.log" 2>&1
  echo "profile rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "chunk|did not" "$OUTD/scratch_ab_profile.log"
  mkdir -p "$OUTD/long"
  timeout ${LONG_S:-110} python3 bench/prefill_probe.py --out "$OUTD/long" ttft --rounds 1 --no-untimed \
    --cells $N:131072 $N:131072@sliding_scratch=1 > "$OUTD/scratch_ab_128k.log" 2>&1
  echo "128K rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul" "$OUTD/scratch_ab_128k.log"
  (cd "$OUTD" && tar -czf scratch_ab.tgz scratch_ab_*.log prefill_*.json first long *.json.gz 2>/dev/null)
fi

if [ "$PART" = runtime_check ]; then  # one TileLang cache: built side by side first, the rest load it
  N=foldkv-folded; P="python3 bench/prefill_probe.py --out $OUTD"
  timeout ${JIT_S:-150} python3 scripts/jit_build_all.py > "$OUTD/rc_jit.log" 2>&1
  echo "jit build rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/rc_jit.log")"
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-300} python3 -m pytest -q -ra --tb=short -p no:cacheprovider \
    ${RC_TESTS:-tests/test_workspace_gpu.py tests/test_first_use_gpu.py tests/test_hf_gpu.py} > "$OUTD/rc_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/rc_pytest.log")"; grep -E "^(FAILED|ERROR)" "$OUTD/rc_pytest.log" | head -20
  mkdir -p "$OUTD/first"
  timeout ${FIRST_S:-60} python3 bench/prefill_probe.py --out "$OUTD/first" first --launches --cells $N:4096 $N:4096 \
    > "$OUTD/rc_first.log" 2>&1
  echo "first rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ +[0-9]+:|^ +[0-9.]+ ms" "$OUTD/rc_first.log"
  timeout ${AB_S:-100} $P ttft --rounds ${RC_ROUNDS:-3} --cells $N:32768 $N:4096 ${RC_CELLS:-} > "$OUTD/rc_ttft.log" 2>&1
  echo "ttft rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul" "$OUTD/rc_ttft.log"
  if [ -n "${RC_LONG:-}" ]; then  # long prompts: one round, no untimed call (first use is paid at cache creation)
    mkdir -p "$OUTD/long"
    timeout ${LONG_S:-150} python3 bench/prefill_probe.py --out "$OUTD/long" ttft --rounds 1 --no-untimed \
      --cells $RC_LONG > "$OUTD/rc_long.log" 2>&1
    echo "long rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul" "$OUTD/rc_long.log"
  fi
  (cd "$OUTD" && tar -czf runtime_check.tgz rc_*.log prefill_*.json first long 2>/dev/null)
fi

if [ "$PART" = prefill_version ]; then  # one TileLang cache: the probe builds both kernels, the rest load them
  V=${VERSION:-prefill_folded_seesaw_async}
  timeout ${PK_S:-120} python3 bench/prefill_kernel_probe.py --out "$OUTD" --arms library_folded ${PV_ARM:-seesaw_async} \
    > "$OUTD/prefill_version_probe.log" 2>&1
  echo "probe rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "gate|prefill_4096|matmul" "$OUTD/prefill_version_probe.log" | grep -v INFO
  for side in version library; do
    mkdir -p "$OUTD/$side"; W=""; [ $side = version ] && W="bench/serve_version.py prefill_folded=$V --"
    timeout ${AB_S:-200} python3 $W bench/prefill_probe.py --out "$OUTD/$side" ttft --rounds ${AB_ROUNDS:-2} \
      --cells ${PV_CELLS:-foldkv-folded:32768 foldkv-folded:131072} > "$OUTD/prefill_version_ttft_$side.log" 2>&1
    echo "$side rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "round|matmul|serve_version" "$OUTD/prefill_version_ttft_$side.log"
  done
  PM=$(python3 -c "import os, pytest; print(os.path.join(os.path.dirname(pytest.__file__), '__main__.py'))")
  FOLDKV_REQUIRE_GPU=1 timeout ${TESTS_S:-200} python3 bench/serve_version.py prefill_folded=$V -- $PM -q -s -ra \
    --tb=short -p no:cacheprovider tests/test_prefill_gpu.py tests/test_prefill_fused_gpu.py tests/test_hf_gpu.py \
    -k "not bench_version" > "$OUTD/prefill_version_pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUTD/prefill_version_pytest.log"); builds served:" \
    "$(grep -c '\[serve_version\]' "$OUTD/prefill_version_pytest.log")"
fi
