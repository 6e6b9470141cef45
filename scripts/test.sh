#!/usr/bin/env bash
# The whole test suite: formatting, clippy (warnings are errors), all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
cargo test --release --workspace
