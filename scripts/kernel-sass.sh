#!/usr/bin/env bash
# What ptxas makes of a kernel source, without a GPU: compiles SOURCE.cu as the CUDA backend does
# (kernels/src/cuda/nvrtc.rs: the prelude first, sm_90a, the pip NVRTC 13.0 and its headers), prints
# each kernel's registers and spills and any ptxas warning (C7512 or C7515: wgmma serialised, for want
# of registers or for a write to an accumulator in flight), and with --kernel NAME the order of the
# loop's GEMMs, waits, barriers and exponentials in the SASS (so a schedule, e.g. the softmax between
# the S and P·V waits, can be read off). The venv lives in target/nvrtc-venv (pip reachable on
# first use).
# Usage: scripts/kernel-sass.sh kernels/src/ops/attention/hopper.cu [--kernel NAME]... [--sass-out F]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/nvrtc-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # nvdisasm has no 13.0 wheel; 13.2's reads 13.0's CUBINs.
  "$venv/bin/pip" install -q "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-nvdisasm==13.2.*"
fi
cu13=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13)
LD_LIBRARY_PATH="$cu13/lib" exec "$venv/bin/python" scripts/lib/nvrtc_sass.py "$@"
