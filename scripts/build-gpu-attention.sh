#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-attention.sh runs on the GPU machine (release, --features
# cuda; libcuda and libnvrtc load at run time, so no toolkit is needed to build), strips them and copies
# them to target/gpu/:
#   target/gpu/kernels_cuda_parity   GPU-vs-CPU parity of every CUDA op (kernels/tests/cuda_parity.rs)
#   target/gpu/kernels_unit          the kernels crate's unit tests (incl. the NVRTC compile of every .cu)
#   target/gpu/attention             the attention timing driver (bench/src/bin/attention.rs)
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree.
# It also fetches, once, the cuDNN frontend's wheel for the GPU machine's Python 3.12 into .whl/ (also
# git-ignored; carry it too), which scripts/gpu-attention-cudnn-fp8.sh needs for cuDNN's FP8 attention.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
json=$(cargo test --release -p ditstream-kernels --features cuda --no-run --message-format=json)
pick() { # $1: target name, $2: target kind
  printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py "$1" "$2"
}
parity=$(pick cuda_parity test)
unit=$(pick ditstream_kernels lib)
cargo build --release -p ditstream-bench --features cuda --bin attention
bench=target/release/attention
for exe in "$parity" "$unit" "$bench"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-attention.sh: an executable is missing (parity '$parity', unit '$unit', bench '$bench')" >&2
    exit 1
  fi
done
cp -f "$parity" target/gpu/kernels_cuda_parity
cp -f "$unit" target/gpu/kernels_unit
cp -f "$bench" target/gpu/attention
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/kernels_cuda_parity target/gpu/kernels_unit target/gpu/attention
ls -l target/gpu/kernels_cuda_parity target/gpu/kernels_unit target/gpu/attention
# 1.16.0: a 2 MB wheel that needs nothing beyond cuDNN's library, which the torch venv there has.
cudnn_fe=nvidia-cudnn-frontend==1.16.0
if ! ls .whl/nvidia_cudnn_frontend-1.16.0-cp312-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 "$cudnn_fe" -d .whl \
    || echo "note: $cudnn_fe not fetched: scripts/gpu-attention-cudnn-fp8.sh will skip cuDNN's FP8 attention"
fi
echo "built; on the GPU machine (target/gpu carried along): scripts/gpu-attention.sh"
echo "(with .whl carried too: scripts/gpu-attention-cudnn-fp8.sh)"
