"""`sampling.chat_template_kwargs` through the real orchestrator and a real replica: a Qwen3 user trains with
`enable_thinking = false`. The server took vLLM's chat_template_kwargs, but the orchestrator never sent any, so the
policy was trained on prompts its template rendered for thinking.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gyre.envs import SamplingParams, load_environment
from gyre_orchestrator.client import InferenceClient, close_replica_clients
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from orchestrator_testlib import first_batch, orchestrator_config
from support import models as support_models
from transformers import AutoTokenizer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's generation prompt, enable_thinking false


@pytest.fixture(scope="module")
def qwen3_templated(tiny_model, tmp_path_factory) -> Path:
    return support_models.qwen3_templated(tmp_path_factory, tiny_model)


@pytest.fixture(scope="module")
def qwen3_replica(start_replica, qwen3_templated):
    return start_replica(model=qwen3_templated)


async def test_chat_template_kwargs_reach_the_prompt_tokens_of_every_rollout(
    tmp_path, redis_url, unique_run_id, qwen3_replica, qwen3_templated
):
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, [qwen3_replica], max_steps=1,
                              sampling={"max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}},
                              advantage={"drop_zero_signal": False})  # fmt: skip
    batch = await first_batch(cfg, qwen3_templated)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_templated)
    rows = [tokenizer.decode(mb.input_ids.tolist()) for rank in batch.micro_batches for mb in rank]
    # every sample's prompt (the tokens the trainer scores it after) ends with the empty think block
    assert batch.num_samples == 8
    assert sum(row.count(EMPTY_THINK) for row in rows) == 8, rows

    # the same task without the setting renders no think block: the block above is the setting's doing
    task = load_environment("reverse_text").tasks("train")[0]
    replicas = ReplicaSet([Endpoint(qwen3_replica.url, qwen3_replica.control)])
    try:
        client = InferenceClient(replicas, timeout_s=60)
        plain = await client.chat(task.prompt, sampling=SamplingParams(max_tokens=2))
        off = await client.chat(
            task.prompt, sampling=SamplingParams(max_tokens=2, chat_template_kwargs={"enable_thinking": False})
        )
    finally:
        await close_replica_clients(list(replicas))
    assert not tokenizer.decode(plain.prompt_token_ids).endswith(EMPTY_THINK)
    assert tokenizer.decode(off.prompt_token_ids).endswith(EMPTY_THINK)
