#!/usr/bin/env bash
# The device call of run 15 as it ran (bench/DECODE_NOTES.md); probe/ held what is now bench/notebook_cells.py and
# bench/ncu_fused_step.py, and probe/r13 was `git archive 8da4ed7 lib notebooks` with s11's build/aot as probe/r13/aot.
# Diagnosis call: (1) notebook 04's sweep cells on main's lib, (2) the same on 8da4ed7's lib (run 13's hand-off, its
# AOT build) under a timeout with stack dumps, (3) ncu of the library's fused step and the LL version at 10,602.
set -u
source .devsite/env.sh
export TILELANG_CACHE_DIR=/tmp/tlc PYTHONUNBUFFERED=1
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
t0=$(date +%s)
PYTHONPATH=$PWD/lib:$PYTHONPATH timeout 100 python3 scripts/jit_build_all.py --workers 14 > $OUTD/jit.log 2>&1
echo "jit rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 $OUTD/jit.log)"
OV='{"mode": "gpu", "aot_dir": "build/aot", "sections": ["sweep"], "out_dir": "/tmp/nb_main", "DUMP_S": 30}'
PYTHONPATH=$PWD/lib:$PYTHONPATH timeout ${MAIN_S:-120} python3 -X faulthandler probe/nb_cells.py notebooks/04_benchmarks.ipynb 2,4,6 "$OV" > $OUTD/main_sweep.log 2>&1
echo "main sweep rc=$? $(( $(date +%s) - t0 )) s"; grep "=== cell" $OUTD/main_sweep.log
OV='{"mode": "gpu", "aot_dir": "probe/r13/aot", "sections": ["sweep"], "out_dir": "/tmp/nb_r13", "DUMP_S": 30}'
PYTHONPATH=$PWD/probe/r13/lib:$PYTHONPATH timeout -s ABRT ${R13_S:-150} python3 -X faulthandler probe/nb_cells.py probe/r13/notebooks/04_benchmarks.ipynb 2,4,6 "$OV" > $OUTD/r13_sweep.log 2>&1
echo "r13 sweep rc=$? $(( $(date +%s) - t0 )) s"; grep "=== cell\|sweep:" $OUTD/r13_sweep.log | tail -5
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
export PYTHONPATH=$PWD/lib:$PYTHONPATH
for w in lib ll ll_no_wait; do
  timeout 60 python3 probe/ncu_tail.py $w 10602 5 400 >> $OUTD/timing.txt 2>&1
  timeout 100 $NCU --clock-control none -k regex:decode_fused --launch-skip 4 --launch-count 1 --section SpeedOfLight \
    --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section SourceCounters python3 probe/ncu_tail.py $w 10602 5 > $OUTD/ncu_$w.txt 2>&1
  echo "ncu $w rc=$? $(( $(date +%s) - t0 )) s"
done
cat $OUTD/timing.txt
grep -i "Duration\|Elapsed Cycles\|Registers Per\|Achieved Occ" $OUTD/ncu_*.txt
