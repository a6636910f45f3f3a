#!/usr/bin/env bash
# Runs on a 2-GPU machine, from the repo root, with prebuilt executables in target/gpu/ (made here by
# scripts/build-gpu-parallel.sh; carry target/gpu with the working tree):
#   1. the parallel parity test over NCCL with DITSTREAM_REQUIRE_GPUS=2 (fewer GPUs or a missing
#      library fails instead of skipping): cfg2, ulysses2, ring2, attn2d 1x2 and 2x1 against the 1-GPU
#      run, bf16, forward and a 2-step CFG denoise, mini128 and a 4-head random model;
#   2. the denoise-step driver: Wan2.1-1.3B dims, random weights, bf16, one CFG step on 1 GPU vs each
#      2-GPU mesh, with the collectives of a step timed alone, for each entry of FRAMES (default
#      "17 17/0 81": 480p 17 frames = 7,800 tokens; the same without blocks, i.e. the part sequence
#      parallelism does not split; 480p 81 frames = 32,760 tokens, which needs a fast attention
#      kernel: the portable one takes ~35 s per forward there);
#   3. a short table last: parity (worst per model, mesh and kind), step times with speedups, and
#      each rank's recorded step, ms per op and per collective (denoise_step's TIMELINE lines).
# Logs go to $OUT (the device runner's output folder) when set, else /tmp/ditstream-gpu.
# Exits non-zero if any step failed (the table is printed anyway).
# Knobs: FRAMES ("17 17/0 81": frames[/blocks] per driver run), WARMUP (1), ITERS (3), SKIP_TEST=1,
# SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."

# Library set-up and NVLink multicast off (GPU.md); defines SP and PY.
source scripts/lib/gpu-env.sh
FRAMES=${FRAMES:-17 17/0 81}
WARMUP=${WARMUP:-1}
ITERS=${ITERS:-3}

status=0
step() { echo; echo "=== $* ==="; }

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
for bin in target/gpu/denoiser_parallel_nccl target/gpu/denoise_step; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-parallel.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done
root=$(pwd)

if [ "${SKIP_TEST:-0}" != 1 ]; then
  step "parallel parity over NCCL, 2 GPUs vs 1 (DITSTREAM_REQUIRE_GPUS=2)"
  start=$(date +%s%N)
  # Run from denoiser/, as cargo runs integration tests: the test finds its fixtures there.
  (cd denoiser && DITSTREAM_REQUIRE_GPUS=2 timeout 400 "$root/target/gpu/denoiser_parallel_nccl" \
    --test-threads=1 --nocapture) > "$LOGS/parallel_nccl.log" 2>&1
  rc=$?
  echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
  grep -E "^test |panicked|out of bounds|failed|FAIL|test result|meshes on" "$LOGS/parallel_nccl.log" | head -n 40
  [ "$rc" -eq 0 ] || { echo "parity test FAILED (exit $rc)"; tail -n 30 "$LOGS/parallel_nccl.log"; status=1; }
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  : > "$LOGS/denoise_step.log"
  for run in $FRAMES; do
    frames=${run%%/*}
    blocks=(); [ "$run" != "$frames" ] && blocks=(--layers "${run#*/}")
    step "denoise step: target/gpu/denoise_step --frames $frames ${blocks[*]} --warmup $WARMUP --iters $ITERS"
    timeout 420 target/gpu/denoise_step --frames "$frames" "${blocks[@]}" --warmup "$WARMUP" --iters "$ITERS" 2>&1 \
      | tee -a "$LOGS/denoise_step.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "denoise_step $run FAILED"; status=1; }
  done
fi

step "summary"
if [ -f "$LOGS/parallel_nccl.log" ]; then
  echo "parity, 2 GPUs vs 1 GPU (bf16): worst over ranks (and over the two token counts for forward)"
  grep -ho 'NCCLPARITY.*' "$LOGS/parallel_nccl.log" | grep -v 'vs rank 0' | awk -F'\t' '
    { kind = $4; sub(/ [0-9]+ tokens/, "", kind); key = $2 " " $3 " " kind
      r = $6; sub(/^rms\/rms /, "", r); m = $7; sub(/^max\/rms /, "", m)
      b = $8; sub(/^bounds /, "", b); bit = $9; sub(/^ranks bitwise /, "", bit)
      if (!(key in seen)) { seen[key] = 1; order[n++] = key; bound[key] = b; allbit[key] = "true" }
      if (r + 0 > rms[key] + 0) rms[key] = r; if (m + 0 > mx[key] + 0) mx[key] = m
      if (bit != "true") allbit[key] = "false"; if ($10 != "ok") bad[key] = 1 }
    END {
      if (n == 0) { print "  no NCCLPARITY lines (see the log)"; exit }
      printf "  %-34s %10s %10s  %-13s %s\n", "model mesh kind", "rms/rms", "max/rms", "bounds", "ranks bitwise"
      for (i = 0; i < n; i++) { k = order[i]
        printf "  %-34s %10s %10s  %-13s %s%s\n", k, rms[k] + 0 ? rms[k] : "0", mx[k] + 0 ? mx[k] : "0", bound[k], allbit[k], (k in bad) ? "  FAIL" : "" }
    }'
fi
if [ -f "$LOGS/denoise_step.log" ]; then
  echo
  grep '^model' "$LOGS/denoise_step.log" | sed 's/^/  /'
  echo "one CFG step: ms (CUDA events, median; 2 GPUs: the slower rank), speedup vs 1 GPU, collectives of a step alone"
  grep -h '^RESULT' "$LOGS/denoise_step.log" | awk -F'\t' '
    BEGIN { printf "  %-12s %-12s %10s %10s %9s %10s %8s\n", "run", "config", "step ms", "wall ms", "speedup", "comm ms", "comm %" }
    { c = ($10 == "-") ? "-" : $10; p = ($10 == "-" || $4 + 0 == 0) ? "-" : sprintf("%.1f", 100 * $10 / $4)
      printf "  %-12s %-12s %10s %10s %8sx %10s %8s\n", $13, $2, $4, $6, $8, c, p }'
  # One recorded step per rank (denoise_step's TIMELINE lines: mesh, rank, label, ms, intervals,
  # run): the collectives' exposed waits beside the model's ops, per run, config and rank.
  echo "one recorded step per rank: ms per label inside the step (kernels::timeline)"
  grep -h '^TIMELINE' "$LOGS/denoise_step.log" | awk -F'\t' '
    { key = $8 " " $2 " | " $3; if (!(key in seen)) { seen[key] = 1; order[n++] = key }
      line[key] = line[key] sprintf(" %s %s;", $4, $5) }
    END { for (i = 0; i < n; i++) printf "  %-30s%s\n", order[i], line[order[i]] }'
fi
echo
[ "$status" -eq 0 ] && echo "gpu-parallel: all steps passed" || echo "gpu-parallel: SOME STEPS FAILED"
exit "$status"
