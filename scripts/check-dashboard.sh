#!/usr/bin/env bash
# Checks the coordinator's live dashboard end to end in headless Chromium: starts a coordinator
# with a cluster token and `--metrics-listen 0.0.0.0:0` (not loopback, so the API needs the
# token), 3 workers and a BERT-tiny job (32-token sequences, 900 steps, held-out eval every 20,
# 2 to 3 workers) on part of the King James Bible, then with the page (scripts/check_dashboard.mjs):
# the API answers 401 without the token and the page asks for it; the loss chart reaches 10
# points; the ring lists the 3 workers; one worker gets SIGKILL; the timeline shows the recovery
# and the ring 2 workers; /metrics answers without the token. Screenshots before and after the
# kill go to $KEEL_DASHBOARD_SHOTS (default: a new folder under /tmp), and their paths are printed.
#
# Usage: scripts/check-dashboard.sh [BIN_DIR]
#   BIN_DIR  built keel, keel-coordinator, keel-worker (default: $CARGO_TARGET_DIR/release, else
#            target/release)
#
# Chromium is Debian's `chromium` package (apt-get, as root; as a user it must be installed
# already, else the check is skipped). playwright-core comes from npm, pinned, into
# /var/cache/keel-validate (as root) or ${XDG_CACHE_HOME:-~/.cache}/keel-validate (as a user),
# installed once; Node.js 20 and npm must be on the machine. When the package registry (Debian's
# mirror or npm) cannot be reached the check is skipped with a message and exit 0; any other
# failure exits 1.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
BIN_DIR="${1:-${CARGO_TARGET_DIR:-$REPO/target}/release}"
BIN_DIR="$(cd "$BIN_DIR" 2>/dev/null && pwd)" || { echo "check-dashboard: no folder ${1:-target/release}" >&2; exit 1; }
for b in keel keel-coordinator keel-worker; do
  [ -x "$BIN_DIR/$b" ] || { echo "check-dashboard: no $BIN_DIR/$b (cargo build --release --bins)" >&2; exit 1; }
done
coordinator_help="$("$BIN_DIR/keel-coordinator" --help 2>&1 || true)"
if ! grep -q -- '--metrics-listen' <<<"$coordinator_help"; then
  echo "check-dashboard: $BIN_DIR/keel-coordinator has no --metrics-listen (an older build?)" >&2
  exit 1
fi
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "check-dashboard: node and npm are needed (Node.js 20)" >&2
  exit 1
fi

PLAYWRIGHT_VERSION=1.65.1
CHROMIUM=/usr/bin/chromium
if [ "$(id -u)" = 0 ]; then CACHE=/var/cache/keel-validate; else CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/keel-validate"; fi
PW_DIR=$CACHE/playwright-core-$PLAYWRIGHT_VERSION

npm_reachable() {
  timeout 20 npm ping >/dev/null 2>&1
}

if [ ! -x "$CHROMIUM" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "check-dashboard: SKIPPED: $CHROMIUM is not installed and installing it needs root (apt-get install chromium)"
    exit 0
  fi
  echo "check-dashboard: installing Debian's chromium (apt-get)"
  log="$(mktemp)"
  if ! { timeout 300 apt-get update -q && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q --no-install-recommends chromium; } >"$log" 2>&1 \
     || [ ! -x "$CHROMIUM" ]; then
    if grep -qiE "could not resolve|failed to fetch|temporary failure|unable to connect|connection (refused|timed out)|network is unreachable" "$log"; then
      echo "check-dashboard: SKIPPED: the Debian mirror is unreachable, so chromium cannot be installed"
      rm -f "$log"
      exit 0
    fi
    echo "check-dashboard: installing chromium failed:" >&2
    tail -n 10 "$log" | sed 's/^/  /' >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
fi

if [ ! -f "$PW_DIR/node_modules/playwright-core/package.json" ]; then
  echo "check-dashboard: installing playwright-core@$PLAYWRIGHT_VERSION into $PW_DIR"
  log="$(mktemp)"
  if ! { mkdir -p "$PW_DIR" && cd "$PW_DIR" && { [ -f package.json ] || echo '{"private": true}' > package.json; } \
         && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 timeout 300 npm install --no-audit --no-fund --fetch-retries=1 --save-exact "playwright-core@$PLAYWRIGHT_VERSION"; } >"$log" 2>&1; then
    cd "$REPO"
    rm -rf "$PW_DIR"
    if ! npm_reachable; then
      echo "check-dashboard: SKIPPED: the npm registry is unreachable, so playwright-core cannot be installed"
      rm -f "$log"
      exit 0
    fi
    echo "check-dashboard: installing playwright-core failed although npm is reachable:" >&2
    tail -n 10 "$log" | sed 's/^/  /' >&2
    rm -f "$log"
    exit 1
  fi
  cd "$REPO"
  rm -f "$log"
fi

[ -f corpora/en-kjv/kjv.txt ] || scripts/corpora.sh en-kjv
work="$(mktemp -d /tmp/keel-dashboard.XXXXXX)"
shots="${KEEL_DASHBOARD_SHOTS:-$(mktemp -d /tmp/keel-dashboard-shots.XXXXXX)}"
pgid=""
cleanup() {
  # The driver runs in its own process group: the cluster and Chromium die with it, even if
  # the driver itself was killed; then every pid it recorded, in case one left the group.
  if [ -n "$pgid" ]; then kill -KILL -- "-$pgid" 2>/dev/null || true; fi
  if [ -f "$work/pids" ]; then while read -r p; do kill -KILL "$p" 2>/dev/null || true; done < "$work/pids"; fi
  if [ "${KEEP_WORK:-0}" = 1 ]; then echo "check-dashboard: kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

echo "check-dashboard: chromium $("$CHROMIUM" --version 2>/dev/null | awk '{print $2}'), playwright-core $PLAYWRIGHT_VERSION, binaries from $BIN_DIR"
rc=0
KEEL_BIN_DIR="$BIN_DIR" KEEL_PLAYWRIGHT_DIR="$PW_DIR" KEEL_CHROMIUM="$CHROMIUM" \
  KEEL_CORPUS="$REPO/corpora/en-kjv/kjv.txt" KEEL_WORK="$work" KEEL_DASHBOARD_SHOTS="$shots" \
  setsid timeout 900 node "$REPO/scripts/check_dashboard.mjs" &
pid=$!
pgid="$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')" || pgid=""
[ "$pgid" = "$pid" ] || pgid=""   # only ever a group of our own
# The driver bounds every wait; `timeout` bounds the whole run (installations excluded).
wait "$pid" || rc=$?
if [ "$rc" != 0 ]; then
  KEEP_WORK=1
  echo "check-dashboard: FAILED (exit $rc); the cluster's logs are in $work/logs" >&2
  exit 1
fi
