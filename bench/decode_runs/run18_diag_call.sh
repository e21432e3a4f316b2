set -u
source .devsite/env.sh
export PYTHONPATH=$PWD/lib:$PYTHONPATH TILELANG_CACHE_DIR=/tmp/tlc FOLDKV_AOT_DIR=$PWD/build/aot PYTHONUNBUFFERED=1
OUTD=$OUT; t0=$(date +%s)
timeout 70 python3 scripts/jit_build_all.py --workers 14 > $OUTD/jit.log 2>&1; echo "jit rc=$? $(( $(date +%s) - t0 )) s"
(sleep 270; nvidia-smi --query-gpu=utilization.gpu,clocks.sm,memory.used,power.draw --format=csv > $OUTD/smi_stall.txt; nvidia-smi >> $OUTD/smi_stall.txt) &
OV='{"mode": "gpu", "aot_dir": "build/aot", "sections": ["single", "sweep"], "out_dir": "/tmp/nb", "DUMP_S": 25}'
timeout -s ABRT 300 python3 -X faulthandler bench/notebook_cells.py notebooks/04_benchmarks.ipynb 2,4,6 "$OV" > $OUTD/diag.log 2>&1
echo "nb rc=$? $(( $(date +%s) - t0 )) s"; wait
tr '\r' '\n' < $OUTD/diag.log | grep -v "^\s*$" | grep -v "threading.py\|_monitor.py" | tail -45
head -3 $OUTD/smi_stall.txt
