"""`reasoning_gym:<dataset>` environments: seeded splits and reasoning-gym's own scorer, on several datasets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from envs_doubles import ScriptedClient
from gyre.envs import EnvironmentLoadError, load_environment

pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is part of the dev install")

DATASETS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "spell_backward": {},
    "letter_counting": {},
}


async def reward_of(env, task, reply: str, sampling) -> float:
    rollout = await env.rollout(ScriptedClient([reply]), task, sampling)
    return (await env.score(task, rollout)).reward


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_splits_are_seeded_and_disjoint(dataset):
    env = load_environment(f"reasoning_gym:{dataset}", config=DATASETS[dataset], num_eval=16)
    assert env.name == f"reasoning_gym:{dataset}"
    evals = [env.tasks("eval")[i] for i in range(16)]
    again = load_environment(f"reasoning_gym:{dataset}", config=DATASETS[dataset], num_eval=16)
    assert [t.prompt for t in again.tasks("eval")] == [t.prompt for t in evals]  # same across runs
    train = env.tasks("train", seed=0)
    assert train.size is None
    drawn = [train[i] for i in range(64)]
    assert [t.prompt for t in drawn[:8]] == [again.tasks("train", seed=0)[i].prompt for i in range(8)]
    assert [t.prompt for t in drawn[:8]] != [env.tasks("train", seed=1)[i].prompt for i in range(8)]
    assert not {t.key for t in drawn} & {t.key for t in evals}
    assert all(t.prompt[-1]["role"] == "user" and t.answer for t in drawn)


@pytest.mark.asyncio
@pytest.mark.parametrize("dataset", sorted(DATASETS))
async def test_scored_by_reasoning_gym(dataset, sampling):
    env = load_environment(f"reasoning_gym:{dataset}", config=DATASETS[dataset], num_eval=4)
    task = env.tasks("eval")[0]
    assert await reward_of(env, task, task.answer, sampling) == 1.0
    assert await reward_of(env, task, f"<think>easy</think><answer>{task.answer}</answer>", sampling) == 1.0
    assert await reward_of(env, task, "zzz 123 qqq", sampling) < 1.0
    assert await reward_of(env, task, "", sampling) == 0.0


def test_the_eval_split_is_distinct_tasks_even_at_an_easy_config():
    """At 2 one-digit terms, 128 seeded draws hold 100 distinct questions: 28 counted twice in every eval."""
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    env = load_environment("reasoning_gym:chain_sum", config=config, num_eval=128)
    evals = list(env.tasks("eval"))
    assert len(evals) == 128 and len({t.key for t in evals}) == 128
    assert [t.id for t in evals] == [f"eval-{i}" for i in range(128)]
    first = env.eval_data[0]  # items that are not repeats stay where they were
    assert evals[0].prompt[-1]["content"] == first["question"]
    assert not {env.tasks("train")[i].key for i in range(50)} & {t.key for t in evals}
    with pytest.raises(ValueError, match="could not draw 300 distinct eval tasks"):
        load_environment("reasoning_gym:chain_sum", config=config, num_eval=300).tasks("eval")


def test_chain_sum_config_controls_difficulty():
    env = load_environment("reasoning_gym:chain_sum", config={"min_terms": 2, "max_terms": 2, "max_digits": 1})
    for i in range(20):
        expression = env.tasks("train")[i].info["entry"]["metadata"]["expression"]
        assert len(expression.split()) == 3 and all(len(t) == 1 for t in expression.split()[::2])


def test_bad_names_and_config():
    with pytest.raises(ValueError, match="unknown dataset 'chain_summ'.*chain_sum"):
        load_environment("reasoning_gym:chain_summ")
    with pytest.raises(ValueError, match="reasoning_gym:chain_sum: config .*max_digitz.*its keys: min_terms"):
        load_environment("reasoning_gym:chain_sum", config={"max_digitz": 1})
    with pytest.raises(EnvironmentLoadError, match="reasoning_gym:<name>"):
        load_environment("reasoning-gym")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # reasoning-gym's own checks are asserts: a bare "min_terms must be positive" named no environment
        ({"min_terms": 0}, r"reasoning_gym:chain_sum: config \{'min_terms': 0\} is refused: min_terms must be"),
        # Gyre passes seed and size itself: "create_dataset() got multiple values for keyword argument 'seed'"
        ({"seed": 3}, "reasoning_gym:chain_sum: config key.* seed are Gyre's to set"),
        ([1], "reasoning_gym:chain_sum: config must be a table"),
    ],
)
def test_a_refused_config_names_the_environment_and_its_keys(config, message):
    with pytest.raises(ValueError, match=message):
        load_environment("reasoning_gym:chain_sum", config=config)


def test_sft_examples_earn_full_reward():
    env = load_environment("reasoning_gym:spell_backward", num_eval=2)
    task = env.tasks("train")[0]
    assert env.sft_example(task)[-1] == {"role": "assistant", "content": task.answer}


# Scorers that run the reply: eval() for Python lists, sympy's parse_expr (an eval) for expressions.
EVALUATING = ["spiral_matrix", "binary_matrix", "string_insertion", "n_queens", "countdown", "puzzle24",
              "polynomial_multiplication", "simple_integration"]  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("dataset", EVALUATING)
async def test_a_reply_never_runs_as_code(dataset, tmp_path, sampling):
    """reasoning-gym's scorers eval()'d the reply: `__import__('os')...` ran in the orchestrator."""
    env = load_environment(f"reasoning_gym:{dataset}", num_eval=2)
    task = env.tasks("eval")[0]
    marker = tmp_path / "ran"
    payload = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    for reply in (payload, f"[{payload}]", "1 + exec(chr(49))", "open(chr(47))"):
        reward = await reward_of(env, task, reply, sampling)
        assert 0.0 <= reward < 1.0 and not marker.exists(), reply


HANG_CHECK = """
import asyncio, sys
from envs_doubles import ScriptedClient
from gyre.envs import SamplingParams, load_environment
env = load_environment(f"reasoning_gym:{sys.argv[1]}", num_eval=2)
task = env.tasks("eval")[0]
async def main():
    for reply in ("9**9**9**9", "2**(2**(2**(2**99)))", "((9**999)**999)**999"):
        rollout = await env.rollout(ScriptedClient([reply]), task, SamplingParams(max_tokens=64))
        print((await env.score(task, rollout)).reward)
asyncio.run(main())
"""


@pytest.mark.parametrize("dataset", ["countdown", "puzzle24", "polynomial_multiplication"])
def test_a_reply_cannot_hang_the_scorer(dataset):
    """sympy computed `9**9**9**9` for ever, holding the GIL (no timeout can stop it in-process): run it in a child."""
    done = subprocess.run([sys.executable, "-c", HANG_CHECK, dataset], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert all(0.0 <= float(r) < 1.0 for r in done.stdout.split()) and len(done.stdout.split()) == 3


@pytest.mark.asyncio
async def test_replies_in_other_valid_forms_still_score(sampling):
    """The guard reads the reply as data; answers the scorers accept in other forms keep their reward."""
    cases = {
        "spiral_matrix": (lambda a: str([int(x) for x in a.split()]), 0.1),  # the list form: the scorer's 0.1
        "n_queens": (lambda a: str([list(r.replace(" ", "")) for r in a.split("\n")]), 0.5),
        "countdown": (lambda a: f"({a})", 1.0),
        "polynomial_multiplication": (lambda a: f"1*({a})", 1.0),
        "bitwise_arithmetic": (lambda a: a, 1.0),  # scored by eval() of the task's own problem: still allowed
    }
    for dataset, (rewrite, expected) in cases.items():
        env = load_environment(f"reasoning_gym:{dataset}", num_eval=3)
        for task in env.tasks("eval"):
            assert await reward_of(env, task, rewrite(task.answer), sampling) == expected, (dataset, task.answer)
