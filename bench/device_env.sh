# Sourced first by the device scripts (bench/h200_*.sh): the carried wheels, the environment, and inductor's
# compilation cache carried between machines.
#
# The fast path's `compile = true` costs about 190 s per new process on a cold machine and about 15 s once
# inductor's on-disk cache is warm (measured on the two-H200 host: a compiled benchmark arm took 44.5 s in all,
# load and steps included, on the call after a ladder had compiled the same graphs). A fresh machine starts cold,
# so the cache travels: carry `.compile-cache.tgz` (gitignored) into the call; the script that sources this file
# ends with `save_compile_cache`, which leaves the updated cache under $OUT for the next call to carry.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=120
export TORCHINDUCTOR_CACHE_DIR=/tmp/prereg-compile-cache/inductor TRITON_CACHE_DIR=/tmp/prereg-compile-cache/triton
mkdir -p /tmp/prereg-compile-cache
if [ -f .compile-cache.tgz ]; then
  tar xzf .compile-cache.tgz -C /tmp/prereg-compile-cache && echo "compile cache: $(du -sh /tmp/prereg-compile-cache | cut -f1) restored"
fi

save_compile_cache() {
  # What comes back is at most 16 MiB a file: a larger cache stays behind, and the call says so.
  tar czf "$OUT/compile-cache.tgz" -C /tmp/prereg-compile-cache . 2>/dev/null
  local size
  size=$(stat -c %s "$OUT/compile-cache.tgz")
  if [ "$size" -gt $((16 * 1024 * 1024)) ]; then
    rm -f "$OUT/compile-cache.tgz"; echo "compile cache: $((size / 1024 / 1024)) MiB compressed, over the 16 MiB a file can come back"
  else
    echo "compile cache: $((size / 1024)) KiB under \$OUT/compile-cache.tgz: copy it to .compile-cache.tgz and carry it"
  fi
}

bring_ledger_back() {
  # The ledger, checkpointed into one file, under $OUT: copy it over ledger.db here and commit it.
  python3 -c "from prereg.ledger import Ledger; l = Ledger.open('ledger.db', create=False); l.checkpoint(); l.close()"
  cp ledger.db "$OUT/ledger.db"
}
