"""Reward building blocks shared by the built-in environments (pure functions, no I/O)."""

from __future__ import annotations

import decimal
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from gyre.envs.parsers import BOXED

# Longer predictions are cut before grading: the model's budget is ~128 tokens, and it bounds the work
# (LCS is quadratic, sympy parsing can be slow) no matter what text arrives.
MAX_GRADED_CHARS = 2000
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


def math_equal(prediction: str | None, reference: str) -> bool:
    """True iff math-verify finds the prediction's final answer equal to the reference.

    Accepts plain numbers ("7", "7.0", "-3"), sentences ("The answer is 7."), delimited LaTeX (`$\\frac{1}{2}$`),
    `\\boxed{7}`, and a reply that is a bare expression (`\\sqrt{2}`, `x+1`, `C`: what MathRubric's parser hands over
    from `\\boxed{}`); with several numbers the last one counts. The reference is an answer, not a sentence: it
    is read as if boxed (verifiers' math rubric does the same), because math-verify finds no LaTeX outside
    delimiters and reads a bare `2\\sqrt{2}` as 2, `\\sqrt{2}` as nothing. When the reference is a number, the final
    answer must be one too (`number_form`): math-verify evaluates an expression such as `3+4*5`, so a reply echoing
    the question's expression would score as its value. math-verify bounds its work with SIGALRM, which only the
    main thread may use, so off the main thread it runs without that timeout (the input is already length-capped).
    """
    if not prediction:
        return False
    from math_verify import parse, verify  # sympy is heavy: import on first use

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    reference = _E_NOTATION.sub(lambda m: _scientific(m, delimit=False), reference.replace("\u2212", "-"))
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout) or parse(reference, parsing_timeout=timeout)
    # a Unicode minus sign: math-verify read no number; `\boxed {7}` is a box to TeX (`BOXED`), not to math-verify
    tail = BOXED.sub(r"\\boxed{", graded_tail(prediction).replace("\u2212", "-"))
    in_latex = _latex_mask(tail)  # E notation inside LaTeX needs no delimiters of its own
    tail = _E_NOTATION.sub(lambda m: _scientific(m, delimit=not in_latex[m.start()]), tail)
    predicted = parse(tail, parsing_timeout=timeout)
    # A bare expression (no words, no delimiters: what MathRubric's parser hands over from `\boxed{2x+3}`) that the
    # plain reading does not take whole is read as boxed: that reading stops at the first number, so `2x+3` was 2
    # (0 against `2x+3`, 1 against 2). `1 000`, `42.` are read whole already.
    if predicted and not _PROSE.search(tail) and _plain(_answer_text(predicted) or "") != _plain(tail.rstrip(".")):
        boxed = parse(f"\\boxed{{{tail.rstrip('.')}}}", parsing_timeout=timeout)
        predicted = boxed if len(boxed) == 2 else predicted
    if not predicted:  # a bare LaTeX reply ("\\sqrt{2}", "x+1", "A"): math-verify needs delimiters
        predicted = parse(f"\\boxed{{{tail}}}", parsing_timeout=timeout)
    if predicted and too_large(predicted[0]):
        return False
    if gold and predicted and not _in_gold_form(_answer_text(gold), _answer_text(predicted)):
        return False
    return bool(gold and predicted and verify(gold, predicted, timeout_seconds=timeout))


# `1.5e3`, `-6.02E+23`: math-verify reads the `e` as Euler's number (1.5*E*3) or stops at it (1.5), so a valid answer
# or a reference in E notation never matched. Exponents of up to 3 digits, so the rewrite stays short.
_E_NOTATION = re.compile(r"(?<![\w.])([-+]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([-+]?\d{1,3})(?!\w|\.\d)")


def _scientific(match: re.Match[str], *, delimit: bool) -> str:
    """An E-notation number as LaTeX scientific notation with a mantissa in [1, 10) (`15e2` is `1.5 \\times 10^{3}`),
    inside `\\(...\\)` when it stands in a reply's text (math-verify reads LaTeX only inside delimiters)."""
    value = decimal.Decimal(f"{match.group(1)}e{match.group(2)}")
    if value == 0:
        return "0"
    exponent = value.adjusted()
    mantissa = value.scaleb(-exponent).normalize()
    latex = f"{mantissa:f} \\times 10^{{{exponent}}}"
    return f"\\({latex}\\)" if delimit else latex


# a word (two letters or more, not a LaTeX command's name) or a LaTeX delimiter: a reply math-verify reads as text
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}|\$|\\[(\[]|\\boxed")


def _latex_mask(text: str) -> bytearray:
    """1 at each position of `text` inside `$...$`, `\\(...\\)`, `\\[...\\]` or `\\boxed{...}` (one pass)."""
    mask = bytearray(len(text))
    dollar, paren, bracket, depth = False, 0, 0, 0
    boxes: list[int] = []  # the brace depth outside each open \boxed{
    i = 0
    while i < len(text):
        inside = dollar or paren > 0 or bracket > 0 or bool(boxes)
        if text[i] == "\\":
            if box := BOXED.match(text, i):
                boxes.append(depth)
                depth += 1
                i = box.end()
                continue
            pair = text[i : i + 2]
            paren += {"\\(": 1, "\\)": -1 if paren else 0}.get(pair, 0)
            bracket += {"\\[": 1, "\\]": -1 if bracket else 0}.get(pair, 0)
            mask[i : i + 2] = bytes([inside, inside][: len(pair)])
            i += 2
            continue
        if text[i] == "$":
            dollar = not dollar
        elif text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if boxes and depth == boxes[-1]:
                boxes.pop()
        mask[i] = inside
        i += 1
    return mask


def _answer_text(parsed: list[Any]) -> str | None:
    """The answer's text as math-verify extracted it (`parse` returns [sympy value, text])."""
    return parsed[-1] if isinstance(parsed[-1], str) else None


def _in_gold_form(gold: str | None, answer: str | None) -> bool:
    """A reference written as a number takes only a number: an integer or decimal (signs, thousands commas, a
    trailing % or degree sign), a fraction in lowest terms, or scientific notation with a mantissa in [1, 10). This
    is the rule of PRM800K's grader (an integer reference needs an integer answer, an unreduced fraction is no
    answer), which verl's and DeepScaleR's math rewards reuse; any other reference is math-verify's to judge."""
    if gold is None or number_form(gold, reduced=False) is None:
        return True
    return answer is not None and (_plain(answer) == _plain(gold) or number_form(answer, reduced=True) is not None)


_LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\\?\$|\s")
_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_UNIT_SUFFIX = re.compile(r"(?:\\?%|\^\{?\\circ\}?|°)$")
_SIGN = r"[-+]?"
_DECIMAL = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_SCIENTIFIC = r"[1-9](?:\.\d+)?(?:\\times|\\cdot|\*|×)10\^(?:\{[-+]?\d+\}|[-+]?\d)"
_FRACTION = r"\d*\\frac\{(?P<numerator>[-+]?\d+)\}\{(?P<denominator>\d+)\}"  # a mixed number's whole part too
_NUMBER = re.compile(rf"{_SIGN}(?:{_DECIMAL}|{_SCIENTIFIC}|{_FRACTION})")


def _plain(text: str) -> str:
    text = _WRAPPER.sub(r"\1", _LATEX_NOISE.sub("", text)).replace("{,}", ",").replace("\\dfrac", "\\frac")
    text = text.replace("\\tfrac", "\\frac")
    # `\frac34` and `3/4` are `\frac{3}{4}`
    text = re.sub(r"^([-+]?)(\d+)/(\d+)$", r"\1\\frac{\2}{\3}", re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text))
    while len(text) > 1 and text[0] + text[-1] in ("{}", "()"):
        text = text[1:-1]
    return text


def number_form(text: str, *, reduced: bool) -> str | None:
    """The number `text` writes (LaTeX spacing, `\\text{}`, outer braces or parentheses, a `x =` or a worked
    `3+4 =` before the last `=` left out), or None when it is not written as a number but as an expression such as
    `3+4*5`, `\\sqrt{4}` or `2^{10}`. With `reduced`, a fraction must be in lowest terms (`2/4`, `6/2` are
    unevaluated divisions)."""
    text = _plain(text).rpartition("=")[2]
    text = _UNIT_SUFFIX.sub("", _plain(text))
    match = _NUMBER.fullmatch(text)
    if match is None:
        return None
    numerator, denominator = match.group("numerator"), match.group("denominator")
    if reduced and numerator is not None and (int(denominator) < 2 or math.gcd(int(numerator), int(denominator)) > 1):
        return None
    return text


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
