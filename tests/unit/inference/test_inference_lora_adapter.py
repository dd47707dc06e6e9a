"""Adapter-only weight versions on the torch backend: applied to the base kept in memory (the base
model is read once, not reloaded), equal to peft's base + adapter, right after a full version too."""

from __future__ import annotations

import asyncio
import json

import peft
import pytest
import pytest_asyncio
import torch
from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config, adapter_tensors
from gyre.transport import FetchedWeights
from gyre_inference.backend import SamplingParams, WeightsIncompatibleError
from gyre_inference.torch_backend import TorchBackend

TARGETS = ["q_proj", "v_proj", "up_proj"]
PROMPT = [5, 17, 33, 2, 9, 81]


@pytest_asyncio.fixture
async def backend(tiny_model):
    engine = TorchBackend(tiny_model, threads=1, max_batch_size=4)
    await engine.start()
    yield engine
    await engine.shutdown()


def write_adapter(tiny_model, folder, seed: int, targets=TARGETS):
    """A trained-looking adapter in PEFT's files, as the trainer publishes it; returns peft's model."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in adapter_tensors(model.state_dict()).items()}, folder / ADAPTER_FILE)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(4, 8, 0.0, targets, str(tiny_model))))
    return model


async def greedy_logprobs(backend, n=12):
    events = [e async for e in backend.generate(PROMPT, SamplingParams(max_tokens=n, temperature=1.0, seed=3))]
    return [e.token_id for e in events], torch.tensor([e.logprob for e in events])


def reference_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.asyncio
async def test_adapter_versions_apply_to_the_base_in_memory(backend, tiny_model, tmp_path, monkeypatch):
    first = write_adapter(tiny_model, tmp_path / "a1", seed=1)
    await backend.update_weights(FetchedWeights.local(tmp_path / "a1", 1))
    tokens, logprobs = await greedy_logprobs(backend)
    assert backend.version == 1
    assert torch.allclose(logprobs, reference_logprobs(first, tokens), atol=1e-4)

    # a full version in between: weights the next adapter does not touch must come back to the base
    full = tmp_path / "full"
    full.mkdir()
    from safetensors.torch import load_file, save_file

    perturbed = {k: v + 0.01 for k, v in load_file(tiny_model / "model.safetensors").items()}

    save_file({k: v.contiguous() for k, v in perturbed.items()}, full / "model.safetensors")
    await backend.update_weights(FetchedWeights.local(full, 2))

    second = write_adapter(tiny_model, tmp_path / "a2", seed=2)
    read_base = []
    original = backend._read_weights
    monkeypatch.setattr(backend, "_read_weights", lambda path: read_base.append(path) or original(path))
    await backend.update_weights(FetchedWeights.local(tmp_path / "a2", 3))
    assert read_base == []  # the base was read once (first adapter), never reloaded
    tokens, logprobs = await greedy_logprobs(backend)
    assert backend.version == 3
    assert torch.allclose(logprobs, reference_logprobs(second, tokens), atol=1e-4)


@pytest.mark.asyncio
async def test_an_adapter_on_lm_head_applies_too(backend, tiny_model, tmp_path):
    # the LoRA demo adapts the output layer as well (docs/trainer.md, "The CPU demo with LoRA")
    model = write_adapter(tiny_model, tmp_path / "head", seed=4, targets=[*TARGETS, "lm_head"])
    await backend.update_weights(FetchedWeights.local(tmp_path / "head", 1))
    tokens, logprobs = await greedy_logprobs(backend)
    assert torch.allclose(logprobs, reference_logprobs(model, tokens), atol=1e-4)


@pytest.mark.asyncio
async def test_an_adapter_that_does_not_fit_is_refused(backend, tiny_model, tmp_path):
    write_adapter(tiny_model, tmp_path / "bad", seed=1)
    config = json.loads((tmp_path / "bad" / ADAPTER_CONFIG).read_text())
    (tmp_path / "bad" / ADAPTER_CONFIG).write_text(json.dumps({**config, "r": 0}))
    with pytest.raises(WeightsIncompatibleError, match="r must be a positive number"):
        await backend.update_weights(FetchedWeights.local(tmp_path / "bad", 1))
    assert backend.version == 0


@pytest.mark.asyncio
async def test_an_adapter_of_integer_tensors_or_mismatched_ranks_is_refused_clearly(backend, tiny_model, tmp_path):
    """Merged into the base (a full UpdateWeights of an adapter folder) and as a named adapter: an integer lora_B
    would be cast into a garbage delta, and lora_A / lora_B of different ranks failed inside the merge."""
    from safetensors.torch import load_file, save_file

    write_adapter(tiny_model, tmp_path / "good", seed=1)
    tensors = load_file(tmp_path / "good" / ADAPTER_FILE)
    b_name = next(k for k in tensors if "lora_B" in k)
    broken = {"ints": {**tensors, b_name: torch.ones(tensors[b_name].shape, dtype=torch.int32)},
              "ranks": {**tensors, b_name: tensors[b_name][:, :3].contiguous()}}  # fmt: skip
    reasons = {"ints": "int32, not floating point", "ranks": "does not fit the model"}
    named = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=1, max_lora_rank=4)
    await named.start()
    try:
        for folder, bad in broken.items():
            (tmp_path / folder).mkdir()
            save_file(bad, tmp_path / folder / ADAPTER_FILE)
            (tmp_path / folder / ADAPTER_CONFIG).write_bytes((tmp_path / "good" / ADAPTER_CONFIG).read_bytes())
            with pytest.raises(WeightsIncompatibleError, match=reasons[folder]):
                await backend.update_weights(FetchedWeights.local(tmp_path / folder, 1))
            if folder == "ints":  # ranks: the bank's own shape check refused it already
                with pytest.raises(WeightsIncompatibleError, match=reasons[folder]):
                    await named.update_adapter("x", FetchedWeights.local(tmp_path / folder, 1))
        assert backend.version == 0 and named.adapter_names == ()
    finally:
        await named.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.asyncio
async def test_an_adapter_is_merged_on_the_gpu_into_peft_s_merged_weights(tiny_model, tmp_path):
    """On a GPU the merge runs on the device from a pinned host copy of the base; the served weights equal
    peft's merge_and_unload (float32), and a second version replaces the first rather than adding to it."""
    engine = TorchBackend(tiny_model, device="cuda", dtype="float32", max_batch_size=4)
    await engine.start()
    try:
        for version, seed in ((1, 1), (2, 2)):
            model = write_adapter(tiny_model, tmp_path / f"a{version}", seed=seed)
            await engine.update_weights(FetchedWeights.local(tmp_path / f"a{version}", version))
            expected = model.merge_and_unload().state_dict()
            served = {name: tensor.detach().cpu() for name, tensor in engine._weights.items()}
            assert all(engine._base[name].is_pinned() for name in engine._base)
            for name, tensor in expected.items():
                torch.testing.assert_close(served[name], tensor, atol=1e-5, rtol=1e-5, msg=name)
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_adapter_features_that_would_be_dropped_are_refused(backend, tiny_model, tmp_path):
    """Per-module ranks/alphas (rank_pattern, alpha_pattern) and tensors besides lora_A/lora_B (modules_to_save,
    LoRA biases) cannot be applied: refused by name, merged or as a named adapter. They were dropped silently,
    serving other weights than the adapter's."""
    from safetensors.torch import load_file, save_file

    write_adapter(tiny_model, tmp_path / "good", seed=1)
    config = json.loads((tmp_path / "good" / ADAPTER_CONFIG).read_text())
    tensors = load_file(tmp_path / "good" / ADAPTER_FILE)
    head = load_file(tiny_model / "model.safetensors")["lm_head.weight"]
    broken = {
        "pattern": ({**config, "alpha_pattern": {"q_proj": 32}}, tensors, "alpha_pattern are not supported"),
        "saved": (config, {**tensors, "base_model.model.lm_head.weight": head}, "besides lora_A/lora_B"),
    }
    named = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=1, max_lora_rank=4)
    await named.start()
    try:
        for folder, (bad_config, bad_tensors, reason) in broken.items():
            (tmp_path / folder).mkdir()
            save_file(bad_tensors, tmp_path / folder / ADAPTER_FILE)
            (tmp_path / folder / ADAPTER_CONFIG).write_text(json.dumps(bad_config))
            with pytest.raises(WeightsIncompatibleError, match=reason):
                await backend.update_weights(FetchedWeights.local(tmp_path / folder, 1))
            with pytest.raises(WeightsIncompatibleError, match=reason):
                await named.update_adapter("x", FetchedWeights.local(tmp_path / folder, 1))
        assert backend.version == 0 and named.adapter_names == ()
    finally:
        await named.shutdown()


@pytest.mark.asyncio
async def test_a_full_version_whose_caller_gave_up_mid_copy_is_whole_for_the_next_adapter(
    backend, tiny_model, tmp_path, monkeypatch
):
    """An UpdateWeights of a full version cancelled (its deadline passed) while the engine thread copies it in: the
    engine completes it, so the next adapter must be merged onto the base for every weight, not only the ones it
    touches. Before, the cancelled call skipped noting that the weights were no longer the base, and released the
    swap lock at once, so the next adapter was read against the old state: the served weights were the full
    version's outside the adapted modules, tagged with the adapter's version."""
    import threading

    from safetensors.torch import load_file, save_file

    full = tmp_path / "full"
    full.mkdir()
    save_file({k: v + 0.01 for k, v in load_file(tiny_model / "model.safetensors").items()}, full / "model.safetensors")
    model = write_adapter(tiny_model, tmp_path / "a2", seed=2)
    copying, release = threading.Event(), threading.Event()
    copy_in = backend._copy_in

    def slow_copy_in(swap):  # the engine thread, between two steps: a big model's copy takes a while
        if swap.version == 1:
            copying.set()
            release.wait(60)
        copy_in(swap)

    monkeypatch.setattr(backend, "_copy_in", slow_copy_in)
    full_update = asyncio.create_task(backend.update_weights(FetchedWeights.local(full, 1)))
    assert await asyncio.to_thread(copying.wait, 60)
    full_update.cancel()  # the gRPC deadline passed while the engine copies it in
    adapter_update = asyncio.create_task(backend.update_weights(FetchedWeights.local(tmp_path / "a2", 2)))
    await asyncio.sleep(0.3)
    assert not full_update.done()  # it waits for the engine, holding the swap lock
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await full_update
    await asyncio.wait_for(adapter_update, 60)
    assert backend.version == 2
    expected = model.merge_and_unload().state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(backend._weights[name].detach(), tensor, atol=1e-5, rtol=1e-5, msg=name)
    tokens, logprobs = await greedy_logprobs(backend)
    assert torch.allclose(logprobs, reference_logprobs(model, tokens), atol=1e-4)
