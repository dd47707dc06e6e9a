"""Multi-run end to end: two runs on one trainer, then one real inference server serving each run's
adapter under the run's model name (real Redis, real gRPC UpdateWeights, real HTTP with the openai client).

Each model name must answer with exactly its own adapter: tokens and log-probs equal those of the base
model with that run's published adapter merged in (transformers forward, atol 1e-4), also when requests
of both runs and of the base share one batch; a run's version is reported per model name.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import grpc
import openai
import pytest
import torch
from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, config_scale, merge, split_lora
from gyre.streams import BatchStream
from gyre.transport import FolderStore
from gyre.v1 import inference_pb2, inference_pb2_grpc
from safetensors.torch import load_file
from support.inference import InferenceServer
from test_trainer_multirun import LORA, multirun_config, run_trainer
from trainer_testlib import push_batches

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]

PROMPT = [5, 17, 33, 2, 9, 81]


def merged_model(base_dir: Path, adapter_dir: Path | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        scale = config_scale(json.loads((adapter_dir / ADAPTER_CONFIG).read_text()))
        _, adapters = split_lora(load_file(adapter_dir / ADAPTER_FILE))
        state = model.state_dict()
        model.load_state_dict(merge(state, adapters, scale))
    return model


def reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def complete(client: openai.OpenAI, model: str, seed: int = 0):
    choice = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed, logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).choices[0]  # fmt: skip
    return choice.model_extra["token_ids"], torch.tensor(choice.logprobs.token_logprobs), choice.model_extra


def test_two_runs_train_their_own_adapters_and_each_model_name_serves_its_own(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    names = [f"{unique_run_id}-a", f"{unique_run_id}-b"]
    for i, name in enumerate(names):
        push_batches(BatchStream(redis_url, name), [1, 2], seed=11 + i)
    runs = [{"name": n, "output_dir": str(tmp_path / n), "max_steps": 2} for n in names]
    assert run_trainer(multirun_config(tiny_model, redis_url, runs, optim={"lr": 5e-2})) == 0

    adapters = json.dumps(names)
    server = InferenceServer(
        tiny_model, "--lora.adapters", adapters, "--lora.max-loras", "3", "--lora.max-rank", str(LORA["rank"]),
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        with (
            openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as client,
            grpc.insecure_channel(server.control) as channel,
        ):
            control = inference_pb2_grpc.InferenceControlStub(channel)
            listed = {m.id: m for m in client.models.list().data}
            assert set(listed) == {server.model_name, *names}
            base_tokens, base_logprobs, _ = complete(client, server.model_name)
            # before its first version a run's name serves the base model
            assert complete(client, names[0])[:2][0] == base_tokens

            for name in names:
                version = FolderStore(tmp_path / name / "weights").version(2)
                reply = control.UpdateWeights(
                    inference_pb2.UpdateWeightsRequest(version=version.to_proto(), model=name), timeout=120
                )
                assert reply.step == 2
                status = control.GetStatus(inference_pb2.GetInferenceStatusRequest(model=name), timeout=30)
                assert (status.model, status.step) == (name, 2)
            assert control.GetStatus(inference_pb2.GetInferenceStatusRequest(), timeout=30).step == 0  # base: untouched

            expected = {server.model_name: merged_model(tiny_model, None)}
            for name in names:
                expected[name] = merged_model(tiny_model, tmp_path / name / "weights" / "step_2")
            alone = {}
            for model, ref in expected.items():
                tokens, logprobs, extra = complete(client, model)
                assert torch.allclose(logprobs, reference(ref, tokens), atol=1e-4), model
                assert extra["policy_version"] == (0 if model == server.model_name else 2)
                alone[model] = (tokens, logprobs)
            assert alone[names[0]][1].tolist() != alone[names[1]][1].tolist()  # the two adapters differ

            # mixed batches: requests of both runs and of the base at once give what each gave alone
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                mixed = list(pool.map(lambda m: (m, complete(client, m)), [*expected, *expected]))
            for model, (tokens, logprobs, _) in mixed:
                assert tokens == alone[model][0], model
                assert torch.allclose(logprobs, alone[model][1], atol=1e-5), model

            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="no-such-run", prompt=PROMPT, max_tokens=2)
    finally:
        server.stop()
