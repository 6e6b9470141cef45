#!/usr/bin/env bash
# The whole test suite: formatting, clippy (warnings are errors), all unit and integration tests
# (real coordinator and worker processes on 127.0.0.1), the deploy/ file checks, the TensorBoard
# round trip (scripts/check-tensorboard.sh), the live dashboard in headless Chromium
# (scripts/check-dashboard.sh), and, as root,
# the multi-host test across network namespaces. Installs what it needs first (scripts/setup.sh)
# and writes the test corpora from Debian packages into corpora/ (scripts/corpora.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
extra=()
if [ "$(id -u)" = 0 ]; then extra+=(iproute2); fi
scripts/setup.sh "${extra[@]}"
scripts/corpora.sh
if ! command -v cargo >/dev/null; then export PATH="$HOME/.cargo/bin:$PATH"; fi

step() { printf '\n== %s\n' "$*"; }
step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy (warnings are errors)"
cargo clippy --release --workspace --all-targets -- -D warnings
step "cargo test"
cargo test --release --workspace
step "deploy/ file checks"
scripts/validate-deploy.sh target/release
step "TensorBoard round trip (the tensorboard package reads every scalar of a short job)"
cargo build --release --bins
scripts/check-tensorboard.sh target/release
step "live dashboard (headless Chromium: token form, loss chart, ring, a worker killed and the recovery shown)"
scripts/check-dashboard.sh target/release
if [ "$(id -u)" = 0 ] && ip netns list >/dev/null 2>&1; then
  step "multi-host test (network namespaces)"
  scripts/multihost-test.sh --netem --link-cut target/release
  step "multi-host test, 8 worker hosts (1 Gbit/s links, bf16 gradients, two killed at once, a newcomer)"
  scripts/multihost-test.sh --netem --kill-two --workers 8 --allreduce-dtype bf16 target/release
else
  step "multi-host test skipped: it needs root and network namespaces (run scripts/multihost-test.sh as root)"
fi
step "container base image (debootstrap + docker import, once per machine)"; scripts/container-base.sh
step "Docker: the Dockerfile's runtime stage, compose.yaml's cluster, four faults mid-job"; scripts/container-test.sh target/release
step "Slurm: a real cluster in containers (slurmctld, 3 slurmd, munge) runs deploy/slurm/keel.sbatch"; scripts/slurm-test.sh target/release
