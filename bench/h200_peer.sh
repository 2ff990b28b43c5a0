#!/usr/bin/env bash
# The peer benchmark on one H200 (kind nvidia-h200), in one run on the machine:
#   1. every GPU test (`pytest -m gpu tests/`; GPU_TESTS_PATHS: other paths; GPU_TESTS=0: none) and, beside them,
#      an untimed run of the compiled rows WARM_OURS and WARM_PEER (bench/peer_molmo2.py --cycles 0) that fills
#      inductor's on-disk cache, so the timed run's compilations are cache hits (cold, our arm's took 2.4-2.9 minutes
#      and the peer's compiled layers 0.8-1.3, on the H200);
#   2. bench/peer_molmo2.py over OURS and PEER alone on the GPU, its JSON named NAME (PEER_LAST=1: the peer after
#      our arms; PROFILE_ARM: one of OURS profiled), stopped BENCH_TIMEOUT_S after it starts (its JSON keeps the rows
#      it finished).
#   OURS=packed-varlen-cudnn-one-pass-x2 PEER=defaults-c6,keep-c2-compiled WARM_OURS=packed-varlen-cudnn-one-pass-x2 \
#     WARM_PEER=keep-c2-compiled NAME=landed-vs-peer-best PEER_LAST=1 bash bench/h200_peer.sh
# Under $OUT: gpu_tests.log, warm_up.log, bench.log, the JSON, the profile's tables.
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
tests=""
if [ "${GPU_TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086  # GPU_TESTS_PATHS: several paths
  timeout --kill-after=10 "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -v -p no:warnings -m gpu \
    --continue-on-collection-errors ${GPU_TESTS_PATHS:-tests/} > "$OUT/gpu_tests.log" 2>&1 &
  tests=$!
fi
cache="cold: this process compiles every graph in its warm-up steps"
if [ -n "${WARM_OURS:-}${WARM_PEER:-}" ]; then
  timeout --kill-after=10 "${WARM_TIMEOUT_S:-300}" python3 bench/peer_molmo2.py --profile h200-4b --ours "${WARM_OURS:-}" \
    --peer "${WARM_PEER:-}" --warmup "${WARMUP:-4}" --cycles 0 --name compile-cache-warm-up --out /tmp/warm-up \
    > "$OUT/warm_up.log" 2>&1
  warm=$?
  echo "warm-up: exit $warm"
  cache="warm: an untimed process compiled ours ${WARM_OURS:-(none)} and the peer's ${WARM_PEER:-(none)} first"
  # stopped at its limit or failed: only the rows it finished (warm_up.log) are cache hits
  [ "$warm" = 0 ] || cache="partly warm: an untimed warm-up of ours ${WARM_OURS:-(none)} and the peer's ${WARM_PEER:-(none)} exited $warm"
fi
if [ -n "$tests" ]; then
  wait "$tests"
  echo "gpu tests: exit $?"
  tail -3 "$OUT/gpu_tests.log"
fi
timeout --kill-after=10 "${BENCH_TIMEOUT_S:-300}" python3 bench/peer_molmo2.py --profile h200-4b --ours "${OURS:-}" \
  --peer "${PEER:-}" --name "$NAME" --warmup "${WARMUP:-4}" --cycles "${CYCLES:-3}" --profile-arm "${PROFILE_ARM:-}" \
  ${PEER_LAST:+--peer-last} --compile-cache "$cache" --out "$OUT" > "$OUT/bench.log" 2>&1
status=$?
echo "bench: exit $status"
if [ "$status" = 0 ]; then grep -E "^(ours|transformers| )" "$OUT/bench.log" | tail -25; else tail -c 4000 "$OUT/bench.log"; fi
