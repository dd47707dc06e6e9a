"""`dataset`: prompts with reference answers from a JSONL or parquet file, one model turn, a rule-based reward.

    [orchestrator.env]
    name = "dataset"
    args = { path = "data/train.jsonl", eval_path = "data/test.jsonl", reward = "math" }

Rows (one JSON object per line, or one parquet row):

    {"prompt": "What is 2 + 3?", "answer": "5"}
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}], "answer": 5}
    {"prompt": "...", "answer": "...", "split": "eval"}

A row without a `prompt` column is asked its `question` (verifiers' layout) while `prompt_key` is left as it is.
`prompt_key` / `answer_key` name the columns and may be dotted paths into nested objects, so verl's parquet
layout (`prompt` = chat messages, `reward_model.ground_truth`) loads with `answer_key = "reward_model.ground_truth"`.
A text prompt becomes one user message after `system_prompt`; a message list is used as it is (with
`system_prompt` prepended when it has no system message). The whole row is kept as `task.info`, so a user reward
function can read any other column, and so are the keys of an `info` column holding an object (verifiers' layout).

Splits, first that applies: `eval_path` (a second file is the eval split, `path` is all train); a `split` column
("train", or "eval"/"test"/"validation"); otherwise `num_eval` rows chosen with `eval_seed` are held out. The train
split is endless: epoch `e` visits every train row once in an order seeded by (`seed`, `e`), so `tasks[i]` stays
a pure function of `i` and a resumed run continues exactly.

Rewards (`reward`): "exact" (the reply, stripped and with whitespace runs collapsed, equals the answer), "math"
(math-verify: numbers, fractions, LaTeX, `\\boxed{}`), or an import path `package.module:function` to a reward
function that takes rubric arguments by name (`completion`, `answer`, `info`, ... see `gyre.envs.rubric`); or a list
of them, with `weights` (one each, default 1), summed as a `Rubric` (each reported on its own).

A train row whose prompt is also in the eval split (a duplicated row, an eval file overlapping the train file) is
left out of training, with a warning, so eval stays held out. A row that cannot be used (not UTF-8, bad JSON, no
prompt, no answer, an unknown split) fails loading with the file and line (or parquet row) named; nothing else is
skipped. A file holding one JSON array is refused as such (the format is JSON Lines).

The rows become tasks in `RowTasks`, which any environment uses when given `dataset=` (a multi-turn or tool
environment over the user's own file: `ToolEnv(dataset="data.jsonl", tools=[...], rubric=...)`); `DatasetEnv` is the
single-turn one with a rule-based reward.
"""

from __future__ import annotations

from gyre.envs.base import SingleTurnEnv
from gyre.envs.parsers import Parser
from gyre.envs.rows import DatasetError, RowTasks, read_rows  # noqa: F401 (re-exported: user code catches DatasetError)
from gyre.envs.rubric import RewardFunc, Rubric
from gyre.envs.scoring import math_equal
from gyre.envs.types import Messages, Task
from gyre.imports import load_callable


def exact_match(completion: Messages, answer: str, parser: Parser) -> float:
    """1.0 when the reply equals the answer after stripping and collapsing whitespace."""
    reply = parser.parse_answer(completion)
    return float(reply is not None and " ".join(reply.split()) == " ".join(answer.split()))


def math_match(completion: Messages, answer: str, parser: Parser) -> float:
    """1.0 when math-verify finds the reply's final answer equal to the reference."""
    return float(math_equal(parser.parse_answer(completion), answer))


REWARDS: dict[str, RewardFunc] = {"exact": exact_match, "math": math_match}


def resolve_reward(reward: str) -> RewardFunc:
    if reward in REWARDS:
        return REWARDS[reward]
    if ":" not in reward:
        raise ValueError(f"reward {reward!r}: use one of {sorted(REWARDS)} or an import path 'package.module:func'")
    return load_callable(reward, f"reward {reward!r}")


def rubric_of(reward: str | list[str], weights: list[float] | None, parser: Parser) -> Rubric:
    """The rubric of `reward` (one name or import path, or a list of them: several reward functions, as a verifiers
    rubric's `funcs`) and `weights` (one per function, default 1 each); mistakes name the setting."""
    rewards = [reward] if isinstance(reward, str) else reward
    if not isinstance(rewards, list) or not rewards or not all(isinstance(r, str) for r in rewards):
        raise ValueError(f"reward: a name or import path, or a non-empty list of them, got {reward!r}")
    if weights is not None and len(weights) != len(rewards):
        raise ValueError(f"weights: {len(weights)} weights for {len(rewards)} rewards {rewards}: give one per reward")
    funcs = [resolve_reward(r) for r in rewards]
    names = [getattr(func, "__name__", r) for func, r in zip(funcs, rewards, strict=True)]
    if len(set(names)) < len(names):
        raise ValueError(f"reward: {rewards} names a reward function twice")
    return Rubric(funcs, weights, parser=parser)


class DatasetEnv(SingleTurnEnv):
    name = "dataset"

    def __init__(
        self,
        *,
        path: str,
        eval_path: str | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        split_key: str = "split",
        reward: str | list[str] = "exact",
        weights: list[float] | None = None,
        system_prompt: str | None = None,
        num_eval: int = 64,
        eval_seed: int = 1234,
    ) -> None:
        parser = Parser()
        super().__init__(
            parser=parser,
            rubric=rubric_of(reward, weights, parser),
            system_prompt=system_prompt,
            num_eval=num_eval,
            eval_seed=eval_seed,
            dataset=path,
            eval_dataset=eval_path,
            prompt_key=prompt_key,
            answer_key=answer_key,
            split_key=split_key,
        )

    @property
    def train_tasks(self) -> list[Task]:
        return self.row_tasks.train

    @property
    def eval_tasks(self) -> list[Task]:
        return self.row_tasks.eval


def load_environment(
    path: str,
    eval_path: str | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    split_key: str = "split",
    reward: str | list[str] = "exact",
    weights: list[float] | None = None,
    system_prompt: str | None = None,
    num_eval: int = 64,
    eval_seed: int = 1234,
) -> DatasetEnv:
    """A JSONL/parquet dataset of prompts and reference answers; see the module docstring for every argument."""
    return DatasetEnv(
        path=path,
        eval_path=eval_path,
        prompt_key=prompt_key,
        answer_key=answer_key,
        split_key=split_key,
        reward=reward,
        weights=weights,
        system_prompt=system_prompt,
        num_eval=num_eval,
        eval_seed=eval_seed,
    )
