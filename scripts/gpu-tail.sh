#!/usr/bin/env bash
# Runs on one GPU (nvidia-h200), from the repo root, with prebuilt executables in target/gpu/ (made
# here by scripts/build-gpu-tail.sh; carry target/gpu with the working tree). Issue 22's benchmark:
#   1. the serving tests on the GPU (DITSTREAM_REQUIRE_GPUS=1: `serve` over gRPC on GPU 0 against
#      the CPU run of the same request; the 2-GPU cases skip), ≈ 1–2 min;
#   2. `tail --mode start` twice, on a kernel and plan cache that starts empty: `serve` (Wan2.1-1.3B
#      dims, random weights, bf16, 480p 81 frames, 4 steps) started with its warm-up, then the
#      first request after start and the second, one after the other. The first start compiles
#      every kernel and searches cuDNN's plans; the second (a restart) reads both caches;
#   3. `tail --mode tail`: the decoder stage alone at 480p and 720p, 81 frames: decode alone,
#      sequential (encode on the VAE's thread) and the encoder pool, median of 3;
#   4. a short table last.
# Expected total: ≈ 5–7 minutes. Logs go to $OUT (the device runner's output folder) when set, else
# /tmp/ditstream-gpu. Exits non-zero if any step failed (the table is printed anyway).
# Knobs: SKIP_TEST=1, SKIP_START=1 (step 2), STEPS (4), ITERS (3).
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/gpu-env.sh
STEPS=${STEPS:-4}
ITERS=${ITERS:-3}

status=0
step() { echo; echo "=== $* ==="; }

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
nproc
for bin in target/gpu/gpu_serving target/gpu/tail; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-tail.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done

if [ "${SKIP_TEST:-0}" != 1 ]; then
  step "serving tests on the GPU (DITSTREAM_REQUIRE_GPUS=1)"
  DITSTREAM_KERNEL_CACHE=/tmp/ditstream-test-cache DITSTREAM_REQUIRE_GPUS=1 timeout 200 \
    target/gpu/gpu_serving --test-threads=1 --nocapture > "$LOGS/gpu_serving.log" 2>&1
  rc=$?
  grep -E "^test |panicked|SERVEPARITY|test result" "$LOGS/gpu_serving.log" | head -n 30
  [ "$rc" -eq 0 ] || { echo "serving tests FAILED (exit $rc)"; tail -n 30 "$LOGS/gpu_serving.log"; status=1; }
fi

# One cache directory for the start runs and the tail run, empty before the first start.
export DITSTREAM_KERNEL_CACHE=/tmp/ditstream-tail-cache
rm -rf "$DITSTREAM_KERNEL_CACHE"
for run in 1 2; do
  [ "${SKIP_START:-0}" = 1 ] && break
  step "start $run: target/gpu/tail --mode start --steps $STEPS"
  start=$(date +%s%N)
  timeout 240 target/gpu/tail --mode start --steps "$STEPS" > "$LOGS/start$run.log" 2> "$LOGS/start$run.err"
  rc=$?
  echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
  grep -v '^START' "$LOGS/start$run.log"
  grep -E "warmed up|ERROR|error" "$LOGS/start$run.err" | head -n 5
  [ "$rc" -eq 0 ] || { echo "start $run FAILED (exit $rc)"; tail -n 20 "$LOGS/start$run.err"; status=1; }
  ls -l "$DITSTREAM_KERNEL_CACHE/cudnn-plans.tsv" 2>/dev/null && wc -l < "$DITSTREAM_KERNEL_CACHE/cudnn-plans.tsv"
done

step "tail: target/gpu/tail --mode tail --iters $ITERS"
timeout 300 target/gpu/tail --mode tail --iters "$ITERS" > "$LOGS/tail.log" 2> "$LOGS/tail.err"
rc=$?
grep -v '^TAIL' "$LOGS/tail.log"
[ "$rc" -eq 0 ] || { echo "tail FAILED (exit $rc)"; tail -n 20 "$LOGS/tail.err"; status=1; }

step "summary"
if [ -f "$LOGS/gpu_serving.log" ]; then
  grep -E "^test .* \.\.\. " "$LOGS/gpu_serving.log" | sed 's/^test /  /'
fi
echo "  start (serve, 480p 81f, $STEPS steps): s to ready, first and second request ms, ratio, their decode ms"
for run in 1 2; do
  grep -h '^START' "$LOGS/start$run.log" 2>/dev/null | awk -F'\t' -v r="$run" \
    '{ printf "  start %s  ready %6s s  first %9s  second %9s  first/second %6s  decode %8s %8s\n", r, $2, $3, $4, $5, $6, $7 }'
done
echo "  tail (decoder alone, 81 frames): last segment ms, x decode alone, first segment ms, threads"
grep -h '^TAIL' "$LOGS/tail.log" 2>/dev/null | awk -F'\t' \
  '{ printf "  %-9s %-13s %9s %7s %9s %4s\n", $2, $3, $4, $5, $6, $7 }'
echo "  targets: pool <= 1.1 x decode alone; first/second <= 1.1"
[ "$status" -eq 0 ] && echo "gpu-tail: all steps passed" || echo "gpu-tail: SOME STEPS FAILED"
exit "$status"
