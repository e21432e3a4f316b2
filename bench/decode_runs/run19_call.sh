# DECODE_NOTES run 19 (one device call): (1) does a device trap reach the host here (bench/trap_probe.py);
# (2) notebook 04's single + sweep cells on main's lib (the flag hand-off), then on dbc39ce's (run 13's one-atomic
# hand-off, which hung s12 and run 18), each under a watcher: no output for 30 s in the sweep (or the cell limit) is
# a hang, and then nvidia-smi and cuda-gdb attached (which kernels are resident, where their warps' PCs are) say where.
set -u
source .devsite/env.sh
BASEPP=$PYTHONPATH
export PYTHONUNBUFFERED=1
OUTD=$OUT; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
timeout 90 python3 bench/trap_probe.py > $OUTD/trap.log 2>&1; echo "trap rc=$? at $(el)"; cat $OUTD/trap.log
nvidia-smi --query-gpu=utilization.gpu,clocks.sm,power.draw --format=csv,noheader

diag() {  # NAME PID
  nvidia-smi --query-gpu=utilization.gpu,clocks.sm,power.draw,memory.used --format=csv > $OUTD/$1_smi.txt
  G="-ex 'set pagination off' -ex 'info cuda kernels' -ex 'info cuda sms' -ex 'info cuda warps' -ex 'x/12i \$pc'"
  for s in 0 1 2 7 33 66 99 131; do G="$G -ex 'cuda sm $s' -ex 'info cuda warps' -ex 'x/4i \$pc'"; done
  G="$G -ex 'info cuda blocks' -ex 'detach'"
  eval timeout 150 cuda-gdb -q -batch -p $2 $G > $OUTD/$1_gdb.txt 2>&1; echo "  cuda-gdb rc=$? at $(el)"
  head -c 3000 $OUTD/$1_gdb.txt | grep -v "^\s*$" | head -40
}

watch_nb() {  # NAME LIBDIR NOTEBOOK AOTDIR SCRIPTSDIR LIMIT_S
  local name=$1 lib=$2 nb=$3 aot=$4 scr=$5 lim=$6 log=$OUTD/$1_nb.log
  export PYTHONPATH=$lib:$BASEPP TILELANG_CACHE_DIR=/tmp/tlc_$1 FOLDKV_AOT_DIR=$aot
  timeout 80 python3 $scr/jit_build_all.py --workers 14 > $OUTD/$1_jit.log 2>&1; echo "$name jit rc=$? at $(el): $(tail -1 $OUTD/$1_jit.log)"
  local ov='{"mode": "gpu", "aot_dir": "'$aot'", "sections": ["single", "sweep"], "out_dir": "/tmp/nb_'$name'", "DUMP_S": 900}'
  python3 -X faulthandler bench/notebook_cells.py $nb 2,4,6 "$ov" > $log 2>&1 &
  local pid=$! ts=$(date +%s) last=-1 lastt=$(date +%s) hung=0
  while kill -0 $pid 2>/dev/null; do
    sleep 5; local now=$(date +%s) sz=$(stat -c %s $log)
    [ "$sz" != "$last" ] && { last=$sz; lastt=$now; }
    if grep -q "=== cell 6 start" $log && [ $((now - lastt)) -ge 30 ]; then hung=1; break; fi
    [ $((now - ts)) -ge $lim ] && { hung=2; break; }
  done
  echo "$name: hung=$hung at $(el)"
  [ $hung != 0 ] && { diag $name $pid; kill -9 $pid; sleep 3; }
  wait $pid 2>/dev/null
  tr '\r' '\n' < $log | grep -v "^\s*$" | grep "=== cell\|sweep:\|Error\|error\|ok\b" | tail -14
  cp /tmp/nb_$name/04_benchmarks.json $OUTD/$1_04.json 2>/dev/null
  nvidia-smi --query-gpu=utilization.gpu,power.draw,memory.used --format=csv,noheader
}

watch_nb main $PWD/lib notebooks/04_benchmarks.ipynb $PWD/build/aot scripts 230
watch_nb dbc39ce $PWD/probe18/lib probe18/notebooks/04_benchmarks.ipynb $PWD/probe18/aot probe18/scripts 230
echo "end at $(el)"
