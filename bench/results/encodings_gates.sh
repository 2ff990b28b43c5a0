#!/usr/bin/env bash
# The clauses of the lab's write-ups that a frozen rule could not express until the tool had the means, encoded
# as amendments (bench/results/encodings/), each with its reason, appended to the ledger given as $1:
#
#     bench/results/encodings_gates.sh ledger.db
#
# It follows bench/results/encodings.sh. No frozen document changes; an amendment is honoured only for data
# measured after it, so none is post-hoc.
set -euo pipefail
ledger="${1:?usage: bench/results/encodings_gates.sh LEDGER}"
cd "$(dirname "$0")/../.."
prereg() { "${PYTHON:-python}" cli.py "$@" --ledger "$ledger"; }
fixes=bench/results/encodings

# The S-bundle's rule 4: a crash is a cuDNN instability too. K-cudnn fires on a crash window (rc != 0) for every
# registration that carries it; those with data (the two H200 ladders) had no crash, so their runs stand.
for reg in molmo2-perf-pass1 molmo2-perf-pass1-h200 molmo2-perf-pass1-h200-interleaved \
  molmo2-perf-pass1-tiny molmo2-perf-pass1-tiny-interleaved; do
  prereg amend "$reg" "$fixes/s-bundle-crash.toml"
done

# The 40k run's gates before launch: the E1 data gate as kill line K-E1 on the data counts every window carries,
# the box pytest as a read every decision rule requires; read 1's paired per-frame Δ with its 95% interval over the
# rows of the run and of its A-s0 anchor (rung a_s0), both entered by `prereg record`.
prereg amend molmo2-ar-40k "$fixes/ar-40k-gates.toml"

# The decided S-bundle ladders: their verdict again, under the amended document (the same decision: none of
# their runs crashed).
for reg in molmo2-perf-pass1-h200 molmo2-perf-pass1-h200-interleaved; do
  prereg verdict "$reg"
done
