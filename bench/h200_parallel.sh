#!/usr/bin/env bash
# One-GPU ladders side by side on a host of several H200s (kind nvidia-h200-x2): REGS="reg-a reg-b" runs
# `prereg run reg-a` on GPU 0 and `prereg run reg-b` on GPU 1 at once, each with the time budget BUDGET_S, both
# appending to the one ledger.db (the ledger serializes its writers; the run lock is per registration).
# Each ladder still sees one GPU of its own; the host's CPUs (32 cores) are shared, compilation included.
# ledger.db comes back under $OUT, to be committed; each ladder's log is $OUT/run-<reg>.log.
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
gpu=0
for reg in ${REGS:?name the registrations}; do
  CUDA_VISIBLE_DEVICES=$gpu python3 cli.py run "$reg" --budget-s "${BUDGET_S:-480}" --ledger ledger.db > "$OUT/run-$reg.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
bring_ledger_back
for reg in $REGS; do
  echo "== $reg"; tail -4 "$OUT/run-$reg.log"
  python3 cli.py audit show "$reg" --ledger ledger.db | tail -10
done
save_compile_cache
