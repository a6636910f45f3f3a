#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-serve.sh runs on a 2-GPU machine (release, features
# `cuda` and `ucx`: libcuda, libnccl, libnvrtc and libcublasLt load at run time, so no CUDA toolkit is
# needed to build; UCX links against the system's libucx, which the GPU hosts have, version 1.16),
# strips them and copies them to target/gpu/:
#   target/gpu/gpu_serving   serving on GPUs: serve over gRPC on a GPU against the CPU run, 2-GPU
#                            mesh and parallel VAE against one GPU, start-up errors (tests/gpu_serving.rs)
#   target/gpu/nccl_link     the NCCL latent link between two GPUs: exact transfer, corruption caught
#                            (tests/nccl_link.rs)
#   target/gpu/pools_gpu     serve on one GPU and the pools on two, and the
#                            latent links' per-chunk latency (bench/src/bin/pools_gpu.rs)
# Works with a shared CARGO_TARGET_DIR (the executables are found in cargo's JSON messages).
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
# openh264-sys2 silently builds OpenH264 without its assembly when nasm is missing (and a build
# that saw nasm appear half-way fails to link): these executables encode, so insist on it.
command -v nasm >/dev/null || {
  echo "$(basename "$0"): nasm is missing; run scripts/install-deps.sh first" >&2
  exit 1
}

mkdir -p target/gpu
json=$(cargo test --release -p ditstream --features cuda,ucx --test gpu_serving --no-run \
  --message-format=json)
test_exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py gpu_serving test)
json=$(cargo test --release -p ditstream --features cuda,ucx --test nccl_link --no-run \
  --message-format=json)
link_exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py nccl_link test)
json=$(cargo build --release -p ditstream-bench --features cuda,ucx --bin pools_gpu \
  --message-format=json)
bench_exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py pools_gpu bin)
for exe in "$test_exe" "$link_exe" "$bench_exe"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-serve.sh: an executable is missing (tests '$test_exe' '$link_exe', bench '$bench_exe')" >&2
    exit 1
  fi
done
cp -f "$test_exe" target/gpu/gpu_serving
cp -f "$link_exe" target/gpu/nccl_link
cp -f "$bench_exe" target/gpu/pools_gpu
# Symbols and debug info are most of their size, and the working tree that travels is limited to
# 64 MiB (with these three, ~34 MB).
strip --strip-all target/gpu/gpu_serving target/gpu/nccl_link target/gpu/pools_gpu
ls -l target/gpu/gpu_serving target/gpu/nccl_link target/gpu/pools_gpu
du -sh target/gpu
echo "built; on a 2-GPU machine (target/gpu carried along): scripts/gpu-serve.sh"
