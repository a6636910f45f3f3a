#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with prebuilt test executables in target/gpu/ (made
# here by scripts/build-gpu-vae.sh; carry target/gpu with the working tree):
#   1. the kernels unit tests (CPU ops, plus NVRTC compiling every .cu, conv.cu included, for sm_90a);
#   2. the kernels GPU parity suite (every CUDA op against its CPU twin, convolutions included) with
#      DITSTREAM_REQUIRE_GPUS=1, so a missing GPU or library fails instead of skipping;
#   3. the Wan VAE decoded on the GPU (f32 and bf16, one latent frame per chunk) against diffusers'
#      fixtures, DITSTREAM_REQUIRE_GPUS=1;
#   4. a short table last: per op and dtype the worst kernel parity difference, then per VAE fixture,
#      dtype and T the max and RMS |ours − diffusers|.
# Logs go to $OUT (the device runner's output folder) when set, else /tmp/ditstream-gpu.
# Exits non-zero if any step failed (the table is printed anyway).
set -uo pipefail
cd "$(dirname "$0")/.."

# Library set-up and NVLink multicast off (GPU.md); defines SP and PY.
source scripts/lib/gpu-env.sh
rm -rf "$DITSTREAM_KERNEL_CACHE"  # a fresh kernel cache per run

status=0
step() { echo; echo "=== $* ==="; }

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
ls -l target/gpu/ 2>&1
for bin in target/gpu/kernels_unit target/gpu/kernels_cuda_parity target/gpu/decoder_vae_cuda; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-vae.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done

step "kernels unit tests (NVRTC compile of every source included)"
timeout 300 target/gpu/kernels_unit 2>&1 | tail -n 15 | tee "$LOGS/kernels_unit.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "unit tests FAILED (exit $rc)"; status=1; }

step "kernels GPU parity suite (DITSTREAM_REQUIRE_GPUS=1)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 300 target/gpu/kernels_cuda_parity --test-threads=1 --nocapture \
  --skip timing_at_dit_sizes > "$LOGS/cuda_parity.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|failed|Error|test result" "$LOGS/cuda_parity.log" | head -n 60
[ "$rc" -eq 0 ] || { echo "parity suite FAILED (exit $rc)"; status=1; }

step "VAE on the GPU vs diffusers (DITSTREAM_REQUIRE_GPUS=1)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 300 target/gpu/decoder_vae_cuda --test-threads=1 --nocapture \
  > "$LOGS/vae_cuda.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|failed|Error|test result|outside" "$LOGS/vae_cuda.log" | head -n 40
[ "$rc" -eq 0 ] || { echo "VAE GPU test FAILED (exit $rc)"; status=1; }

step "summary: kernels GPU vs CPU max |diff| per op and dtype (worst over cases)"
grep -ho 'PARITY.*' "$LOGS/cuda_parity.log" | grep -v '^VAE_' | awk -F'\t' '
  { key = $2 " " $3; n[key]++; if (!(key in worst) || $5 + 0 > worst[key] + 0) { worst[key] = $5; tol[key] = $6 }
    if (!(key in seen)) { seen[key] = 1; order[m++] = key } }
  END {
    if (m == 0) { print "no PARITY lines (see the log)"; exit }
    printf "%-28s %6s %12s  %s\n", "op dtype", "cases", "max|diff|", "tolerance"
    for (i = 0; i < m; i++) { k = order[i]; printf "%-28s %6d %12s  %s\n", k, n[k], worst[k], tol[k] }
  }'
echo
echo "VAE on the GPU vs diffusers (one latent frame per chunk):"
printf "%-34s %5s %4s %11s %11s  %-22s %10s %s\n" fixture dtype T "max|diff|" "rms|diff|" tolerance time ""
grep -ho 'VAE_PARITY.*' "$LOGS/vae_cuda.log" | awk -F'\t' \
  '{ printf "%-34s %5s %4s %11s %11s  %-22s %10s %s\n", $2, $3, $4, $5, $6, $7, $8, $9 }'
echo
[ "$status" -eq 0 ] && echo "gpu-vae: all steps passed" || echo "gpu-vae: SOME STEPS FAILED"
exit "$status"
