#!/usr/bin/env bash
# Runs on the GPU machine (nvidia-h200, one GPU), from the repo root, with prebuilt executables in
# target/gpu/ (made here by scripts/build-gpu-conv.sh; carry target/gpu with the working tree). The
# cuBLASLt algorithm search of kernels/src/cuda/gemm.rs against the heuristic's first choice, in one
# call:
#   1. the GEMM parity tests with DITSTREAM_REQUIRE_GPUS=1, the search on and a fresh cache
#      (`searched_gemms_match_cpu` checks the chosen algorithm and the cache line);
#   2. the DiT GEMM bench (bench/src/bin/gemm.rs) three times: DITSTREAM_GEMM_SEARCH=heuristic; the
#      search on a fresh algorithm cache; the search again with that cache (a restart: no timing,
#      the same choices), then torch.matmul / F.linear (bench/gemm_torch.py) on the same shapes;
#   3. a short table last: TFLOP/s per shape and variant, heuristic | searched | restart | torch, and
#      searched / heuristic.
# Expected time: ~2 minutes. Logs go to $OUT when set, else /tmp/ditstream-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/gpu-env.sh
export DITSTREAM_KERNEL_CACHE=/tmp/ditstream-gemm-cache
rm -rf "$DITSTREAM_KERNEL_CACHE"

status=0
step() { echo; echo "=== $* ==="; }
for bin in target/gpu/kernels_cuda_parity target/gpu/gemm_bench; do
  [ -x "$bin" ] || { echo "missing $bin: run scripts/build-gpu-conv.sh and carry target/gpu" >&2; exit 2; }
done

step "GEMM parity (DITSTREAM_REQUIRE_GPUS=1, search on)"
DITSTREAM_REQUIRE_GPUS=1 timeout 180 target/gpu/kernels_cuda_parity gemm --test-threads=1 \
  > "$LOGS/gemm_parity.log" 2>&1 || status=1
grep -E "^test |panicked|test result" "$LOGS/gemm_parity.log" | head -n 20
echo "algorithm cache after the tests:"
cat "$DITSTREAM_KERNEL_CACHE/cublaslt-algos.tsv" 2>/dev/null || echo "(none)"
rm -rf "$DITSTREAM_KERNEL_CACHE"

target/gpu/gemm_bench --list > "$LOGS/gemm_cases.tsv" || status=1
bench() { # $1: label, then env assignments
  local label=$1; shift
  step "ours, $label"
  env "$@" timeout 120 target/gpu/gemm_bench 2>&1 | sed "s/^RESULT\tours\t/RESULT\t$label\t/" \
    | tee "$LOGS/gemm_$label.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gemm bench $label FAILED"; status=1; }
}
bench heuristic DITSTREAM_GEMM_SEARCH=heuristic
bench searched DITSTREAM_GEMM_SEARCH=find
echo "algorithm cache:"; cat "$DITSTREAM_KERNEL_CACHE/cublaslt-algos.tsv" 2>/dev/null || echo "(none)"
cp "$DITSTREAM_KERNEL_CACHE/cublaslt-algos.tsv" "$LOGS/" 2>/dev/null
bench restart DITSTREAM_GEMM_SEARCH=find
if cmp -s "$DITSTREAM_KERNEL_CACHE/cublaslt-algos.tsv" "$LOGS/cublaslt-algos.tsv"; then
  echo "restart: the cache is unchanged (no new search)"
else
  echo "restart: the cache CHANGED"; status=1
fi

step "torch: matmul / F.linear (bench/gemm_torch.py)"
timeout 90 "$PY" bench/gemm_torch.py --cases "$LOGS/gemm_cases.tsv" 2>&1 | tee "$LOGS/gemm_torch.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "torch GEMM reference FAILED"; status=1; }

step "summary: TFLOP/s (bf16)"
cat "$LOGS"/gemm_heuristic.log "$LOGS"/gemm_searched.log "$LOGS"/gemm_restart.log "$LOGS"/gemm_torch.log \
  2>/dev/null | awk -F'\t' '
  $1 == "RESULT" { t[$2, $3, $4] = $6; if (!(($3, $4) in seen)) { seen[$3, $4] = 1; order[n++] = $3 "\t" $4 } }
  END {
    printf "%-12s %-14s %9s %9s %9s %9s %8s\n", "variant", "shape", "heuristic", "searched", "restart", "torch", "s/h"
    for (i = 0; i < n; i++) { split(order[i], k, "\t"); h = t["heuristic", k[1], k[2]] + 0; s = t["searched", k[1], k[2]] + 0
      r = (h > 0 && s > 0) ? sprintf("%.3f", s / h) : "-"
      printf "%-12s %-14s %9s %9s %9s %9s %8s\n", k[1], k[2], t["heuristic", k[1], k[2]], t["searched", k[1], k[2]], t["restart", k[1], k[2]], t["torch", k[1], k[2]], r }
  }'
[ "$status" -eq 0 ] && echo "gpu-gemm: all steps passed" || echo "gpu-gemm: SOME STEPS FAILED"
exit "$status"
