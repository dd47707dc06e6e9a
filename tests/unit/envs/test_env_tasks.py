"""Task sources: deterministic given the seed, index-addressable, and disjoint train/eval splits."""

from __future__ import annotations

import itertools
import random

import pytest
from gyre.envs import MultiTurnEnv, SingleTurnEnv, Task, load_environment

BUILTINS = ["reverse_text", "arithmetic", "alphabet_sort", "calculator"]


@pytest.mark.parametrize("name", BUILTINS)
def test_train_split_is_deterministic_and_seed_dependent(name):
    a = list(itertools.islice(load_environment(name).tasks("train", seed=3), 50))
    b = list(itertools.islice(load_environment(name).tasks("train", seed=3), 50))
    c = list(itertools.islice(load_environment(name).tasks("train", seed=4), 50))
    assert a == b
    assert [t.key for t in a] != [t.key for t in c]
    assert len({t.id for t in a}) == 50


@pytest.mark.parametrize("name", BUILTINS)
def test_splits_are_disjoint_for_any_seeds(name):
    env = load_environment(name, num_eval=64)
    eval_tasks = list(env.tasks("eval", seed=0))
    eval_keys = {t.key for t in eval_tasks}
    assert len(eval_tasks) == len(eval_keys) == 64  # distinct
    assert [t.key for t in env.tasks("eval", seed=99)] == [t.key for t in eval_tasks]  # fixed held-out set
    for seed in range(3):
        train_keys = {t.key for t in itertools.islice(env.tasks("train", seed), 300)}
        assert not train_keys & eval_keys


def test_train_redraws_tasks_that_collide_with_eval():
    # 2 letters from "ab" -> 4 possible strings; 3 of them are held out, so train must always be the 4th.
    env = load_environment("reverse_text", min_length=2, max_length=2, alphabet="ab", num_eval=3)
    eval_texts = {t.info["text"] for t in env.tasks("eval")}
    train_texts = {t.info["text"] for t in itertools.islice(env.tasks("train", 0), 20)}
    assert len(eval_texts) == 3 and len(train_texts) == 1 and not train_texts & eval_texts


def test_too_small_task_space_fails_clearly():
    with pytest.raises(ValueError, match="num_eval"):
        list(load_environment("reverse_text", min_length=1, max_length=1, alphabet="ab", num_eval=3).tasks("eval"))
    env = load_environment("reverse_text", min_length=1, max_length=1, alphabet="ab", num_eval=2)
    with pytest.raises(ValueError, match="too small"):
        env.tasks("train", 0)[0]


def test_sources_are_index_addressable_for_resume():
    source = load_environment("arithmetic").tasks("train", seed=7)
    first = list(itertools.islice(source, 30))
    assert [source[i] for i in range(30)] == first
    assert list(itertools.islice(source.iter_from(12), 18)) == first[12:]
    assert source.size is None
    with pytest.raises(TypeError, match="endless"):
        len(source)
    evals = load_environment("arithmetic", num_eval=5).tasks("eval")
    assert len(evals) == 5 and [t.id for t in evals] == [f"eval-{i}" for i in range(5)]
    with pytest.raises(IndexError):
        evals[5]


def test_bad_split_is_rejected():
    with pytest.raises(ValueError, match="split"):
        load_environment("reverse_text").tasks("test", 0)  # type: ignore[arg-type]


def test_task_generators_respect_their_args():
    env = load_environment("reverse_text", min_length=5, max_length=6, alphabet="xyz")
    for task in itertools.islice(env.tasks("train", 0), 100):
        text = task.prompt[-1]["content"]
        assert 5 <= len(text) <= 6 and set(text) <= set("xyz") and task.answer == text[::-1]
        assert task.prompt[0] == {"role": "system", "content": "Reverse the text."}
    env = load_environment("arithmetic", max_value=20, num_steps=3, operations="+-*/")
    for task in itertools.islice(env.tasks("train", 0), 200):
        assert int(task.answer) >= 0
    env = load_environment("alphabet_sort", num_rounds=3, min_names=1, max_names=4)
    for task in itertools.islice(env.tasks("train", 0), 100):
        rounds = task.info["rounds"]
        names = [n for r in rounds for n in r]
        assert len(rounds) == 3 and all(1 <= len(r) <= 4 for r in rounds) and len(set(names)) == len(names)
        assert task.answer == ", ".join(sorted(names))
    env = load_environment("calculator", max_value=99, num_operands=3, operations="*")
    for task in itertools.islice(env.tasks("train", 0), 50):
        a, b, c = (int(x) for x in task.info["expression"].split(" * "))
        assert task.answer == str(a * b * c) and all(10 <= x <= 99 for x in (a, b, c))


@pytest.mark.asyncio
@pytest.mark.parametrize("reward", ["exact", "lcs"])
async def test_reverse_text_with_spaces_in_its_alphabet_rewards_the_reference_fully(reward):
    """The reply is read stripped: a text starting or ending with a space (about half of them with alphabet " ab")
    had a reversal no reply could give, and even the reference reply (the SFT example) scored 0 with `exact`.
    Whitespace now stays inside the text, where it is kept."""
    from envs_doubles import ScriptedClient
    from gyre.envs import SamplingParams

    env = load_environment("reverse_text", alphabet=" ab", reward=reward, min_length=3, max_length=5, num_eval=4)
    tasks = [env.tasks("train", 0)[i] for i in range(40)]
    assert any(" " in task.answer for task in tasks)
    for task in tasks:
        assert task.answer == task.answer.strip()
        reference = env.sft_example(task)[-1]["content"]
        rollout = await env.rollout(ScriptedClient([reference]), task, SamplingParams(max_tokens=16))
        assert (await env.score(task, rollout)).reward == 1.0, task.answer


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("reverse_text", {"min_length": 0}),
        ("reverse_text", {"min_length": 5, "max_length": 3}),
        ("reverse_text", {"alphabet": "aa"}),
        ("reverse_text", {"alphabet": " \n"}),  # nothing a stripped reply can start or end with
        ("arithmetic", {"operations": "+^"}),
        ("arithmetic", {"num_steps": 0}),
        ("alphabet_sort", {"max_names": 100}),
        ("calculator", {"num_operands": 1}),
        ("calculator", {"operations": "/"}),
        ("calculator", {"num_eval": 0}),
    ],
)
def test_bad_environment_args_are_rejected(name, args):
    with pytest.raises(ValueError):
        load_environment(name, **args)


def test_custom_environment_only_needs_make_task():
    class Dice(SingleTurnEnv):
        name = "dice"

        def make_task(self, rng: random.Random, task_id: str) -> Task:
            roll = rng.randint(1, 1000)
            return Task(id=task_id, prompt=self.format_prompt(f"{roll}?"), answer=str(roll))

    env = Dice(num_eval=10, system_prompt="Echo the number.")
    assert len(env.tasks("eval")) == 10
    assert env.tasks("train", 1)[0] == Dice(num_eval=10, system_prompt="Echo the number.").tasks("train", 1)[0]


def test_a_game_with_one_prompt_says_how_to_tell_its_tasks_apart():
    """A guessing game (verifiers' Wordle) asks the same question in every task, its secret in the answer: its eval
    split failed with 'lower num_eval', whatever num_eval was. The error now says tasks are told apart by their
    prompt and names the hook, task_key; with it the game has as many tasks as secrets, and train draws still
    never give an eval task."""

    class Guess(MultiTurnEnv):
        name = "guess"

        def make_task(self, rng: random.Random, task_id: str) -> Task:
            return Task(
                id=task_id, prompt=self.format_prompt("Guess my number, 1 to 20."), answer=str(rng.randint(1, 20))
            )

    hint = r"overrides task_key\(task\), e.g. return task.key \+ task.answer"
    with pytest.raises(
        ValueError, match=r"guess: could not draw 8 distinct eval tasks: 800 draws gave only 1 .*" + hint
    ):
        Guess(num_eval=8).tasks("eval")

    class Secret(Guess):
        def task_key(self, task: Task) -> str:
            return task.key + task.answer

    env = Secret(num_eval=8)
    secrets = {task.answer for task in env.tasks("eval")}
    assert len(secrets) == 8
    train = {task.answer for task in itertools.islice(env.tasks("train", 0), 50)}
    assert train and not train & secrets


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"prompt": "Reverse: abc"}, "prompt must be a non-empty list of chat messages, got str .*format_prompt"),
        ({"prompt": []}, "prompt must be a non-empty list"),
        ({"prompt": ["Reverse: abc"]}, "each prompt message is a dict with a 'role'"),
        ({"answer": 7}, r"answer must be text \(str\), got int 7: write answer=str"),
        ({"info": "x"}, "info must be a dict"),
    ],
)
def test_a_task_drawn_wrong_fails_where_it_is_made(fields, why):
    """A text prompt failed every rollout with a TypeError deep in the client; an int answer (answer=a + b) scored
    every reply 0, silently (the reply's text never equals an int)."""
    with pytest.raises(TypeError, match=f"^Task 't': {why}"):
        Task(**{"id": "t", "prompt": [{"role": "user", "content": "hi"}], **fields})
