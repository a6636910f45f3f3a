#!/usr/bin/env bash
# Our FP8 attention beside cuDNN's (issue 24), in one call on the GPU machine, from the repo root:
# ROUNDS (default 2) rounds of, in turn,
#   1. our bench: `target/gpu/attention --auto-only --no-portable-check --fp8 --batch` at SHAPES
#      (default 1,12,32760 and 1,12,32768, in case cuDNN wants a multiple of 64 or 128): our bf16
#      Auto and the FP8 default, RESULT and BATCH, and the FP8 call's SPLIT (its quantisation's two
#      kernels and its attention kernel);
#   2. the torch twin: `bench/attention_torch.py --batch --cudnn-fp8` at the same shapes: torch's SDPA
#      (cuDNN bf16, FA2) and cuDNN's FP8 attention (the cuDNN frontend's sdpa_fp8 graph on inputs
#      quantised beforehand, so its time is its kernel's alone);
# then a table of ratios per round: bf16 time over FP8 time, each pair from one process.
# Needs target/gpu/attention, or the bench named by BENCH (scripts/build-gpu-attention.sh, which also
# fetches the cuDNN frontend's wheel into .whl/); carry target/gpu and .whl. The wheel is unpacked into /tmp and put on PYTHONPATH
# (the torch venv has cuDNN's library but not its Python frontend). Logs in $OUT, else
# /tmp/ditstream-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/gpu-env.sh
SHAPES=${SHAPES:-1,12,32760 1,12,32768}
ROUNDS=${ROUNDS:-2}
BENCH=${BENCH:-target/gpu/attention}
FP8_DEFAULT=hopper_fp8_fwd_d128_br128_bc128_s3_win3_spec

echo "== $(nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | head -n 1)"
[ -x "$BENCH" ] || { echo "missing $BENCH: run scripts/build-gpu-attention.sh here" >&2; exit 2; }
site=/tmp/cudnn-frontend
if [ -n "$(unpack_wheel 'nvidia_cudnn_frontend-*-cp312-*.whl' "$site")" ]; then
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no cuDNN frontend wheel in .whl/: cuDNN's FP8 rows will be skipped"
fi

status=0
for r in $(seq 1 "$ROUNDS"); do
  # shellcheck disable=SC2086  # SHAPES is a list
  timeout 200 "$BENCH" --auto-only --no-portable-check --fp8 --batch --fp8-variant "$FP8_DEFAULT" \
    --shapes $SHAPES > "$LOGS/ours_$r.log" 2>&1 || { echo "round $r: our bench failed"; tail -n 5 "$LOGS/ours_$r.log"; status=1; }
  # shellcheck disable=SC2086
  timeout 300 "$PY" bench/attention_torch.py --batch --cudnn-fp8 $SHAPES > "$LOGS/torch_$r.log" 2>&1 \
    || { echo "round $r: the torch twin failed"; tail -n 5 "$LOGS/torch_$r.log"; status=1; }
done

echo
grep -hE "^(CHECK|SKIP|torch )" "$LOGS"/ours_*.log "$LOGS"/torch_*.log | cut -c1-160 | sort -u
echo
echo "ms per call (RESULT / BATCH; \"fp8 kern\": our FP8 call's attention kernel alone, from SPLIT). Ratios:"
echo "bf16 time / FP8 time (ours within one process, cuDNN's within the other); \"ours bf16 / cudnn fp8\" across the two"
printf '%-5s %-18s %-17s %-17s %-9s %-17s %-17s %-15s %-15s %-15s\n' round shape "ours bf16" "ours fp8" \
  "fp8 kern" "cudnn bf16" "cudnn fp8" "ours fp8/bf16" "cudnn fp8/bf16" "ours bf16/cudnn fp8"
for r in $(seq 1 "$ROUNDS"); do
  awk -F'\t' -v r="$r" -v fp8="$FP8_DEFAULT" '
    FNR == 1 { file++ }
    /^(RESULT|BATCH)/ {
      k = ($2 == "ours" && $3 == "auto") ? "ob" : ($2 == "ours" && $3 == fp8) ? "o8" \
        : ($2 == "torch" && $3 == "cudnn") ? "cb" : ($2 == "torch" && $3 == "cudnn_fp8") ? "c8" : ""
      if (k != "") { t[k, $1, $4] = $5; shapes[$4] = 1 }
    }
    /^SPLIT/ && $2 == fp8 { split($6, a, " "); kern[$3] = a[2] }
    function pair(k, s) { return sprintf("%.3f / %.3f", t[k, "RESULT", s], t[k, "BATCH", s]) }
    function ratio(b, f, s) {
      if (!t[f, "RESULT", s] || !t[f, "BATCH", s]) return "-"
      return sprintf("%.3f / %.3f", t[b, "RESULT", s] / t[f, "RESULT", s], t[b, "BATCH", s] / t[f, "BATCH", s])
    }
    END {
      for (s in shapes)
        printf "%-5s %-18s %-17s %-17s %-9s %-17s %-17s %-15s %-15s %-15s\n", r, s, pair("ob", s), pair("o8", s),
          kern[s], pair("cb", s), pair("c8", s), ratio("ob", "o8", s), ratio("cb", "c8", s), ratio("ob", "c8", s)
    }' "$LOGS/ours_$r.log" "$LOGS/torch_$r.log"
done
exit $status
