"""Multi-turn (alphabet_sort) and tool-calling (calculator) rollouts end to end against a real replica.

A random tiny model almost never ends its turn or emits a tool call, so the protocol would stop after
one turn. The fixture fine-tunes the tiny model (a few seconds) on each environment's reference
conversations (`env.sft_example`) until greedy decoding reproduces them; the replica serves that model,
and the orchestrator's `InferenceClient` drives real multi-turn and tool-calling rollouts through it.
The loss mask is then checked token by token against what the server reported for every turn.
"""

from __future__ import annotations

import pytest
from gyre.envs import SamplingParams, load_environment
from gyre_orchestrator.client import InferenceClient, close_replica_clients
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from orchestrator_testlib import first_batch, orchestrator_config
from support.models import teach

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300), pytest.mark.slow]

ENVS = {"alphabet_sort": {}, "calculator": {}}
TASKS_PER_ENV = 1


def training_conversations():
    for name, args in ENVS.items():
        env = load_environment(name, **args)
        source = env.tasks("train", seed=0)
        for i in range(TASKS_PER_ENV):
            yield env.sft_example(source[i]), env.tool_schemas


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    """The tiny model taught the reference conversations of a few tasks (greedy reproduces them)."""
    import torch
    from transformers import AutoTokenizer

    path = tmp_path_factory.getbasetemp() / "orchestrator-chat-model"
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = []
    for messages, tools in training_conversations():
        enc = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert any(enc["assistant_masks"]), "the chat template marks no assistant tokens"
        rows.append((enc["input_ids"], enc["assistant_masks"]))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
    return teach(tiny_model, path, input_ids, labels, attention, max_steps=600)


@pytest.fixture(scope="module")
def chat_replica(start_replica, chat_model):
    return start_replica(model=chat_model)


def check_sequence(rollout):
    """token_ids / loss_mask / logprobs are exactly: prompt and environment tokens unmasked with log-prob 0,
    and each turn's sampled tokens masked with the server's log-probs, in order, nothing else."""
    ids, mask, lps = rollout.token_ids, rollout.loss_mask, rollout.logprobs
    assert len(ids) == len(mask) == len(lps)
    pos = 0
    for turn in rollout.turns[: rollout.sequence_turns]:
        context = turn.prompt_token_ids[pos:]
        assert turn.prompt_token_ids[:pos] == ids[:pos]  # the next prompt extends the sequence
        assert ids[pos : pos + len(context)] == context
        assert not any(mask[pos : pos + len(context)]) and all(x == 0.0 for x in lps[pos : pos + len(context)])
        pos += len(context)
        n = len(turn.completion_token_ids)
        assert ids[pos : pos + n] == turn.completion_token_ids
        assert all(mask[pos : pos + n]) and lps[pos : pos + n] == turn.completion_logprobs
        pos += n
    assert pos == len(ids)
    assert not any(mask[: rollout.prompt_len])


async def rollouts(env_name: str, replica, sampling: SamplingParams):
    env = load_environment(env_name, **ENVS[env_name])
    replicas = ReplicaSet([Endpoint(replica.url, replica.control)])
    client = InferenceClient(replicas, timeout_s=60)
    source = env.tasks("train", seed=0)
    try:
        out = []
        for i in range(TASKS_PER_ENV):
            rollout = await env.rollout(client, source[i], sampling)
            out.append((rollout, await env.score(source[i], rollout)))
        return out
    finally:
        await close_replica_clients(list(replicas))


async def test_alphabet_sort_multi_turn(chat_replica):
    for rollout, score in await rollouts("alphabet_sort", chat_replica, SamplingParams(temperature=0, max_tokens=48)):
        assert rollout.error is None and rollout.stop_reason == "done"
        assert rollout.num_turns == 2 and rollout.sequence_turns == 2
        assert [m["role"] for m in rollout.completion] == ["assistant", "user", "assistant"]
        check_sequence(rollout)
        # the environment's "Add: ..." message sits between the turns, outside the loss
        second = rollout.turns[1]
        env_tokens = len(second.prompt_token_ids) - (
            len(rollout.turns[0].prompt_token_ids) + len(rollout.turns[0].completion_token_ids)
        )
        assert env_tokens > 0
        assert score.reward == pytest.approx(1.0)  # the taught answers, sorted, in both rounds


async def test_calculator_tool_calling(chat_replica):
    for rollout, score in await rollouts("calculator", chat_replica, SamplingParams(temperature=0, max_tokens=48)):
        assert rollout.error is None and rollout.stop_reason == "done"
        roles = [m["role"] for m in rollout.completion]
        assert roles == ["assistant", "tool", "assistant"]
        call = rollout.turns[0].tool_calls or rollout.state.get("tool_calls")
        assert call, "the first turn must be a tool call"
        assert rollout.state["tool_calls"][0]["ok"] and rollout.state["tool_calls"][0]["name"] == "calculator"
        check_sequence(rollout)
        assert score.per_function["used_calculator"] == 1.0
        assert score.reward == pytest.approx(1.2)  # correct answer + tool credit


@pytest.mark.parametrize("env_name", sorted(ENVS))
async def test_orchestrator_pushes_multi_turn_batches(
    env_name, chat_replica, chat_model, tmp_path, redis_url, unique_run_id
):
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, [chat_replica], env={"name": env_name}, max_steps=1,
        batch_size=2, rollouts_per_example=2, sampling={"max_tokens": 48, "temperature": 1.0},
        advantage={"drop_zero_signal": False},
    )  # fmt: skip
    batch = await first_batch(cfg, chat_model)
    assert batch.step == 1 and batch.num_samples == 4
    assert all(s["env"] == env_name and s["num_loss_tokens"] >= 1 for s in batch.samples)
    # a model-generated token is never preceded by a position outside its sample; the first token is never trained
    for rank in batch.micro_batches:
        for mb in rank:
            starts = mb.position_ids == 0
            assert not mb.loss_mask[starts].any()
            assert (mb.inference_logprobs[~mb.loss_mask] == 0).all()
            assert (mb.inference_logprobs[mb.loss_mask] <= 0).all()


async def test_a_turn_past_the_context_ends_the_episode(start_replica, chat_replica, chat_model):
    """A later turn whose prompt + max_tokens no longer fits the model's context ends the episode as a length stop
    (what verifiers calls prompt_too_long): the turns so far are trained and scored. The server's 400
    context_length_exceeded used to fail the rollout, then every retry of it, then the run."""
    sampling = SamplingParams(temperature=0, max_tokens=48)
    ((whole, _),) = await rollouts("alphabet_sort", chat_replica, sampling)
    assert whole.stop_reason == "done" and whole.num_turns == 2
    limit = len(whole.turns[1].prompt_token_ids) + sampling.max_tokens - 1  # the first turn fits, the second not
    env = load_environment("alphabet_sort", **ENVS["alphabet_sort"])
    task = env.tasks("train", seed=0)[0]
    replica = start_replica("--engine.max-model-len", str(limit), model=chat_model)
    replicas = ReplicaSet([Endpoint(replica.url, replica.control)])
    client = InferenceClient(replicas, timeout_s=60, retries=0)
    try:
        rollout = await env.rollout(client, task, sampling)
    finally:
        await close_replica_clients(list(replicas))
        replica.stop()
    assert rollout.error is None and rollout.stop_reason == "length" and rollout.truncated
    assert rollout.num_turns == rollout.sequence_turns == 1
    assert rollout.completion == whole.completion[:1]  # the unanswered "Add: ..." is left out
    check_sequence(rollout)
    score = await env.score(task, rollout)
    assert score.reward == pytest.approx(0.5)  # round 1 right, round 2 never answered
