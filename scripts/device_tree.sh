#!/usr/bin/env bash
# The device call takes at most 64 MiB of tree (tracked files, untracked files git does not ignore, and what `carry`
# names); the device bundles (.devsite) are 52 MB of it. `hold` moves what earlier runs wrote (every
# papermill_runs/h200-* folder but the newest, bench/decode_runs/, bench/fp8_runs/) into .device_hold/, which git
# ignores, so it stays behind; `restore` moves it back. `foldkv.provenance` ignores those folders, so the checkout
# stays clean and its stamp (build/checkout.json) still matches on the device. Prints the size that would travel.
#   bash scripts/device_tree.sh hold      # before the device calls (after prepare_device_run.sh)
#   bash scripts/device_tree.sh restore   # after them, before committing
set -euo pipefail
cd "$(dirname "$0")/.."
HOLD=.device_hold
travel() {
  local tree carry
  # (a held file is still in git's index: stat skips it)
  tree=$({ git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true; } \
    | awk '{s+=$1} END {print s+0}')
  carry=$({ du -sb .devsite build/aot build/checkout.json 2>/dev/null || true; } | awk '{s+=$1} END {print s+0}')
  echo "travels: $(( (tree + carry) / 1048576 )) MiB (tree $(( tree / 1048576 )), carry .devsite build/aot build/checkout.json $(( carry / 1048576 ))); the cap is 64"
}
case "${1:-}" in
  hold)
    newest=$(ls -d papermill_runs/h200-* 2>/dev/null | sort | tail -1)
    for d in papermill_runs/h200-* bench/decode_runs bench/fp8_runs; do
      [ -e "$d" ] && [ "$d" != "$newest" ] || continue
      mkdir -p "$HOLD/$(dirname "$d")"
      mv "$d" "$HOLD/$d"
    done
    echo "held in $HOLD/ (kept here: ${newest:-no run folder})"; travel ;;
  restore)
    [ -d "$HOLD" ] || { echo "nothing held"; exit 0; }
    (cd "$HOLD" && find . -mindepth 2 -maxdepth 2 -type d) | while read -r d; do
      [ -e "${d#./}" ] && { echo "refusing: ${d#./} exists here and in $HOLD" >&2; exit 1; }
      mv "$HOLD/${d#./}" "${d#./}"
    done
    rmdir -p "$HOLD"/* 2>/dev/null || true; rmdir "$HOLD" 2>/dev/null || true
    echo "restored"; git status --short | head -5 ;;
  size) travel ;;
  *) echo "usage: $0 hold|restore|size" >&2; exit 2 ;;
esac
