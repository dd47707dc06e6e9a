"""Fixtures for the inference service tests (the tiny model: tests/conftest.py; real servers: support.inference)."""

from __future__ import annotations

from pathlib import Path

import pytest
from inference_testlib import make_tool_model
from support.inference import InferenceServer


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, tiny_model) -> Path:
    return make_tool_model(tmp_path_factory, tiny_model)


@pytest.fixture(scope="session")
def start_server(start_inference):
    """start_server(*args, model_path=None): `start_inference` (tests/conftest.py) under this folder's name."""
    return lambda *args, model_path=None: start_inference(*args, model=model_path)


@pytest.fixture(scope="session")
def server(start_server, tool_model) -> InferenceServer:
    """The shared server of the API tests: the tool model, context 256 (keeps generated cases short)."""
    return start_server("--engine.max-model-len", "256", "--run-id", "api-tests", model_path=tool_model)


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def model_id(client) -> str:
    return client.models.list().data[0].id
