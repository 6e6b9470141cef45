#!/usr/bin/env bash
# A real Slurm cluster in containers, running deploy/slurm/keel.sbatch as shipped.
#
# The image: Keel's image (scripts/container-image.sh: the Dockerfile's runtime stage around the
# host's binaries, on the debootstrap base of scripts/container-base.sh) plus Debian 12's
# slurmctld, slurmd, slurm-client and munge (Slurm 22.05). Four containers on a private network
# of their own: `ctl` (munged, slurmctld) and `n1` `n2` `n3` (munged, slurmd), one munge key,
# one slurm.conf (proctrack/linuxproc, task/none: no cgroups needed), and a folder shared by all
# of them at /shared (the submit directory: keel.sbatch writes its token and its output there).
#
# From `ctl`: `sbatch --nodes=3 deploy/slurm/keel.sbatch job.toml OUT` (the file as shipped,
# mounted read-only) with a 60-step tiny-BERT job; the script runs the coordinator on n1 and a
# worker on each node with srun, submits, watches, pulls. Checks: the Slurm job leaves the queue,
# its output ends with "done (exit 0)", the checkpoint is in OUT (config.json,
# model.safetensors, vocab.txt), the token it made is removed, and every node's scratch is empty.
# Then two faults, each in an allocation of its own:
#   kill     the worker on n3 is killed (kill -9) at step ~60 of a 300-step job with
#            min_workers = 2: the job shrinks to two workers and completes 300/300, and
#            keel.sbatch ends with exit 0;
#   scancel  the whole allocation is cancelled at step ~160 of a 1000-step job run with
#            KEEL_SLURM_DATA_DIR on the shared folder: every checkpoint the coordinator finished
#            (step-50, -100, -150) is still there, each file matching its manifest (size, sha256).
#
# Usage (as root): scripts/slurm-test.sh [BIN_DIR]
#   BIN_DIR  keel, keel-coordinator, keel-worker (default: $CARGO_TARGET_DIR/release, else
#            target/release)
# Environment: KEEL_SLURM_TEST_KEEP=1 leaves the work folder (outputs, logs) in /tmp.
# Every container, network and image tag it makes is removed at the end, whatever the exit.
# Every wait is bounded.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/tiny-job.sh disable=SC1091 # checked on its own by validate-deploy.sh
. "$REPO/scripts/lib/tiny-job.sh"
cd "$REPO"
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
BIN_DIR="${1:-${CARGO_TARGET_DIR:-$REPO/target}/release}"
T_START=$SECONDS

log() { printf '[slurm-test %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[slurm-test] FAIL: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (docker)"
for b in keel keel-coordinator keel-worker; do
  [ -x "$BIN_DIR/$b" ] || die "no $BIN_DIR/$b (cargo build --release --bins)"
done
BIN_DIR="$(cd "$BIN_DIR" && pwd)"
command -v docker >/dev/null || die "'docker' not found: this test needs a Docker engine (Debian: docker.io)"
timeout 30 docker info >/dev/null 2>&1 || die "the Docker daemon does not answer (docker info)"
scripts/container-base.sh
[ -f corpora/en-kjv/kjv.txt ] || scripts/corpora.sh en-kjv >/dev/null

ID="keelslurm$$"
TAG="keel:$ID"
STAG="keel-slurm:$ID"
NET="$ID"
NODES=(n1 n2 n3)
WORK="$(mktemp -d /tmp/keel-slurm-test.XXXXXX)"
mkdir -p "$WORK/shared/submit" "$WORK/etc" "$WORK/image" "$WORK/logs"

cleanup() {
  local rc=$? c
  set +e
  trap - EXIT
  trap "" INT TERM
  if [ "$rc" != 0 ]; then
    for c in ctl "${NODES[@]}"; do
      docker inspect "$ID-$c" >/dev/null 2>&1 || continue
      echo "----- $c: last lines of its log -----" >&2
      docker exec "$ID-$c" bash -c 'tail -n 15 /var/log/slurm/*.log' 2>&1 | cut -c1-300 >&2
    done
    for c in "$WORK"/shared/submit/keel-*.out; do
      [ -f "$c" ] && { echo "----- $(basename "$c") -----" >&2; tail -n 30 "$c" >&2; }
    done
  fi
  docker ps -aq --filter "label=keel-slurm-test=$ID" | xargs -r docker rm -f >/dev/null 2>&1
  docker network rm "$NET" >/dev/null 2>&1
  for t in "$STAG" "$TAG" "$TAG-bin"; do
    docker image inspect "$t" >/dev/null 2>&1 && docker rmi -f "$t" >/dev/null 2>&1
  done
  if [ "${KEEL_SLURM_TEST_KEEP:-0}" = 1 ]; then log "kept $WORK"; else rm -rf "$WORK"; fi
  if [ "$rc" = 0 ]; then log "PASS in $((SECONDS - T_START)) s"; else echo "[slurm-test] exit $rc" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# The image: Keel's, plus Slurm and munge from Debian.
scripts/container-image.sh "$BIN_DIR" "$TAG"
cat >"$WORK/image/Dockerfile" <<EOF
# Written by scripts/slurm-test.sh: Keel's image plus Debian 12's Slurm 22.05 and munge.
FROM $TAG
USER root
RUN apt-get update \\
 && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge iproute2 \\
 && rm -rf /var/lib/apt/lists/* \\
 && mkdir -p /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm /run/munge
EOF
t0=$SECONDS
DOCKER_BUILDKIT=0 timeout 600 docker build --force-rm -t "$STAG" "$WORK/image" >"$WORK/logs/build.log" 2>&1 \
  || { tail -n 20 "$WORK/logs/build.log" >&2; die "docker build of the Slurm image failed"; }
log "built $STAG (Keel's image + slurmctld slurmd slurm-client munge) in $((SECONDS - t0)) s: $(docker image inspect -f '{{.Size}}' "$STAG" | awk '{ printf "%.0f MB", $1 / 1e6 }')"

# ---------------------------------------------------------------------------------------------
# The cluster: one munge key, one slurm.conf, four containers on a network of their own.
head -c 1024 /dev/urandom >"$WORK/etc/munge.key"
chmod 0400 "$WORK/etc/munge.key"
cat >"$WORK/etc/slurm.conf" <<EOF
# Written by scripts/slurm-test.sh: a private Slurm cluster in containers.
ClusterName=keeltest
SlurmctldHost=ctl
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=n[1-3] CPUs=$(nproc) State=UNKNOWN
PartitionName=main Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP
EOF
cat >"$WORK/etc/start.sh" <<'EOF'
#!/bin/bash
# munged (as root: --force), then the Slurm daemon in the foreground.
set -e
install -m 0400 /keel-etc/munge.key /etc/munge/munge.key
munged --force
if [ "$(hostname)" = ctl ]; then exec slurmctld -D; else exec slurmd -D -N "$(hostname)"; fi
EOF
chmod 0755 "$WORK/etc/start.sh"

docker network create --label "keel-slurm-test=$ID" "$NET" >/dev/null
for c in ctl "${NODES[@]}"; do
  docker run -d --name "$ID-$c" --hostname "$c" --network "$NET" --network-alias "$c" \
    --label "keel-slurm-test=$ID" --user root \
    -v "$WORK/etc:/keel-etc:ro" -v "$WORK/etc/slurm.conf:/etc/slurm/slurm.conf:ro" \
    -v "$WORK/shared:/shared" -v "$REPO/deploy/slurm:/keel/deploy/slurm:ro" \
    "$STAG" /keel-etc/start.sh >/dev/null
done
on() { local c="$1"; shift; docker exec "$ID-$c" "$@"; }
deadline=$((SECONDS + 90))
until [ "$(on ctl sinfo -h -N -o %T 2>/dev/null | grep -c '^idle')" = 3 ]; do
  [ $SECONDS -lt $deadline ] || die "Slurm nodes not idle after 90 s: $(on ctl sinfo -h -N 2>&1 | tr '\n' ' ')"
  sleep 1
done
log "Slurm $(on ctl sinfo --version | awk '{ print $2 }'): slurmctld on ctl, slurmd on ${NODES[*]} (network $NET); sinfo: $(on ctl sinfo -h -N -o '%N=%T' | tr '\n' ' ')"

# ---------------------------------------------------------------------------------------------
# The job, through sbatch.
cp corpora/en-kjv/kjv.txt "$WORK/shared/submit/kjv.txt"
write_job() { # write_job FILE STEPS CHECKPOINT_EVERY MIN_WORKERS
  {
    echo "# Written by scripts/slurm-test.sh: tiny BERT on the King James Bible, one worker per node."
    tiny_job_sections /shared/submit/kjv.txt "$2" "$3" 0
    cat <<EOF

[cluster]
min_workers = $4
max_workers = 3
peer_timeout_seconds = 4
EOF
  } >"$1"
}
write_job "$WORK/shared/submit/job.toml" 60 20 3
t0=$EPOCHREALTIME
sid="$(docker exec -w /shared/submit "$ID-ctl" env KEEL_SLURM_TIMEOUT=300 NO_COLOR=1 \
  sbatch --parsable --nodes=3 --cpus-per-task="$(nproc)" --time=10 /keel/deploy/slurm/keel.sbatch job.toml /shared/out)" \
  || die "sbatch refused deploy/slurm/keel.sbatch"
log "sbatch --nodes=3 deploy/slurm/keel.sbatch job.toml /shared/out: Slurm job $sid"
deadline=$((SECONDS + 420))
while state="$(on ctl squeue -h -j "$sid" -o %T 2>/dev/null)" && [ -n "$state" ]; do
  [ $SECONDS -lt $deadline ] || die "Slurm job $sid still $state after 420 s"
  sleep 2
done
t1=$EPOCHREALTIME
out="$WORK/shared/submit/keel-$sid.out"
[ -f "$out" ] || die "Slurm job $sid left no keel-$sid.out"
cp "$out" "$WORK/logs/"
grep '^\[keel.sbatch' "$out" | sed 's/^/    /'
grep -q '^\[keel.sbatch [0-9:]*\] done (exit 0)$' "$out" || die "keel.sbatch (Slurm job $sid) did not end with exit 0"
grep -q '"state": "completed"' "$out" || die "the Keel job did not complete (keel status in keel-$sid.out)"
for f in config.json model.safetensors vocab.txt; do
  [ -s "$WORK/shared/out/$f" ] || die "the checkpoint in /shared/out has no $f: $(find "$WORK/shared/out" -maxdepth 1 -printf '%f ' 2>&1)"
done
! compgen -G "$WORK/shared/submit/.keel-*.token" >/dev/null || die "the token keel.sbatch made was not removed"
for c in "${NODES[@]}"; do
  left="$(on "$c" bash -c 'ls -A /tmp | grep "^keel-" || true')"
  [ -z "$left" ] || die "$c: node scratch left in /tmp: $left"
done
nodes_used="$(grep -o 'workers starting on .*' "$out" | head -n 1)"
RESULT="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f s", b - a }') from sbatch to the job leaving the queue; $nodes_used; checkpoint pulled into /shared/out; token and node scratch removed"
log "RESULT Slurm job $sid: $RESULT"
RESULTS=("sbatch as shipped: $RESULT")

# ---------------------------------------------------------------------------------------------
# Faults. sbatch_job NAME JOB_FILE OUT [VAR=VALUE...]: submits keel.sbatch, prints the Slurm job id.
sbatch_job() {
  local name="$1" job="$2" outdir="$3"; shift 3
  docker exec -w /shared/submit "$ID-ctl" env KEEL_SLURM_TIMEOUT=300 NO_COLOR=1 "$@" \
    sbatch --parsable --nodes=3 --cpus-per-task="$(nproc)" --time=10 --job-name="keel-$name" \
    /keel/deploy/slurm/keel.sbatch "$job" "$outdir" || die "[$name] sbatch refused keel.sbatch"
}
# keel_status SID: the Keel job's status JSON, asked from ctl with the token keel.sbatch made.
keel_status() {
  on ctl env KEEL_COORDINATOR=n1:7070 KEEL_TOKEN_FILE="/shared/submit/.keel-$1.token" timeout 5 keel status job-1 2>/dev/null
}
# wait_keel_step SID N: until the Keel job runs with 3 workers at step >= N; prints the step.
wait_keel_step() {
  local sid="$1" n="$2" deadline=$((SECONDS + 180)) st state step nw
  while :; do
    st="$(keel_status "$sid" | python3 -c 'import json, sys
d = json.load(sys.stdin); print(d["state"], d["step"], len(d.get("workers") or []))' 2>/dev/null || echo "none 0 0")"
    read -r state step nw <<<"$st"
    [ "$state" = running ] && [ "$nw" = 3 ] && [ "$step" -ge "$n" ] && { echo "$step"; return 0; }
    [ $SECONDS -lt $deadline ] || die "Slurm job $sid: Keel job not running at step $n with 3 workers after 180 s ($st)"
    sleep 0.5
  done
}
wait_gone() { # wait_gone SID SECONDS: until the Slurm job has left the queue
  local deadline=$((SECONDS + $2)) state
  while state="$(on ctl squeue -h -j "$1" -o %T 2>/dev/null)" && [ -n "$state" ]; do
    [ $SECONDS -lt $deadline ] || die "Slurm job $1 still $state after $2 s"
    sleep 1
  done
}

# kill: the worker on n3 is killed (kill -9) mid-job; min_workers = 2, so the job goes on with
# the two others and completes.
write_job "$WORK/shared/submit/job-kill.toml" 300 50 2
sid="$(sbatch_job kill job-kill.toml /shared/out-kill)"
at="$(wait_keel_step "$sid" 60)"
# (No procps in the image: the worker's pid from /proc.)
# shellcheck disable=SC2016 # expanded by the container's bash
wpid="$(on n3 bash -c 'for p in /proc/[0-9]*; do [ "$(cat "$p/comm" 2>/dev/null)" = keel-worker ] && echo "${p#/proc/}"; done; true' | head -n 1)"
[ -n "$wpid" ] || die "[kill] no keel-worker process on n3"
on n3 bash -c "kill -KILL $wpid"
log "[kill] Slurm job $sid: killed keel-worker (pid $wpid) on n3 at step $at"
wait_gone "$sid" 300
out="$WORK/shared/submit/keel-$sid.out"
cp "$out" "$WORK/logs/" 2>/dev/null || die "[kill] Slurm job $sid left no output"
grep '^\[keel.sbatch' "$out" | sed 's/^/    /'
grep -q '^\[keel.sbatch [0-9:]*\] done (exit 0)$' "$out" || die "[kill] keel.sbatch (Slurm job $sid) did not end with exit 0 after a worker was killed"
final="$(python3 - "$out" <<'PY'
import json, re, sys
text = open(sys.argv[1], errors="replace").read()
# The last `keel status` JSON object the script printed.
objs = list(re.finditer(r"^\{$.*?^\}$", text, re.S | re.M))
d = json.loads(objs[-1].group(0))
print(d["state"], d["step"], d["max_steps"], len(d["workers"]), d["recoveries"])
PY
)" || die "[kill] no final keel status in keel-$sid.out"
read -r fstate fstep fmax fnw frec <<<"$final"
{ [ "$fstate $fstep" = "completed $fmax" ] && [ "$fnw" = 2 ]; } || die "[kill] the Keel job ended as '$final' (want completed $fmax/$fmax with 2 workers)"
[ -s "$WORK/shared/out-kill/model.safetensors" ] || die "[kill] no checkpoint pulled"
RESULTS+=("$(awk -v s="$at" -v n="$fstep" -v r="$frec" 'BEGIN { printf "kill -9 of the worker on n3 at step %d: the job shrank to 2 workers and completed %d/%d (%d recoveries); keel.sbatch done (exit 0)", s, n, n, r }')")
log "RESULT ${RESULTS[-1]}"

# scancel: the whole allocation is cancelled mid-job; the coordinator's data folder (on the
# shared disk: KEEL_SLURM_DATA_DIR) keeps every finished checkpoint intact.
write_job "$WORK/shared/submit/job-cancel.toml" 1000 50 3
sid="$(sbatch_job cancel job-cancel.toml /shared/out-cancel KEEL_SLURM_DATA_DIR=/shared/coord-data)"
at="$(wait_keel_step "$sid" 160)"
on ctl scancel "$sid"; tf=$EPOCHREALTIME
log "[scancel] Slurm job $sid: scancel at step $at"
wait_gone "$sid" 120
log "[scancel] Slurm job $sid left the queue $(awk -v a="$tf" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f s", b - a }') after scancel"
cp "$WORK/shared/submit/keel-$sid.out" "$WORK/logs/" 2>/dev/null || true
python3 - "$WORK/shared/coord-data" >"$WORK/logs/cancel-checkpoints.txt" <<'PY' || { cat "$WORK/logs/cancel-checkpoints.txt" >&2; die "[scancel] checkpoints in the coordinator's data folder are not intact"; }
import glob, hashlib, json, os, sys
root = sys.argv[1]
dirs = sorted(glob.glob(os.path.join(root, "jobs", "job-1", "checkpoints", "step-*")), key=lambda d: int(d.rsplit("-", 1)[1]))
bad = 0
for d in dirs:
    try:
        m = json.load(open(os.path.join(d, "manifest.json")))
    except (OSError, ValueError) as e:
        print(f"{d}: no readable manifest.json ({e})"); bad += 1; continue
    for name, digest in m["files"].items():
        p = os.path.join(d, name)
        ok = os.path.isfile(p) and os.path.getsize(p) == m["sizes"][name] and hashlib.sha256(open(p, "rb").read()).hexdigest() == digest
        if not ok:
            print(f"{p}: missing, or size/sha256 differ from the manifest"); bad += 1
print(" ".join(os.path.basename(d) for d in dirs))
sys.exit(1 if bad or len(dirs) < 3 else 0)
PY
kept="$(tail -n 1 "$WORK/logs/cancel-checkpoints.txt")"
RESULTS+=("scancel at step $at: the allocation ended; the coordinator's data folder kept checkpoints $kept, every file matching its manifest (size and sha256)")
log "RESULT ${RESULTS[-1]}"
for r in "${RESULTS[@]}"; do log "RESULT $r"; done
