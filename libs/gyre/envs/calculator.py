"""`calculator`: arithmetic the model should not do in its head: it calls a `calculator` tool, then answers.

    system:    Use the calculator tool, then reply with the number only.   (+ the tool list from the template)
    user:      What is 347 * 29?
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 29"}}</tool_call>
    tool:      10063
    assistant: 10063

Reward: 1.0 for a correct final number (math-verify on the last assistant message, tool-call blocks removed; the
expression itself is no answer) plus `tool_weight` (default 0.2) when at least one well-formed calculator call ran
successfully. The tool is `gyre.envs.safe_math.evaluate`: an `ast` whitelist, never `eval`.
"""

from __future__ import annotations

import json
import random
from typing import Any

from gyre.envs.parsers import Parser
from gyre.envs.rubric import Rubric
from gyre.envs.safe_math import evaluate, format_number
from gyre.envs.scoring import math_equal
from gyre.envs.tools import ToolEnv
from gyre.envs.types import Messages, Task

SYSTEM_PROMPT = "Use the calculator tool, then reply with the number only."


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. 3 * (4 + 5)
    """
    # The schema text matches the one `gyre model init` trains its tokenizer on, so it costs few tokens.
    return format_number(evaluate(expression))


def correct_answer(completion: Messages, answer: str, parser: Parser) -> float:
    """1.0 when the final reply's number equals the reference, else 0.0."""
    return float(math_equal(parser.parse_answer(completion), answer))


def used_calculator(state: dict[str, Any]) -> float:
    """1.0 when at least one calculator call was well formed and ran, else 0.0."""
    return float(any(call["ok"] and call["name"] == "calculator" for call in state.get("tool_calls", [])))


class CalculatorEnv(ToolEnv):
    name = "calculator"

    def __init__(
        self, *, max_value: int = 999, num_operands: int = 2, operations: str = "+-*", tool_weight: float = 0.2, **kw
    ) -> None:
        if max_value < 10:
            raise ValueError(f"max_value must be >= 10, got {max_value}")
        if not 2 <= num_operands <= 5:
            raise ValueError(f"num_operands must be in 2..5, got {num_operands}")
        if not operations or set(operations) - set("+-*"):
            raise ValueError(f"operations must be a non-empty subset of '+-*', got {operations!r}")
        parser = Parser()
        rubric = Rubric([correct_answer, used_calculator], weights=[1.0, tool_weight], parser=parser)
        super().__init__(tools=[calculator], parser=parser, rubric=rubric, **kw)
        self.max_value, self.num_operands, self.operations = max_value, num_operands, operations

    def make_task(self, rng: random.Random, task_id: str) -> Task:
        # Operands of at least two digits: products and sums a tiny model cannot just memorise.
        parts = [str(rng.randint(10, self.max_value))]
        for _ in range(self.num_operands - 1):
            parts += [rng.choice(self.operations), str(rng.randint(10, self.max_value))]
        expression = " ".join(parts)
        answer = format_number(evaluate(expression))
        prompt = self.format_prompt(f"What is {expression}?")
        return Task(id=task_id, prompt=prompt, answer=answer, info={"expression": expression})

    def sft_example(self, task: Task) -> Messages:
        """Prompt, the reference tool call, its result, the final answer (render with `tools=env.tool_schemas`)."""
        arguments = json.dumps({"expression": task.info["expression"]})
        call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
        return [dict(m) for m in task.prompt] + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": calculator(task.info["expression"])},
            {"role": "assistant", "content": task.answer},
        ]


def load_environment(
    max_value: int = 999,
    num_operands: int = 2,
    operations: str = "+-*",
    tool_weight: float = 0.2,
    max_turns: int = 4,
    system_prompt: str = SYSTEM_PROMPT,
    num_eval: int = 256,
    eval_seed: int = 1234,
) -> CalculatorEnv:
    """Args: operand size, operands per expression, operations, tool-call credit, turn budget, prompt, eval split."""
    return CalculatorEnv(
        max_value=max_value,
        num_operands=num_operands,
        operations=operations,
        tool_weight=tool_weight,
        max_turns=max_turns,
        system_prompt=system_prompt,
        num_eval=num_eval,
        eval_seed=eval_seed,
    )
