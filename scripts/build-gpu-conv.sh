#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-conv.sh runs on the GPU machine (release, --features cuda;
# libcuda, libnvrtc, libcublasLt and libcudnn load at run time, so no toolkit is needed to build), strips
# them and copies them to target/gpu/:
#   target/gpu/kernels_cuda_parity   GPU-vs-CPU parity of every CUDA op, convolutions by both paths
#                                    (im2col and cuDNN) (kernels/tests/cuda_parity.rs)
#   target/gpu/kernels_unit          the kernels crate's unit tests (the NVRTC compile of every .cu and
#                                    the cuDNN descriptor check included)
#   target/gpu/conv_bench            the VAE convolution timing driver (bench/src/bin/conv.rs)
#   target/gpu/gemm_bench            the DiT GEMM timing driver (bench/src/bin/gemm.rs)
#   target/gpu/gemm_space            cuBLASLt's algorithm space at the 14B linears, sustained
#                                    (bench/src/bin/gemm_space.rs, for scripts/gpu-gemm-space.sh)
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
json=$(cargo test --release -p ditstream-kernels --features cuda --no-run --message-format=json)
pick() { # $1: target name, $2: target kind
  printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py "$1" "$2"
}
parity=$(pick cuda_parity test)
unit=$(pick ditstream_kernels lib)
json=$(cargo build --release -p ditstream-bench --features cuda --bin conv --bin gemm --bin gemm_space --message-format=json)
conv=$(pick conv bin)
gemm=$(pick gemm bin)
space=$(pick gemm_space bin)
for exe in "$parity" "$unit" "$conv" "$gemm" "$space"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-conv.sh: an executable is missing (parity '$parity', unit '$unit', conv '$conv', gemm '$gemm', gemm_space '$space')" >&2
    exit 1
  fi
done
cp -f "$parity" target/gpu/kernels_cuda_parity
cp -f "$unit" target/gpu/kernels_unit
cp -f "$conv" target/gpu/conv_bench
cp -f "$gemm" target/gpu/gemm_bench
cp -f "$space" target/gpu/gemm_space
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/kernels_cuda_parity target/gpu/kernels_unit target/gpu/conv_bench \
  target/gpu/gemm_bench target/gpu/gemm_space
ls -l target/gpu/kernels_cuda_parity target/gpu/kernels_unit target/gpu/conv_bench target/gpu/gemm_bench \
  target/gpu/gemm_space
echo "built; on the GPU machine (target/gpu carried along): scripts/gpu-conv.sh, gpu-gemm.sh, gpu-gemm-space.sh"
