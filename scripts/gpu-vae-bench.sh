#!/usr/bin/env bash
# Runs on the GPU machine (kind nvidia-h200-x2), from the repo root, with prebuilt executables in
# target/gpu/ (made here by scripts/build-gpu-vae-bench.sh; carry target/gpu and .whl with the working
# tree). Issue 7's GPU benchmark:
#   1. the CUDA attention parity cases (portable and tensor-core kernels against the CPU twin; head
#      dims 64–512, the Wan VAE's 480p frame at head dim 384 included), DITSTREAM_REQUIRE_GPUS=1;
#   2. the parallel VAE on 2 GPUs over NCCL against the 1-GPU decode (base16 and the real Wan 2.1 size,
#      f32 and bf16, both split dims, even and uneven bands), DITSTREAM_REQUIRE_GPUS=2;
#   3. ours: the Wan 2.1 VAE (random weights, bf16) decoding 480p 81 frames (latent 16×21×60×104)
#      one latent frame per chunk, on 1 GPU (with the per-op profile and the attention kernels alone)
#      and on 2 GPUs (height split; latent frame 0 alone, then 1 and then 20 latent frames per
#      decode_chunk call: a wait for the communicator per call), then 720p 81 frames (latent
#      16×21×90×160) on 1 GPU;
#   4. diffusers' AutoencoderKLWan.decode at the same shapes (bench/vae_decode_torch.py; the carried
#      wheel is unpacked to /tmp and put on PYTHONPATH);
#   5. with --extra: 480p in f32 (ours and diffusers) and ours with the memory pool's default release
#      threshold (0: freed memory goes back to the driver at every sync);
#   6. a short table last.
# Expected run time: about 3–4 minutes (5–6 with --extra), most of it kernel compilation on first use
# and the decodes.
# With --pvae (issue 7's parallel-VAE speedup): only step 2 and ours at 480p bf16 on 1 and 2 GPUs
# (height split) with the per-rank breakdown, the 1-GPU and per-rank profiles, cuDNN's plans and the
# launch count of one chunk (no attention parity, no diffusers, no 720p); about 1–2 minutes on a
# warm machine (60 s measured); the table last is the breakdown, the profiles side by side and the
# speedup.
# Logs go to $OUT (the device runner's output folder) when set, else /tmp/ditstream-gpu. Exits
# non-zero if any step failed (the table is printed anyway).
set -uo pipefail
cd "$(dirname "$0")/.."
extra=0
pvae=0
[ "${1:-}" = "--extra" ] && extra=1
[ "${1:-}" = "--pvae" ] && pvae=1

# Library set-up and NVLink multicast off (GPU.md); defines SP and PY.
source scripts/lib/gpu-env.sh

export PYTHONUNBUFFERED=1

status=0
step() { echo; echo "=== $* ==="; }

step "machine"
date -u
nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
for bin in target/gpu/kernels_cuda_parity target/gpu/decoder_parallel_vae_nccl target/gpu/vae_decode; do
  if [ ! -x "$bin" ]; then
    echo "missing $bin: run scripts/build-gpu-vae-bench.sh on the build machine and carry target/gpu" >&2
    exit 2
  fi
done

if [ "$pvae" -eq 0 ]; then
step "CUDA attention parity, head dims 64–512 (DITSTREAM_REQUIRE_GPUS=1)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=1 timeout 300 target/gpu/kernels_cuda_parity attention --test-threads=1 \
  --nocapture > "$LOGS/attention_parity.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|test result" "$LOGS/attention_parity.log" | head -n 20
[ "$rc" -eq 0 ] || { echo "attention parity FAILED (exit $rc)"; status=1; }
fi

step "parallel VAE on 2 GPUs over NCCL vs 1 GPU (DITSTREAM_REQUIRE_GPUS=2)"
start=$(date +%s%N)
DITSTREAM_REQUIRE_GPUS=2 timeout 400 target/gpu/decoder_parallel_vae_nccl --test-threads=1 \
  --nocapture > "$LOGS/parallel_vae_nccl.log" 2>&1
rc=$?
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
grep -E "^test |panicked|test result|outside|cases on" "$LOGS/parallel_vae_nccl.log" | head -n 20
[ "$rc" -eq 0 ] || { echo "parallel VAE NCCL test FAILED (exit $rc)"; status=1; }

# The diffusers wheel is pure Python: unpack it where PYTHONPATH can see it.
site=/tmp/ditstream-site
whl=$(unpack_wheel 'diffusers-0.42.1-*.whl' "$site")

ours() { # $1: log name, then vae_decode's arguments
  local name=$1; shift
  step "ours: vae_decode $*"
  timeout 420 target/gpu/vae_decode "$@" 2>&1 | tee "$LOGS/ours_$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "vae_decode $name FAILED"; status=1; }
}
theirs() { # $1: log name, then vae_decode_torch.py's arguments
  local name=$1; shift
  step "diffusers: vae_decode_torch.py $*"
  if [ -z "$whl" ]; then
    echo "skipped: no diffusers wheel in .whl/"; status=1; return
  fi
  PYTHONPATH=$site timeout 300 "$PY" bench/vae_decode_torch.py "$@" 2>&1 | tee "$LOGS/diffusers_$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "vae_decode_torch $name FAILED"; status=1; }
}

if [ "$pvae" -eq 1 ]; then
  ours 480p_bf16 --height 480 --width 832 --frames 81 --dtype bf16 --gpus 2 --split height \
    --warmup 1 --iters 2 --profile --launches --chunk-frames 1,20
  step "summary (--pvae)"
  echo "parallel VAE, 2 GPUs vs 1 (max |diff|, RMS(diff)/RMS(want), bound):"
  grep -ho 'VAE_NCCL.*' "$LOGS/parallel_vae_nccl.log" | awk -F'\t' \
    '{ printf "  %-12s %-5s %-15s %-7s %11s %11s  %-26s %s\n", $2, $3, $4, $5, $6, $7, $8, $9 }'
  log="$LOGS/ours_480p_bf16.log"
  echo
  echo "cuDNN plans of the 3x3 convs (cuda:0: full shapes and rank 0's bands; cuda:1: rank 1's bands):"
  grep -h '^PLAN' "$log" | grep -E 'k \[(3|1), 3, 3\]' | cut -f2- | sed 's/^/  /' | head -n 40
  echo
  echo "1 GPU, one decode with events around each conv (top 10, then totals):"
  grep -h '^OP	' "$log" | head -n 10 | awk -F'\t' '{ printf "  %-52s %6s %9s ms %6s %% %8s TFLOP/s\n", $2, $3, $4, $5, $6 }'
  grep -h '^PROFILE	' "$log" | awk -F'\t' '{ printf "  %-72s %9s ms %6s %%\n", $2, $3, $5 }'
  for r in 0 1; do
    echo "2 GPUs, rank $r, one decode with events around each sharded op (top 12, then totals):"
    grep -h "^OP2	rank$r	" "$log" | head -n 12 | awk -F'\t' '{ printf "  %-52s %6s %9s ms %6s %% %8s TFLOP/s\n", $3, $4, $5, $6, $7 }'
    grep -h "^PROFILE2	rank$r	" "$log" | awk -F'\t' '{ printf "  %-72s %9s ms %6s %%\n", $3, $4, $6 }'
  done
  echo
  echo "GPU work items of one steady-state 1-GPU chunk:"
  grep -h '^LAUNCHES' "$log" | awk -F'\t' '{ printf "  %-40s %s\n", $2, $3 }'
  echo
  echo "host time per step, summed over the 21 chunks of the median decode (ms; backlog: GPU work still"
  echo "queued when the host finished queueing each chunk, summed; ~0 = the GPU waited for the host):"
  grep -h '^BREAKDOWN' "$log" | awk -F'\t' '
    NR == 1 { next }
    { printf "  %-11s wall %7s  GPU %7s  queue %7s  agree %6s  kv-gather %6s  waited-halo %6s (%s)  sync %7s  gather %7s  other %6s  backlog %7s  halos %s (%s ms host)\n",
        $2, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16 }'
  echo
  grep -hE '^(RESULT|SPEEDUP)' "$log" | awk -F'\t' '
    $1 == "RESULT" { printf "  ours %s, %s GPU(s)%s: %s ms (first frame %s ms, later calls median %s ms)\n", $3, $4, ($10 != "" ? ", then " $10 " latent frames per call" : ""), $5, $6, $7 }
    $1 == "SPEEDUP" { printf "  2-GPU speedup %sx, latent frame 0 alone, then %s per call (target >= 1.8x)\n", $5, $6 }'
  echo
  [ "$status" -eq 0 ] && echo "gpu-vae-bench --pvae: all steps passed" || echo "gpu-vae-bench --pvae: SOME STEPS FAILED"
  exit "$status"
fi

ours 480p_bf16 --height 480 --width 832 --frames 81 --dtype bf16 --gpus 2 --split height \
  --warmup 1 --iters 2 --profile --attention --chunk-frames 1,20
theirs 480p_bf16 --height 480 --width 832 --frames 81 --dtype bf16 --warmup 1 --iters 2
ours 720p_bf16 --height 720 --width 1280 --frames 81 --dtype bf16 --gpus 1 --warmup 1 --iters 1
theirs 720p_bf16 --height 720 --width 1280 --frames 81 --dtype bf16 --warmup 1 --iters 1
if [ "$extra" -eq 1 ]; then
  ours 480p_f32 --height 480 --width 832 --frames 81 --dtype f32 --gpus 1 --warmup 1 --iters 1
  theirs 480p_f32 --height 480 --width 832 --frames 81 --dtype f32 --warmup 1 --iters 1
  ours 480p_bf16_release --height 480 --width 832 --frames 81 --dtype bf16 --gpus 1 --warmup 1 \
    --iters 1 --release-pool
fi

step "summary"
echo "attention parity (worst per kernel and dtype; bounds in kernels/tests/cuda_parity.rs):"
grep -ho 'PARITY.*' "$LOGS/attention_parity.log" | awk -F'\t' '
  { key = $2 " " $3; if (!(key in seen)) { seen[key] = 1; order[n++] = key; tol[key] = $6 }
    if ($5 + 0 > worst[key] + 0 || !(key in worst)) worst[key] = $5 }
  END { if (n == 0) { print "  no PARITY lines (see the log)"; exit }
        for (i = 0; i < n; i++) { k = order[i]; printf "  %-62s %11s  %s\n", k, worst[k], tol[k] } }'
echo
echo "parallel VAE, 2 GPUs vs 1 (max |diff|, RMS(diff)/RMS(want), bound):"
grep -ho 'VAE_NCCL.*' "$LOGS/parallel_vae_nccl.log" | awk -F'\t' \
  '{ printf "  %-12s %-5s %-15s %-7s %11s %11s  %-26s %s\n", $2, $3, $4, $5, $6, $7, $8, $9 }'
echo
echo "where ours spends the time (480p bf16, 1 GPU, one decode with events around each conv):"
grep -h '^OP	' "$LOGS/ours_480p_bf16.log" 2>/dev/null | head -n 11 | awk -F'\t' \
  '{ printf "  %-52s %6s %10s %12s %8s\n", $2, $3, $4, $5, $6 }'
grep -h '^PROFILE	' "$LOGS/ours_480p_bf16.log" 2>/dev/null | awk -F'\t' '{ printf "  %-70s %9s ms %6s %%\n", $2, $3, $5 }'
grep -h '^ATTENTION' "$LOGS/ours_480p_bf16.log" 2>/dev/null | awk -F'\t' \
  '{ printf "  attention alone %-40s %s %s %s ms/frame %s TFLOP/s\n", $2, $3, $4, $5, $7 }'
echo
echo "Wan 2.1 VAE decode, 81 frames, random weights, one latent frame per chunk (ours) | diffusers"
cat "$LOGS"/ours_*.log "$LOGS"/diffusers_*.log 2>/dev/null | grep -hE '^(RESULT|SPEEDUP)' | awk -F'\t' '
  $1 == "RESULT" && $4 == "1" { k = $3; if (!(k in seen)) { seen[k] = 1; order[n++] = k }
    if ($2 == "ours") { o[k] = $5; ff[k] = $6; po[k] = $8 } else { d[k] = $5; pd[k] = $8 } }
  $1 == "RESULT" && $4 == "2" && $2 == "ours" { o2[$3] = $5 }
  $1 == "SPEEDUP" { sp[$2] = $5 }
  END {
    printf "%-32s %10s %12s %7s %14s %17s %10s %9s\n", "config", "ours ms", "diffusers ms", "ratio",
      "first-frame ms", "peak GiB ours|diff", "2-GPU ms", "speedup"
    for (i = 0; i < n; i++) { k = order[i]
      r = (o[k] != "" && d[k] != "" && d[k] + 0 > 0) ? sprintf("%.2fx", o[k] / d[k]) : "-"
      printf "%-32s %10s %12s %7s %14s %17s %10s %9s\n", k, (o[k] != "" ? o[k] : "-"),
        (d[k] != "" ? d[k] : "-"), r, (ff[k] != "" ? ff[k] : "-"),
        (po[k] != "" ? po[k] : "-") "|" (pd[k] != "" ? pd[k] : "-"),
        (o2[k] != "" ? o2[k] : "-"), (sp[k] != "" ? sp[k] "x" : "-") }
    print "targets (DESIGN.md): ours <= 0.5x diffusers at 480p bf16; 2-GPU speedup >= 1.8x"
  }'
echo
[ "$status" -eq 0 ] && echo "gpu-vae-bench: all steps passed" || echo "gpu-vae-bench: SOME STEPS FAILED"
exit "$status"
