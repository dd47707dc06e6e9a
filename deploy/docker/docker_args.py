"""The plan as Docker command lines: a smoke run's names for the plan's objects, and the `docker run`
arguments of a pod's sandbox and of each container (with its `--mount` specs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from plan_model import Container, Mount, Pod, Unsupported


@dataclass
class Names:
    """How plan names become Docker names (one smoke run's prefix) and host paths."""

    prefix: str
    files_root: Path
    volume_paths: dict[str, str] = field(default_factory=dict)  # Docker volume -> host mountpoint (subPath only)

    def sandbox(self, pod: str) -> str:
        return f"{self.prefix}-{pod}"

    def container(self, pod: str, name: str) -> str:
        return f"{self.prefix}-{pod}-{name}"

    def volume(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    @property
    def pod_network(self) -> str:
        return self.prefix

    def service_network(self, service: str) -> str:
        return f"{self.prefix}-svc-{service}"


def sandbox_args(pod: Pod, image: str, names: Names, labels: dict[str, str]) -> list[str]:
    """`docker run` arguments of a pod's sandbox: network, hostname, DNS, published ports; it only sleeps."""
    args = [
        "--detach",
        "--name",
        names.sandbox(pod.name),
        "--network",
        names.pod_network,
        "--hostname",
        pod.hostname,
        "--user",
        "65535:65535",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--entrypoint",
        "sleep",
    ]
    if pod.shared_pid:  # Docker's init (tini) as PID 1 reaps orphans and zombies, as the pause container does
        args.append("--init")
    if pod.domain:
        args += ["--domainname", pod.domain]
    for alias in pod.aliases_at_start:
        args += ["--network-alias", alias]
    for search in pod.dns_search:
        args += ["--dns-search", search]
    for option in pod.dns_options:
        args += ["--dns-option", option]
    for port in pod.ports:
        args += ["--publish", f"127.0.0.1::{port}"]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    return [*args, image, "infinity"]


def container_args(c: Container, names: Names, labels: dict[str, str]) -> list[str]:
    """`docker run` arguments of one container, joined to its pod's sandbox. Environment values are passed
    as `--env NAME` (the value comes from the docker client's environment, never from its command line).
    No Docker restart policy: the smoke restarts exited containers itself, counting exits and codes."""
    args = ["--detach", "--name", names.container(c.pod, c.name), "--network", f"container:{names.sandbox(c.pod)}"]
    if c.shared_pid:
        args += ["--pid", f"container:{names.sandbox(c.pod)}"]
    if c.user is not None:
        args += ["--user", c.user]
    for group in c.group_add:
        args += ["--group-add", str(group)]
    if c.read_only:
        args.append("--read-only")
    if c.privileged:
        args.append("--privileged")
    if c.no_new_privileges:
        args += ["--security-opt", "no-new-privileges"]
    if c.seccomp_unconfined:
        args += ["--security-opt", "seccomp=unconfined"]
    for cap in c.cap_drop:
        args += ["--cap-drop", cap]
    for cap in c.cap_add:
        args += ["--cap-add", cap]
    if c.memory_bytes is not None:
        args += ["--memory", str(c.memory_bytes)]
    if c.cpus is not None:
        args += ["--cpus", f"{c.cpus:g}"]
    if c.workdir:
        args += ["--workdir", c.workdir]
    for mount in c.mounts:
        args += ["--mount", mount_spec(mount, names)]
    for name in c.env:
        args += ["--env", name]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    words: list[str] = []
    if c.command is not None:
        args += ["--entrypoint", c.command[0]]
        words = [*c.command[1:], *(c.args or [])]
    elif c.args is not None:
        words = list(c.args)
    return [*args, c.image, *words]


def mount_spec(mount: Mount, names: Names) -> str:
    ro = ",readonly" if mount.read_only else ""
    if mount.files:  # written on the host by the runner
        source = names.files_root / mount.volume / mount.sub_path if mount.sub_path else names.files_root / mount.volume
        return f"type=bind,source={source},target={mount.target}{ro}"
    if mount.sub_path:
        if mount.volume not in names.volume_paths:
            raise Unsupported(f"subPath {mount.sub_path} of volume {mount.volume}: its host path is unknown")
        return f"type=bind,source={names.volume_paths[mount.volume]}/{mount.sub_path},target={mount.target}{ro}"
    # volume-nocopy: Docker would fill an empty volume with (and give it the owner of) the image's folder at
    # that path; a Kubernetes volume comes as the kubelet made it.
    return f"type=volume,source={names.volume(mount.volume)},target={mount.target},volume-nocopy{ro}"
