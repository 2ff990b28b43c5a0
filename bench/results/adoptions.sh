#!/usr/bin/env bash
# The verdicts the Molmo2 workload's defaults embody, as adoptions appended to the ledger given as $1:
#
#     bench/results/adoptions.sh ledger.db
#
# The commit is the one where these paths became the workload's defaults: the merge of the typed run config.
set -euo pipefail
DEFAULTS_COMMIT=799a2e0
ledger="${1:?usage: bench/results/adoptions.sh LEDGER}"
cd "$(dirname "$0")/../.."
prereg() { "${PYTHON:-python}" cli.py "$@" --ledger "$ledger"; }

# The S-bundle (land-bundle, rule R2, under both schedules): every switch on by default.
prereg adopt molmo2-perf-pass1-h200 P1 P2 P3a P3b P3c P4 --commit "$DEFAULTS_COMMIT"
prereg adopt molmo2-perf-pass1-h200-interleaved P1 P2 P3a P3b P3c P4 --commit "$DEFAULTS_COMMIT"
# The frozen ViT's attention on fp16 inputs in training (land-x2, rule X-land).
prereg adopt molmo2-x2-h200 X2 --commit "$DEFAULTS_COMMIT"
# Run-config outcomes: one backward chunk, flex prefix attention, compiled decoder, camera-bucketed steps.
prereg adopt molmo2-fast-h200 --outcome --commit "$DEFAULTS_COMMIT"
prereg adopt molmo2-fast-same-steps-h200 --outcome --commit "$DEFAULTS_COMMIT"
# pack = true, pack_one_pass = true, pack_attention = varlen, then varlen-cudnn on CUDA.
prereg adopt molmo2-pack-h200 --outcome --commit "$DEFAULTS_COMMIT"
prereg adopt molmo2-pack-one-pass-h200 --outcome --commit "$DEFAULTS_COMMIT"
prereg adopt molmo2-pack-varlen-h200 --outcome --commit "$DEFAULTS_COMMIT"
prereg adopt molmo2-pack-cudnn-h200 --outcome --commit "$DEFAULTS_COMMIT"
