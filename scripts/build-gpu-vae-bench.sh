#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-vae-bench.sh runs on the GPU machine (release, feature
# `cuda`; libcuda, libnvrtc, libcublasLt and libnccl load at run time, so no toolkit is needed to build),
# strips them and copies them to target/gpu/:
#   target/gpu/kernels_cuda_parity          GPU-vs-CPU parity of the CUDA ops (kernels/tests/cuda_parity.rs;
#                                           the bench script runs its attention cases, head dim 384 included)
#   target/gpu/decoder_parallel_vae_nccl    the parallel VAE on 2 GPUs over NCCL vs the 1-GPU decode
#                                           (decoder/tests/parallel_vae_nccl.rs)
#   target/gpu/vae_decode                   the Wan 2.1 VAE decode benchmark (bench/src/bin/vae_decode.rs)
# target/ is git-ignored: carry target/gpu (and .whl, the diffusers wheel for bench/vae_decode_torch.py)
# to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
pick() { # $1: cargo's JSON messages, $2: target name, $3: target kind
  printf '%s\n' "$1" | python3 scripts/lib/cargo-exe.py "$2" "$3"
}
json=$(cargo test --release -p ditstream-kernels --features cuda --test cuda_parity \
  --no-run --message-format=json)
parity=$(pick "$json" cuda_parity test)
json=$(cargo test --release -p ditstream-decoder --features cuda --test parallel_vae_nccl \
  --no-run --message-format=json)
nccl=$(pick "$json" parallel_vae_nccl test)
json=$(cargo build --release -p ditstream-bench --features cuda --bin vae_decode --message-format=json)
bench=$(pick "$json" vae_decode bin)
for exe in "$parity" "$nccl" "$bench"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-vae-bench.sh: an executable is missing (parity '$parity', nccl '$nccl', bench '$bench')" >&2
    exit 1
  fi
done
cp -f "$parity" target/gpu/kernels_cuda_parity
cp -f "$nccl" target/gpu/decoder_parallel_vae_nccl
cp -f "$bench" target/gpu/vae_decode
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/kernels_cuda_parity target/gpu/decoder_parallel_vae_nccl target/gpu/vae_decode
ls -l target/gpu/kernels_cuda_parity target/gpu/decoder_parallel_vae_nccl target/gpu/vae_decode
du -sh target/gpu
if ! ls .whl/diffusers-0.42.1-*.whl >/dev/null 2>&1; then
  echo "note: no diffusers wheel in .whl/ (pip download --no-deps diffusers==0.42.1 -d .whl): the diffusers reference will be skipped"
fi
echo "built; on the GPU machine (kind nvidia-h200-x2; target/gpu and .whl carried along): scripts/gpu-vae-bench.sh"
