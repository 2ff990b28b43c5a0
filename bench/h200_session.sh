#!/usr/bin/env bash
# One command on the lent H200: the switch bench (issue 3), then a time-budgeted slice of the
# molmo2-perf-pass1-h200 ladder; the ledger comes back under $OUT and is committed here.
#   PART=bench|ladder  BUDGET_S=seconds for the ladder slice
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=120
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
if [ "${PART:-ladder}" = bench ]; then
  python3 bench/molmo2_switches.py --profile h200-4b --warmup 2 --steps 4 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
fi
python3 cli.py run molmo2-perf-pass1-h200 --budget-s "${BUDGET_S:-400}" --ledger ledger.db 2>&1 | tee "$OUT/run.log"
python3 -c "from prereg.ledger import Ledger; l = Ledger.open('ledger.db', create=False); l.checkpoint(); l.close()"
cp ledger.db "$OUT/ledger.db"
python3 cli.py audit show molmo2-perf-pass1-h200 --ledger ledger.db | tail -25
