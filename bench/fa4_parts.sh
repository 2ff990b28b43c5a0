#!/usr/bin/env bash
# flash-attn-4 for the lent H200, in parts that fit a call's carry (64 MiB with the tree): its CuTe DSL compiler
# (nvidia-cutlass-dsl-libs-cu13, 92 MB as a wheel) is more than one call carries, so it travels as tar.xz in two
# parts, .fa4b and .fa4c, after .fa4a (the workload's wheels from .whl without transformers and torchao, and the
# small wheels flash-attn-4 needs). Here: `bash bench/fa4_parts.sh` (with `/.fa4*/` in .git/info/exclude). There,
# three calls in a row while the machine stays warm (it is given back 30 s after a call):
#   carry [".fa4a"]: mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/
#   carry [".fa4b"]: cp .fa4b/* /tmp/fa4/
#   carry [".fa4c"]: cp .fa4c/* /tmp/fa4/ && WHEELS=/tmp/fa4 source bench/device_env.sh && ...
set -euo pipefail
work=$(mktemp -d)
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$1" "${@:2}"
}
rm -rf .fa4a .fa4b .fa4c && mkdir -p .fa4a .fa4b .fa4c
cp .whl/annotated_types* .whl/greenlet* .whl/nvidia_cudnn_frontend* .whl/pydantic* .whl/sqlalchemy* .whl/sqlmodel* \
  .whl/typing_inspection* .fa4a/
download .fa4a flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext quack-kernels==0.6.5
download "$work" nvidia-cutlass-dsl-libs-cu13==4.8.1
mkdir "$work/cu13" && (cd "$work/cu13" && python3 -m zipfile -e ../nvidia_cutlass_dsl_libs_cu13-*.whl .)
tar -C "$work/cu13" -cf - . | xz -9e -T2 > "$work/cu13.tar.xz"
split -n 2 -d "$work/cu13.tar.xz" "$work/cu13.part"
(cd "$work" && sha256sum cu13.tar.xz) > .fa4c/cu13.sha256
mv "$work/cu13.part00" .fa4b/ && mv "$work/cu13.part01" .fa4c/
rm -rf "$work"
du -sh .fa4a .fa4b .fa4c
