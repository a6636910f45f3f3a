#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with prebuilt binaries in target/gpu/
# (made here by scripts/build-gpu.sh; carry target/gpu with the working tree):
#   1. the NCCL collective test suite, with DITSTREAM_REQUIRE_GPUS (default 2) so a missing GPU
#      or library fails instead of skipping;
#   2. our collective benchmark (bench/src/bin/collectives.rs) at 256 MiB per rank;
#   3. the torch.distributed reference (bench/collectives_torch.py), same sizes and timing;
#   4. a short table last: ours vs torch bus bandwidth, and vs GPU.md's NCCL ceilings (for
#      all-gather, which GPU.md lacks, the best NCCL all-gather measured; see the summary step).
# Logs go to $OUT (the device runner's output folder) when set, else /tmp/ditstream-gpu; our
# benchmark also writes NCCL's INIT/P2P log (version, transports, channels) to nccl_debug_ours.txt.
# Exits non-zero if any step failed (the table is printed anyway).
# Knobs: DITSTREAM_REQUIRE_GPUS (2), SIZE_MIB (256), ITERS (20).
set -uo pipefail
cd "$(dirname "$0")/.."

# Library set-up and NVLink multicast off (GPU.md); defines SP and PY.
source scripts/lib/gpu-env.sh
REQUIRE=${DITSTREAM_REQUIRE_GPUS:-2}
SIZE_MIB=${SIZE_MIB:-256}
ITERS=${ITERS:-20}

status=0
step() { echo; echo "=== $* ==="; }

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
ls -l target/gpu/ 2>&1

for bin in target/gpu/collectives_nccl target/gpu/collectives; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done

step "NCCL collective test suite (DITSTREAM_REQUIRE_GPUS=$REQUIRE)"
DITSTREAM_REQUIRE_GPUS=$REQUIRE timeout 480 target/gpu/collectives_nccl --test-threads=1 --nocapture \
  2>&1 | tee "$LOGS/collectives_nccl.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "NCCL test suite FAILED (exit $rc)"; status=1; }

step "ours: target/gpu/collectives --size-mib $SIZE_MIB --iters $ITERS"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P NCCL_DEBUG_FILE="$LOGS/nccl_debug_ours.txt" \
  timeout 300 target/gpu/collectives --size-mib "$SIZE_MIB" --iters "$ITERS" 2>&1 | tee "$LOGS/collectives_ours.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "our benchmark FAILED (exit $rc)"; status=1; }

step "torch reference: bench/collectives_torch.py --size-mib $SIZE_MIB --iters $ITERS"
timeout 300 "$PY" bench/collectives_torch.py --size-mib "$SIZE_MIB" --iters "$ITERS" 2>&1 \
  | tee "$LOGS/collectives_torch.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "torch reference FAILED (exit $rc)"; status=1; }

step "summary: bus bandwidth, GB/s (ceilings from GPU.md: all-to-all 284, all-reduce 300)"
# All-gather has no GPU.md figure; its ceiling is the best all-gather NCCL does on this machine:
# the larger of NCCL's ring all-gather measured in this run (ncclAllGather called directly,
# row nccl_all_gather_ring, and torch's all_gather) and, at P = 2, where all-gather moves exactly
# the bytes of all-to-all, GPU.md's all-to-all ceiling (284: NCCL send/recv moves them that fast).
grep -h '^RESULT' "$LOGS/collectives_ours.log" "$LOGS/collectives_torch.log" 2>/dev/null | awk -F'\t' '
  { key = $3; p[key] = $4; bus[$2, key] = $8; ms[$2, key] = $6; if (!(key in seen)) { seen[key] = 1; order[n++] = key } }
  END {
    if (n == 0) { print "no RESULT lines (see the logs above)"; exit }
    ag = 0
    if ((("ours", "nccl_all_gather_ring") in bus) && bus["ours", "nccl_all_gather_ring"] + 0 > ag) ag = bus["ours", "nccl_all_gather_ring"] + 0
    if ((("torch", "all_gather") in bus) && bus["torch", "all_gather"] + 0 > ag) ag = bus["torch", "all_gather"] + 0
    if (p["all_gather"] == 2 && 284 > ag) ag = 284
    printf "%-28s %3s %10s %10s %10s %8s %9s %10s\n", "op", "P", "ours ms", "ours bus", "torch bus", "ours/tr", "ceiling", "ours/ceil"
    for (i = 0; i < n; i++) {
      k = order[i]
      if (k == "all_reduce") ceil = 300
      else if (k == "all_gather" || k == "nccl_all_gather_ring") ceil = (ag > 0) ? ag : 284
      else ceil = 284
      o = ((("ours", k) in bus)) ? bus["ours", k] : "-"
      t = ((("torch", k) in bus)) ? bus["torch", k] : "-"
      om = ((("ours", k) in ms)) ? sprintf("%.3f", ms["ours", k]) : "-"
      r = (o != "-" && t != "-" && t > 0) ? sprintf("%.3f", o / t) : "-"
      c = (o != "-") ? sprintf("%.3f", o / ceil) : "-"
      printf "%-28s %3s %10s %10s %10s %8s %9s %10s\n", k, p[k], om, o, t, r, ceil, c
    }
    printf "(all_gather ceiling = max(nccl_all_gather_ring %s, torch all_gather %s%s) = %s GB/s)\n", \
      ((("ours", "nccl_all_gather_ring") in bus) ? bus["ours", "nccl_all_gather_ring"] : "-"), \
      ((("torch", "all_gather") in bus) ? bus["torch", "all_gather"] : "-"), \
      (p["all_gather"] == 2 ? ", GPU.md all-to-all 284 (same bytes at P = 2)" : ""), ag
  }'
echo
[ "$status" -eq 0 ] && echo "gpu-collectives: all steps passed" || echo "gpu-collectives: SOME STEPS FAILED"
exit "$status"
