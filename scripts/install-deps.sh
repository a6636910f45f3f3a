#!/usr/bin/env bash
# Installs the Debian packages ditstream builds and tests against. Idempotent; run as root
# (or with sudo available). Called by scripts/test.sh, scripts/demo.sh and .ci/run.
set -euo pipefail

# The default build needs none of these (protox parses the .proto files; openh264 builds without
# nasm, only slower): they serve the `ffmpeg` and `ucx` features and the tests.
packages=(
  pkg-config nasm                    # openh264's assembly (faster encoding)
  libavcodec-dev libavformat-dev libavutil-dev libswscale-dev  # ffmpeg-next (x264 backend)
  ffmpeg                             # ffprobe and ffmpeg, to check the MP4s we write
  libucx-dev clang libclang-dev      # the UCX latent link (bindgen bindings over UCX 1.13)
  python3-venv curl chromium         # the HTTP API's outside clients: the openai SDK, curl,
                                     # a browser for the page (headless)
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
