"""Start-up, readiness and shutdown: probes before the model is loaded, graceful SIGTERM, exit statuses."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightsVersion
from support.inference import InferenceServer


@pytest.mark.asyncio
async def test_probes_say_not_ready_until_the_model_is_loaded(tiny_model, monkeypatch):
    """The same parts `gyre inference` wires (service.py), driven step by step in-process."""
    from gyre_inference import api
    from gyre_inference.api import AppState, create_app
    from gyre_inference.control import ControlServer
    from gyre_inference.metrics import InferenceMetrics
    from gyre_inference.service import _bind, _HTTPServer, _load
    from gyre_inference.text import ModelText
    from gyre_inference.torch_backend import TorchBackend

    backend = TorchBackend(tiny_model, threads=1)
    metrics = InferenceMetrics("lifecycle", backend)
    state = AppState("tiny", str(tiny_model), backend, metrics)
    control = ControlServer(backend, metrics, "tiny")
    control_port = await control.start("127.0.0.1", 0)
    sock = _bind("127.0.0.1", 0)
    http = _HTTPServer(uvicorn.Config(create_app(state), log_config=None, lifespan="off"))
    serving = asyncio.create_task(http.serve(sockets=[sock]))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{control_port}")
    health = health_pb2_grpc.HealthStub(channel)
    stub = inference_pb2_grpc.InferenceControlStub(channel)
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            while not http.started:
                await asyncio.sleep(0.01)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await stub.GetStatus(inference_pb2.GetInferenceStatusRequest(), timeout=10)).ready is False
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.UpdateWeights(
                    inference_pb2.UpdateWeightsRequest(version=WeightsVersion(1, "", "folder", "/w/step_1").to_proto()),
                    timeout=10,
                )
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await client.get("/health")).status_code == 200  # alive while loading
            assert (await client.get("/ready")).status_code == 503
            # vLLM's /ping answers as /ready: a SageMaker-style router must not send traffic to a loading server
            assert (await client.get("/ping")).status_code == 503 and (await client.post("/ping")).status_code == 503
            loading = await client.get("/v1/models")
            assert loading.status_code == 503 and loading.json()["error"]["code"] == "not_ready"
            # with a Retry-After, as the openai SDK honours it: its own backoff (about 0.5 s then 1 s) ends its
            # retries before most models are loaded
            assert loading.headers["retry-after"] == "5"
            monkeypatch.setattr(api, "LOADING_RETRY_AFTER_S", 2)
            started = time.monotonic()
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=1) as sdk:
                with pytest.raises(openai.InternalServerError, match="still loading"):
                    await sdk.models.list()
            assert time.monotonic() - started >= 2  # one retry, after the 2 s it was told

            await _load(state, backend, str(tiny_model), ModelText)
            await control.set_serving(True)
            answer = await health.Check(health_pb2.HealthCheckRequest(service="gyre.v1.InferenceControl"), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            assert (await client.get("/ready")).json()["policy_version"] == 0
            assert (await client.get("/ping")).status_code == 200 and (await client.post("/ping")).status_code == 200
            assert (await client.get("/v1/models")).status_code == 200
    finally:
        await channel.close()
        http.should_exit = True
        await serving
        await control.stop(0)
        await backend.shutdown()


def test_sigterm_lets_in_flight_streams_finish_then_exits_cleanly(tiny_model, tmp_path):
    server = InferenceServer(tiny_model, log_dir=tmp_path)
    result: dict = {}

    def stream():
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
            chunks = client.completions.create(model=server.model_name, prompt=[5, 6, 7], max_tokens=1000, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
            result["tokens"] = 0
            for chunk in chunks:
                result["tokens"] += len(chunk.choices[0].model_extra.get("token_ids", []))
            result["finish"] = chunk.choices[0].finish_reason

    worker = threading.Thread(target=stream)
    worker.start()
    while result.get("tokens", 0) < 3:
        time.sleep(0.02)
        assert worker.is_alive() or result.get("tokens", 0) >= 3, server.log()
    server.proc.send_signal(signal.SIGTERM)
    # draining: readiness goes down while the stream keeps going
    # (the stream is as long as the context allows, and its state is read the moment readiness goes down: on a
    # loaded 2-core CI machine a 150-token stream once finished before the first /ready answer came back)
    deadline, unready, streaming = time.monotonic() + 10, False, False
    while time.monotonic() < deadline and not unready:
        try:
            ready = httpx.get(f"{server.url}/ready", timeout=2)
            unready = ready.status_code == 503
            assert not unready or ready.headers["retry-after"] == "1"  # the replica goes away: retry soon, elsewhere
        except httpx.TransportError:
            unready = True  # the listener is already closed: not taking new work either
        streaming = worker.is_alive()
        time.sleep(0.05)
    assert unready and streaming, "the stream must still be running while the server drains"
    worker.join(timeout=120)
    assert result == {"tokens": 1000, "finish": "length"}
    assert server.stop(timeout=60) == 0
    log = server.log()
    assert "shutting down" in log and "stopped" in log


def test_requests_that_outlast_the_grace_end_with_a_503_and_an_error_event(tiny_model, tmp_path):
    """Grace 1 s, a request and a stream that need far longer: at the grace the engine stops, so the request gets a
    503 not_ready (which the openai SDK retries) and the stream an error event the SDK raises. uvicorn cancelled
    them instead: a bare 500 "Internal Server Error", a stream cut mid-chunk (RemoteProtocolError), and a traceback
    per request in the log plus "_GatheringFuture exception was never retrieved"."""
    server = InferenceServer(tiny_model, "--server.shutdown-grace-s", "1", log_dir=tmp_path)
    long = {"max_tokens": 1000, "extra_body": {"ignore_eos": True}}  # 16 rows of 1000 steps: many seconds here
    results: dict = {}

    def plain():
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as client:
            try:
                client.completions.create(model=server.model_name, prompt=[5, 6, 7], n=8, **long)
            except Exception as error:  # noqa: BLE001 - what the client gets is the result
                results["plain"] = error

    def stream():
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as client:
            try:
                for _chunk in client.completions.create(model=server.model_name, prompt=[5, 6], n=8, stream=True,
                                                       **long):  # fmt: skip
                    results["streaming"] = True
            except Exception as error:  # noqa: BLE001
                results["stream"] = error

    workers = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 30
    while not (results.get("streaming") and server.status().running >= 16) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.status().running >= 16, server.tail()
    server.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.join(timeout=30)
    assert server.stop(timeout=30) == 0
    plain_error, stream_error = results.get("plain"), results.get("stream")
    assert isinstance(plain_error, openai.InternalServerError) and plain_error.status_code == 503, repr(plain_error)
    assert plain_error.body["code"] == "not_ready" and plain_error.response.headers["retry-after"] == "1"
    assert type(stream_error) is openai.APIError and "not running" in stream_error.message, repr(stream_error)
    log = server.log()
    assert "stopping the engine" in log
    for noise in ("Traceback", "Exception in ASGI application", "never retrieved", "running task(s)"):
        assert noise not in log, log


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre.cli", "inference", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_bad_config_exits_2_naming_the_key():
    result = run_cli("--engine.max-batch-size", "0")
    assert result.returncode == 2 and "engine.max_batch_size" in result.stderr
    result = run_cli("--engine.nope", "1")
    assert result.returncode == 2 and "engine.nope" in result.stderr
    help_text = run_cli("--help")
    assert help_text.returncode == 0 and "server.shutdown_grace_s" in help_text.stdout


def test_a_model_folder_that_is_not_there_exits_2_before_serving(tmp_path, tiny_model):
    """A missing folder, one without config.json or without weights, or a file: one line naming the key and
    the path, exit 2, before any port is bound (it was a hub client's "Repo id must be in the form ..." or a
    tokenizer error, logged after the HTTP server had started, exit 1)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text((tiny_model / "config.json").read_text())
    # config and weights without a tokenizer: it was transformers' "install sentencepiece or tiktoken", exit 1
    shutil.copytree(tiny_model, tmp_path / "no-tokenizer", ignore=shutil.ignore_patterns("tokenizer*"))
    cases = {
        tmp_path / "no-model": "does not exist",
        tmp_path / "empty": "no config.json",
        tmp_path / "no-weights": "holds no weights",
        tmp_path / "no-tokenizer": "holds no tokenizer (tokenizer.json, tokenizer.model",
        tiny_model / "config.json": "is a file",
    }
    for path, says in cases.items():
        result = run_cli("--model.name", str(path), "--server.port", "0", "--control.port", "0")
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"gyre inference: error: model.name = '{path}'"), lines
        assert says in lines[0]
    # a .gguf file with the vLLM backend passed the check ("vLLM reads a .gguf"), then failed after start: the
    # tokenizer and configs are read from a folder ("the config file at ... is not a valid JSON file", exit 1)
    (tmp_path / "m.Q4_1.gguf").write_bytes(b"GGUF")
    result = run_cli("--backend", "vllm", "--model.name", str(tmp_path / "m.Q4_1.gguf"), "--server.port", "0",
                     "--control.port", "0")  # fmt: skip
    assert result.returncode == 2 and "is a file, not a model folder (`gyre model import FILE" in result.stderr
    help_text = run_cli("--help").stdout
    assert "lacks config.json, weights or a tokenizer stops the service at start" in " ".join(help_text.split())


def test_a_relative_folder_that_reads_as_a_hub_id_says_it_is_no_local_folder_either(tmp_path):
    """`models/qwen` (a typo of a relative folder, or a folder on a volume not mounted) has a hub id's shape: the
    hub's "couldn't connect ... cached files" alone did not say that no such folder exists here."""
    import os

    result = subprocess.run([sys.executable, "-m", "gyre.cli", "inference", "--model.name", "models/not-here",
                             "--server.port", "0", "--control.port", "0"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    # refused by the start-up check (exit 2, nothing started): offline, a hub id that is not in the cache is no model
    assert result.returncode == 2, result.stderr
    assert "model.name = 'models/not-here' is not a local folder, and as a Hugging Face hub id it cannot be " \
        "fetched (HF_HUB_OFFLINE is set, and it is not in the hub cache" in result.stderr, result.stderr  # fmt: skip
    assert "Check your internet connection" not in result.stderr  # the hub client's advice, a line of its own


def test_a_missing_folder_the_hub_would_refuse_as_a_repo_id_is_a_missing_folder(tmp_path):
    """`run-1/model-`, `runs/a--b`, `out/model.git`, `model-` (no such folder here) have our hub id shape but are repo
    ids the hub client refuses: they were sent to it and the service logged its "Repo id must use alphanumeric chars
    ..." and exited 1; now they are the missing folder they are, one line naming the key and the path, exit 2."""
    for name in ("run-1/model-", "runs/a--b", "out/model.git", "model-"):
        result = subprocess.run([sys.executable, "-m", "gyre.cli", "inference", "--model.name", name,
                                 "--server.port", "0", "--control.port", "0"], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path)  # fmt: skip
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"gyre inference: error: model.name = '{name}': the model folder ") and (
            "does not exist" in lines[0]
        ), lines  # fmt: skip


def test_a_model_that_cannot_be_loaded_exits_1_with_a_clear_message(tmp_path, tiny_model):
    import shutil

    broken = shutil.copytree(tiny_model, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    result = run_cli("--model.name", str(broken), "--server.port", "0", "--control.port", "0")
    assert result.returncode == 1 and "cannot load model" in result.stderr and "broken" in result.stderr


def test_a_bind_failure_names_the_option_to_change(tiny_model):
    """A busy port names its port option; a host that is no address of this machine (192.0.2.1, TEST-NET-1) names
    its host option (it was "--server.port; 0 picks a free port" for both). Exit 1, one error line, no traceback."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("--model.name", str(tiny_model), "--server.port", str(port), "--control.port", "0")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(port) in result.stderr and "--server.port" in result.stderr
    for option in ("server", "control"):
        result = run_cli("--model.name", str(tiny_model), f"--{option}.host", "192.0.2.1", "--server.port", "0",
                         "--control.port", "0")  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"set --{option}.host to one of its addresses" in result.stderr and "--server.port" not in result.stderr
