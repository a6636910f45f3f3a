#!/usr/bin/env bash
# Issue 24's FP8 checks and numbers in one GPU call, from the repo root, with the executables of
# scripts/build-gpu-conv.sh and scripts/build-gpu-dit.sh in target/gpu/ (carry target/gpu, or its
# packed form, and .whl):
#   1. the kernels' GPU parity suite with DITSTREAM_REQUIRE_GPUS=1: the FP8 quantisation (bit for
#      bit) and the FP8 linears against their CPU reference, and every bf16/f32 op as before (the
#      GEMM code they share changed);
#   2. the FP8 attention beside our bf16 kernel (bench/src/bin/attention.rs --fp8, quantisation of
#      Q, K, V included) at the DiT's self-attention shapes (1,12,32760,128) and (1,40,75600,128),
#      when target/gpu/attention is there (scripts/build-gpu-attention.sh), ATTENTION_RUNS times
#      (default 1; each run times every FP8 variant beside a fresh bf16 run, each kernel after 1 s
#      of settling calls (the bench's --settle-ms), each call alone and back to back (`RESULT` and
#      `BATCH`: the bench's --batch), ~2 minutes);
#   3. scripts/gpu-dit.sh with FP8=1 (KERNELS=0): the Wan GPU tests (mini128 in FP8 against the
#      CPU's FP8 model and diffusers), then ours in bf16 and with FP8 linears beside diffusers'
#      bf16 forward at 480p 5 and 81 frames (the latter with a 20-step denoise by both models);
#      `--14b` adds Wan2.1-14B dims at 720p 81 frames.
# SKIP_DIT=1 leaves step 3 out. Logs go to $OUT when set, else /tmp/ditstream-gpu. Exits non-zero
# if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/gpu-env.sh
status=0

echo "=== GPU parity suite (DITSTREAM_REQUIRE_GPUS=1) ==="
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 400 target/gpu/kernels_cuda_parity --test-threads=1 --nocapture \
  > "$LOGS/cuda_parity.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|test result" "$LOGS/cuda_parity.log" | head -n 40
grep -E "^PARITY.*(e4m3|fp8)" "$LOGS/cuda_parity.log"
[ "$rc" -eq 0 ] || { echo "parity suite FAILED (exit $rc)"; status=1; }

if [ -x target/gpu/attention ]; then
  for run in $(seq "${ATTENTION_RUNS:-1}"); do
    echo "=== attention: FP8 beside bf16 (run $run) ==="
    log="$LOGS/attention_fp8_$run.log"
    timeout 300 target/gpu/attention --auto-only --no-portable-check --fp8 --batch --shapes 1,12,32760 1,40,75600 \
      > "$log" 2>&1 || { echo "attention bench FAILED"; status=1; }
    grep -E "^(CHECK|SKIP)" "$log"
    # Each FP8 row's ratio is over the bf16 time taken the same way (RESULT or BATCH).
    awk -F'\t' '/^(RESULT|BATCH)/ { key = $1 $4
      if ($3 == "auto") { bf[key] = $5; printf "  %-6s %-48s %-16s %9.3f ms  %6.1f TFLOP/s\n", $1, "bf16 (our auto)", $4, $5, $6 }
      else if (bf[key] > 0)
      printf "  %-6s %-48s %-16s %9.3f ms  %6.1f TFLOP/s  %.3fx our bf16\n", $1, $3, $4, $5, $6, bf[key] / $5 }' "$log"
  done
fi

[ "${SKIP_DIT:-0}" = 1 ] || FP8=1 KERNELS=0 scripts/gpu-dit.sh --full "$@" || status=1
grep -h "FP8PARITY" "$LOGS/wan_cuda.log" 2>/dev/null
[ "$status" -eq 0 ] && echo "gpu-fp8: all steps passed" || echo "gpu-fp8: SOME STEPS FAILED"
exit "$status"
