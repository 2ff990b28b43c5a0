#!/usr/bin/env bash
# The bundled registrations made faithful to the lab's write-ups they encode, appended to the ledger given as $1:
#
#     bench/results/encodings.sh ledger.db
#
# Every correction is an amendment or a record (bench/results/encodings/), each with its reason; no frozen
# document changes. Amendments that only mark assumed values or add notes change no value, so none is post-hoc.
set -euo pipefail
ledger="${1:?usage: bench/results/encodings.sh LEDGER}"
cd "$(dirname "$0")/../.."
prereg() { "${PYTHON:-python}" cli.py "$@" --ledger "$ledger"; }
fixes=bench/results/encodings

# The S-bundle: its encoder's values marked; the transfer check on the registrations at the real geometry (the tiny
# ones are the CPU demo, which no 4-GPU box smoke follows).
for reg in molmo2-perf-pass1 molmo2-perf-pass1-h200 molmo2-perf-pass1-h200-interleaved \
  molmo2-perf-pass1-tiny molmo2-perf-pass1-tiny-interleaved; do
  prereg amend "$reg" "$fixes/s-bundle-assumed.toml"
done
for reg in molmo2-perf-pass1 molmo2-perf-pass1-h200 molmo2-perf-pass1-h200-interleaved; do
  prereg amend "$reg" "$fixes/s-bundle-transfer.toml"
done
# The decided ones: their verdict again, under the document with the check (the same decision; its box rungs and
# box_gain are undefined until the box smoke is recorded).
for reg in molmo2-perf-pass1-h200 molmo2-perf-pass1-h200-interleaved; do
  prereg verdict "$reg"
done

# The 40k run: K1 counts only evals after step 5k; its encoder's values marked.
prereg amend molmo2-ar-40k "$fixes/ar-40k-k1-and-assumed.toml"

# The F1 smoke: its encoder's values, what the write-up's timestamps say of the declarations, and its whole cost
# (rung 8's smoke and the forensics runs); then the verdict again, over the whole cost.
prereg amend molmo2-ar-40k-f1 "$fixes/f1-assumed.toml"
prereg amend molmo2-ar-40k-f1 "$fixes/f1-declared-when.toml"
prereg amend molmo2-ar-40k-f1 "$fixes/f1-forensics-rung.toml"
prereg record molmo2-ar-40k-f1 "$fixes/f1-record-costs.toml"
prereg verdict molmo2-ar-40k-f1
