"""Each built-in environment's reward functions on hand-made good and bad answers."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from gyre.envs import Parser, Rollout, Task, load_environment
from gyre.envs.alphabet_sort import sorted_rounds_reward, split_names
from gyre.envs.arithmetic import correct_answer
from gyre.envs.reverse_text import exact_reward, lcs_reward
from gyre.envs.scoring import lcs_length, lcs_ratio, math_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def said(*texts: str) -> list[dict]:
    return [{"role": "assistant", "content": t} for t in texts]


def fake_rollout(task: Task, completion: list[dict], state: dict | None = None) -> Rollout:
    return Rollout(
        task_id=task.id,
        prompt=task.prompt,
        completion=completion,
        turns=[],
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        prompt_len=0,
        sequence_turns=0,
        policy_version_min=0,
        policy_version_max=0,
        stop_reason="done",
        state=state or {},
    )


@pytest.mark.parametrize(
    ("a", "b", "length"),
    [("", "", 0), ("abc", "", 0), ("abcde", "ace", 3), ("abc", "cba", 1), ("abcbdab", "bdcaba", 4), ("xyz", "xyz", 3)],
)
def test_lcs_length_known_values(a, b, length):
    assert lcs_length(a, b) == length == lcs_length(b, a)


def test_lcs_ratio_bounds_and_lists():
    assert lcs_ratio("edcba", "edcba") == 1.0
    assert lcs_ratio("zzz", "abc") == 0.0
    assert lcs_ratio("", "abc") == 0.0
    assert lcs_ratio("edcb", "edcba") == pytest.approx(8 / 9)
    assert lcs_ratio(["Ana", "Ben"], ["Ana", "Ben", "Tom"]) == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("olleh", 1.0),
        ("  olleh\n", 1.0),  # surrounding whitespace is not the answer
        ("hello", 0.4),  # the unreversed text only shares "ll" in order
        ("olle", 8 / 9),
        ("olleh olleh", 10 / 16),  # rambling on costs reward
        ("", 0.0),
    ],
)
def test_reverse_text_reward(reply, reward):
    assert lcs_reward(said(reply), "olleh", Parser()) == pytest.approx(reward)
    assert exact_reward(said(reply), "olleh", Parser()) == (reward == 1.0)  # the sparse variant: all or nothing


def test_reverse_text_takes_the_sparse_reward_by_name():
    from gyre.envs import load_environment

    assert load_environment("reverse_text", reward="exact").rubric.names == ["exact_reward"]
    assert load_environment("reverse_text").rubric.names == ["lcs_reward"]
    with pytest.raises(ValueError, match="reward must be one of lcs, exact"):
        load_environment("reverse_text", reward="bleu")


@pytest.mark.parametrize(
    ("reply", "ok"),
    [
        ("12", True),
        ("12.0", True),
        ("\\boxed{12}", True),
        ("The answer is 12.", True),
        ("First 5, then 12", True),  # the last number is the answer
        ("13", False),
        ("12 apples? no, 13", False),
        ("twelve", False),
        ("", False),
        ("5 + 7", False),  # an expression is not the answer: math-verify would evaluate it to 12
        ("$60 \\div 5$", False),
        ("5 + 7 = 12", True),
    ],
)
def test_arithmetic_reward(reply, ok):
    assert correct_answer(said(reply), "12", Parser()) == float(ok)


def test_math_equal_handles_nothing_and_negatives():
    assert math_equal(None, "3") is False
    assert math_equal("-349", "-349") and not math_equal("349", "-349")


@pytest.mark.parametrize(
    ("reply", "reference", "ok"),
    [
        # references written as LaTeX without delimiters (MATH-style datasets): read as the answer they are
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True),
        ("$\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}", True),
        ("The answer is $\\pi$.", "\\pi", True),
        ("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}", True),
        ("2", "2\\sqrt{2}", False),  # a bare 2\sqrt{2} was read as 2: the wrong answer got full reward
        ("1000", "10^{3}", True),
        ("10", "10^{3}", False),
        ("\\boxed{(1,2)}", "(1,2)", True),
        ("3.14", "\\pi", False),
        ("\\sqrt{2}", "\\sqrt{2}", True),  # a reply that is the bare expression
        ("x+1", "x+1", True),  # ... without a backslash too: math-verify read nothing, a right answer scored 0
        ("(1,2)", "(1,2)", True),
        ("A", "A", True),
        ("x+1", "x+2", False),
        ("A or B", "A", False),  # a hedge is no answer
        ("twelve", "12", False),
        ("7", "\\boxed{7}", True),  # a reference that is already delimited
        ("7", "$7$", True),
    ],
)
def test_math_equal_reads_latex_references(reply, reference, ok):
    assert math_equal(reply, reference) is ok


@pytest.mark.parametrize(
    ("reply", "reference"),
    [
        ("3+4*5", "23"),
        ("The answer is $3 + 4 \\cdot 5$.", "23"),
        ("\\boxed{3+4\\times 5}", "23"),
        ("$23 = 3+4*5$", "23"),  # the last thing stated is the expression
        ("\\boxed{x = 3+4*5}", "23"),
        ("\\boxed{\\sqrt{9}}", "3"),  # "compute the square root of 9"
        ("\\boxed{2^{10}}", "1024"),
        ("$100 \\div 4$", "25"),
        ("\\boxed{6/2}", "3"),  # a fraction is a number only in lowest terms (PRM800K's grader)
        ("\\boxed{\\frac{6}{2}}", "3"),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
        ("\\boxed{7/1}", "7"),
        ("$15 \\times 10^{2}$", "1500"),  # scientific notation has a mantissa in [1, 10)
        ("-(3-5)", "2"),
    ],
)
def test_math_equal_refuses_the_question_s_expression_for_a_number(reply, reference):
    """math-verify evaluates the final answer, so a reply repeating the question's expression scored 1 (as in
    verifiers and PRIME-RL): a policy learns to copy the question. A numeric reference now takes only a number."""
    assert math_equal(reply, reference) is False


@pytest.mark.parametrize(
    ("reply", "reference"),
    [
        ("23", "23"),
        ("The answer is 23.", "23"),
        ("\\boxed{23 \\text{ apples}}", "23"),
        ("\\boxed{\\$23}", "23"),
        ("23.0", "23"),
        ("$x = 23$", "23"),
        ("3+4*5 = 23", "23"),  # worked out, the value last
        ("\\boxed{23^{\\circ}}", "23"),
        ("-3", "-3"),
        ("\\boxed{\\left(-3\\right)}", "-3"),
        ("$\\frac{1}{2}$", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac12"),
        ("$-\\frac{1}{2}$", "-0.5"),
        ("\\boxed{\\frac{-1}{2}}", "-\\frac{1}{2}"),
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
        ("\\boxed{1\\frac{1}{2}}", "\\frac{3}{2}"),  # a mixed number
        ("1,000", "1000"),
        ("$1{,}000$", "1000"),
        ("\\boxed{12,345.67}", "12345.67"),
        ("$1.5 \\times 10^{3}$", "1500"),
        ("$1.5\\times10^{-3}$", "0.0015"),
        ("\\boxed{5\\%}", "5\\%"),
        ("\\boxed{\\frac{6}{2}}", "\\frac{6}{2}"),  # written as the reference is
        # references that are not numbers stay math-verify's to judge: expressions are answers there
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{2\\pi}", "2\\pi"),
        ("1000", "10^{3}"),
        ("$(1, 2]$", "(1,2]"),
        ("$\\{1, 2\\}$", "\\{1,2\\}"),
        ("\\boxed{3, 5}", "3, 5"),
        ("\\boxed{x=3}", "x=3"),
        # E notation, which math-verify read as Euler's number (1.5*E*3) or cut at the e (1.5): never matched
        ("1.5e3", "1500"),
        ("The answer is 1.5e3.", "1500"),
        ("\\boxed{1.5e3}", "1500"),
        ("$1.5e3$", "1500"),
        ("So $x=2$ and the answer is 15e2.", "1500"),
        ("-1.5e-7", "-0.00000015"),
        ("2E+3", "2000"),
        ("1.2e-7", "1.2e-7"),
        ("$1.5 \\times 10^{3}$", "1.5e3"),
        ("6.02e23", "6.02 \\times 10^{23}"),
        ("\u22123", "-3"),  # a Unicode minus sign: math-verify read no number
    ],
)
def test_math_equal_takes_every_valid_form_of_an_answer(reply, reference):
    assert math_equal(reply, reference) is True


@pytest.mark.parametrize(
    ("reply", "reference"), [("1.3e-7", "1.2e-7"), ("1e-7", "1e-5"), ("1.5e3 * 2", "3000"), ("3", "\u22123")]
)
def test_math_equal_compares_e_notation_and_unicode_minus_by_value(reply, reference):
    assert math_equal(reply, reference) is False


def test_math_equal_grades_the_tail_without_splitting_a_number():
    """Only a reply's last 2000 characters are graded; the cut falls at a whitespace, so it never turns the final
    answer into another number (the "1" of "12" was cut off and a wrong "12" scored 1 against "2")."""
    assert math_equal("The answer is 12" + "." * 1999, "2") is False
    assert math_equal("The answer is 3.5" + "!" * 1998, "5") is False
    assert math_equal("\\frac{1}{2}" + " ok" * 664, "2") is False
    assert math_equal("Let me think. " * 400 + "The answer is 12.", "12") is True
    assert math_equal("The answer is 12" + " " * 2500, "12") is True  # padding is not the tail


@pytest.mark.parametrize(
    "reply",
    [
        "9^9^9^9",
        "$9^{9^{9^{9}}}$",
        "\\boxed{10^{10^{10}}}",
        "\\boxed{1000000!}",
        "\\boxed{(10^{100})!}",
        "\\boxed{\\binom{10^9}{10^8}}",
        "$\\prod_{k=1}^{10^{9}} k$",
        "\\boxed{x^{9^{9^9}}}",
    ],
)
def test_math_equal_refuses_answers_too_large_to_compute(reply):
    """A reply whose value is astronomically large scores 0 at once: comparing it made sympy compute the number
    until math-verify's 5 s alarm (on the orchestrator's event loop), and forever off the main thread."""
    started = time.monotonic()
    assert math_equal(reply, "7") is False
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    ("reply", "reference"),
    [(str(2**100), "2^{100}"), (str(math.factorial(100)), "100!"), ("\\boxed{2^{10000}}", "2^{10000}")],
)
def test_math_equal_still_grades_large_answers(reply, reference):
    assert math_equal(reply, reference) is True


def test_alphabet_sort_reward_per_round():
    info = {"rounds": [["Tom", "Ana"], ["Ben"]]}  # sorted after round 1: Ana, Tom; after round 2: Ana, Ben, Tom
    parser = Parser()
    assert sorted_rounds_reward(said("Ana, Tom", "Ana, Ben, Tom"), info, parser) == 1.0
    assert sorted_rounds_reward(said("Ana, Tom", "Ana, Ben, Tom."), info, parser) == 1.0
    assert sorted_rounds_reward(said("Ana, Tom"), info, parser) == 0.5  # second round never answered
    assert sorted_rounds_reward(said("Tom, Ana", "Tom, Ben, Ana"), info, parser) == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert sorted_rounds_reward(said("", ""), info, parser) == 0.0
    # Only the assistant's messages are graded, not the environment's prompts in between.
    mixed = [*said("Ana, Tom"), {"role": "user", "content": "Add: Ben"}, *said("Ana, Ben, Tom")]
    assert sorted_rounds_reward(mixed, info, parser) == 1.0


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "alphabet_sort", "calculator", "code"])
async def test_reasoning_is_not_graded_as_the_answer(name):
    """Every built-in grades the reply after `<think>`: the reference inside an unfinished thought scores 0, and
    a closed thought before the reference does not cost reward."""
    env = load_environment(name, num_eval=4)
    task = env.tasks("eval")[0]
    reference = env.sft_example(task)[len(task.prompt) :]
    state = {"tool_calls": [{"name": "calculator", "ok": True}]} if name == "calculator" else {}
    reasoned = [dict(m, content=f"<think>Let me see.</think>{m['content']}") if m["role"] == "assistant" and
                m.get("content") else m for m in reference]  # fmt: skip
    unfinished = [dict(m, content=f"<think>{m['content']}") if m["role"] == "assistant" and m.get("content") else m
                  for m in reference]  # fmt: skip
    full = await env.score(task, fake_rollout(task, reasoned, state))
    cut = await env.score(task, fake_rollout(task, unfinished, state))
    assert full.reward == pytest.approx(sum(env.rubric.weights))
    answer_weight = env.rubric.weights[0]
    assert cut.reward == pytest.approx(sum(env.rubric.weights) - answer_weight), cut


def test_split_names():
    assert split_names("Ana, Ben and Tom.") == ["Ana", "Ben", "Tom"]
    assert split_names("Ana\nBen") == ["Ana", "Ben"]
    assert split_names(None) == []


@pytest.mark.asyncio
async def test_calculator_rubric_rewards_answer_and_tool_use():
    env = load_environment("calculator")
    task = env.tasks("eval")[0]
    used = {"tool_calls": [{"turn": 1, "name": "calculator", "arguments": {}, "ok": True, "result": task.answer}]}
    failed = {"tool_calls": [{"turn": 1, "name": "calculator", "arguments": {}, "ok": False, "result": "Error"}]}
    cases = [
        (said(task.answer), used, 1.2),
        (said(task.answer), {"tool_calls": []}, 1.0),  # right without the tool: full answer credit only
        (said("0"), used, 0.2),
        (said(task.answer), failed, 1.0),
        (said("0"), {}, 0.0),
        # echoing the question's expression is no answer (math-verify evaluates it: it scored 1.0 without the tool)
        (said(task.info["expression"]), {}, 0.0),
        (said(task.info["expression"].replace("*", "\\times")), {}, 0.0),
    ]
    for completion, state, reward in cases:
        score = await env.score(task, fake_rollout(task, completion, state))
        assert score.reward == pytest.approx(reward), (completion, state)
        assert set(score.per_function) == {"correct_answer", "used_calculator"} and not score.errors


@pytest.mark.asyncio
async def test_calculator_answer_ignores_a_trailing_tool_call_block():
    env = load_environment("calculator")
    task = env.tasks("eval")[1]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    score = await env.score(task, fake_rollout(task, said(call)))
    assert score.per_function["correct_answer"] == 0.0


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "alphabet_sort", "calculator"])
async def test_reference_answers_earn_full_reward(name):
    """The SFT example is exactly what the rubric rewards most, for every built-in (ties SFT to RL)."""
    env = load_environment(name)
    for task in list(env.tasks("eval"))[:20]:
        messages = env.sft_example(task)
        completion = messages[len(task.prompt) :]
        state = {"tool_calls": [{"name": "calculator", "ok": True}]} if name == "calculator" else {}
        score = await env.score(task, fake_rollout(task, completion, state))
        assert score.reward == pytest.approx(sum(env.rubric.weights)), (task, score)


# Fragments that parsers and graders treat specially, mixed into arbitrary unicode.
_FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
    "\\boxed{",
    "}",
    "$",
    "\\frac{1}{2}",
    "9^{9^{9}}",
    "```",
    "\n",
    ", ",
    " and ",
    "Ana",
    "7",
    "-3",
    "0.5",
    "1/0",
    "nan",
    "inf",
]
_MODEL_TEXT = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(_FRAGMENTS)), max_size=12).map("".join)


@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "alphabet_sort", "calculator"])
def test_rewards_are_finite_and_in_range_for_any_output(name):
    """Whatever a model writes (empty, unclosed tags, arbitrary unicode, several turns), every built-in's reward is
    finite, within [0, sum of weights], and no reward function errors. Sync on purpose: scoring runs on the main
    thread, where math-verify's own timeout works, as in the orchestrator."""
    env = load_environment(name, num_eval=4)
    task = env.tasks("eval")[0]
    top = sum(env.rubric.weights)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(_MODEL_TEXT, max_size=3))
    def check(texts):
        score = asyncio.run(env.score(task, fake_rollout(task, said(*texts), {"tool_calls": []})))
        assert math.isfinite(score.reward) and 0.0 <= score.reward <= top, (texts, score)
        assert not score.errors, (texts, score)

    check()


@pytest.mark.parametrize(
    ("reply", "reference"), [("\\boxed{x+1}", "x+1"), ("\\boxed{(1,2)}", "(1,2)"), ("\\boxed{C}", "C")]
)
def test_math_rubric_grades_a_boxed_answer_without_latex_commands(reply, reference):
    """MathRubric's parser hands math_equal the box's content (`x+1`), not `\\boxed{x+1}`: math-verify found no answer
    in it, so every right symbolic answer without a backslash scored 0 (verifiers boxes the parsed reply)."""
    from gyre.envs.rubric import MathRubric, correct_answer_reward_func

    parser = MathRubric().parser
    completion = [{"role": "assistant", "content": f"<think>x+2?</think>So {reply}"}]
    assert correct_answer_reward_func(completion, reference, parser) == 1.0
    assert correct_answer_reward_func(completion, reference + "+1", parser) == 0.0


@pytest.mark.parametrize(
    ("reply", "right", "wrong"),
    [("\\boxed{2x+3}", "2x+3", "2"), ("\\boxed{2x + 3}", "2x+3", "2"), ("\\boxed{3x^2}", "3x^{2}", "3")],
)
def test_math_rubric_reads_a_boxed_expression_whole(reply, right, wrong):
    """The box's content `2x+3` was read by math-verify as its first number, 2: the right answer scored 0 and the
    wrong one 1. A bare expression is now read whole; numbers written with spaces (`1 000`) still read as one."""
    from gyre.envs.rubric import MathRubric, correct_answer_reward_func

    parser = MathRubric().parser
    completion = [{"role": "assistant", "content": f"So {reply}"}]
    assert correct_answer_reward_func(completion, right, parser) == 1.0
    assert correct_answer_reward_func(completion, wrong, parser) == 0.0
    assert math_equal("1 000", "1000") and math_equal("42.", "42") and math_equal("12 345", "12345")


@pytest.mark.parametrize("box", ["\\boxed {7}", "\\boxed  {7}", "\\boxed\n{7}"])
def test_a_box_with_a_space_before_its_brace_is_a_box(box):
    """TeX skips spaces between a control word and its argument, so `\\boxed {7}` is a box. Looking for `\\boxed{` only
    (verifiers' extract_boxed_answer, math-verify), the reply's final box was missed: MathRubric graded an earlier
    `\\boxed{5}`, and math_equal read the number after the box (8 below)."""
    from gyre.envs.parsers import extract_boxed_answer
    from gyre.envs.rubric import MathRubric, correct_answer_reward_func

    assert extract_boxed_answer(f"At first \\boxed{{5}}. No: {box}.") == "7"
    assert extract_boxed_answer("\\boxed {\\frac{1}{2}} at last") == "\\frac{1}{2}"
    parser = MathRubric().parser
    completion = [{"role": "assistant", "content": f"At first \\boxed{{5}}. No, the answer is {box}."}]
    assert correct_answer_reward_func(completion, "7", parser) == 1.0
    assert correct_answer_reward_func(completion, "5", parser) == 0.0
    assert math_equal(f"The answer is {box}, so 8 apples remain.", "7")
    assert not math_equal(f"The answer is {box}, so 8 apples remain.", "8")
