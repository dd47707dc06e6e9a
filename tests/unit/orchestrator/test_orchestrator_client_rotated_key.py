"""The policy's key (`inference.api_key_file`, a mounted Secret) rotated in place is taken up without a restart.

The kubelet rewrites a mounted Secret's file when the Secret is updated; the orchestrator read the file once, at
start, so once the replicas took the new key every request was a 401 until the orchestrator restarted. A 401/403
now reads the file again and, when the key has changed, asks once more with it (as the judges' `Endpoint` does);
an unchanged key fails as before, at once, naming the setting. A real uvicorn server checks the bearer key here,
and the config is loaded as the chart gives it (GYRE_INFERENCE__API_KEY_FILE).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from gyre.config.loader import reveal
from gyre.config.orchestrator import GyreEvalConfig, OrchestratorConfig
from gyre.envs import SamplingParams
from gyre.net import free_port
from gyre_orchestrator.bench import _echo_app
from gyre_orchestrator.client import InferenceClient, InferenceError
from gyre_orchestrator.eval_command import wait_for_inference
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from support.asgi import serving

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4)
CHAT = [{"role": "user", "content": "hi"}]


def keyed_app(server: dict):
    """The bench's echo server behind a bearer key (`server["key"]`), recording the key of each request
    but the end-of-turn probe's."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await _echo_app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"authorization", b"").decode().removeprefix("Bearer ")
        if not scope["path"].endswith("tokenize"):  # not the client's end-of-turn probe (/tokenize, /detokenize)
            server["seen"].append(sent)
        if sent != server["key"]:
            body = json.dumps({"error": {"message": "invalid api key", "type": "invalid_request_error"}}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            return await send({"type": "http.response.body", "body": body})
        return await _echo_app(scope, receive, send)

    return app


def client_for(cfg, port: int) -> InferenceClient:
    """The client as the orchestrator's service and `gyre eval` build it."""
    inf = cfg.inference
    replicas = ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1:1")])
    return InferenceClient(replicas, model="m", api_key=reveal(inf.api_key), retries=3, backoff_s=0.01,
                           reread_key=lambda: inf.reread_secret("api_key"))  # fmt: skip


@pytest.mark.timeout(60)
def test_a_key_rotated_in_place_is_read_again_after_a_401(tmp_path, monkeypatch):
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-old\n")
    monkeypatch.setenv("GYRE_INFERENCE__API_KEY_FILE", str(key_file))  # as the chart mounts it
    cfg = OrchestratorConfig()
    port, server = free_port(), {"key": "sk-old", "seen": []}

    async def scenario():
        client = client_for(cfg, port)
        await client.chat(CHAT, sampling=SAMPLING)
        server["key"] = "sk-new"  # the replicas restarted with the rotated Secret...
        key_file.write_text("sk-new\n")  # ...which the kubelet wrote into the orchestrator's mount
        await client.for_version(0).chat(CHAT, sampling=SAMPLING)
        await client.chat(CHAT, sampling=SAMPLING)  # the new key from now on: no 401 first
        assert client.api_key == "sk-new" and client.stats["retries"] == 0  # asked again at once, not a retry

    with serving(keyed_app(server), port):
        asyncio.run(scenario())
    assert server["seen"] == ["sk-old", "sk-old", "sk-new", "sk-new"]


@pytest.mark.timeout(60)
def test_a_key_that_has_not_changed_fails_at_once_naming_the_setting(tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-old\n")
    cfg = OrchestratorConfig(inference={"api_key_file": str(key_file)})
    port, server = free_port(), {"key": "sk-new", "seen": []}

    async def scenario():
        with pytest.raises(InferenceError, match=r"401 .*inference.api_key_file"):
            await client_for(cfg, port).chat(CHAT, sampling=SAMPLING)
        key_file.unlink()  # a key that can no longer be read: the refusal, and why
        with pytest.raises(InferenceError, match=r"401 .*re-reading the key: api_key_file = .*cannot read"):
            await client_for(cfg, port).chat(CHAT, sampling=SAMPLING)

    with serving(keyed_app(server), port):
        asyncio.run(scenario())
    assert server["seen"] == ["sk-old", "sk-old"]  # one request each: a refused key is not retried


@pytest.mark.timeout(60)
def test_gyre_evals_startup_wait_takes_a_rotated_key_up(tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-old\n")
    cfg = GyreEvalConfig(inference={"api_key_file": str(key_file)})
    port, server = free_port(), {"key": "sk-new", "seen": []}
    key_file.write_text("sk-new\n")  # rotated after the config was read

    async def scenario():
        client = client_for(cfg, port)
        client.model = None  # the wait asks /v1/models
        await wait_for_inference(client, 10.0, poll_s=0.05)

    with serving(keyed_app(server), port):
        asyncio.run(scenario())
    assert server["seen"][:2] == ["sk-old", "sk-new"]


def test_gyre_orchestrator_stops_on_a_refused_key_or_model_with_one_line(tmp_path, monkeypatch, caplog):
    # it was "orchestrator failed" and a traceback three exceptions deep, after every rollout's attempts
    import gyre_orchestrator.service as service_module
    from gyre_orchestrator import main as main_module
    from gyre_orchestrator.client import SetupRefused

    refusal = "http://r:8000 rejected the request: 401 bad key (check inference.api_key / inference.api_key_file)"

    class Refused:
        def __init__(self, cfg):
            pass

        async def run(self):
            raise SetupRefused(refusal)

    monkeypatch.setattr(service_module, "OrchestratorService", Refused)
    with caplog.at_level("ERROR", logger="gyre_orchestrator"):
        assert asyncio.run(main_module.serve(OrchestratorConfig(output_dir=str(tmp_path)))) == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == [refusal] and errors[0].exc_info is None


@pytest.mark.timeout(60)
def test_a_404_is_a_setup_mistake_only_before_any_answer():
    """A model the server never served is the configuration's fault: stop at once. A 404 after answers is a replica
    that lost a named adapter (its pod restarted): an `InferenceError`, so the rollout is generated again, not the
    run's end."""
    from gyre_orchestrator.client import SetupRefused

    port, server = free_port(), {"missing": True}

    async def app(scope, receive, send):
        if scope["type"] == "http" and server["missing"]:
            body = json.dumps({"error": {"message": "model 'm' not found", "type": "NotFoundError"}}).encode()
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            return await send({"type": "http.response.body", "body": body})
        return await _echo_app(scope, receive, send)

    async def scenario():
        client = client_for(OrchestratorConfig(), port)
        with pytest.raises(SetupRefused, match=r"404 .*inference.model = 'm'"):
            await client.chat(CHAT, sampling=SAMPLING)
        server["missing"] = False
        await client.chat(CHAT, sampling=SAMPLING)
        server["missing"] = True  # the replica lost the model it served
        with pytest.raises(InferenceError, match=r"404") as raised:
            await client.chat(CHAT, sampling=SAMPLING)
        assert not isinstance(raised.value, SetupRefused)

    with serving(app, port):
        asyncio.run(scenario())
