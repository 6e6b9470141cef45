#!/usr/bin/env bash
# A real multi-host test of Keel: each process gets a network host of its own.
#
# Builds five network namespaces, each with its own address on 10.77.0.0/24, joined by a bridge
# that lives in a sixth namespace (so the machine's own interfaces and addresses are never
# touched):
#
#   keelmhPID-coord  10.77.0.10  keel-coordinator --listen 0.0.0.0:7070
#   keelmhPID-w1     10.77.0.11  keel-worker --advertise-addr 10.77.0.11:7071
#   keelmhPID-w2     10.77.0.12  keel-worker --advertise-addr 10.77.0.12:7071
#   keelmhPID-w3     10.77.0.13  keel-worker --advertise-addr 10.77.0.13:7071
#   ...              (--workers N: hosts w1..wN at 10.77.0.11..10.77.0.1N, N from 2 to 8)
#   keelmhPID-user   10.77.0.20  keel submit / watch / status / pull
#   keelmhPID-net    (no address: the bridge keelbr0 and the host-side end of every veth)
#
# It first checks the plumbing (a TCP server on each host's Keel port reached from every other
# host), then runs a short job across the worker hosts (3 unless --workers; tiny preset, 30 steps, max_seq_length 64,
# vocab_size 2000) and pulls the checkpoint from the user's host, checking its files. With --netem every host's
# link gets `netem delay 1ms rate 1gbit` and the job runs a second time under it; both step
# times are printed (a kernel without sch_netem gets `tbf rate 1gbit`: the bandwidth limit
# without the delay; the script says so). With --link-cut a third job (120 steps, peer timeout
# 4 s) runs while worker w2's link is taken down for 12 s and brought back: the job must
# notice, re-form its ring (state recovering), take w2 back when its link returns, and complete
# with every step; the time from the cut to the recovery is printed. With --kill-two (last; on
# the shaped links with --netem) a job of 120 steps (min_workers = N - 2) runs while the workers
# on w2 and w3 are killed (kill -9, back to back): the job must go on with N - 2 workers, take a newcomer (a fresh worker process with
# an empty cache on w2's host) in a new generation, and complete every step. --allreduce-dtype
# bf16 sends the gradients as bf16 on the ring in every job. --rate R shapes to R instead of 1gbit
# (tc's units: 100mbit, 1gbit). --diloco H trains every job with DiLoCo, H local steps per outer
# step (outer momentum $KEEL_MH_DILOCO_MOMENTUM, default 0.5; --steps must be a multiple of H). --plumbing-only stops after the network checks and
# needs no binaries. With --slurm, deploy/slurm/keel.sbatch then runs the same job on the three
# worker hosts: on a real Slurm cluster when slurmctld, slurmd, munged and sbatch are installed
# (Debian: slurmctld slurmd slurm-client munge; this script starts private daemons in the
# namespaces: slurmctld on the coordinator's host, one slurmd per worker host), otherwise with
# stand-ins for srun, scontrol and squeue that run one task per host in its namespace.
#
# Usage (as root):
#   scripts/multihost-test.sh [--netem] [--link-cut] [--kill-two] [--slurm] [--plumbing-only] [--keep]
#                             [--steps N] [--workers N] [--allreduce-dtype fp32|bf16]
#                             [--rate R] [--diloco H]
#                             [--bin-dir DIR] [--corpus PATH] [BIN_DIR [CORPUS]]
#   BIN_DIR  directory holding keel, keel-coordinator, keel-worker
#            (default: $CARGO_TARGET_DIR/release, else target/release)
#   CORPUS   corpus file or folder (default: corpora/en-kjv, written by scripts/corpora.sh)
# Environment: KEEL_MH_JOB_TIMEOUT (seconds for one job, default 900),
#              KEEL_MH_START_TIMEOUT (seconds for a server to listen, default 60),
#              KEEL_MH_THREADS (--threads per worker, default 1),
#              KEEL_MH_SLURM (--slurm on: real, standins, or auto (default: real when installed)).
#
# Everything it creates (namespaces, veths, bridge, processes, temp dir) is removed on exit,
# whatever the exit. Every wait is bounded. Exits non-zero on any failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/tiny-job.sh disable=SC1091 # checked on its own by validate-deploy.sh
. "$REPO/scripts/lib/tiny-job.sh"

NETEM=0
SLURM=0
LINK_CUT=0
KILL_TWO=0
N_WORKERS=3
ALLREDUCE_DTYPE=fp32
PLUMBING_ONLY=0
KEEP=0
STEPS=30
RATE=1gbit
DILOCO=0
BIN_DIR=""
CORPUS=""
JOB_TIMEOUT="${KEEL_MH_JOB_TIMEOUT:-900}"
START_TIMEOUT="${KEEL_MH_START_TIMEOUT:-60}"
THREADS="${KEEL_MH_THREADS:-1}"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

positional=()
while [ $# -gt 0 ]; do
  case "$1" in
    --netem) NETEM=1 ;;
    --slurm) SLURM=1 ;;
    --link-cut) LINK_CUT=1 ;;
    --kill-two) KILL_TWO=1 ;;
    --workers) N_WORKERS="${2:?--workers needs a number}"; shift ;;
    --allreduce-dtype) ALLREDUCE_DTYPE="${2:?--allreduce-dtype needs fp32 or bf16}"; shift ;;
    --plumbing-only) PLUMBING_ONLY=1 ;;
    --keep) KEEP=1 ;;
    --steps) STEPS="${2:?--steps needs a number}"; shift ;;
    --rate) RATE="${2:?--rate needs a tc rate such as 100mbit}"; shift ;;
    --diloco) DILOCO="${2:?--diloco needs H}"; shift ;;
    --bin-dir) BIN_DIR="${2:?--bin-dir needs a directory}"; shift ;;
    --corpus) CORPUS="${2:?--corpus needs a path}"; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "multihost: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
[ ${#positional[@]} -ge 1 ] && BIN_DIR="${positional[0]}"
[ ${#positional[@]} -ge 2 ] && CORPUS="${positional[1]}"
[ ${#positional[@]} -ge 3 ] && { echo "multihost: too many arguments (see --help)" >&2; exit 2; }
[[ "$N_WORKERS" =~ ^[2-8]$ ]] || { echo "multihost: --workers must be 2 to 8, got $N_WORKERS" >&2; exit 2; }
[[ "$ALLREDUCE_DTYPE" =~ ^(fp32|bf16)$ ]] || { echo "multihost: --allreduce-dtype must be fp32 or bf16" >&2; exit 2; }
[ "$SLURM" = 0 ] || [ "$N_WORKERS" = 3 ] || { echo "multihost: --slurm runs on exactly 3 worker hosts" >&2; exit 2; }
[ "$KILL_TWO" = 0 ] || [ "$N_WORKERS" -ge 3 ] || { echo "multihost: --kill-two needs --workers 3 or more" >&2; exit 2; }
if [ -z "$BIN_DIR" ]; then
  if [ -n "${CARGO_TARGET_DIR:-}" ]; then BIN_DIR="$CARGO_TARGET_DIR/release"; else BIN_DIR="$REPO/target/release"; fi
fi
if [ -z "$CORPUS" ]; then "$REPO/scripts/corpora.sh" >/dev/null; CORPUS="$REPO/corpora/en-kjv"; fi
case "$STEPS" in ''|*[!0-9]*) echo "multihost: --steps must be a positive integer, got '$STEPS'" >&2; exit 2 ;; esac
[[ "$RATE" =~ ^[0-9]+(kbit|mbit|gbit)$ ]] || { echo "multihost: --rate must look like 100mbit or 1gbit, got '$RATE'" >&2; exit 2; }
if ! [[ "$DILOCO" =~ ^[0-9]+$ ]] || { [ "$DILOCO" != 0 ] && [ $((STEPS % DILOCO)) != 0 ]; }; then
  echo "multihost: --diloco H needs a number that divides --steps ($STEPS), got '$DILOCO'" >&2; exit 2
fi
# The rate in Gbit/s, for checking that the shaping shows.
RATE_GBIT="$(python3 -c 'import re,sys; n,u=re.match(r"(\d+)(\w+)",sys.argv[1]).groups(); print(int(n)*{"kbit":1e-6,"mbit":1e-3,"gbit":1}[u])' "$RATE")"

log() { printf '[multihost %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[multihost] FAIL: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# Preflight: everything checked before anything is created.
[ "$(id -u)" = 0 ] || die "must run as root (creates network namespaces)"
for tool in ip timeout python3; do
  command -v "$tool" >/dev/null || die "'$tool' not found (Debian: apt-get install iproute2 coreutils python3)"
done
if [ "$NETEM" = 1 ]; then
  command -v tc >/dev/null || die "'tc' not found (Debian: apt-get install iproute2)"
fi
if [ "$PLUMBING_ONLY" = 0 ]; then
  BIN_DIR="$(cd "$BIN_DIR" 2>/dev/null && pwd)" || die "binary directory '$BIN_DIR' does not exist (build with: cargo build --release)"
  for b in keel keel-coordinator keel-worker; do
    [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b is missing or not executable (build with: cargo build --release)"
  done
  [ -e "$CORPUS" ] || die "corpus '$CORPUS' not found (give one as the second argument or --corpus)"
  CORPUS="$(cd "$(dirname "$CORPUS")" && pwd)/$(basename "$CORPUS")"
fi

# ---------------------------------------------------------------------------------------------
# State that cleanup undoes. Names carry our PID so parallel runs never collide.
PREFIX="keelmh$$"
NS_NET="$PREFIX-net"
WORKER_NODES=()
declare -A ADDR=([coord]=10.77.0.10 [user]=10.77.0.20)
for ((i = 1; i <= N_WORKERS; i++)); do WORKER_NODES+=("w$i"); ADDR[w$i]="10.77.0.$((10 + i))"; done
NODES=(coord "${WORKER_NODES[@]}" user)
# The worker process on each host (kill -9 in --kill-two).
declare -A WPID=()
CREATED_NS=()
PIDS=()
WORK="$(mktemp -d /tmp/keel-multihost.XXXXXX)"
mkdir -p "$WORK/logs"
# The cluster token: one file every program on every "host" reads (namespaces share files).
TOKEN_FILE="$WORK/keel.token"
(umask 077 && head -c 32 /dev/urandom | base64 >"$TOKEN_FILE")

ns_of() { echo "$PREFIX-$1"; }

stop_pids() { # stop_pids PID...: TERM to all, up to 10 s grace in all, then KILL
  local pid alive _
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 100); do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 1 ] || return 0
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null || true
}

cleanup() {
  local rc=$? pid ns
  set +e
  # A second Ctrl-C or SIGTERM must not cut the cleanup short.
  trap - EXIT
  trap "" INT TERM
  stop_pids "${PIDS[@]}"
  # Anything still inside our namespaces was started by this script (directly or as a child).
  local left=()
  for ns in "${CREATED_NS[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do left+=("$pid"); done
  done
  stop_pids "${left[@]}"
  for ns in "${CREATED_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  if [ "$rc" != 0 ]; then
    for f in "$WORK"/logs/*.log; do
      [ -s "$f" ] || continue
      echo "----- last lines of $(basename "$f") -----" >&2
      tail -n 25 "$f" >&2
    done
  fi
  if [ "$KEEP" = 1 ]; then log "kept $WORK"; else rm -rf "$WORK"; fi
  [ "$rc" = 0 ] && log "PASS" || echo "[multihost] exit $rc" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

in_ns() { local node="$1"; shift; ip netns exec "$(ns_of "$node")" "$@"; }

# start_in NODE NAME CMD...: runs CMD in NODE's namespace in the background, logging to logs/NAME.log.
start_in() {
  local node="$1" name="$2"; shift 2
  ip netns exec "$(ns_of "$node")" "$@" >"$WORK/logs/$name.log" 2>&1 &
  PIDS+=("$!")
  LAST_PID=$!
}

# tcp_probe NODE HOST PORT: one TCP connect from NODE, 2 s at most.
tcp_probe() {
  in_ns "$1" timeout 3 python3 -c '
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()' "$2" "$3" >/dev/null 2>&1
}

# wait_listening NODE HOST PORT PID WHAT: waits (bounded) until HOST:PORT accepts from NODE.
wait_listening() {
  local node="$1" host="$2" port="$3" pid="$4" what="$5" deadline=$((SECONDS + START_TIMEOUT))
  until tcp_probe "$node" "$host" "$port"; do
    kill -0 "$pid" 2>/dev/null || die "$what exited before listening on $host:$port"
    [ $SECONDS -lt $deadline ] || die "$what not listening on $host:$port after ${START_TIMEOUT}s"
    sleep 0.3
  done
}

# ---------------------------------------------------------------------------------------------
# The network: one bridge in its own namespace, one veth per host.
setup_network() {
  ip netns add "$NS_NET"; CREATED_NS+=("$NS_NET")
  ip -n "$NS_NET" link set lo up
  ip -n "$NS_NET" link add keelbr0 type bridge
  ip -n "$NS_NET" link set keelbr0 up
  local node ns
  for node in "${NODES[@]}"; do
    ns="$(ns_of "$node")"
    ip netns add "$ns"; CREATED_NS+=("$ns")
    ip -n "$ns" link set lo up
    # Created directly inside the bridge's namespace: no name ever appears in the host's.
    ip -n "$NS_NET" link add "v-$node" type veth peer name eth0 netns "$ns"
    ip -n "$NS_NET" link set "v-$node" master keelbr0
    ip -n "$NS_NET" link set "v-$node" up
    ip -n "$ns" addr add "${ADDR[$node]}/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
  log "network: bridge keelbr0 in $NS_NET; hosts $(for n in "${NODES[@]}"; do printf '%s=%s ' "$n" "${ADDR[$n]}"; done)"
}

port_of() { case "$1" in coord) echo 7070 ;; *) echo 7071 ;; esac; }

# Every host serves a marker over HTTP on its Keel port; every host fetches every other's.
# The ring needs worker-to-worker reachability, not just to and from the coordinator.
check_plumbing() {
  local node peer pids=()
  for node in "${NODES[@]}"; do
    mkdir -p "$WORK/www-$node"
    echo "keel-multihost $node" >"$WORK/www-$node/marker"
    start_in "$node" "http-$node" python3 -m http.server "$(port_of "$node")" \
      --bind "${ADDR[$node]}" --directory "$WORK/www-$node"
    pids+=("$LAST_PID")
  done
  local i=0
  for node in "${NODES[@]}"; do
    wait_listening "$node" "${ADDR[$node]}" "$(port_of "$node")" "${pids[$i]}" "http.server on $node"
    i=$((i + 1))
  done
  # One client process per host, fetching from every other host (a Python start costs ~1 s here).
  local pairs=0 urls got
  for node in "${NODES[@]}"; do
    urls=()
    for peer in "${NODES[@]}"; do
      [ "$node" = "$peer" ] || urls+=("$peer=http://${ADDR[$peer]}:$(port_of "$peer")/marker")
    done
    got="$(in_ns "$node" timeout 30 python3 -c '
import sys, urllib.request
bad = 0
for arg in sys.argv[1:]:
    peer, url = arg.split("=", 1)
    try:
        body = urllib.request.urlopen(url, timeout=5).read().decode().strip()
    except OSError as e:
        body = f"error {e}"
    if body == f"keel-multihost {peer}":
        print("ok")
    else:
        print(f"cannot fetch {url}: {body}", file=sys.stderr)
        bad += 1
sys.exit(1 if bad else 0)' "${urls[@]}")" || die "host $node (${ADDR[$node]}) cannot reach every other host (see above)"
    pairs=$((pairs + $(grep -c '^ok$' <<<"$got")))
  done
  local want=$(( ${#NODES[@]} * (${#NODES[@]} - 1) ))
  [ "$pairs" = "$want" ] || die "only $pairs of $want host pairs reached each other"
  # (No check that the host's own namespace cannot reach 10.77.0.0/24: on some sandboxes the
  # host's default gateway accepts every TCP connection. Our namespaces have no default route.)
  log "plumbing: $pairs/$want host pairs reached each other over TCP through the bridge"
  stop_pids "${pids[@]}"
}

# Link shaping. The wanted figure is netem's 1 ms delay + 1 Gbit/s; kernels built without
# sch_netem (CONFIG_NET_SCH_NETEM unset, as on this project's Firecracker VMs) still have tbf,
# which gives the 1 Gbit/s limit but no added delay: the script says which one it used.
SHAPING=""
detect_shaping() {
  local probe; probe="$(ns_of user)"
  if ip netns exec "$probe" tc qdisc replace dev eth0 root netem delay 1ms rate "$RATE" 2>/dev/null; then
    SHAPING="netem delay 1ms rate $RATE"
  elif ip netns exec "$probe" tc qdisc replace dev eth0 root tbf rate "$RATE" burst 256kb latency 20ms 2>/dev/null; then
    SHAPING="tbf rate $RATE burst 256kb latency 20ms"
    log "netem: this kernel has no sch_netem qdisc; using tbf ($RATE limit, NO added 1 ms delay)"
  else
    die "--netem: neither the netem nor the tbf qdisc is available in this kernel"
  fi
  ip netns exec "$probe" tc qdisc del dev eth0 root
}

apply_shaping() {
  local node
  for node in "${NODES[@]}"; do
    # Egress of every host, so each message between two hosts crosses one shaped link.
    # shellcheck disable=SC2086 # SHAPING is a qdisc spec split into words on purpose
    ip netns exec "$(ns_of "$node")" tc qdisc replace dev eth0 root $SHAPING
  done
  log "shaping: '$SHAPING' on eth0 of every host"
}

remove_shaping() {
  local node
  for node in "${NODES[@]}"; do ip netns exec "$(ns_of "$node")" tc qdisc del dev eth0 root 2>/dev/null || true; done
}

# probe_link: TCP connect time (median of 20, ms) and one-way throughput (64 MiB, Gbit/s) from the
# user's host to the coordinator's, printed as "RTT_MS GBITS". Uses port 7079 on the coordinator.
probe_link() {
  cat >"$WORK/sink.py" <<'PY'
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(60)
for _ in range(21):  # 20 connect probes, then one bulk transfer
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(60)
        n = 0
        while chunk := conn.recv(1 << 20):
            n += len(chunk)
        if n:
            conn.sendall(b"done")
PY
  start_in coord link-sink timeout 120 python3 "$WORK/sink.py" "${ADDR[coord]}" 7079
  local sink=$LAST_PID deadline=$((SECONDS + 20))
  until in_ns coord ss -ltn 2>/dev/null | grep -q ":7079 "; do
    kill -0 "$sink" 2>/dev/null || die "link probe server exited"
    [ $SECONDS -lt $deadline ] || die "link probe server not listening after 20 s"
    sleep 0.2
  done
  in_ns user timeout 120 python3 -c '
import socket, statistics, sys, time
addr = (sys.argv[1], int(sys.argv[2]))
ts = []
for _ in range(20):
    t = time.perf_counter()
    socket.create_connection(addr, timeout=5).close()
    ts.append((time.perf_counter() - t) * 1e3)
payload = bytes(64 << 20)
s = socket.create_connection(addr, timeout=60)
t = time.perf_counter()
s.sendall(payload)
s.shutdown(socket.SHUT_WR)
assert s.recv(4) == b"done"
dt = time.perf_counter() - t
print(f"{statistics.median(ts):.3f} {len(payload) * 8 / dt / 1e9:.2f}")' "${ADDR[coord]}" 7079     || die "link probe from user to coordinator failed"
  wait "$sink" 2>/dev/null || true
}

# ---------------------------------------------------------------------------------------------
# The Keel job.
TX_BEFORE=()
link_tx_bytes() { # bytes the host NODE sent into the bridge
  ip netns exec "$(ns_of "$1")" cat /sys/class/net/eth0/statistics/tx_bytes
}

write_job() { # write_job FILE
  {
    echo "# Written by scripts/multihost-test.sh: a short job across the worker hosts."
    tiny_job_sections "$CORPUS" "$STEPS" "$STEPS" "$STEPS"
    cat <<EOF
allreduce_dtype = "$ALLREDUCE_DTYPE"

[cluster]
min_workers = $N_WORKERS
max_workers = $N_WORKERS
EOF
    if [ "$DILOCO" != 0 ]; then
      printf '\n[diloco]\ninner_steps = %s\nouter_momentum = %s\n' "$DILOCO" "${KEEL_MH_DILOCO_MOMENTUM:-0.5}"
    fi
  } >"$1"
}

keel_user() { # keel CLI from the user's host, bounded
  local t="$1"; shift
  in_ns user env KEEL_COORDINATOR="${ADDR[coord]}:7070" KEEL_TOKEN_FILE="$TOKEN_FILE" NO_COLOR=1 KEEL_LOG="${KEEL_LOG:-info}" \
    timeout "$t" "$BIN_DIR/keel" "$@"
}

start_cluster() { # start_cluster TAG: coordinator + three workers, each on its own host
  local tag="$1" w
  start_in coord "$tag-coordinator" env NO_COLOR=1 KEEL_LOG="${KEEL_LOG:-info}" KEEL_TOKEN_FILE="$TOKEN_FILE" \
    "$BIN_DIR/keel-coordinator" --listen 0.0.0.0:7070 --data-dir "$WORK/$tag/coord-data"
  wait_listening user "${ADDR[coord]}" 7070 "$LAST_PID" "keel-coordinator"
  for w in "${WORKER_NODES[@]}"; do
    start_worker "$tag" "$w" "$WORK/$tag/cache-$w"
  done
  for w in "${WORKER_NODES[@]}"; do
    # Reached from another worker's host: that is how ring peers will connect.
    local from=w1; [ "$w" = w1 ] && from=w2
    wait_listening "$from" "${ADDR[$w]}" 7071 "${WPID[$w]}" "keel-worker on $w"
  done
  log "[$tag] coordinator on ${ADDR[coord]}:7070, workers on $(for w in "${WORKER_NODES[@]}"; do printf '%s ' "${ADDR[$w]}"; done):7071"
}

start_worker() { # start_worker TAG HOST CACHE_DIR: a keel-worker on HOST's address, port 7071
  local tag="$1" w="$2" cache="$3"
  start_in "$w" "$tag-worker-$w-$(date +%s%N)" env NO_COLOR=1 KEEL_LOG="${KEEL_LOG:-info}" KEEL_TOKEN_FILE="$TOKEN_FILE" \
    "$BIN_DIR/keel-worker" --coordinator "${ADDR[coord]}:7070" --listen 0.0.0.0:7071 \
    --advertise-addr "${ADDR[$w]}:7071" --threads "$THREADS" --cache-dir "$cache"
  WPID[$w]=$LAST_PID
}

stop_cluster() {
  stop_pids "${PIDS[@]}"
  PIDS=()
}

# Checks a pulled checkpoint: HF layout, a well-formed safetensors file, vocab sizes agreeing.
check_checkpoint() { # check_checkpoint DIR
  local dir="$1" f found
  for f in config.json model.safetensors vocab.txt tokenizer.json; do
    found="$(find "$dir" -name "$f" -type f | head -n 1)"
    [ -n "$found" ] || die "pulled checkpoint in $dir has no $f (got: $(cd "$dir" && find . -type f | tr '\n' ' '))"
  done
  local ckpt; ckpt="$(dirname "$(find "$dir" -name model.safetensors -type f | head -n 1)")"
  python3 - "$ckpt" <<'PY' || die "checkpoint in $ckpt is malformed (see above)"
import json, math, os, struct, sys
d = sys.argv[1]
cfg = json.load(open(os.path.join(d, "config.json")))
vocab_lines = sum(1 for _ in open(os.path.join(d, "vocab.txt"), encoding="utf-8"))
path = os.path.join(d, "model.safetensors")
size = os.path.getsize(path)
with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
tensors = {k: v for k, v in header.items() if k != "__metadata__"}
end = max(v["data_offsets"][1] for v in tensors.values())
errors = []
if size != 8 + n + end:
    errors.append(f"file is {size} bytes, header says {8 + n + end}")
name = "bert.embeddings.word_embeddings.weight"
if name not in tensors:
    errors.append(f"no tensor {name}; has {sorted(tensors)[:5]}...")
elif tensors[name]["shape"] != [cfg.get("vocab_size"), cfg.get("hidden_size")]:
    errors.append(f"{name} shape {tensors[name]['shape']} != [vocab_size, hidden_size] from config.json")
if cfg.get("vocab_size") != vocab_lines:
    errors.append(f"config.json vocab_size {cfg.get('vocab_size')} != {vocab_lines} lines in vocab.txt")
json.load(open(os.path.join(d, "tokenizer.json")))
for e in errors:
    print("checkpoint:", e)
params = sum(math.prod(v["shape"]) for v in tensors.values())
print(f"checkpoint: {len(tensors)} tensors, {params} parameters, vocab {vocab_lines}, {size} bytes")
sys.exit(1 if errors else 0)
PY
}

# Median step time (ms) from the step lines the processes log ("step N | ... | 412 ms | ...").
step_ms_from_logs() { # step_ms_from_logs TAG
  python3 - "$WORK/logs" "$1" <<'PY'
import glob, os, re, statistics, sys
ansi = re.compile(r"\x1b\[[0-9;]*m")
line_re = re.compile(r"step\s+(\d+)\s*\|.*?\|\s*([0-9.]+)\s*ms\b")
times = {}
for path in glob.glob(os.path.join(sys.argv[1], sys.argv[2] + "-*.log")):
    for line in open(path, errors="replace"):
        m = line_re.search(ansi.sub("", line))
        if m:
            times.setdefault(int(m.group(1)), []).append(float(m.group(2)))
# Skip the first steps (warm-up: connections, first allocations).
steps = sorted(times)[2:]
vals = [statistics.median(times[s]) for s in steps]
print(f"{statistics.median(vals):.1f}" if vals else "")
PY
}

run_job() { # run_job TAG: start a cluster, run the job from the user's host, pull, check, stop
  local tag="$1" w
  mkdir -p "$WORK/$tag"
  start_cluster "$tag"
  for w in "${WORKER_NODES[@]}"; do TX_BEFORE+=("$(link_tx_bytes "$w")"); done
  write_job "$WORK/$tag/job.toml"
  local job t0 t1
  job="$(keel_user 120 submit "$WORK/$tag/job.toml" 2>"$WORK/logs/$tag-submit.log" | awk 'NF { last = $NF } END { print last }')" \
    || die "[$tag] keel submit failed"
  [ -n "$job" ] || die "[$tag] keel submit printed no job id"
  log "[$tag] submitted job $job from the user's host ${ADDR[user]}"
  t0=$EPOCHREALTIME
  keel_user "$JOB_TIMEOUT" watch "$job" >"$WORK/logs/$tag-watch.log" 2>&1 \
    || die "[$tag] keel watch $job failed or passed ${JOB_TIMEOUT}s (exit $?)"
  t1=$EPOCHREALTIME
  keel_user 60 status "$job" >"$WORK/logs/$tag-status.log" 2>&1 || die "[$tag] keel status $job failed"
  sed 's/^/    /' "$WORK/logs/$tag-status.log" | head -n 20
  keel_user 300 pull "$job" --out "$WORK/$tag/pulled" >"$WORK/logs/$tag-pull.log" 2>&1 \
    || die "[$tag] keel pull $job --out failed"
  check_checkpoint "$WORK/$tag/pulled"
  local i=0 sent
  for w in "${WORKER_NODES[@]}"; do
    sent=$(( $(link_tx_bytes "$w") - TX_BEFORE[i] ))
    log "[$tag] $w sent $((sent / 1024)) KiB over its link"
    # A 30-step all-reduce of even a tiny BERT moves megabytes: far less means no ring traffic.
    [ "$sent" -gt $((1024 * 1024)) ] || die "[$tag] $w sent only $sent bytes: did gradients cross the network?"
    i=$((i + 1))
  done
  TX_BEFORE=()
  local ms; ms="$(step_ms_from_logs "$tag")"
  STEP_RESULT="$(awk -v a="$t0" -v b="$t1" -v n="$STEPS" \
    'BEGIN { printf "job %.1f s for %d steps (submit to end, data preparation included)", b - a, n }')"
  [ -n "$ms" ] && STEP_RESULT="median step ${ms} ms; $STEP_RESULT"
  local heldout
  heldout="$(find "$WORK/$tag/pulled" -name metrics.jsonl -type f -exec python3 -c 'import json,sys
e=[json.loads(l)["eval_loss"] for l in open(sys.argv[1]) if "eval_loss" in l]
print(f"{e[-1]:.4f}" if e else "")' {} \; | head -n 1)"
  [ -n "$heldout" ] && STEP_RESULT="$STEP_RESULT; held-out loss $heldout"
  log "[$tag] $STEP_RESULT"
  stop_cluster
}

# ---------------------------------------------------------------------------------------------
# deploy/slurm/keel.sbatch on an "allocation" of the hosts w1 w2 w3 (w1 is the batch host).
# Stand-ins for Slurm's commands: scontrol expands the node list, squeue reports an hour left,
# srun runs one task per node inside that node's namespace. Every node gets its own scratch
# directory, bind-mounted over the shared scratch path, like a node-local /tmp.
write_slurm_standins() { # write_slurm_standins DIR
  local bin="$1/bin"
  mkdir -p "$bin"
  cat >"$bin/scontrol" <<'SH'
#!/usr/bin/env bash
# Stand-in for `scontrol show hostnames LIST` (LIST comma-separated, no ranges).
[ "${1:-} ${2:-}" = "show hostnames" ] || { echo "scontrol stand-in: only 'show hostnames'" >&2; exit 1; }
tr ',' '\n' <<<"${3:-$SLURM_JOB_NODELIST}"
SH
  cat >"$bin/squeue" <<'SH'
#!/usr/bin/env bash
# Stand-in for `squeue -h -j JOB -o %L`: an hour left.
echo "1:00:00"
SH
  cat >"$bin/node-run" <<'SH'
#!/usr/bin/env bash
# node-run NODE CMD...: CMD on NODE: its network namespace, its own scratch over the shared path.
node="$1"; shift
mkdir -p "$KEEL_MH_NODES/$node" "$KEEL_MH_SCRATCH"
# `ip netns exec` gives the command a mount namespace of its own: the bind mount stays there.
exec ip netns exec "$KEEL_MH_PREFIX-$node" bash -c \
  'mount --bind "$1" "$2" && shift 2 && exec "$@"' _ "$KEEL_MH_NODES/$node" "$KEEL_MH_SCRATCH" "$@"
SH
  cat >"$bin/srun" <<'SH'
#!/usr/bin/env bash
# Stand-in for srun: one task per node of SLURM_JOB_NODELIST (the first --nodes=N of them).
nodes="" cpus=1
while [[ "${1:-}" == -* ]]; do
  case "$1" in
    --nodes=*) nodes="${1#*=}" ;;
    --cpus-per-task=*) cpus="${1#*=}" ;;
  esac
  shift
done
mapfile -t names < <(tr ',' '\n' <<<"$SLURM_JOB_NODELIST")
pids=()
for i in "${!names[@]}"; do
  if [ -n "$nodes" ] && [ "$i" -ge "$nodes" ]; then break; fi
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_CPUS_PER_TASK=$cpus node-run "${names[$i]}" "$@" &
  pids+=("$!")
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit "$rc"
SH
  chmod 0755 "$bin"/*
}

run_sbatch_standins() { # run_sbatch_standins DIR: keel.sbatch with stand-ins, on the batch host w1
  local sb="$1"
  write_slurm_standins "$sb"
  PATH="$sb/bin:$PATH" KEEL_MH_PREFIX="$PREFIX" KEEL_MH_NODES="$sb/nodes" KEEL_MH_SCRATCH="$sb/scratch" \
    SLURM_JOB_ID=4242 SLURM_JOB_NODELIST=w1,w2,w3 SLURM_SUBMIT_DIR="$sb/submit" SLURM_CPUS_ON_NODE="$THREADS" \
    SLURM_CPUS_PER_TASK="$THREADS" TMPDIR="$sb/scratch" KEEL_BIN_DIR="$BIN_DIR" \
    KEEL_SLURM_TIMEOUT="$JOB_TIMEOUT" NO_COLOR=1 KEEL_LOG="${KEEL_LOG:-info}" \
    timeout $((JOB_TIMEOUT + 300)) "$sb/bin/node-run" w1 bash "$REPO/deploy/slurm/keel.sbatch" \
    "$sb/submit/job.toml" "$sb/out" >"$WORK/logs/slurm-batch.log" 2>&1 \
    || die "[slurm] keel.sbatch failed (exit $?); see slurm-batch.log above"
}

# A real Slurm cluster on the hosts: slurmctld on the coordinator's host (named ctl), one slurmd
# per worker host (w1 w2 w3), a private munged. Each daemon runs in its host's network namespace
# with that host's name (UTS namespace) and a hosts file naming every host.
slurm_node_exec() { # slurm_node_exec NODE CMD...: CMD on NODE, as NODE
  local node="$1" ns; shift
  if [ "$node" = ctl ]; then ns="$(ns_of coord)"; else ns="$(ns_of "$node")"; fi
  # shellcheck disable=SC2016 # expanded by the inner bash
  nsenter --net="/run/netns/$ns" unshare --mount --uts bash -c \
    'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' _ "$WORK/slurm/hosts" "$node" "$@"
}

# start_in_host NAME CMD...: CMD in the machine's own namespaces (munged: a unix socket only).
start_in_host() {
  local name="$1"; shift
  "$@" >"$WORK/logs/$name.log" 2>&1 &
  PIDS+=("$!")
}

start_real_slurm() {
  local sb="$WORK/slurm" n
  mkdir -p "$sb/state/ctld" "$sb/munge"
  {
    echo "127.0.0.1 localhost"
    echo "${ADDR[coord]} ctl"
    for n in w1 w2 w3; do echo "${ADDR[$n]} $n"; done
  } >"$sb/hosts"
  chmod 0700 "$sb/munge"
  head -c 1024 /dev/urandom >"$sb/munge/munge.key"
  chmod 0400 "$sb/munge/munge.key"
  start_in_host munged munged --foreground --force --key-file="$sb/munge/munge.key" \
    --socket="$sb/munge/munge.socket" --pid-file="$sb/munge/munged.pid" \
    --seed-file="$sb/munge/munged.seed" --log-file="$sb/munge/munged.log"
  cat >"$sb/slurm.conf" <<SLURMCONF
# Written by scripts/multihost-test.sh: a private Slurm cluster on network namespaces.
ClusterName=keelmultihost
SlurmctldHost=ctl(${ADDR[coord]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sb/munge/munge.socket
StateSaveLocation=$sb/state/ctld
SlurmdSpoolDir=$sb/state/spool-%n
SlurmctldPidFile=$sb/state/slurmctld.pid
SlurmdPidFile=$sb/state/slurmd-%n.pid
SlurmctldLogFile=$WORK/logs/slurmctld.log
SlurmdLogFile=$WORK/logs/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=w[1-3] NodeAddr=${ADDR[w1]},${ADDR[w2]},${ADDR[w3]} CPUs=$(nproc) State=UNKNOWN
PartitionName=main Nodes=w[1-3] Default=YES MaxTime=INFINITE State=UP
SLURMCONF
  export SLURM_CONF="$sb/slurm.conf"
  local deadline=$((SECONDS + 60))
  until [ -S "$sb/munge/munge.socket" ]; do
    [ $SECONDS -lt $deadline ] || die "munged did not create its socket in 60 s"
    sleep 0.2
  done
  slurm_node_exec ctl slurmctld -D >"$WORK/logs/slurmctld.out" 2>&1 &
  PIDS+=("$!")
  for n in w1 w2 w3; do
    slurm_node_exec "$n" slurmd -D -N "$n" >"$WORK/logs/slurmd-$n.out" 2>&1 &
    PIDS+=("$!")
  done
  deadline=$((SECONDS + START_TIMEOUT))
  until [ "$(slurm_node_exec w1 sinfo -h -N -o %T 2>/dev/null | grep -c '^idle')" = 3 ]; do
    [ $SECONDS -lt $deadline ] || die "Slurm nodes not idle after ${START_TIMEOUT}s: $(slurm_node_exec w1 sinfo -h -N 2>&1 | tr '\n' ' ')"
    sleep 1
  done
  log "[slurm] real Slurm $(sinfo --version | awk '{ print $2 }'): slurmctld on ctl=${ADDR[coord]}, slurmd on w1 w2 w3"
}

# sbatch_real SUBMIT_DIR OUT_DIR: keel.sbatch through sbatch, waits (bounded) until it left the queue.
sbatch_real() {
  local submit="$1" out="$2" id state deadline=$((SECONDS + JOB_TIMEOUT + 300))
  mkdir -p "$WORK/slurm/scratch"
  # TMPDIR: the nodes' scratch (keel.sbatch removes it); one folder here, as the nodes share a disk.
  id="$(slurm_node_exec w1 env -C "$submit" KEEL_BIN_DIR="$BIN_DIR" KEEL_SLURM_TIMEOUT="$JOB_TIMEOUT" \
    TMPDIR="$WORK/slurm/scratch" \
    NO_COLOR=1 KEEL_LOG="${KEEL_LOG:-info}" \
    sbatch --parsable --nodes=3 --cpus-per-task="$THREADS" --time=$((JOB_TIMEOUT / 60 + 10)) \
    "$REPO/deploy/slurm/keel.sbatch" job.toml "$out")" || die "[slurm] sbatch refused keel.sbatch"
  log "[slurm] sbatch deploy/slurm/keel.sbatch: Slurm job $id"
  while state="$(slurm_node_exec w1 squeue -h -j "$id" -o %T 2>/dev/null)" && [ -n "$state" ]; do
    [ $SECONDS -lt $deadline ] || die "[slurm] job $id still $state after $((JOB_TIMEOUT + 300)) s"
    sleep 2
  done
  cp "$submit/keel-$id.out" "$WORK/logs/slurm-batch.log" 2>/dev/null || die "[slurm] job $id left no output file"
  grep -q '^\[keel.sbatch [0-9:]*\] done (exit 0)$' "$WORK/logs/slurm-batch.log" \
    || die "[slurm] keel.sbatch (job $id) did not end with exit 0; see slurm-batch.log above"
}

run_slurm() {
  local sb="$WORK/slurm" w t0 t1
  mkdir -p "$sb/submit"
  write_job "$sb/submit/job.toml"
  for w in w1 w2 w3; do TX_BEFORE+=("$(link_tx_bytes "$w")"); done
  local kind="${KEEL_MH_SLURM:-auto}"
  if [ "$kind" = auto ]; then
    kind=standins
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
      && command -v sbatch >/dev/null; then kind=real; fi
  fi
  case "$kind" in real|standins) ;; *) die "KEEL_MH_SLURM must be real, standins or auto, got $kind" ;; esac
  if [ "$kind" = real ]; then
    start_real_slurm
    t0=$EPOCHREALTIME
    sbatch_real "$sb/submit" "$sb/out"
  else
    log "[slurm] stand-ins for srun, scontrol, squeue (nodes w1,w2,w3, batch host w1)"
    t0=$EPOCHREALTIME
    run_sbatch_standins "$sb"
  fi
  t1=$EPOCHREALTIME
  grep '^\[keel.sbatch' "$WORK/logs/slurm-batch.log" | sed 's/^/    /'
  check_checkpoint "$sb/out"
  local i=0 sent
  for w in "${WORKER_NODES[@]}"; do
    sent=$(( $(link_tx_bytes "$w") - TX_BEFORE[i] ))
    log "[slurm] $w sent $((sent / 1024)) KiB over its link"
    [ "$sent" -gt $((1024 * 1024)) ] || die "[slurm] $w sent only $sent bytes: did gradients cross the network?"
    i=$((i + 1))
  done
  TX_BEFORE=()
  ! compgen -G "$sb/submit/.keel-*.token" >/dev/null || die "[slurm] the generated token was not removed"
  for w in w1 w2 w3 scratch; do
    local dir="$sb/nodes/$w"; [ "$w" = scratch ] && dir="$sb/scratch"
    [ -z "$(ls -A "$dir" 2>/dev/null)" ] || die "[slurm] node scratch $dir not cleaned: $(ls -A "$dir")"
  done
  log "[slurm] $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "sbatch ran %.1f s", b - a }'); checkpoint in place, token and node scratch removed"
  stop_cluster  # the Slurm daemons (real Slurm) or nothing (stand-ins)
}

# ---------------------------------------------------------------------------------------------
# A link cut: w2's veth goes down mid-job, then comes back. The job must recover (a new ring),
# take w2 back, and complete.
job_field() { # job_field JOB FIELD: one field of `keel status JOB` (JSON)
  keel_user 30 status "$1" 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin).get(sys.argv[1], ""))' "$2"
}

# The long job of the fault runs (120 steps, peer timeout 4 s) on a fresh cluster, submitted
# from the user's host with min_workers = MIN; sets LONG_JOB to its id.
submit_long_job() { # submit_long_job TAG MIN
  local tag="$1" min="$2"
  mkdir -p "$WORK/$tag"
  start_cluster "$tag"
  write_job "$WORK/$tag/job.toml"
  sed -i "s/^max_steps = .*/max_steps = 120/; s/^checkpoint_every = .*/checkpoint_every = 40/; s/^eval_every = .*/eval_every = 0/; s/^min_workers = .*/min_workers = $min/" \
    "$WORK/$tag/job.toml"
  printf 'peer_timeout_seconds = 4\nreplacement_timeout_seconds = 120\n' >>"$WORK/$tag/job.toml"
  LONG_JOB="$(keel_user 120 submit "$WORK/$tag/job.toml" 2>"$WORK/logs/$tag-submit.log" | awk 'NF { last = $NF } END { print last }')" \
    || die "[$tag] keel submit failed"
}

# Waits for the long job to complete, checks it ran 120/120 steps with w2 (10.77.0.12) in the
# final ring, and pulls and checks its checkpoint.
finish_long_job() { # finish_long_job TAG JOB
  local tag="$1" job="$2"
  keel_user "$JOB_TIMEOUT" watch "$job" >"$WORK/logs/$tag-watch.log" 2>&1 \
    || die "[$tag] job $job did not complete: $(keel_user 30 status "$job")"
  keel_user 60 status "$job" >"$WORK/logs/$tag-status.log" 2>&1 || die "[$tag] keel status $job failed"
  sed 's/^/    /' "$WORK/logs/$tag-status.log" | head -n 30
  [ "$(job_field "$job" step)" = 120 ] || die "[$tag] job $job ended at step $(job_field "$job" step), not 120"
  grep -q "10.77.0.12" "$WORK/logs/$tag-status.log" || die "[$tag] w2 (10.77.0.12) is not in the final ring"
  keel_user 300 pull "$job" --out "$WORK/$tag/pulled" >"$WORK/logs/$tag-pull.log" 2>&1 \
    || die "[$tag] keel pull $job --out failed"
  check_checkpoint "$WORK/$tag/pulled"
}

run_link_cut() {
  local tag=linkcut job i state step recoveries t_cut t_seen
  submit_long_job "$tag" "$N_WORKERS"
  job="$LONG_JOB"
  for i in $(seq 1 600); do
    step="$(job_field "$job" step)"; state="$(job_field "$job" state)"
    [ "$state" = running ] && [ "${step:-0}" -ge 5 ] && break
    [ "$state" = failed ] && die "[$tag] job $job failed before the cut: $(job_field "$job" error)"
    sleep 0.5
  done
  [ "${step:-0}" -ge 5 ] || die "[$tag] job $job never reached step 5"
  ip -n "$NS_NET" link set "v-w2" down
  t_cut=$EPOCHREALTIME
  log "[$tag] cut w2's link at step $step"
  for i in $(seq 1 120); do
    recoveries="$(job_field "$job" recoveries)"
    [ "${recoveries:-0}" -ge 1 ] && break
    sleep 0.5
  done
  t_seen=$EPOCHREALTIME
  [ "${recoveries:-0}" -ge 1 ] || die "[$tag] the job did not notice the cut within 60 s: $(keel_user 30 status "$job")"
  log "[$tag] $(awk -v a="$t_cut" -v b="$t_seen" 'BEGIN { printf "recovery started %.1f s after the cut", b - a }') (state $(job_field "$job" state))"
  sleep "$(awk -v a="$t_cut" -v b="$t_seen" 'BEGIN { d = 12 - (b - a); print (d > 0 ? d : 0) }')"
  ip -n "$NS_NET" link set "v-w2" up
  log "[$tag] w2's link is back"
  finish_long_job "$tag" "$job"
  LINK_CUT_RESULT="link cut: recovery started $(awk -v a="$t_cut" -v b="$t_seen" 'BEGIN { printf "%.1f s", b - a }') after the cut; completed 120/120 steps with w2 back in the ring, $(job_field "$job" recoveries) recoveries"
  log "[$tag] $LINK_CUT_RESULT"
  stop_cluster
}

# Two workers killed at once (w2 and w3, kill -9 back to back): the job goes on with the
# others without waiting (min_workers = N - 2), a newcomer (a fresh process, empty cache) joins
# on w2's host in a new generation, and the job completes every step.
job_worker_count() { # job_worker_count JOB: how many workers `keel status JOB` lists
  keel_user 30 status "$1" 2>/dev/null | python3 -c 'import json, sys; print(len(json.load(sys.stdin).get("workers") or []))'
}

run_kill_two() {
  local tag=killtwo job i state step t_kill t_on t_grown n_left=$((N_WORKERS - 2)) count
  submit_long_job "$tag" "$n_left"
  job="$LONG_JOB"
  for i in $(seq 1 600); do
    step="$(job_field "$job" step)"; state="$(job_field "$job" state)"
    [ "$state" = running ] && [ "${step:-0}" -ge 5 ] && [ "$(job_worker_count "$job")" = "$N_WORKERS" ] && break
    [ "$state" = failed ] && die "[$tag] job $job failed before the kill: $(job_field "$job" error)"
    sleep 0.5
  done
  [ "${step:-0}" -ge 5 ] || die "[$tag] job $job never reached step 5 with $N_WORKERS workers"
  kill -KILL "${WPID[w2]}" "${WPID[w3]}"
  t_kill=$EPOCHREALTIME
  log "[$tag] killed the workers on w2 and w3 (kill -9) at step $step"
  for i in $(seq 1 240); do
    state="$(job_field "$job" state)"; count="$(job_worker_count "$job")"
    [ "$state" = running ] && [ "$count" = "$n_left" ] && break
    [ "$state" = failed ] && die "[$tag] job $job failed after the kill: $(job_field "$job" error)"
    sleep 0.5
  done
  t_on=$EPOCHREALTIME
  [ "$count" = "$n_left" ] || die "[$tag] the job did not go on with $n_left workers within 120 s: $(keel_user 30 status "$job")"
  step="$(job_field "$job" step)"
  log "[$tag] $(awk -v a="$t_kill" -v b="$t_on" 'BEGIN { printf "running with the survivors %.1f s after the kill", b - a }') (step $step, $(job_field "$job" recoveries) recoveries)"
  start_worker "$tag" w2 "$WORK/$tag/cache-w2-newcomer"
  for i in $(seq 1 240); do
    state="$(job_field "$job" state)"; count="$(job_worker_count "$job")"
    [ "$count" = $((n_left + 1)) ] && break
    [ "$state" = completed ] && die "[$tag] job $job completed before the newcomer joined (raise the steps)"
    [ "$state" = failed ] && die "[$tag] job $job failed while the newcomer joined: $(job_field "$job" error)"
    sleep 0.5
  done
  t_grown=$EPOCHREALTIME
  [ "$count" = $((n_left + 1)) ] || die "[$tag] the newcomer on w2 did not join within 120 s: $(keel_user 30 status "$job")"
  log "[$tag] the newcomer joined at step $(job_field "$job" step), $(awk -v a="$t_on" -v b="$t_grown" 'BEGIN { printf "%.1f s", b - a }') after it started"
  # The newcomer runs on w2's host: w2's address in the final ring is the newcomer's.
  finish_long_job "$tag" "$job"
  KILL_TWO_RESULT="kill two of $N_WORKERS: running with $n_left $(awk -v a="$t_kill" -v b="$t_on" 'BEGIN { printf "%.1f s", b - a }') after the kill; a newcomer joined; completed 120/120 steps with $(job_worker_count "$job") workers, $(job_field "$job" recoveries) recoveries"
  log "[$tag] $KILL_TWO_RESULT"
  stop_cluster
}

# ---------------------------------------------------------------------------------------------
log "work dir $WORK"
setup_network
check_plumbing

if [ "$NETEM" = 1 ]; then
  detect_shaping
  read -r rtt_plain gbit_plain <<<"$(probe_link)"
  apply_shaping
  read -r rtt_shaped gbit_shaped <<<"$(probe_link)"
  log "link user->coordinator: connect ${rtt_plain} ms, ${gbit_plain} Gbit/s plain;" \
    "connect ${rtt_shaped} ms, ${gbit_shaped} Gbit/s under '$SHAPING'"
  # The shaping must show: at most ~the rate (tbf and netem), and >= 2 ms round trip (netem).
  python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= 1.2 * float(sys.argv[2]) else 1)' "$gbit_shaped" "$RATE_GBIT" \
    || die "shaping applied but throughput is ${gbit_shaped} Gbit/s (expected <= $RATE_GBIT Gbit/s)"
  if [[ "$SHAPING" == netem* ]]; then
    python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) >= 1.5 else 1)' "$rtt_shaped" \
      || die "netem applied but connect time is ${rtt_shaped} ms (expected >= 2 ms round trip)"
  fi
  remove_shaping
fi

if [ "$PLUMBING_ONLY" = 1 ]; then
  log "plumbing only: Keel job skipped"
  exit 0
fi

run_job plain
result_plain="$STEP_RESULT"
if [ "$SLURM" = 1 ]; then
  run_slurm
fi
if [ "$LINK_CUT" = 1 ]; then
  run_link_cut
fi
if [ "$NETEM" = 1 ]; then
  apply_shaping
  run_job shaped
  result_shaped="$STEP_RESULT"
fi
# Under the shaping when --netem is on.
if [ "$KILL_TWO" = 1 ]; then
  run_kill_two
fi
if [ "$NETEM" = 1 ]; then
  log "RESULT plain links: $result_plain"
  log "RESULT links shaped by '$SHAPING': $result_shaped"
else
  log "RESULT: $result_plain"
fi
if [ "$LINK_CUT" = 1 ]; then
  log "RESULT $LINK_CUT_RESULT"
fi
if [ "$KILL_TWO" = 1 ]; then
  log "RESULT $KILL_TWO_RESULT"
fi
log "RESULT $N_WORKERS worker hosts, gradients as $ALLREDUCE_DTYPE on the ring"
