"""What an answer says about the version its replica serves, through a real uvicorn server and the official
`openai` client: a replica that failed is trusted with a version again only on evidence (a probe, an update, or an
answer that reports its versions), never on the version the client tagged an answer without versions with (vLLM)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from gyre.envs import SamplingParams
from gyre.net import free_port
from gyre_orchestrator.bench import _echo_app
from gyre_orchestrator.client import InferenceClient
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from support.asgi import serving


def answering(version: int | None, arrived: threading.Event | None = None, release: threading.Event | None = None):
    """The bench's echo server, its answers from policy `version` (None: no versions in them, as vLLM's). With
    `arrived` and `release`, a chat answer sets `arrived` and is held until `release` is set."""

    async def app(scope, receive, send):
        async def rewriting(message):
            chat = scope["path"].endswith("/chat/completions")
            if message["type"] == "http.response.start" and release is not None and chat:
                arrived.set()
                await asyncio.to_thread(release.wait, 60)
            if message["type"] == "http.response.body" and chat:
                body = json.loads(message["body"])
                for choice in body["choices"]:
                    for key in ("policy_version_min", "policy_version_max"):
                        choice.pop(key)
                        if version is not None:
                            choice[key] = version
                message = {**message, "body": json.dumps(body).encode()}
            await send(message)

        await _echo_app(scope, receive, rewriting)

    return app


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("version", "confirmed"), [(None, False), (1, False), (2, True)])
def test_an_answer_confirms_a_failed_replicas_version_only_when_it_reports_it(version, confirmed):
    port = free_port()

    async def scenario():
        replicas = ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1:1")], cooldown_s=0.01)
        (replica,) = list(replicas)
        replicas.mark_ok(replica, version=2)
        replicas.mark_failed(replica, "connection refused")  # restarted? its version is no longer known
        await asyncio.sleep(0.02)  # the cooldown is over: back in rotation, for floor-0 requests only
        client = InferenceClient(replicas, model="m")
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4)
        turn = await client.for_version(0).chat([{"role": "user", "content": "hi"}], sampling=sampling)
        return turn.policy_version_max, [r.url for r in replicas.eligible(2)], replicas.probe_requested

    with serving(answering(version), port):
        tagged, eligible, probe = asyncio.run(scenario())
    assert tagged == (2 if version is None else version)
    assert bool(eligible) is confirmed
    assert probe is (version == 1)  # an older version than known: the relay is asked to probe now


@pytest.mark.timeout(60)
def test_an_answer_without_versions_is_as_old_as_the_version_its_request_was_sent_to():
    # audit: an answer without versions (vLLM) was tagged with the replica's version known when it came back, so a
    # completion the relay's swap from 3 to 4 interrupted was taken for version 4's alone and passed the floor 4
    port, arrived, release = free_port(), threading.Event(), threading.Event()

    async def scenario():
        replicas = ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1:1")])
        (replica,) = list(replicas)
        replicas.mark_ok(replica, version=3)
        client = InferenceClient(replicas, model="m")
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4)
        chat = asyncio.create_task(client.for_version(3).chat([{"role": "user", "content": "hi"}], sampling=sampling))
        # the swap lands once the request is at the replica, whose answer waits for it: a fixed 0.5 s (against an
        # answer 1.5 s late) could be the client still setting up on a loaded machine, the request then sent to 4
        assert await asyncio.to_thread(arrived.wait, 30), "the request never reached the replica"
        replicas.mark_ok(replica, version=4)  # the relay's UpdateWeights(4) returned while the request generated
        release.set()
        turn = await chat
        return turn.policy_version_min, turn.policy_version_max

    try:
        with serving(answering(None, arrived, release), port):
            assert asyncio.run(scenario()) == (3, 4)
    finally:
        release.set()  # a failed scenario does not leave the server's answer held
