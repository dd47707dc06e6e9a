"""The shared gRPC scaffold (`gyre.grpc_server`): health lifecycle, open health/reflection, token auth
and bind errors, for both the asyncio and the threaded server (real servers on free ports)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from gyre.grpc_server import AioGrpcServer, ThreadedGrpcServer
from gyre.v1 import trainer_pb2, trainer_pb2_grpc

NAME = "gyre.v1.Trainer"
TOKEN = "s3cret"


class Servicer(trainer_pb2_grpc.TrainerServicer):
    def GetStatus(self, request, context):  # noqa: N802
        return trainer_pb2.GetTrainerStatusResponse(step=7)


def check(port: int, serving: bool) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        expected = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", NAME):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == expected
        # reflection needs no token either
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        assert NAME in {s.name for s in next(stream).list_services_response.service}
        stub = trainer_pb2_grpc.TrainerStub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as denied:
                stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), metadata=metadata, timeout=5)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {TOKEN}"),)
        assert stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), metadata=auth, timeout=5).step == 7


def test_threaded_server():
    server = ThreadedGrpcServer(NAME, token=TOKEN)
    trainer_pb2_grpc.add_TrainerServicer_to_server(Servicer(), server.server)
    port = server.start("127.0.0.1", 0)
    try:
        check(port, serving=False)
        server.set_serving(True)
        check(port, serving=True)
        other = ThreadedGrpcServer(NAME, what="the test server")
        with pytest.raises(OSError, match="cannot bind the test server to 192.0.2.1:0"):
            other.start("192.0.2.1", 0)  # TEST-NET-1: never an address of this machine
    finally:
        server.stop(0)


@pytest.mark.asyncio
async def test_aio_server():
    server = AioGrpcServer(NAME, token=TOKEN)
    trainer_pb2_grpc.add_TrainerServicer_to_server(Servicer(), server.server)
    port = await server.start("127.0.0.1", 0)
    try:
        await asyncio.to_thread(check, port, False)
        await server.set_serving(True)
        await asyncio.to_thread(check, port, True)
    finally:
        await server.stop(0)
