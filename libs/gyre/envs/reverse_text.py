"""`reverse_text`: reverse a short random string (single turn).

    system: Reverse the text.
    user:   qzxwv
    answer: vwxzq

Reward: LCS ratio between the reply (whole text, stripped) and the reversed string, so a tiny policy earns
partial credit for partly right answers and the signal is dense; or, with `reward = "exact"`, 1 for exactly the
reversed string and 0 otherwise (a sparse reward: what on-policy distillation's dense signal is compared on).
Random letters rarely merge into BPE tokens, so the model works (mostly) letter by letter. The SFT example
replies in exactly this format.
"""

from __future__ import annotations

import random
import string
from typing import Any

from gyre.envs.base import SingleTurnEnv
from gyre.envs.parsers import Parser
from gyre.envs.rubric import Rubric
from gyre.envs.scoring import lcs_ratio
from gyre.envs.types import Messages, Task

SYSTEM_PROMPT = "Reverse the text."


def lcs_reward(completion: Messages, answer: str, parser: Parser) -> float:
    """LCS ratio of the parsed reply against the reversed text (0..1)."""
    return lcs_ratio(parser.parse_answer(completion) or "", answer)


def exact_reward(completion: Messages, answer: str, parser: Parser) -> float:
    """1 when the parsed reply is exactly the reversed text, else 0."""
    return float((parser.parse_answer(completion) or "") == answer)


REWARDS = {"lcs": lcs_reward, "exact": exact_reward}


class ReverseTextEnv(SingleTurnEnv):
    name = "reverse_text"

    def __init__(self, *, min_length: int = 3, max_length: int = 8, alphabet: str = string.ascii_lowercase,
                 reward: str = "lcs", **kwargs):  # fmt: skip
        if not 1 <= min_length <= max_length <= 256:
            raise ValueError(f"need 1 <= min_length <= max_length <= 256, got {min_length}, {max_length}")
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet must be a non-empty string of distinct characters")
        # The reply is read stripped (Parser): a text starting or ending with whitespace had a reversal no reply
        # could give, so even the reference reply scored below 1 (0 with `exact`). Its ends are drawn from these.
        self.edges = "".join(c for c in alphabet if not c.isspace())
        if not self.edges:
            raise ValueError(f"alphabet must have a character that is not whitespace, got {alphabet!r}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {reward!r}")
        parser = Parser()
        super().__init__(parser=parser, rubric=Rubric([REWARDS[reward]], parser=parser), **kwargs)
        self.min_length, self.max_length, self.alphabet = min_length, max_length, alphabet

    def make_task(self, rng: random.Random, task_id: str) -> Task:
        chars = [rng.choice(self.alphabet) for _ in range(rng.randint(self.min_length, self.max_length))]
        if self.edges != self.alphabet:  # whitespace only inside (an alphabet without any draws as it always did)
            chars[0], chars[-1] = rng.choice(self.edges), rng.choice(self.edges)
        text = "".join(chars)
        return Task(id=task_id, prompt=self.format_prompt(text), answer=text[::-1], info={"text": text})


def load_environment(
    min_length: int = 3,
    max_length: int = 8,
    alphabet: str = string.ascii_lowercase,
    system_prompt: str = SYSTEM_PROMPT,
    num_eval: int = 256,
    eval_seed: int = 1234,
    reward: str = "lcs",
) -> ReverseTextEnv:
    """Args: string length range, the alphabet letters are drawn from, prompt, eval split size and seed, and the
    reward (`lcs`: partial credit, dense; `exact`: 1 for exactly the reversal, sparse)."""
    kwargs: dict[str, Any] = {"system_prompt": system_prompt, "num_eval": num_eval, "eval_seed": eval_seed}
    return ReverseTextEnv(min_length=min_length, max_length=max_length, alphabet=alphabet, reward=reward, **kwargs)
