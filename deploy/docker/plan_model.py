"""The container smoke's plan as data: pods of containers, their mounts and probes, Docker and file volumes,
Services; and the two ways a rendered release cannot run (`WiringError`, `Unsupported`). plan.py builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

POD_IP = "\x00POD_IP\x00"  # stands for the pod's IP until its sandbox exists (the runner substitutes it)


class WiringError(Exception):
    """The rendered objects cannot run as they are; `where` names the pod (and container) or object."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


class Unsupported(Exception):
    """Something the chart renders that the container smoke cannot reproduce (it says what)."""


@dataclass
class Probe:
    action: str  # http | tcp | grpc | exec
    port: int | None = None
    path: str = "/"
    scheme: str = "HTTP"
    headers: dict[str, str] = field(default_factory=dict)
    service: str = ""  # grpc health service name
    command: list[str] = field(default_factory=list)
    initial_delay_s: float = 0
    period_s: float = 10
    timeout_s: float = 1
    failure_threshold: int = 3

    @property
    def budget_s(self) -> float:
        """How long the kubelet lets this probe fail before acting (startup: the container's time to start)."""
        return self.initial_delay_s + self.period_s * self.failure_threshold


@dataclass
class Mount:
    target: str
    volume: str  # a Docker volume (Plan.volumes) or a file volume (Plan.file_volumes), by plan name
    read_only: bool = False
    sub_path: str = ""
    files: bool = False  # a file volume (host folder), else a Docker volume


@dataclass
class DockerVolume:
    name: str
    origin: str  # for messages: "PersistentVolumeClaim exp-gyre-data", "emptyDir tmp of pod ..."
    empty_dir: bool = False  # 0777, as the kubelet creates an emptyDir
    tmpfs_bytes: int | None = None  # emptyDir medium Memory (None: on disk)


@dataclass
class FileVolume:
    name: str
    origin: str
    files: dict[str, tuple[bytes, int]]  # relative path -> (content, mode)
    group: int | None = None  # fsGroup: files root:<group> and group-readable, as the kubelet sets them


@dataclass
class Container:
    pod: str
    name: str
    image: str
    pull_policy: str
    init: bool = False
    command: list[str] | None = None  # Kubernetes `command` (replaces the image's ENTRYPOINT), expanded
    args: list[str] | None = None  # Kubernetes `args` (replaces the image's CMD), expanded
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None  # "uid" or "uid:gid"; None: the image's USER
    run_as_non_root: bool = False
    group_add: list[int] = field(default_factory=list)
    read_only: bool = False
    privileged: bool = False
    no_new_privileges: bool = False
    cap_drop: list[str] = field(default_factory=list)
    cap_add: list[str] = field(default_factory=list)
    seccomp_unconfined: bool = False
    mounts: list[Mount] = field(default_factory=list)
    memory_bytes: int | None = None
    cpus: float | None = None
    workdir: str | None = None
    ports: dict[str, int] = field(default_factory=dict)  # declared containerPorts by name (or str(number))
    probes: dict[str, Probe] = field(default_factory=dict)  # startupProbe / readinessProbe / livenessProbe
    shared_pid: bool = False  # shareProcessNamespace: joins the sandbox's PID namespace (its init is PID 1)
    restart: str = "always"  # always (restartPolicy Always: the smoke restarts it) | no (runs once)

    @property
    def label(self) -> str:
        return f"pod {self.pod}, {'init container' if self.init else 'container'} {self.name}"


@dataclass
class Pod:
    name: str
    owner: str  # "StatefulSet exp-gyre-trainer"
    labels: dict[str, str]
    annotations: dict[str, str]
    hostname: str
    domain: str = ""  # `<subdomain>.<ns>.svc.<cluster domain>` when the pod has a subdomain
    test_hook: bool = False  # a `helm test` pod: runs after the release is ready, to completion
    run_once: bool = False  # Job / restartPolicy != Always: done when its containers exit 0
    init_containers: list[Container] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)  # Docker volumes the pod mounts (prepared before it starts)
    fs_group: int | None = None
    fs_group_always: bool = False  # fsGroupChangePolicy Always (else OnRootMismatch)
    shared_pid: bool = False  # shareProcessNamespace: the sandbox's init is the pod's PID 1 (it reaps orphans)
    grace_s: int = 30  # terminationGracePeriodSeconds: SIGTERM, then SIGKILL this long after
    dns_search: list[str] = field(default_factory=list)
    dns_options: list[str] = field(default_factory=list)
    aliases_at_start: list[str] = field(default_factory=list)  # names of publishNotReadyAddresses Services
    aliases_when_ready: dict[str, list[str]] = field(default_factory=dict)  # Service -> names, once ready

    @property
    def ports(self) -> list[int]:
        return sorted({p for c in self.containers for p in c.ports.values()})


@dataclass
class Service:
    name: str
    fqdn: str
    selector: dict[str, str]
    ports: dict[str, int]  # port name (or str(number)) -> port
    pods: list[str]
    headless: bool
    publish_not_ready: bool
    labels: dict[str, str]


@dataclass
class Plan:
    release: str
    namespace: str
    domain: str
    pods: list[Pod]
    services: list[Service]
    volumes: list[DockerVolume]
    file_volumes: list[FileVolume]
    objects: list[dict]
    not_emulated: list[str]
    notes: list[str]

    def pod(self, name: str) -> Pod:
        (found,) = [p for p in self.pods if p.name == name]
        return found

    def service(self, name: str) -> Service:
        (found,) = [s for s in self.services if s.name == name]
        return found

    @property
    def workload_pods(self) -> list[Pod]:
        return [p for p in self.pods if not p.test_hook]

    @property
    def test_pods(self) -> list[Pod]:
        return [p for p in self.pods if p.test_hook]
