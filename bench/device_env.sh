# Sourced first by the device scripts (bench/h200_*.sh): the carried wheels, the environment, and one place for
# inductor's compilation cache.
#
# The fast path's `compile = true` costs about 190 s per new process on a cold machine and about 15 s once
# inductor's on-disk cache is warm (measured on the two-H200 host: a compiled benchmark arm took 44.5 s in all,
# load and steps included, on the call after a ladder had compiled the same graphs). The cache lives under /tmp,
# which a machine kept warm between calls keeps. It does not travel: after the fast path's ladders it was over
# 45 MiB compressed, and a call carries 64 MiB in all, the wheels (20 MiB) and the tree included.
#
# WHEELS: where the wheels are (.whl, carried; /tmp/fa4 after bench/fa4_parts.sh's calls, which carry them there).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${WHEELS:-.whl}"/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=120
# flash-attn-4 (pack_attention = "varlen-fa4"): its CuTe DSL compiler, 64 MB as tar.xz, arrives in two parts under
# /tmp/fa4 (bench/fa4_parts.sh); once both are there it is unpacked beside the wheels. Its packages live under
# dsl_packages, which the wheel's .pth puts on the path of a site directory, and /tmp/site is none.
if [ -f /tmp/fa4/cu13.sha256 ]; then
  if [ ! -d /tmp/site/nvidia_cutlass_dsl/cu13 ]; then
    (cd /tmp/fa4 && cat cu13.part00 cu13.part01 > cu13.tar.xz && sha256sum -c --quiet cu13.sha256) || exit 1
    tar -C /tmp/site -xJf /tmp/fa4/cu13.tar.xz || exit 1
  fi
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
  # its kernels compile at first use: kept on disk for the next process (a ladder's next rung, a benchmark)
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/prereg-compile-cache/fa4
fi
# The checkout is not pip-installed there, so its workload entry points are written as a distribution's
# metadata on PYTHONPATH, where importlib.metadata finds them (prereg/registry.py).
python3 - <<'PY' || exit 1
import tomllib
from pathlib import Path
points = tomllib.loads(Path("pyproject.toml").read_text())["project"]["entry-points"]
info = Path("/tmp/site/prereg_checkout-0.dist-info")
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: prereg-checkout\nVersion: 0\n")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in names.items()) for group, names in points.items()))
PY
export TORCHINDUCTOR_CACHE_DIR=/tmp/prereg-compile-cache/inductor TRITON_CACHE_DIR=/tmp/prereg-compile-cache/triton
mkdir -p /tmp/prereg-compile-cache

bring_ledger_back() {
  # The ledger, checkpointed into one file, under $OUT: copy it over ledger.db here and commit it.
  python3 -c "from prereg.ledger import Ledger; l = Ledger.open('ledger.db', create=False); l.checkpoint(); l.close()"
  cp ledger.db "$OUT/ledger.db"
}
