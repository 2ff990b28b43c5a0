#!/usr/bin/env bash
# Commands on the lent H200, by PART:
#   bench   the switch bench (bench/molmo2_switches.py), then a time-budgeted slice of the ladder REG
#   ladder  a time-budgeted slice of the ladder REG (BUDGET_S seconds; default molmo2-perf-pass1-h200)
#   peer    every GPU test, then bench/peer_molmo2.py over OURS (arms) and PEER (the peer's configurations), its
#           JSON named NAME (bench/h200_peer.sh does the same with a compile-cache warm-up beside the tests)
#   final   peer, then ladder
#   gated   the GPU tests TESTS, then bench/decoder_block.py, then the ladder REG only if the tests passed and GATE (a
#           Python condition on the block bench's JSON, `d`) holds: a ladder registered beside a kernel runs only
#           where its kernel measured faster
# Whatever touches ledger.db brings it back under $OUT, to be committed here.
set -uo pipefail
source bench/device_env.sh
REG=${REG:-molmo2-perf-pass1-h200}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
case "${PART:-ladder}" in
  peer|final)
    python3 -m pytest -q -p no:warnings -m gpu tests/ 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
    python3 bench/peer_molmo2.py --profile h200-4b --ours "${OURS:-baseline,fast-c1}" --peer "${PEER:-defaults-c6}" \
      --name "${NAME:-session}" --profile-arm "${PROFILE_ARM:-}" --warmup "${WARMUP:-4}" --cycles "${CYCLES:-3}" \
      --out "$OUT" > "$OUT/peer.log" 2>&1
    grep -A16 '^conditions' "$OUT/peer.log"
    [ "${PART}" = peer ] && exit 0 ;;
  gated)
    python3 -m pytest -p no:warnings -m gpu ${TESTS:-tests/} 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" || exit 1
    python3 bench/decoder_block.py --geometry 4b --warmup 5 --repeats 30 --out "$OUT" > "$OUT/decoder_block.log" 2>&1
    tail -6 "$OUT/decoder_block.log"
    python3 -c "import json, sys; d = json.load(open('$OUT/decoder_block_4b.json')); sys.exit(0 if ($GATE) else 1)" \
      || { echo "the ladder's gate does not hold: $GATE"; exit 0; } ;;
  bench)
    python3 bench/molmo2_switches.py --profile h200-4b --warmup 2 --steps 4 --out "$OUT" 2>&1 | tee "$OUT/bench.log" ;;
esac
python3 cli.py run "$REG" --budget-s "${BUDGET_S:-400}" --ledger ledger.db > "$OUT/run.log" 2>&1
tail -5 "$OUT/run.log"
bring_ledger_back
python3 cli.py audit show "$REG" --ledger ledger.db | tail -15
