#!/usr/bin/env bash
# Builds, here, the binaries scripts/gpu-collectives.sh runs on the GPU machine (release,
# --features cuda; CUDA and NCCL are loaded at run time, so no toolkit is needed to build) and
# copies them to target/gpu/:
#   target/gpu/collectives_nccl   the NCCL collective test suite (common/tests/collectives_nccl.rs)
#   target/gpu/collectives        the collective benchmark (bench/src/bin/collectives.rs)
# target/ is git-ignored: carry target/gpu to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu

cargo build --release -p ditstream-bench --features cuda --bin collectives
cp -f target/release/collectives target/gpu/collectives

# The test executable's name carries a hash: ask cargo for it.
json=$(cargo test --release -p ditstream-common --features cuda --test collectives_nccl \
  --no-run --message-format=json)
exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py collectives_nccl)
if [ -z "$exe" ] || [ ! -x "$exe" ]; then
  echo "build-gpu.sh: could not find the collectives_nccl test executable" >&2
  exit 1
fi
cp -f "$exe" target/gpu/collectives_nccl
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/collectives target/gpu/collectives_nccl

ls -l target/gpu/collectives target/gpu/collectives_nccl
echo "built; on the GPU machine (target/gpu carried along): scripts/gpu-collectives.sh"
