#!/usr/bin/env bash
# Runs deploy/systemd/ for real: systemd as PID 1 in Docker containers, the units installed by
# the steps of deploy/README.md's systemd section as written, a job through them, a worker killed.
#
# The image: debian:bookworm-slim (scripts/container-base.sh) plus Debian 12's systemd 252,
# systemd-sysv and the runtime libraries of deploy/docker/Dockerfile's runtime stage
# (libopenblas0-pthread libgfortran5 libdnnl2 libgomp1 ca-certificates). No Keel binary in it:
# the install steps copy them in. Three containers ("machines") on a private network of their
# own, each booting /sbin/init: `coord` (keel-coordinator) and `w1` `w2` (keel-worker, 1 thread).
# What systemd as PID 1 needs from Docker here (20.10, cgroup v1, cgroupfs driver, no seccomp):
#   --cap-add SYS_ADMIN   the units' sandboxing (ProtectSystem=, PrivateTmp=, ...) is a mount
#                         namespace per service. WITHOUT it systemd 252 still starts the services
#                         but silently skips those namespaces (a service could write /usr): the
#                         test checks the namespaces are really there, not only the unit files.
#                         (--privileged does not start at all here: the engine's own bounding set
#                         lacks CAP_SYS_RESOURCE, "unable to apply caps: operation not permitted".)
#   -v /sys/fs/cgroup:/sys/fs/cgroup:ro   the host's cgroup v1 hierarchies (systemd makes its
#                         slices under /docker/ID in them); without it PID 1 exits at once
#                         ("Failed to allocate manager object").
#   --tmpfs /run --tmpfs /run/lock, container=docker, STOPSIGNAL SIGRTMIN+3.
#   --cap-add SYS_PTRACE  not for systemd: for this test's own look inside the services (root
#                         in the container needs it to nsenter a process of user keel, or read
#                         its /proc/PID/exe); the units drop every capability anyway.
# No drop-in and no change to the units: every option of both units is in force as shipped.
#
# On every machine, the code block of deploy/README.md's "## systemd" section, line by line, as
# written (run by bash in /keel, which holds target/release/{keel,keel-coordinator,keel-worker},
# deploy/systemd/ and a `token` file, all read-only mounts), with only:
#   - right after the line installing keel.env ("then edit it"): KEEL_COORDINATOR=coord:7070,
#     KEEL_ADVERTISE_ADDR=<machine>:7071, KEEL_THREADS=1 set in /etc/keel/keel.env;
#   - `systemctl enable --now keel-coordinator` run on coord only, `... keel-worker` on w1 and w2
#     only (as their comments say), and `journalctl -u keel-worker -f` not run (it never returns).
# Then, checked on every machine: the unit is active; its main process (systemctl show -p
# MainPID) runs as user keel (all four uids of /proc/PID/status), with no capabilities, no new
# privileges and a seccomp filter; inside its mount namespace (nsenter) /usr, /etc and
# /srv/keel/corpora are read-only even for root (ProtectSystem=strict), its state or cache
# folder is writable and /tmp is its own.
# From coord, as root with the documented variables: `keel submit` of a tiny-BERT job (60 steps,
# corpus in /srv/keel/corpora), `keel watch`, `keel pull`: model.safetensors is there. Then a
# 200-step job (2 workers required, checkpoint every 50, peer timeout 4 s), and at step ~60
# `systemctl kill -s KILL keel-worker` on w2: systemd restarts it (Restart=on-failure,
# RestartSec=5s), the job completes 200/200. Reported: the time from the kill until systemd had
# a new main process, until the job ran past the step it was at, and the steps lost (steps
# computed twice, from both workers' journals: rank 0 logs every step it computes). The
# restarted worker is sandboxed as the first was. Last, `systemctl stop` of each unit: the
# program ends on SIGTERM (no SIGKILL after TimeoutStopSec) and systemd records a success.
# Before the job: `keel-worker bf16-probe` under the installed unit's settings (a oneshot copy)
# must choose the bf16 route the probe chooses outside them (MemoryDenyWriteExecute=yes broke
# oneDNN's JIT kernels; on a CPU without AMX or AVX512_BF16 both say "emulated").
#
# Usage (as root): scripts/systemd-test.sh [BIN_DIR]
#   BIN_DIR  keel, keel-coordinator, keel-worker (default: $CARGO_TARGET_DIR/release, else
#            target/release); built on Debian 12 (the image's libraries)
# Environment: KEEL_SYSTEMD_TEST_KEEP=1 leaves the work folder (journals, outputs) in /tmp.
# Every container, network and image tag it makes is removed at the end, whatever the exit.
# Every wait is bounded. Debian's package mirror must be reachable from a container (the image).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/tiny-job.sh disable=SC1091 # checked on its own by validate-deploy.sh
. "$REPO/scripts/lib/tiny-job.sh"
cd "$REPO"
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
BIN_DIR="${1:-${CARGO_TARGET_DIR:-$REPO/target}/release}"
T_START=$SECONDS

log() { printf '[systemd-test %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[systemd-test] FAIL: %s\n' "$*" >&2; exit 1; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f s", b - a }'; }

[ "$(id -u)" = 0 ] || die "must run as root (docker)"
for b in keel keel-coordinator keel-worker; do
  [ -x "$BIN_DIR/$b" ] || die "no $BIN_DIR/$b (cargo build --release --bins)"
done
BIN_DIR="$(cd "$BIN_DIR" && pwd)"
command -v docker >/dev/null || die "'docker' not found: this test needs a Docker engine (Debian: docker.io)"
timeout 30 docker info >/dev/null 2>&1 || die "the Docker daemon does not answer (docker info)"
scripts/container-base.sh
[ -f corpora/en-kjv/kjv.txt ] || scripts/corpora.sh en-kjv >/dev/null

# The documented install steps: the first ```sh block after "## systemd".
STEPS="$(awk '/^## systemd/ { s = 1 } s && /^```sh$/ { b = 1; next } b && /^```$/ { exit } b { print }' deploy/README.md)"
[ -n "$STEPS" ] || die "deploy/README.md has no \`\`\`sh block in its '## systemd' section"
grep -q 'keel.env' <<<"$STEPS" || die "deploy/README.md's systemd steps install no keel.env"

ID="keelsd$$"
TAG="keel-systemd:$ID"
NET="$ID"
MACHINES=(coord w1 w2)
WORK="$(mktemp -d /tmp/keel-systemd-test.XXXXXX)"
mkdir -p "$WORK/image" "$WORK/in" "$WORK/logs"
CIDS=()

cleanup() {
  local rc=$? c left
  set +e
  trap - EXIT
  trap "" INT TERM
  if [ "$rc" != 0 ]; then
    for c in "${MACHINES[@]}"; do
      docker inspect "$ID-$c" >/dev/null 2>&1 || continue
      echo "----- $c: systemctl --failed; the keel units' last journal lines -----" >&2
      docker exec "$ID-$c" systemctl --failed --no-pager --no-legend 2>&1 | cut -c1-200 >&2
      docker exec "$ID-$c" journalctl --no-pager -n 25 -u keel-coordinator -u keel-worker 2>&1 | cut -c1-300 >&2
    done
  fi
  docker ps -aq --filter "label=keel-systemd-test=$ID" | xargs -r docker rm -f >/dev/null 2>&1
  docker network rm "$NET" >/dev/null 2>&1
  docker image inspect "$TAG" >/dev/null 2>&1 && docker rmi -f "$TAG" >/dev/null 2>&1
  # systemd made its slices inside the containers' cgroups (the host's hierarchy): gone with them?
  for c in "${CIDS[@]}"; do
    left="$(find /sys/fs/cgroup/ -maxdepth 3 -type d -name "$c" 2>/dev/null | head -n 3 | tr '\n' ' ')"
    [ -z "$left" ] || { echo "[systemd-test] cleanup left cgroups: $left" >&2; [ "$rc" != 0 ] || rc=1; }
  done
  left="$(docker ps -aq --filter "label=keel-systemd-test=$ID"; docker network ls -q --filter "name=^$NET\$"; docker images -q "$TAG")"
  [ -z "$left" ] || { echo "[systemd-test] cleanup left: $left" >&2; [ "$rc" != 0 ] || rc=1; }
  if [ "${KEEL_SYSTEMD_TEST_KEEP:-0}" = 1 ]; then log "kept $WORK"; else rm -rf "$WORK"; fi
  if [ "$rc" = 0 ]; then log "PASS in $((SECONDS - T_START)) s"; else echo "[systemd-test] exit $rc" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# The image: systemd and the runtime libraries; no Keel binary.
cat >"$WORK/image/Dockerfile" <<'EOF'
# Written by scripts/systemd-test.sh: Debian 12 booting systemd, with the libraries of
# deploy/docker/Dockerfile's runtime stage. The Keel binaries are installed by the test.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends systemd systemd-sysv \
    libopenblas0-pthread libgfortran5 libdnnl2 libgomp1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && systemctl mask getty.target console-getty.service systemd-logind.service
ENV container=docker
STOPSIGNAL SIGRTMIN+3
CMD ["/sbin/init"]
EOF
t0=$SECONDS
DOCKER_BUILDKIT=0 timeout 600 nice -n 10 docker build --force-rm -t "$TAG" "$WORK/image" >"$WORK/logs/build.log" 2>&1 \
  || { tail -n 20 "$WORK/logs/build.log" >&2; die "docker build of the systemd image failed"; }
log "built $TAG (debian:bookworm-slim + systemd systemd-sysv + the runtime libraries) in $((SECONDS - t0)) s: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{ printf "%.0f MB", $1 / 1e6 }')"

# ---------------------------------------------------------------------------------------------
# The machines: systemd as PID 1.
(umask 077 && head -c 32 /dev/urandom | base64 >"$WORK/token")   # as deploy/README.md makes it
cp corpora/en-kjv/kjv.txt "$WORK/in/kjv.txt"
docker network create --label "keel-systemd-test=$ID" "$NET" >/dev/null
t0=$SECONDS
for m in "${MACHINES[@]}"; do
  CIDS+=("$(docker run -d --name "$ID-$m" --hostname "$m" --network "$NET" --network-alias "$m" \
    --label "keel-systemd-test=$ID" \
    --cap-add SYS_ADMIN --cap-add SYS_PTRACE --tmpfs /run --tmpfs /run/lock -v /sys/fs/cgroup:/sys/fs/cgroup:ro \
    -v "$BIN_DIR/keel:/keel/target/release/keel:ro" \
    -v "$BIN_DIR/keel-coordinator:/keel/target/release/keel-coordinator:ro" \
    -v "$BIN_DIR/keel-worker:/keel/target/release/keel-worker:ro" \
    -v "$REPO/deploy/systemd:/keel/deploy/systemd:ro" -v "$WORK/token:/keel/token:ro" \
    -v "$WORK/in:/keel-test:ro" "$TAG")") || die "docker run of $m failed"
done
on() { local m="$1"; shift; docker exec "$ID-$m" "$@"; }
for m in "${MACHINES[@]}"; do
  deadline=$((SECONDS + 60))
  # Until PID 1 answers on its private socket (right after `docker run`: "Failed to connect to bus").
  until st="$(on "$m" timeout 60 systemctl is-system-running --wait 2>&1)"; [[ "$st" != *"Failed to connect"* ]]; do
    [ $SECONDS -lt $deadline ] || break
    sleep 0.2
  done
  [ "$(on "$m" cat /proc/1/comm 2>/dev/null)" = systemd ] || die "$m: PID 1 is not systemd: $(docker logs "$ID-$m" 2>&1 | tail -n 5)"
  [ "$st" = running ] || die "$m: systemd is '$st', not running: $(on "$m" systemctl --failed --no-pager --no-legend 2>&1 | tr '\n' ';')"
done
log "booted ${MACHINES[*]} in $((SECONDS - t0)) s (network $NET): PID 1 $(on coord systemctl --version | head -n 1 | cut -d' ' -f1-2), $(on coord systemd-detect-virt), 'systemctl is-system-running': running on all three"

# ---------------------------------------------------------------------------------------------
# deploy/README.md's steps, as written, line by line.
install_machine() { # install_machine MACHINE ROLE(coordinator|worker)
  local m="$1" role="$2" line out n=0
  while IFS= read -r line; do
    [ -n "${line// }" ] || continue
    case "$line" in
      *"journalctl"*"-f"*) continue ;;                                  # follows forever
      *"enable --now keel-coordinator"*) [ "$role" = coordinator ] || continue ;;
      *"enable --now keel-worker"*) [ "$role" = worker ] || continue ;;
    esac
    n=$((n + 1))
    printf '+ %s\n' "$line" >>"$WORK/logs/install-$m.log"
    out="$(on "$m" bash -c "cd /keel && $line" 2>&1)" \
      || die "$m: the documented step failed: \`$line\`: $(tr '\n' ' ' <<<"$out")"
    [ -z "$out" ] || printf '%s\n' "$out" >>"$WORK/logs/install-$m.log"
    if [[ "$line" == *"/etc/keel/keel.env"*"then edit it"* ]]; then
      on "$m" sed -i -e "s/^KEEL_COORDINATOR=.*/KEEL_COORDINATOR=coord:7070/" \
        -e "s/^KEEL_ADVERTISE_ADDR=.*/KEEL_ADVERTISE_ADDR=$m:7071/" \
        -e "s/^KEEL_THREADS=.*/KEEL_THREADS=1/" /etc/keel/keel.env
      printf '+ (edit) KEEL_COORDINATOR=coord:7070 KEEL_ADVERTISE_ADDR=%s:7071 KEEL_THREADS=1\n' "$m" >>"$WORK/logs/install-$m.log"
    fi
  done <<<"$STEPS"
  echo "$n"
}
t0=$SECONDS
n="$(install_machine coord coordinator)"
for m in w1 w2; do install_machine "$m" worker >/dev/null; done
log "deploy/README.md's systemd steps as written: $n commands on coord, the same with keel-worker on w1 w2, in $((SECONDS - t0)) s; sysusers: $(on coord getent passwd keel)"

unit_of() { case "$1" in coord) echo keel-coordinator ;; *) echo keel-worker ;; esac; }
for m in "${MACHINES[@]}"; do
  u="$(unit_of "$m")"
  deadline=$((SECONDS + 30))
  until [ "$(on "$m" systemctl is-active "$u" 2>/dev/null)" = active ]; do
    [ $SECONDS -lt $deadline ] || die "$m: $u is not active: $(on "$m" systemctl status --no-pager "$u" 2>&1 | tail -n 15)"
    sleep 0.5
  done
done

# The CLI on coord, as root, with the documented variables.
keel_c() { # keel_c SECONDS ARGS...
  local t="$1"; shift
  on coord env KEEL_COORDINATOR=coord:7070 KEEL_TOKEN_FILE=/etc/keel/token NO_COLOR=1 timeout "$t" keel "$@"
}
deadline=$((SECONDS + 60))
until keel_c 5 jobs >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || die "the coordinator does not answer on coord:7070 after 60 s: $(on coord journalctl --no-pager -n 10 -u keel-coordinator 2>&1)"
  sleep 0.5
done
log "keel-coordinator active on coord (answers 'keel jobs'), keel-worker active on w1 w2"

# ---------------------------------------------------------------------------------------------
# The sandbox is real: user, capabilities, seccomp, and the mount namespace of each service.
sandbox_check() { # sandbox_check MACHINE UNIT WRITABLE_DIR: prints one line
  local m="$1" u="$2" rw="$3" pid kuid st out
  pid="$(on "$m" systemctl show -p MainPID --value "$u")"
  { [ -n "$pid" ] && [ "$pid" != 0 ]; } || die "$m: $u has no main process"
  [ "$(on "$m" readlink "/proc/$pid/exe")" = "/usr/local/bin/$u" ] || die "$m: $u's MainPID $pid runs $(on "$m" readlink "/proc/$pid/exe")"
  kuid="$(on "$m" id -u keel)"
  st="$(on "$m" cat "/proc/$pid/status")"
  [ "$(awk '/^Uid:/ { print $2, $3, $4, $5 }' <<<"$st")" = "$kuid $kuid $kuid $kuid" ] || die "$m: $u (pid $pid) does not run as keel ($kuid): $(grep '^Uid:' <<<"$st")"
  [ "$(awk '/^CapEff:/ { print $2 }' <<<"$st")" = 0000000000000000 ] || die "$m: $u has capabilities: $(grep '^Cap' <<<"$st" | tr '\n' ' ')"
  [ "$(awk '/^CapBnd:/ { print $2 }' <<<"$st")" = 0000000000000000 ] || die "$m: $u's bounding set is not empty"
  [ "$(awk '/^NoNewPrivs:/ { print $2 }' <<<"$st")" = 1 ] || die "$m: $u has no NoNewPrivs"
  [ "$(awk '/^Seccomp:/ { print $2 }' <<<"$st")" = 2 ] || die "$m: $u has no seccomp filter"
  [ "$(on "$m" readlink "/proc/$pid/ns/mnt")" != "$(on "$m" readlink /proc/1/ns/mnt)" ] || die "$m: $u shares PID 1's mount namespace: no sandboxing at all"
  for d in /usr/local/bin /etc/keel /srv/keel/corpora; do
    out="$(on "$m" nsenter -t "$pid" -m touch "$d/.keel-probe" 2>&1)" && die "$m: root inside $u's mount namespace could write $d (ProtectSystem=strict not in force)"
    grep -q "Read-only file system" <<<"$out" || die "$m: writing $d in $u's namespace failed, but not as read-only: $out"
  done
  on "$m" nsenter -t "$pid" -m sh -c "touch $rw/.keel-probe && rm $rw/.keel-probe" || die "$m: $rw is not writable in $u's namespace"
  on "$m" touch /tmp/.keel-host-probe
  on "$m" nsenter -t "$pid" -m test ! -e /tmp/.keel-host-probe || die "$m: $u sees the machine's /tmp (PrivateTmp not in force)"
  on "$m" rm -f /tmp/.keel-host-probe
  echo "$m $u pid $pid uid keel ($kuid), CapEff 0, NoNewPrivs 1, Seccomp 2; in its mount namespace /usr/local/bin /etc/keel /srv/keel/corpora are read-only (root: \"Read-only file system\"), $rw writable, /tmp private"
}
line="$(sandbox_check coord keel-coordinator /var/lib/keel/coordinator)"; log "sandbox: $line"
for m in w1 w2; do line="$(sandbox_check "$m" keel-worker /var/cache/keel/worker)"; log "sandbox: $line"; done

# The bf16 route under the unit's sandbox is the route outside it: `keel-worker bf16-probe` run
# by a oneshot copy of the installed keel-worker.service (same user, same options, only
# ExecStart and Type changed) against the same probe run by root. oneDNN JIT-compiles its
# kernels: MemoryDenyWriteExecute=yes makes them fail and the probe fall back to emulated bf16
# (on a CPU without AMX or AVX512_BF16 both say "emulated" whatever the sandbox).
# shellcheck disable=SC2016 # expanded by the container's bash
on w1 bash -c 'sed -e "s|^ExecStart=.*|ExecStart=/usr/local/bin/keel-worker bf16-probe|" -e "s/^Type=.*/Type=oneshot/" \
  -e "/^Restart/d" -e "/^\[Install\]/,\$d" /etc/systemd/system/keel-worker.service >/run/systemd/system/keel-bf16-probe.service \
  && systemctl daemon-reload && timeout 120 systemctl start keel-bf16-probe' \
  || die "w1: keel-worker bf16-probe under keel-worker.service's settings failed: $(on w1 journalctl --no-pager -o cat -u keel-bf16-probe 2>&1 | tail -n 5)"
in_unit="$(on w1 journalctl --no-pager -o cat -u keel-bf16-probe | grep '^bf16 GEMMs' | tail -n 1)"
outside="$(on w1 timeout 120 keel-worker bf16-probe 2>/dev/null | grep '^bf16 GEMMs' | tail -n 1)"
on w1 bash -c 'rm /run/systemd/system/keel-bf16-probe.service && systemctl daemon-reload'
# With AVX512_BF16 and no AMX the line carries the race's GFLOP/s, which differ from run to run:
# the route, the oneDNN kernel and the verdict are compared, not the timings.
route_of() { sed -E 's/: [0-9]+ GFLOP\/s against [0-9]+ for OpenBLAS fp32( on [0-9]+ threads?)? \([^)]*\)//' <<<"$1"; }
{ [ -n "$in_unit" ] && [ "$(route_of "$in_unit")" = "$(route_of "$outside")" ]; } \
  || die "w1: keel-worker bf16-probe under the unit's settings says '$in_unit', outside them '$outside'"
log "bf16 route under keel-worker.service's settings = outside them: \"$in_unit\""

# ---------------------------------------------------------------------------------------------
# A job, from coord's shell.
write_job() { # write_job FILE STEPS CHECKPOINT_EVERY
  {
    echo "# Written by scripts/systemd-test.sh: tiny BERT on the King James Bible, the two workers."
    tiny_job_sections /srv/keel/corpora/kjv.txt "$2" "$3" 0
    cat <<EOF

[cluster]
min_workers = 2
max_workers = 2
peer_timeout_seconds = 4
replacement_timeout_seconds = 120
EOF
  } >"$1"
}
write_job "$WORK/in/job.toml" 60 20
write_job "$WORK/in/long.toml" 200 50
on coord install -m 0644 /keel-test/kjv.txt /srv/keel/corpora/kjv.txt

submit() { # submit FILE: prints the job id
  local out job
  out="$(keel_c 60 submit "$1" 2>&1)" || die "keel submit $1 failed: $out"
  job="$(awk 'NF { last = $NF } END { print last }' <<<"$out")"
  [ -n "$job" ] || die "keel submit printed no job id"
  echo "$job"
}
# status JOB: "STATE STEP WORKERS GENERATION RECOVERIES", or "down 0 0 0 0".
status() {
  keel_c 5 status "$1" 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["state"], d["step"], len(d.get("workers") or []), d["generation"], d["recoveries"])' 2>/dev/null || echo "down 0 0 0 0"
}

t0=$EPOCHREALTIME
JOB0="$(submit /keel-test/job.toml)"
keel_c 300 watch "$JOB0" >"$WORK/logs/watch-$JOB0.log" 2>&1 || die "keel watch $JOB0 failed: $(tail -n 3 "$WORK/logs/watch-$JOB0.log")"
t1=$EPOCHREALTIME
st="$(status "$JOB0")"
[ "$(cut -d' ' -f1-3 <<<"$st")" = "completed 60 2" ] || die "$JOB0 ended as '$st' (want completed 60 with 2 workers)"
keel_c 120 pull "$JOB0" --out "/root/out/$JOB0" >"$WORK/logs/pull-$JOB0.log" 2>&1 || die "keel pull $JOB0 failed: $(tail -n 3 "$WORK/logs/pull-$JOB0.log")"
on coord test -s "/root/out/$JOB0/model.safetensors" || die "keel pull $JOB0 brought no model.safetensors: $(on coord ls "/root/out/$JOB0" | tr '\n' ' ')"
size="$(on coord stat -c %s "/root/out/$JOB0/model.safetensors")"
RESULTS=("job $JOB0 (60 steps, 2 workers): submit to completed $(secs "$t0" "$t1"); keel pull: $(on coord ls "/root/out/$JOB0" | tr '\n' ' ')(model.safetensors $size bytes)")
log "RESULT ${RESULTS[-1]}"

# ---------------------------------------------------------------------------------------------
# systemctl kill -s KILL keel-worker on w2 mid-job: systemd restarts it, the job completes.
show() { on "$1" systemctl show -p "$3" --value "$2"; }
JOB="$(submit /keel-test/long.toml)"
deadline=$((SECONDS + 180))
while :; do
  read -r state at nw _ <<<"$(status "$JOB")"
  [ "$state" = running ] && [ "$nw" = 2 ] && [ "$at" -ge 60 ] && break
  [ "$state" = failed ] && die "$JOB failed before the fault: $(keel_c 5 status "$JOB")"
  [ $SECONDS -lt $deadline ] || die "$JOB not running at step 60 with 2 workers after 180 s: $state $at"
  sleep 0.2
done
pid0="$(show w2 keel-worker MainPID)"
nr0="$(show w2 keel-worker NRestarts)"
on w2 systemctl kill -s KILL keel-worker; tf=$EPOCHREALTIME
log "[kill] $JOB: systemctl kill -s KILL keel-worker on w2 (pid $pid0) at step $at"
deadline=$((SECONDS + 60))
while :; do
  pid1="$(show w2 keel-worker MainPID)"; nr1="$(show w2 keel-worker NRestarts)"
  [ "$nr1" -gt "$nr0" ] && [ "$pid1" != 0 ] && [ "$pid1" != "$pid0" ] && [ "$(show w2 keel-worker ActiveState)" = active ] && break
  [ $SECONDS -lt $deadline ] || die "[kill] systemd did not restart keel-worker on w2 in 60 s: $(on w2 systemctl status --no-pager keel-worker 2>&1 | tail -n 8)"
  sleep 0.1
done
tr_=$EPOCHREALTIME
how="$(on w2 journalctl --no-pager -o cat -u keel-worker | grep -E 'Main process exited|Scheduled restart job' | tail -n 2 | sed 's/^keel-worker.service: //' | tr '\n' ' ')"
log "[kill] systemd restarted keel-worker on w2 after $(secs "$tf" "$tr_") (pid $pid1, NRestarts $nr1): $how"
deadline=$((SECONDS + 180))
while :; do
  read -r state step nw _ <<<"$(status "$JOB")"
  [ "$state" = completed ] && break
  [ "$state" = running ] && [ "$nw" = 2 ] && [ "$step" -gt "$at" ] && break
  [ "$state" = failed ] && die "[kill] $JOB failed after the kill: $(keel_c 5 status "$JOB")"
  [ $SECONDS -lt $deadline ] || die "[kill] $JOB not back past step $at in 180 s: $state $step ($nw workers)"
  sleep 0.2
done
tb=$EPOCHREALTIME
keel_c 300 watch "$JOB" >"$WORK/logs/watch-$JOB.log" 2>&1 || die "[kill] $JOB did not complete: $(tail -n 2 "$WORK/logs/watch-$JOB.log")"
st="$(status "$JOB")"
[ "$(cut -d' ' -f1-3 <<<"$st")" = "completed 200 2" ] || die "[kill] $JOB ended as '$st' (want completed 200 with 2 workers)"
read -r _ _ _ fgen frec <<<"$st"
for m in w1 w2; do on "$m" journalctl --no-pager -o cat -u keel-worker >"$WORK/logs/journal-$m.log"; done
on coord journalctl --no-pager -o cat -u keel-coordinator >"$WORK/logs/journal-coord.log"
read -r lost starts <<<"$(python3 - "$JOB" "$WORK"/logs/journal-w1.log "$WORK"/logs/journal-w2.log <<'PY'
import re, sys
job = sys.argv[1]
ansi = re.compile(r"\x1b\[[0-9;]*m")
steps, starts = [], set()
for path in sys.argv[2:]:
    cur = None
    for line in open(path, errors="replace"):
        line = ansi.sub("", line)
        m = re.search(r"starting job job=(\S+) generation=(\d+) .*start_step=(\d+)", line)
        if m:
            cur = m.group(1)
            if cur == job:
                starts.add((int(m.group(2)), int(m.group(3))))
            continue
        m = re.search(r"trainer: step (\d+) \|", line)
        if m and cur == job:
            steps.append(int(m.group(1)))
print(len(steps) - len(set(steps)), "; ".join(f"generation {g} from step {s}" for g, s in sorted(starts)))
PY
)"
RESULTS+=("$(awk -v j="$JOB" -v s="$at" -v a="$tf" -v r="$tr_" -v b="$tb" -v l="$lost" -v g="$fgen" -v c="$frec" \
  'BEGIN { printf "systemctl kill -s KILL keel-worker (w2), %s at step %d: restarted by systemd after %.1f s; job back past step %d after %.1f s; steps lost %d; completed 200/200 (generation %d, %d recoveries)", j, s, r - a, s, b - a, l, g, c }') [$starts]")
log "RESULT ${RESULTS[-1]}"

# The restarted worker is sandboxed like the first.
line="$(sandbox_check w2 keel-worker /var/cache/keel/worker)"; log "sandbox after the restart: $line"

# `systemctl stop` ends each program on SIGTERM, well inside TimeoutStopSec (no SIGKILL needed),
# and systemd counts the stop a success.
stops=()
for m in "${MACHINES[@]}"; do
  u="$(unit_of "$m")"
  t0=$EPOCHREALTIME
  on "$m" timeout 60 systemctl stop "$u" || die "$m: systemctl stop $u failed"
  t1=$EPOCHREALTIME
  res="$(show "$m" "$u" ActiveState) $(show "$m" "$u" Result)"
  [ "$res" = "inactive success" ] || die "$m: after systemctl stop, $u is '$res' (want inactive success): $(on "$m" journalctl --no-pager -o cat -n 5 -u "$u" | tr '\n' ' ')"
  ! on "$m" journalctl --no-pager -o cat -u "$u" | grep -q "stop-sigterm.*timed out" || die "$m: $u did not end on SIGTERM (systemd sent SIGKILL)"
  stops+=("$m $(secs "$t0" "$t1")")
done
stops_line="$(printf '%s, ' "${stops[@]}")"
RESULTS+=("systemctl stop: ${stops_line%, } (each inactive, Result=success, no SIGKILL)")
log "RESULT ${RESULTS[-1]}"

# ---------------------------------------------------------------------------------------------
for r in "${RESULTS[@]}"; do log "RESULT $r"; done
log "RESULT whole test $((SECONDS - T_START)) s (no drop-in: both units ran with every option as shipped)"
