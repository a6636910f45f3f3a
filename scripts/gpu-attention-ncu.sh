#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with target/gpu/attention built by
# scripts/build-gpu-attention.sh: Nsight Compute profiles of single launches of Hopper attention
# variants, to see where a kernel's time goes (tensor-pipe and MUFU utilisation, stall reasons, L2 hit
# rate and DRAM traffic). Each profile replays one launch of the named kernel under ncu's sections.
# Arguments: pairs of KERNEL SHAPE, e.g.
#   scripts/gpu-attention-ncu.sh hopper_ws_fwd_d128_br128_bc128_s3 1,40,75600
# FP8 kernels (hopper_fp8_*) are profiled the same way: the driver runs them with --fp8.
# (default: the Auto variant at the two DiT shapes of bench/RESULTS.md). Full reports go to $OUT
# (the device runner's output folder) when set, else /tmp/ditstream-gpu; a short extract is printed.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/gpu-env.sh
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$NCU" ] || { echo "ncu not found" >&2; exit 2; }
[ -x target/gpu/attention ] || { echo "missing target/gpu/attention: run scripts/build-gpu-attention.sh" >&2; exit 2; }
[ $# -gt 0 ] || set -- hopper_ws_fwd_d128_br128_bc128_s3 1,12,32760 hopper_ws_fwd_d128_br128_bc128_s3 1,40,75600

# Metric names differ between ncu versions: list the pipe-utilisation ones this one has.
"$NCU" --query-metrics 2>/dev/null | grep -Ei '^(sm__pipe_(tensor|xu|fma|alu)|sm__inst_executed_pipe_(xu|fma|alu|tensor))' \
  | awk '{print $1}' > "$LOGS/ncu_metric_names.txt"
status=0
while [ $# -ge 2 ]; do
  kernel=$1 shape=$2
  shift 2
  log="$LOGS/ncu_${kernel}_${shape//,/x}.txt"
  # --hopper-only runs Auto then every Hopper variant (and with --fp8 every FP8 one); the filter
  # keeps the first launch of $kernel.
  # --clock-control none: ncu would otherwise lock the clocks to base (GPU.md: never change clocks).
  timeout 300 "$NCU" --clock-control none --kernel-name "$kernel" --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --print-details all \
    target/gpu/attention --hopper-only --fp8 --shapes "$shape" --warmup 0 --iters 1 > "$log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || { echo "ncu $kernel $shape FAILED (exit $rc)"; tail -n 20 "$log"; status=1; continue; }
  echo "=== $kernel $shape ==="
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit Rate|L1/TEX Hit|Executed Ipc Active|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per Thread|Achieved Occupancy|Stall|[Pp]ipe" "$log" \
    | sed 's/^ *//' | head -n 60
done
exit "$status"
