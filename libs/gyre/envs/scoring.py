"""Reward building blocks shared by the built-in environments (pure functions, no I/O)."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from typing import Any

# Longer predictions are cut before grading: the model's budget is ~128 tokens, and it bounds the work
# (LCS is quadratic, sympy parsing can be slow) no matter what text arrives.
MAX_GRADED_CHARS = 2000
# An operation between two operands in an extracted answer (math-verify folds some, e.g. 60 \div 5, into a number).
_OPERATION = re.compile(r"[\d)}]\s*(?:[-+*/^×÷:]|\\times|\\div|\\cdot)\s*[\d({\\]")
# A parsed reply whose value has more digits than this is no answer: `\boxed{9^{9^{9^9}}}`, `1000000!` or
# `\prod_{k=1}^{10^9} k` parse in milliseconds, but comparing them makes sympy compute the number, which only
# math-verify's 5 s alarm stops on the main thread (blocking the orchestrator's event loop) and nothing stops off it.
MAX_ANSWER_DIGITS = 100_000


def lcs_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common subsequence (not substring) of two sequences; O(len(a) * len(b))."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def lcs_ratio(prediction: Sequence[Any], reference: Sequence[Any]) -> float:
    """2 * LCS / (len(prediction) + len(reference)) in [0, 1]: 1 iff equal, 0 iff nothing in common (in order).

    Works on strings (characters) or lists (e.g. of names). Two empty sequences count as equal.
    """
    prediction = prediction[:MAX_GRADED_CHARS]
    total = len(prediction) + len(reference)
    return 1.0 if total == 0 else 2.0 * lcs_length(prediction, reference) / total


def math_equal(prediction: str | None, reference: str, *, numeric: bool = False) -> bool:
    """True iff math-verify finds the prediction's final answer equal to the reference.

    Accepts plain numbers ("7", "7.0", "-3"), sentences ("The answer is 7."), delimited LaTeX (`$\\frac{1}{2}$`),
    `\\boxed{7}`, and a reply that is a bare LaTeX expression (`\\sqrt{2}`); with several numbers the last one
    counts. The reference is an answer, not a sentence: it is read as if boxed (verifiers' math rubric does the
    same), because math-verify finds no LaTeX outside delimiters and reads a bare `2\\sqrt{2}` as 2, `\\sqrt{2}`
    as nothing. With `numeric`, the reply's final answer must be a number: math-verify evaluates an expression such
    as `347 * 29`, so a reply echoing the question's expression would otherwise score as its value. math-verify
    bounds its work with SIGALRM, which only the main thread may use, so off the main thread it runs without that
    timeout (the input is already length-capped).
    """
    if not prediction:
        return False
    from math_verify import parse, verify  # sympy is heavy: import on first use

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout) or parse(reference, parsing_timeout=timeout)
    tail = graded_tail(prediction)
    predicted = parse(tail, parsing_timeout=timeout)
    if not predicted and "\\" in tail:  # a bare LaTeX reply ("\\sqrt{2}"): math-verify needs delimiters
        predicted = parse(f"\\boxed{{{tail}}}", parsing_timeout=timeout)
    if predicted and too_large(predicted[0]):
        return False
    if numeric and not (
        predicted and getattr(predicted[0], "is_Number", False) and not _OPERATION.search(str(predicted[-1]))
    ):
        return False
    return bool(gold and predicted and verify(gold, predicted, timeout_seconds=timeout))


def graded_tail(text: str) -> str:
    """The last `MAX_GRADED_CHARS` of a reply, where the final answer is ("... so the answer is 7"), cut at a
    whitespace so the cut never splits a number or a LaTeX command ("... 12" + padding must not leave "2").
    Trailing whitespace is no part of it (a reply padded with blanks keeps its answer)."""
    text = text.rstrip()
    if len(text) <= MAX_GRADED_CHARS:
        return text
    tail = text[-MAX_GRADED_CHARS:]
    if text[-MAX_GRADED_CHARS - 1].isspace():
        return tail
    space = re.search(r"\s", tail)
    return tail[space.start() :] if space else ""


def too_large(expr: Any) -> bool:
    """True when a parsed answer's value may have more than `MAX_ANSWER_DIGITS` digits (see there).

    A structural bound on log10 of the value, read off the expression tree without evaluating anything.
    """
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False
    try:
        _digits(expr, sympy)
    except _TooLarge:
        return True
    return False


class _TooLarge(Exception):
    pass


def _digits(expr: Any, sympy: Any) -> float:
    """Upper bound on log10 of |value| (and of 1/|value|) of each subtree; raises `_TooLarge` past
    `MAX_ANSWER_DIGITS`."""
    if isinstance(expr, sympy.Rational):  # Integer included
        bound = max(abs(expr.p).bit_length(), expr.q.bit_length()) * math.log10(2)
    elif isinstance(expr, sympy.Float):
        exponent = expr._mpf_[2] + expr._mpf_[3]  # mantissa * 2**exponent: the binary exponent plus mantissa bits
        bound = abs(exponent) * math.log10(2)
    elif not expr.args:  # symbols and constants (pi, E, I, oo): sympy leaves them symbolic
        bound = 1.0
    else:
        args = [_digits(arg, sympy) for arg in expr.args]
        scale = lambda digits: 10.0 ** min(digits, 12)  # noqa: E731  (a value of that many digits, capped)
        if isinstance(expr, sympy.Pow):
            bound = args[0] * scale(args[1])
        elif isinstance(expr, sympy.exp):
            bound = scale(args[0]) * math.log10(math.e)
        elif isinstance(expr, sympy.Mul):
            bound = sum(args)
        elif isinstance(expr, sympy.factorial | sympy.factorial2 | sympy.subfactorial | sympy.gamma | sympy.binomial
                        | sympy.RisingFactorial | sympy.FallingFactorial):  # fmt: skip
            n = scale(max(args))
            bound = n * math.log10(n + 1) + 1
        elif isinstance(expr, sympy.Product):
            bound = args[0] * scale(max(args[1:]))
        else:  # sums, functions, containers: not much bigger than their largest part
            bound = max(args) + math.log10(len(args) + 1)
    if bound > MAX_ANSWER_DIGITS:
        raise _TooLarge
    return bound
