#!/usr/bin/env bash
# Runs on a 2-GPU machine (nvidia-h200-x2), from the repo root, with target/gpu/ built here by
# scripts/build-gpu-link.sh: the NCCL latent link test (DITSTREAM_REQUIRE_GPUS=2), then the
# per-chunk latency of every link from cuda:0 to cuda:1; the latency table is printed last.
# About 1 minute. Logs go to $OUT when set, else /tmp/ditstream-gpu. Exits non-zero on failure.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/ditstream-gpu}
mkdir -p "$LOGS"
source scripts/lib/gpu-env.sh
export DITSTREAM_KERNEL_CACHE=/tmp/ditstream-kernel-cache
status=0
for bin in target/gpu/nccl_link target/gpu/link_gpu; do
  [ -x "$bin" ] || { echo "missing $bin: run scripts/build-gpu-link.sh here first" >&2; exit 2; }
done

echo "=== NCCL latent link test (2 GPUs) ==="
DITSTREAM_REQUIRE_GPUS=2 timeout 180 target/gpu/nccl_link --nocapture > "$LOGS/nccl_link.log" 2>&1
rc=$?
grep -E "^test |panicked|test result" "$LOGS/nccl_link.log"
[ "$rc" -eq 0 ] || { echo "NCCL link test FAILED (exit $rc)"; tail -n 30 "$LOGS/nccl_link.log"; status=1; }

echo "=== latent link latency, cuda:0 → cuda:1 ==="
timeout 240 target/gpu/link_gpu --chunks 50 > "$LOGS/link_gpu.log" 2>&1
rc=$?
[ "$rc" -eq 0 ] || { echo "link bench FAILED (exit $rc)"; status=1; }
tail -n 8 "$LOGS/link_gpu.log"
exit "$status"
