#!/usr/bin/env bash
# The test command of the README and CI: installs the system packages the build needs, then runs
# every test of the workspace with every feature compiled (GPU tests skip on machines without
# GPUs unless DITSTREAM_REQUIRE_GPUS says they are required), then builds the docs with rustdoc's
# warnings as errors (a shape like [n] that rustdoc reads as a broken link fails the run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo test --workspace --all-features --locked "$@"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --locked
