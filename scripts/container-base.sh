#!/usr/bin/env bash
# Makes the base image deploy/docker/Dockerfile's runtime stage starts from (debian:bookworm-slim)
# on a machine whose Docker engine cannot pull from a registry: a Debian 12 root file system
# built by debootstrap (--variant=minbase) from Debian's package mirror, trimmed like Debian's
# own slim images (no documentation, manual pages or locales; dpkg told to leave them out of
# later installs too), then `docker import`ed under that name. Skips all of it when an image of
# that name is already there (once per machine: about a minute, 2/3 of it the download).
#
# Usage (as root): scripts/container-base.sh [--force] [IMAGE]
#   IMAGE    the name to import under (default: the FROM of the Dockerfile's last stage)
#   --force  rebuild and re-import even when IMAGE exists
# Environment: KEEL_DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Installs debootstrap (Debian package) when missing. The temporary root file system is removed
# on exit, whatever the exit.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIRROR="${KEEL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
FORCE=0
IMAGE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "container-base: unknown option $1" >&2; exit 2 ;;
    *) IMAGE="$1" ;;
  esac
  shift
done
# The runtime stage is the Dockerfile's last FROM.
[ -n "$IMAGE" ] || IMAGE="$(awk 'toupper($1) == "FROM" { img = $2 } END { print img }' "$REPO/deploy/docker/Dockerfile")"
[ -n "$IMAGE" ] || { echo "container-base: no FROM in deploy/docker/Dockerfile" >&2; exit 1; }

log() { printf '[container-base %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[container-base] FAIL: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, docker)"
command -v docker >/dev/null || die "'docker' not found (Debian: apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "the Docker daemon does not answer (docker info failed)"

if [ "$FORCE" = 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "$IMAGE is already there ($(docker image inspect -f '{{.Id}}' "$IMAGE" | cut -c1-19)); nothing to do"
  exit 0
fi

if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap (Debian package)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

ROOTFS="$(mktemp -d /var/tmp/keel-rootfs.XXXXXX)"
cleanup() {
  local rc=$?
  set +e
  # debootstrap may leave /proc or /sys mounted when it fails half-way.
  for m in proc sys dev/pts dev; do umount -l "$ROOTFS/$m" 2>/dev/null; done
  rm -rf --one-file-system "$ROOTFS"
  [ "$rc" = 0 ] || echo "[container-base] exit $rc" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

t0=$SECONDS
log "debootstrap --variant=minbase bookworm from $MIRROR into $ROOTFS"
timeout 900 debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
  || { tail -n 20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; die "debootstrap failed (see above)"; }
rm -f "$ROOTFS.log"
log "debootstrap done in $((SECONDS - t0)) s: $(du -sh --one-file-system "$ROOTFS" | cut -f1)"

# What Debian's official bookworm-slim image has: the same sources (with updates and security),
# dpkg excludes for documentation, apt cleaning its caches after every install.
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${MIRROR%/debian}/debian-security bookworm-security main
EOF
mkdir -p "$ROOTFS/etc/dpkg/dpkg.cfg.d" "$ROOTFS/etc/apt/apt.conf.d"
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# Written by Keel's scripts/container-base.sh, as in Debian's slim images.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
EOF
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
echo 'APT::Install-Recommends "false";' >"$ROOTFS/etc/apt/apt.conf.d/docker-no-recommends"
find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$ROOTFS"/usr/share/{man,info,groff,lintian,linda,locale}/* \
  "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
  "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log "$ROOTFS"/var/log/apt/* \
  "$ROOTFS"/tmp/* "$ROOTFS"/root/.bash_history
: >"$ROOTFS/etc/hostname"
log "trimmed to $(du -sh --one-file-system "$ROOTFS" | cut -f1)"

tar --numeric-owner --one-file-system -C "$ROOTFS" -c . \
  | docker import --change 'CMD ["bash"]' \
      --message "debootstrap --variant=minbase bookworm ($MIRROR), by Keel's scripts/container-base.sh" \
      - "$IMAGE" >/dev/null
log "imported $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }'), $((SECONDS - t0)) s in all"
