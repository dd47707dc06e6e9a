"""One container smoke run's Docker objects, and the kubelet's work on them: shared networks and volumes,
each pod's sandbox, volumes and containers, probes and restarts, a pod's Service names following its
readiness, `helm test` pods, and teardown of everything carrying the run's label."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from docker_args import Names, container_args, sandbox_args
from plan_model import POD_IP, Container, FileVolume, Plan, Pod
from probes import run_probe

LABEL = "dev.gyre.smoke"


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


# ---- the run ---------------------------------------------------------------------------------------------


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

    the_plan: Plan
    images: dict[str, str]
    max_restarts: int = 3
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))

    def __post_init__(self):
        self.names = Names(f"gyre-smoke-{self.run_id}", Path(tempfile.mkdtemp(prefix=f"gyre-smoke-{self.run_id}-")))
        os.chmod(self.names.files_root, 0o755)
        self.labels = {LABEL: self.run_id}
        self.host_ports: dict[str, dict[int, int]] = {}  # pod -> container port -> host port
        self.pod_ready: dict[str, bool] = {}
        self.running: dict[str, Container] = {}  # docker name -> container (main containers)
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

    def write_files(self, volume: FileVolume) -> None:
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
    def start(self, pods: list[Pod]) -> None:
        for pod in pods:
            self.futures[pod.name] = self.pool.submit(self.start_pod, pod)

    def start_pod(self, pod: Pod) -> None:
        first_image = self.images[(pod.init_containers or pod.containers)[0].image]
        docker("run", *sandbox_args(pod, first_image, self.names, self.labels))
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

    def prepare_volumes(self, pod: Pod, image: str) -> None:
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

    def run_container(self, c: Container, pod_ip: str) -> None:
        spec = replace(c, image=self.images[c.image])
        env = {k: v.replace(POD_IP, pod_ip) for k, v in c.env.items()}
        args = [a.replace(POD_IP, pod_ip) for a in container_args(spec, self.names, self.labels)]
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

    def restart(self, name: str, c: Container, state: dict, w: Watch) -> None:
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

    def set_endpoints(self, pod: Pod, ready: bool) -> None:
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

    def wait_ready(self, pods: list[Pod], deadline: float) -> None:
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
    def run_to_completion(self, pod: Pod, timeout: float) -> str:
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

    # ---- stopping
    def stop_pods(self, pods: list[Pod]) -> list[dict]:
        """What `helm uninstall` makes the kubelet do: every pod at once, each container of a pod SIGTERMed
        together and SIGKILLed its terminationGracePeriodSeconds later (`docker stop -t`). Per container:
        how long it took, its exit code and whether it was killed. The monitor must be stopped first (it
        would restart what exits)."""

        def stop(pod: Pod, c: Container) -> dict:
            name = self.names.container(pod.name, c.name)
            started = time.monotonic()
            docker("stop", "-t", str(pod.grace_s), name, timeout=pod.grace_s + 60)
            seconds = time.monotonic() - started
            state = json.loads(docker("inspect", name))[0]["State"]
            code = state["ExitCode"]
            # Docker reports a SIGKILL as 137; a stop that took the whole grace period was one too
            killed = code == 137 or state["OOMKilled"] or seconds >= pod.grace_s
            return {"pod": pod.name, "container": c.name, "seconds": round(seconds, 1), "code": code,
                    "grace_s": pod.grace_s, "killed": killed, "log": tail(name, 15)}  # fmt: skip

        with concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="stop") as pool:
            futures = [pool.submit(stop, pod, c) for pod in pods for c in pod.containers]
            return [f.result() for f in futures]

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
