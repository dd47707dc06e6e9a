"""Rollout protocol end to end with the scripted test double: training sequence, loss mask, log-probs, stops."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import pytest
from envs_doubles import END_ID, Reply, ScriptedClient, encode, render
from gyre.envs import ContextLengthExceeded, MultiTurnEnv, SequenceBuilder, SingleTurnEnv, Task, Turn, load_environment


def check_alignment(rollout, client_turns: list[Turn]) -> None:
    """The sequence holds each turn's sampled tokens (mask on, their log-probs) and nothing else masked."""
    assert len(rollout.token_ids) == len(rollout.loss_mask) == len(rollout.logprobs)
    masked_ids = [t for t, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if m]
    masked_lps = [lp for lp, m in zip(rollout.logprobs, rollout.loss_mask, strict=True) if m]
    used = client_turns[: rollout.sequence_turns]
    assert masked_ids == [t for turn in used for t in turn.completion_token_ids]
    assert masked_lps == [lp for turn in used for lp in turn.completion_logprobs]
    assert all(lp == 0.0 for lp, m in zip(rollout.logprobs, rollout.loss_mask, strict=True) if not m)
    assert not any(rollout.loss_mask[: rollout.prompt_len])
    assert rollout.token_ids[: rollout.prompt_len] == client_turns[0].prompt_token_ids


class Echo(SingleTurnEnv):
    name = "echo"

    def make_task(self, rng, task_id):
        return Task(id=task_id, prompt=self.format_prompt(str(rng.random())), answer="x")


@pytest.mark.asyncio
async def test_single_turn_sequence_is_prompt_plus_completion(sampling):
    env = load_environment("reverse_text")
    task = env.tasks("train", 0)[0]
    client = ScriptedClient([Reply(task.answer, versions=(3, 4))])
    rollout = await env.rollout(client, task, sampling)
    prompt_ids = encode(render(task.prompt, None))
    assert rollout.token_ids == prompt_ids + encode(task.answer) + [END_ID]
    assert rollout.prompt_len == len(prompt_ids)
    assert rollout.loss_mask == [False] * len(prompt_ids) + [True] * (len(task.answer) + 1)
    assert (rollout.policy_version_min, rollout.policy_version_max) == (3, 4)
    assert rollout.stop_reason == "done" and not rollout.truncated and rollout.num_turns == 1
    assert rollout.completion == [{"role": "assistant", "content": task.answer}]
    assert client.calls[0]["sampling"] is sampling and client.calls[0]["tools"] is None
    assert (await env.score(task, rollout)).reward == 1.0


@pytest.mark.asyncio
async def test_multi_turn_interleaves_env_tokens_unmasked(sampling):
    env = load_environment("alphabet_sort", num_rounds=3)
    task = env.tasks("train", 0)[0]
    replies = [m["content"] for m in env.sft_example(task) if m["role"] == "assistant"]
    client = ScriptedClient([Reply(r, versions=(v, v)) for v, r in zip([5, 4, 6], replies, strict=True)])
    rollout = await env.rollout(client, task, sampling)
    turns = rollout.turns
    assert rollout.num_turns == rollout.sequence_turns == 3 and rollout.stop_reason == "done"
    check_alignment(rollout, turns)
    # The environment's messages are in the sequence, unmasked, between the model's turns.
    second_prompt = turns[1].prompt_token_ids
    end_of_first = len(turns[0].prompt_token_ids) + len(turns[0].completion_token_ids)
    assert rollout.token_ids[:end_of_first] == second_prompt[:end_of_first]
    env_part = second_prompt[end_of_first:]
    assert "".join(map(chr, env_part)).startswith("\n<user>Add: ")
    assert not any(rollout.loss_mask[end_of_first : end_of_first + len(env_part)])
    # Final sequence = the last prompt + the last completion (nothing lost, nothing duplicated).
    assert rollout.token_ids == turns[2].prompt_token_ids + turns[2].completion_token_ids
    assert (rollout.policy_version_min, rollout.policy_version_max) == (4, 6)
    assert rollout.messages == env.sft_example(task)
    assert (await env.score(task, rollout)).reward == 1.0


@pytest.mark.asyncio
async def test_drift_cuts_the_sample_at_the_last_consistent_turn(sampling, caplog):
    env = load_environment("alphabet_sort", num_rounds=3)
    task = env.tasks("train", 1)[0]
    replies = [m["content"] for m in env.sft_example(task) if m["role"] == "assistant"]
    start = len(encode(render(task.prompt, None)))

    def retokenise_differently(call: int, ids: list[int]) -> list[int]:
        # On the third call the server re-tokenises the first assistant reply differently (a BPE merge).
        if call == 2:
            return ids[:start] + [9999] + ids[start + 2 :]
        return ids

    client = ScriptedClient(replies, mutate_prompt=retokenise_differently)
    with caplog.at_level("WARNING", logger="gyre.envs.base"):
        rollout = await env.rollout(client, task, sampling)
        # logged, once per environment: it was only counted as truncated, and a template that always re-renders
        # earlier turns differently (Qwen3's <think> blocks) trained every multi-turn sample on one turn, silently
        await env.rollout(ScriptedClient(replies, mutate_prompt=retokenise_differently), task, sampling)
    said = [r.getMessage() for r in caplog.records if "does not extend" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("alphabet_sort: turn 3's prompt"), said
    assert f"differ at token {start} of {len(rollout.token_ids)}" in said[0] and "cut after turn 2" in said[0]
    assert rollout.stop_reason == "drift" and rollout.truncated
    assert rollout.num_turns == 3 and rollout.sequence_turns == 2
    check_alignment(rollout, rollout.turns)
    assert rollout.token_ids == rollout.turns[1].prompt_token_ids + rollout.turns[1].completion_token_ids
    # The rejected turn is recorded but is not part of the conversation that gets scored.
    assert [m["role"] for m in rollout.completion] == ["assistant", "user", "assistant"]
    assert len(client.calls) == 3


def test_sequence_builder_rejects_without_changing_state():
    builder = SequenceBuilder()
    first = Turn(prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5], text="c")
    assert builder.add(first)
    before = (list(builder.token_ids), list(builder.loss_mask), list(builder.logprobs))
    shorter = Turn(prompt_token_ids=[1, 2], completion_token_ids=[4], completion_logprobs=[-0.1], text="d")
    changed = Turn(prompt_token_ids=[1, 2, 5, 6], completion_token_ids=[4], completion_logprobs=[-0.1], text="d")
    assert not builder.add(shorter) and not builder.add(changed)
    assert (builder.token_ids, builder.loss_mask, builder.logprobs) == before
    exact = Turn(prompt_token_ids=[1, 2, 3], completion_token_ids=[7], completion_logprobs=[-0.2], text="e")
    assert builder.add(exact)
    assert builder.token_ids == [1, 2, 3, 7] and builder.loss_mask == [False, False, True, True]
    assert builder.logprobs == [0.0, 0.0, -0.5, -0.2] and builder.num_turns == 2


@pytest.mark.asyncio
async def test_length_stop_ends_the_episode(sampling):
    env = load_environment("alphabet_sort")
    task = env.tasks("train", 0)[0]
    client = ScriptedClient([Reply("Ana, B", finish_reason="length"), "unused"])
    rollout = await env.rollout(client, task, sampling)
    assert rollout.stop_reason == "length" and rollout.truncated and len(client.calls) == 1
    assert rollout.token_ids[-1] != END_ID  # no end-of-turn token was sampled
    check_alignment(rollout, rollout.turns)


class Chatty(MultiTurnEnv):
    """Never says done: replies 'go on' forever (the turn budget must stop it)."""

    name = "chatty"

    def make_task(self, rng, task_id):
        return Task(id=task_id, prompt=[{"role": "user", "content": "hi"}])

    async def env_response(self, messages, state):
        return [{"role": "user", "content": f"go on {state['turn']}"}], False


@pytest.mark.asyncio
async def test_max_turns_stops_without_a_dangling_env_message(sampling):
    env = Chatty(max_turns=3, num_eval=1)
    rollout = await env.rollout(ScriptedClient(["a", "b", "c"]), env.tasks("eval")[0], sampling)
    assert rollout.stop_reason == "max_turns" and rollout.num_turns == 3
    assert rollout.completion[-1] == {"role": "assistant", "content": "c"}
    assert [m["content"] for m in rollout.completion if m["role"] == "user"] == ["go on 1", "go on 2"]
    check_alignment(rollout, rollout.turns)


class ContextOf:
    """The scripted client under a context limit: a prompt longer than `limit` tokens raises like the server's 400."""

    def __init__(self, client: ScriptedClient, limit: int) -> None:
        self.client, self.limit = client, limit

    async def chat(self, messages, *, tools=None, sampling):
        if len(encode(render(messages, tools))) + sampling.max_tokens > self.limit:
            raise ContextLengthExceeded("400 context_length_exceeded")
        return await self.client.chat(messages, tools=tools, sampling=sampling)


@pytest.mark.asyncio
async def test_a_turn_past_the_context_ends_the_episode_as_a_length_stop(sampling):
    env = Chatty(max_turns=4, num_eval=1)
    task = env.tasks("eval")[0]
    first = len(encode(render(task.prompt, None)))
    client = ScriptedClient(["a", "b", "c", "d"])
    # turns 1 and 2 fit; turn 3's prompt (after "go on 2") does not
    limit = first + len(encode("a\x02\n<user>go on 1\n<assistant>b\x02\n<user>go on 2\n")) + sampling.max_tokens - 1
    rollout = await env.rollout(ContextOf(client, limit), task, sampling)
    assert rollout.stop_reason == "length" and rollout.truncated and rollout.error is None
    assert rollout.num_turns == rollout.sequence_turns == 2
    assert [m["content"] for m in rollout.completion] == ["a", "go on 1", "b"]  # "go on 2" is never answered
    check_alignment(rollout, rollout.turns)
    # the task's own prompt does not fit: nothing to train, the error goes to the caller
    with pytest.raises(ContextLengthExceeded):
        await env.rollout(ContextOf(ScriptedClient(["a"]), first), task, sampling)


class Broken(MultiTurnEnv):
    name = "broken"

    def make_task(self, rng, task_id):
        return Task(id=task_id, prompt=[{"role": "user", "content": "hi"}])

    async def env_response(self, messages, state):
        raise KeyError("oops")


@pytest.mark.asyncio
async def test_env_bug_ends_the_episode_with_an_error_and_keeps_the_turn(sampling):
    env = Broken(num_eval=1)
    rollout = await env.rollout(ScriptedClient(["a"]), env.tasks("eval")[0], sampling)
    assert rollout.stop_reason == "error" and "KeyError" in rollout.error
    assert rollout.sequence_turns == 1 and rollout.num_completion_tokens == 2


class Guess(MultiTurnEnv):
    """Written as a verifiers user would: a plain (sync) env_response."""

    name = "guess"

    def make_task(self, rng, task_id):
        return Task(id=task_id, prompt=[{"role": "user", "content": "guess"}], answer="7")

    def env_response(self, messages, state):
        if messages[-1]["content"] == state["answer"]:
            return [], True
        return [{"role": "user", "content": "no"}], False


@pytest.mark.asyncio
async def test_a_plain_env_response_runs_as_an_async_one(sampling):
    """A sync env_response was awaited as a tuple: every episode ended as an error ('object tuple can't be used in
    an await expression'). Like reward functions, it may be sync or async."""
    env = Guess(num_eval=1)
    rollout = await env.rollout(ScriptedClient(["3", "7"]), env.tasks("eval")[0], sampling)
    assert rollout.error is None and rollout.stop_reason == "done"
    assert [m["content"] for m in rollout.completion] == ["3", "no", "7"]
    check_alignment(rollout, rollout.turns)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (({"role": "user", "content": "no"}, False), "messages a list of dicts with a 'role'"),  # its keys were added
        (("try again", False), "messages a list of dicts"),  # its characters were added as messages
        (([], "yes"), r"done True or False \(or verifiers' \(messages, state\)\), got done = str 'yes'"),
        ([{"role": "user", "content": "no"}], r"must return \(messages, done\), got list"),
    ],
)
@pytest.mark.asyncio
async def test_an_env_response_of_another_shape_ends_the_episode_saying_so(sampling, answer, why):
    """A message dict or a string was added to the conversation as a list (its keys, its characters: a corrupt
    prompt for the next turn and for training), and verifiers' (messages, state) took a non-empty state as done."""

    class Odd(Guess):
        async def env_response(self, messages, state):
            return answer

    env = Odd(num_eval=1)
    rollout = await env.rollout(ScriptedClient(["3", "4"]), env.tasks("eval")[0], sampling)
    assert rollout.stop_reason == "error" and rollout.num_turns == 1
    assert re.search(f"env_response failed: TypeError: env_response .*{why}", rollout.error), rollout.error
    assert rollout.completion == [{"role": "assistant", "content": "3"}]


@pytest.mark.asyncio
async def test_verifiers_multi_turn_hooks_run_as_there(sampling):
    """A verifiers env ported as it was defines is_completed and setup_state and returns (messages, state): Gyre
    never called the hooks (every episode ran to max_turns) and refused the state as `done` (an error on the first
    reply). setup_state runs first, is_completed after every model turn and again after env_response (before the
    next model turn, as verifiers' loop asks it), and a returned state is the state."""
    seen = []

    class Ported(Guess):
        def setup_state(self, state, **kwargs):  # sync or async, as verifiers' maybe_await allows
            return {**state, "guesses": []}

        async def is_completed(self, messages, state, **kwargs):
            seen.append(state["turn"])
            return messages[-1]["content"] == state["answer"] or await super().is_completed(messages, state)

        async def env_response(self, messages, state, **kwargs):
            guesses = [*state["guesses"], messages[-1]["content"]]
            return [{"role": "user", "content": "no"}], {**state, "guesses": guesses}

    env = Ported(num_eval=1, max_turns=4)
    rollout = await env.rollout(ScriptedClient(["3", "5", "7", "8"]), env.tasks("eval")[0], sampling)
    assert rollout.error is None and rollout.stop_reason == "done" and seen == [1, 1, 2, 2, 3]
    assert [m["content"] for m in rollout.completion] == ["3", "no", "5", "no", "7"]
    assert rollout.state["guesses"] == ["3", "5"]
    check_alignment(rollout, rollout.turns)
    # the default is_completed (via super()) is the turn budget: a model that never guesses stops at max_turns
    rollout = await env.rollout(ScriptedClient(["1", "2", "3", "4", "5"]), env.tasks("eval")[0], sampling)
    assert rollout.stop_reason == "done" and rollout.num_turns == 4 and seen[-1] == 4


@pytest.mark.asyncio
async def test_a_verifiers_env_response_that_ends_the_game_ends_the_episode(sampling):
    """verifiers asks is_completed before every model turn, so a game its env_response ends (a text-arena game that
    sets state["is_finished"] on the winning move and announces it) stops there. Asked only after model turns, the
    model was sampled once more after the win: that reply was trained, and the rubric read it as the final answer."""

    class Arena(Guess):
        async def is_completed(self, messages, state, **kwargs):
            return state.get("is_finished", False) or await self.max_turns_reached(state)

        async def env_response(self, messages, state, **kwargs):
            won = messages[-1]["content"] == state["answer"]
            return [{"role": "user", "content": "You won!" if won else "no"}], {**state, "is_finished": won}

    env = Arena(num_eval=1, max_turns=4)
    rollout = await env.rollout(ScriptedClient(["3", "7", "after the game"]), env.tasks("eval")[0], sampling)
    assert rollout.error is None and rollout.stop_reason == "done" and rollout.num_turns == 2
    assert [m["content"] for m in rollout.completion] == ["3", "no", "7", "You won!"]
    assert rollout.state["is_finished"] is True
    check_alignment(rollout, rollout.turns)


@pytest.mark.asyncio
async def test_client_errors_propagate(sampling):
    class Down:
        async def chat(self, messages, *, tools=None, sampling):
            raise ConnectionError("replica down")

    env = Echo(num_eval=1)
    with pytest.raises(ConnectionError):
        await env.rollout(Down(), env.tasks("eval")[0], sampling)


@pytest.mark.asyncio
async def test_rollout_does_not_mutate_the_task(sampling):
    env = load_environment("alphabet_sort")
    task = env.tasks("train", 0)[0]
    before = [dict(m) for m in task.prompt]
    await env.rollout(ScriptedClient(["x", "y"]), task, sampling)
    assert task.prompt == before


def test_turn_rejects_misaligned_or_invalid_records():
    with pytest.raises(ValueError, match="align"):
        Turn(prompt_token_ids=[1], completion_token_ids=[2, 3], completion_logprobs=[-1.0], text="")
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Turn(prompt_token_ids=[], completion_token_ids=[2], completion_logprobs=[-1.0], text="")
    with pytest.raises(ValueError, match="log-prob"):
        Turn(prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[0.5], text="")
    with pytest.raises(ValueError, match="log-prob"):
        Turn(prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[float("nan")], text="")
    with pytest.raises(ValueError, match="policy_version"):
        Turn(prompt_token_ids=[1], completion_token_ids=[], completion_logprobs=[], text="", policy_version_min=2)


@pytest.mark.asyncio
async def test_one_environment_serves_concurrent_rollouts(sampling):
    """Rollouts interleave on the event loop; each keeps its own state, messages and sequence."""
    env = load_environment("alphabet_sort", num_rounds=3)
    tasks = [env.tasks("train", 5)[i] for i in range(16)]

    class Interleaving(ScriptedClient):
        async def chat(self, messages, *, tools=None, sampling):
            await asyncio.sleep(0)  # let the other rollouts run between turns
            return await super().chat(messages, tools=tools, sampling=sampling)

    clients = [Interleaving([m["content"] for m in env.sft_example(t) if m["role"] == "assistant"]) for t in tasks]
    rollouts = await asyncio.gather(*(env.rollout(c, t, sampling) for c, t in zip(clients, tasks, strict=True)))
    for task, rollout in zip(tasks, rollouts, strict=True):
        assert rollout.task_id == task.id and rollout.messages == env.sft_example(task)
        assert rollout.state["info"] == task.info and rollout.state["turn"] == 3
        check_alignment(rollout, rollout.turns)
        assert (await env.score(task, rollout)).reward == 1.0


@pytest.mark.asyncio
async def test_rollouts_dump_to_json(sampling):
    env = load_environment("calculator")
    task = env.tasks("train", 0)[0]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    rollout = await env.rollout(ScriptedClient([call, "2"]), task, sampling)
    record = json.loads(json.dumps(dataclasses.asdict(rollout)))
    assert record["token_ids"] == rollout.token_ids and record["turns"][0]["text"] == call
    assert record["state"]["tool_calls"][0]["result"] == "2"
