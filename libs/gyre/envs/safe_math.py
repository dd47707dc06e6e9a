"""A safe arithmetic evaluator for model-written expressions: `evaluate("3 * (4 + 5)") -> 27`.

Nothing is `eval`ed. The text is parsed with `ast` and walked with a whitelist: int/float literals, + - * / //
% ** and unary +/-. Names, calls, attributes, subscripts, comprehensions, strings and everything else are
rejected. Work is bounded: the text length, the exponent, and the magnitude of every intermediate result are
capped, so `9**9**9` or `10**10**10` fail fast instead of eating the CPU or memory.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Characters models (and people) use for operators that Python spells differently.
_ALIASES = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})
# A number written with thousands commas, "1,000" or "12,345,678.5" (groups of exactly three digits, as the judges'
# number grammar reads them): the commas are dropped. Python read it as a tuple, refused with "Tuple is not allowed",
# so a model copying a large number from its task never got an answer it could act on. Any other comma ("1,5", a
# decimal comma; "(1, 2)") is refused, saying so.
_THOUSANDS = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?!,?\d)")


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be computed; the message says why (it is shown to the model)."""


def evaluate(expression: str) -> int | float:
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.translate(_ALIASES).strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = _THOUSANDS.sub(lambda number: number.group().replace(",", ""), text)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.__class__.__name__}") from None
    return _eval(tree.body)


def format_number(value: int | float) -> str:
    """Integers (and integral floats) without a decimal point; other floats rounded to 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else repr(round(value, 6))


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: excluded by the exact type check
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise CalculatorError(f"cannot compute: {exc}") from None
    if isinstance(node, ast.Tuple):
        raise CalculatorError("',' is no operator: write a decimal with a point (1.5); 1,000 is read as a thousand")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("'^' is not a power here: use '**'")
    raise CalculatorError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** and parentheses")


def _checked(value: int | float | complex) -> int | float:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"the result is larger than {MAX_MAGNITUDE:.0e}")
    return value
