#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root: builds bench/micro/xu_rates.cu with the machine's
# nvcc and prints the issue rates of the FP8 attention softmax's instructions (MUFU.EX2, the e4m3
# and f16 conversions, alone and mixed), one warp and more per SM sub-partition.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
dir=$(mktemp -d)
"$NVCC" -arch=sm_90a -O3 -o "$dir/xu_rates" bench/micro/xu_rates.cu
"$dir/xu_rates"
