#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with prebuilt test executables in target/gpu/ (made
# here by scripts/build-gpu-kernels.sh; carry target/gpu with the working tree):
#   1. the kernels unit tests (CPU ops, plus NVRTC compiling every .cu for sm_90a with the pip headers);
#   2. the GPU parity suite with DITSTREAM_REQUIRE_GPUS=1, so a missing GPU or library fails instead of
#      skipping; a fresh CUBIN cache, so its first use compiles every kernel;
#   3. a rerun of one parity test against the now-filled cache (its time shows the CUBIN load path);
#   4. PyTorch timings of the same linears and SDPA (same method), for the side-by-side;
#   5. a short table last: per op and dtype the worst max-abs difference over the cases, then ours and
#      torch's timings (linear TFLOP/s vs GPU.md's cuBLASLt figures; the portable attention vs SDPA).
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
for bin in target/gpu/kernels_unit target/gpu/kernels_cuda_parity; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-kernels.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done

step "kernels unit tests (NVRTC compile of every source included)"
timeout 300 target/gpu/kernels_unit 2>&1 | tail -n 15 | tee "$LOGS/kernels_unit.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "unit tests FAILED (exit $rc)"; status=1; }
rm -rf "$DITSTREAM_KERNEL_CACHE"

step "GPU parity suite (DITSTREAM_REQUIRE_GPUS=1, cold kernel cache)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 400 target/gpu/kernels_cuda_parity --test-threads=1 --nocapture \
  > "$LOGS/cuda_parity.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|failed|Error|test result" "$LOGS/cuda_parity.log" | head -n 60
[ "$rc" -eq 0 ] || { echo "parity suite FAILED (exit $rc)"; status=1; }
ls -l "$DITSTREAM_KERNEL_CACHE" 2>&1 | tail -n +1

step "warm cache: layout test again (loads CUBINs from disk)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 120 target/gpu/kernels_cuda_parity layout_ops --test-threads=1 \
  > "$LOGS/cuda_parity_warm.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms (the cold run above included NVRTC)"
[ "$rc" -eq 0 ] || { echo "warm rerun FAILED (exit $rc)"; status=1; }

step "torch reference timings (same shapes and method: CUDA events, 5 batches, median)"
timeout 180 /opt/torch/.venv/bin/python - > "$LOGS/torch_timing.log" 2>&1 <<'PY'
import torch, torch.nn.functional as F
torch.manual_seed(0)
def timed(iters, f):
    for _ in range(3):
        f()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            f()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / iters)
    return sorted(times)[len(times) // 2]
for rows, inf, outf in [(32760, 1536, 1536), (32760, 1536, 8960), (32760, 8960, 1536), (8192, 8192, 8192)]:
    x = torch.randn(rows, inf, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(outf, inf, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(outf, device="cuda", dtype=torch.bfloat16)
    t = timed(20, lambda: F.linear(x, w, b))
    print(f"TIMING\ttorch linear+bias bf16 {rows}x{inf}x{outf}\t{t*1e3:.3f} ms\t{2*rows*inf*outf/t/1e12:.1f} TFLOP/s")
for seq, heads in [(4096, 12)]:
    q = torch.randn(1, heads, seq, 128, device="cuda", dtype=torch.bfloat16)
    t = timed(20, lambda: F.scaled_dot_product_attention(q, q, q))
    print(f"TIMING\ttorch sdpa bf16 (1,{heads},{seq},128) default\t{t*1e3:.3f} ms\t{4*seq*seq*heads*128/t/1e12:.1f} TFLOP/s")
PY
rc=$?
[ "$rc" -eq 0 ] || { echo "torch reference FAILED (exit $rc)"; tail -n 5 "$LOGS/torch_timing.log"; status=1; }

step "summary: GPU vs CPU max |diff| per op and dtype (worst over cases), then timings"
grep -ho 'PARITY.*' "$LOGS/cuda_parity.log" | awk -F'\t' '
  { key = $2 " " $3; n[key]++; if (!(key in worst) || $5 + 0 > worst[key] + 0) { worst[key] = $5; tol[key] = $6 }
    if (!(key in seen)) { seen[key] = 1; order[m++] = key } }
  END {
    if (m == 0) { print "no PARITY lines (see the log)"; exit }
    printf "%-26s %6s %12s  %s\n", "op dtype", "cases", "max|diff|", "tolerance"
    for (i = 0; i < m; i++) { k = order[i]; printf "%-26s %6d %12s  %s\n", k, n[k], worst[k], tol[k] }
  }'
echo
grep -ho 'TIMING.*' "$LOGS/cuda_parity.log" "$LOGS/torch_timing.log" 2>/dev/null | awk -F'\t' '{ printf "%-56s %12s %16s\n", $2, $3, $4 }'
echo "(GPU.md: cuBLASLt bf16 8192^3 788-791 TFLOP/s; DiT linears 706-817 TFLOP/s)"
echo
[ "$status" -eq 0 ] && echo "gpu-kernels: all steps passed" || echo "gpu-kernels: SOME STEPS FAILED"
exit "$status"
