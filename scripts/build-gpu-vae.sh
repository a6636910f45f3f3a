#!/usr/bin/env bash
# Builds, here, the test executables scripts/gpu-vae.sh runs on the GPU machine (release, feature
# `cuda`; libcuda, libnvrtc and libcublasLt load at run time, so no toolkit is needed to build), strips
# them and copies them to target/gpu/:
#   target/gpu/kernels_cuda_parity   GPU-vs-CPU parity of every CUDA op, convolutions included
#                                    (kernels/tests/cuda_parity.rs)
#   target/gpu/kernels_unit          the kernels crate's unit tests (incl. the NVRTC compile of every .cu)
#   target/gpu/decoder_vae_cuda      the Wan VAE decoded on the GPU against diffusers (decoder/tests/vae_cuda.rs)
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
json=$(cargo test --release -p ditstream-kernels -p ditstream-decoder \
  --features ditstream-kernels/cuda,ditstream-decoder/cuda --no-run --message-format=json)
pick() { # $1: target name, $2: target kind
  printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py "$1" "$2"
}
parity=$(pick cuda_parity test)
unit=$(pick ditstream_kernels lib)
vae=$(pick vae_cuda test)
for exe in "$parity" "$unit" "$vae"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-vae.sh: a test executable is missing (parity '$parity', unit '$unit', vae '$vae')" >&2
    exit 1
  fi
done
cp -f "$parity" target/gpu/kernels_cuda_parity
cp -f "$unit" target/gpu/kernels_unit
cp -f "$vae" target/gpu/decoder_vae_cuda
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/kernels_cuda_parity target/gpu/kernels_unit target/gpu/decoder_vae_cuda
ls -l target/gpu/kernels_cuda_parity target/gpu/kernels_unit target/gpu/decoder_vae_cuda
echo "built; on the GPU machine (target/gpu carried along): scripts/gpu-vae.sh"
