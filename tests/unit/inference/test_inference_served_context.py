"""The context a model is served with comes from its config, for the generating and the reward-model backend alike.

The reward model's backend (`--runner pooling`) took `engine.max_model_len` as given: above the model's
`max_position_embeddings` it served, and answered, inputs longer than the positions the model has (a learned
position table fails on them; RoPE extrapolates untrained). The torch backend refused that at start; both now do, by
one rule (`served_context`).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from support.models import reward_model_path


def test_the_reward_model_backend_refuses_a_context_beyond_the_models(tmp_path_factory):
    from gyre_inference.classify import ClassifierBackend

    path = reward_model_path(tmp_path_factory)
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(
        ValueError, match=f"engine.max_model_len {positions + 1} exceeds the model's context {positions}"
    ):
        asyncio.run(ClassifierBackend(path, max_model_len=positions + 1, threads=1).start())
    backend = ClassifierBackend(path, threads=1)
    asyncio.run(backend.start())
    assert backend.max_model_len == positions
