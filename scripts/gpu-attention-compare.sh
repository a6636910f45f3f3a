#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with target/gpu/attention built by
# scripts/build-gpu-attention.sh: our automatic attention choice against torch's default SDPA,
# alternating the two ROUNDS times (default 3) at the given shapes (default: issue 4's two target
# shapes), each side WARMUP untimed calls then the median of ITERS (defaults 3 and 15) per round.
# Why: one run of each, as scripts/gpu-attention.sh does, moved our kernel ±3–5 % between device
# calls (bench/RESULTS.md, third session), too much to judge a 1.15× bar; alternating rounds in one
# call puts ours and torch under the same clocks and shows the spread. Prints per round and shape
# the ratio ours/torch, then the median ratio per shape. Logs go to $OUT when set, else
# /tmp/ditstream-gpu. About 1 minute at the default shapes on a warm machine (estimate).
# SUMMARISE=<log> prints the table of an earlier run's attention_compare.log and runs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/gpu-env.sh
if [ -z "${SUMMARISE:-}" ]; then
  [ -x target/gpu/attention ] || { echo "missing target/gpu/attention: run scripts/build-gpu-attention.sh" >&2; exit 2; }
fi
[ $# -gt 0 ] || set -- 1,12,32760 1,40,75600
ROUNDS=${ROUNDS:-3} WARMUP=${WARMUP:-3} ITERS=${ITERS:-15}

status=0
log="$LOGS/attention_compare.log"
if [ -n "${SUMMARISE:-}" ]; then
  log=$SUMMARISE  # only the table, from an earlier run's log
else
  : > "$log"
  for r in $(seq 1 "$ROUNDS"); do
    timeout 300 target/gpu/attention --auto-only --no-portable-check --shapes "$@" \
      --warmup "$WARMUP" --iters "$ITERS" 2>&1 | grep '^RESULT' | sed "s/^/ROUND$r\t/" >> "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "ours, round $r: FAILED"; status=1; }
    timeout 300 "$PY" bench/attention_torch.py --warmup "$WARMUP" --iters "$ITERS" "$@" 2>&1 \
      | grep '^RESULT' | sed "s/^/ROUND$r\t/" >> "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "torch, round $r: FAILED"; status=1; }
  done
fi

# Lines: ROUNDr, RESULT, ours|torch, auto|default|…, (B,H,S,D), ms, TFLOP/s.
awk -F'\t' '
  $3 == "ours" && $4 == "auto" { ours[$1, $5] = $7 }
  $3 == "torch" && $4 == "default" { torch[$1, $5] = $7; if (!($5 in seen)) { seen[$5] = 1; shapes[n++] = $5 } }
  { rounds[$1] = 1 }
  END {
    printf "%-8s %-20s %10s %10s %8s\n", "round", "shape (B,H,S,D)", "ours auto", "torch", "ratio"
    for (i = 0; i < n; i++) {
      s = shapes[i]; m = 0
      for (r = 1; ("ROUND" r) in rounds; r++) {
        o = ours["ROUND" r, s]; t = torch["ROUND" r, s]
        if (o > 0 && t > 0) { ratio[m++] = o / t; printf "%-8s %-20s %10s %10s %8.3f\n", r, s, o, t, o / t }
      }
      # median of the m ratios (insertion sort: m is small)
      for (a = 1; a < m; a++) { v = ratio[a]; for (b = a - 1; b >= 0 && ratio[b] > v; b--) ratio[b + 1] = ratio[b]; ratio[b + 1] = v }
      med[s] = m == 0 ? "-" : (m % 2 ? sprintf("%.3f", ratio[int(m / 2)]) : sprintf("%.3f", (ratio[m / 2 - 1] + ratio[m / 2]) / 2))
      lo[s] = m == 0 ? "-" : sprintf("%.3f", ratio[0]); hi[s] = m == 0 ? "-" : sprintf("%.3f", ratio[m - 1])
    }
    print ""
    printf "%-20s %12s %8s %8s\n", "shape (B,H,S,D)", "median ratio", "lowest", "highest"
    for (i = 0; i < n; i++) printf "%-20s %12s %8s %8s\n", shapes[i], med[shapes[i]], lo[shapes[i]], hi[shapes[i]]
  }' "$log"
exit "$status"
