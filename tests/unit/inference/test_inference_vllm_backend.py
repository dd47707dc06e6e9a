"""vLLM backend: the pure mapping on CPU, the vLLM API contract when vllm imports, end to end on a GPU."""

from __future__ import annotations

import asyncio
import inspect
from collections import namedtuple

import pytest
import torch
from gyre.transport import FetchedWeights
from gyre_inference.backend import SamplingParams, WeightsIncompatibleError
from gyre_inference.vllm_backend import check_same_layout, safetensors_layout, token_events

# Same fields as vllm.logprobs.Logprob (the contract test below checks the real class has them).
Logprob = namedtuple("Logprob", ["logprob", "rank", "decoded_token"])


def test_token_events_carry_the_sampled_logprob_ranked_alternatives_and_the_finish():
    deltas = [
        {7: Logprob(-0.1, 1, None), 3: Logprob(-2.5, 2, None)},
        {9: Logprob(-3.0, 4, None), 4: Logprob(-0.2, 1, None), 5: Logprob(-1.9, 2, None)},  # sampled = rank 4
    ]
    events = token_events([7, 9], deltas, "stop", version=3, top_logprobs=2)
    assert [(e.token_id, e.logprob, e.version, e.finish_reason) for e in events] == [
        (7, -0.1, 3, None),
        (9, -3.0, 3, "stop"),
    ]
    assert events[0].top_logprobs == ((7, -0.1), (3, -2.5))
    assert events[1].top_logprobs == ((4, -0.2), (5, -1.9))
    assert token_events([7], deltas[:1], "abort", 0, 0)[0].finish_reason is None  # aborted: no finish
    assert token_events([7], deltas[:1], None, 0, 0)[0].top_logprobs == ()
    with pytest.raises(RuntimeError, match="no log-prob"):
        token_events([8], deltas[:1], None, 0, 0)


def test_guides_map_to_vllm_structured_outputs_with_the_same_json_layout():
    from gyre_inference.structured import JSON_OPTIONS, Guide
    from gyre_inference.vllm_backend import structured_outputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert structured_outputs(Guide("json", schema)) == {"json": {**schema, "x-guidance": JSON_OPTIONS}}
    assert structured_outputs(Guide("json_object")) == {"json": {"type": "object", "x-guidance": JSON_OPTIONS}}
    assert structured_outputs(Guide("regex", "a+")) == {"regex": "a+"}
    assert structured_outputs(Guide("choice", ("a", "b"))) == {"choice": ["a", "b"]}
    assert structured_outputs(Guide("grammar", 'start: "a"')) == {"grammar": 'start: "a"'}


def test_weights_layout_is_checked_from_safetensors_headers(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    layout = safetensors_layout(tiny_model)
    tensors = load_file(tiny_model / "model.safetensors")
    assert {name: shape for name, (_, shape) in layout.items()} == {n: tuple(t.shape) for n, t in tensors.items()}
    same = tmp_path / "same"
    same.mkdir()
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, str(same / "model.safetensors"))
    check_same_layout(tiny_model, same)  # dtype may differ
    name = next(iter(tensors))
    cases = {
        "reshaped": ({**tensors, name: torch.zeros(3)}, "has shape"),
        "extra": ({**tensors, "x.weight": torch.zeros(1)}, "unknown tensors \\['x.weight'\\]"),
        "short": ({n: t for n, t in tensors.items() if n != name}, "missing tensors"),
    }
    for folder, (content, reason) in cases.items():
        (tmp_path / folder).mkdir()
        save_file(content, str(tmp_path / folder / "model.safetensors"))
        with pytest.raises(WeightsIncompatibleError, match=reason):
            check_same_layout(tiny_model, tmp_path / folder)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(WeightsIncompatibleError, match="not a readable"):
        check_same_layout(tiny_model, tmp_path / "garbage")


def test_vllm_api_contract():
    """The vLLM entry points and arguments this backend relies on (runs wherever vllm imports)."""
    vllm = pytest.importorskip("vllm")
    from vllm.logprobs import Logprob as VLLMLogprob
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    fields = set(inspect.signature(vllm.AsyncEngineArgs).parameters)
    assert {"logprobs_mode", "worker_extension_cls", "max_logprobs", "enable_prefix_caching",
            "scheduling_policy"} <= fields  # fmt: skip
    assert "priority" in inspect.signature(AsyncLLM.generate).parameters
    vllm.SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, max_tokens=4, seed=1, stop_token_ids=[2],
                        ignore_eos=True,
                        logprobs=3, detokenize=False, output_kind=RequestOutputKind.DELTA, min_tokens=2,
                        logit_bias={5: 1.5})  # fmt: skip
    assert "mode" in inspect.signature(AsyncLLM.pause_generation).parameters
    for method in ("generate", "resume_generation", "collective_rpc", "reset_prefix_cache", "shutdown"):
        assert callable(getattr(AsyncLLM, method))
    entry = VLLMLogprob(logprob=-0.5, rank=1, decoded_token=None)
    assert token_events([4], [{4: entry}], "length", 1, 1)[0].top_logprobs == ((4, -0.5),)


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_end_to_end_on_a_gpu(tiny_model, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from gyre_inference.vllm_backend import VLLMBackend
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    perturbed.save_pretrained(tmp_path / "v1")

    def forward_logprobs(model, prompt, tokens, temperature):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]

    async def scenario():
        backend = VLLMBackend(tiny_model, dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=16)
        await backend.start()
        try:
            prompt = [1, 705, 201, 74, 75, 2, 201, 1, 739, 201]
            params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, top_logprobs=2)
            first = [e async for e in backend.generate(prompt, params)]
            again = [e async for e in backend.generate(prompt, params)]
            assert [e.token_id for e in first] == [e.token_id for e in again] and len(first) == 24
            expected = forward_logprobs(reference, prompt, [e.token_id for e in first], 0.8)
            assert torch.allclose(torch.tensor([e.logprob for e in first]), expected, atol=2e-3)

            long = backend.generate(prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=1))
            events = [await long.__anext__() for _ in range(3)]
            await backend.update_weights(FetchedWeights.local(tmp_path / "v1", 1))
            events += [e async for e in long]
            assert len(events) == 200 and events[0].version == 0 and events[-1].version == 1
            fresh = [e async for e in backend.generate(prompt, params)]
            expected = forward_logprobs(perturbed.eval(), prompt, [e.token_id for e in fresh], 0.8)
            assert {e.version for e in fresh} == {1}
            assert torch.allclose(torch.tensor([e.logprob for e in fresh]), expected, atol=2e-3)
            await backend.reload_base()
            assert backend.version == 0
        finally:
            await backend.shutdown()

    asyncio.run(scenario())


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_structured_outputs_on_a_gpu(tiny_model):
    """Each guide kind through real vLLM (its guidance backend, llguidance): the output matches the guide."""
    import json
    import re

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from gyre_inference.structured import Guide
    from gyre_inference.text import ModelText
    from gyre_inference.vllm_backend import VLLMBackend

    text = ModelText(tiny_model)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
              "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip
    checks = {
        Guide("json", schema): lambda out: set(json.loads(out)) == {"n", "ok"} and out.startswith('{"n": '),
        Guide("regex", "[ab]{3}-[0-9]"): lambda out: re.fullmatch("[ab]{3}-[0-9]", out),
        Guide("choice", ("red", "green")): lambda out: out in ("red", "green"),
        Guide("grammar", 'start: "x" ("y" | "z")'): lambda out: out in ("xy", "xz"),
    }

    async def scenario():
        backend = VLLMBackend(tiny_model, dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=16)
        await backend.start()
        try:
            for guide, check in checks.items():
                for seed in range(3):
                    params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, guide=guide,
                                            stop_token_ids=text.eos_token_ids)  # fmt: skip
                    events = [e async for e in backend.generate([1, 705, 201], params)]
                    assert events[-1].finish_reason == "stop", guide
                    assert check(text.decode([e.token_id for e in events])), (guide, events)
        finally:
            await backend.shutdown()

    asyncio.run(scenario())


def test_model_dtype_auto_starts_vllm_in_bfloat16_the_dtype_the_trainer_steps_in(tiny_model):
    # vLLM's own "auto" keeps a float16 checkpoint in float16: rollouts were sampled in another dtype than the
    # trainer's (and the torch backend's) bfloat16
    from gyre_inference.vllm_backend import VLLMBackend
    from gyre_trainer.model import resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert VLLMBackend(tiny_model)._engine_kwargs["dtype"] == "bfloat16"
    assert VLLMBackend(tiny_model, dtype="float16")._engine_kwargs["dtype"] == "float16"
