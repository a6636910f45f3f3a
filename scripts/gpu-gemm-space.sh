#!/usr/bin/env bash
# Runs on the GPU machine (one GPU), from the repo root, with target/gpu/gemm_space (made here by
# scripts/build-gpu-conv.sh; carry target/gpu): cuBLASLt's whole bf16 algorithm space at the 14B
# DiT's linear shapes and 8192³ (bench/src/bin/gemm_space.rs): a 40 s screen per shape, then the
# heuristic's 8 and the screen's 4 fastest timed sustained, 15 interleaved rounds of 12 calls each,
# with nvidia-smi's SM clock and power sampled beside it. A short table last: per shape, every
# finalist's median ms, TFLOP/s and ratio to the heuristic's first (what gemm.rs runs unless its
# search finds one ≥ 3 % faster). Expected time: ~6 minutes.
# Environment: SPACE_FLAGS adds flags (e.g. "--screen-secs 0 --extra 66:29:35:1:3").
# Logs go to $OUT when set, else /tmp/ditstream-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/gpu-env.sh
[ -x target/gpu/gemm_space ] || { echo "missing target/gpu/gemm_space: run scripts/build-gpu-conv.sh and carry target/gpu" >&2; exit 2; }

nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 500 > "$LOGS/space_smi.csv" &
smi=$!
# shellcheck disable=SC2086
timeout 560 target/gpu/gemm_space ${SPACE_FLAGS:-} > "$LOGS/space.log" 2>&1
status=$?
kill "$smi" 2>/dev/null
awk -F'\t' '/^(cuBLASLt|algorithm ids|===|space:|screen:)/ || ($1 == "SCREEN" && n[$2]++ < 3)' "$LOGS/space.log"
[ "$status" -eq 0 ] || { tail -n 20 "$LOGS/space.log"; echo "gemm_space FAILED ($status)"; }

echo; echo "=== clocks while it ran (nvidia-smi, every 0.5 s) ==="
awk -F', ' '$2 > 400 { n++; c += $1; p += $2; if ($1 < lo || !lo) lo = $1 }
  END { if (n) printf "%d samples above 400 W: SM clock mean %.0f MHz (min %d), power mean %.0f W\n", n, c / n, lo, p / n }' \
  "$LOGS/space_smi.csv"

echo; echo "=== finals: sustained medians (ms, TFLOP/s, × the heuristic's first) ==="
awk -F'\t' '$1 == "FINAL" { printf "%-18s %-16s %8s %7s %6s  %s\n", $2, $3, $4, $5, $6, $8 }' "$LOGS/space.log"
exit "$status"
