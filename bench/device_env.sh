# Sourced first by the device scripts (bench/h200_*.sh): the carried wheels, the environment, and inductor's
# compilation cache carried between machines.
#
# The fast path's `compile = true` costs about 190 s per new process on a cold machine and about 15 s once
# inductor's on-disk cache is warm (measured on the two-H200 host: a compiled benchmark arm took 44.5 s in all,
# load and steps included, on the call after a ladder had compiled the same graphs). A fresh machine starts cold,
# so the cache travels: carry `.compile-cache` (gitignored: the archive cut in parts of 15 MiB, since a file
# coming back may be 16 MiB at most); the script that sources this file ends with `save_compile_cache`, which
# leaves the updated parts under $OUT/compile-cache/ for the next call to carry.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=120
export TORCHINDUCTOR_CACHE_DIR=/tmp/prereg-compile-cache/inductor TRITON_CACHE_DIR=/tmp/prereg-compile-cache/triton
mkdir -p /tmp/prereg-compile-cache
if compgen -G ".compile-cache/part-*" > /dev/null; then
  cat .compile-cache/part-* | tar xz -C /tmp/prereg-compile-cache && echo "compile cache: $(du -sh /tmp/prereg-compile-cache | cut -f1) restored"
fi

save_compile_cache() {
  [ "${CACHE_PARTS:-2}" = 0 ] && { echo "compile cache: not saved (CACHE_PARTS=0)"; return; }
  # At most CACHE_PARTS parts of 15 MiB come back (a call returns 8 files in all; the ledger and logs need some).
  # Afterwards, here: rm -rf .compile-cache && cp -r <files_at>/compile-cache .compile-cache
  local parts=${CACHE_PARTS:-2}  # 2 x 15 MiB: with the wheels (20 MiB) and the tree, under the 64 MiB a call carries
  mkdir -p "$OUT/compile-cache"
  tar cz -C /tmp/prereg-compile-cache . 2>/dev/null | split -b 15M -a 2 - "$OUT/compile-cache/part-"
  local count size
  count=$(ls "$OUT/compile-cache" | wc -l)
  size=$(du -sm "$OUT/compile-cache" | cut -f1)
  if [ "$count" -gt "$parts" ]; then
    rm -rf "$OUT/compile-cache"; echo "compile cache: ${size} MiB compressed, more than ${parts} parts of 15 MiB: left behind"
  else
    echo "compile cache: ${size} MiB in ${count} part(s) under \$OUT/compile-cache: carry them as .compile-cache"
  fi
}

bring_ledger_back() {
  # The ledger, checkpointed into one file, under $OUT: copy it over ledger.db here and commit it.
  python3 -c "from prereg.ledger import Ledger; l = Ledger.open('ledger.db', create=False); l.checkpoint(); l.close()"
  cp ledger.db "$OUT/ledger.db"
}
