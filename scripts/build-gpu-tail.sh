#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-tail.sh runs on one GPU (nvidia-h200) (release, feature
# `cuda`: libcuda, libnvrtc, libcublasLt, libcudnn and libnccl load at run time, so no CUDA toolkit
# is needed to build), strips them and copies them to target/gpu/:
#   target/gpu/gpu_serving   serving on GPUs: serve over gRPC on a GPU against the CPU run, start-up
#                            errors (tests/gpu_serving.rs; the 2-GPU cases skip on one GPU)
#   target/gpu/tail          the streaming tail and the first request after start
#                            (bench/src/bin/tail.rs)
# Works with a shared CARGO_TARGET_DIR (the executables are found in cargo's JSON messages).
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree (together
# they must stay under the 64 MiB a working tree may be; pack target/gpu with xz if not).
set -euo pipefail
cd "$(dirname "$0")/.."
# openh264-sys2 silently builds OpenH264 without its assembly when nasm is missing (and a build
# that saw nasm appear half-way fails to link): these executables encode, so insist on it.
command -v nasm >/dev/null || {
  echo "$(basename "$0"): nasm is missing; run scripts/install-deps.sh first" >&2
  exit 1
}

mkdir -p target/gpu
json=$(cargo test --release -p ditstream --features cuda --test gpu_serving --no-run \
  --message-format=json)
test_exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py gpu_serving test)
json=$(cargo build --release -p ditstream-bench --features cuda --bin tail --message-format=json)
bench_exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py tail bin)
for exe in "$test_exe" "$bench_exe"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-tail.sh: an executable is missing (test '$test_exe', bench '$bench_exe')" >&2
    exit 1
  fi
done
cp -f "$test_exe" target/gpu/gpu_serving
cp -f "$bench_exe" target/gpu/tail
strip --strip-all target/gpu/gpu_serving target/gpu/tail
ls -l target/gpu/gpu_serving target/gpu/tail
du -sh target/gpu
echo "built; on the GPU machine (target/gpu carried along): scripts/gpu-tail.sh"
