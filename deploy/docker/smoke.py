"""Container smoke: the chart's own pods in Docker, exactly as rendered, then what the kind smoke checks.

    deploy/docker/smoke.py                    # deploy/values-kind.yaml, release smoke, namespace gyre
    make smoke                                # the same (after `make images`)
    deploy/docker/smoke.py --clean            # remove what an interrupted smoke left behind

1. Render charts/gyre with the values (and the Prometheus operator's APIs, as the kind workflow installs
   them) and plan every pod as Docker containers (deploy/docker/plan.py says how each Kubernetes rule is
   reproduced). A wiring mistake the plan can see (a Secret key, ConfigMap or volume that does not exist, a
   Service port no pod declares, a root image under runAsNonRoot) fails here, before anything starts.
2. Start every pod at once: its sandbox, its volumes prepared (fsGroup), its init containers in order, then
   its containers; a pod's Service names appear when its readiness probes pass.
3. Wait until every pod is ready: startup probes within their failureThreshold x periodSeconds, no
   container exited more than --max-restarts times (exited containers restart after a back-off).
4. Check what deploy/kind/smoke.sh checks, through published ports (its port-forwards): the OpenAI API
   answers the official `openai` client (models, a chat completion with token ids and a policy version),
   the trainer completes --min-steps RL steps and a later completion is served by trained weights, every
   ServiceMonitor endpoint's /metrics scrapes, every `helm test` pod's command passes, and every startup
   and liveness probe still passes.
5. Tear everything down (containers, networks, volumes, files), on failure and on SIGINT/SIGTERM too.

A failure names the pod and container and says why, with the container's last log lines. Needs a local
Docker daemon (files are bind-mounted from the host, as a kubelet does) and the images the values name
(`make images`); an image that cannot be pulled here is replaced per --image-fallback (Docker Hub's Redis
by Debian's, built by deploy/docker/build.sh), and the output says so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "deploy" / "kind")]
import plan as P  # noqa: E402
import smoke_client  # noqa: E402

LABEL = "dev.gyre.smoke"
MONITORING_APIS = (
    "monitoring.coreos.com/v1",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)
DEFAULT_FALLBACKS = ("redis=gyre-local/redis:7-bookworm",)


class SmokeFailure(Exception):
    def __init__(self, where: str, why: str, logs: str = ""):
        super().__init__(f"{where}: {why}")
        self.where, self.why, self.logs = where, why, logs


def say(text: str) -> None:
    print(text, flush=True)


# ---- docker CLI ----------------------------------------------------------------------------------------


def docker(*args: str, env: dict[str, str] | None = None, timeout: float = 120, check: bool = True) -> str:
    """Run the docker CLI; `env` adds variables to its environment (values for `--env NAME`)."""
    proc = subprocess.run(
        ["docker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env} if env else None,
        stdin=subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ...: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def image_present(ref: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", ref], capture_output=True).returncode == 0


def resolve_images(the_plan: P.Plan, fallbacks: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """rendered image -> local image to run, and what was substituted. Like the kubelet: `Never` must be
    present, `IfNotPresent` is pulled when missing, `Always` is pulled (a local copy serves if that fails)."""
    resolved, notes = {}, []
    for c in [c for pod in the_plan.pods for c in pod.init_containers + pod.containers]:
        if c.image in resolved:
            continue
        present = image_present(c.image)
        if c.pull_policy == "Never" and not present:
            raise SmokeFailure(c.label, f"image {c.image} is not present (imagePullPolicy: Never): run `make images`")
        if present and c.pull_policy != "Always":
            resolved[c.image] = c.image
            continue
        pull = subprocess.run(["docker", "pull", "-q", c.image], capture_output=True, text=True, timeout=600)
        if pull.returncode == 0 or present:
            resolved[c.image] = c.image
            continue
        stand_in = fallbacks.get(c.image.split("@")[0].rsplit("/", 1)[-1].split(":")[0])  # by repository name
        if stand_in and image_present(stand_in):
            resolved[c.image] = stand_in
            notes.append(
                f"{c.image} cannot be pulled here ({pull.stderr.strip().splitlines()[-1][:120]}): {stand_in} stands in"
            )
            continue
        raise SmokeFailure(c.label, f"image {c.image} cannot be pulled: {pull.stderr.strip()[:300]}")
    return resolved, notes


def check_non_root(the_plan: P.Plan, images: dict[str, str]) -> None:
    """runAsNonRoot as the kubelet checks it: the effective user must be numeric and not 0."""
    for c in [c for pod in the_plan.pods for c in pod.init_containers + pod.containers]:
        if not c.run_as_non_root:
            continue
        user = c.user or docker("image", "inspect", "-f", "{{.Config.User}}", images[c.image]).strip()
        uid = user.split(":")[0]
        if not uid.isdigit():
            raise SmokeFailure(
                c.label,
                f"runAsNonRoot, but the image's user {uid or 'root'!r} is not numeric: "
                "the kubelet cannot verify it is not root",
            )
        if int(uid) == 0:
            raise SmokeFailure(c.label, "runAsNonRoot, but it would run as root (uid 0)")


# ---- probes ----------------------------------------------------------------------------------------------


def run_probe(probe: P.Probe, host_port: int | None, container: str) -> tuple[bool, str]:
    """(passed, what happened), from the host: HTTP, TCP and gRPC against the pod's published port (the
    kubelet dials the pod IP on that port), exec with `docker exec` in the container."""
    timeout = probe.timeout_s
    try:
        if probe.action == "http":
            scheme = probe.scheme.lower()
            request = urllib.request.Request(f"{scheme}://127.0.0.1:{host_port}{probe.path}", headers=probe.headers)
            context = ssl._create_unverified_context() if scheme == "https" else None  # the kubelet does not verify
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                return 200 <= response.status < 400, f"GET {probe.path}: HTTP {response.status}"
        if probe.action == "tcp":
            with socket.create_connection(("127.0.0.1", host_port), timeout=timeout):
                return True, f"TCP {probe.port}: open"
        if probe.action == "grpc":
            return grpc_serving(host_port, probe.service, timeout)
        if probe.action == "exec":
            proc = subprocess.run(
                ["docker", "exec", container, *probe.command], capture_output=True, text=True, timeout=timeout + 5
            )
            return proc.returncode == 0, f"exec {probe.command}: exit {proc.returncode} {proc.stderr.strip()[:200]}"
    except urllib.error.HTTPError as error:
        return False, f"GET {probe.path}: HTTP {error.code}"
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"{probe.action} probe on port {probe.port}: {type(error).__name__}: {error}"
    raise P.Unsupported(f"probe {probe}")


def grpc_serving(port: int | None, service: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            return False, f"grpc health: {error.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return status == "SERVING", f"grpc health: {status}"


# ---- running the plan ----------------------------------------------------------------------------------


@dataclass
class Watch:
    """What the monitor knows about one running container."""

    started_at: str = ""
    started: bool = False  # startup probe passed (or none)
    ready: bool = False
    since: float = 0.0  # monotonic time of the current start
    last: str = ""  # the last probe's outcome
    restarts: int = 0
    exits: list[int] = field(default_factory=list)  # exit codes seen
    restart_at: float | None = None  # when an exited container starts again


@dataclass
class Cluster:
    """One smoke run's Docker objects; everything carries the label dev.gyre.smoke=<run id>."""

    the_plan: P.Plan
    images: dict[str, str]
    max_restarts: int = 3
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))

    def __post_init__(self):
        self.names = P.Names(f"gyre-smoke-{self.run_id}", Path(tempfile.mkdtemp(prefix=f"gyre-smoke-{self.run_id}-")))
        os.chmod(self.names.files_root, 0o755)
        self.labels = {LABEL: self.run_id}
        self.host_ports: dict[str, dict[int, int]] = {}  # pod -> container port -> host port
        self.pod_ready: dict[str, bool] = {}
        self.running: dict[str, P.Container] = {}  # docker name -> container (main containers)
        self.watch: dict[str, Watch] = {}
        self.failure: SmokeFailure | None = None
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="pod")
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.stop_monitor = threading.Event()

    # ---- objects shared by pods
    def create_shared(self) -> None:
        label = ["--label", f"{LABEL}={self.run_id}"]
        docker("network", "create", *label, self.names.pod_network)
        for service in self.the_plan.services:
            if not service.publish_not_ready:
                docker("network", "create", *label, self.names.service_network(service.name))
        for volume in self.the_plan.volumes:
            opts = []
            if volume.tmpfs_bytes:
                opts = ["--opt", "type=tmpfs", "--opt", "device=tmpfs", "--opt", f"o=size={volume.tmpfs_bytes}"]
            docker("volume", "create", *label, *opts, self.names.volume(volume.name))
        subpaths = {
            m.volume
            for p in self.the_plan.pods
            for c in p.init_containers + p.containers
            for m in c.mounts
            if m.sub_path and not m.files
        }
        for name in subpaths:  # a subPath of a Docker volume is bind-mounted from the volume's host folder
            self.names.volume_paths[name] = docker(
                "volume", "inspect", "-f", "{{.Mountpoint}}", self.names.volume(name)
            ).strip()
        for volume in self.the_plan.file_volumes:
            self.write_files(volume)

    def write_files(self, volume: P.FileVolume) -> None:
        """A ConfigMap/Secret/projected volume as the kubelet writes it: each key a file with its mode; with an
        fsGroup, owned by root:<fsGroup> and group-readable."""
        root = self.names.files_root / volume.name
        root.mkdir(mode=0o755)
        for rel, (content, mode) in volume.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            path.write_bytes(content)
            if volume.group is not None:
                try:
                    os.chown(path, 0, volume.group)
                    mode |= 0o440
                except PermissionError:  # not root: readable by all instead
                    mode |= 0o444
            os.chmod(path, mode)

    # ---- pods
    def start(self, pods: list[P.Pod]) -> None:
        for pod in pods:
            self.futures[pod.name] = self.pool.submit(self.start_pod, pod)

    def start_pod(self, pod: P.Pod) -> None:
        first_image = self.images[(pod.init_containers or pod.containers)[0].image]
        docker("run", *P.sandbox_args(pod, first_image, self.names, self.labels))
        sandbox = self.names.sandbox(pod.name)
        for service in self.the_plan.services:  # reach every Service; be reached through yours once ready
            if not service.publish_not_ready and service.name not in pod.aliases_when_ready:
                docker("network", "connect", self.names.service_network(service.name), sandbox)
        info = json.loads(docker("inspect", sandbox))[0]["NetworkSettings"]
        pod_ip = info["Networks"][self.names.pod_network]["IPAddress"]
        self.host_ports[pod.name] = {int(k.split("/")[0]): int(v[0]["HostPort"]) for k, v in info["Ports"].items() if v}
        self.prepare_volumes(pod, first_image)
        for c in pod.init_containers:
            self.run_container(c, pod_ip)
            name = self.names.container(pod.name, c.name)
            code = int(docker("wait", name, timeout=24 * 3600).strip() or 1)
            if code != 0:
                raise SmokeFailure(c.label, f"exited with code {code}", tail(name))
        for c in pod.containers:
            self.run_container(c, pod_ip)
            with self.lock:
                self.running[self.names.container(pod.name, c.name)] = c
                self.watch[self.names.container(pod.name, c.name)] = Watch(since=time.monotonic())

    def prepare_volumes(self, pod: P.Pod, image: str) -> None:
        """What the kubelet does to a pod's volumes before its containers start: emptyDir 0777; with an
        fsGroup, group ownership (setgid) of emptyDirs and claims (OnRootMismatch: only when the root differs)."""
        script, mounts = [], []
        for i, name in enumerate(pod.volumes):
            volume = next(v for v in self.the_plan.volumes if v.name == name)
            path = f"/v/{i}"
            mounts += ["--mount", f"type=volume,source={self.names.volume(name)},target={path},volume-nocopy"]
            if volume.empty_dir:
                script.append(f"chmod 0777 {path}")
            if pod.fs_group is not None:
                g = pod.fs_group
                change = f"chgrp -R {g} {path} && chmod -R g+rwX {path} && find {path} -type d -exec chmod g+s {{}} +"
                script.append(change if pod.fs_group_always else f'[ "$(stat -c %g {path})" = {g} ] || {{ {change}; }}')
        if script:
            docker(
                "run",
                "--rm",
                "--network",
                "none",
                "--user",
                "0:0",
                "--entrypoint",
                "sh",
                *mounts,
                "--label",
                f"{LABEL}={self.run_id}",
                image,
                "-c",
                " && ".join(script),
            )

    def run_container(self, c: P.Container, pod_ip: str) -> None:
        spec = replace(c, image=self.images[c.image])
        env = {k: v.replace(P.POD_IP, pod_ip) for k, v in c.env.items()}
        args = [a.replace(P.POD_IP, pod_ip) for a in P.container_args(spec, self.names, self.labels)]
        docker("run", *args, env=env)

    # ---- readiness
    def monitor_once(self) -> None:
        """One pass of the kubelet's work: container states, restarts, startup and readiness probes."""
        for pod_name, future in self.futures.items():
            if future.done() and future.exception() is not None:
                error = future.exception()
                raise error if isinstance(error, SmokeFailure) else SmokeFailure(f"pod {pod_name}", repr(error))
        with self.lock:
            running = dict(self.running)
        if not running:
            return
        states = {s["Name"].lstrip("/"): s["State"] for s in json.loads(docker("inspect", *running))}
        for name, c in running.items():
            state, w = states[name], self.watch[name]
            if c.restart == "no":
                continue  # run-once pods (helm test) are judged by their exit code
            if state["Status"] == "exited":
                self.restart(name, c, state, w)
                continue
            if state["Status"] != "running":
                continue
            if state["StartedAt"] != w.started_at:  # (re)started: probes start over
                w.started_at, w.since, w.started, w.ready = state["StartedAt"], time.monotonic(), False, False
            ports = self.host_ports[c.pod]
            if not w.started:
                startup = c.probes.get("startupProbe")
                if startup is None:
                    w.started = True
                else:
                    w.started, w.last = run_probe(startup, ports.get(startup.port), name)
                    if not w.started and time.monotonic() - w.since > startup.budget_s:
                        why = f"startup probe failed for {startup.budget_s:.0f} s (failureThreshold x periodSeconds)"
                        raise SmokeFailure(c.label, f"{why}: {w.last}", tail(name))
            if w.started:
                readiness = c.probes.get("readinessProbe")
                if readiness is None:
                    w.ready, w.last = True, "running"
                else:
                    w.ready, w.last = run_probe(readiness, ports.get(readiness.port), name)
        for pod in self.the_plan.workload_pods:
            names = [self.names.container(pod.name, c.name) for c in pod.containers]
            if pod.run_once or not all(n in running for n in names):
                continue
            ready = all(self.watch[n].ready for n in names)
            if ready != self.pod_ready.get(pod.name, False):
                self.set_endpoints(pod, ready)
            self.pod_ready[pod.name] = ready

    def restart(self, name: str, c: P.Container, state: dict, w: Watch) -> None:
        """restartPolicy Always: an exited container starts again after a back-off (the kubelet's crash-loop
        back-off, shortened); more than --max-restarts exits fail the smoke with the exit code and the log."""
        w.started = w.ready = False
        if w.restart_at is None:  # a new exit
            w.exits.append(state["ExitCode"])
            code = f"code {state['ExitCode']}" + (", OOM-killed" if state["OOMKilled"] else "")
            if len(w.exits) > self.max_restarts:
                logs = tail(name)
                why = f"exited {len(w.exits)} times (restarted {len(w.exits) - 1}), last with {code}"
                raise SmokeFailure(c.label, f"{why}: {first_error(logs)}", logs)
            delay = min(2 ** len(w.exits), 30)
            w.restart_at = time.monotonic() + delay
            say(f"  pod {c.pod}: container {c.name} exited with {code}; restarting in {delay} s")
        elif time.monotonic() >= w.restart_at:
            docker("start", name)
            w.restart_at, w.restarts = None, w.restarts + 1

    def set_endpoints(self, pod: P.Pod, ready: bool) -> None:
        """A pod's Service names follow its readiness, as the endpoints of a Service do."""
        sandbox = self.names.sandbox(pod.name)
        for service, aliases in pod.aliases_when_ready.items():
            network = self.names.service_network(service)
            if ready:
                alias_args = [a for alias in aliases for a in ("--alias", alias)]
                docker("network", "connect", *alias_args, network, sandbox)
            else:
                docker("network", "disconnect", network, sandbox, check=False)
        services = f" (Services: {', '.join(pod.aliases_when_ready)})" if ready and pod.aliases_when_ready else ""
        say(f"  {'ready' if ready else 'NOT READY'}: pod {pod.name}{services}")

    def wait_ready(self, pods: list[P.Pod], deadline: float) -> None:
        while not all(self.pod_ready.get(p.name) for p in pods):
            self.monitor_once()
            if time.monotonic() > deadline:
                waiting = [p for p in pods if not self.pod_ready.get(p.name)]
                pod = waiting[0]
                names = [self.names.container(pod.name, c.name) for c in pod.containers]
                last = "; ".join(
                    f"{c.name}: {self.watch[n].last or 'not started'}"
                    for c, n in zip(pod.containers, names, strict=True)
                    if n in self.watch
                )
                why = f"not ready in time ({last or 'its init containers have not finished'})"
                others = [p.name for p in waiting[1:]]
                raise SmokeFailure(
                    f"pod {pod.name}", why + (f"; also not ready: {others}" if others else ""), tail(names[-1])
                )
            time.sleep(1)

    def start_monitor(self) -> threading.Thread:
        """Keep watching (crash loops, readiness) while the checks run; the first problem lands in .failure."""

        def loop():
            while not self.stop_monitor.wait(2):
                try:
                    self.monitor_once()
                except SmokeFailure as failure:
                    self.failure = failure
                    return
                except Exception as error:  # noqa: BLE001 - a docker hiccup must not hide behind a check timeout
                    self.failure = SmokeFailure("monitor", repr(error))
                    return

        thread = threading.Thread(target=loop, name="monitor", daemon=True)
        thread.start()
        return thread

    def guarded(self, fn, *args, timeout: float):
        """fn(*args) in a thread; fails at once with the monitor's finding if a pod breaks meanwhile."""
        future = self.pool.submit(fn, *args)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=1)
            except concurrent.futures.TimeoutError:
                if self.failure is not None:
                    raise self.failure from None
                if time.monotonic() > deadline:
                    raise SmokeFailure(
                        "check", f"{getattr(fn, '__name__', fn)} did not finish in {timeout:.0f} s"
                    ) from None
            except SystemExit as error:  # smoke_client reports failures as SystemExit(message)
                raise SmokeFailure("check", str(error)) from None

    # ---- run-once pods (helm test)
    def run_to_completion(self, pod: P.Pod, timeout: float) -> str:
        self.start_pod(pod)
        out = []
        for c in pod.containers:
            name = self.names.container(pod.name, c.name)
            code = int(docker("wait", name, timeout=timeout).strip() or 1)
            logs = tail(name, 20)
            if code != 0:
                raise SmokeFailure(c.label, f"exited with code {code}", logs)
            out.append(logs.strip())
        return "\n".join(out)

    # ---- teardown
    def teardown(self) -> str:
        self.stop_monitor.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        removed = remove_labelled(f"{LABEL}={self.run_id}")
        shutil.rmtree(self.names.files_root, ignore_errors=True)
        return removed


def remove_labelled(selector: str) -> str:
    """Remove every container, network and volume carrying the label; say what was removed and what is left."""
    found = {}
    for kind, ls in (
        ("container", ["ps", "-aq"]),
        ("network", ["network", "ls", "-q"]),
        ("volume", ["volume", "ls", "-q"]),
    ):
        ids = docker(*ls, "--filter", f"label={selector}", check=False).split()
        if ids:
            docker(
                *(
                    ["rm", "-f", "-v"]
                    if kind == "container"
                    else [kind, "rm", "-f"]
                    if kind == "volume"
                    else [kind, "rm"]
                ),
                *ids,
                check=False,
                timeout=300,
            )
        found[kind] = len(ids)
    left = sum(
        len(docker(*ls, "--filter", f"label={selector}", check=False).split())
        for ls in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"])
    )
    summary = ", ".join(f"{n} {kind}s" for kind, n in found.items())
    return f"removed {summary}; {left} left" if left else f"removed {summary}; nothing left"


def first_error(logs: str) -> str:
    """The first line of a log that reports an error (`error:`, `Error:`, `ERROR`), else its last line."""
    lines = logs.splitlines()
    found = [ln for ln in lines if re.search(r"\berror\b:|\bERROR\b|^[\w.]*(Error|Exception):", ln.strip())]
    return found[0].strip() if found else (lines[-1].strip() if lines else "(no log)")


def tail(container: str, lines: int = 40) -> str:
    proc = subprocess.run(["docker", "logs", "--tail", str(lines), container], capture_output=True, text=True)
    return (proc.stdout + proc.stderr).rstrip()


# ---- the checks ------------------------------------------------------------------------------------------


def find_service(the_plan: P.Plan, component: str, port: str) -> P.Service:
    """The ClusterIP Service of a component with a port of that name (what `kubectl port-forward svc/...` uses)."""
    for service in the_plan.services:
        is_component = service.labels.get("app.kubernetes.io/component") == component
        if is_component and not service.headless and port in service.ports:
            return service
    raise SmokeFailure("check", f"no Service of component {component} with a port named {port!r}")


def secret_value(the_plan: P.Plan, key: str) -> str:
    import base64

    for obj in the_plan.objects:
        if obj["kind"] == "Secret" and key in (obj.get("data") or {}):
            return base64.b64decode(obj["data"][key]).decode()
    raise SmokeFailure("check", f"no rendered Secret has the key {key!r}")


def scrape_targets(the_plan: P.Plan) -> list[tuple[str, str, int, str]]:
    """(Service, pod, port, path) Prometheus scrapes: each ServiceMonitor's endpoints on the pods of the
    Services it selects; without ServiceMonitors, every Service port named `metrics`."""
    monitors = [o for o in the_plan.objects if o["kind"] == "ServiceMonitor"]
    targets = set()
    for monitor in monitors:
        selector = monitor["spec"]["selector"].get("matchLabels", {})
        for service in the_plan.services:
            if P.selects(selector, service.labels):
                for endpoint in monitor["spec"]["endpoints"]:
                    port = service.ports[endpoint["port"]]
                    targets |= {(service.name, pod, port, endpoint.get("path", "/metrics")) for pod in service.pods}
    if not monitors:
        targets = {
            (s.name, pod, s.ports["metrics"], "/metrics")
            for s in the_plan.services
            if "metrics" in s.ports
            for pod in s.pods
        }
    return sorted(targets)


def scrape(host_port: int, path: str) -> tuple[int, int, list[str]]:
    """(families, samples, gyre_* family names) of a /metrics page in the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{host_port}{path}", timeout=10) as response:
        text = response.read().decode()
    families = [f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")]
    samples = sum(len(f.samples) for f in families)
    return len(families), samples, sorted(f.name for f in families if f.name.startswith("gyre_"))


def chat_after_training(base_url: str, api_key: str, model: str, deadline: float) -> tuple[str, list[int], int]:
    """A completion served by trained weights (policy version >= 1): the weights went trainer -> volume ->
    orchestrator -> inference over the containers' network."""
    while True:
        reply = smoke_client.chat_once(base_url, api_key, model)
        if reply[2] >= 1 or time.monotonic() > deadline:
            return reply
        time.sleep(3)


def checks(cluster: Cluster, min_steps: int, timeout: float) -> dict:
    the_plan, out = cluster.the_plan, {}
    deadline = time.monotonic() + timeout
    api = find_service(the_plan, "inference", "http")
    api_port = cluster.host_ports[api.pods[0]][api.ports["http"]]
    base_url, api_key = f"http://127.0.0.1:{api_port}/v1", secret_value(the_plan, "api-key")
    say(f"  OpenAI API: svc/{api.name}:{api.ports['http']} published at {base_url} (the port-forward)")
    model = cluster.guarded(smoke_client.wait_for_model, base_url, api_key, deadline, timeout=timeout)
    say(f"  GET /v1/models (official openai client): {model!r}")
    text, token_ids, version = cluster.guarded(smoke_client.chat_once, base_url, api_key, model, timeout=300)
    say(f"  chat completion: {text!r}, token_ids {token_ids}, policy_version {version}")
    out["chat"] = {"text": text, "token_ids": token_ids, "policy_version": version}

    trainer = find_service(the_plan, "trainer", "grpc")
    address = f"127.0.0.1:{cluster.host_ports[trainer.pods[0]][trainer.ports['grpc']]}"
    step = cluster.guarded(smoke_client.wait_for_steps, address, min_steps, deadline, timeout=timeout)
    say(f"  trainer (svc/{trainer.name}:{trainer.ports['grpc']}, gRPC GetStatus): step {step} >= {min_steps}")
    text, token_ids, version = cluster.guarded(
        chat_after_training, base_url, api_key, model, time.monotonic() + 180, timeout=240
    )
    if version < 1:
        raise SmokeFailure(
            f"pod {api.pods[0]}",
            f"still serves policy version {version} after {step} trained steps: "
            "the trained weights never reached inference",
        )
    say(f"  chat completion after training: {text!r}, token_ids {token_ids}, policy_version {version}")
    out["steps"], out["chat_after_training"] = step, {"text": text, "token_ids": token_ids, "policy_version": version}

    out["metrics"] = []
    for service, pod, port, path in scrape_targets(the_plan):
        try:
            families, samples, gyre = scrape(cluster.host_ports[pod][port], path)
        except OSError as error:
            why = f"{path} on port {port} (Service {service}) does not scrape: {error}"
            raise SmokeFailure(f"pod {pod}", why) from None
        if not gyre:
            raise SmokeFailure(f"pod {pod}", f"{path} on port {port} has no gyre_* metrics")
        say(
            f"  scraped {service} -> pod {pod}:{port}{path}: {families} families, {samples} samples, "
            f"{len(gyre)} gyre_* (e.g. {', '.join(gyre[:3])})"
        )
        out["metrics"].append({"service": service, "pod": pod, "port": port, "families": families, "samples": samples})

    out["tests"] = []
    for pod in the_plan.test_pods:
        logs = cluster.run_to_completion(pod, timeout=300)
        say(f"  helm test pod {pod.name}: passed: {logs.splitlines()[-1] if logs else ''}")
        out["tests"].append({"pod": pod.name, "log": logs})

    for name, c in cluster.running.items():  # every probe still holds (liveness failures would restart it)
        if c.pod in {p.name for p in the_plan.test_pods}:
            continue
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind in c.probes:
                probe = c.probes[kind]
                passed, what = run_probe(probe, cluster.host_ports[c.pod].get(probe.port), name)
                if not passed:
                    raise SmokeFailure(c.label, f"{kind} fails after training: {what}", tail(name))
    out["restarts"] = {name.removeprefix(cluster.names.prefix + "-"): w.restarts for name, w in cluster.watch.items()}
    restarted = {name: n for name, n in out["restarts"].items() if n}
    say(f"  startup, liveness and readiness probes all pass; restarts: {restarted or 'none'}")
    return out


# ---- the whole run ---------------------------------------------------------------------------------------


@dataclass
class Options:
    release: str = "smoke"
    namespace: str = "gyre"
    min_steps: int = 3
    timeout: float = 900
    max_restarts: int = 3
    fallbacks: dict[str, str] = field(default_factory=lambda: dict(f.split("=", 1) for f in DEFAULT_FALLBACKS))
    keep: bool = False


def render(values_files: list[Path], release: str, namespace: str) -> tuple[list[dict], str]:
    """The release's objects as the kind workflow installs it, and the cluster domain its values set."""
    import yaml

    chart = ROOT / "charts" / "gyre"
    values: dict = {}
    for path in values_files:
        values = P.merge_values(values, yaml.safe_load(path.read_text()) or {})
    defaults = yaml.safe_load((chart / "values.yaml").read_text())
    domain = P.merge_values(defaults, values).get("clusterDomain") or "cluster.local"
    docs = P.render_chart(chart, values, release=release, namespace=namespace, api_versions=MONITORING_APIS)
    return docs, domain


def run(objects: list[dict], options: Options, domain: str = "cluster.local") -> dict:
    """Plan, start, wait, check, tear down. Raises SmokeFailure (or P.WiringError) naming the pod and why."""
    started = time.monotonic()
    the_plan = P.plan(objects, namespace=options.namespace, release=options.release, domain=domain)
    workloads = the_plan.workload_pods
    say(
        f"plan: {len(workloads)} pods ({', '.join(p.name for p in workloads)}), {len(the_plan.test_pods)} test pods, "
        f"{len(the_plan.services)} Services, {len(the_plan.volumes)} volumes, "
        f"{len(the_plan.file_volumes)} ConfigMap/Secret volumes"
    )
    if the_plan.not_emulated:
        say(f"not emulated (the kind workflow covers them): {', '.join(the_plan.not_emulated)}")
    for note in the_plan.notes:
        say(f"note: {note}")
    images, substituted = resolve_images(the_plan, options.fallbacks)
    for note in substituted:
        say(f"image: {note}")
    check_non_root(the_plan, images)
    summary = {"images": {}}
    for ref in sorted(set(images.values())):
        size = int(docker("image", "inspect", "-f", "{{.Size}}", ref).strip())
        summary["images"][ref] = size
        say(f"image {ref}: {size / 1e6:.0f} MB")

    cluster = Cluster(the_plan, images, options.max_restarts)
    say(f"run id {cluster.run_id}: Docker objects labelled {LABEL}={cluster.run_id}")
    try:
        cluster.create_shared()
        cluster.start(workloads)
        cluster.wait_ready(workloads, time.monotonic() + options.timeout)
        summary["ready_s"] = round(time.monotonic() - started)
        say(f"all {len(workloads)} pods ready after {summary['ready_s']} s")
        cluster.start_monitor()
        summary.update(checks(cluster, options.min_steps, options.timeout))
        summary["seconds"] = round(time.monotonic() - started)
        return summary
    finally:
        if options.keep:
            say(f"--keep: left running; remove with: {Path(__file__).name} --clean")
        else:
            say(f"teardown: {cluster.teardown()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--values", "-f", action="append", type=Path, help="values file(s) (default: deploy/values-kind.yaml)"
    )
    parser.add_argument("--release", default="smoke", help="release name (default: smoke)")
    parser.add_argument("--namespace", "-n", default="gyre", help="namespace (default: gyre)")
    parser.add_argument("--min-steps", type=int, default=3, help="training steps to wait for (default: 3)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for readiness, and for the checks")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts of a container tolerated before the smoke fails (default: 3)",
    )
    parser.add_argument(
        "--image-fallback",
        action="append",
        default=[],
        metavar="NAME=IMAGE",
        help="run IMAGE where an image whose repository ends in NAME cannot be pulled "
        f"(default: {' '.join(DEFAULT_FALLBACKS)})",
    )
    parser.add_argument("--summary", type=Path, help="write the results as JSON here")
    parser.add_argument("--keep", action="store_true", help="leave the containers running (debugging)")
    parser.add_argument("--clean", action="store_true", help=f"remove every object labelled {LABEL} and exit")
    args = parser.parse_args(argv)
    if args.clean:
        say(remove_labelled(LABEL))
        return 0
    options = Options(args.release, args.namespace, args.min_steps, args.timeout, args.max_restarts, keep=args.keep)
    options.fallbacks.update(dict(f.split("=", 1) for f in args.image_fallback))
    values = args.values or [ROOT / "deploy" / "values-kind.yaml"]

    def terminate(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through run()'s teardown

    previous = signal.signal(signal.SIGTERM, terminate)
    say(f"== container smoke: release {args.release} in namespace {args.namespace}, values {[str(v) for v in values]}")
    try:
        objects, domain = render(values, args.release, args.namespace)
        summary = run(objects, options, domain)
    except (SmokeFailure, P.WiringError) as failure:
        say(f"\nSMOKE FAILED: {failure.where}: {failure.why}")
        if getattr(failure, "logs", ""):
            say(f"--- last log lines of {failure.where}:\n{failure.logs}")
        return 1
    except P.Unsupported as error:
        say(f"\nSMOKE FAILED: the container smoke cannot run this: {error}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")
    say(f"SMOKE PASSED in {summary['seconds']} s")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
