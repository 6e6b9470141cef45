#!/usr/bin/env bash
# Builds Keel's image without a registry: deploy/docker/Dockerfile's runtime stage, unchanged
# (copied out of the file), around binaries already built on this machine. The Dockerfile's
# builder stage starts from rust:1-bookworm, which an engine without a registry cannot pull; a
# `FROM scratch AS builder` stage holding BIN_DIR's three binaries stands in for it. The runtime
# stage's base (debian:bookworm-slim) must exist locally: scripts/container-base.sh makes it.
# The runtime stage still runs apt-get, so Debian's package mirror must be reachable from a
# container. Uses the legacy builder (the runtime stage needs no BuildKit feature).
#
# Usage: scripts/container-image.sh [BIN_DIR] [TAG]
#   BIN_DIR  keel, keel-coordinator, keel-worker (default: $CARGO_TARGET_DIR/release, else
#            target/release); built on Debian 12 (or a system with the same glibc and libraries)
#   TAG      the image's name (default keel:latest, the name deploy/docker/compose.yaml uses)
# Prints the image's size. Leaves no other image or tag behind (the stand-in builder stage is
# built under TAG-bin and removed); the temporary build context is removed, whatever the exit.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
BIN_DIR="${1:-${CARGO_TARGET_DIR:-$REPO/target}/release}"
TAG="${2:-keel:latest}"

log() { printf '[container-image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[container-image] FAIL: %s\n' "$*" >&2; exit 1; }

for b in keel keel-coordinator keel-worker; do
  [ -x "$BIN_DIR/$b" ] || die "no $BIN_DIR/$b (cargo build --release --bins)"
done
docker image inspect debian:bookworm-slim >/dev/null 2>&1 \
  || die "no debian:bookworm-slim image here: run scripts/container-base.sh first (or docker pull it where a registry is reachable)"

CTX="$(mktemp -d /tmp/keel-image.XXXXXX)"
cleanup() {
  local rc=$?
  set +e
  docker image inspect "$TAG-bin" >/dev/null 2>&1 && docker rmi -f "$TAG-bin" >/dev/null 2>&1
  rm -rf "$CTX"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for b in keel keel-coordinator keel-worker; do
  ln "$BIN_DIR/$b" "$CTX/$b" 2>/dev/null || cp "$BIN_DIR/$b" "$CTX/$b"
done
{
  echo "# Written by scripts/container-image.sh: the host's binaries stand in for the builder stage."
  echo "FROM scratch AS builder"
  echo "COPY keel keel-coordinator keel-worker /out/"
  echo
  sed -n '/^FROM debian:bookworm-slim AS runtime/,$p' "$REPO/deploy/docker/Dockerfile"
} >"$CTX/Dockerfile"
grep -q '^FROM debian:bookworm-slim AS runtime' "$CTX/Dockerfile" \
  || die "deploy/docker/Dockerfile has no 'FROM debian:bookworm-slim AS runtime' stage"

t0=$SECONDS
# The builder stage first, under a tag of its own: the legacy builder would leave it untagged.
DOCKER_BUILDKIT=0 timeout 120 docker build --force-rm --target builder -t "$TAG-bin" "$CTX" >"$CTX/build.log" 2>&1 \
  || { tail -n 20 "$CTX/build.log" >&2; die "docker build of the stand-in builder stage failed"; }
DOCKER_BUILDKIT=0 timeout 600 docker build --force-rm -t "$TAG" "$CTX" >>"$CTX/build.log" 2>&1 \
  || { tail -n 20 "$CTX/build.log" >&2; die "docker build of the runtime stage failed"; }
size="$(docker image inspect -f '{{.Size}}' "$TAG")"
base="$(docker image inspect -f '{{.Size}}' debian:bookworm-slim)"
bins="$(du -cb "$BIN_DIR"/keel "$BIN_DIR"/keel-coordinator "$BIN_DIR"/keel-worker | tail -n 1 | cut -f1)"
log "built $TAG from the Dockerfile's runtime stage in $((SECONDS - t0)) s: $(awk -v s="$size" -v b="$base" -v n="$bins" \
  'BEGIN { printf "image %.0f MB (base %.0f MB, binaries %.0f MB, runtime libraries %.0f MB)", s/1e6, b/1e6, n/1e6, (s-b-n)/1e6 }')"
