# Sourced by scripts/gpu-*.sh on the GPU machine, from the repo root: the CUDA library set-up of
# /work/shared/GPU.md, in one place. Defines SP (the NVIDIA pip libraries of the torch venv) and PY
# (that venv's python), links the unversioned names cudarc looks for (it tries libnccl.so, never
# libnccl.so.2), puts them first on LD_LIBRARY_PATH, points NVRTC at the CUDA headers, and keeps
# NVLink multicast off. Also what every GPU script shares: LOGS, the logs folder ($OUT when set,
# else /tmp/ditstream-gpu, created), and one kernel cache for the run in /tmp. The DITSTREAM_*
# settings variables are read by the tests' GPU gate and the benchmarks only
# (kernels/src/testing.rs); `serve` takes the same from its config's `cuda:` section. A script
# that wants another cache sets it after sourcing this.
SP=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
PY=/opt/torch/.venv/bin/python
mkdir -p /tmp/cudalinks
link() { [ -e "$1" ] && ln -sf "$1" "/tmp/cudalinks/$2"; }
link "$SP/nccl/lib/libnccl.so.2"      libnccl.so
link "$SP/cudnn/lib/libcudnn.so.9"    libcudnn.so
link "$SP/cu13/lib/libcublas.so.13"   libcublas.so
link "$SP/cu13/lib/libcublasLt.so.13" libcublasLt.so
link "$SP/cu13/lib/libnvrtc.so.13"    libnvrtc.so
export LD_LIBRARY_PATH=/tmp/cudalinks:$SP/cu13/lib:$SP/cudnn/lib:$SP/nccl/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# NVRTC needs cuda_bf16.h: the pip headers match the pip NVRTC (GPU.md). ditstream looks in no
# machine-specific place by itself, so name it here.
export DITSTREAM_CUDA_INCLUDE=${DITSTREAM_CUDA_INCLUDE:-$SP/cu13/include}
# NVLink multicast can take the host's GPUs out of service: keep it off in every process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS=${OUT:-/tmp/ditstream-gpu}
mkdir -p "$LOGS"
export DITSTREAM_KERNEL_CACHE=/tmp/ditstream-kernel-cache
# The first wheel in .whl/ whose name matches the glob $1, unpacked into $2 (emptied first), for a
# PYTHONPATH: pure wheels the torch venv lacks travel there (GPU.md). Prints the wheel's path, or
# nothing when there is none (the caller then skips what needs it).
unpack_wheel() {
  local whl
  # shellcheck disable=SC2086  # $1 is a glob
  whl=$(ls .whl/$1 2>/dev/null | head -n 1) || true
  [ -n "$whl" ] || return 0
  rm -rf "$2" && mkdir -p "$2"
  "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$2"
  echo "$whl"
}
