"""Fixtures of the inference unit tests (the tiny model itself comes from tests/conftest.py)."""

from __future__ import annotations

import pytest
import pytest_asyncio


@pytest.fixture(scope="session")
def model_text(tiny_model):
    from gyre_inference.text import ModelText

    return ModelText(tiny_model)


@pytest_asyncio.fixture
async def backend(tiny_model):
    """A running torch engine on the tiny model (one thread, 8 rows)."""
    from gyre_inference.torch_backend import TorchBackend

    engine = TorchBackend(tiny_model, threads=1, max_batch_size=8)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The tiny model in transformers (fp32, eval): the independent forward pass engine results are checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
