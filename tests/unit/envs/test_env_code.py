"""The `code` environment: tasks, the parser, and grading in real `python -I` child processes under rlimits."""

from __future__ import annotations

import asyncio
import glob
import os
import tempfile
import time

import pytest
from gyre.envs import Rollout, Task, load_environment
from gyre.envs.code import FAMILIES, HARNESS, CodeParser, ConcurrencyBound, Limits, run_tests

FAST = Limits(timeout_s=2.0, memory_mb=256)


def reference_code(task: Task) -> str:
    return CodeParser().parse(task.answer)


def rollout_of(task: Task, text: str) -> Rollout:
    return Rollout(task_id=task.id, prompt=task.prompt, completion=[{"role": "assistant", "content": text}], turns=[],
                   token_ids=[], loss_mask=[], logprobs=[], prompt_len=0, sequence_turns=0, policy_version_min=0,
                   policy_version_max=0, stop_reason="done", state={})  # fmt: skip


def harness_processes() -> list[int]:
    """Live processes running the grading harness (their command line holds its text)."""
    marker = HARNESS.strip().splitlines()[1].encode()
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if marker in f.read():
                    found.append(int(path.split("/")[2]))
        except OSError:
            pass
    return found


def work_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "gyre-code-*")))


@pytest.fixture
def no_leaks():
    """Every test leaves no grading process and no temporary directory behind."""
    before = work_dirs()
    yield
    assert harness_processes() == []
    assert work_dirs() - before == set()


@pytest.fixture(scope="module")
def task() -> Task:
    env = load_environment("code", num_eval=8, families=["rotate_left"])
    return env.tasks("eval")[0]


def test_splits_are_deterministic_disjoint_and_every_reference_passes_its_tests():
    env = load_environment("code", num_eval=64)
    evals = list(env.tasks("eval"))
    assert [t.prompt for t in evals] == [t.prompt for t in load_environment("code", num_eval=64).tasks("eval")]
    keys = {t.key for t in evals}
    train = env.tasks("train", seed=3)
    assert all(train[i].key not in keys for i in range(200))
    assert {t.info["entry"] for t in evals} == {family[0] for family in FAMILIES}  # every family drawn
    assert all(len(t.info["tests"]) == 5 and "```python" in t.prompt[0]["content"] for t in evals)


@pytest.mark.asyncio
async def test_every_family_reference_scores_1(no_leaks):
    env = load_environment("code", num_eval=64)
    seen = {}
    for t in env.tasks("eval"):
        seen.setdefault(t.info["entry"], t)
    scores = await asyncio.gather(*(env.score(t, rollout_of(t, t.answer)) for t in seen.values()))
    for t, score in zip(seen.values(), scores, strict=True):
        assert score.reward == 1.0 and score.per_function == {"tests_passed": 1.0, "passed_all": 1.0}, t.info


def test_parser_takes_the_last_python_block_after_reasoning():
    parser = CodeParser()
    text = "<think>```python\ndef f(): return 0\n```</think>First:\n```python\ndef f(): return 1\n```\nBetter:\n" \
           "```py\ndef f(): return 2\n```\nDone."  # fmt: skip
    assert parser.parse_answer([{"role": "assistant", "content": text}]) == "def f(): return 2"
    assert parser.parse("```python\ndef f(): return 3") == "def f(): return 3"  # cut by max_tokens
    assert parser.parse("no code here") is None and parser.parse("```python\n\n```") is None


@pytest.mark.asyncio
async def test_right_code_scores_1_wrong_code_partial_and_0(task, no_leaks):
    env = load_environment("code", num_eval=8, families=["rotate_left"])
    right = await env.score(task, rollout_of(task, task.answer))
    assert right.reward == 1.0 and right.per_function["passed_all"] == 1.0
    assert env.rubric.weights == [1.0, 0.0]  # passed_all is logged, not rewarded
    # right only for the tests whose k is 0 mod len(xs) (or an empty list): a partial score
    tests = task.info["tests"]
    lucky = sum(not t["args"][0] or t["args"][1] % len(t["args"][0]) == 0 for t in tests)
    factor = int(task.answer.split("x * ")[1].split(" ")[0])
    partly = f"```python\ndef rotate_left(xs, k):\n    return [x * {factor} for x in xs]\n```"
    score = await env.score(task, rollout_of(task, partly))
    assert score.reward == pytest.approx(lucky / len(tests))
    wrong = await env.score(task, rollout_of(task, "```python\ndef rotate_left(xs, k):\n    return 'no'\n```"))
    assert wrong.reward == 0.0 and wrong.per_function["passed_all"] == 0.0
    none = rollout_of(task, "rotate it left")
    assert (await env.score(task, none)).reward == 0.0 and "no ```python code block" in none.state["code"]["error"]


@pytest.mark.asyncio
async def test_syntax_error_and_missing_function_score_0_with_the_reason(task, no_leaks):
    env = load_environment("code", num_eval=8, families=["rotate_left"])
    broken = rollout_of(task, "```python\ndef rotate_left(xs, k)\n    return xs\n```")
    assert (await env.score(task, broken)).reward == 0.0
    assert broken.state["code"]["error"].startswith("SyntaxError") and broken.state["code"]["passed"] == 0
    misnamed = rollout_of(task, "```python\ndef rotate(xs, k):\n    return xs\n```")
    assert (await env.score(task, misnamed)).reward == 0.0
    assert misnamed.state["code"]["error"] == "the code defines no function named rotate_left"


@pytest.mark.asyncio
async def test_an_infinite_loop_is_killed_at_the_deadline_and_earlier_tests_count(task, no_leaks):
    # passes test 0, then loops for ever on every later call
    code = "calls = []\ndef rotate_left(xs, k):\n    calls.append(1)\n    if len(calls) > 1:\n" \
           f"        while True: pass\n    return {task.info['tests'][0]['expected']!r}"  # fmt: skip
    start = time.monotonic()
    run = await run_tests(code, "rotate_left", task.info["tests"], FAST)
    assert time.monotonic() - start < FAST.timeout_s + 1.5
    assert (run.passed, run.total) == (1, 5) and run.error == "timed out after 2s"


@pytest.mark.asyncio
async def test_a_memory_bomb_is_stopped_by_the_address_space_limit(task, no_leaks):
    bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))\n"
    start = time.monotonic()
    run = await run_tests(bomb, "rotate_left", task.info["tests"], FAST)
    assert time.monotonic() - start < FAST.timeout_s  # the rlimit, not the deadline
    assert run.passed == 0 and run.error.startswith("MemoryError")
    in_call = "def rotate_left(xs, k):\n    return len(bytearray(10**10))"
    run = await run_tests(in_call, "rotate_left", task.info["tests"], FAST)
    assert run.passed == 0 and all("MemoryError" in failure for failure in run.failures)


@pytest.mark.parametrize("timeout_s", [2.0, 2.5, 10])
def test_the_cpu_limit_stands_behind_the_deadline(timeout_s):
    """A spinning one-thread child spends its wall time in CPU: with RLIMIT_CPU = the deadline the two raced, and the
    same infinite loop read "timed out after 2s" or "killed: a limit" by chance (CI saw both)."""
    assert Limits(timeout_s=timeout_s).rlimits()["RLIMIT_CPU"] >= timeout_s + 1


@pytest.mark.asyncio
async def test_a_fork_bomb_is_contained(task, no_leaks):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    run = await run_tests(bomb, "rotate_left", task.info["tests"], FAST)
    assert run.passed == 0 and run.error == "timed out after 2s"
    plain = "import os\nwhile True:\n    os.fork()\n"
    run = await run_tests(plain, "rotate_left", task.info["tests"], FAST)
    assert run.passed == 0 and "BlockingIOError" in run.error  # the process limit refused the first fork


@pytest.mark.asyncio
async def test_the_child_sees_no_environment_is_not_root_and_its_file_and_output_sizes_are_capped(task, no_leaks):
    os.environ["GYRE_CODE_TEST_SECRET"] = "s3cret"
    try:
        probe = "import os\ndef rotate_left(xs, k):\n" \
                "    return ['GYRE_CODE_TEST_SECRET' in os.environ, os.getuid() != 0, " \
                "os.path.basename(os.getcwd())[:10]]"  # fmt: skip
        tests = [{"args": [[], 0], "expected": [False, True, "gyre-code-"]}]
        assert (await run_tests(probe, "rotate_left", tests, FAST)).passed == 1
    finally:
        del os.environ["GYRE_CODE_TEST_SECRET"]
    big_file = "def rotate_left(xs, k):\n    open('f', 'wb').write(bytes(5 * 1024 * 1024))\n    return xs"
    run = await run_tests(big_file, "rotate_left", [{"args": [[], 0], "expected": []}], FAST)
    assert run.passed == 0 and "File too large" in run.error
    loud = "print('x' * 10**7)\ndef rotate_left(xs, k):\n    return 'y' * 10**7"
    run = await run_tests(loud, "rotate_left", [{"args": [[], 0], "expected": []}], FAST)
    assert run.passed == 0 and "output over 256 KiB" in run.error  # prints go nowhere; the huge return is cut


@pytest.mark.asyncio
async def test_a_value_that_equals_everything_does_not_pass(task, no_leaks):
    cheat = "class Any(list):\n    def __eq__(self, other):\n        return True\n" \
            "def rotate_left(xs, k):\n    return Any()"  # fmt: skip
    run = await run_tests(cheat, "rotate_left", task.info["tests"], FAST)
    nonempty = sum(bool(t["expected"]) for t in task.info["tests"])
    assert run.passed == len(task.info["tests"]) - nonempty  # only where [] is the right answer


@pytest.mark.asyncio
async def test_concurrent_scoring_is_bounded_and_never_blocks_the_event_loop(no_leaks):
    sleeper = "import time\ndef f():\n    time.sleep(0.5)\n    return 1"
    tests = [{"args": [], "expected": 1}]
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    start = time.monotonic()
    bound = ConcurrencyBound(4)
    runs = await asyncio.gather(*(run_tests(sleeper, "f", tests, FAST, bound) for _ in range(8)))
    elapsed = time.monotonic() - start
    ticking.cancel()
    assert all(run.passed == 1 for run in runs)
    assert elapsed >= 1.0  # 8 runs of 0.5 s, 4 at a time: two waves
    assert ticks >= elapsed / 0.05 * 0.5  # the loop kept running while the children worked


@pytest.mark.asyncio
async def test_each_code_environment_keeps_its_own_concurrency_bound(no_leaks):
    """One bound per environment: a first environment with max_concurrent = 1 does not serialise a second one's runs."""
    one = load_environment("code", num_eval=4, max_concurrent=1, families=["rotate_left"])
    four = load_environment("code", num_eval=4, max_concurrent=4, families=["rotate_left"])
    task = one.tasks("eval")[0]
    # 1.5 s a run: two waves take 3 s or more, whatever the machine, and one wave's margin below that (child
    # start-up, scoring) is 1.5 s, which a loaded 2-core machine needs (0.6 s runs left it 0.6 s)
    sleeper = "```python\nimport time\ntime.sleep(1.5)\ndef rotate_left(xs, k):\n    return xs\n```"
    await one.score(task, rollout_of(task, sleeper))
    start = time.monotonic()
    await asyncio.gather(*(four.score(task, rollout_of(task, sleeper)) for _ in range(4)))
    assert time.monotonic() - start < 3.0  # one wave of 4, not 2 waves of 2 (>= 3 s) nor 4 waves of 1 (>= 6 s)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="families.*unknown: nope"):
        load_environment("code", families=["nope"])
    with pytest.raises(ValueError, match="timeout_s"):
        load_environment("code", timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrent"):
        load_environment("code", max_concurrent=0)
    with pytest.raises(ValueError, match="num_tests"):
        load_environment("code", num_tests=0)
