"""`arithmetic`: short word problems with an integer answer (single turn), graded with math-verify.

    system: Solve the problem. Reply with the number only.
    user:   Mia has 3 pears. Mia buys 4 more. How many pears does Mia have now?
    answer: 7

Difficulty: `max_value` (operand size), `num_steps` (operations chained in one story), `operations` (any of
"+-*/"; division always comes out even). Intermediate results stay non-negative, so every story makes sense.
The grader accepts a plain number, a sentence ending in the number, or `\\boxed{7}`; an expression (`3 + 4`) is
no answer.
"""

from __future__ import annotations

import random
from typing import Any

from gyre.envs.base import SingleTurnEnv
from gyre.envs.parsers import Parser
from gyre.envs.rubric import Rubric
from gyre.envs.scoring import math_equal
from gyre.envs.types import Messages, Task

SYSTEM_PROMPT = "Solve the problem. Reply with the number only."
NAMES = ("Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Ben", "Eva", "Max", "Ivy", "Raj", "Kim")
ITEMS = ("apples", "pears", "books", "coins", "shells", "cards", "pens", "eggs", "stamps", "marbles")


def correct_answer(completion: Messages, answer: str, parser: Parser) -> float:
    """1.0 when the reply's final number equals the reference (math-verify), else 0.0."""
    return float(math_equal(parser.parse_answer(completion), answer))


class ArithmeticEnv(SingleTurnEnv):
    name = "arithmetic"

    def __init__(self, *, max_value: int = 10, num_steps: int = 1, operations: str = "+-", **kwargs: Any) -> None:
        if max_value < 2:
            raise ValueError(f"max_value must be >= 2, got {max_value}")
        if not 1 <= num_steps <= 5:
            raise ValueError(f"num_steps must be in 1..5, got {num_steps}")
        if not operations or set(operations) - set("+-*/"):
            raise ValueError(f"operations must be a non-empty subset of '+-*/', got {operations!r}")
        parser = Parser()
        super().__init__(parser=parser, rubric=Rubric([correct_answer], parser=parser), **kwargs)
        self.max_value, self.num_steps, self.operations = max_value, num_steps, operations

    def make_task(self, rng: random.Random, task_id: str) -> Task:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        value = rng.randint(1, self.max_value)
        sentences = [f"{name} has {value} {item}."]
        for _ in range(self.num_steps):
            value, sentence = self._step(rng, name, value)
            sentences.append(sentence)
        sentences.append(f"How many {item} does {name} have now?")
        return Task(id=task_id, prompt=self.format_prompt(" ".join(sentences)), answer=str(value))

    def _step(self, rng: random.Random, name: str, value: int) -> tuple[int, str]:
        """One operation on the running total; returns (new total, the sentence telling it)."""
        op = rng.choice(self.operations)
        if op == "-" and value == 0:
            op = "+"
        if op == "+":
            b = rng.randint(1, self.max_value)
            return value + b, f"{name} buys {b} more."
        if op == "-":
            b = rng.randint(1, min(value, self.max_value))
            return value - b, f"{name} gives {b} away."
        if op == "*":
            b = rng.randint(2, max(2, min(self.max_value, 9)))
            return value * b, f"Then {name} gets {b} times as many."
        divisors = [d for d in range(2, min(value, self.max_value) + 1) if value % d == 0]
        if not divisors:  # nothing divides evenly: fall back to adding, keeping the answer an integer
            b = rng.randint(1, self.max_value)
            return value + b, f"{name} buys {b} more."
        b = rng.choice(divisors)
        return value // b, f"{name} splits them into {b} equal groups and keeps one group."


def load_environment(
    max_value: int = 10,
    num_steps: int = 1,
    operations: str = "+-",
    system_prompt: str = SYSTEM_PROMPT,
    num_eval: int = 256,
    eval_seed: int = 1234,
) -> ArithmeticEnv:
    """Args: operand size, operations per story, allowed operations, prompt, eval split size and seed."""
    return ArithmeticEnv(
        max_value=max_value,
        num_steps=num_steps,
        operations=operations,
        system_prompt=system_prompt,
        num_eval=num_eval,
        eval_seed=eval_seed,
    )
