#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-text.sh runs on the GPU machine (release, feature `cuda`;
# libcuda, libnvrtc and libcublasLt load at run time, so no toolkit is needed to build), strips them
# and copies them to target/gpu/:
#   target/gpu/text_kernels_unit    the kernels crate's unit tests, among them the GPU parity tests of
#                                   the text encoder's ops (ops::embedding, ops::softmax, ops::random)
#   target/gpu/denoiser_text_cuda   the umT5/T5 encoder on the GPU vs transformers (denoiser/tests/text_cuda.rs)
#   target/gpu/text_encode          the umT5-XXL encode timing driver (bench/src/bin/text_encode.rs)
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
pick() { # stdin: cargo's JSON messages; $1: target name, $2: target kind
  python3 scripts/lib/cargo-exe.py "$1" "$2"
}
unit=$(cargo test --release -p ditstream-kernels --features cuda --lib --no-run --message-format=json \
  | pick ditstream_kernels lib)
text=$(cargo test --release -p ditstream-denoiser --features cuda --test text_cuda --no-run \
  --message-format=json | pick text_cuda test)
bench=$(cargo build --release -p ditstream-bench --features cuda --bin text_encode --message-format=json \
  | pick text_encode bin)
for exe in "$unit" "$text" "$bench"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-text.sh: an executable is missing (unit '$unit', test '$text', driver '$bench')" >&2
    exit 1
  fi
done
cp -f "$unit" target/gpu/text_kernels_unit
cp -f "$text" target/gpu/denoiser_text_cuda
cp -f "$bench" target/gpu/text_encode
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/text_kernels_unit target/gpu/denoiser_text_cuda target/gpu/text_encode
ls -l target/gpu/text_kernels_unit target/gpu/denoiser_text_cuda target/gpu/text_encode
echo "built; on the GPU machine (nvidia-h200, target/gpu carried along): scripts/gpu-text.sh"
