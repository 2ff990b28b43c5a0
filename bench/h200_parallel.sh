#!/usr/bin/env bash
# Work side by side on a host of several H200s (kind nvidia-h200-x2): one lane per GPU, each lane a list of tasks
# run one after another on its GPU, the lanes at once.
#
#   GPU0="ladder=molmo2-x2-h200" GPU1="ladder=molmo2-fast-same-steps-h200" BUDGET_S=480 bash bench/h200_parallel.sh
#   GPU0="ladder=reg-a@300 gputests" GPU1="peer=baseline,fast-c1@defaults-c6" bash bench/h200_parallel.sh
#   REGS="reg-a reg-b" BUDGET_S=480 bash bench/h200_parallel.sh      (shorthand: one ladder per lane)
#
# Tasks:
#   ladder=REG[@S]   `prereg run REG --budget-s S` (S defaults to BUDGET_S, else 480); it appends to the one
#                    ledger.db that every lane shares (the ledger serializes its writers; the run lock is per
#                    registration)
#   gate=REG[@S]     the same with --gate-only: the oracle gate, then stop before the first rung
#   peer=ARMS[@PEERS] bench/peer_molmo2.py over our arms ARMS and the peer's configurations PEERS (both
#                    comma-separated; default defaults-c6; @none: no peer), its JSON named NAME (default lane<i>)
#   flexbench        bench/flex_configs.py: the prefix's FlexAttention under several kernel configurations
#   packbench[=ROWS] bench/packed_attention.py: a packed step's attention beside the same samples padded (ROWS: its
#                    --only list, row names with "_" for " ", e.g. packbench=prefix_packed,prefix_packed-128)
#   gputests[=K]     every GPU test (`pytest -m gpu tests/`; those whose names match pytest's -k K)
#   cudnnprobe       bench/cudnn_varlen_probe.py: the varlen calls on cuDNN's SDPA (cudnn-frontend, a carried wheel)
#                    beside torch's FlashAttention-2
# A task that exits non-zero ends its lane (the tasks after it do not run).
# Each lane's log is $OUT/lane<i>.log, its benchmark JSON under $OUT/lane<i>/; ledger.db comes back under $OUT.
# PEER_LAST=1 times the peer after our arms. GPU_TIMEOUT_S=S stops every lane's tasks after S seconds (SIGTERM).
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader

run_task() {  # one task on the GPU this lane was given
  local task=$1 name=${1%%=*} value="" arg=""
  [[ "$task" == *=* ]] && value=${task#*=}
  [[ "$value" == *@* ]] && { arg=${value#*@}; value=${value%@*}; }
  echo "== $(date +%T) $task on GPU $CUDA_VISIBLE_DEVICES"
  case "$name" in
    ladder) python3 cli.py run "$value" --budget-s "${arg:-${BUDGET_S:-480}}" --ledger ledger.db ;;
    gate) python3 cli.py run "$value" --gate-only --budget-s "${arg:-${BUDGET_S:-480}}" --ledger ledger.db ;;
    peer) python3 bench/peer_molmo2.py --profile h200-4b --ours "$value" --peer "$([ "$arg" = none ] && echo "" || echo "${arg:-defaults-c6}")" \
            --name "${NAME:-lane$CUDA_VISIBLE_DEVICES}" --warmup "${WARMUP:-4}" --cycles "${CYCLES:-3}" --profile-arm "${PROFILE_ARM:-}" \
            --out "$OUT/lane$CUDA_VISIBLE_DEVICES" ${PEER_LAST:+--peer-last} --alongside "$ALONGSIDE" ;;
    flexbench) python3 bench/flex_configs.py --profile h200-4b --out "$OUT/lane$CUDA_VISIBLE_DEVICES" ;;
    packbench) python3 bench/packed_attention.py --profile h200-4b --only "${value//_/ }" --out "$OUT/lane$CUDA_VISIBLE_DEVICES" ;;
    cudnnprobe) python3 bench/cudnn_varlen_probe.py --profile h200-4b --out "$OUT/lane$CUDA_VISIBLE_DEVICES" ;;
    gputests) python3 -m pytest -q -p no:warnings -m gpu ${value:+-k "$value"} tests/ ;;
    *) echo "unknown task $task; allowed: ladder=REG[@S], gate=REG[@S], peer=ARMS[@PEERS|@none], flexbench, packbench[=ROWS], cudnnprobe, gputests[=K]"; return 2 ;;
  esac
  local status=$?
  echo "== $(date +%T) $task: exit $status"
  return $status
}

if [ -n "${REGS:-}" ]; then
  lane=0
  for reg in $REGS; do declare "GPU$lane=ladder=$reg"; lane=$((lane + 1)); done
fi
for lane in 0 1 2 3 4 5 6 7; do
  tasks_var="GPU$lane"; tasks=${!tasks_var:-}
  [ -n "$tasks" ] || continue
  others=""  # what the other lanes run, for the benchmark's conditions
  for other in 0 1 2 3 4 5 6 7; do
    other_var="GPU$other"
    [ "$other" != "$lane" ] && [ -n "${!other_var:-}" ] && others="$others GPU $other: ${!other_var};"
  done
  (
    export CUDA_VISIBLE_DEVICES=$lane ALONGSIDE="${others# }" TASKS="$tasks"
    export -f run_task
    # GPU_TIMEOUT_S: the lane's tasks get SIGTERM then (a ladder stops cleanly on it), so this script still
    # brings the ledger back inside the machine's time limit; a timeout around the whole script would not.
    # A task that fails ends its lane: a ladder after a failed GPU test would spend the call on a broken path.
    timeout --kill-after=30 "${GPU_TIMEOUT_S:-86400}" bash -c 'for task in $TASKS; do run_task "$task" || { echo "== lane stopped: $task failed"; break; }; done'
  ) > "$OUT/lane$lane.log" 2>&1 &
done
wait
bring_ledger_back
for lane in 0 1 2 3 4 5 6 7; do
  [ -f "$OUT/lane$lane.log" ] || continue
  echo "==== lane $lane"; grep -E "^== |passed|failed|stopped|verdict|budget|^ours|^transformers|ceiling" "$OUT/lane$lane.log" | tail -25
done
for reg in $(grep -hoE "(ladder|gate)=[^ @]*" <<< "${GPU0:-} ${GPU1:-} ${GPU2:-} ${GPU3:-}" | cut -d= -f2 | sort -u); do
  python3 cli.py audit show "$reg" --ledger ledger.db | tail -12
done
