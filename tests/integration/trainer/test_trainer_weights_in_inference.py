"""Weights the trainer publishes are what the inference service's torch backend hot-loads.

The folder is written by the trainer's own publisher (`WeightPublisher` -> `WeightStore`); the
backend swaps it in as a new version and must then generate exactly what transformers generates
from the same folder.
"""

from __future__ import annotations

import asyncio

import torch
from gyre.transport import FolderSource, FolderStore
from gyre.weights import WeightStore
from gyre_trainer.publish import WeightPublisher


def test_torch_backend_serves_published_weights(tiny_model, tmp_path, isolated_torch_state):
    from gyre_inference.backend import SamplingParams
    from gyre_inference.torch_backend import TorchBackend
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    store = WeightStore(tmp_path / "weights")
    published = WeightPublisher(FolderStore(store.root), tiny_model, keep_last=2).publish(
        7, trained.state_dict(), trained.config, {}
    )
    store.verify(7, published.digest)

    prompt = [1, 705, 201, 89, 83, 85, 2, 201, 1, 739, 201]
    reference = AutoModelForCausalLM.from_pretrained(published.path, dtype=torch.float32).eval()
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = expected[0, len(prompt) :].tolist()

    async def serve() -> tuple[list[int], set[int]]:
        backend = TorchBackend(tiny_model, device="cpu", dtype="float32", threads=1)
        await backend.start()
        try:
            await backend.update_weights(FolderSource().fetch(published))  # what a replica does
            events = [e async for e in backend.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))]
            return [e.token_id for e in events], {e.version for e in events}
        finally:
            await backend.shutdown()

    tokens, versions = asyncio.run(serve())
    assert versions == {7}
    assert tokens == expected
