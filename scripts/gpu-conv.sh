#!/usr/bin/env bash
# Runs on the GPU machine (nvidia-h200, one GPU), from the repo root, with prebuilt executables in
# target/gpu/ (made here by scripts/build-gpu-conv.sh; carry target/gpu with the working tree):
#   1. the kernels unit tests of the CUDA layer and the convolutions (NVRTC compiling every .cu for
#      sm_90a, cuDNN's descriptors against ours);
#   2. the kernels GPU parity suite with DITSTREAM_REQUIRE_GPUS=1 (convolutions by im2col, cuDNN on
#      NCDHW, cuDNN on a channels-last copy and the default routing; every other op as a regression
#      check);
#   3. the VAE convolution bench: ours by each path, the default routing (`auto`) first
#      (bench/src/bin/conv.rs), and torch's F.conv3d (bench/conv_torch.py) on the same case list, in
#      this same call;
#   4. the DiT GEMM bench: ours (bench/src/bin/gemm.rs) and torch.matmul / F.linear (bench/gemm_torch.py);
#   5. a short table last: conv parity worst cases, conv TFLOP/s per shape and path with ratios to torch
#      and the per-chunk totals, then GEMM TFLOP/s with ratios to torch and to GPU.md's figures.
# Expected time: ~3–4 minutes (parity ~1 min cold, conv benches ~1.5 min ours + ~1 min torch, GEMM
# ~30 s); each step is
# bounded by its own `timeout` (1–3 minutes), and the logs stay in $OUT if the call is cut short.
# Environment: CONV_DTYPE=bf16|f32 (both conv drivers; default bf16); CONV_FLAGS adds flags to our conv
# driver only (e.g. "--latent 90x160" for 720p: torch reads the same case list); GEMM_FLAGS to both GEMM
# drivers (--warmup/--reps/--iters); SKIP_PARITY=1 skips step 2.
# Logs go to $OUT (the device runner's output folder) when set, else /tmp/ditstream-gpu.
# Exits non-zero if any step failed (the table is printed anyway).
set -uo pipefail
cd "$(dirname "$0")/.."

# Library set-up (libcudnn.so among the links) and NVLink multicast off (GPU.md); defines SP and PY.
source scripts/lib/gpu-env.sh
rm -rf "$DITSTREAM_KERNEL_CACHE"  # a fresh kernel cache per run

status=0
step() { echo; echo "=== $* ==="; }
conv_flags=(${CONV_FLAGS:-} --dtype "${CONV_DTYPE:-bf16}")
gemm_flags=(${GEMM_FLAGS:-})

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
ls -l "$SP/cudnn/lib/libcudnn.so.9" 2>&1
for bin in target/gpu/kernels_unit target/gpu/kernels_cuda_parity target/gpu/conv_bench target/gpu/gemm_bench; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-conv.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done

step "kernels unit tests: CUDA layer and convolutions (NVRTC compile of every source, cuDNN descriptors)"
timeout 90 target/gpu/kernels_unit cuda:: conv 2>&1 | tail -n 12 | tee "$LOGS/kernels_unit.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "unit tests FAILED (exit $rc)"; status=1; }

if [ "${SKIP_PARITY:-0}" != 1 ]; then
  step "GPU parity suite (DITSTREAM_REQUIRE_GPUS=1)"
  start=$(date +%s%N)
  DITSTREAM_REQUIRE_GPUS=1 timeout 180 target/gpu/kernels_cuda_parity --test-threads=1 --nocapture \
    --skip timing_at_dit_sizes > "$LOGS/cuda_parity.log" 2>&1
  rc=$?
  echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
  grep -E "^test |^cuDNN|panicked|test result" "$LOGS/cuda_parity.log" | head -n 40
  [ "$rc" -eq 0 ] || { echo "parity suite FAILED (exit $rc)"; grep -B2 -A12 panicked "$LOGS/cuda_parity.log" | head -n 40; status=1; }
fi

step "ours: VAE convolutions per path (bench/src/bin/conv.rs)"
target/gpu/conv_bench --list "${conv_flags[@]}" > "$LOGS/conv_cases.tsv" || status=1
timeout 180 target/gpu/conv_bench "${conv_flags[@]}" 2>&1 | tee "$LOGS/conv_ours.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "our conv bench FAILED (exit $rc)"; status=1; }

step "ours: the default routing with cuDNN's heuristic choice instead of measured (DITSTREAM_CUDNN_SEARCH=heuristic)"
DITSTREAM_CUDNN_SEARCH=heuristic timeout 60 target/gpu/conv_bench "${conv_flags[@]}" --paths auto \
  --tag _heur --no-check 2>&1 | tee "$LOGS/conv_ours_heur.log" | grep -E '^(TOTAL|PLAN|Error)'
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "our conv bench (heuristic) FAILED (exit $rc)"; status=1; }

step "torch: F.conv3d, cudnn.benchmark (bench/conv_torch.py)"
timeout 90 "$PY" bench/conv_torch.py --cases "$LOGS/conv_cases.tsv" --dtype "${CONV_DTYPE:-bf16}" 2>&1 \
  | tee "$LOGS/conv_torch.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "torch conv reference FAILED (exit $rc)"; status=1; }

step "ours: DiT GEMMs (bench/src/bin/gemm.rs)"
target/gpu/gemm_bench --list > "$LOGS/gemm_cases.tsv" || status=1
timeout 60 target/gpu/gemm_bench "${gemm_flags[@]}" 2>&1 | tee "$LOGS/gemm_ours.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "our GEMM bench FAILED (exit $rc)"; status=1; }

step "torch: matmul / F.linear (bench/gemm_torch.py)"
timeout 60 "$PY" bench/gemm_torch.py --cases "$LOGS/gemm_cases.tsv" "${gemm_flags[@]}" 2>&1 \
  | tee "$LOGS/gemm_torch.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "torch GEMM reference FAILED (exit $rc)"; status=1; }

step "summary"
grep -ho 'PARITY.*' "$LOGS/cuda_parity.log" 2>/dev/null | grep -i conv | awk -F'\t' '
  { key = $2 " " $3; n[key]++; if (!(key in worst) || $5 + 0 > worst[key] + 0) { worst[key] = $5; tol[key] = $6 }
    if (!(key in seen)) { seen[key] = 1; order[m++] = key } }
  END {
    if (m == 0) { print "conv parity: no PARITY lines (skipped or failed; see the log)"; exit }
    printf "%-40s %6s %12s  %s\n", "conv parity: op path dtype", "cases", "max|diff|", "tolerance (of the worst case)"
    for (i = 0; i < m; i++) { k = order[i]; printf "%-40s %6d %12s  %s\n", k, n[k], worst[k], tol[k] }
  }'
echo
echo "VAE convolutions, TFLOP/s (one steady-state chunk's shapes; x calls per chunk). Our causal_conv3d:"
echo "auto: the default routing (what the decoder runs; incl. its transposes); via_nd: cuDNN on a channels-last"
echo "copy (join+transpose, cuDNN, transpose back+bias); im2col; cudnn: cuDNN on NCDHW incl. the frame join."
echo "prej: our cuDNN on a pre-joined input; ndhwc: our cuDNN on channels-last tensors (no transposes);"
echo "a.heur: auto with cuDNN's heuristic pick; t.ncdhw/t.ndhwc: torch F.conv3d on the pre-joined input;"
echo "t.diff: diffusers' cat+pad+conv3d. Ratios: auto/t = auto / t.ncdhw, auto/df = auto / t.diff, cud/t = cudnn / t.ncdhw."
cat "$LOGS/conv_ours.log" "$LOGS/conv_ours_heur.log" "$LOGS/conv_torch.log" 2>/dev/null | awk -F'\t' -v cases="$LOGS/conv_cases.tsv" '
  BEGIN { while ((getline line < cases) > 0) { split(line, f, "\t"); if (f[1] == "CASE") { order[n++] = f[2]; calls[f[2]] = f[10] } } }
  $1 == "RESULT" { t[$2, $3] = $5 }
  $1 == "TOTAL" { total[$2] = $3 }
  END {
    np = split("auto via_ndhwc im2col cudnn cudnn_prejoined cudnn_ndhwc auto_heur torch_ncdhw torch_ndhwc torch_diffusers", p, " ")
    printf "%-40s %3s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s\n", "case", "x", "auto", "via_nd", "im2col", "cudnn", "prej", "ndhwc", "a.heur", "t.ncdhw", "t.ndhwc", "t.diff", "auto/t", "auto/df", "cud/t"
    for (i = 0; i < n; i++) { c = order[i]; row = sprintf("%-40s %3s", c, calls[c])
      for (j = 1; j <= np; j++) row = row sprintf(" %7s", ((p[j], c) in t) ? t[p[j], c] : "-")
      tc = t["torch_ncdhw", c] + 0; td = t["torch_diffusers", c] + 0
      row = row sprintf(" %7s %7s %7s", tc > 0 ? sprintf("%.2f", t["auto", c] / tc) : "-",
                        td > 0 ? sprintf("%.2f", t["auto", c] / td) : "-", tc > 0 ? sprintf("%.2f", t["cudnn", c] / tc) : "-")
      print row }
    row = sprintf("%-40s %3s", "TOTAL per chunk, ms (lower is better)", "")
    for (j = 1; j <= np; j++) row = row sprintf(" %7s", (p[j] in total) ? sprintf("%.2f", total[p[j]]) : "-")
    print row
  }'
echo
echo "DiT GEMMs, bf16, TFLOP/s (target: ours linear >= 0.9 x GPU.md's cuBLASLt figure, and ~1.0 x torch):"
cat "$LOGS/gemm_ours.log" "$LOGS/gemm_torch.log" 2>/dev/null | awk -F'\t' -v cases="$LOGS/gemm_cases.tsv" '
  BEGIN { while ((getline line < cases) > 0) { split(line, f, "\t"); if (f[1] == "CASE") { order[n++] = f[2]; dims[f[2]] = f[3] "x" f[4] "x" f[5]; ref[f[2]] = f[6] } } }
  $1 == "RESULT" { t[$2, $3, $4] = $6 }
  END {
    printf "%-14s %-18s %7s %7s %6s %7s %7s %5s %8s %8s\n", "shape", "MxKxN", "ours", "torch", "o/t", "GPU.md", "o/GPU", "pass", "bias o/t", "mm o/t"
    for (i = 0; i < n; i++) { s = order[i]; o = t["ours", "linear", s] + 0; tt = t["torch", "linear", s] + 0
      ob = t["ours", "linear+bias", s] + 0; tb = t["torch", "linear+bias", s] + 0
      om = t["ours", "matmul", s] + 0; tm = t["torch", "matmul", s] + 0
      r_t = (o > 0 && tt > 0) ? sprintf("%.2f", o / tt) : "-"; r_g = (o > 0) ? sprintf("%.2f", o / ref[s]) : "-"
      ok = (o <= 0) ? "-" : (o >= 0.9 * ref[s]) ? "yes" : "NO"
      r_b = (ob > 0 && tb > 0) ? sprintf("%.2f", ob / tb) : "-"; r_m = (om > 0 && tm > 0) ? sprintf("%.2f", om / tm) : "-"
      printf("%-14s %-18s %7s %7s %6s %7s %7s %5s %8s %8s\n", s, dims[s], (o > 0) ? o : "-", (tt > 0) ? tt : "-", r_t, ref[s], r_g, ok, r_b, r_m) }
    print "(GPU.md: the low end of its cuBLASLt ranges, 706-817 for DiT linears and 788-791 for 8192^3; torch in this call is the per-shape reference.)"
  }'
echo
[ "$status" -eq 0 ] && echo "gpu-conv: all steps passed" || echo "gpu-conv: SOME STEPS FAILED"
exit "$status"
