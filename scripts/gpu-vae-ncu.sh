#!/usr/bin/env bash
# Runs on the GPU machine (one GPU is enough), from the repo root, with target/gpu/vae_decode built by
# scripts/build-gpu-vae-bench.sh: the GPU time of every kernel of one steady-state chunk of the Wan 2.1
# VAE decode (480p, bf16, random weights), from Nsight Compute. vae_decode --profiler-chunk N decodes a
# fresh stream with latent frame N alone between cuProfilerStart and cuProfilerStop, and ncu (capture
# off until then) times each kernel of that range on its own: where a chunk's time goes, kernel by
# kernel, cuDNN's included (what the events of vae_decode --profile cannot split).
# Arguments: [CHUNK] (default 3: chunks from 2 on repeat the same shapes). About 20 s.
# Clocks and caches are left as they are (--clock-control none: GPU.md, never change clocks;
# --cache-control none: kernels see the caches the decode leaves them). Logs go to $OUT when set,
# else /tmp/ditstream-gpu; the table last is the time per kernel name, largest first.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/gpu-env.sh
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$NCU" ] || { echo "ncu not found" >&2; exit 2; }
[ -x target/gpu/vae_decode ] || { echo "missing target/gpu/vae_decode: run scripts/build-gpu-vae-bench.sh" >&2; exit 2; }
chunk=${1:-3}

csv="$LOGS/vae_ncu_chunk$chunk.csv"
timeout 300 "$NCU" --clock-control none --cache-control none --profile-from-start off \
  --metrics gpu__time_duration.sum --csv --print-units base \
  target/gpu/vae_decode --height 480 --width 832 --frames 17 --dtype bf16 --gpus 1 --warmup 1 \
  --iters 1 --profiler-chunk "$chunk" > "$csv" 2> "$LOGS/vae_ncu_chunk$chunk.err"
rc=$?
[ "$rc" -eq 0 ] || { echo "ncu FAILED (exit $rc)"; tail -n 20 "$LOGS/vae_ncu_chunk$chunk.err"; exit 1; }
# ncu prints the decode's own output before its CSV: keep the quoted rows.
"$PY" - "$csv" <<'PYEOF'
import csv, re, sys
rows = [line for line in open(sys.argv[1]) if line.startswith('"')]
total, per = 0.0, {}
for r in csv.DictReader(rows):
    if r["Metric Name"] != "gpu__time_duration.sum":
        continue
    name = re.sub(r"\(.*", "", r["Kernel Name"])[:80]
    ms = float(r["Metric Value"].replace(",", "")) / 1e6
    calls, t = per.get(name, (0, 0.0))
    per[name] = (calls + 1, t + ms)
    total += ms
print(f"one chunk: {total:.3f} ms of kernels, {sum(c for c, _ in per.values())} launches")
for name, (calls, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
    print(f"  {t:8.3f} ms {100 * t / total:5.1f} % {calls:4d}  {name}")
PYEOF
