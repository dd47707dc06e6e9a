"""`reasoning_gym:<dataset>`: a reasoning-gym procedural dataset as a single-turn environment, scored by its own
verifier (`score_answer`).

    [orchestrator.env]
    name = "reasoning_gym:chain_sum"
    args = { config = { min_terms = 2, max_terms = 2, max_digits = 1 } }

Needs the optional `reasoning-gym` package (`pip install 'gyre[reasoning-gym]'`; pure Python, no torch).
`config` is passed to reasoning-gym's dataset config (difficulty knobs differ per dataset; a wrong key or value fails
at load with reasoning-gym's message and the dataset's keys; `seed` and `size` are Gyre's). Splits: "eval" is the
dataset generated with `eval_seed` (`num_eval` distinct items, fixed across runs: a repeated question is replaced by
the dataset's next item); "train" is endless, item `i` of the
dataset generated from (`seed`, `i`), and an item whose question is also in the eval split is redrawn. The reply is
the assistant text after its reasoning (`<think>`), or the content of its last `<answer>` block when it has one
(reasoning-gym's own prompt format), handed to the dataset's scorer (reward in [0, 1]) inside
`reply_guard.reply_is_data`, because some scorers `eval` the text they grade.
"""

from __future__ import annotations

import hashlib
import re
from functools import cached_property
from typing import Any

from gyre.envs.base import SingleTurnEnv
from gyre.envs.parsers import Parser
from gyre.envs.reply_guard import reply_is_data
from gyre.envs.rubric import Rubric
from gyre.envs.splits import MAX_REDRAWS, TaskSource, distinct_tasks
from gyre.envs.types import Split, Task

SYSTEM_PROMPT = "Answer the question. Reply with the answer only."
ANSWER_TAG = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
# Train items come from datasets of this many items (reasoning-gym draws item i from seed + i, lazily).
TRAIN_CHUNK = 1 << 20


class AnswerTagParser(Parser):
    """The last `<answer>...</answer>` block when there is one, else the whole reply."""

    def parse(self, text: str) -> str:
        blocks = ANSWER_TAG.findall(text)
        return (blocks[-1] if blocks else text).strip()


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(
            "the reasoning_gym environments need the reasoning-gym package: pip install 'gyre[reasoning-gym]'"
        ) from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def config_keys(dataset: str) -> list[str]:
    """The settings of a dataset's config (a dataclass in reasoning-gym), Gyre's own `seed` and `size` left out."""
    from dataclasses import fields, is_dataclass

    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[dataset][1]
    names = [f.name for f in fields(config_cls)] if is_dataclass(config_cls) else []
    return [name for name in names if name not in ("seed", "size")]


class ReasoningGymEnv(SingleTurnEnv):
    def __init__(self, *, dataset: str, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        rg = import_reasoning_gym()
        if dataset not in dataset_names():
            raise ValueError(f"reasoning_gym: unknown dataset {dataset!r}; it has: {', '.join(dataset_names())}")
        parser = AnswerTagParser()
        super().__init__(parser=parser, rubric=Rubric([self.verified], parser=parser), **kwargs)
        self.name = f"reasoning_gym:{dataset}"
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"{self.name}: config must be a table of the dataset's settings, got {config!r}")
        self.dataset, self.config = dataset, dict(config or {})
        reserved = sorted({"seed", "size"} & set(self.config))
        if reserved:
            raise ValueError(
                f"{self.name}: config key(s) {', '.join(reserved)} are Gyre's to set (eval: eval_seed and num_eval; "
                "train: drawn from the run's seed); remove them"
            )
        self._create = rg.create_dataset
        # Fails here, at load time, for a key the dataset does not know or a value its own checks refuse (those
        # are asserts in reasoning-gym: say which environment and which keys it has).
        try:
            self.eval_data = self._create(dataset, seed=self.eval_seed, size=self.num_eval, **self.config)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(
                f"{self.name}: config {self.config} is refused: {exc or type(exc).__name__} "
                f"(its keys: {', '.join(config_keys(dataset))})"
            ) from exc

    async def verified(self, completion, info, parser) -> float:
        """reasoning-gym's own verifier on the parsed reply (0 when there is none)."""
        reply = parser.parse_answer(completion)
        if reply is None:
            return 0.0
        with reply_is_data(info["entry"]):
            return float(self.eval_data.score_answer(answer=reply, entry=info["entry"]))

    def _task(self, entry: dict[str, Any], task_id: str) -> Task:
        return Task(
            id=task_id, prompt=self.format_prompt(entry["question"]), answer=str(entry["answer"]), info={"entry": entry}
        )

    @cached_property
    def _eval_tasks(self) -> list[Task]:
        """The eval dataset's items, each question once: at an easy config two seeds draw the same question (28 of
        chain_sum's 128 at 2 one-digit terms), which counted it twice in every eval; a repeat is replaced by the next
        item of the same seeded dataset, so the eval split is `num_eval` distinct tasks as in every environment."""
        more: list[Any] = []  # items past num_eval: reasoning-gym draws item i lazily from seed + i

        def draw(index: int, task_id: str) -> Task:
            if index < len(self.eval_data):
                return self._task(self.eval_data[index], task_id)
            if not more:
                size = self.num_eval * MAX_REDRAWS
                more.append(self._create(self.dataset, seed=self.eval_seed, size=size, **self.config))
            return self._task(more[0][index], task_id)

        return distinct_tasks(draw, self.num_eval, self.name)

    def _train_data(self, seed: int, chunk: int):
        digest = hashlib.sha256(f"{self.dataset}/train/{seed}/{chunk}".encode()).digest()
        return self._create(self.dataset, seed=int.from_bytes(digest[:6], "big"), size=TRAIN_CHUNK, **self.config)

    def tasks(self, split: Split, seed: int = 0) -> TaskSource:
        if split != "train":
            return super().tasks(split, seed)
        datasets: dict[int, Any] = {}

        def task(index: int) -> Task:
            for attempt in range(MAX_REDRAWS):
                chunk, offset = divmod(index + attempt * TRAIN_CHUNK // MAX_REDRAWS, TRAIN_CHUNK)
                if chunk not in datasets:
                    datasets[chunk] = self._train_data(seed, chunk)
                candidate = self._task(datasets[chunk][offset], f"train-{seed}-{index}")
                if candidate.key not in self._eval_keys:
                    return candidate
            raise ValueError(f"{self.name}: train draws keep hitting the eval split; the task space is too small")

        return TaskSource(task, None)


def load_environment(
    dataset: str,
    config: dict[str, Any] | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    num_eval: int = 128,
    eval_seed: int = 1234,
) -> ReasoningGymEnv:
    """Args: reasoning-gym dataset name, its config (difficulty), prompt, eval split size and seed."""
    return ReasoningGymEnv(
        dataset=dataset, config=config, system_prompt=system_prompt, num_eval=num_eval, eval_seed=eval_seed
    )
