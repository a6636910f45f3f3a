#!/usr/bin/env bash
# Builds, here, the executables scripts/gpu-dit.sh runs on the GPU machine (release, --features cuda;
# libcuda, libnvrtc and libcublasLt load at run time, so no toolkit is needed to build), strips them
# and copies them to target/gpu/:
#   target/gpu/denoiser_wan_cuda   the Wan transformer on the GPU vs diffusers (denoiser/tests/wan_cuda.rs)
#   target/gpu/dit_step            the DiT step timing driver (bench/src/bin/dit_step.rs)
# target/ is git-ignored: carry target/gpu (and .whl, the diffusers wheel for bench/dit_step_torch.py)
# to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p target/gpu
json=$(cargo test --release -p ditstream-denoiser --features cuda --test wan_cuda --no-run --message-format=json)
test_exe=$(printf '%s\n' "$json" | python3 scripts/lib/cargo-exe.py wan_cuda)
cargo build --release -p ditstream-bench --features cuda --bin dit_step
step_exe=target/release/dit_step
for exe in "$test_exe" "$step_exe"; do
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "build-gpu-dit.sh: an executable is missing (test '$test_exe', driver '$step_exe')" >&2
    exit 1
  fi
done
cp -f "$test_exe" target/gpu/denoiser_wan_cuda
cp -f "$step_exe" target/gpu/dit_step
# Debug info is most of their size, and the working tree that travels is limited to 64 MiB.
strip --strip-debug target/gpu/denoiser_wan_cuda target/gpu/dit_step
ls -l target/gpu/denoiser_wan_cuda target/gpu/dit_step
if ! ls .whl/diffusers-0.42.1-*.whl >/dev/null 2>&1; then
  echo "note: no diffusers wheel in .whl/ (pip download --no-deps diffusers==0.42.1 -d .whl): the torch reference will be skipped"
fi
echo "built; on the GPU machine (target/gpu and .whl carried along): scripts/gpu-dit.sh"
