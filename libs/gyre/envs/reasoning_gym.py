"""`reasoning_gym:<dataset>`: a reasoning-gym procedural dataset as a single-turn environment, scored by its own
verifier (`score_answer`).

    [orchestrator.env]
    name = "reasoning_gym:chain_sum"
    args = { config = { min_terms = 2, max_terms = 2, max_digits = 1 } }

Needs the optional `reasoning-gym` package (`pip install 'gyre[reasoning-gym]'`; pure Python, no torch).
`config` is passed to reasoning-gym's dataset config (difficulty knobs differ per dataset; a wrong key or value fails
at load with reasoning-gym's message and the dataset's keys; `seed` and `size` are Gyre's). Splits: "eval" is the
dataset generated with `eval_seed` (`num_eval` items, fixed across runs); "train" is endless, item `i` of the
dataset generated from (`seed`, `i`), and an item whose question is also in the eval split is redrawn. The reply is
the assistant text after its reasoning (`<think>`), or the content of its last `<answer>` block when it has one
(reasoning-gym's own prompt format), handed to the dataset's scorer (reward in [0, 1]).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import re
import sys
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from gyre.envs.base import MAX_REDRAWS, SingleTurnEnv, TaskSource
from gyre.envs.parsers import Parser
from gyre.envs.rubric import Rubric
from gyre.envs.scoring import too_large
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
        return [self._task(self.eval_data[i], f"eval-{i}") for i in range(len(self.eval_data))]

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


# --- the model's reply is data, never code ------------------------------------------------------------------------
#
# Several reasoning-gym scorers run the reply: `eval(answer)` to read a Python list (spiral_matrix, binary_matrix,
# string_insertion, n_queens) and sympy's `parse_expr`/`sympify`, which `eval` too (countdown, puzzle24,
# polynomial_multiplication, simple/intermediate_integration). A reply such as `__import__('os').system(...)` ran in
# the orchestrator, and `9**9**9**9` hung it. While a reply is scored, text that does not come from the task's own
# entry goes through `literal_eval` (for `eval`) or an arithmetic whitelist (for sympy); the entry's text (generated
# by reasoning-gym from the seed) is evaluated as before.

MAX_UNTRUSTED_CHARS = 1000
# Functions a reply's math may call (sympy names): no strings, no attributes, nothing that grows without bound.
SAFE_FUNCTIONS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh", "tanh", "coth", "asinh",
    "acosh", "atanh", "exp", "log", "ln", "sqrt", "cbrt", "root", "Abs", "abs", "sign", "floor", "ceiling", "re", "im",
    "Max", "Min", "max", "min", "erf", "atan2",
})  # fmt: skip
_GROWING = frozenset({"exp", "sinh", "cosh"})  # like powers: nested ones make numbers no computer holds
MAX_EXPONENT_CONSTANT = 1000


class UntrustedExpression(ValueError):
    """A reply's text was refused as code or as math too costly to evaluate (the scorer then gives no credit)."""


def _entry_texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _entry_texts(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _entry_texts(v)]
    return []


def check_math(text: str, parse_expr: Any) -> None:
    """Raise `UntrustedExpression` unless `text` is arithmetic over numbers, names and `SAFE_FUNCTIONS` whose numbers
    stay computable: no power or exponential inside a numeric exponent, exponent constants <= 1000, and (read
    unevaluated with sympy's real `parse_expr`, safe once the text passed the whitelist) a value of at most
    `scoring.MAX_ANSWER_DIGITS` digits, so `((9**999)**999)**999` is refused too."""
    if len(text) > MAX_UNTRUSTED_CHARS:
        raise UntrustedExpression(f"expression longer than {MAX_UNTRUSTED_CHARS} characters")
    try:
        tree = ast.parse(text.replace("^", "**").strip(), mode="eval")
        _check_node(tree.body, in_exponent=False)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        if isinstance(exc, UntrustedExpression):
            raise
        raise UntrustedExpression(f"not an arithmetic expression: {type(exc).__name__}") from None
    try:
        unevaluated = parse_expr(text, evaluate=False)
    except Exception as exc:
        raise UntrustedExpression(f"not an arithmetic expression: {type(exc).__name__}") from None
    if too_large(unevaluated):
        raise UntrustedExpression("the value has too many digits to compute")


def _check_node(node: ast.AST, *, in_exponent: bool) -> None:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise UntrustedExpression(f"only numbers are allowed, got {node.value!r}")
        if in_exponent and abs(node.value) > MAX_EXPONENT_CONSTANT:
            raise UntrustedExpression(f"exponent {node.value} is too large")
    elif isinstance(node, ast.Name):
        if node.id.startswith("_") or (hasattr(builtins, node.id) and node.id not in SAFE_FUNCTIONS):
            raise UntrustedExpression(f"name {node.id!r} is not allowed")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        _check_node(node.operand, in_exponent=in_exponent)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div | ast.Pow):
        if in_exponent and isinstance(node.op, ast.Pow) and _numeric(node):
            raise UntrustedExpression("a power inside an exponent")
        _check_node(node.left, in_exponent=in_exponent)
        _check_node(node.right, in_exponent=in_exponent or isinstance(node.op, ast.Pow))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SAFE_FUNCTIONS:
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise UntrustedExpression(f"{node.func.id}() takes plain arguments only")
        growing = node.func.id in _GROWING
        if in_exponent and growing and _numeric(node):
            raise UntrustedExpression(f"{node.func.id}() inside an exponent")
        for arg in node.args:
            _check_node(arg, in_exponent=in_exponent or growing)
    else:
        raise UntrustedExpression(f"{type(node).__name__} is not allowed in an answer")


def _numeric(node: ast.AST) -> bool:
    """No names in it: sympy computes it to a number."""
    return not any(isinstance(n, ast.Name) for n in ast.walk(node) if not _is_call_name(node, n))


def _is_call_name(root: ast.AST, name: ast.AST) -> bool:
    return any(isinstance(c, ast.Call) and c.func is name for c in ast.walk(root))


@contextlib.contextmanager
def reply_is_data(entry: dict[str, Any]) -> Iterator[None]:
    """While a reply is scored: `eval`, `parse_expr` and `sympify` in reasoning-gym's modules (and sympy's own
    string parsing) read text that is not part of `entry` as data (see above).

    The names are swapped process-wide for the (synchronous) scorer call: task generation, whose own `eval`s must
    stay real, must not run in another thread meanwhile. Gyre generates and scores on the event loop's thread."""
    import sympy
    import sympy.parsing.sympy_parser as sympy_parser

    trusted = _entry_texts(entry)
    real_parse_expr, real_sympify = sympy_parser.parse_expr, sympy.sympify

    def is_trusted(text: Any) -> bool:
        return not isinstance(text, str) or any(text.strip() in t for t in trusted)

    def safe_eval(source: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(source, str) and is_trusted(source):
            return builtins.eval(source, *args, **kwargs)
        if not isinstance(source, str) or len(source) > MAX_UNTRUSTED_CHARS:
            raise UntrustedExpression("a reply is read as a Python literal only")
        return ast.literal_eval(source.strip())

    def safe_parse_expr(text: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_trusted(text):
            check_math(text, real_parse_expr)
        return real_parse_expr(text, *args, **kwargs)

    def safe_sympify(value: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_trusted(value):
            check_math(value, real_parse_expr)
        return real_sympify(value, *args, **kwargs)

    patches: list[tuple[Any, str, Any]] = [
        (sympy_parser, "parse_expr", safe_parse_expr),
        (sympy, "parse_expr", safe_parse_expr),
        (sympy, "sympify", safe_sympify),
    ]
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "reasoning_gym" or name.startswith("reasoning_gym.")):
            continue
        namespace = vars(module)
        patches.append((module, "eval", safe_eval))  # shadows the builtin for that module's code
        if namespace.get("parse_expr") is real_parse_expr:
            patches.append((module, "parse_expr", safe_parse_expr))
        if namespace.get("sympify") is real_sympify:
            patches.append((module, "sympify", safe_sympify))
    missing = object()
    saved = [(obj, attr, vars(obj).get(attr, missing)) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is missing:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
