#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, with prebuilt executables in target/gpu/ (made here by
# scripts/build-gpu-dit.sh; carry target/gpu and .whl with the working tree):
#   1. the Wan transformer GPU test with DITSTREAM_REQUIRE_GPUS=1 (a missing GPU or library fails
#      instead of skipping): both DiT fixtures in f32 and bf16 against diffusers' outputs;
#   2. the DiT step driver at Wan2.1-1.3B dims, 480p 5 frames (3,120 tokens), with its per-op split;
#   3. diffusers' WanTransformer3DModel at the same dims and tokens (bench/dit_step_torch.py; the
#      carried wheel is unpacked to /tmp and put on PYTHONPATH);
#   4. with --full: both again at 480p 81 frames (32,760 tokens), ours one warm-up then two timed
#      forwards (~1.2 s each);
#   5. with --full, where Nsight Systems is installed: the GPU kernels of ours at 480p 81 frames
#      (one warm-up and one timed forward), summed per kernel name, the top 25 (the itemised "rest");
#      where only Nsight Compute is, every kernel of two forwards timed by ncu (serialised, at the
#      idle boost clock), summed per name, and one middle block's launches in order
#      (scripts/lib/kernel-times.py);
#   6. with --14b: both at Wan2.1-14B dims, 720p 81 frames (75,600 tokens), ours one warm-up and
#      one timed forward (~10 s each; the model takes ~95 s to build), with the split (≈ 4–5 min
#      for the pair);
#   7. a short table last: the parity summary, then ours vs diffusers and the ratio.
# KERNELS=0 skips step 5 (the kernel profile, ~2 minutes). FP8=1 adds ours in FP8 (`dit_step
# --fp8`: the forward with FP8 linears and self-attention as `model.dtype: fp8` runs it, and with
# FP8 linears only; the FP8 forward's error against bf16; the block's linears in FP8) to every pair,
# and at 480p 81 frames a 20-step denoise with both (`--steps 20`); the summary then gives the FP8
# forward against diffusers' bf16 one. With FP8=1, FP8_ATTENTION=<kernel>[,<kernel>...] also times
# the FP8 forward with those FP8 attention kernels in place of the default (`dit_step
# --fp8-attention`).
# Logs go to $OUT (the device runner's output folder) when set, else /tmp/ditstream-gpu.
# Exits non-zero if any step failed (the table is printed anyway).
set -uo pipefail
cd "$(dirname "$0")/.."
full=0 big=0
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    --14b) big=1 ;;
    *) echo "usage: $0 [--full] [--14b]" >&2; exit 2 ;;
  esac
done

# Library set-up and NVLink multicast off (GPU.md); defines SP and PY.
source scripts/lib/gpu-env.sh

export PYTHONUNBUFFERED=1

status=0
step() { echo; echo "=== $* ==="; }

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
for bin in target/gpu/denoiser_wan_cuda target/gpu/dit_step; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-dit.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done
root=$(pwd)

step "Wan transformer on the GPU vs diffusers (DITSTREAM_REQUIRE_GPUS=1)"
start=$(date +%s%N)
# Run from denoiser/, as cargo runs integration tests: the test finds its fixtures there.
(cd denoiser && DITSTREAM_REQUIRE_GPUS=1 timeout 300 "$root/target/gpu/denoiser_wan_cuda" \
  --test-threads=1 --nocapture) > "$LOGS/wan_cuda.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|failed|test result" "$LOGS/wan_cuda.log" | head -n 30
[ "$rc" -eq 0 ] || { echo "GPU test FAILED (exit $rc)"; status=1; }

# The diffusers wheel is pure Python: unpack it where PYTHONPATH can see it.
site=/tmp/ditstream-site
whl=$(unpack_wheel 'diffusers-0.42.1-*.whl' "$site")

run_pair() { # $1: label, then the shared shape arguments; ours' iteration args come from OURS_ITERS
  local label=$1; shift
  step "ours, $label"
  timeout 420 target/gpu/dit_step "$@" $OURS_ITERS 2>&1 | tee "$LOGS/dit_step_$label.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "dit_step $label FAILED"; status=1; }
  step "diffusers, $label"
  if [ -z "$whl" ]; then
    echo "skipped: no diffusers wheel in .whl/"; status=1; return
  fi
  PYTHONPATH=$site timeout 300 "$PY" bench/dit_step_torch.py "$@" --split 2>&1 | tee "$LOGS/dit_step_torch_$label.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "dit_step_torch $label FAILED"; status=1; }
}

FP8_ARGS=""
[ "${FP8:-0}" = 1 ] && FP8_ARGS="--fp8"
[ "${FP8:-0}" = 1 ] && [ -n "${FP8_ATTENTION:-}" ] && FP8_ARGS="$FP8_ARGS --fp8-attention $FP8_ATTENTION"
OURS_ITERS="--warmup 2 --iters 5 $FP8_ARGS"
run_pair 480p5f --height 480 --width 832 --frames 5
if [ "$full" -eq 1 ]; then
  OURS_ITERS="--warmup 1 --iters 2 $FP8_ARGS"
  [ -n "$FP8_ARGS" ] && OURS_ITERS="$OURS_ITERS --steps 20"
  run_pair 480p81f --height 480 --width 832 --frames 81
  NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)
  if [ "${KERNELS:-1}" = 0 ]; then
    echo "(KERNELS=0: no kernel breakdown)"
  elif [ -n "$NSYS" ] && [ -x "$NSYS" ]; then
    step "kernels of ours, 480p81f, 2 forwards (nsys: total ms, launches, name)"
    timeout 300 "$NSYS" profile --force-overwrite true --trace cuda -o "$LOGS/dit_481f" \
      target/gpu/dit_step --height 480 --width 832 --frames 81 --warmup 1 --iters 1 --no-split \
      > "$LOGS/nsys_profile.log" 2>&1
    timeout 200 "$NSYS" stats --report cuda_gpu_kern_sum --format csv --output - "$LOGS/dit_481f.nsys-rep" \
      2> "$LOGS/nsys_stats.err" | python3 -c '
import csv, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) > 8]
head, body = rows[0], rows[1:]
ti, ni, na = head.index("Total Time (ns)"), head.index("Instances"), head.index("Name")
total = sum(float(r[ti]) for r in body)
print(f"all kernels: {total / 1e6:.1f} ms")
for r in sorted(body, key=lambda r: -float(r[ti]))[:25]:
    print(f"{float(r[ti]) / 1e6:10.1f} {r[ni]:>7}  {r[na][:110]}")
' || echo "nsys stats failed (see $LOGS/nsys_stats.err)"
  elif command -v ncu >/dev/null || [ -x /usr/local/cuda/bin/ncu ]; then
    # No nsys: Nsight Compute times every kernel of one forward (serialised, so launch gaps do not
    # show; ours' wall time minus this sum is what the gaps and the host cost). L2 is not flushed and
    # the clocks are left alone, so each kernel runs as it does in the forward.
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    step "kernels of ours, 480p81f, 2 forwards (the timed one and the host-issue one; ncu gpu__time_duration: total ms, launches, name)"
    timeout 400 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --csv --print-units base target/gpu/dit_step --height 480 --width 832 --frames 81 \
      --warmup 0 --iters 1 --no-split > "$LOGS/ncu_dit_481f.csv" 2> "$LOGS/ncu_dit_481f.err"
    python3 scripts/lib/kernel-times.py "$LOGS/ncu_dit_481f.csv" \
      || echo "ncu kernel times failed (see $LOGS/ncu_dit_481f.err)"
  else
    echo "(neither nsys nor ncu installed: no kernel breakdown)"
  fi
fi
if [ "$big" -eq 1 ]; then
  OURS_ITERS="--warmup 1 --iters 1 $FP8_ARGS"
  run_pair 14b720p81f --preset wan2.1-t2v-14b --height 720 --width 1280 --frames 81
fi

step "summary"
echo "GPU vs diffusers (f32 CPU run): worst over the 3 timestep cases per fixture, dtype and tensor"
grep -ho 'WANPARITY.*' "$LOGS/wan_cuda.log" | awk -F'\t' '
  { key = $2 " " $5 " " $4; s = $6; sub(/^scaled /, "", s); m = $7; sub(/^max\/rms /, "", m);
    e = $8; sub(/^rms\/rms /, "", e);
    if (!(key in seen)) { seen[key] = 1; order[n++] = key; tol[key] = $9 }
    if (e + 0 > rms[key] + 0) rms[key] = e; if (m + 0 > mx[key] + 0) mx[key] = m; if (s + 0 > sc[key] + 0) sc[key] = s }
  END {
    if (n == 0) { print "no WANPARITY lines (see the log)"; exit }
    printf "%-40s %10s %10s %10s  %s\n", "fixture dtype tensor", "scaled", "max/rms", "rms/rms", "tolerance"
    for (i = 0; i < n; i++) { k = order[i]; printf "%-40s %10s %10s %10s  %s\n", k, sc[k], mx[k], rms[k], tol[k] }
  }'
echo
for label in 480p5f 480p81f 14b720p81f; do
  [ -f "$LOGS/dit_step_$label.log" ] || continue
  dims=Wan2.1-1.3B
  [ "$label" = 14b720p81f ] && dims=Wan2.1-14B
  echo "$dims dims, bf16, $label: ms (ours | diffusers), ours/diffusers"
  cat "$LOGS/dit_step_$label.log" "$LOGS/dit_step_torch_$label.log" 2>/dev/null | grep -h '^RESULT' | awk -F'\t' '
    { v[$2 " " $3] = $4; x[$2 " " $3] = $6 " " $7; if (!($3 in seen)) { seen[$3] = 1; order[n++] = $3 } }
    END {
      printf "  %-16s %12s %12s %8s   %s\n", "what", "ours", "diffusers", "ratio", "(ours | diffusers)"
      for (i = 0; i < n; i++) { k = order[i]; o = v["ours " k]; d = v["diffusers " k]
        r = (o != "" && d != "" && d + 0 > 0) ? sprintf("%.2fx", o / d) : "-"
        printf "  %-16s %12s %12s %8s   %s | %s\n", k, o, d, r, x["ours " k], x["diffusers " k] }
      if (v["ours forward fp8"] != "" && v["diffusers forward"] + 0 > 0)
        printf "  %-16s %12s %12s %7.2fx   (FP8 linears + self-attention) | bf16\n", "forward fp8", v["ours forward fp8"], v["diffusers forward"], v["ours forward fp8"] / v["diffusers forward"]
    }'
  grep -h '^RESULT' "$LOGS/dit_step_$label.log" | grep -E 'fp8|quantize' | cut -f3- | sed 's/^/  /'
done
echo
[ "$status" -eq 0 ] && echo "gpu-dit: all steps passed" || echo "gpu-dit: SOME STEPS FAILED"
exit "$status"
