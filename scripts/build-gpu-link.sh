#!/usr/bin/env bash
# Builds, here, what scripts/gpu-link.sh runs on a 2-GPU machine (release, features cuda + ucx;
# libcuda, libnccl and libucx load or link at run time, no toolkit needed), stripped, into
# target/gpu/:
#   target/gpu/nccl_link   the NCCL latent link between two GPUs (tests/nccl_link.rs)
#   target/gpu/link_gpu    per-chunk latency of every latent link, cuda:0 → cuda:1 (bench)
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
test_json=$(cargo test --release -p ditstream --features cuda,ucx --test nccl_link --no-run \
  --message-format=json)
bench_json=$(cargo build --release -p ditstream-bench --features cuda,ucx --bin link_gpu \
  --message-format=json)
link_test=$(printf '%s\n' "$test_json" | python3 scripts/lib/cargo-exe.py nccl_link test)
link_bench=$(printf '%s\n' "$bench_json" | python3 scripts/lib/cargo-exe.py link_gpu bin)
for exe in "$link_test" "$link_bench"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-link.sh: an executable is missing (test '$link_test', bench '$link_bench')" >&2
    exit 1
  fi
done
cp -f "$link_test" target/gpu/nccl_link
cp -f "$link_bench" target/gpu/link_gpu
strip --strip-debug target/gpu/nccl_link target/gpu/link_gpu
ls -l target/gpu/nccl_link target/gpu/link_gpu
echo "built; on a 2-GPU machine (target/gpu carried along): scripts/gpu-link.sh"
