#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with prebuilt executables in target/gpu/ (made here by
# scripts/build-gpu-attention.sh; carry target/gpu with the working tree):
#   1. the kernels unit tests of the CUDA layer (NVRTC compiling every .cu for sm_90a with the pip headers);
#   2. the attention parity tests (portable and tensor-core kernels vs the CPU twin) with
#      DITSTREAM_REQUIRE_GPUS=1, so a missing GPU or library fails instead of skipping; the Hopper wgmma
#      kernel's test (hopper_attention_matches_cpu) in a process of its own, so a device fault of the new
#      kernel (which poisons the CUDA context) cannot fail the other kernels' cases;
#   3. our attention timing (bench/src/bin/attention.rs; the Hopper kernel again in its own process,
#      beside the automatic choice) and torch SDPA's (bench/attention_torch.py) in this same call, at the
#      DiT shapes;
#   4. the rest of the parity suite (every other CUDA op), as a regression check;
#   5. a short table last: parity worst cases, then TFLOP/s per shape, ours vs torch, and the ratios.
# Environment: BENCH_FLAGS adds flags to our driver (e.g. --auto-only: the automatic choice only, not
# every variant); SKIP_REST=1 skips step 4.
# Extra arguments go to both timing drivers as shapes (B,H,S or B,H,S,D; D = 128 by default).
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
for bin in target/gpu/kernels_unit target/gpu/kernels_cuda_parity target/gpu/attention; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-attention.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done

step "kernels unit tests of the CUDA layer (NVRTC compile of every source included)"
timeout 200 target/gpu/kernels_unit cuda:: 2>&1 | tail -n 12 | tee "$LOGS/kernels_unit.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "unit tests FAILED (exit $rc)"; status=1; }

step "attention parity (DITSTREAM_REQUIRE_GPUS=1)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 300 target/gpu/kernels_cuda_parity attention --skip hopper --test-threads=1 \
  --nocapture > "$LOGS/attention_parity.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|FAILED|Error|test result" "$LOGS/attention_parity.log" | head -n 40
[ "$rc" -eq 0 ] || { echo "attention parity FAILED (exit $rc)"; tail -n 30 "$LOGS/attention_parity.log"; status=1; }

step "Hopper attention parity (own process, DITSTREAM_REQUIRE_GPUS=1)"
DITSTREAM_REQUIRE_GPUS=1 timeout 120 target/gpu/kernels_cuda_parity hopper_attention_matches_cpu --exact \
  --test-threads=1 --nocapture > "$LOGS/hopper_parity.log" 2>&1
rc=$?
grep -E "^test |panicked|FAILED|Error|skipped|test result" "$LOGS/hopper_parity.log" | head -n 20
[ "$rc" -eq 0 ] || { echo "Hopper attention parity FAILED (exit $rc)"; tail -n 30 "$LOGS/hopper_parity.log"; status=1; }

step "ours: bench attention (CUDA events, median)"
ours_args=(${BENCH_FLAGS:-})
[ $# -gt 0 ] && ours_args+=(--shapes "$@")
timeout 420 target/gpu/attention --no-hopper "${ours_args[@]}" 2>&1 | tee "$LOGS/attention_ours.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "our attention bench FAILED (exit $rc)"; status=1; }

step "ours: the Hopper kernel beside the automatic choice (own process)"
hopper_args=(--hopper-only)
[ $# -gt 0 ] && hopper_args+=(--shapes "$@")
timeout 240 target/gpu/attention "${hopper_args[@]}" 2>&1 | tee "$LOGS/attention_hopper.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "Hopper attention bench FAILED (exit $rc)"; status=1; }

step "torch: scaled_dot_product_attention (same method)"
timeout 300 /opt/torch/.venv/bin/python bench/attention_torch.py "$@" 2>&1 | tee "$LOGS/attention_torch.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "torch reference FAILED (exit $rc)"; status=1; }

if [ "${SKIP_REST:-0}" != 1 ]; then
  step "rest of the parity suite (regression check)"
  DITSTREAM_REQUIRE_GPUS=1 timeout 300 target/gpu/kernels_cuda_parity --skip attention --skip timing \
    --test-threads=1 --nocapture > "$LOGS/cuda_parity_rest.log" 2>&1
  rc=$?
  grep -E "^test |panicked|test result" "$LOGS/cuda_parity_rest.log" | head -n 30
  [ "$rc" -eq 0 ] || { echo "parity suite FAILED (exit $rc)"; status=1; }
fi

step "summary"
cat "$LOGS/attention_parity.log" "$LOGS/hopper_parity.log" 2>/dev/null | grep -o 'PARITY.*' | awk -F'\t' '
  { key = $2 " " $3; n[key]++; if (!(key in worst) || $5 + 0 > worst[key] + 0) { worst[key] = $5; tol[key] = $6 }
    if (!(key in seen)) { seen[key] = 1; order[m++] = key } }
  END {
    if (m == 0) { print "no PARITY lines (see the log)"; exit }
    printf "%-58s %6s %12s  %s\n", "parity: op dtype", "cases", "max|diff|", "tolerance (of the worst case)"
    for (i = 0; i < m; i++) { k = order[i]; printf "%-58s %6d %12s  %s\n", k, n[k], worst[k], tol[k] }
  }'
echo
grep -h '^CHECK\|^SKIP' "$LOGS/attention_ours.log" "$LOGS/attention_hopper.log" 2>/dev/null | cut -f2- | column -t -s $'\t' 2>/dev/null \
  || grep -h '^CHECK\|^SKIP' "$LOGS/attention_ours.log" "$LOGS/attention_hopper.log"
echo
cat "$LOGS/attention_ours.log" "$LOGS/attention_hopper.log" "$LOGS/attention_torch.log" 2>/dev/null | grep '^RESULT' | awk -F'\t' '
  { key = $2 " " $3; s = $4; t[s, key] = $6; ms[s, key] = $5
    if (!(s in seen)) { seen[s] = 1; shapes[n++] = s }
    if ($2 == "ours" && $3 != "auto" && ($6 + 0 > best[s] + 0)) { best[s] = $6; bestname[s] = $3 }
    if ($2 == "ours" && $3 ~ /^hopper_/ && ($6 + 0 > hbest[s] + 0)) { hbest[s] = $6; hname[s] = $3 } }
  END {
    printf "%-20s %12s %12s %12s %12s %12s %12s %10s %10s %12s\n", "shape (B,H,S,D)", "ours auto", "ours best", "ours hopper", "torch dflt", "torch cudnn", "torch FA2", "auto/dflt", "auto/FA2", "hopper/dflt"
    for (i = 0; i < n; i++) { s = shapes[i]
      a = t[s, "ours auto"]; d = t[s, "torch default"]; c = t[s, "torch cudnn"]; f = t[s, "torch flash2"]
      hp = hbest[s]
      printf "%-20s %12s %12s %12s %12s %12s %12s %10s %10s %12s\n", s, a, best[s], (hp != "" ? hp : "-"), d, c, f, (d > 0 ? sprintf("%.3f", a / d) : "-"), (f > 0 ? sprintf("%.3f", a / f) : "-"), (d > 0 && hp > 0 ? sprintf("%.3f", hp / d) : "-")
    }
    print "(TFLOP/s = 4·B·H·S²·D / median time; ours best = the fastest compiled variant:)"
    for (i = 0; i < n; i++) printf "  %s: %s\n", shapes[i], bestname[shapes[i]]
    print "(ours hopper = the fastest Hopper wgmma variant:)"
    for (i = 0; i < n; i++) printf "  %s: %s\n", shapes[i], (hname[shapes[i]] != "" ? hname[shapes[i]] : "-")
  }'
echo
[ "$status" -eq 0 ] && echo "gpu-attention: all steps passed" || echo "gpu-attention: SOME STEPS FAILED"
exit "$status"
