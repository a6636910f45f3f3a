#!/usr/bin/env bash
# Runs on the GPU machine (nvidia-h200), from the repo root, with prebuilt executables in target/gpu/
# (made here by scripts/build-gpu-text.sh; carry target/gpu with the working tree). About 2 minutes:
#   1. the GPU parity tests of the text encoder's kernel ops (embedding gather, biased masked softmax,
#      seeded normal draw) against their CPU twins, DITSTREAM_REQUIRE_GPUS=1 (a missing GPU or library
#      fails instead of skipping);
#   2. the umT5 and T5 fixture encoders on the GPU in f32 and bf16 against transformers' states
#      (denoiser/tests/text_cuda.rs), DITSTREAM_REQUIRE_GPUS=1;
#   3. ours: the umT5-XXL encode (random weights drawn on the GPU, bf16), 512 tokens, batch 1 and 2;
#   4. transformers' UMT5EncoderModel at the same size and inputs (bench/text_encode_torch.py), with
#      its default attention and with eager attention;
#   5. a short table last: parity per case, then ms ours, ms transformers and the ratio.
# Logs go to $OUT (the device runner's output folder) when set, else /tmp/ditstream-gpu.
# Exits non-zero if any step failed (the table is printed anyway).
set -uo pipefail
cd "$(dirname "$0")/.."

# Library set-up and NVLink multicast off (GPU.md); defines SP and PY.
source scripts/lib/gpu-env.sh

export PYTHONUNBUFFERED=1

status=0
step() { echo; echo "=== $* ==="; }
ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
for bin in target/gpu/text_kernels_unit target/gpu/denoiser_text_cuda target/gpu/text_encode; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-text.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done
root=$(pwd)

step "text kernel ops: GPU vs CPU (DITSTREAM_REQUIRE_GPUS=1)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 120 target/gpu/text_kernels_unit --test-threads=1 --nocapture \
  ops::embedding ops::softmax ops::random > "$LOGS/text_kernels.log" 2>&1
rc=$?
echo "exit $rc after $(ms_since "$start") ms"
grep -E "^test |panicked|test result" "$LOGS/text_kernels.log" | head -n 30
[ "$rc" -eq 0 ] || { echo "kernel parity FAILED (exit $rc)"; status=1; }

step "umT5 / T5 encoder on the GPU vs transformers (DITSTREAM_REQUIRE_GPUS=1)"
start=$(date +%s%N)
# Run from denoiser/, as cargo runs integration tests: the test finds its fixtures there.
(cd denoiser && DITSTREAM_REQUIRE_GPUS=1 timeout 120 "$root/target/gpu/denoiser_text_cuda" \
  --test-threads=1 --nocapture) > "$LOGS/text_cuda.log" 2>&1
rc=$?
echo "exit $rc after $(ms_since "$start") ms"
grep -E "^test |panicked|test result" "$LOGS/text_cuda.log" | head -n 30
[ "$rc" -eq 0 ] || { echo "encoder GPU test FAILED (exit $rc)"; status=1; }

step "ours: umT5-XXL encode, bf16, 512 tokens"
start=$(date +%s%N)
timeout 180 target/gpu/text_encode --warmup 3 --iters 10 2>&1 | tee "$LOGS/text_encode.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "text_encode FAILED"; status=1; }
echo "($(ms_since "$start") ms in all)"

step "transformers: UMT5EncoderModel, umT5-XXL, bf16, 512 tokens"
start=$(date +%s%N)
timeout 240 "$PY" bench/text_encode_torch.py --warmup 3 --iters 10 --also-eager 2>&1 \
  | tee "$LOGS/text_encode_torch.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "text_encode_torch FAILED"; status=1; }
echo "($(ms_since "$start") ms in all)"

step "summary"
echo "kernel ops, GPU vs CPU (max |diff| over the cases of each op and dtype):"
grep -ho 'PARITY.*' "$LOGS/text_kernels.log" | awk -F'\t' '
  { key = $2 " " $3; n[key]++; if (!(key in worst) || $5 + 0 > worst[key] + 0) { worst[key] = $5; tol[key] = $6 }
    if (!(key in seen)) { seen[key] = 1; order[m++] = key } }
  END {
    if (m == 0) { print "  no PARITY lines (see the log)"; exit }
    for (i = 0; i < m; i++) { k = order[i]; printf "  %-36s %3d cases  %10s  %s\n", k, n[k], worst[k], tol[k] }
  }'
echo "encoder on the GPU vs transformers (f32 CPU reference):"
grep -ho 'TEXTPARITY.*' "$LOGS/text_cuda.log" | awk -F'\t' '
  BEGIN { printf "  %-26s %5s %12s %12s %12s  %s\n", "case", "dtype", "max|d|", "max/rms", "rms/rms", "tolerance" }
  { a = $4; sub(/^max\|d\| /, "", a); m = $5; sub(/^max\/rms /, "", m); r = $6; sub(/^rms\/rms /, "", r)
    printf "  %-26s %5s %12s %12s %12s  %s\n", $2, $3, a, m, r, $7 }'
echo
echo "umT5-XXL encode, bf16, 512 tokens per prompt, one H200: ms (ours | transformers), ours/transformers"
cat "$LOGS/text_encode.log" "$LOGS/text_encode_torch.log" 2>/dev/null | grep -h '^RESULT' | awk -F'\t' '
  { v[$2 " " $3] = $4; x[$2 " " $3] = $6; if (!($3 in seen)) { seen[$3] = 1; order[n++] = $3 } }
  END {
    printf "  %-10s %10s %14s %8s   %s\n", "batch", "ours", "transformers", "ratio", "TFLOP/s (ours | transformers)"
    for (i = 0; i < n; i++) { k = order[i]; base = k; sub(/_.*$/, "", base)
      # A row only transformers has (b1_eager) is set against our base row.
      ko = ("ours " k) in v ? "ours " k : "ours " base
      kt = ("transformers " k) in v ? "transformers " k : "transformers " base
      o = v[ko]; t = v[kt]
      r = (o != "" && t != "" && t + 0 > 0) ? sprintf("%.2fx", o / t) : "-"
      printf "  %-10s %10s %14s %8s   %s | %s\n", k, o, t, r, x[ko], x[kt] }
  }'
echo "  (b1: one prompt; b2: prompt + negative prompt in one batch; *_eager: transformers with eager attention)"
echo
[ "$status" -eq 0 ] && echo "gpu-text: all steps passed" || echo "gpu-text: SOME STEPS FAILED"
exit "$status"
