#!/usr/bin/env bash
# Runs on one GPU (nvidia-h200), from the repo root, with target/gpu/pools_gpu built by
# scripts/build-gpu-serve.sh (carry target/gpu and .whl, the diffusers wheel): one whole request
# through `serve` beside diffusers' `WanPipeline`, in the same call (issue 23):
#   1. ours: `serve` on GPU 0 (the gateway, the denoiser pool and the decoder in one process, as the
#      README's command runs it), Wan2.1-1.3B dims with random weights in bf16, 480p 81 frames, STEPS
#      steps with CFG; one warm-up request (1 step), then one request: its wall time from submit to
#      the last segment (text encoding, loop, VAE and H.264 included);
#   2. diffusers: bench/wan_pipeline_torch.py at the same dims, steps, guidance and flow shift (text
#      encoding excluded, decoded frames to numpy, no video encoding);
#   3. a short table last: wall per request, ours / diffusers.
# ≈ 3 minutes. Logs go to $OUT when set, else /tmp/ditstream-gpu. Knobs: STEPS (20), DTYPES (the
# `model.dtype` of each run of ours, in turn: "bf16"; "bf16 fp8" adds the FP8 linears, issue 24).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/gpu-env.sh
STEPS=${STEPS:-20}
export PYTHONUNBUFFERED=1
status=0
[ -x target/gpu/pools_gpu ] || { echo "missing target/gpu/pools_gpu: run scripts/build-gpu-serve.sh" >&2; exit 2; }

DTYPES=${DTYPES:-bf16}
for dtype in $DTYPES; do
  echo "=== ours ($dtype): serve, 1 request of $STEPS steps after a warm-up ==="
  timeout 300 target/gpu/pools_gpu --requests 1 --steps "$STEPS" --skip-pools --decoder-gpu 0 \
    --latency-links quic --chunks 3 --dtype "$dtype" 2>&1 | tee "$LOGS/request_ours_$dtype.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "pools_gpu ($dtype) FAILED"; status=1; }
done

echo "=== diffusers: WanPipeline, 1 request of $STEPS steps after a warm-up ==="
site=/tmp/ditstream-site
whl=$(unpack_wheel 'diffusers-0.42.1-*.whl' "$site")
if [ -n "$whl" ]; then
  PYTHONPATH=$site timeout 300 "$PY" bench/wan_pipeline_torch.py --steps "$STEPS" 2>&1 \
    | tee "$LOGS/request_diffusers.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "wan_pipeline_torch FAILED"; status=1; }
else
  echo "skipped: no diffusers wheel in .whl/"; status=1
fi

echo
echo "=== summary: one request, Wan2.1-1.3B dims, 480p 81 frames, $STEPS steps, CFG (diffusers: bf16) ==="
# pools_gpu's RESULT: name, k, wall s, req/s, ×T, steady, ×T, T_denoise s, after-loop ms, decode, encode.
ref=$(awk -F'\t' '$1 == "RESULT" && $3 == "request" { print $4 }' "$LOGS/request_diffusers.log" 2>/dev/null)
ref_loop=$(awk -F'\t' '$1 == "RESULT" && $3 == "loop" { print $4 }' "$LOGS/request_diffusers.log" 2>/dev/null)
ratio() { [ -n "$1" ] && [ -n "$2" ] && awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }' || echo "-"; }
printf "  %-40s %10s %10s %8s\n" "what" "ours s" "diffusers" "ratio"
for dtype in $DTYPES; do
  log="$LOGS/request_ours_$dtype.log"
  ours=$(awk -F'\t' '$1 == "RESULT" && $2 == "serve-1gpu" { print $4 }' "$log")
  ours_loop=$(awk -F'\t' '$1 == "RESULT" && $2 == "serve-1gpu" { print $9 }' "$log")
  printf "  %-40s %10s %10s %8s\n" "$dtype: request (submit to last segment)" "${ours:--}" "${ref:--}" "$(ratio "$ours" "$ref")"
  printf "  %-40s %10s %10s %8s\n" "$dtype: text + loop (ours) | loop (theirs)" "${ours_loop:--}" "${ref_loop:--}" "$(ratio "$ours_loop" "$ref_loop")"
done
[ "$status" -eq 0 ] && echo "gpu-request: all steps passed" || echo "gpu-request: SOME STEPS FAILED"
exit "$status"
