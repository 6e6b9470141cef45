#!/usr/bin/env bash
# Installs what building and running Keel needs on a Debian or Ubuntu machine, and nothing
# that is already there: OpenBLAS (libopenblas-dev), oneDNN (libdnnl-dev: the bf16 GEMMs, and
# libgomp, which its Debian build runs on), a C compiler, and the Rust toolchain
# (rustup, into ~/.cargo) when `cargo` is missing. Extra Debian packages can be named as
# arguments (the demo adds bible-kjv, the tests iproute2 and friends).
# Uses sudo when not root. Prints what it installs.
set -euo pipefail

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "setup: need root (or sudo) to run: $*" >&2; exit 1; fi
}

want=(libopenblas-dev libdnnl-dev "$@")
command -v cc >/dev/null || want+=(build-essential)
command -v cargo >/dev/null || [ -x "$HOME/.cargo/bin/cargo" ] || want+=(curl ca-certificates)
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
  echo "setup: installing the Rust toolchain with rustup into ~/.cargo"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal -c rustfmt,clippy
fi
