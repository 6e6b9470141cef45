#!/usr/bin/env python3
"""Structural checks of Keel's deployment files, run by scripts/validate-deploy.sh.

Each subcommand checks one kind of file against what Keel needs from it (not only that it
parses) and prints one `ok:` line per passed check and one `error:` line per failure; the exit
status is 1 when any check failed.

# Layout
- `CONTRACT_FLAGS`, `CONTRACT_ENV`: the command lines and environment variables the Keel
  binaries promise (deploy/README.md); every file is checked against them, and against the
  binaries' own `--help` when built ones are given.
- `check_systemd`, `check_compose`, `check_dockerfile`, `check_k8s`, `check_slurm`: one per kind
  (`compose` also checks deploy/docker/example-job.toml against docs/job-file.md's keys).
- `check_monitoring`: the Grafana dashboard and the Prometheus scrape configuration use only the
  metric names in deploy/grafana/metric-names.txt (the one list of them; the programs must serve
  exactly these); `check_promtool`: the same files through Prometheus' promtool.
- `check_flags`: every flag and KEEL_* variable the files pass to a Keel program.
- `check_runtime_libs`: the shared libraries of built binaries come from the runtime image's packages.
- `check_health`: built servers answer the gRPC health service the Kubernetes probes call.

Needs Python 3.9+ and PyYAML (Debian: python3-yaml). `k8s --typed` also needs the `kubernetes`
Python client 37 (pydantic models that reject unknown fields).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

# The programs' documented command lines; `keel` is keyed by subcommand.
CONTRACT_FLAGS: dict[str, set[str]] = {
    "keel-coordinator": {
        "--listen",
        "--data-dir",
        "--input-root",
        "--token-file",
        "--tls-cert",
        "--tls-key",
        "--log",
        "--metrics-listen",  # HTTP port for /metrics and the dashboard
    },
    "keel-worker": {
        "--coordinator",
        "--listen",
        "--advertise-addr",
        "--threads",
        "--io-threads",  # threads of the network runtime
        "--cache-dir",
        "--token-file",
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
        "--log",
        "--metrics-listen",  # HTTP port for /metrics
    },
    "keel submit": set(),
    "keel jobs": set(),
    "keel status": set(),
    "keel watch": set(),
    "keel cancel": set(),
    "keel pull": {"--out", "--step"},
    "keel local": {"--workers", "--out"},
}
# Environment variables the binaries read (one per flag).
CONTRACT_ENV = {
    "KEEL_LISTEN",
    "KEEL_DATA_DIR",
    "KEEL_COORDINATOR",
    "KEEL_ADVERTISE_ADDR",
    "KEEL_THREADS",
    "KEEL_IO_THREADS",  # --io-threads (worker): threads of the network runtime, default 1
    "KEEL_CACHE_DIR",
    "KEEL_TOKEN_FILE",
    "KEEL_TLS_CERT",  # optional TLS: server certificate chain (PEM)
    "KEEL_TLS_KEY",  # its private key
    "KEEL_TLS_CA",  # the CA clients trust
    "KEEL_LOG",  # the log filter (tracing EnvFilter syntax)
    "KEEL_INPUT_ROOT",  # the coordinator's --input-root: the folders jobs may read
    "KEEL_METRICS_LISTEN",  # --metrics-listen (coordinator and worker): the HTTP port, off when unset
}
# KEEL_* names the deployment files define for themselves, never read by a binary.
DEPLOY_OWN_ENV = {
    "KEEL_COORDINATOR_LISTEN",  # systemd: coordinator's --listen
    "KEEL_WORKER_LISTEN",  # systemd: worker's --listen
    "KEEL_COORDINATOR_METRICS_LISTEN",  # systemd: coordinator's --metrics-listen
    "KEEL_WORKER_METRICS_LISTEN",  # systemd: worker's --metrics-listen
    "KEEL_CORPUS_DIR",  # compose: host folder mounted at /corpus
    "KEEL_JOBS_DIR",  # compose: host folder mounted at /jobs
    "KEEL_OUT_DIR",  # compose: host folder mounted at /out
    "KEEL_COORDINATOR_PUBLISH",  # compose: host address:port the coordinator's 7070 is published on
    "KEEL_METRICS_PUBLISH",  # compose: host address:port the coordinator's 9470 is published on
    "KEEL_WORKER_THREADS",  # compose: each worker's --threads and CPU limit
    "KEEL_BIN_DIR",  # slurm: where the binaries are
    "KEEL_IFACE",  # slurm: interface whose address is advertised
    "KEEL_WORKER_BIN",  # slurm: the worker's path, passed to srun tasks
    "KEEL_SLURM_DATA_DIR",  # slurm: the coordinator's data folder (kept when set)
}
DEPLOY_OWN_ENV_PREFIXES = ("KEEL_SLURM_", "KEEL_MH_", "KEEL_VALIDATE_")

# Packages a debian:bookworm-slim image already has that a Rust binary may link.
SLIM_BASE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}
# Pulled in by libgfortran5 (a Depends), so present whenever it is.
# libdnnl2 (oneDNN, the bf16 GEMMs) depends on libgomp1 and an OpenCL loader.
IMPLIED_PACKAGES = {
    "libgfortran5": {"libquadmath0"},
    "libdnnl2": {"libgomp1", "ocl-icd-libopencl1"},
}


class Report:
    """Collects the outcome of each check; `errors` decides the exit status."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.errors = 0

    def ok(self, msg: str) -> None:
        print(f"  ok: {msg}")

    def error(self, msg: str) -> None:
        print(f"  error: {msg}")
        self.errors += 1

    def check(self, cond: bool, msg: str, why: str = "") -> bool:
        if cond:
            self.ok(msg)
        else:
            self.error(msg + (f" ({why})" if why else ""))
        return cond


class QuietReport(Report):
    """A Report for checks run only for their result (their lines are printed elsewhere)."""

    def ok(self, msg: str) -> None:
        pass

    def error(self, msg: str) -> None:
        self.errors += 1


# ------------------------------------------------------------------------------------------
# systemd


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Parses a unit file into section -> key -> values (in order; keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        if current is None or "=" not in line:
            raise ValueError(f"{path}:{lineno}: expected [Section] or Key=Value, got {raw!r}")
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def parse_env_file(path: Path, rep: Report) -> dict[str, str]:
    """Parses a systemd EnvironmentFile (KEY=value lines)."""
    env: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if not m:
            rep.error(f"{path}:{lineno}: not KEY=value: {raw!r}")
            continue
        env[m.group(1)] = m.group(2)
    return env


def check_systemd(root: Path, rep: Report) -> None:
    d = root / "deploy/systemd"
    env_file = parse_env_file(d / "keel.env", rep)
    for key in env_file:
        if key.startswith("KEEL_"):
            rep.check(
                key in CONTRACT_ENV or key in DEPLOY_OWN_ENV,
                f"keel.env: {key} is a variable Keel or the units read",
            )
    for key in ("KEEL_COORDINATOR", "KEEL_ADVERTISE_ADDR", "KEEL_TOKEN_FILE"):
        rep.check(key in env_file, f"keel.env sets {key} (a worker cannot start without it)")
    rep.check(
        env_file.get("KEEL_INPUT_ROOT", "").startswith("/"),
        "keel.env sets KEEL_INPUT_ROOT (the folders jobs may read) to an absolute path",
    )
    sysusers = (d / "keel.sysusers").read_text().split()
    sysuser = sysusers[sysusers.index("u") + 1] if "u" in sysusers else None

    units = {
        "keel-coordinator.service": ("keel-coordinator", "StateDirectory"),
        "keel-worker.service": ("keel-worker", "CacheDirectory"),
    }
    for name, (program, state_key) in units.items():
        unit = parse_unit(d / name)
        svc = unit.get("Service", {})
        one = lambda k: (svc.get(k) or [None])[-1]  # noqa: E731 - last assignment wins
        rep.check(one("User") == sysuser, f"{name}: User={one('User')} is the sysusers user {sysuser}")
        rep.check(one("NoNewPrivileges") == "yes", f"{name}: NoNewPrivileges=yes")
        rep.check(one("ProtectSystem") == "strict", f"{name}: ProtectSystem=strict")
        rep.check(one("Restart") == "on-failure", f"{name}: Restart=on-failure")
        rep.check(bool(one(state_key)), f"{name}: {state_key}= gives it a writable directory")
        rep.check(
            "/etc/keel/keel.env" in svc.get("EnvironmentFile", []),
            f"{name}: EnvironmentFile=/etc/keel/keel.env",
        )
        rep.check(
            unit.get("Install", {}).get("WantedBy") == ["multi-user.target"],
            f"{name}: WantedBy=multi-user.target",
        )
        exec_start = shlex.split(one("ExecStart") or "")
        rep.check(
            bool(exec_start) and exec_start[0] == f"/usr/local/bin/{program}",
            f"{name}: ExecStart runs /usr/local/bin/{program}",
        )
        defined = set(env_file)
        for assignment in svc.get("Environment", []):
            for word in shlex.split(assignment):
                defined.add(word.split("=", 1)[0])
        for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", one("ExecStart") or ""):
            rep.check(var in defined, f"{name}: ExecStart's ${{{var}}} is defined by Environment= or keel.env")
        # The HTTP port is on by default only on loopback: the dashboard's API answers there without
        # the token, and /metrics always does (the HTTP port's contract).
        metrics = flag_value(exec_start, "--metrics-listen")
        if metrics is not None:
            m = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", metrics)
            defaults = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in svc.get("Environment", []) if "=" in w}
            values = [("ExecStart", metrics)] if not m else [
                ("the unit's default", defaults.get(m.group(1))), ("keel.env", env_file.get(m.group(1)))
            ]  # fmt: skip
            for src, v in values:
                if v is not None:
                    rep.check(is_loopback_addr(v), f"{name}: --metrics-listen {v} ({src}) is a loopback address")
        # The directory the program is told to write to must be the one systemd makes writable.
        writable = {f"/var/lib/{v}" for v in svc.get("StateDirectory", [])}
        writable |= {f"/var/cache/{v}" for v in svc.get("CacheDirectory", [])}
        dir_var = "KEEL_DATA_DIR" if program == "keel-coordinator" else "KEEL_CACHE_DIR"
        dir_default = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in svc.get("Environment", []) if "=" in w}
        rep.check(
            dir_default.get(dir_var) in writable,
            f"{name}: {dir_var}={dir_default.get(dir_var)} is writable under ProtectSystem=strict",
            f"writable: {sorted(writable)}",
        )


# ------------------------------------------------------------------------------------------
# Docker


def dockerfile_instructions(path: Path) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[int, str, str]] = []
    pending, start = "", 0
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are skipped by Docker too
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((start, word.upper(), rest.strip()))
    return out


DOCKER_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER",
}  # fmt: skip


def apt_packages(run_args: str) -> set[str]:
    """Packages named by `apt-get install` in one RUN instruction."""
    pkgs: set[str] = set()
    for part in re.split(r"&&|;|\|\|", run_args):
        words = part.split()
        if len(words) >= 2 and words[0] in ("apt-get", "apt") and "install" in words:
            after = words[words.index("install") + 1 :]
            pkgs |= {w for w in after if not w.startswith("-")}
    return pkgs


def check_dockerfile(root: Path, rep: Report) -> set[str]:
    """Checks deploy/docker/Dockerfile; returns the runtime stage's apt packages."""
    path = root / "deploy/docker/Dockerfile"
    instrs = dockerfile_instructions(path)
    for lineno, word, _ in instrs:
        if word not in DOCKER_INSTRUCTIONS:
            rep.error(f"Dockerfile:{lineno}: unknown instruction {word}")
    stages: list[list[tuple[int, str, str]]] = []
    for ins in instrs:
        if ins[1] == "FROM":
            stages.append([])
        if not stages:
            rep.error(f"Dockerfile:{ins[0]}: {ins[1]} before the first FROM")
            continue
        stages[-1].append(ins)
    if not rep.check(len(stages) >= 2, f"Dockerfile is multi-stage ({len(stages)} stages)"):
        return set()
    builder, runtime = stages[0], stages[-1]
    rep.check(
        re.fullmatch(r"rust:1-bookworm\s+AS\s+builder", builder[0][2], re.I) is not None,
        f"Dockerfile: builder stage is rust:1-bookworm AS builder (got {builder[0][2]!r})",
    )
    rep.check(
        re.fullmatch(r"debian:bookworm-slim\s+AS\s+runtime", runtime[0][2], re.I) is not None,
        f"Dockerfile: runtime stage is debian:bookworm-slim AS runtime (got {runtime[0][2]!r})",
    )
    # A `# syntax=` directive makes BuildKit pull a frontend image: impossible without a registry,
    # and not needed (the built-in frontend knows RUN --mount).
    first = path.read_text().splitlines()[:1]
    rep.check(
        not (first and re.match(r"#\s*syntax\s*=", first[0], re.I)),
        "Dockerfile: no `# syntax=` line (BuildKit's built-in frontend; no registry needed for it)",
    )
    build_pkgs = set().union(*(apt_packages(a) for _, w, a in builder if w == "RUN"))
    rep.check("libopenblas-dev" in build_pkgs, "Dockerfile: builder installs libopenblas-dev")
    rep.check("libdnnl-dev" in build_pkgs, "Dockerfile: builder installs libdnnl-dev (oneDNN, bf16 GEMMs)")
    runs = [a for _, w, a in runtime if w == "RUN"]
    runtime_pkgs = set().union(*(apt_packages(a) for a in runs))
    allowed = {"libopenblas0-pthread", "libgfortran5", "libdnnl2", "libgomp1", "ca-certificates"}
    rep.check(
        {"libopenblas0-pthread", "libdnnl2", "ca-certificates"} <= runtime_pkgs <= allowed,
        f"Dockerfile: runtime installs only OpenBLAS and oneDNN runtimes + CA certificates ({sorted(runtime_pkgs)})",
        f"allowed: {sorted(allowed)}",
    )
    for a in runs:
        if apt_packages(a):
            rep.check("--no-install-recommends" in a, "Dockerfile: runtime apt-get uses --no-install-recommends")
            rep.check("rm -rf /var/lib/apt/lists" in a, "Dockerfile: runtime apt lists removed in the same layer")
    users = [a for _, w, a in runtime if w == "USER"]
    rep.check(
        bool(users) and users[-1].split(":")[0] not in ("root", "0"),
        f"Dockerfile: runtime runs as a non-root USER ({users[-1] if users else 'none'})",
    )
    copies = " ".join(a for _, w, a in runtime if w == "COPY")
    rep.check("--from=builder" in copies, "Dockerfile: runtime copies the binaries from the builder")
    builder_text = " ".join(a for _, _, a in builder)
    for program in ("keel", "keel-coordinator", "keel-worker"):
        rep.check(
            re.search(rf"target/release/{program}(\s|$)", builder_text) is not None,
            f"Dockerfile: the builder installs target/release/{program}",
        )
    for pkg in ("keel-coordinator", "keel-worker", "keel-cli"):
        rep.check(f"-p {pkg}" in builder_text, f"Dockerfile: cargo builds package {pkg}")
    ignore = (root / "deploy/docker/Dockerfile.dockerignore").read_text().split()
    rep.check("target" in ignore, "Dockerfile.dockerignore keeps target/ out of the build context")
    return runtime_pkgs


def check_compose(root: Path, rep: Report) -> None:
    path = root / "deploy/docker/compose.yaml"
    doc = yaml.safe_load(path.read_text())
    services = doc.get("services", {})
    rep.check("coordinator" in services, "compose: has a coordinator service")
    workers = sorted(s for s in services if s.startswith("worker"))
    rep.check(len(workers) == 3, f"compose: three worker services ({workers})")
    coord = services.get("coordinator", {})
    cmd = coord.get("command", [])
    rep.check(cmd[:1] == ["keel-coordinator"], "compose: coordinator runs keel-coordinator")
    data_dir = flag_value(cmd, "--data-dir")
    vols = [v.split(":") for v in coord.get("volumes", []) if isinstance(v, str)]
    input_root = flag_value(cmd, "--input-root")
    # SOURCE:TARGET:MODE, where SOURCE may hold ${VAR:-default}.
    mounts = [v.rsplit(":", 2) for v in coord.get("volumes", []) if isinstance(v, str)]
    rep.check(
        any(len(m) == 3 and m[1] == input_root and m[2] == "ro" for m in mounts),
        f"compose: coordinator's --input-root {input_root} is a read-only mount",
    )
    named = [v for v in vols if len(v) >= 2 and v[1] == data_dir]
    rep.check(
        bool(named) and named[0][0] in (doc.get("volumes") or {}),
        f"compose: coordinator's --data-dir {data_dir} is a named volume",
    )
    build = coord.get("build", {})
    dockerfile = (path.parent / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve()
    rep.check(dockerfile == (root / "deploy/docker/Dockerfile").resolve(), f"compose: coordinator builds {dockerfile}")
    images = {s.get("image") for s in services.values()}
    rep.check(len(images) == 1, f"compose: every service uses the one image ({images})")
    for name in workers:
        wcmd = services[name].get("command", [])
        rep.check(wcmd[:1] == ["keel-worker"], f"compose: {name} runs keel-worker")
        rep.check(flag_value(wcmd, "--advertise-addr") == f"{name}:7071", f"compose: {name} advertises {name}:7071")
        rep.check(flag_value(wcmd, "--coordinator") == "coordinator:7070", f"compose: {name} joins coordinator:7070")
        rep.check(
            "coordinator" in (services[name].get("depends_on") or {}),
            f"compose: {name} starts after the coordinator",
        )
    # The HTTP ports (--metrics-listen): the coordinator's published, the workers' exposed.
    metrics = flag_value(cmd, "--metrics-listen")
    if rep.check(metrics is not None, "compose: coordinator has --metrics-listen"):
        _, port = split_host_port(metrics)
        published = [str(p).rsplit(":", 1)[-1] for p in coord.get("ports", [])]
        rep.check(str(port) in published, f"compose: coordinator's --metrics-listen {metrics} port is published ({published})")
    for name in workers:
        wmetrics = flag_value(services[name].get("command", []), "--metrics-listen")
        if rep.check(wmetrics is not None, f"compose: {name} has --metrics-listen"):
            _, port = split_host_port(wmetrics)
            exposed = [str(p) for p in services[name].get("expose", [])]
            rep.check(str(port) in exposed, f"compose: {name}'s --metrics-listen {wmetrics} port is exposed ({exposed})")


def job_file_keys(root: Path) -> dict[str, set[str]]:
    """The keys of each job-file section, from docs/job-file.md's tables (generated from the code)."""
    keys: dict[str, set[str]] = {}
    section = None
    for line in (root / "docs/job-file.md").read_text().splitlines():
        m = re.fullmatch(r"### `\[+(\w+)\]+`", line)
        if m:
            section = keys.setdefault(m.group(1), set())
        elif line.startswith("## "):
            section = None
        elif section is not None:
            m = re.match(r"\| `(\w+)` \|", line)
            if m:
                section.add(m.group(1))
    return keys


def check_example_job(root: Path, rep: Report) -> None:
    """deploy/docker/example-job.toml parses, uses only documented keys, reads its corpus inside
    the coordinator's --input-root and asks for no more workers than compose.yaml runs."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        print("  skip: example-job.toml: no tomllib (Python 3.11+)")
        return
    path = root / "deploy/docker/example-job.toml"
    try:
        job = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        rep.error(f"example-job.toml: not TOML: {e}")
        return
    rep.ok("example-job.toml parses (TOML)")
    documented = job_file_keys(root)
    rep.check({"data", "model", "train"} <= set(documented), f"docs/job-file.md documents the sections ({sorted(documented)})")
    for section, table in job.items():
        rows = table if isinstance(table, list) else [table]
        for row in rows:
            unknown = sorted(set(row) - documented.get(section, set()))
            rep.check(
                section in documented and not unknown,
                f"example-job.toml: [{section}] {', '.join(sorted(row))} are keys of docs/job-file.md",
                f"unknown: {unknown or section}",
            )
    compose = yaml.safe_load((root / "deploy/docker/compose.yaml").read_text())
    services = compose.get("services", {})
    input_root = flag_value(services.get("coordinator", {}).get("command", []), "--input-root") or ""
    for corpus in job.get("data", {}).get("corpus", []):
        rep.check(
            corpus.startswith(input_root.rstrip("/") + "/"),
            f"example-job.toml: corpus {corpus} is inside the coordinator's --input-root {input_root}",
        )
    workers = len([s for s in services if s.startswith("worker")])
    cluster = job.get("cluster", {})
    lo, hi = cluster.get("min_workers", 1), cluster.get("max_workers", 1)
    rep.check(
        1 <= lo <= hi <= workers,
        f"example-job.toml: min_workers {lo} <= max_workers {hi} <= the {workers} workers of compose.yaml",
    )


def split_host_port(addr: str) -> tuple[str, int | None]:
    """`host:port` or `[v6]:port` -> (host, port); port None when absent or not a number."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        return addr.strip("[]"), None
    return host.strip("[]"), int(port)


def is_loopback_addr(addr: str) -> bool:
    """Whether a listen address `host:port` can be reached only from its own machine."""
    host, _ = split_host_port(addr)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def flag_value(cmd: list[str], flag: str) -> str | None:
    for i, word in enumerate(cmd):
        if word == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


# ------------------------------------------------------------------------------------------
# Kubernetes


def load_k8s(root: Path) -> tuple[list[tuple[str, dict]], dict]:
    d = root / "deploy/k8s"
    kust = yaml.safe_load((d / "kustomization.yaml").read_text())
    docs: list[tuple[str, dict]] = []
    for res in kust.get("resources", []) + ["secret.example.yaml"]:
        for doc in yaml.safe_load_all((d / res).read_text()):
            if doc:
                docs.append((res, doc))
    return docs, kust


def container_env_names(container: dict, configmaps: dict[str, dict]) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef", {}).get("name")
        names |= set((configmaps.get(ref) or {}).get("data", {}))
    return names


def check_pod(kind: str, name: str, pod: dict, ctx: dict, rep: Report) -> None:
    spec = pod.get("spec", {})
    sc = spec.get("securityContext", {})
    rep.check(sc.get("runAsNonRoot") is True, f"{kind}/{name}: runAsNonRoot")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for vname, vol in volumes.items():
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            rep.check(claim in ctx["pvcs"], f"{kind}/{name}: volume {vname} claims existing PVC {claim}")
        if "secret" in vol:
            secret = vol["secret"]["secretName"]
            rep.check(secret in ctx["secrets"], f"{kind}/{name}: volume {vname} uses Secret {secret} (secret.example.yaml)")
    for c in spec.get("containers", []):
        cname = f"{kind}/{name}/{c['name']}"
        ports = {p["containerPort"] for p in c.get("ports", [])}
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe == "startupProbe" and probe not in c:
                continue
            grpc = (c.get(probe) or {}).get("grpc")
            rep.check(
                grpc is not None and grpc.get("port") in ports,
                f"{cname}: {probe} is a native grpc probe on a container port {sorted(ports)}",
            )
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            rep.check(
                {"cpu", "memory"} <= set(res.get(part, {})),
                f"{cname}: resources.{part} has cpu and memory",
            )
        csc = c.get("securityContext", {})
        rep.check(csc.get("allowPrivilegeEscalation") is False, f"{cname}: allowPrivilegeEscalation false")
        for m in c.get("volumeMounts", []):
            rep.check(m["name"] in volumes, f"{cname}: mount {m['name']} has a volume")
        for src in c.get("envFrom", []):
            ref = src.get("configMapRef", {}).get("name")
            if ref:
                rep.check(ref in ctx["configmaps"], f"{cname}: envFrom ConfigMap {ref} exists")
        env_names = container_env_names(c, ctx["configmaps"])
        for word in c.get("command", []) + c.get("args", []):
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", word):
                rep.check(var in env_names, f"{cname}: $({var}) in args is defined in env")
        # A variable referenced by another env entry must come earlier in the list.
        seen: set[str] = set(env_names - {e["name"] for e in c.get("env", [])})
        for e in c.get("env", []):
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(e.get("value", ""))):
                rep.check(var in seen, f"{cname}: env {e['name']} uses $({var}) defined before it")
            seen.add(e["name"])


def check_scrape_annotations(kind: str, name: str, pod: dict, rep: Report) -> None:
    """Prometheus' pod annotations (read by deploy/prometheus/prometheus.yml's kubernetes_sd job)
    agree with the container port named `metrics` and with the port of --metrics-listen."""
    ann = pod.get("metadata", {}).get("annotations") or {}
    where = f"{kind}/{name}"
    if not rep.check(ann.get("prometheus.io/scrape") == "true", f'{where}: annotation prometheus.io/scrape: "true"'):
        return
    rep.check(ann.get("prometheus.io/path") == "/metrics", f"{where}: annotation prometheus.io/path: /metrics")
    port = ann.get("prometheus.io/port")
    rep.check(isinstance(port, str) and port.isdigit(), f"{where}: annotation prometheus.io/port {port!r} is a port number (a string)")
    port = str(port)
    c = pod["spec"]["containers"][0]
    cports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    rep.check(str(cports.get("metrics")) == port, f"{where}: container port `metrics` {cports.get('metrics')} is the annotation's {port}")
    listen = flag_value(c.get("command", []) + c.get("args", []), "--metrics-listen")
    if rep.check(listen is not None, f"{where}: {c['name']} runs with --metrics-listen"):
        _, lport = split_host_port(listen)
        rep.check(str(lport) == port, f"{where}: --metrics-listen {listen} serves the annotation's port {port}")
        rep.check(not is_loopback_addr(listen), f"{where}: --metrics-listen {listen} is reachable from Prometheus (not loopback)")


def check_k8s(root: Path, rep: Report, typed: bool) -> None:
    docs, kust = load_k8s(root)
    for res in kust.get("resources", []):
        rep.check((root / "deploy/k8s" / res).is_file(), f"kustomization: resource {res} exists")
    for src, doc in docs:
        rep.check(
            all(k in doc for k in ("apiVersion", "kind", "metadata")) and "name" in doc["metadata"],
            f"{src}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')} has apiVersion, kind, metadata.name",
        )
    by_kind: dict[str, dict[str, dict]] = {}
    for _, doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    for kind in ("Namespace", "ConfigMap", "PersistentVolumeClaim", "Service", "Deployment", "StatefulSet", "Secret"):
        rep.check(kind in by_kind, f"k8s: has a {kind}")
    ctx = {
        "pvcs": by_kind.get("PersistentVolumeClaim", {}),
        "secrets": by_kind.get("Secret", {}),
        "configmaps": by_kind.get("ConfigMap", {}),
    }
    for cm in ctx["configmaps"].values():
        for key in cm.get("data", {}):
            rep.check(key in CONTRACT_ENV, f"ConfigMap/{cm['metadata']['name']}: {key} is a Keel variable")
    services = by_kind.get("Service", {})

    def selected_by(svc: dict, workload: dict) -> bool:
        labels = workload["spec"]["template"]["metadata"].get("labels", {})
        sel = svc["spec"].get("selector", {})
        return bool(sel) and all(labels.get(k) == v for k, v in sel.items())

    for kind in ("Deployment", "StatefulSet"):
        for name, wl in by_kind.get(kind, {}).items():
            labels = wl["spec"]["template"]["metadata"].get("labels", {})
            match = wl["spec"]["selector"].get("matchLabels", {})
            rep.check(
                all(labels.get(k) == v for k, v in match.items()),
                f"{kind}/{name}: selector matches the pod template's labels",
            )
            rep.check(
                any(selected_by(s, wl) for s in services.values()),
                f"{kind}/{name}: a Service selects its pods",
            )
            check_pod(kind, name, wl["spec"]["template"], ctx, rep)
            check_scrape_annotations(kind, name, wl["spec"]["template"], rep)
    # A Service's named targetPort is a port of the containers it selects.
    for sname, svc in services.items():
        pods = [wl for kind in ("Deployment", "StatefulSet") for wl in by_kind.get(kind, {}).values() if selected_by(svc, wl)]
        names = {p.get("name") for wl in pods for c in wl["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort")
            if isinstance(target, str):
                rep.check(target in names, f"Service/{sname}: targetPort {target} is a named port of its pods", f"have {sorted(names)}")

    for name, dep in by_kind.get("Deployment", {}).items():
        c = dep["spec"]["template"]["spec"]["containers"][0]
        rep.check(c.get("command", [None])[0] == "keel-coordinator", f"Deployment/{name} runs keel-coordinator")
        # The input root lies on a mounted volume and is made before the coordinator starts.
        pod = dep["spec"]["template"]["spec"]
        root = flag_value(c.get("command", []) + c.get("args", []), "--input-root") or ""
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        rep.check(
            any(root == m or root.startswith(m.rstrip("/") + "/") for m in mounts),
            f"Deployment/{name}: --input-root {root or '(none)'} lies on a mounted volume",
        )
        rep.check(
            any(root in (i.get("command", []) + i.get("args", [])) for i in pod.get("initContainers", [])),
            f"Deployment/{name}: an init container makes the input root {root} on a fresh volume",
        )
        for i in pod.get("initContainers", []):
            isc = i.get("securityContext", {})
            rep.check(
                isc.get("allowPrivilegeEscalation") is False and isc.get("capabilities", {}).get("drop") == ["ALL"],
                f"Deployment/{name}/{i['name']}: init container meets the restricted Pod Security Standard",
            )
    for name, sts in by_kind.get("StatefulSet", {}).items():
        svc_name = sts["spec"].get("serviceName")
        svc = services.get(svc_name, {})
        rep.check(svc.get("spec", {}).get("clusterIP") == "None", f"StatefulSet/{name}: serviceName {svc_name} is a headless Service")
        rep.check(bool(svc) and selected_by(svc, sts), f"StatefulSet/{name}: headless Service {svc_name} selects its pods")
        c = sts["spec"]["template"]["spec"]["containers"][0]
        words = c.get("command", []) + c.get("args", [])
        rep.check(words[:1] == ["keel-worker"], f"StatefulSet/{name} runs keel-worker")
        advertise = flag_value(words, "--advertise-addr") or ""
        want = f"$(POD_NAME).{svc_name}.$(POD_NAMESPACE).svc.cluster.local:7071"
        rep.check(advertise == want, f"StatefulSet/{name}: --advertise-addr {advertise}", f"want {want}")
        env = {e["name"]: e for e in c.get("env", [])}
        rep.check(
            env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name"
            and env.get("POD_NAMESPACE", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            == "metadata.namespace",
            f"StatefulSet/{name}: POD_NAME and POD_NAMESPACE come from the downward API",
        )
        threads = flag_value(words, "--threads") or ""
        m = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", threads)
        ref = env.get(m.group(1), {}).get("valueFrom", {}).get("resourceFieldRef", {}) if m else {}
        rep.check(
            ref.get("resource") == "limits.cpu" and ref.get("containerName") == c["name"],
            f"StatefulSet/{name}: --threads {threads} is the container's CPU limit",
        )
    if typed:
        import kubernetes.client as kc  # the pinned client: pydantic models, extra fields forbidden

        for src, doc in docs:
            model = getattr(kc, "V1" + doc["kind"], None)
            if model is None or doc["apiVersion"] not in ("v1", "apps/v1"):
                rep.error(f"{src}: no typed model for {doc['apiVersion']} {doc['kind']}")
                continue
            try:
                model.model_validate(doc)
                rep.ok(f"{src}: {doc['kind']}/{doc['metadata']['name']} matches the Kubernetes API schema")
            except Exception as e:  # pydantic.ValidationError: every field error listed
                rep.error(f"{src}: {doc['kind']}/{doc['metadata']['name']} does not match the API schema:\n{e}")


# ------------------------------------------------------------------------------------------
# Monitoring: Grafana dashboard, Prometheus scrape configuration, metric names

METRIC_NAMES = "deploy/grafana/metric-names.txt"
DASHBOARD = "deploy/grafana/keel-dashboard.json"
PROMETHEUS_YML = "deploy/prometheus/prometheus.yml"
# A Keel metric name anywhere in a file's text (not inside a longer word).
KEEL_METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])keel_[a-z0-9_]*[a-z0-9](?![A-Za-z0-9_])")
# The ports deploy/ gives --metrics-listen (the HTTP port's contract).
METRICS_PORTS = {"coordinator": 9470, "worker": 9471}
SCRAPE_ANNOTATIONS = {
    f"__meta_kubernetes_pod_annotation_prometheus_io_{a}" for a in ("scrape", "port", "path")
}  # fmt: skip


def load_metric_names(root: Path, rep: Report) -> set[str]:
    """The names in deploy/grafana/metric-names.txt (# comments and blank lines skipped)."""
    names: list[str] = []
    for lineno, raw in enumerate((root / METRIC_NAMES).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not re.fullmatch(r"keel_[a-z0-9_]*[a-z0-9]", line):
            rep.error(f"{METRIC_NAMES}:{lineno}: {line!r} is not a keel_... metric name")
            continue
        names.append(line)
    dups = sorted({n for n in names if names.count(n) > 1})
    rep.check(not dups, f"{METRIC_NAMES}: {len(names)} names, none twice", f"twice: {dups}")
    return set(names)


def dashboard_panels(dash: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = []
    for p in dashboard_panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p.get('id')} {p.get('title')!r} {t.get('refId')}", t.get("expr", "")))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            out.append((f"variable ${v.get('name')}", q.get("query", "") if isinstance(q, dict) else str(q or "")))
    return out


def check_dashboard(root: Path, names: set[str], rep: Report) -> set[str]:
    """Checks the Grafana dashboard; returns the metric names it uses."""
    try:
        dash = json.loads((root / DASHBOARD).read_text())
    except json.JSONDecodeError as e:
        rep.error(f"{DASHBOARD} is not JSON: {e}")
        return set()
    rep.ok(f"{DASHBOARD} parses as JSON")
    rep.check(isinstance(dash.get("schemaVersion"), int) and dash["schemaVersion"] >= 36,
              f"{DASHBOARD}: schemaVersion {dash.get('schemaVersion')} (Grafana 9.4 or later)")  # fmt: skip
    rep.check(bool(dash.get("title")) and bool(dash.get("uid")), f"{DASHBOARD}: has a title and a uid")
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("DS_PROMETHEUS", {})
    rep.check(ds.get("type") == "datasource" and ds.get("query") == "prometheus",
              f"{DASHBOARD}: variable DS_PROMETHEUS picks a Prometheus data source")  # fmt: skip
    job = variables.get("job_id", {})
    q = job.get("query")
    q = q.get("query") if isinstance(q, dict) else q
    rep.check(job.get("type") == "query" and q == "label_values(keel_job_step, job_id)",
              f"{DASHBOARD}: variable job_id is label_values(keel_job_step, job_id)", f"got {q!r}")  # fmt: skip
    panels = dashboard_panels(dash)
    ids = [p.get("id") for p in panels]
    rep.check(len(ids) == len(set(ids)) and None not in ids, f"{DASHBOARD}: {len(ids)} panels with distinct ids")
    want_ds = "${DS_PROMETHEUS}"
    for p in panels:
        where = f"{DASHBOARD}: panel {p.get('id')} {p.get('title')!r}"
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in "hwxy") or g["x"] + g["w"] > 24:
            rep.error(f"{where}: gridPos {g} is not within the 24-column grid")
        if p.get("type") == "row":
            continue
        rep.check(bool(p.get("targets")), f"{where}: has queries")
        sources = [p.get("datasource")] + [t.get("datasource") for t in p.get("targets", [])]
        rep.check(all((s or {}).get("uid") == want_ds for s in sources), f"{where}: queries the {want_ds} data source")
        if p.get("repeat"):
            rep.check(p["repeat"] in variables, f"{where}: repeats over a defined variable ${p['repeat']}")
    for where, expr in dashboard_queries(dash):
        for var in re.findall(r"\$\{?([A-Za-z_]\w*)", expr):
            if not var.startswith("__"):
                rep.check(var in variables, f"{DASHBOARD}: {where}: ${var} is a dashboard variable")
    # Every keel_ name anywhere in the file (queries, descriptions), not only in expressions.
    used = set(KEEL_METRIC_RE.findall((root / DASHBOARD).read_text()))
    for n in sorted(used):
        rep.check(n in names, f"{DASHBOARD}: {n} is in {METRIC_NAMES}")
    rep.check(len(dashboard_queries(dash)) > 0, f"{DASHBOARD}: {len(dashboard_queries(dash))} queries")
    return used


def check_prometheus_yml(root: Path, names: set[str], rep: Report) -> None:
    text = (root / PROMETHEUS_YML).read_text()
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        rep.error(f"{PROMETHEUS_YML} is not YAML: {e}")
        return
    rep.ok(f"{PROMETHEUS_YML} parses as YAML")
    jobs = cfg.get("scrape_configs") or []
    job_names = [j.get("job_name") for j in jobs]
    rep.check(len(job_names) == len(set(job_names)) and None not in job_names,
              f"{PROMETHEUS_YML}: scrape jobs {job_names} have distinct names")  # fmt: skip
    static_ports: dict[int, list[str]] = {}
    k8s_jobs = []
    for j in jobs:
        name = j.get("job_name")
        # Keel labels its series job_id, so Prometheus' own `job` label needs no override.
        rep.check(j.get("honor_labels") is not True, f"{PROMETHEUS_YML}: job {name} leaves honor_labels off (a target may not override Prometheus' labels)")
        rep.check(j.get("metrics_path", "/metrics") == "/metrics", f"{PROMETHEUS_YML}: job {name} scrapes /metrics")
        for sc in j.get("static_configs") or []:
            for target in sc.get("targets") or []:
                _, port = split_host_port(str(target))
                static_ports.setdefault(port, []).append(name)
        if j.get("kubernetes_sd_configs"):
            k8s_jobs.append(j)
    for component, port in METRICS_PORTS.items():
        rep.check(port in static_ports, f"{PROMETHEUS_YML}: a static job scrapes the {component}s' port {port}",
                  f"static ports: {sorted(p for p in static_ports if p)}")  # fmt: skip
    if rep.check(len(k8s_jobs) == 1, f"{PROMETHEUS_YML}: one kubernetes_sd_configs job"):
        j = k8s_jobs[0]
        roles = [sd.get("role") for sd in j["kubernetes_sd_configs"]]
        rep.check(roles == ["pod"], f"{PROMETHEUS_YML}: job {j['job_name']} discovers pods (role: pod)", f"roles {roles}")
        relabels = j.get("relabel_configs") or []
        sources = {s for r in relabels for s in r.get("source_labels", [])}
        for a in sorted(SCRAPE_ANNOTATIONS):
            rep.check(a in sources, f"{PROMETHEUS_YML}: job {j['job_name']} honours {a}")
        keeps = [r for r in relabels if r.get("action") == "keep"]
        rep.check(any("__meta_kubernetes_pod_annotation_prometheus_io_scrape" in r.get("source_labels", [])
                      and r.get("regex") == "true" for r in keeps),
                  f"{PROMETHEUS_YML}: job {j['job_name']} keeps only pods annotated prometheus.io/scrape: 'true'")  # fmt: skip
        targets = {r.get("target_label") for r in relabels}
        rep.check({"__address__", "__metrics_path__"} <= targets,
                  f"{PROMETHEUS_YML}: job {j['job_name']} sets __address__ (port annotation) and __metrics_path__ (path annotation)")  # fmt: skip
    for n in sorted(set(KEEL_METRIC_RE.findall(text))):
        rep.check(n in names, f"{PROMETHEUS_YML}: {n} is in {METRIC_NAMES}")


def check_monitoring(root: Path, rep: Report) -> None:
    names = load_metric_names(root, rep)
    used = check_dashboard(root, names, rep)
    check_prometheus_yml(root, names, rep)
    unused = sorted(names - used)
    if unused:
        print(f"  note: not charted by the dashboard: {', '.join(unused)}")


# Grafana's built-in interval variables, replaced by a duration when the expressions are parsed.
GRAFANA_DURATIONS = {"__rate_interval", "__interval", "__range", "__range_s"}


def check_promtool(root: Path, promtool: Path, rep: Report) -> None:
    """`promtool check config` on prometheus.yml, and every dashboard expression parsed by
    `promtool check rules` (as recording rules, Grafana's variables replaced)."""
    import tempfile

    def run_promtool(*args: str) -> tuple[bool, str]:
        r = subprocess.run([str(promtool), "check", *args], capture_output=True, text=True, timeout=60)
        return r.returncode == 0, (r.stdout + r.stderr).strip()

    with tempfile.TemporaryDirectory() as tmp:
        dash = json.loads((root / DASHBOARD).read_text())
        rules = []
        for p in dashboard_panels(dash):
            for t in p.get("targets", []):
                expr = re.sub(r"\$\{?(\w+)\}?", lambda m: "5m" if m.group(1) in GRAFANA_DURATIONS else ".*", t.get("expr", ""))
                rules.append({"record": f"keel_dashboard:panel{p.get('id')}_{t.get('refId')}", "expr": expr})
        rules_file = Path(tmp) / "dashboard-rules.yml"
        rules_file.write_text(yaml.safe_dump({"groups": [{"name": "keel-dashboard", "rules": rules}]}))
        ok, out = run_promtool("rules", str(rules_file))
        rep.check(ok, f"promtool check rules: the dashboard's {len(rules)} expressions parse as PromQL", out)

        config = root / PROMETHEUS_YML
        ok, out = run_promtool("config", str(config))
        if not ok and "field kubernetes_sd_configs not found" in out:
            # Debian's promtool is built without Kubernetes discovery: check the rest of the job
            # (honor_labels, relabel rules) on a static stand-in target instead.
            print(f"  skip: {promtool} lacks kubernetes_sd_configs (Debian builds it without Kubernetes discovery): "
                  "that block is checked at YAML level only, its job's relabel rules on a static stand-in")  # fmt: skip
            cfg = yaml.safe_load(config.read_text())
            for j in cfg.get("scrape_configs") or []:
                if j.pop("kubernetes_sd_configs", None) is not None:
                    j["static_configs"] = [{"targets": ["stand-in.invalid:9470"]}]
            config = Path(tmp) / "prometheus.yml"
            config.write_text(yaml.safe_dump(cfg))
            ok, out = run_promtool("config", str(config))
        rep.check(ok, f"promtool check config {PROMETHEUS_YML}", out)


# ------------------------------------------------------------------------------------------
# Slurm

SBATCH_OPTIONS = {
    "--job-name", "--nodes", "--ntasks-per-node", "--exclusive", "--time", "--output",
    "--error", "--cpus-per-task", "--partition", "--account", "--mem", "--constraint",
}  # fmt: skip


def check_slurm(root: Path, rep: Report) -> None:
    path = root / "deploy/slurm/keel.sbatch"
    text = path.read_text()
    lines = text.splitlines()
    rep.check(lines[0].startswith("#!"), "keel.sbatch starts with a #! line")
    opts = {}
    for lineno, line in enumerate(lines, 1):
        if line.startswith("#SBATCH"):
            m = re.fullmatch(r"#SBATCH\s+(--[a-z-]+)(?:=(\S+))?\s*", line)
            if not rep.check(m is not None and m.group(1) in SBATCH_OPTIONS, f"keel.sbatch:{lineno}: {line.strip()}"):
                continue
            opts[m.group(1)] = m.group(2)
        elif line.strip() and not line.startswith("#"):
            break  # sbatch stops reading directives at the first command
    rep.check(opts.get("--ntasks-per-node") == "1", "keel.sbatch: one task (worker) per node")
    rep.check(int(opts.get("--nodes") or 0) >= 2, f"keel.sbatch: several nodes (--nodes={opts.get('--nodes')})")
    rep.check("scontrol show hostnames" in text, "keel.sbatch: expands the node list with scontrol")
    rep.check(re.search(r"^srun .*--ntasks-per-node=1", text, re.M) is not None, "keel.sbatch: workers start with srun, one per node")
    rep.check(text.count('"$COORDINATOR_BIN" --listen') == 1, "keel.sbatch: one coordinator")
    coord_line = next((l for l in logical_lines(text) if '"$COORDINATOR_BIN" --listen' in l), "")
    rep.check("--input-root" in coord_line, "keel.sbatch: the coordinator has an --input-root")
    for step in ("submit", "watch", "pull"):
        rep.check(f'"$KEEL" {step}' in text, f"keel.sbatch: runs keel {step}")


# ------------------------------------------------------------------------------------------
# Flags and environment variables


def logical_lines(text: str) -> list[str]:
    out, cur = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
        else:
            out.append(cur + raw)
            cur = ""
    return out


SHELL_PROGRAMS = [
    (re.compile(r"(keel-coordinator|COORDINATOR_BIN)\"?\s"), "keel-coordinator"),
    (re.compile(r"(keel-worker|KEEL_WORKER_BIN)\"?\s"), "keel-worker"),
    (re.compile(r"(\"\$KEEL\"|/keel\"|keel_user\s+\S+)\s+(submit|jobs|status|watch|cancel|pull|local)\b"), None),
]


def used_invocations(root: Path) -> list[tuple[str, str, set[str]]]:
    """(file, program, flags) for every Keel program invocation in the deployment files."""
    found: list[tuple[str, str, set[str]]] = []

    def add(src: str, words: list[str]) -> None:
        prog = os.path.basename(words[0])
        if prog == "keel" and len(words) > 1:
            prog = f"keel {words[1]}"
        flags = {w.split("=", 1)[0] for w in words[1:] if w.startswith("--")}
        found.append((src, prog, flags))

    for unit in sorted((root / "deploy/systemd").glob("*.service")):
        svc = parse_unit(unit).get("Service", {})
        for line in svc.get("ExecStart", []):
            add(str(unit.relative_to(root)), shlex.split(line))
    compose = yaml.safe_load((root / "deploy/docker/compose.yaml").read_text())
    for svc in compose.get("services", {}).values():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd and cmd[0].startswith("keel"):
            add("deploy/docker/compose.yaml", cmd)
    docs, _ = load_k8s(root)
    for src, doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            add(f"deploy/k8s/{src}", c.get("command", []) + c.get("args", []))
    for rel in ("deploy/slurm/keel.sbatch", "scripts/multihost-test.sh"):
        for line in logical_lines((root / rel).read_text()):
            for pattern, prog in SHELL_PROGRAMS:
                m = pattern.search(line)
                if not m:
                    continue
                name = prog or f"keel {m.group(2)}"
                rest = line[m.end() :]
                flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest))
                if flags or prog is None:  # a server's name without flags is not a start of it
                    found.append((rel, name, flags))
                break
    return found


def used_env(root: Path) -> dict[str, set[str]]:
    """KEEL_* names per file."""
    files = [p for p in (root / "deploy").rglob("*") if p.is_file() and p.suffix != ".py" and p.name != "README.md"]
    files += [root / "scripts/multihost-test.sh"]
    out: dict[str, set[str]] = {}
    for p in files:
        names = set(re.findall(r"\bKEEL_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(errors="replace")))
        if names:
            out[str(p.relative_to(root))] = names
    return out


def help_text(binary: Path, *sub: str) -> str | None:
    try:
        r = subprocess.run([str(binary), *sub, "--help"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout + r.stderr if r.returncode == 0 else None


def check_flags(root: Path, bin_dir: Path | None, rep: Report) -> None:
    invocations = used_invocations(root)
    rep.check(len(invocations) >= 10, f"found {len(invocations)} Keel invocations in the files")
    for src, prog, flags in invocations:
        allowed = CONTRACT_FLAGS.get(prog)
        if allowed is None:
            rep.error(f"{src}: {prog} is not a documented Keel command")
            continue
        extra = flags - allowed - {"--help"}
        rep.check(not extra, f"{src}: {prog} {' '.join(sorted(flags))} is in the documented command line", f"unknown: {sorted(extra)}")
    for src, names in used_env(root).items():
        for n in sorted(names):
            rep.check(
                n in CONTRACT_ENV or n in DEPLOY_OWN_ENV or n.startswith(DEPLOY_OWN_ENV_PREFIXES),
                f"{src}: {n} is a documented Keel variable or the file's own",
            )
    if bin_dir is None:
        print("  skip: no binary directory given: flags checked against the documented command lines only")
        return
    helps: dict[str, str | None] = {}
    for prog in sorted({p for _, p, _ in invocations}):
        words = prog.split()
        helps[prog] = help_text(bin_dir / words[0], *words[1:])
    env_seen: set[str] = set()
    for prog, text in helps.items():
        if text:
            env_seen |= set(re.findall(r"\[env:\s*([A-Z_][A-Z0-9_]*)", text))
    for prog, text in sorted(helps.items()):
        contract = CONTRACT_FLAGS[prog]
        if text is None:
            print(f"  skip: {bin_dir / prog.split()[0]} {' '.join(prog.split()[1:])} --help did not run: not built yet")
            continue
        accepted = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
        if contract and not (contract & accepted):
            print(f"  skip: `{prog} --help` shows none of its documented flags: binary not built yet")
            continue
        used = set().union(*(f for _, p, f in invocations if p == prog))
        missing = used - accepted - {"--help"}
        rep.check(not missing, f"{prog} --help accepts {' '.join(sorted(used)) or '(no flags)'}", f"not accepted: {sorted(missing)}")
    if env_seen:
        files_env = set().union(*used_env(root).values())
        for n in sorted(CONTRACT_ENV & files_env):
            if n in env_seen:
                rep.ok(f"the binaries read {n} (clap [env: ...] in --help)")
            else:
                # Not fatal (an unknown variable is ignored), but what it promises does not happen.
                print(f"  skip: {n} is set by the deployment files but no binary's --help lists it: ignored by this build")


def check_runtime_libs(bin_dir: Path, runtime_pkgs: set[str], rep: Report) -> None:
    allowed = set(runtime_pkgs) | SLIM_BASE_PACKAGES
    for pkg in runtime_pkgs:
        allowed |= IMPLIED_PACKAGES.get(pkg, set())
    for prog in ("keel", "keel-coordinator", "keel-worker"):
        binary = bin_dir / prog
        if not binary.is_file():
            print(f"  skip: {binary} not built: its shared libraries are not checked")
            continue
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30).stdout
        for lib, path in re.findall(r"^\s*(\S+) => (\S+)", out, re.M):
            if path == "not":
                rep.error(f"{prog}: {lib} not found")
                continue
            real = os.path.realpath(path)
            owner = ""
            for candidate in (path, real):
                r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
                if r.returncode == 0:
                    owner = r.stdout.split(":")[0]
                    break
            rep.check(owner in allowed, f"{prog}: {lib} comes from {owner or '?'}, installed in the runtime image")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_health(bin_dir: Path, rep: Report) -> None:
    """Kubernetes' grpc probes (deploy/k8s) call grpc.health.v1.Health/Check without a token: both
    servers must answer SERVING, and refuse Keel's own calls without the cluster token. Starts a
    coordinator and a worker on 127.0.0.1 (with a fresh token) and asks them."""
    import tempfile
    import time

    import grpc  # grpcio + grpcio-health-checking, from the tools venv
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with tempfile.TemporaryDirectory() as tmp:
        cport, wport = free_port(), free_port()
        token = os.path.join(tmp, "keel.token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        logs = {n: open(os.path.join(tmp, f"{n}.log"), "w") for n in ("coordinator", "worker")}
        procs = {
            "coordinator": subprocess.Popen(
                [str(bin_dir / "keel-coordinator"), "--listen", f"127.0.0.1:{cport}", "--data-dir", f"{tmp}/data",
                 "--token-file", token],
                stdout=logs["coordinator"], stderr=subprocess.STDOUT,
            ),
            "worker": subprocess.Popen(
                [str(bin_dir / "keel-worker"), "--coordinator", f"127.0.0.1:{cport}", "--listen", f"127.0.0.1:{wport}",
                 "--advertise-addr", f"127.0.0.1:{wport}", "--threads", "1", "--cache-dir", f"{tmp}/cache",
                 "--token-file", token],
                stdout=logs["worker"], stderr=subprocess.STDOUT,
            ),
        }  # fmt: skip
        try:
            for name, port in (("coordinator", cport), ("worker", wport)):
                status, deadline = "no answer", time.monotonic() + 30
                while time.monotonic() < deadline and procs[name].poll() is None:
                    try:
                        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
                        break
                    except grpc.RpcError as e:
                        status = f"{e.code().name} {e.details() or ''}".strip()
                        if e.code() != grpc.StatusCode.UNAVAILABLE:
                            break  # the server answered: retrying will not change it
                        time.sleep(0.3)
                rep.check(
                    status == "SERVING",
                    f"keel-{name} answers grpc.health.v1.Health/Check with SERVING (Kubernetes' grpc probes)",
                    f"got {status}",
                )
            # Everything but health needs the token: a Keel call without one is refused.
            for name, port, method in (
                ("coordinator", cport, "/keel.v1.Coordinator/Ping"),
                ("worker", wport, "/keel.ring.v1.Ring/Push"),
            ):
                try:
                    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                        ch.unary_unary(method)(b"", timeout=3)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                rep.check(
                    code == "UNAUTHENTICATED",
                    f"keel-{name} refuses {method} without the cluster token (UNAUTHENTICATED)",
                    f"got {code}",
                )
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
            for f in logs.values():
                f.close()


# ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "what", choices=["systemd", "docker", "compose", "k8s", "slurm", "flags", "libs", "health", "monitoring", "promtool"]
    )
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2], help="repository root")
    ap.add_argument("--bin-dir", type=Path, help="folder with built keel, keel-coordinator, keel-worker")
    ap.add_argument("--typed", action="store_true", help="k8s: also validate against the kubernetes client's models")
    ap.add_argument("--promtool", type=Path, help="promtool: Prometheus' promtool binary")
    args = ap.parse_args()
    rep = Report(args.what)
    try:
        if args.what == "systemd":
            check_systemd(args.root, rep)
        elif args.what == "docker":
            check_dockerfile(args.root, rep)
        elif args.what == "compose":
            check_compose(args.root, rep)
            check_example_job(args.root, rep)
        elif args.what == "k8s":
            check_k8s(args.root, rep, args.typed)
        elif args.what == "slurm":
            check_slurm(args.root, rep)
        elif args.what == "flags":
            check_flags(args.root, args.bin_dir, rep)
        elif args.what == "monitoring":
            check_monitoring(args.root, rep)
        elif args.what == "promtool":
            if args.promtool is None:
                ap.error("promtool needs --promtool")
            check_promtool(args.root, args.promtool, rep)
        elif args.what == "health":
            if args.bin_dir is None:
                ap.error("health needs --bin-dir")
            check_health(args.bin_dir, rep)
        elif args.what == "libs":
            if args.bin_dir is None:
                ap.error("libs needs --bin-dir")
            pkgs = check_dockerfile(args.root, QuietReport("docker"))
            check_runtime_libs(args.bin_dir, pkgs, rep)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, yaml.YAMLError, subprocess.SubprocessError) as e:
        rep.error(f"{args.what}: could not check: {type(e).__name__}: {e}")
    return 1 if rep.errors else 0


if __name__ == "__main__":
    sys.exit(main())
