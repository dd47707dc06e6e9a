"""gRPC gyre.v1.Trainer status + health + reflection, and the gyre_trainer_* Prometheus metrics."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from gyre.v1 import trainer_pb2, trainer_pb2_grpc
from gyre_trainer.metrics import TrainerMetrics, serve
from gyre_trainer.server import SERVICE_NAME, TrainerServer, TrainerStatus


@pytest.fixture
def server():
    srv = TrainerServer(TrainerStatus(world_size=2), "127.0.0.1", 0)
    srv.start()
    yield srv
    srv.stop(grace=0)


def test_status_and_health(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        server.set_serving(True)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING

        stub = trainer_pb2_grpc.TrainerStub(channel)
        assert stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5).step == 0
        server.status.update(step=3, tokens=100, run="r")
        server.status.update(step=4, tokens=50, run="r")
        reply = stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)
        assert (reply.step, reply.tokens, reply.world_size) == (4, 150, 2)
        assert reply.last_step_unix > 0
        assert [(r.name, r.step, r.tokens, r.finished) for r in reply.runs] == [("r", 4, 150, False)]

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"gyre.v1.Trainer", "grpc.health.v1.Health"} <= names


def test_metrics_exposition():
    metrics = TrainerMetrics("exp1")
    record = {"step": 3, "loss": 0.25, "entropy": 2.0, "mismatch_kl": 0.01, "grad_norm": 1.5, "lr": 1e-5,
              "ratio_mean": 0.98, "ratio_min": 0.125, "ratio_max": 7.5,
              "num_tokens": 640, "step_seconds": 0.7, "time": 1234.0}  # fmt: skip
    metrics.observe_step(record, mfu_per_rank=[0.31, 0.29])
    metrics.observe_step({**record, "step": 4, "loss": None}, mfu_per_rank=[0.3, 0.3])  # a missing value keeps the last
    # a skipped update (zero gradient, no valid loss token) is a trained step, and counted as skipped
    metrics.observe_step({**record, "step": 5, "skipped": 1.0, "skip_reason": "zero gradient"}, mfu_per_rank=[0.3, 0.3])
    server, port = serve(metrics.registry, 0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    lines = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"
    }
    assert lines['gyre_trainer_step{run_id="exp1"}'] == 5
    assert lines['gyre_trainer_loss{run_id="exp1"}'] == 0.25
    assert lines['gyre_trainer_tokens_total{run_id="exp1"}'] == 1920
    assert lines['gyre_trainer_skipped_updates_total{run_id="exp1"}'] == 1
    assert lines['gyre_trainer_mfu_ratio{rank="1",run_id="exp1"}'] == 0.3
    assert lines['gyre_trainer_step_duration_seconds_count{run_id="exp1"}'] == 3
    assert lines['gyre_trainer_last_step_timestamp_seconds{run_id="exp1"}'] == 1234.0
    # the trainer/inference probability ratio of the step record, as it is there
    ratios = {stat: lines[f'gyre_trainer_ratio_{stat}{{run_id="exp1"}}'] for stat in ("mean", "min", "max")}
    assert ratios == {"mean": 0.98, "min": 0.125, "max": 7.5}
    for name in ("entropy", "mismatch_kl", "grad_norm", "lr"):
        assert f'gyre_trainer_{name}{{run_id="exp1"}}' in lines
    assert "# TYPE gyre_trainer_weight_publish_seconds histogram" in text


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.parametrize("rank", [0, 1])
def test_every_node_answers_health_and_only_rank_0_serves_grpc(rank, tmp_path):
    """Every trainer pod (local rank 0 of each node) answers /health and /ready; gRPC is rank 0's."""
    import torch
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer.dist import DistContext
    from gyre_trainer.service import Trainer

    cfg = TrainerConfig(output_dir=str(tmp_path), server={"port": 0, "health_port": 0}, metrics={"port": 0})
    trainer = Trainer(cfg, DistContext(rank=rank, world_size=2, local_rank=0, device=torch.device("cpu")))
    trainer._start_servers()
    try:
        base = f"http://127.0.0.1:{trainer.health.port}"
        assert http_status(f"{base}/health") == 200
        assert http_status(f"{base}/ready") == 503  # not yet training
        trainer.health.ready.set()
        assert http_status(f"{base}/ready") == 200
        assert http_status(f"{base}/metrics") == 404
        assert (trainer.server is not None) == (rank == 0)
        assert (trainer.metrics_server is not None) == (rank == 0)
    finally:
        trainer._close()


def test_other_local_ranks_serve_no_health(tmp_path):
    import torch
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer.dist import DistContext
    from gyre_trainer.service import Trainer

    cfg = TrainerConfig(output_dir=str(tmp_path), server={"port": 0, "health_port": 0})
    trainer = Trainer(cfg, DistContext(rank=3, world_size=4, local_rank=1, device=torch.device("cpu")))
    trainer._start_servers()
    assert trainer.health is None and trainer.server is None
