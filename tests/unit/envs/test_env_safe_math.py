"""The calculator's evaluator computes arithmetic and refuses everything else, quickly."""

from __future__ import annotations

import pytest
from gyre.envs.calculator import calculator
from gyre.envs.safe_math import CalculatorError, evaluate, format_number


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347 * 29", 10063),
        ("3 * (4 + 5)", 27),
        ("-2 ** 2", -4),
        ("2 ** -1", 0.5),
        ("7 // 2 + 7 % 2", 4),
        ("1.5 + 2.25", 3.75),
        ("12 × 3 ÷ 4", 9.0),
        ("  +5 - −3 ", 8),
        # thousands commas, as a model copies a large number: it was a tuple, "Tuple is not allowed"
        ("1,000 + 5", 1005),
        ("12,345,678 * 2", 24691356),
        ("(1,000.5 - 0.5) / 4", 250.0),
        ("-2,500", -2500),
    ],
)
def test_arithmetic(expression, value):
    assert evaluate(expression) == value


def test_formatting():
    assert calculator("10 / 4") == "2.5"
    assert calculator("10 / 5") == "2"
    assert calculator("1 / 3") == "0.333333"
    assert format_number(-7) == "-7"


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo pwned')",
        "open('/etc/passwd').read()",
        "().__class__.__bases__[0].__subclasses__()",
        "x + 1",
        "lambda: 1",
        "[i for i in range(10**9)]",
        "'a' * 10",
        "True + 1",
        "1 if 1 else 2",
        "(1, 2)",
        "1 < 2",
        "3 ^ 2",
        "~5",
        "1j * 1j",
        "print(1)",
        "a := 1",
        "import os",
        "",
        "   ",
    ],
)
def test_rejects_anything_but_arithmetic(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


@pytest.mark.parametrize(
    "expression",
    [
        "9 ** 9 ** 9",
        "10 ** 10 ** 10",
        "2 ** 65",
        "(10 ** 20) * (10 ** 20)",
        "9" * 40,
        "1e308 * 10",
        "(" * 150 + "1" + ")" * 150,
    ],
)
@pytest.mark.timeout(10)  # unbounded work (a 10**10**10 bignum) would hang here instead of failing
def test_huge_or_long_expressions_are_refused(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_nesting_within_the_length_limit_works():
    assert evaluate("(" * 90 + "2" + ")" * 90) == 2


def test_errors_that_models_cause():
    with pytest.raises(CalculatorError, match="division by zero"):
        evaluate("1 / (2 - 2)")
    with pytest.raises(CalculatorError, match="real"):
        evaluate("(-8) ** 0.5")
    with pytest.raises(CalculatorError, match="longer"):
        evaluate("1 + " * 60 + "1")
    with pytest.raises(CalculatorError, match=r"\*\*"):
        evaluate("2 ^ 3")
    for commas in ("1,5 + 1", "(1, 2)", "1,0000", "1,000,5", "2 * (3,4)"):  # not thousands: said so, not a "Tuple"
        with pytest.raises(CalculatorError, match="',' is no operator: write a decimal with a point"):
            evaluate(commas)
    with pytest.raises(CalculatorError, match="string"):
        evaluate(123)  # type: ignore[arg-type]
