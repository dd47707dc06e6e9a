"""ReplicaSet routing and health, and the three discovery modes (static, DNS, Kubernetes EndpointSlices).

The Kubernetes watch runs the real `kubernetes` client (list + watch over HTTP) against a small HTTP
server that speaks the EndpointSlice API (`support.kube_api`): the JSON list and the watch stream.
"""

from __future__ import annotations

import asyncio

import pytest
from gyre_orchestrator.replicas import (
    DnsDiscovery,
    Endpoint,
    KubernetesDiscovery,
    NoReplicaAvailable,
    ReplicaSet,
    endpoints_from_slices,
    static_endpoints,
)
from support.kube_api import FakeKubeAPI, slice_json


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def two(clock=None) -> ReplicaSet:
    return ReplicaSet(
        [Endpoint("http://a:1", "a:2"), Endpoint("http://b:1", "b:2")], cooldown_s=5, max_cooldown_s=20,
        clock=clock or Clock(),
    )  # fmt: skip


@pytest.mark.asyncio
async def test_least_inflight_wins():
    rs = two()
    first = await rs.acquire()
    second = await rs.acquire()
    assert {first.url, second.url} == {"http://a:1", "http://b:1"}  # spread, not piled on one
    rs.release(first)
    assert (await rs.acquire()).url == first.url


@pytest.mark.asyncio
async def test_failed_replica_leaves_rotation_and_comes_back_after_cooldown():
    clock = Clock()
    rs = two(clock)
    a = rs.replicas["http://a:1"]
    rs.mark_failed(a, "connection refused")
    rs.mark_failed(a, "connection refused")  # same outage (still out): not escalated
    assert a.failures == 1 and not rs.in_rotation(a)
    assert [r.url for r in rs.eligible()] == ["http://b:1"]
    clock.now += 5
    assert rs.in_rotation(a)  # half-open: eligible again
    rs.mark_failed(a, "still down")
    assert a.failures == 2 and a.retry_at == clock.now + 10  # cooldown doubles
    for _ in range(5):
        clock.now = a.retry_at
        rs.mark_failed(a, "down")
    assert a.retry_at - clock.now == 20  # capped
    rs.mark_ok(a, version=3)
    assert rs.in_rotation(a) and a.failures == 0 and a.version == 3


@pytest.mark.asyncio
async def test_a_replica_back_from_its_cooldown_takes_one_request_until_it_answers():
    clock = Clock()
    rs = two(clock)
    a, b = rs.replicas["http://a:1"], rs.replicas["http://b:1"]
    for _ in range(3):
        await rs.acquire()  # b is busy: the fewest requests in flight would pick a for everything
    rs.mark_failed(a, "GetStatus: DEADLINE_EXCEEDED")
    a.inflight = 0  # its requests abandoned
    clock.now = a.retry_at  # half-open
    assert await rs.acquire() is a  # the trial
    assert [await rs.acquire() for _ in range(3)] == [b, b, b]  # not a, though it has the fewest in flight
    rs.release(a)  # the trial came back without an answer (abandoned): another may try
    assert await rs.acquire() is a
    rs.mark_ok(a)  # it answered: in full rotation again
    assert await rs.acquire() is a


def test_a_replica_whose_probe_failed_takes_no_request_until_a_probe_answers():
    clock = Clock()
    rs = two(clock)
    a, b = rs.replicas["http://a:1"], rs.replicas["http://b:1"]
    rs.mark_failed(a, "GetStatus: DEADLINE_EXCEEDED", probe=True)  # frozen
    clock.now = a.retry_at + 100
    assert rs.in_rotation(a)  # probed again...
    assert rs.eligible(0) == [b]  # ...but no request: back untested, it took one that waited for the next probe
    rs.mark_ok(a, version=0)  # a probe answered
    assert rs.eligible(0) == [a, b]
    rs.mark_failed(b, "connection refused")  # a request's failure: half-open after the cooldown, as before
    clock.now = b.retry_at
    assert rs.eligible(0) == [a, b]


@pytest.mark.asyncio
async def test_abandoning_a_replica_cancels_its_calls_only_when_another_can_take_them():
    clock = Clock()
    rs = two(clock)
    a, b = rs.replicas["http://a:1"], rs.replicas["http://b:1"]
    calls = [asyncio.create_task(asyncio.sleep(60)) for _ in range(3)]
    a.calls.update(calls)
    rs.mark_failed(a, "GetStatus: DEADLINE_EXCEEDED")
    rs.mark_failed(b, "down")
    assert rs.abandon(a) == 0  # b is out too: a lone replica that is only slow keeps its requests
    assert not any(c.done() for c in calls)
    clock.now = b.retry_at  # b back in rotation: a's requests go there
    assert rs.abandon(a) == 3
    await asyncio.gather(*calls, return_exceptions=True)
    assert all(c.cancelled() for c in calls)


@pytest.mark.asyncio
async def test_min_version_routing_and_waiting():
    rs = ReplicaSet([Endpoint("http://a:1", "a:2"), Endpoint("http://b:1", "b:2")])
    a, b = rs.replicas["http://a:1"], rs.replicas["http://b:1"]
    rs.mark_ok(a, version=1)
    assert (await rs.acquire(min_version=0)) in (a, b)
    assert (await rs.acquire(min_version=1)) is a  # b's version is unknown: not trusted for >= 1
    waiter = asyncio.create_task(rs.acquire(min_version=2, timeout=5))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    rs.mark_ok(b, version=2)
    assert await asyncio.wait_for(waiter, 1) is b
    with pytest.raises(NoReplicaAvailable, match="version >= 3"):
        await rs.acquire(min_version=3, timeout=0.05)


@pytest.mark.asyncio
async def test_a_replica_back_from_its_cooldown_is_trusted_with_no_version_until_a_probe_says_which():
    # audit: a replica that failed (killed, then restarted on the base model) came back into rotation when its
    # cooldown ended still "serving" the version known from before: requests of floor 2 went to a replica serving
    # 0, max_healthy_version counted it, and the relay's wait_served(2) said every replica served 2
    clock = Clock()
    rs = two(clock)
    a, b = rs.replicas["http://a:1"], rs.replicas["http://b:1"]
    rs.mark_ok(a, version=2)
    rs.mark_ok(b, version=1)
    rs.mark_failed(a, "connection refused")  # the process died
    clock.now += 5
    assert rs.in_rotation(a) and a.version == 2  # half-open: back in rotation, its old version unconfirmed
    assert rs.eligible(2) == [] and [r.url for r in rs.eligible(1)] == ["http://b:1"]
    assert {r.url for r in rs.eligible(0)} == {"http://a:1", "http://b:1"}  # the base model's requests: anyone
    assert rs.max_healthy_version() == 1
    rs.mark_ok(a)  # a request succeeded: alive, but which version it serves is still unknown
    assert a.failures == 0 and rs.eligible(2) == []
    waiter = asyncio.create_task(rs.acquire(min_version=1, timeout=5))
    await asyncio.sleep(0)
    rs.mark_ok(a, version=0)  # the relay's probe: restarted on the base model
    assert rs.eligible(1) == [b] and rs.max_healthy_version() == 1
    assert await asyncio.wait_for(waiter, 1) is b
    rs.release(b)  # its request done (a half-open replica with one in flight takes no other)
    rs.mark_ok(a, version=2)  # updated by the relay (its reply says so)
    assert rs.eligible(2) == [a] and rs.max_healthy_version() == 2
    rs.mark_failed(b, "timeout")
    clock.now += 5
    rs.observe_version(b, 1)  # a floor-0 completion from version 1: it serves 1 now
    assert rs.eligible(1) == [a, b]


@pytest.mark.asyncio
async def test_observed_versions_only_go_up():
    rs = two()
    a = rs.replicas["http://a:1"]
    rs.observe_version(a, 4)
    rs.observe_version(a, 3)  # a completion that finished before a swap, arriving late, or a restart
    assert a.version == 4 and rs.probe_requested  # not lowered, but the relay is asked to probe now
    rs.mark_ok(a, version=0)  # the relay's GetStatus is authoritative: a restarted replica
    assert a.version == 0


@pytest.mark.asyncio
async def test_membership_changes():
    rs = two()
    removed = rs.set_endpoints([Endpoint("http://b:1", "b:2"), Endpoint("http://c:1", "c:2")])
    assert [r.url for r in removed] == ["http://a:1"]
    assert sorted(rs.replicas) == ["http://b:1", "http://c:1"]
    with pytest.raises(NoReplicaAvailable, match="no inference replicas"):
        await ReplicaSet().acquire(timeout=0.01)


def test_static_endpoints():
    eps = static_endpoints(["http://10.0.0.1:8000/", "http://[::1]:8001"], None, 50051)
    assert eps == [Endpoint("http://10.0.0.1:8000", "10.0.0.1:50051"), Endpoint("http://[::1]:8001", "[::1]:50051")]
    assert static_endpoints(["http://h:1"], ["h:9"], 0) == [Endpoint("http://h:1", "h:9")]
    with pytest.raises(ValueError, match="control_urls"):
        static_endpoints(["http://h:1"], [], 1)
    with pytest.raises(ValueError, match="not an http"):
        static_endpoints(["h:1"], None, 1)


@pytest.mark.asyncio
async def test_dns_discovery_resolves_every_address():
    rs = ReplicaSet()
    discovery = DnsDiscovery(rs, "localhost", 8000, 50051, refresh_s=0.05)
    await discovery.start()
    try:
        assert "http://127.0.0.1:8000" in rs.replicas
        assert rs.replicas["http://127.0.0.1:8000"].endpoint.control == "127.0.0.1:50051"
        discovery.name = "no-such-host.invalid"  # lookups fail: the last known set is kept
        await asyncio.sleep(0.2)
        assert "http://127.0.0.1:8000" in rs.replicas
    finally:
        await discovery.stop()


def test_endpoints_from_slices_keeps_ready_ones_and_uses_named_ports():
    eps = endpoints_from_slices(
        [slice_json("a", {"10.0.0.2": True, "10.0.0.3": False}, http=9000, control=9001), slice_json("b", {})],
        8000, 50051,
    )  # fmt: skip
    assert eps == [Endpoint("http://10.0.0.2:9000", "10.0.0.2:9001")]


async def wait_for(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_kubernetes_endpointslice_watch():
    from kubernetes import client

    fake = FakeKubeAPI()
    fake.slices["s1"] = slice_json("s1", {"10.1.0.1": True, "10.1.0.2": False})
    api = client.DiscoveryV1Api(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{fake.port}")))
    rs = ReplicaSet()
    discovery = KubernetesDiscovery(rs, "inf", "gyre", 8000, 50051, api=api, watch_timeout_s=5)
    try:
        await discovery.start()
        assert sorted(rs.replicas) == ["http://10.1.0.1:8000"]  # only the ready endpoint
        # a pod becomes ready, a new slice appears, then the first slice is deleted
        fake.events.put({"type": "MODIFIED", "object": slice_json("s1", {"10.1.0.1": True, "10.1.0.2": True})})
        await wait_for(lambda: sorted(rs.replicas) == ["http://10.1.0.1:8000", "http://10.1.0.2:8000"])
        fake.events.put({"type": "ADDED", "object": slice_json("s2", {"10.2.0.1": True})})
        await wait_for(lambda: "http://10.2.0.1:8000" in rs.replicas)
        fake.events.put({"type": "DELETED", "object": slice_json("s1", {})})
        await wait_for(lambda: sorted(rs.replicas) == ["http://10.2.0.1:8000"])
        assert rs.replicas["http://10.2.0.1:8000"].endpoint.control == "10.2.0.1:50051"
        # the watch resumed from the list's resourceVersion
        assert any(r.get("watch") in ("true", "True") and r.get("resourceVersion") == "10" for r in fake.requests)
        assert fake.errors == []
    finally:
        await discovery.stop()
        fake.close()
