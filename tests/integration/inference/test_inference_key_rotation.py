"""A rotated `auth.api_key_file` or `auth.control_token_file` (a Kubernetes Secret updated in place) is taken up
without a restart: the real `gyre inference` process, the official openai client over HTTP, gRPC for the control."""

from __future__ import annotations

import grpc
import openai
import pytest
from gyre.v1 import inference_pb2, inference_pb2_grpc


def models(server, key: str):
    with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60) as client:
        return [card.id for card in client.models.list().data]


def status(server, token: str):
    with grpc.insecure_channel(server.control) as channel:
        stub = inference_pb2_grpc.InferenceControlStub(channel)
        metadata = (("authorization", f"Bearer {token}"),)
        return stub.GetStatus(inference_pb2.GetInferenceStatusRequest(), metadata=metadata, timeout=30)


def rotate(path, value: str) -> None:
    """As the kubelet does it: the new content appears at once (here a rename over the old file)."""
    fresh = path.with_suffix(".tmp")
    fresh.write_text(value + "\n")
    fresh.rename(path)


@pytest.fixture(scope="module")
def rotating(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    key_file, token_file = folder / "api-key", folder / "control-token"
    key_file.write_text("sk-old\n")
    token_file.write_text("token-old\n")
    server = start_server("--auth.api-key-file", str(key_file), "--auth.control-token-file", str(token_file),
                          "--run-id", "key-rotation-tests")  # fmt: skip
    return server, key_file, token_file


def test_a_rotated_key_file_is_taken_up_and_the_old_key_kept_for_the_grace(rotating):
    server, key_file, _ = rotating
    assert models(server, "sk-old")
    with pytest.raises(openai.AuthenticationError):
        models(server, "sk-new")

    rotate(key_file, "sk-new")
    assert models(server, "sk-new")  # read once, this was a 401 until a restart
    assert models(server, "sk-old")  # clients whose copy of the Secret is not rewritten yet: the grace
    with pytest.raises(openai.AuthenticationError) as refused:
        models(server, "sk-wrong")
    assert refused.value.body["code"] == "invalid_api_key"

    # a file emptied or removed mid-rotation keeps the key in force: the server never opens up
    key_file.unlink()
    with pytest.raises(openai.AuthenticationError):
        models(server, "sk-wrong")
    assert models(server, "sk-new")


def test_a_rotated_control_token_file_is_taken_up_by_the_grpc_control(rotating):
    """The orchestrator's relay re-reads its token after UNAUTHENTICATED; the server read its own once, so every weight
    update was refused until the pod restarted."""
    server, _, token_file = rotating
    assert status(server, "token-old").ready
    rotate(token_file, "token-new")
    assert status(server, "token-new").ready
    assert status(server, "token-old").ready  # the grace
    with pytest.raises(grpc.RpcError) as refused:
        status(server, "token-wrong")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
