#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-parallel.sh runs on a 2-GPU machine (release, --features
# cuda; libcuda, libnccl, libnvrtc and libcublasLt load at run time, so no toolkit is needed to build),
# strips them and copies them to target/gpu/:
#   target/gpu/denoiser_parallel_nccl  every 2-GPU mesh over NCCL vs the 1-GPU run, bf16
#                                      (denoiser/tests/parallel_nccl.rs)
#   target/gpu/denoise_step            one CFG denoise step, 1 GPU vs every 2-GPU mesh
#                                      (bench/src/bin/denoise_step.rs)
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
json=$(cargo test --release -p ditstream-denoiser --features cuda --test parallel_nccl --no-run --message-format=json)
test_exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py parallel_nccl)
cargo build --release -p ditstream-bench --features cuda --bin denoise_step
step_exe=target/release/denoise_step
for exe in "$test_exe" "$step_exe"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-parallel.sh: an executable is missing (test '$test_exe', driver '$step_exe')" >&2
    exit 1
  fi
done
cp -f "$test_exe" target/gpu/denoiser_parallel_nccl
cp -f "$step_exe" target/gpu/denoise_step
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/denoiser_parallel_nccl target/gpu/denoise_step
ls -l target/gpu/denoiser_parallel_nccl target/gpu/denoise_step
du -sh target/gpu
echo "built; on a 2-GPU machine (target/gpu carried along): scripts/gpu-parallel.sh"
