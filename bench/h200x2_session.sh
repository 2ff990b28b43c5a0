#!/usr/bin/env bash
# Two H200s of one host (kind nvidia-h200-x2), one command:
#   1. bench/ddp_step.py: the two-GPU DDP step next to the one-GPU step at the same per-rank batch;
#   2. a time-budgeted slice of the F1 ladder molmo2-ar-f1-h200x2 (BUDGET_S), then its report WRITTEN HERE, where
#      the rungs' allocation snapshots are (the report embeds their forensics; the pickles stay behind), as report.tgz;
#   3. ledger.db back under $OUT, to be committed.
set -uo pipefail
source bench/device_env.sh
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (KINDS.md)
REG=${REG:-molmo2-ar-f1-h200x2}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${DDP_STEP:-1}" = 1 ]; then
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/ddp_step.py --sync ddp --out "$OUT" 2>&1 | grep '^{'
  CUDA_VISIBLE_DEVICES=0 python3 bench/ddp_step.py --out "$OUT" 2>&1 | grep '^{'
fi
python3 cli.py run "$REG" --budget-s "${BUDGET_S:-400}" --ledger ledger.db > "$OUT/run.log" 2>&1
tail -12 "$OUT/run.log"
bring_ledger_back
# The report is 8 files and a call brings back 8 in all: it comes back as one archive.
python3 cli.py report "$REG" --ledger ledger.db --out /tmp/report > /dev/null 2>&1 && tar czf "$OUT/report.tgz" -C /tmp report \
  || echo "report: not yet (no verdict data)"
python3 cli.py audit show "$REG" --ledger ledger.db | tail -12
