#!/usr/bin/env bash
# Board power and SM clock while each attention kernel runs (GPU.md: a kernel at the 700 W limit
# trades clock for power, so a faster schedule can show as a lower clock): runs
# `target/gpu/attention --auto-only --no-portable-check --fp8` at SHAPE (default 1,40,75600, ~0.15 s
# a call) with ITERS timed calls per kernel (default 20), samples nvidia-smi's power.draw and
# clocks.sm every ~0.1 s beside it, and prints per kernel its time and the median power and clock
# over its timed calls (the window of ITERS × its median time that ends at its RESULT line).
# Needs target/gpu/attention (scripts/build-gpu-attention.sh). Logs in $OUT, else /tmp/ditstream-gpu.
# On an H100 the FP8 kernel once ran 8 % slower at (1,12,32760) here than in the plain bench of
# the same call, bf16 not (bench/RESULTS.md, 2026-12-06, third session). The likely cause, found
# later (tenth session): the plain bench then timed a few calls partly at an idle GPU's clock, and
# the FP8 kernel loses more clock at the power limit; the bench now settles each kernel first
# (--settle-ms). Take this script's times as a power and clock record, and ratios from the bench.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/gpu-env.sh
SHAPE=${SHAPE:-1,40,75600}
ITERS=${ITERS:-20}

(while :; do
  echo "$(date +%s.%N) $(nvidia-smi --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits | tr -d ' ')"
  sleep 0.1
done) > "$LOGS/power_samples.txt" 2>/dev/null &
sampler=$!
timeout 300 target/gpu/attention --auto-only --no-portable-check --fp8 --shapes "$SHAPE" --warmup 3 --iters "$ITERS" \
  2>&1 | while IFS= read -r line; do echo "$(date +%s.%N) $line"; done > "$LOGS/power_bench.txt"
rc=${PIPESTATUS[0]}
kill "$sampler" 2>/dev/null
wait "$sampler" 2>/dev/null
python3 - "$LOGS/power_bench.txt" "$LOGS/power_samples.txt" "$ITERS" <<'PY'
import statistics, sys
bench, samples, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
pts = []
for line in open(samples):
    t, _, v = line.partition(" ")
    try:
        w, mhz = v.strip().split(",")
        pts.append((float(t), float(w), float(mhz)))
    except ValueError:
        pass
print(f"{'kernel':<44} {'ms':>9} {'W (median)':>11} {'MHz (median)':>13} {'samples':>8}")
for line in open(bench):
    t, _, rest = line.partition(" ")
    f = rest.rstrip("\n").split("\t")
    if f[0] != "RESULT":
        continue
    end, ms = float(t), float(f[4])
    win = [p for p in pts if end - iters * ms / 1000 <= p[0] <= end]
    if win:
        w = statistics.median(p[1] for p in win)
        mhz = statistics.median(p[2] for p in win)
        print(f"{f[2]:<44} {ms:9.3f} {w:11.0f} {mhz:13.0f} {len(win):8d}")
    else:
        print(f"{f[2]:<44} {ms:9.3f} {'-':>11} {'-':>13} {0:8d}")
PY
exit "$rc"
