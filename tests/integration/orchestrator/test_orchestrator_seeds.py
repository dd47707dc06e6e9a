"""`sampling.seed`: every rollout gets its own seed, derived from (seed, step, task, rollout index), against a
real replica. Before, the one configured seed went out with every request, so the k samples of a task (and the
rollouts of a GRPO group) were one completion k times: no advantage, and avg@k = pass@k.
"""

from __future__ import annotations

import pytest
from gyre.envs import SamplingParams, load_environment
from gyre_orchestrator.client import InferenceClient, close_replica_clients
from gyre_orchestrator.evaluate import evaluate
from gyre_orchestrator.replicas import Endpoint, ReplicaSet

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


class Recorder:
    """The real client, remembering each completion per prompt (the eval calls are concurrent)."""

    def __init__(self, client: InferenceClient) -> None:
        self.client, self.texts = client, []

    async def chat(self, messages, *, tools=None, sampling: SamplingParams):
        turn = await self.client.chat(messages, tools=tools, sampling=sampling)
        self.texts.append((messages[-1]["content"], sampling.seed, tuple(turn.completion_token_ids)))
        return turn


async def seeded_eval(replica, seed: int | None) -> list[tuple]:
    env = load_environment("reverse_text")
    replicas = ReplicaSet([Endpoint(replica.url, replica.control)])
    recorder = Recorder(InferenceClient(replicas, timeout_s=60))
    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
    try:
        await evaluate(env, recorder, env_name="reverse_text", num_examples=3, k=4, sampling=sampling)
    finally:
        await close_replica_clients(list(replicas))
    return sorted(recorder.texts)


async def test_eval_samples_of_a_task_differ_and_repeat_with_the_same_seed(replicas):
    first = await seeded_eval(replicas[0], seed=1)
    for prompt in {p for p, _, _ in first}:
        samples = [(seed, ids) for p, seed, ids in first if p == prompt]
        assert len({seed for seed, _ in samples}) == 4  # four requests, four seeds
        assert len({ids for _, ids in samples}) > 1  # so not one completion four times (avg@4 = pass@4)
    assert await seeded_eval(replicas[1], seed=1) == first  # reproducible, whichever replica serves it
    assert await seeded_eval(replicas[0], seed=2) != first
