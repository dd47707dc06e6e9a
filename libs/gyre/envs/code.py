"""`code`: write a small Python function; the reward is the share of its unit tests that pass (single turn).

    system: Solve the programming task. Reply with the complete function in one ```python code block.
    user:   Write a Python function `rotate_left(xs, k)` that returns the list `xs` rotated left by `k` ...
            Example: rotate_left([1, 2, 3, 4], 1) == [2, 3, 4, 1]
    reply:  ```python
            def rotate_left(xs, k): ...
            ```

Tasks come from parametrised families (`FAMILIES`: each a reference solution with constants drawn from the rng,
and argument generators), so the splits are large and disjoint like the other built-ins'; the expected outputs are
the reference's, computed here, and `task.answer` (the SFT reply) is the reference in a python block.

Grading (`run_tests`): the reply's last ```python block (`CodeParser`) runs in a separate `python -I` process, in a
fresh temporary directory, with an empty environment, a wall-clock deadline, and rlimits set in the child (CPU
seconds, address space, file size, open files, processes: no fork, no threads), dropping to uid 65534 first when
the orchestrator runs as root (root ignores the process limit). The child only computes each call's return value
(as JSON); the parent compares it with the expected value, which never enters the child, so the code cannot
return an object that equals everything or print a forged report of passing tests. Calls run in order and each
result is streamed back, so a solution that hangs on test 4 keeps its first 3. The process group is killed and the
directory removed whatever happened.

Rewards: `tests_passed` (weight 1): passed / total; `passed_all` (weight 0, logged only): 1 when every test passed.
The reason a run scored less (a syntax error, no code block, a timeout, a limit) is in `rollout.state["code"]`, also
its `details` (in the rollout dumps and samples.md).

Not a security boundary: see docs/environments.md, "code: what the rlimits do and do not do".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

from gyre.envs.base import SingleTurnEnv
from gyre.envs.parsers import Parser
from gyre.envs.rubric import Rubric
from gyre.envs.types import Rollout, Score, ScoringError, Task

SYSTEM_PROMPT = "Solve the programming task. Reply with the complete function in one ```python code block."
# ```python / ```py / ``` fences; a block left open at the very end (cut by max_tokens) still counts
CODE_BLOCK_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)
NOBODY = 65534  # the uid a root orchestrator's child drops to, so the process limit applies to it

# The child: reads the job from stdin, points fds 1 and 2 at /dev/null (the code's prints are not the report),
# drops root, sets its own rlimits, runs the code, then each call, writing one JSON line per result to a copy of
# the original stdout. Kept free of imports past the standard library so `python -I` (no site, no env) runs it.
HARNESS = r"""
import json, os, resource, sys
job = json.loads(sys.stdin.read())
report = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
if os.getuid() == 0:
    try:
        os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
    except OSError:
        pass
for name, value in job["limits"].items():
    try:
        resource.setrlimit(getattr(resource, name), (value, value))
    except (ValueError, OSError):
        pass
def emit(**fields):
    report.write(json.dumps(fields) + "\n"); report.flush()
def reason(exc):
    return (type(exc).__name__ + ": " + str(exc))[:300]
namespace = {"__name__": "__solution__"}
try:
    exec(compile(job["code"], "solution.py", "exec"), namespace)
    function = namespace[job["entry"]]
except KeyError:
    emit(load="the code defines no function named " + job["entry"]); sys.exit(0)
except BaseException as exc:
    emit(load=reason(exc)); sys.exit(0)
for i, args in enumerate(job["calls"]):
    try:
        emit(i=i, out=json.dumps(function(*args)))
    except BaseException as exc:
        emit(i=i, error=reason(exc))
"""


@dataclass
class Limits:
    """What one run may use: `timeout_s` wall clock for the whole run (CPU seconds = the same, rounded up),
    `memory_mb` address space, `file_mb` largest file written, `output_kb` the report read back."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 1
    output_kb: int = 256

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "file_mb", "output_kb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"code environment: {name} must be a positive number, got {value!r}")

    def rlimits(self) -> dict[str, int]:
        mb = 1024 * 1024
        # CPU seconds a second past the wall deadline: a one-thread child (no threads: RLIMIT_NPROC 0) spends at most
        # wall time in CPU, so a spinning one is stopped by the deadline and reported as timed out; at ceil(timeout_s)
        # the two raced, and a loop was reported as "killed: a limit" or "timed out" by chance
        return {"RLIMIT_CPU": math.ceil(self.timeout_s) + 1, "RLIMIT_AS": int(self.memory_mb * mb),
                "RLIMIT_FSIZE": int(self.file_mb * mb), "RLIMIT_NOFILE": 16, "RLIMIT_NPROC": 0,
                "RLIMIT_CORE": 0}  # fmt: skip


@dataclass
class TestRun:
    """One graded run: how many tests passed, of how many, and why not all (None when all passed)."""

    passed: int
    total: int
    error: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class ConcurrencyBound:
    """At most `size` runs at once, per event loop (a semaphore belongs to the loop it first waits on, and tests run
    several loops). Each `CodeEnv` has its own, so two code environments in one run each keep their `max_concurrent`
    (one module-wide bound had the first caller's size hold for both)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            self._per_loop[loop] = asyncio.Semaphore(self.size)
        return self._per_loop[loop]


DEFAULT_BOUND = ConcurrencyBound(8)  # run_tests called without one


async def run_tests(code: str, entry: str, tests: list[dict[str, Any]], limits: Limits | None = None,
                    bound: ConcurrencyBound | None = None) -> TestRun:  # fmt: skip
    """Run `code`, then `entry(*test["args"])` for each test in a limited child process; a test passes when the
    returned value, as JSON, equals `test["expected"]` as JSON. At most `bound.size` children at once (default
    `DEFAULT_BOUND`: 8), the others wait. ScoringError when no child could be started (the machine's
    fault, not the code's: scored again)."""
    limits = limits or Limits()
    expected = [json.dumps(test["expected"], sort_keys=True) for test in tests]
    job = json.dumps({"code": code, "entry": entry, "calls": [test["args"] for test in tests],
                      "limits": limits.rlimits(), "uid": NOBODY}).encode()  # fmt: skip
    async with (bound or DEFAULT_BOUND).semaphore():
        results, error = await _run_child(job, limits)
    failures: list[str] = []
    passed = 0
    for i, want in enumerate(expected):
        got = results.get(i)
        if got is None:
            failures.append(f"test {i}: no result ({error or 'the process ended first'})")
        elif "error" in got:
            failures.append(f"test {i}: {got['error']}")
        elif _canonical(got.get("out")) != want:
            failures.append(f"test {i}: returned {str(got.get('out'))[:100]}, expected {want[:100]}")
        else:
            passed += 1
    if "load" in results:
        error = results["load"]
    return TestRun(passed, len(tests), error or (failures[0] if failures else None), failures)


def _canonical(out: Any) -> str | None:
    try:
        return json.dumps(json.loads(out), sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return None


async def _run_child(job: bytes, limits: Limits) -> tuple[dict[Any, Any], str | None]:
    """({test index: {"out"|"error": ...}, "load": reason}, why the run ended early or None)."""
    workdir = tempfile.mkdtemp(prefix="gyre-code-")
    os.chmod(workdir, 0o777)  # the child may run as nobody
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", HARNESS, cwd=workdir, env={}, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
            limit=limits.output_kb * 1024)  # fmt: skip
    except OSError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        raise ScoringError(f"code environment: could not start the test process: {exc}") from exc
    results: dict[Any, Any] = {}
    error = None
    try:
        async with asyncio.timeout(limits.timeout_s):
            error = await _read_report(proc, job, limits.output_kb * 1024, results)
    except TimeoutError:
        error = f"timed out after {limits.timeout_s:g}s"
    finally:
        _kill_group(proc.pid)
        await proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    if error is None and proc.returncode:  # os._exit, a signal from a limit, a crash
        error = _exit_reason(proc.returncode)
    return results, error


async def _read_report(proc: asyncio.subprocess.Process, job: bytes, cap: int, results: dict) -> str | None:
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(job)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the child died at start; its exit status says why
    read = 0
    while True:
        try:
            line = await proc.stdout.readuntil(b"\n")
        except asyncio.IncompleteReadError:
            break  # end of the report
        except asyncio.LimitOverrunError:
            return f"output over {cap // 1024} KiB"
        read += len(line)
        if read > cap:
            return f"output over {cap // 1024} KiB"
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if isinstance(fields, dict) and "load" in fields:
            results["load"] = str(fields["load"])
        elif isinstance(fields, dict) and isinstance(fields.get("i"), int):
            results[fields["i"]] = fields
    await proc.wait()
    return None


def _kill_group(pid: int) -> None:
    """SIGKILL the child's whole process group (it is its session's leader), children it got started included."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed: a limit)", "SIGSEGV": " (crashed)"}
        return f"the process was ended by {name}{hint.get(name, '')}"
    return f"the process exited with status {returncode}"


class CodeParser(Parser):
    """The code of the last ```python (or ```py, or bare ```) block of the reply; None when there is none."""

    def parse(self, text: str) -> str | None:  # type: ignore[override]
        blocks = CODE_BLOCK_RE.findall(text)
        return blocks[-1].strip("\n") if blocks and blocks[-1].strip() else None


def tests_passed(state: dict[str, Any]) -> float:
    """Share of the task's tests that passed (the run is made by `CodeEnv.score`, once for both rewards)."""
    return state["code"]["passed"] / state["code"]["total"]


def passed_all(state: dict[str, Any]) -> float:
    """1 when every test passed (logged with weight 0: how often a solution is fully right)."""
    return float(state["code"]["passed"] == state["code"]["total"])


# --- task families ------------------------------------------------------------------------------------------------
# Each: (entry, signature, description with {constants}, reference source with {constants}, constants(rng),
# args(rng) -> one test's argument list). Descriptions say exactly what the tests check.


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, min_len: int = 0, max_len: int = 8) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def _word(rng: random.Random, letters: str = "abcde", max_len: int = 10) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(0, max_len)))


FAMILIES: list[tuple[str, str, str, str, Any, Any]] = [
    ("sum_multiples", "n", "returns the sum of the non-negative integers below `n` that are divisible by {a} or {b}",
     "def sum_multiples(n):\n    return sum(i for i in range(n) if i % {a} == 0 or i % {b} == 0)",
     lambda r: {"a": (a := r.randint(2, 9)), "b": r.choice([b for b in range(2, 10) if b != a])},
     lambda r: [r.randint(0, 200)]),
    ("rotate_left", "xs, k", "returns the list `xs` rotated left by `k` positions (`k` may exceed the length; an "
     "empty list stays empty), with every element then multiplied by {m}",
     "def rotate_left(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
     "    return [x * {m} for x in xs[k:] + xs[:k]]",
     lambda r: {"m": r.randint(1, 5)}, lambda r: [_ints(r), r.randint(0, 12)]),
    ("clamp_all", "xs", "returns a new list with each number of `xs` clamped to the range [{lo}, {hi}]",
     "def clamp_all(xs):\n    return [min(max(x, {lo}), {hi}) for x in xs]",
     lambda r: {"lo": (lo := r.randint(-10, 5)), "hi": lo + r.randint(0, 15)}, lambda r: [_ints(r)]),
    ("count_char", "s", "returns how many times the letter '{c}' occurs in the string `s`, ignoring case",
     "def count_char(s):\n    return s.lower().count('{c}')",
     lambda r: {"c": r.choice("abcde")}, lambda r: [_word(r, "abcdeABCDE ", 12)]),
    ("digit_power_sum", "n", "returns the sum of the decimal digits of the non-negative integer `n`, each raised to "
     "the power {p}",
     "def digit_power_sum(n):\n    return sum(int(d) ** {p} for d in str(n))",
     lambda r: {"p": r.randint(1, 4)}, lambda r: [r.randint(0, 10**6)]),
    ("run_length", "s", "returns the run-length encoding of the string `s`: each run of a repeated character "
     "written as the character followed by the run's length, joined with '{sep}' "
     "(\"aab\" -> \"a2{sep}b1\"; \"\" -> \"\")",
     "def run_length(s):\n    out = []\n    for ch in s:\n        if out and out[-1][0] == ch:\n"
     "            out[-1][1] += 1\n        else:\n            out.append([ch, 1])\n"
     "    return '{sep}'.join(ch + str(n) for ch, n in out)",
     lambda r: {"sep": r.choice(["", "-", ",", ";", "|"])}, lambda r: [_word(r, "aab", 10)]),
    ("fib_mod", "n", "returns the `n`-th Fibonacci number modulo {m} (fib_mod(0) == 0, fib_mod(1) == 1)",
     "def fib_mod(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m}\n    return a % {m}",
     lambda r: {"m": r.randint(2, 1000)}, lambda r: [r.randint(0, 300)]),
    ("caesar", "s", "returns the string `s` with every lowercase letter shifted {k} places forward in the alphabet "
     "(wrapping from 'z' to 'a'); other characters stay as they are",
     "def caesar(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)",
     lambda r: {"k": r.randint(1, 25)}, lambda r: [_word(r, "abcxyz !Q", 12)]),
    ("kth_largest", "xs", "returns the {kth} largest distinct value of the list `xs`, or None when `xs` has fewer "
     "than {k} distinct values",
     "def kth_largest(xs):\n    values = sorted(set(xs), reverse=True)\n"
     "    return values[{k} - 1] if len(values) >= {k} else None",
     lambda r: {"k": (k := r.randint(1, 3)), "kth": ("", "1st", "2nd", "3rd")[k]}, lambda r: [_ints(r, -9, 9)]),
    ("filter_scale", "xs", "returns the numbers of `xs` that are divisible by {d}, each multiplied by {m}, in their "
     "original order",
     "def filter_scale(xs):\n    return [x * {m} for x in xs if x % {d} == 0]",
     lambda r: {"d": r.randint(2, 5), "m": r.randint(-3, 4)}, lambda r: [_ints(r, -30, 30, 0, 10)]),
]  # fmt: skip


def reference(source: str, entry: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # Gyre's own reference solutions, never model text
    return namespace[entry]


class CodeEnv(SingleTurnEnv):
    name = "code"

    def __init__(self, *, num_tests: int = 5, families: list[str] | None = None, timeout_s: float = 10.0,
                 memory_mb: int = 512, max_concurrent: int = 8, **kwargs: Any) -> None:  # fmt: skip
        known = [family[0] for family in FAMILIES]
        unknown = sorted(set(families or []) - set(known))
        if unknown or families == []:
            raise ValueError(f"code environment: families must be a non-empty list of {', '.join(known)}; "
                             f"unknown: {', '.join(unknown) or '(empty list)'}")  # fmt: skip
        if not 1 <= num_tests <= 50:
            raise ValueError(f"code environment: num_tests must be in 1..50, got {num_tests}")
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"code environment: max_concurrent must be a positive integer, got {max_concurrent!r}")
        parser = CodeParser()
        rubric = Rubric([tests_passed, passed_all], weights=[1.0, 0.0], parser=parser)
        super().__init__(parser=parser, rubric=rubric, **kwargs)
        self.families = [f for f in FAMILIES if families is None or f[0] in families]
        self.num_tests, self.bound = num_tests, ConcurrencyBound(max_concurrent)
        self.limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb)

    def make_task(self, rng: random.Random, task_id: str) -> Task:
        entry, signature, description, source, constants, make_args = rng.choice(self.families)
        values = constants(rng)
        source = source.format(**values)
        function = reference(source, entry)
        example, *calls = [make_args(rng) for _ in range(self.num_tests + 1)]
        tests = [{"args": args, "expected": function(*json.loads(json.dumps(args)))} for args in calls]
        shown = ", ".join(repr(a) for a in example)
        prompt = (f"Write a Python function `{entry}({signature})` that {description.format(**values)}.\n"
                  f"Example: {entry}({shown}) == {function(*example)!r}")  # fmt: skip
        return Task(id=task_id, prompt=self.format_prompt(prompt), answer=f"```python\n{source}\n```",
                    info={"entry": entry, "tests": tests})  # fmt: skip

    async def score(self, task: Task, rollout: Rollout) -> Score:
        """Run the reply's code once (both rewards read the result from `rollout.state["code"]`)."""
        code = self.parser.parse_answer(rollout.completion)
        if code is None:
            run = TestRun(0, len(task.info["tests"]), "no ```python code block in the reply")
        else:
            run = await run_tests(code, task.info["entry"], task.info["tests"], self.limits, self.bound)
        rollout.state["code"] = asdict(run)
        # why it scored what it did, in the rollout dumps and samples.md (gyre.rollouts caps a long error there)
        rollout.state["details"] = rollout.state["code"]
        return await self.rubric.score(task, rollout)


def load_environment(
    num_tests: int = 5,
    families: list[str] | None = None,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_concurrent: int = 8,
    system_prompt: str = SYSTEM_PROMPT,
    num_eval: int = 256,
    eval_seed: int = 1234,
) -> CodeEnv:
    """Args: tests per task, which task families (default all), the per-run wall-clock limit and address space, the
    runs at once, prompt, eval split size and seed."""
    return CodeEnv(num_tests=num_tests, families=families, timeout_s=timeout_s, memory_mb=memory_mb,
                   max_concurrent=max_concurrent, system_prompt=system_prompt, num_eval=num_eval,
                   eval_seed=eval_seed)  # fmt: skip
