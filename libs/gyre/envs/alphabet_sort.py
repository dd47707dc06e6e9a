"""`alphabet_sort`: sort names, then keep the list sorted as the environment adds names (multi-turn).

    system:    Sort the names alphabetically. Reply with the names separated by commas.
    user:      Ivy, Ben, Tom
    assistant: Ben, Ivy, Tom
    user:      Add: Ana, Max
    assistant: Ana, Ben, Ivy, Max, Tom

Every round's reply is compared with the full sorted list so far by LCS ratio over names; the reward is the
mean over rounds (a round never answered scores 0). `task.info["rounds"]` holds the names added per round and
`task.answer` the final sorted list.
"""

from __future__ import annotations

import random
import re
from typing import Any

from gyre.envs.base import MultiTurnEnv
from gyre.envs.parsers import Parser, assistant_texts
from gyre.envs.rubric import Rubric
from gyre.envs.scoring import lcs_ratio
from gyre.envs.types import Messages, Task

SYSTEM_PROMPT = "Sort the names alphabetically. Reply with the names separated by commas."
_NAMES_TEXT = """
Ada Alan Ana Anna Ben Bob Cara Carl Dan Dora Eli Emma Eva Finn Gus Hana Ian Ida Ivy Jack Jane Jon
Kai Kim Lea Leo Liam Lily Luca Max Mia Nia Noah Nora Omar Otto Paul Pia Raj Rosa Ruby Sam Sara Tess
Tom Uma Vera Will Yara Zoe"""
NAMES = tuple(_NAMES_TEXT.split())


def split_names(text: str | None) -> list[str]:
    """Names in a reply: split on commas, newlines and 'and'; empty pieces dropped."""
    return [piece.strip(" .") for piece in re.split(r",|\n|\band\b", text or "") if piece.strip(" .")]


def expected_lists(rounds: list[list[str]]) -> list[list[str]]:
    """The sorted list after each round."""
    seen: list[str] = []
    out = []
    for names in rounds:
        seen += names
        out.append(sorted(seen))
    return out


def sorted_rounds_reward(completion: Messages, info: dict[str, Any], parser: Parser) -> float:
    """Mean over rounds of the LCS ratio between the reply's names and the expected sorted list."""
    expected = expected_lists(info["rounds"])
    replies = assistant_texts(completion)
    scores = [
        lcs_ratio(split_names(parser.parse_reply(reply)), want) for reply, want in zip(replies, expected, strict=False)
    ]
    return sum(scores) / len(expected)


class AlphabetSortEnv(MultiTurnEnv):
    name = "alphabet_sort"

    def __init__(self, *, num_rounds: int = 2, min_names: int = 2, max_names: int = 3, **kwargs: Any) -> None:
        if num_rounds < 1:
            raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
        if not 1 <= min_names <= max_names or num_rounds * max_names > len(NAMES):
            raise ValueError(
                f"need 1 <= min_names <= max_names and num_rounds * max_names <= {len(NAMES)}; "
                f"got {min_names}, {max_names}, {num_rounds}"
            )
        parser = Parser()
        rubric = Rubric([sorted_rounds_reward], parser=parser)
        super().__init__(max_turns=num_rounds, parser=parser, rubric=rubric, **kwargs)
        self.num_rounds, self.min_names, self.max_names = num_rounds, min_names, max_names

    def make_task(self, rng: random.Random, task_id: str) -> Task:
        pool = rng.sample(NAMES, self.num_rounds * self.max_names)
        rounds = [
            [pool.pop() for _ in range(rng.randint(self.min_names, self.max_names))] for _ in range(self.num_rounds)
        ]
        final = ", ".join(expected_lists(rounds)[-1])
        return Task(id=task_id, prompt=self.format_prompt(", ".join(rounds[0])), answer=final, info={"rounds": rounds})

    async def env_response(self, messages: Messages, state: dict[str, Any]) -> tuple[Messages, bool]:
        rounds = state["info"]["rounds"]
        if state["turn"] >= len(rounds):
            return [], True
        return [{"role": "user", "content": "Add: " + ", ".join(rounds[state["turn"]])}], False

    def sft_example(self, task: Task) -> Messages:
        rounds = task.info["rounds"]
        messages = list(task.prompt)
        for i, expected in enumerate(expected_lists(rounds)):
            if i:
                messages.append({"role": "user", "content": "Add: " + ", ".join(rounds[i])})
            messages.append({"role": "assistant", "content": ", ".join(expected)})
        return [dict(m) for m in messages]


def load_environment(
    num_rounds: int = 2,
    min_names: int = 2,
    max_names: int = 3,
    system_prompt: str = SYSTEM_PROMPT,
    num_eval: int = 256,
    eval_seed: int = 1234,
) -> AlphabetSortEnv:
    """Args: rounds (= model turns), names added per round, prompt, eval split size and seed."""
    return AlphabetSortEnv(
        num_rounds=num_rounds,
        min_names=min_names,
        max_names=max_names,
        system_prompt=system_prompt,
        num_eval=num_eval,
        eval_seed=eval_seed,
    )
