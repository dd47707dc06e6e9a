"""gRPC control of a real server: weight updates under streaming load, refusals, reload, status, auth.

The server runs the base tiny model with an API key and a control token. Version 1 is the tool model
(a fine-tune of the base), published with the foundation's WeightStore, so a successful update is
visible in behaviour (the tool prompt becomes a tool call) and in log-probs (they match the new model).
"""

from __future__ import annotations

import asyncio
import shutil

import grpc
import httpx
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightStore, WeightsVersion
from inference_testlib import TOOL_MESSAGES, TOOLS

API_KEY, TOKEN = "sk-test-key", "control-secret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
STORY = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def secure(start_server):
    return start_server("--auth.api-key", API_KEY, "--auth.control-token", TOKEN, "--run-id", "control-tests")


@pytest.fixture(scope="module")
def stub(secure):
    with grpc.insecure_channel(secure.control) as channel:
        yield inference_pb2_grpc.InferenceControlStub(channel), channel


@pytest.fixture(scope="module")
def client(secure):
    with openai.OpenAI(base_url=secure.base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def store(tmp_path_factory, tool_model) -> WeightStore:
    """weights/step_1 = the tool model, published atomically with its manifest."""
    store = WeightStore(tmp_path_factory.mktemp("shared") / "weights")

    def write(folder):
        for file in tool_model.iterdir():
            shutil.copy(file, folder / file.name)

    store.publish(1, write)
    return store


def update(stub, store: WeightStore, step: int, digest: str | None = None, path=None):
    control, _ = stub
    version = WeightsVersion(
        step, store.digest(step) if digest is None else digest, "folder", str(path or store.path(step))
    )
    request = inference_pb2.UpdateWeightsRequest(version=version.to_proto())
    return control.UpdateWeights(request, metadata=AUTH, timeout=120)


def status(stub):
    return stub[0].GetStatus(inference_pb2.GetInferenceStatusRequest(), metadata=AUTH, timeout=30)


def metric(server, name: str, **labels) -> float:
    """One sample of the server's /metrics (labels besides run_id must match exactly)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"run_id": "control-tests", **labels}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return sample.value
    raise AssertionError(f"no sample {name}{wanted}")


def forward_logprobs(model_dir, prompt, tokens, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_the_api_key_is_required_on_the_api_but_not_on_probes(secure):
    bad = openai.OpenAI(base_url=secure.base_url, api_key="wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError) as error:
        bad.models.list()
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    assert httpx.post(f"{secure.url}/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(f"{secure.url}/v1/completions", content=b"not json").status_code == 401  # auth first
    for route in ("/health", "/ready", "/metrics"):
        assert httpx.get(secure.url + route).status_code == 200


def test_the_tokens_in_route_is_behind_the_same_gate(secure):
    """One gate for every API route: the key is checked before the body is read, so a request without the key
    gets 401 whatever its body, on /inference/v1/generate as on /v1 (not 422 from parsing it first)."""
    route = f"{secure.url}/inference/v1/generate"
    for body in (b"not json", b'{"model": "m", "token_ids": []}'):
        answer = httpx.post(route, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert answer.headers["www-authenticate"] == "Bearer"
    body = {"model": secure.model_name, "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}}
    good = httpx.post(route, json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 2


def test_control_calls_need_the_token_but_health_and_reflection_do_not(secure, stub):
    control, channel = stub
    for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", TOKEN),)):
        with pytest.raises(grpc.RpcError) as error:
            control.GetStatus(inference_pb2.GetInferenceStatusRequest(), metadata=metadata, timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as error:
        control.UpdateWeights(
            inference_pb2.UpdateWeightsRequest(version=WeightsVersion(1, "", "folder", "/x/step_1").to_proto()),
            timeout=30,
        )
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = status(stub)
    assert (reply.backend, reply.ready, reply.model) == ("torch", True, secure.model_name)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "gyre.v1.InferenceControl"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
    )
    names = {s.name for reply in listing for s in reply.list_services_response.service}
    assert {"gyre.v1.InferenceControl", "grpc.health.v1.Health"} <= names


@pytest.mark.asyncio
async def test_update_weights_while_16_streams_run(secure, stub, store, tool_model):
    if status(stub).step != 0:
        stub[0].ReloadWeights(inference_pb2.ReloadWeightsRequest(), metadata=AUTH, timeout=120)
    client = openai.AsyncOpenAI(base_url=secure.base_url, api_key=API_KEY, max_retries=0, timeout=300)
    progress = [0] * 16
    all_started = asyncio.Event()

    async def stream(i: int):
        raw = await client.chat.completions.with_raw_response.create(
            model=secure.model_name, messages=STORY, max_tokens=300, seed=i, stream=True, logprobs=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        chunks = []
        async for chunk in raw.parse():
            chunks.append(chunk)
            if chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
                progress[i] += 1
                if min(progress) >= 3:
                    all_started.set()
        return raw.headers["x-gyre-policy-version"], chunks

    streams = [asyncio.create_task(stream(i)) for i in range(16)]
    started = asyncio.create_task(all_started.wait())
    await asyncio.wait([started, *streams], timeout=240, return_when=asyncio.FIRST_COMPLETED)
    assert started.done() and not any(s.done() for s in streams), "every stream must be decoding before the update"
    reply = await asyncio.to_thread(update, stub, store, 1)
    results = await asyncio.gather(*streams)  # none fails
    await client.close()

    assert reply.step == 1 and reply.load_seconds > 0
    spanning = 0
    for header, chunks in results:
        assert header == "0"
        tokens = [c.choices[0] for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids")]
        versions = [c.model_extra["policy_version"] for c in tokens]
        assert len(versions) == 300 and versions == sorted(versions) and versions[0] == 0
        last = tokens[-1].model_extra
        assert (last["policy_version_min"], last["policy_version_max"]) == (versions[0], versions[-1])
        assert last["policy_version"] == versions[-1]
        spanning += versions[-1] == 1
    assert spanning >= 1  # the swap happened while streams were decoding, and they kept going

    with openai.OpenAI(base_url=secure.base_url, api_key=API_KEY, max_retries=0, timeout=120) as sync_client:
        raw = sync_client.chat.completions.with_raw_response.create(
            model=secure.model_name, messages=STORY, max_tokens=20, temperature=0.9, seed=1, logprobs=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        after = raw.parse()
        tool = sync_client.chat.completions.create(
            model=secure.model_name, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0
        )
    assert raw.headers["x-gyre-policy-version"] == "1"
    choice = after.choices[0]
    assert (choice.model_extra["policy_version_min"], choice.model_extra["policy_version_max"]) == (1, 1)
    expected = forward_logprobs(tool_model, after.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], 0.9)
    assert torch.allclose(torch.tensor([e.logprob for e in choice.logprobs.content]), expected, atol=1e-4)
    assert tool.choices[0].finish_reason == "tool_calls"  # the new weights' behaviour
    reply = status(stub)
    assert (reply.step, reply.ready) == (1, True)
    assert metric(secure, "gyre_inference_policy_version") == 1
    assert metric(secure, "gyre_inference_weight_update_seconds_count") == 1


def test_corrupt_half_written_or_mismatched_weights_are_refused(secure, stub, store, tool_model):
    update(stub, store, 1)  # serving version 1
    root = store.root
    # corrupt: a truncated file in a published version (a flipped byte needs weights.full_verify, see
    # tests/unit/test_weights_transport.py: by default replicas check sizes + the manifest digest)
    shutil.copytree(store.path(1), root / "step_2")
    manifest = root / "step_2" / "MANIFEST.json"
    manifest.write_text(manifest.read_text().replace('"step": 1', '"step": 2'))
    blob = (root / "step_2" / "model.safetensors").read_bytes()
    (root / "step_2" / "model.safetensors").write_bytes(blob[:-1])
    # half-written: files but no manifest yet
    shutil.copytree(tool_model, root / "step_3")
    # verified but not loadable into this model
    store.publish(4, lambda folder: (folder / "model.safetensors").write_bytes(b"not a safetensors file"))
    cases = [
        (2, "", grpc.StatusCode.FAILED_PRECONDITION, "bytes"),
        (3, "", grpc.StatusCode.FAILED_PRECONDITION, "incomplete"),
        (9, "", grpc.StatusCode.FAILED_PRECONDITION, "missing"),
        (1, "0" * 64, grpc.StatusCode.FAILED_PRECONDITION, "digest"),
        (4, None, grpc.StatusCode.INVALID_ARGUMENT, "refused"),  # for good: no retry loads it (the relay's cue)
    ]
    for step, digest, code, reason in cases:
        with pytest.raises(grpc.RpcError) as error:
            update(stub, store, step, digest=digest if digest is not None else store.digest(step))
        assert error.value.code() == code, error.value.details()
        assert reason in error.value.details() and "still serving version 1" in error.value.details()
    for step, path in [(5, store.path(1)), (-1, root / "step_-1"), (1, root / "weights-1")]:
        with pytest.raises(grpc.RpcError) as error:
            update(stub, store, step, digest="", path=path)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status(stub).step == 1
    assert metric(secure, "gyre_inference_weight_updates_total", outcome="error") == 5


def test_reload_weights_returns_to_the_base_model(secure, stub, store, client, tiny_model):
    update(stub, store, 1)
    reply = stub[0].ReloadWeights(inference_pb2.ReloadWeightsRequest(), metadata=AUTH, timeout=120)
    assert reply.step == 0 and status(stub).step == 0
    response = client.completions.create(
        model=secure.model_name, prompt=[5, 6, 7], max_tokens=12, temperature=0.7, seed=2, logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = response.choices[0]
    expected = forward_logprobs(tiny_model, [5, 6, 7], choice.model_extra["token_ids"], 0.7)
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), expected, atol=1e-4)
    assert choice.model_extra["policy_version"] == 0


def test_an_older_version_is_refused_unless_it_is_an_explicit_rollback(secure, stub, store, tool_model):
    def write(folder):
        for file in tool_model.iterdir():
            shutil.copy(file, folder / file.name)

    store.publish(6, write)
    assert update(stub, store, 6).step == 6
    # a late retry of step 1 must not roll the policy back silently
    with pytest.raises(grpc.RpcError) as error:
        update(stub, store, 1)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "older" in error.value.details() and "still serving version 6" in error.value.details()
    assert status(stub).step == 6
    assert update(stub, store, 6).step == 6  # the same version again is a harmless retry
    request = inference_pb2.UpdateWeightsRequest(version=store.version(1).to_proto(), rollback=True)
    assert stub[0].UpdateWeights(request, metadata=AUTH, timeout=120).step == 1  # the trainer rewound: explicit
    assert status(stub).step == 1
