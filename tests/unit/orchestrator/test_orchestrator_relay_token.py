"""The relay's control calls: a rotated control token is taken up, and a refused or unanswered control names its
settings. A real gRPC InferenceControl server checks the bearer token here.

`inference.control_token_file` (a mounted Secret) was read once, at start: once the replicas took a rotated token,
every probe and weights update was UNAUTHENTICATED until the orchestrator restarted. A control port that never
answered (a vLLM user's `--inference.urls` alone: the control is taken at port 50051) said only "UNAVAILABLE:
failed to connect to all addresses", every few seconds, naming no setting.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from gyre.config.loader import reveal
from gyre.config.orchestrator import OrchestratorConfig
from gyre.transport import FolderStore
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre_orchestrator.relay import WeightRelay
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from gyre_orchestrator.scheduler import VersionWatch


class Control(inference_pb2_grpc.InferenceControlServicer):
    def __init__(self, token: str):
        self.token, self.seen = token, []

    async def GetStatus(self, request, context):  # noqa: N802
        sent = dict(context.invocation_metadata()).get("authorization", "").removeprefix("Bearer ")
        self.seen.append(sent)
        if sent != self.token:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid control token")
        return inference_pb2.GetInferenceStatusResponse(model="m", step=3, backend="t", ready=True)


def relay_for(cfg, replicas: ReplicaSet, tmp_path) -> WeightRelay:
    """The relay as the orchestrator's service builds it."""
    inf = cfg.inference
    token = reveal(inf.control_token)
    return WeightRelay(replicas, FolderStore(tmp_path / "store"), VersionWatch(0), control_token=token,
                       reread_token=lambda: inf.reread_secret("control_token"))  # fmt: skip


@pytest.mark.timeout(60)
def test_a_control_token_rotated_in_place_is_taken_up_by_the_next_probe(tmp_path, monkeypatch):
    token_file = tmp_path / "control-token"
    token_file.write_text("old\n")
    monkeypatch.setenv("GYRE_INFERENCE__CONTROL_TOKEN_FILE", str(token_file))  # as the chart mounts it
    cfg = OrchestratorConfig()

    async def scenario():
        control = Control("new")  # the replicas restarted with the rotated Secret...
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceControlServicer_to_server(control, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        replicas = ReplicaSet([Endpoint("http://127.0.0.1:1", f"127.0.0.1:{port}")])
        replica = next(iter(replicas))
        relay = relay_for(cfg, replicas, tmp_path)
        try:
            await relay.probe(replica)
            assert "check inference.control_token / control_token_file" in replica.last_error
            token_file.write_text("new\n")  # ...which the kubelet wrote into the orchestrator's mount
            await relay.probe(replica)
            assert "control_token_file changed: the next call sends the new token" in replica.last_error
            await relay.probe(replica)
            assert replica.version == 3 and replicas.in_rotation(replica)
        finally:
            await server.stop(None)
            await replica.clients.pop("channel").close()
        return control.seen

    assert asyncio.run(scenario()) == ["old", "old", "new"]


@pytest.mark.timeout(60)
def test_a_control_port_that_never_answered_names_the_settings(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        control = f"127.0.0.1:{closed.getsockname()[1]}"

    async def scenario():
        replicas = ReplicaSet([Endpoint("http://127.0.0.1:1", control)])
        replica = next(iter(replicas))
        relay = relay_for(OrchestratorConfig(), replicas, tmp_path)
        try:
            await relay.probe(replica)
            return replica.last_error
        finally:
            await replica.clients.pop("channel").close()

    error = asyncio.run(scenario())
    assert error.startswith("GetStatus: UNAVAILABLE"), error
    assert f"no answer from its control at {control} yet: check inference.control_urls / control_port" in error
