"""The orchestrator's HTTP client drops idle connections before the server does.

uvicorn (Gyre's server) and vLLM close an idle keep-alive connection after 5 s; httpx keeps one for 5 s
too. At equal timeouts a request sometimes goes out on a connection the server is closing, fails as a
connection error, and takes a healthy replica out of rotation (seen in long CPU runs as
"replica ... failed (APIConnectionError)"). The client's expiry must be well below the server's.
A real uvicorn server here, counting the TCP connections its requests arrive on.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from gyre.net import free_port
from gyre_orchestrator.client import KEEPALIVE_EXPIRY_S, InferenceClient
from gyre_orchestrator.replicas import Endpoint, Replica, ReplicaSet
from support.asgi import serving

SERVER_KEEPALIVE_S = 5  # uvicorn's default, and vLLM's


def _app(peers: list[tuple[str, int]]):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        peers.append(tuple(scope["client"]))
        body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "t"}]})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})

    return app


@pytest.mark.timeout(60)
def test_idle_connections_expire_before_the_servers_keep_alive():
    assert KEEPALIVE_EXPIRY_S <= SERVER_KEEPALIVE_S / 2  # margin for a loaded event loop on either side
    port, peers = free_port(), []

    async def scenario():
        replica = Replica(Endpoint(f"http://127.0.0.1:{port}", control="127.0.0.1:1"))
        openai_client = InferenceClient(ReplicaSet(), model="m")._new_openai(replica)
        try:
            await openai_client.models.list()
            await openai_client.models.list()  # back to back: the pooled connection is reused
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 1.0)  # idle: past the client's expiry, not the server's
            await openai_client.models.list()
        finally:
            await openai_client.close()

    with serving(_app(peers), port, timeout_keep_alive=SERVER_KEEPALIVE_S):
        asyncio.run(scenario())
    assert len(peers) == 3
    assert peers[0] == peers[1], "back-to-back requests should share a keep-alive connection"
    assert peers[2] != peers[1], "a connection idle past the client's expiry must not be reused"
