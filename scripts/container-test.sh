#!/usr/bin/env bash
# Runs Keel the way a Docker user does: the image of deploy/docker/Dockerfile, the cluster of
# deploy/docker/compose.yaml (a coordinator and three workers on the project's private network),
# and the `keel` CLI on the host talking to the published port.
#
#   1. The image (scripts/container-image.sh): the Dockerfile's runtime stage, unchanged (copied
#      out of the file), built around the binaries in BIN_DIR. Its builder stage starts from
#      rust:1-bookworm, which a machine without a registry cannot pull: a `FROM scratch AS
#      builder` stage holding the host's binaries stands in for it. The runtime stage's base,
#      debian:bookworm-slim, comes from scripts/container-base.sh (debootstrap + docker import;
#      made once per machine). Prints the image's size; checks every process of the containers
#      runs as uid 10001, /corpus is read-only and /var/lib/keel writable.
#   2. `compose up` of compose.yaml as shipped, plus a test-only override file that changes only
#      the image tag (keel:keelctPID, so a user's keel:latest is never touched) and the cluster
#      token's file (a temporary one, not deploy/docker/token). The ports and the corpus folder
#      are set through the variables compose.yaml reads: KEEL_COORDINATOR_PUBLISH and
#      KEEL_METRICS_PUBLISH on free ports of 127.0.0.1, KEEL_CORPUS_DIR = corpora/en-kjv.
#   3. From the host: `keel submit` a short job (tiny BERT, 60 steps), `keel watch`, `keel pull`,
#      and Hugging Face `transformers` loads the checkpoint (BertForMaskedLM, no missing or
#      unexpected keys) and fills a mask with it. The coordinator's /metrics answers on its
#      published port and each worker's on worker-N:9471 inside the network (where
#      deploy/prometheus/prometheus.yml's static jobs would scrape them), and a real Prometheus
#      (Debian's binary, in a container on the network) scraping with those jobs finds all four
#      targets up. The compose file's CLI service (`compose run --rm keel jobs`, `pull`) works.
#   4. Faults, each in the middle of a job of its own (200 steps, a checkpoint every 50, peer
#      timeout 4 s, 3 workers required), each ending with the job completed at 200/200:
#        kill     `docker kill` of worker-2, then `compose up` starts it again
#        netcut   worker-2 cut off its network with `docker network disconnect` for 10 s
#                 (longer than the 4 s peer timeout), then reconnected under its name
#        restart  `docker restart` of the coordinator: the job resumes
#        downup   `compose down` (volumes kept), then `compose up`: the job resumes, and the jobs
#                 finished before are still listed and pull the same bytes
#      For each: the time from the fault until the job is past the step `keel status` showed at
#      the fault, and the steps lost: steps computed twice, from the workers' logs (rank 0 logs
#      every step it computes), those of containers `compose down` removed included.
#
# Usage (as root): scripts/container-test.sh [BIN_DIR]
#   BIN_DIR  keel, keel-coordinator, keel-worker (default: $CARGO_TARGET_DIR/release, else
#            target/release)
# Environment: KEEL_CT_KEEP=1 leaves the work folder (logs, pulled checkpoints) in /tmp.
#
# Installs what is missing: docker-compose (Debian) when neither `docker compose` nor
# `docker-compose` works, debootstrap (through container-base.sh), python3-torch and python3-venv
# (Debian) and transformers (PyPI, pinned, in a venv under /var/cache/keel-validate), the
# prometheus binary (unpacked from Debian's package into /var/cache/keel-validate). The Docker
# engine itself must be there and running. Every container, network, volume and image tag it
# makes is removed at the end, whatever the exit. Every wait is bounded.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/tiny-job.sh disable=SC1091 # checked on its own by validate-deploy.sh
. "$REPO/scripts/lib/tiny-job.sh"
cd "$REPO"
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
BIN_DIR="${1:-${CARGO_TARGET_DIR:-$REPO/target}/release}"
T_START=$SECONDS

log() { printf '[container-test %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[container-test] FAIL: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# Preflight and installs.
[ "$(id -u)" = 0 ] || die "must run as root (docker, apt-get)"
for b in keel keel-coordinator keel-worker; do
  [ -x "$BIN_DIR/$b" ] || die "no $BIN_DIR/$b (cargo build --release --bins)"
done
BIN_DIR="$(cd "$BIN_DIR" && pwd)"
command -v docker >/dev/null || die "'docker' not found: this test needs a Docker engine (Debian: docker.io)"
timeout 30 docker info >/dev/null 2>&1 || die "the Docker daemon does not answer (docker info)"

apt_install() { # apt_install PKG...: the Debian packages not yet installed
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  log "installing Debian packages: ${missing[*]}"
  timeout 300 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

if docker compose version >/dev/null 2>&1; then
  COMPOSE_TOOL=(docker compose)
else
  command -v docker-compose >/dev/null || apt_install docker-compose
  COMPOSE_TOOL=(docker-compose)
fi

command -v curl >/dev/null || apt_install curl
TRANSFORMERS_VERSION=4.40.2
VENV=/var/cache/keel-validate/venv-transformers$TRANSFORMERS_VERSION
HF_PY=""
if ! "$VENV/bin/python" -c 'import torch, transformers' 2>/dev/null; then
  log "installing torch (Debian) and transformers==$TRANSFORMERS_VERSION (PyPI) into $VENV"
  # torch from Debian (1.13, CPU only: PyPI's wheel brings gigabytes of CUDA libraries);
  # transformers from PyPI, the last minor release that supports torch 1.13's API.
  apt_install python3-torch python3-venv
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  if /usr/bin/python3 -m venv --system-site-packages "$VENV" \
    && timeout 300 "$VENV/bin/pip" install -q --disable-pip-version-check "transformers==$TRANSFORMERS_VERSION" >/dev/null 2>&1; then
    :
  else
    rm -rf "$VENV"
    log "transformers could not be installed (PyPI unreachable?): the transformers load check will be SKIPPED"
  fi
fi
"$VENV/bin/python" -c 'import torch, transformers' 2>/dev/null && HF_PY="$VENV/bin/python"

# Prometheus: only the server binary, unpacked from Debian's package (installing the package
# would add a service user and start a server through its init script).
PROM_DIR=/var/cache/keel-validate/prometheus-debian
PROM_BIN=""
if [ ! -x "$PROM_DIR/usr/bin/prometheus" ]; then
  log "unpacking prometheus from Debian's package into $PROM_DIR"
  dl="$(mktemp -d)"
  if ( cd "$dl" && { timeout 300 apt-get download prometheus >/dev/null 2>&1 \
         || { timeout 300 apt-get update -qq && timeout 300 apt-get download prometheus >/dev/null 2>&1; }; } ) \
    && mkdir -p "$PROM_DIR" && dpkg-deb --fsys-tarfile "$dl"/prometheus_*.deb | tar -x -C "$PROM_DIR" ./usr/bin/prometheus; then
    :
  else
    rm -rf "$PROM_DIR"
  fi
  rm -rf "$dl"
fi
[ -x "$PROM_DIR/usr/bin/prometheus" ] && PROM_BIN="$PROM_DIR/usr/bin/prometheus"

scripts/container-base.sh
[ -f corpora/en-kjv/kjv.txt ] || scripts/corpora.sh en-kjv >/dev/null

# ---------------------------------------------------------------------------------------------
# What cleanup removes. Names carry our PID so parallel runs never collide.
ID="keelct$$"
TAG="keel:$ID"
WORK="$(mktemp -d /tmp/keel-container-test.XXXXXX)"
mkdir -p "$WORK/logs"
STARTED=0

compose() { timeout 300 "${COMPOSE_TOOL[@]}" -p "$ID" -f deploy/docker/compose.yaml -f "$WORK/override.yaml" "$@"; }

cleanup() {
  local rc=$? c
  set +e
  trap - EXIT
  trap "" INT TERM
  if [ "$rc" != 0 ] && [ "$STARTED" = 1 ]; then
    for c in $(docker ps -aq --filter "label=com.docker.compose.project=$ID"); do
      echo "----- last lines of $(docker inspect -f '{{.Name}}' "$c") -----" >&2
      docker logs --tail 20 "$c" 2>&1 | cut -c1-300 >&2
    done
  fi
  [ "$STARTED" = 1 ] && compose down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1
  # Whatever compose did not remove (a failed `up`, a container made outside it).
  docker ps -aq --filter "label=com.docker.compose.project=$ID" | xargs -r docker rm -f >/dev/null 2>&1
  docker network ls -q --filter "label=com.docker.compose.project=$ID" | xargs -r docker network rm >/dev/null 2>&1
  docker volume ls -q --filter "label=com.docker.compose.project=$ID" | xargs -r docker volume rm -f >/dev/null 2>&1
  for t in "$TAG" "$TAG-bin"; do  # TAG-bin: container-image.sh's, if it was killed
    docker image inspect "$t" >/dev/null 2>&1 && docker rmi -f "$t" >/dev/null 2>&1
  done
  if [ "${KEEL_CT_KEEP:-0}" = 1 ]; then log "kept $WORK"; else rm -rf "$WORK"; fi
  left="$(docker ps -aq --filter "label=com.docker.compose.project=$ID"; docker volume ls -q --filter "label=com.docker.compose.project=$ID")"
  [ -z "$left" ] || { echo "[container-test] cleanup left: $left" >&2; [ "$rc" != 0 ] || rc=1; }
  if [ "$rc" = 0 ]; then log "PASS in $((SECONDS - T_START)) s"; else echo "[container-test] exit $rc" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# 1. The image: the shipped runtime stage around the host's binaries (scripts/container-image.sh).
out="$(scripts/container-image.sh "$BIN_DIR" "$TAG")" || die "scripts/container-image.sh failed"
echo "$out"
IMAGE_RESULT="$(sed -n 's/.*: \(image [0-9]* MB.*\)$/\1/p' <<<"$out")"

# ---------------------------------------------------------------------------------------------
# 2. The cluster.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT="$(free_port)"
MPORT="$(free_port)"
export KEEL_COORDINATOR_PUBLISH="127.0.0.1:$PORT" KEEL_METRICS_PUBLISH="127.0.0.1:$MPORT"
export KEEL_CORPUS_DIR="$REPO/corpora/en-kjv"
export KEEL_JOBS_DIR="$WORK/jobs" KEEL_OUT_DIR="$WORK/out"
mkdir -p "$WORK/jobs"
install -d -o 10001 -g 10001 "$WORK/out"   # as deploy/README.md makes out/: the CLI service writes as uid 10001
# The token must be readable by the programs' uid (10001) and by nobody else.
(umask 077 && head -c 32 /dev/urandom | base64 >"$WORK/token")
chown 10001:10001 "$WORK/token"
cat >"$WORK/override.yaml" <<EOF
# Test-only: the image tag and the token file; nothing else.
services:
  coordinator: {image: "$TAG"}
  worker-1: {image: "$TAG"}
  worker-2: {image: "$TAG"}
  worker-3: {image: "$TAG"}
  keel: {image: "$TAG"}
secrets:
  keel-token:
    file: $WORK/token
EOF

STARTED=1
t0=$SECONDS
compose up -d --no-build >"$WORK/logs/up.log" 2>&1 || { cat "$WORK/logs/up.log" >&2; die "compose up failed"; }
log "compose up (${COMPOSE_TOOL[*]}): $(docker ps --filter "label=com.docker.compose.project=$ID" --format '{{.Names}}' | sort | tr '\n' ' ')in $((SECONDS - t0)) s; coordinator on 127.0.0.1:$PORT"

cid() { compose ps -q "$1"; }
keel_host() { # keel_host SECONDS ARGS...: the host's keel CLI against the published port
  local t="$1"; shift
  KEEL_COORDINATOR="127.0.0.1:$PORT" KEEL_TOKEN_FILE="$WORK/token" NO_COLOR=1 timeout "$t" "$BIN_DIR/keel" "$@"
}

# Waits (bounded) until the coordinator answers and N workers are registered (every job wants 3).
wait_cluster() {
  local deadline=$((SECONDS + 90))
  until keel_host 5 jobs >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "the coordinator did not answer on 127.0.0.1:$PORT in 90 s"
    sleep 0.5
  done
}
wait_cluster

# The programs run as uid 10001; the corpus is mounted read-only.
for svc in coordinator worker-1 worker-2 worker-3; do
  c="$(cid "$svc")"
  [ -n "$c" ] || die "no container for $svc"
  procs="$(docker top "$c" -eo pid,uid,comm)" || die "docker top $svc failed"
  uids="$(awk 'NR > 1 { print $2 }' <<<"$procs" | sort -u | tr '\n' ' ')"
  [ "$uids" = "10001 " ] || die "$svc: processes run as uid(s) $uids, not 10001: $(tr '\n' ';' <<<"$procs")"
  [ "$(docker exec "$c" id -u)" = 10001 ] || die "$svc: docker exec runs as $(docker exec "$c" id -u), not 10001"
done
coord="$(cid coordinator)"
[ "$(docker inspect -f '{{range .Mounts}}{{if eq .Destination "/corpus"}}{{.RW}}{{end}}{{end}}' "$coord")" = false ] \
  || die "/corpus is not a read-only mount of the coordinator"
if out="$(docker exec "$coord" bash -c 'echo x > /corpus/written-by-test' 2>&1)"; then
  die "the coordinator could write into /corpus"
fi
grep -q "Read-only file system" <<<"$out" || die "writing /corpus failed, but not as read-only: $out"
docker exec "$coord" bash -c 'echo x > /var/lib/keel/.probe && rm /var/lib/keel/.probe' \
  || die "the coordinator cannot write its data volume /var/lib/keel"
log "every process of the 4 containers runs as uid 10001; /corpus is read-only (\"$(tail -n 1 <<<"$out" | sed 's/^.*: //')\"); /var/lib/keel is writable"

# ---------------------------------------------------------------------------------------------
# 3. A job from the host.
write_job() { # write_job FILE STEPS CHECKPOINT_EVERY EVAL_EVERY
  {
    echo "# Written by scripts/container-test.sh: tiny BERT on the King James Bible, 3 workers."
    tiny_job_sections /corpus/kjv.txt "$2" "$3" "$4"
    cat <<EOF

[cluster]
min_workers = 3
max_workers = 3
peer_timeout_seconds = 4
replacement_timeout_seconds = 120
EOF
  } >"$1"
}

submit() { # submit FILE: prints the job id
  local job
  job="$(keel_host 60 submit "$1" 2>>"$WORK/logs/submit.log" | awk 'NF { last = $NF } END { print last }')" || die "keel submit $1 failed: $(tail -n 3 "$WORK/logs/submit.log")"
  [ -n "$job" ] || die "keel submit printed no job id"
  echo "$job"
}

# status JOB: "STATE STEP WORKERS GENERATION RECOVERIES", or "down" when the coordinator does not answer.
status() {
  keel_host 5 status "$1" 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["state"], d["step"], len(d.get("workers") or []), d["generation"], d["recoveries"])' 2>/dev/null || echo "down 0 0 0 0"
}

check_hf() { # check_hf DIR: transformers loads it with no missing keys and fills a mask
  if [ -z "$HF_PY" ]; then
    log "transformers check SKIPPED (not installed)"
    return 0
  fi
  "$HF_PY" - "$1" <<'PY' || die "transformers could not load the checkpoint in $1"
import sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
from transformers import BertForMaskedLM, BertTokenizerFast
d = sys.argv[1]
model, info = BertForMaskedLM.from_pretrained(d, output_loading_info=True)
bad = {k: v for k, v in info.items() if v}
if bad:
    sys.exit(f"loading info not empty: {bad}")
tok = BertTokenizerFast.from_pretrained(d)
enc = tok("in the beginning god created the [MASK] and the earth", return_tensors="pt")
with torch.no_grad():
    logits = model(**enc).logits
i = (enc["input_ids"][0] == tok.mask_token_id).nonzero()[0].item()
n = sum(p.numel() for p in model.parameters())
print(f"transformers {transformers.__version__} (torch {torch.__version__}): BertForMaskedLM, {n} parameters, "
      f"missing_keys=[] unexpected_keys=[]; top-3 for [MASK]: {tok.convert_ids_to_tokens(logits[0, i].topk(3).indices)}")
PY
}

t0=$SECONDS
write_job "$WORK/jobs/short.toml" 60 60 60
JOB0="$(submit "$WORK/jobs/short.toml")"
keel_host 300 watch "$JOB0" >"$WORK/logs/watch-$JOB0.log" 2>&1 || die "keel watch $JOB0 failed: $(tail -n 3 "$WORK/logs/watch-$JOB0.log")"
[ "$(status "$JOB0" | cut -d' ' -f1-2)" = "completed 60" ] || die "$JOB0 ended as $(status "$JOB0")"
keel_host 120 pull "$JOB0" --out "$WORK/pulled-$JOB0" >"$WORK/logs/pull-$JOB0.log" 2>&1 || die "keel pull $JOB0 failed"
[ -f "$WORK/pulled-$JOB0/model.safetensors" ] || die "keel pull $JOB0 brought no model.safetensors"
log "$JOB0: $(tail -n 1 "$WORK/logs/watch-$JOB0.log") ($((SECONDS - t0)) s from submit to pulled)"
log "$(check_hf "$WORK/pulled-$JOB0")"
# Metrics, where deploy/prometheus/prometheus.yml's static jobs would scrape them: the
# coordinator's /metrics on its published port, each worker's on worker-N:9471 inside the network.
n="$(curl -sf --max-time 5 "http://127.0.0.1:$MPORT/metrics" | grep -c "^keel_job_step{job_id=\"$JOB0\"}")" \
  || die "the coordinator's /metrics on 127.0.0.1:$MPORT has no keel_job_step for $JOB0"
for svc in worker-1 worker-2 worker-3; do
  docker exec "$coord" timeout 5 bash -c "exec 3<>/dev/tcp/$svc/9471 && printf 'GET /metrics HTTP/1.0\r\nHost: $svc\r\n\r\n' >&3 && cat <&3" \
    | grep -q '^keel_' || die "$svc:9471/metrics does not answer inside the compose network"
done
log "metrics: coordinator /metrics on 127.0.0.1:$MPORT (keel_job_step{job_id=\"$JOB0\"}); worker-1..3:9471/metrics answer inside the network"
# A real Prometheus (Debian's, 2.42) on the compose network, scraping with
# deploy/prometheus/prometheus.yml's static jobs: their example host names replaced by the
# compose services', the interval cut to 2 s, and the Kubernetes job left out (Debian builds
# Prometheus without Kubernetes discovery). Every target must be "up" and keel_job_step read.
if [ -n "$PROM_BIN" ]; then
  mkdir -p "$WORK/prom/data"
  cp "$PROM_BIN" "$WORK/prom/prometheus"
  sed -n '/^  - job_name: keel-kubernetes-pods/q; p' deploy/prometheus/prometheus.yml \
    | sed -e 's/coordinator\.example\.internal/coordinator/; s/\(worker-[0-9]\)\.example\.internal/\1/' \
          -e 's/^\(  scrape_interval:\).*/\1 2s/' >"$WORK/prom/prometheus.yml"
  chown -R 10001:10001 "$WORK/prom"
  PPORT="$(free_port)"
  docker run -d --name "$ID-prometheus" --label "com.docker.compose.project=$ID" \
    --network "$(docker inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}' "$coord" | awk '{ print $1 }')" \
    -p "127.0.0.1:$PPORT:9090" -v "$WORK/prom:/prom" --entrypoint /prom/prometheus "$TAG" \
    --config.file=/prom/prometheus.yml --storage.tsdb.path=/prom/data >/dev/null
  deadline=$((SECONDS + 60))
  until up="$(curl -sf --max-time 5 "http://127.0.0.1:$PPORT/api/v1/targets" | python3 -c '
import json, sys
t = json.load(sys.stdin)["data"]["activeTargets"]
up = sorted(x["labels"]["instance"] for x in t if x["health"] == "up")
print(" ".join(up))
sys.exit(0 if len(t) == 4 and len(up) == 4 else 1)' 2>/dev/null)"; do
    [ $SECONDS -lt $deadline ] || die "Prometheus: not every target up after 60 s: $(curl -s --max-time 5 "http://127.0.0.1:$PPORT/api/v1/targets" | head -c 1500)"
    sleep 1
  done
  val="$(curl -sf --max-time 5 "http://127.0.0.1:$PPORT/api/v1/query?query=keel_job_step" | python3 -c '
import json, sys
r = json.load(sys.stdin)["data"]["result"]
print(" ".join("%s=%s" % (x["metric"].get("job_id"), x["value"][1]) for x in r))')"
  [[ " $val " == *" $JOB0=60 "* ]] || die "Prometheus: keel_job_step has no $JOB0=60 ($val)"
  log "Prometheus $("$WORK/prom/prometheus" --version 2>&1 | head -n 1 | awk '{ print $3 }') with prometheus.yml's static jobs: targets up: $up; keel_job_step: $val"
  docker rm -f "$ID-prometheus" >/dev/null
else
  log "Prometheus check SKIPPED (Debian's prometheus package could not be downloaded)"
fi
# The compose file's CLI service (profile cli) too: `jobs`, and `pull` into KEEL_OUT_DIR.
compose run --rm keel jobs >"$WORK/logs/run-jobs.log" 2>&1 || die "compose run --rm keel jobs failed: $(tail -n 3 "$WORK/logs/run-jobs.log")"
grep -q "^$JOB0 .*completed" "$WORK/logs/run-jobs.log" || die "compose run --rm keel jobs does not list $JOB0 completed: $(cat "$WORK/logs/run-jobs.log")"
compose run --rm keel pull "$JOB0" --out "/out/$JOB0" >"$WORK/logs/run-pull.log" 2>&1 \
  || die "compose run --rm keel pull failed: $(tail -n 3 "$WORK/logs/run-pull.log")"
cmp -s "$WORK/out/$JOB0/model.safetensors" "$WORK/pulled-$JOB0/model.safetensors" \
  || die "compose run --rm keel pull brought a different model.safetensors"
log "compose run --rm keel jobs / pull (the compose file's CLI service): $JOB0 listed, the same model.safetensors"

# ---------------------------------------------------------------------------------------------
# 4. Faults.
STEPS=200
write_job "$WORK/jobs/long.toml" "$STEPS" 50 0

# wait_step JOB N: until the job runs with 3 workers at step >= N; prints the step.
wait_step() {
  local job="$1" n="$2" deadline=$((SECONDS + 120)) state step nw _
  while :; do
    read -r state step nw _ <<<"$(status "$job")"
    [ "$state" = running ] && [ "$nw" = 3 ] && [ "$step" -ge "$n" ] && { echo "$step"; return 0; }
    [ "$state" = failed ] && die "$job failed before the fault: $(keel_host 5 status "$job")"
    [ $SECONDS -lt $deadline ] || die "$job not running at step $n after 120 s: $state $step"
    sleep 0.2
  done
}

# wait_recovering JOB: until the coordinator has noticed (state recovering, or a new generation).
wait_recovering() {
  local job="$1" gen0="$2" deadline=$((SECONDS + 60)) state gen _
  while :; do
    read -r state _ _ gen _ <<<"$(status "$1")"
    [ "$state" = recovering ] || { [ "$state" != down ] && [ "$gen" -gt "$gen0" ]; } && return 0
    [ $SECONDS -lt $deadline ] || die "$job: the fault was not noticed in 60 s ($(status "$job"))"
    sleep 0.2
  done
}

# wait_back JOB STEP: until the job runs with 3 workers past STEP (or completed); bounded.
wait_back() {
  local job="$1" before="$2" deadline=$((SECONDS + 180)) state step nw _
  while :; do
    read -r state step nw _ <<<"$(status "$job")"
    [ "$state" = completed ] && return 0
    [ "$state" = running ] && [ "$nw" = 3 ] && [ "$step" -gt "$before" ] && return 0
    [ "$state" = failed ] && die "$job failed after the fault: $(keel_host 5 status "$job")"
    [ $SECONDS -lt $deadline ] || die "$job not back past step $before in 180 s: $state $step ($nw workers)"
    sleep 0.2
  done
}

# steps_lost JOB: steps computed twice, from the workers' logs (rank 0 logs every step it
# computes: "step N | loss ..."): the logs of the current containers, and of those `compose down`
# removed (saved in OLD_LOGS_DIR); also the generations' start steps.
OLD_LOGS_DIR="$WORK/logs/removed"
mkdir -p "$OLD_LOGS_DIR"
steps_lost() {
  local svc
  for svc in worker-1 worker-2 worker-3; do docker logs "$(cid "$svc")" >"$WORK/logs/now-$svc.log" 2>&1; done
  python3 - "$1" "$WORK"/logs/now-worker-*.log "$OLD_LOGS_DIR"/*.log <<'PY'
import glob, re, sys
job = sys.argv[1]
ansi = re.compile(r"\x1b\[[0-9;]*m")
steps, starts = [], set()
for path in sys.argv[2:]:
    if not glob.glob(path):
        continue
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
}

# finish JOB NAME STEP T_FAULT T_NOTICED T_BACK: the job completes; prints and records the result.
RESULTS=()
finish() {
  local job="$1" name="$2" at="$3" tf="$4" tn="$5" tb="$6" lost starts st
  keel_host 300 watch "$job" >"$WORK/logs/watch-$job.log" 2>&1 || die "[$name] $job did not complete: $(tail -n 2 "$WORK/logs/watch-$job.log")"
  st="$(status "$job")"
  [ "$(cut -d' ' -f1-3 <<<"$st")" = "completed $STEPS 3" ] || die "[$name] $job ended as $st (want completed $STEPS with 3 workers)"
  read -r lost starts <<<"$(steps_lost "$job")"
  local line
  line="$(awk -v n="$name" -v j="$job" -v s="$at" -v a="$tf" -v b="$tn" -v c="$tb" -v l="$lost" -v r="$(cut -d' ' -f5 <<<"$st")" -v g="$(cut -d' ' -f4 <<<"$st")" -v t="$STEPS" \
    'BEGIN { printf "%-8s %s: fault at step %d (keel status); noticed after %.1f s; back past step %d after %.1f s; steps lost %d; completed %d/%d (generation %d, %d recoveries)", n, j, s, b - a, s, c - a, l, t, t, g, r }')"
  log "RESULT $line [$starts]"
  RESULTS+=("$line")
}

# kill: docker kill worker-2, then compose up brings it back.
JOB="$(submit "$WORK/jobs/long.toml")"
w2="$(cid worker-2)"
wait_step "$JOB" 60 >/dev/null; read -r _ at _ gen _ <<<"$(status "$JOB")"
docker kill "$w2" >/dev/null; tf=$EPOCHREALTIME
log "[kill] $JOB: docker kill worker-2 at step $at"
wait_recovering "$JOB" "$gen"; tn=$EPOCHREALTIME
compose up -d --no-build worker-2 >>"$WORK/logs/up.log" 2>&1 || die "compose up worker-2 failed"
log "[kill] compose up -d worker-2: $(docker inspect -f '{{.State.Status}}' "$(cid worker-2)")"
wait_back "$JOB" "$at"; tb=$EPOCHREALTIME
finish "$JOB" kill "$at" "$tf" "$tn" "$tb"

# netcut: worker-2 off the network for 10 s (peer timeout 4 s), then back under its name.
w2="$(cid worker-2)"
NET="$(docker inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}' "$w2" | awk '{ print $1 }')"
[ -n "$NET" ] || die "worker-2 is on no network"
JOB="$(submit "$WORK/jobs/long.toml")"
wait_step "$JOB" 60 >/dev/null; read -r _ at _ gen _ <<<"$(status "$JOB")"
docker network disconnect "$NET" "$w2"; tf=$EPOCHREALTIME
log "[netcut] $JOB: docker network disconnect $NET worker-2 at step $at"
wait_recovering "$JOB" "$gen"; tn=$EPOCHREALTIME
sleep "$(awk -v a="$tf" -v b="$EPOCHREALTIME" 'BEGIN { d = 10 - (b - a); print (d > 0 ? d : 0) }')"
docker network connect --alias worker-2 "$NET" "$w2"
log "[netcut] reconnected worker-2 after $(awk -v a="$tf" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f s", b - a }')"
wait_back "$JOB" "$at"; tb=$EPOCHREALTIME
finish "$JOB" netcut "$at" "$tf" "$tn" "$tb"

# restart: docker restart of the coordinator; the job resumes.
JOB="$(submit "$WORK/jobs/long.toml")"
coord="$(cid coordinator)"
wait_step "$JOB" 60 >/dev/null; read -r _ at _ gen _ <<<"$(status "$JOB")"
docker restart -t 10 "$coord" >/dev/null; tf=$EPOCHREALTIME
log "[restart] $JOB: docker restart coordinator at step $at (returned after the restart)"
wait_recovering "$JOB" "$gen"; tn=$EPOCHREALTIME
wait_back "$JOB" "$at"; tb=$EPOCHREALTIME
finish "$JOB" restart "$at" "$tf" "$tn" "$tb"

# downup: compose down (volumes kept) mid-job, then compose up; the job resumes.
JOB="$(submit "$WORK/jobs/long.toml")"
sha_before="$(sha256sum "$WORK/pulled-$JOB0/model.safetensors" | cut -c1-16)"
# The workers' logs until their containers stop: `compose down` removes them.
followers=()
for svc in worker-1 worker-2 worker-3; do
  timeout 120 docker logs -f "$(cid "$svc")" >"$OLD_LOGS_DIR/$svc.log" 2>&1 &
  followers+=("$!")
done
wait_step "$JOB" 60 >/dev/null; read -r _ at _ gen _ <<<"$(status "$JOB")"
jobs_before="$(keel_host 10 jobs | awk 'NR > 1 && $2 == "completed" { print $1 }' | sort | tr '\n' ' ')"
compose down --timeout 10 >"$WORK/logs/down.log" 2>&1 || die "compose down failed"; tf=$EPOCHREALTIME
for p in "${followers[@]}"; do wait "$p" || true; done
[ -z "$(docker ps -aq --filter "label=com.docker.compose.project=$ID")" ] || die "compose down left containers"
vols="$(docker volume ls -q --filter "label=com.docker.compose.project=$ID" | wc -l)"
[ "$vols" = 4 ] || die "after compose down $vols volumes are left, want 4"
log "[downup] $JOB: compose down at step $at (containers and network gone, $vols volumes kept)"
compose up -d --no-build >>"$WORK/logs/up.log" 2>&1 || die "compose up after down failed"
wait_cluster
log "[downup] compose up: the coordinator answers $(awk -v a="$tf" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f s", b - a }') after the down"
tn=$EPOCHREALTIME
wait_back "$JOB" "$at"; tb=$EPOCHREALTIME
finish "$JOB" downup "$at" "$tf" "$tn" "$tb"
jobs_after="$(keel_host 10 jobs | awk 'NR > 1 && $2 == "completed" { print $1 }' | sort | tr '\n' ' ')"
for j in $jobs_before; do
  [[ " $jobs_after " == *" $j "* ]] || die "[downup] $j was completed before the down and is not listed after: $jobs_after"
done
keel_host 120 pull "$JOB0" --out "$WORK/pulled-again-$JOB0" >"$WORK/logs/pull-again.log" 2>&1 || die "[downup] keel pull $JOB0 after down/up failed"
sha_after="$(sha256sum "$WORK/pulled-again-$JOB0/model.safetensors" | cut -c1-16)"
[ "$sha_before" = "$sha_after" ] || die "[downup] $JOB0's model.safetensors changed across down/up ($sha_before -> $sha_after)"
log "[downup] after down/up: completed jobs listed: $jobs_after; $JOB0 pulled again, same model.safetensors (sha256 $sha_after...)"

# ---------------------------------------------------------------------------------------------
log "RESULT $IMAGE_RESULT"
for r in "${RESULTS[@]}"; do log "RESULT $r"; done
log "RESULT whole test $((SECONDS - T_START)) s (base image already there: $(docker image inspect -f '{{.Created}}' debian:bookworm-slim | cut -c1-19))"
