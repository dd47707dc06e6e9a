"""Inference replicas: who they are (discovery), whether they answer (health), what version they serve.

`ReplicaSet` is the single place that knows each replica's HTTP URL, control address, served policy
version, in-flight requests and failure state. The model client picks replicas from it
(`acquire`), the weight relay updates their versions, discovery adds and removes them.

Health is a circuit breaker per replica: a failure takes the replica out of rotation for a cooldown
that doubles with consecutive failures (capped); when the cooldown has passed it is eligible again
(half-open: one request at a time) and the next success — a request, or the relay's status probe — closes the
breaker.

Discovery sources (`inference.discovery`):
- `static`: `inference.urls` (+ `control_urls`, or the same host with `control_port`);
- `dns`: a headless Service name resolved to every pod IP, re-resolved every `refresh_s`;
- `kubernetes`: a watch on the Service's EndpointSlices (in-cluster config, else the kubeconfig), only
  ready endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class NoReplicaAvailable(RuntimeError):
    """No healthy replica serving a recent enough version appeared within the wait."""


@dataclass(frozen=True)
class Endpoint:
    """Where one replica listens: its OpenAI HTTP base URL and its gRPC InferenceControl address."""

    url: str  # http://host:port (no /v1)
    control: str  # host:port


@dataclass
class Replica:
    endpoint: Endpoint
    version: int | None = None  # served policy version; None = not known yet
    inflight: int = 0
    requests: int = 0  # answered requests (load-balancing evidence for tests and logs)
    failures: int = 0  # consecutive
    retry_at: float = 0.0  # monotonic time before which it is out of rotation
    last_error: str | None = None
    # False from a failure until a status probe or a weights update says which version it serves: a replica that
    # failed may have restarted on other weights, so the version known from before is no evidence of what it
    # serves once its cooldown is over (a request that succeeds meanwhile never lowers it: `observe_version`)
    confirmed: bool = True
    # it is down: its status probe failed or said "not ready" (loading its model), or an update found it UNAVAILABLE.
    # No request goes to it until a probe (or a weights update) answers again, whatever its cooldown (back from it
    # untested, a replica still frozen took the next request, stuck until the next probe); the relay probes it during
    # its cooldown too, so it rejoins as soon as it is ready
    probe_failed: bool = False
    clients: dict[str, Any] = field(default_factory=dict)  # lazily built HTTP/gRPC clients, closed on removal
    # the requests in flight on it, each its own task: `ReplicaSet.abandon` cancels them when it stops answering
    calls: set[asyncio.Task] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def healthy(self) -> bool:
        return self.failures == 0


class ReplicaSet:
    """The live set of replicas. Not thread-safe: use from the event loop only.

    Invariants: `acquire` returns a replica that is in rotation (cooldown over) and, when
    `min_version > 0`, known to serve a version >= min_version; the caller must `release` it.
    """

    def __init__(
        self,
        endpoints: Iterable[Endpoint] = (),
        *,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self.probe_requested = False  # set when a replica answered with an older version than we knew
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self.set_endpoints(endpoints)

    # ---- membership -----------------------------------------------------------------------------
    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> list[Replica]:
        """Make the set equal to `endpoints`; returns the removed replicas (the caller closes their clients)."""
        wanted = {e.url: e for e in endpoints}
        removed = [r for url, r in self.replicas.items() if url not in wanted or wanted[url] != r.endpoint]
        for r in removed:
            del self.replicas[r.url]
        added = [e for url, e in wanted.items() if url not in self.replicas]
        for e in added:
            self.replicas[e.url] = Replica(e)
        if added or removed:
            log.info(
                "replicas: %s (added %s, removed %s)",
                sorted(self.replicas),
                [e.url for e in added],
                [r.url for r in removed],
            )
            self._notify()
        return removed

    def __iter__(self):
        return iter(list(self.replicas.values()))

    def __len__(self) -> int:
        return len(self.replicas)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called on every change (membership, health, version)."""
        self._listeners.append(callback)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for callback in list(self._listeners):
            callback()

    # ---- health and versions --------------------------------------------------------------------
    def in_rotation(self, replica: Replica) -> bool:
        return replica.url in self.replicas and self.clock() >= replica.retry_at

    def mark_failed(self, replica: Replica, error: BaseException | str, *, probe: bool = False) -> None:
        """A failure; `probe`: its status probe's (see `Replica.probe_failed`)."""
        replica.last_error = str(error) or type(error).__name__
        replica.confirmed = False
        replica.probe_failed |= probe
        if self.replicas.get(replica.url) is not replica:
            return  # discovery dropped it (a request it held failed as it went): no rotation to take it out of
        if self.clock() < replica.retry_at:
            return  # already out: the other requests that were in flight when it broke are the same outage
        replica.failures += 1
        cooldown = min(self.cooldown_s * 2 ** (replica.failures - 1), self.max_cooldown_s)
        replica.retry_at = self.clock() + cooldown
        log.warning(
            "replica %s failed (%s); out of rotation for %.1fs (failure %d)",
            replica.url,
            replica.last_error,
            cooldown,
            replica.failures,
        )
        self._notify()

    def mark_ok(self, replica: Replica, version: int | None = None) -> None:
        """A success; with `version` (a status probe, a weights update) also what it serves, which confirms it."""
        changed = replica.failures > 0 or (version is not None and not replica.confirmed)
        if version is not None:
            replica.confirmed = True
            replica.probe_failed = False
        if replica.failures:
            log.info("replica %s is healthy again", replica.url)
        replica.failures = 0
        replica.retry_at = 0.0
        replica.last_error = None
        if version is not None and version != replica.version:
            if replica.version is not None and version < replica.version:
                log.warning(
                    "replica %s went back from version %d to %d (restarted?)", replica.url, replica.version, version
                )
            replica.version = version
            changed = True
        if changed:
            self._notify()

    def abandon(self, replica: Replica) -> int:
        """Cancel the requests in flight on `replica`, which stopped answering (its status probe failed: frozen,
        hung, cut off by the network), so that the client retries them on another replica now. Left alone, they
        waited for `inference.timeout_s` (300 s) or until the replica woke up, holding their step back although the
        probe had taken the replica out of rotation. Only when another replica is in rotation: a lone replica that is
        merely slow keeps its requests (they could go nowhere else). Returns how many were cancelled."""
        others = [r for r in self.replicas.values() if r is not replica and not r.probe_failed]
        if not replica.calls or not any(self.in_rotation(r) for r in others):
            return 0
        calls = [c for c in replica.calls if not c.done()]
        for call in calls:
            call.cancel()
        if calls:
            log.warning("replica %s stopped answering: retrying its %d requests in flight elsewhere", replica.url,
                        len(calls))  # fmt: skip
        return len(calls)

    def observe_version(self, replica: Replica, version: int) -> None:
        """A completion was produced by `version`: the replica serves at least that (never lowers it).

        Only the relay's status probes may lower a known version (a restarted replica): a completion
        that finished just before a swap can arrive after the relay recorded the new version.
        """
        known = replica.version
        if known is None or version > known or (version == known and not replica.confirmed):
            replica.version = version
            replica.confirmed = True  # it answered from that version after its failure: what it serves now
            self._notify()
        elif version < replica.version:
            # most likely a restart on older weights: ask for a status probe now rather than at the next tick
            self.probe_requested = True
            self._notify()

    def served_versions(self) -> set[int]:
        return {r.version for r in self.replicas.values() if r.version is not None}

    def serves(self, replica: Replica, min_version: int) -> bool:
        """In rotation and known to serve a version >= `min_version` (anything, for 0), confirmed since its last
        failure. Back from its cooldown but not answered since (half-open), it takes one request at a time."""
        if not self.in_rotation(replica) or replica.probe_failed:
            return False
        if replica.failures and replica.inflight:
            # the trial request is out: with the fewest requests in flight, it took every request before (32 on a
            # replica still frozen, each waiting for the probe to give up on it) and the other replicas idled
            return False
        version = replica.version if replica.confirmed else None
        return min_version <= 0 or (version is not None and version >= min_version)

    def max_healthy_version(self) -> int | None:
        versions = [r.version for r in self.replicas.values()
                    if r.version is not None and r.confirmed and self.in_rotation(r)]  # fmt: skip
        return max(versions) if versions else None

    # ---- routing --------------------------------------------------------------------------------
    def eligible(self, min_version: int = 0) -> list[Replica]:
        return [r for r in self.replicas.values() if self.serves(r, min_version)]

    async def acquire(self, min_version: int = 0, timeout: float | None = None) -> Replica:
        """The eligible replica with the fewest requests in flight (waits for one; `NoReplicaAvailable`)."""
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            candidates = self.eligible(min_version)
            if candidates:
                replica = min(candidates, key=lambda r: (r.inflight, r.failures, r.url))
                replica.inflight += 1
                return replica
            # wake on any change, or when the earliest cooldown ends (half-open retry)
            waits = [r.retry_at - self.clock() for r in self.replicas.values() if r.retry_at > self.clock()]
            step = min(waits) if waits else 1.0
            if deadline is not None:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise NoReplicaAvailable(self._why_none(min_version))
                step = min(step, remaining)
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can lose a cancellation (relay.py)
                async with asyncio.timeout(max(step, 0.01)):
                    await self._changed.wait()

    def release(self, replica: Replica) -> None:
        replica.inflight = max(0, replica.inflight - 1)
        if replica.failures:
            self._notify()  # a half-open replica's trial is over, answered or not: the next request may go there

    def _why_none(self, min_version: int) -> str:
        if not self.replicas:
            return "no inference replicas are known (check inference.urls / discovery)"
        states = ", ".join(
            f"{r.url} version={r.version} "
            f"{'ok' if self.in_rotation(r) and not r.probe_failed else 'out: ' + (r.last_error or '?')}"
            for r in self.replicas.values()
        )
        return f"no replica in rotation serves version >= {min_version}: {states}"


# ---- discovery ----------------------------------------------------------------------------------
def static_endpoints(urls: list[str], control_urls: list[str] | None, control_port: int) -> list[Endpoint]:
    """`urls[i]` with `control_urls[i]`, or the URL's host with `control_port`."""
    if control_urls is not None and len(control_urls) != len(urls):
        raise ValueError(f"inference.control_urls has {len(control_urls)} entries for {len(urls)} urls")
    endpoints = []
    for i, url in enumerate(urls):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"inference.urls[{i}] = {url!r} is not an http(s) URL")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        control = control_urls[i] if control_urls is not None else f"{host}:{control_port}"
        endpoints.append(Endpoint(url=url.rstrip("/"), control=control))
    return endpoints


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve_dns(name: str, http_port: int, control_port: int) -> list[Endpoint]:
    """Every address `name` resolves to (a headless Service gives one per ready pod), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, http_port, type=socket.SOCK_STREAM)
    ips = sorted({info[4][0] for info in infos})
    return [Endpoint(url=f"http://{_host_port(ip, http_port)}", control=_host_port(ip, control_port)) for ip in ips]


def endpoints_from_slices(slices: Iterable[Any], http_port: int, control_port: int) -> list[Endpoint]:
    """Ready endpoints of EndpointSlices (kubernetes client objects or plain dicts of the API's JSON).

    Ports come from the slice's named ports `http` and `control` (or `grpc`) when present, so the
    Service definition stays the source of truth; the config ports are the fallback.
    """
    found: dict[str, Endpoint] = {}
    for s in slices:
        ports = {_get(p, "name"): _get(p, "port") for p in (_get(s, "ports") or [])}
        http = ports.get("http") or http_port
        control = ports.get("control") or ports.get("grpc") or control_port
        for ep in _get(s, "endpoints") or []:
            conditions = _get(ep, "conditions")
            if conditions is not None and _get(conditions, "ready") is False:
                continue  # not ready (starting, or terminating): no traffic
            for ip in _get(ep, "addresses") or []:
                e = Endpoint(url=f"http://{_host_port(ip, http)}", control=_host_port(ip, control))
                found[e.url] = e
    return [found[url] for url in sorted(found)]


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        camel = "".join(w if i == 0 else w.title() for i, w in enumerate(name.split("_")))
        return obj.get(name, obj.get(camel))
    return getattr(obj, name, None)


class Discovery:
    """Keeps a `ReplicaSet` in sync with a discovery source until `stop()`."""

    def __init__(self, replicas: ReplicaSet, on_removed: Callable[[list[Replica]], None] | None = None):
        self.replicas = replicas
        self.on_removed = on_removed or (lambda removed: None)
        self._task: asyncio.Task | None = None

    def apply(self, endpoints: list[Endpoint]) -> None:
        removed = self.replicas.set_endpoints(endpoints)
        if removed:
            self.on_removed(removed)

    async def start(self) -> None:
        """Resolve once (so replicas are known when this returns), then keep watching in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._watch(), name=f"discovery-{type(self).__name__}")

    async def refresh(self) -> None:
        pass

    async def _watch(self) -> None:
        pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class StaticDiscovery(Discovery):
    def __init__(self, replicas: ReplicaSet, endpoints: list[Endpoint], **kwargs):
        super().__init__(replicas, **kwargs)
        self.endpoints = endpoints

    async def refresh(self) -> None:
        self.apply(self.endpoints)


class DnsDiscovery(Discovery):
    """Re-resolves a (headless Service) name every `refresh_s`; a failed lookup keeps the last set."""

    def __init__(self, replicas: ReplicaSet, name: str, http_port: int, control_port: int, refresh_s: float, **kw):
        super().__init__(replicas, **kw)
        self.name, self.http_port, self.control_port, self.refresh_s = name, http_port, control_port, refresh_s

    async def refresh(self) -> None:
        try:
            self.apply(await resolve_dns(self.name, self.http_port, self.control_port))
        except OSError as e:
            log.warning("DNS lookup of %s failed (%s); keeping %d known replicas", self.name, e, len(self.replicas))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()


class KubernetesDiscovery(Discovery):
    """Watches the EndpointSlices of Service `service` (label `kubernetes.io/service-name`).

    The kubernetes client is synchronous: list+watch runs in a thread and hands each new endpoint
    set to the event loop. A dropped watch (timeout, 410 Gone, API restart) re-lists and re-watches.
    `api` is a `kubernetes.client.DiscoveryV1Api` (default: built from the in-cluster config).
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        service: str,
        namespace: str | None,
        http_port: int,
        control_port: int,
        *,
        api: Any = None,
        watch_timeout_s: int = 300,
        **kw,
    ):
        super().__init__(replicas, **kw)
        self.service, self.http_port, self.control_port = service, http_port, control_port
        self.namespace = namespace or _pod_namespace()
        self.api = api
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _make_api(self) -> Any:
        from kubernetes import client, config  # imported only for this discovery mode

        try:
            config.load_incluster_config()  # in a pod: its service account
        except config.ConfigException:  # outside a cluster: the kubeconfig (KUBECONFIG, ~/.kube/config)
            config.load_kube_config()
        return client.DiscoveryV1Api()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        first = asyncio.Event()
        if self.api is None:
            self.api = self._make_api()

        def deliver(endpoints: list[Endpoint]) -> None:
            self.apply(endpoints)
            first.set()

        self._thread = threading.Thread(
            target=self._run, args=(lambda eps: loop.call_soon_threadsafe(deliver, eps),), daemon=True
        )
        self._thread.start()
        try:
            async with asyncio.timeout(30):
                await first.wait()
        except TimeoutError:
            log.warning("no EndpointSlices of service %s/%s within 30s; waiting on", self.namespace, self.service)

    def _run(self, deliver: Callable[[list[Endpoint]], None]) -> None:
        from kubernetes import watch

        selector = f"kubernetes.io/service-name={self.service}"
        backoff = 1.0
        while not self._stop.is_set():
            try:
                listed = self.api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {s.metadata.name: s for s in listed.items}
                deliver(endpoints_from_slices(slices.values(), self.http_port, self.control_port))
                w = watch.Watch()
                for event in w.stream(
                    self.api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=self.watch_timeout_s,
                ):
                    if self._stop.is_set():
                        w.stop()
                        return
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        slices.pop(obj.metadata.name, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        slices[obj.metadata.name] = obj
                    else:
                        continue  # BOOKMARK / ERROR: nothing to apply (an ERROR ends the stream, we re-list)
                    deliver(endpoints_from_slices(slices.values(), self.http_port, self.control_port))
                backoff = 1.0
            except Exception as e:  # API unavailable, 410 Gone, ...: re-list after a pause
                log.warning("EndpointSlice watch of %s/%s failed: %s; retrying", self.namespace, self.service, e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 1.0)  # a blocked watch ends at its own timeout
            self._thread = None


def _pod_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError:
        return "default"


def make_discovery(cfg: Any, replicas: ReplicaSet, **kwargs) -> Discovery:
    """A `Discovery` for `OrchestratorConfig.inference`."""
    if cfg.discovery == "static":
        return StaticDiscovery(replicas, static_endpoints(cfg.urls, cfg.control_urls, cfg.control_port), **kwargs)
    if cfg.discovery == "dns":
        if not cfg.dns_name:
            raise ValueError("inference.discovery = 'dns' needs inference.dns_name")
        return DnsDiscovery(replicas, cfg.dns_name, cfg.http_port, cfg.control_port, cfg.refresh_s, **kwargs)
    if cfg.discovery == "kubernetes":
        if not cfg.kubernetes_service:
            raise ValueError("inference.discovery = 'kubernetes' needs inference.kubernetes_service")
        return KubernetesDiscovery(
            replicas, cfg.kubernetes_service, cfg.namespace, cfg.http_port, cfg.control_port, **kwargs
        )
    raise ValueError(f"unknown inference.discovery {cfg.discovery!r}")
