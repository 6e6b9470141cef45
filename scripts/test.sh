#!/usr/bin/env bash
# The whole test suite: formatting, clippy (warnings are errors), all unit and integration tests
# (real coordinator and worker processes on 127.0.0.1), the deploy/ file checks, the TensorBoard
# round trip (scripts/check-tensorboard.sh), the live dashboard in headless Chromium
# (scripts/check-dashboard.sh), and, as root,
# the multi-host test across network namespaces. Installs what it needs first (scripts/setup.sh)
# and writes the test corpora from Debian packages into corpora/ (scripts/corpora.sh).
#
# Every step runs even when an earlier one failed (a failing crate must not hide the tests after
# it: `cargo test --no-fail-fast`), and the end lists every failed step and test; the exit status
# is 1 if anything failed. The start names the CPU and the bf16 kernel oneDNN picked on it (AMX,
# AVX512_BF16, or none), since the bf16 tests exercise different kernels on different CPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=()
if [ "$(id -u)" = 0 ]; then extra+=(iproute2); fi
scripts/setup.sh "${extra[@]}"
scripts/corpora.sh
if ! command -v cargo >/dev/null; then export PATH="$HOME/.cargo/bin:$PATH"; fi

step() { printf '\n== %s (at %d s)\n' "$*" "$SECONDS"; }
failed=()
# Each step's wall time, listed at the end: the suite must stay well inside CI's limit, and
# this shows which step grew.
timings=()
# run NAME COMMAND...: one step of the suite; a failure is noted and the suite goes on.
run() {
  local name=$1 started=$SECONDS
  shift
  step "$name"
  if ! "$@"; then
    failed+=("$name")
    echo "== FAILED: $name"
  fi
  timings+=("$(printf '%6d s  %s' $((SECONDS - started)) "$name")")
}
log_dir=$(mktemp -d /tmp/keel-test.XXXXXX)
trap 'rm -rf "$log_dir"' EXIT

setup_seconds=$SECONDS
step "this machine"
grep -m1 'model name' /proc/cpuinfo || true
echo "bf16 instructions: $(grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
if cargo build --release -q -p keel-worker --bin keel-worker; then
  target/release/keel-worker bf16-probe || failed+=("bf16 probe")
else
  failed+=("build keel-worker")
fi

run "cargo fmt --check" cargo fmt --all --check
run "cargo clippy (warnings are errors)" cargo clippy --release --workspace --all-targets -- -D warnings
run "rustdoc (warnings are errors; missing docs warned in the library crates)" \
  env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
cargo_test() {
  cargo test --release --workspace --no-fail-fast 2>&1 | tee "$log_dir/cargo-test.log"
}
run "cargo test" cargo_test
run "build the binaries" cargo build --release --bins
run "deploy/ file checks" scripts/validate-deploy.sh target/release
run "TensorBoard round trip (the tensorboard package reads every scalar of a short job)" \
  scripts/check-tensorboard.sh target/release
run "live dashboard (headless Chromium: token form, loss chart, ring, a worker killed and the recovery shown)" \
  scripts/check-dashboard.sh target/release
if [ "$(id -u)" = 0 ] && ip netns list >/dev/null 2>&1; then
  run "multi-host test (network namespaces)" \
    scripts/multihost-test.sh --netem --link-cut target/release
  run "multi-host test, 8 worker hosts (1 Gbit/s links, bf16 gradients, two killed at once, a newcomer)" \
    scripts/multihost-test.sh --netem --kill-two --workers 8 --allreduce-dtype bf16 target/release
else
  step "multi-host test skipped: it needs root and network namespaces (run scripts/multihost-test.sh as root)"
fi
if [ "$(id -u)" = 0 ] && command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  run "container base image (debootstrap + docker import, once per machine)" scripts/container-base.sh
  run "Docker: the Dockerfile's runtime stage, compose.yaml's cluster, four faults mid-job" \
    scripts/container-test.sh target/release
  run "Slurm: a real cluster in containers (slurmctld, 3 slurmd, munge) runs deploy/slurm/keel.sbatch" \
    scripts/slurm-test.sh target/release
  run "systemd: the units under systemd as PID 1 in containers, installed as deploy/README.md says; a job, the sandbox, a worker killed" \
    scripts/systemd-test.sh target/release
else
  step "container, Slurm and systemd tests skipped: they need root and a running Docker engine"
fi
run "docs checks" scripts/check-docs.sh target/release

step "summary"
echo "wall time of each step (before them: packages and corpora $setup_seconds s, then the bf16 probe and its build):"
printf '%s\n' "${timings[@]}"
if [ ${#failed[@]} -eq 0 ]; then
  echo "every step passed"
  exit 0
fi
echo "failed steps:"
printf '  %s\n' "${failed[@]}"
if [ -f "$log_dir/cargo-test.log" ]; then
  tests=$(grep -E '^test .* \.\.\. FAILED$' "$log_dir/cargo-test.log" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/' || true)
  if [ -n "$tests" ]; then
    echo "failed tests:"
    printf '  %s\n' $tests
  fi
  grep -A100 -E '^error: [0-9]+ targets? failed' "$log_dir/cargo-test.log" | grep -E '^ +`' |
    sed 's/^ */  failed target: /' || true
fi
exit 1
