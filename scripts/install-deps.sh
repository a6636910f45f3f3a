#!/usr/bin/env bash
# Installs the Debian packages ditstream builds and tests against. Idempotent; run as root
# (or with sudo available). Called by scripts/test.sh, scripts/demo.sh and .ci/run.
set -euo pipefail

packages=(
  pkg-config clang libclang-dev      # bindgen (UCX bindings)
  protobuf-compiler                  # tonic/prost code generation
  nasm                               # openh264's assembly (the static H.264 encoder)
  libavcodec-dev libavformat-dev libavutil-dev libswscale-dev  # ffmpeg-next (x264 backend)
  libucx-dev                         # UCX latent link
  ffmpeg                             # ffprobe, to check the MP4s we write
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
