"""`details` in rollout dumps: capped, JSON-safe, one line in samples.md, and dumps written before it still read."""

from __future__ import annotations

import json

from gyre.rollouts import DETAILS_MAX_CHARS, cap_details, details_line, read_dump, samples_page, write_dump


def record(task_id: str, reward: float, **extra) -> dict:
    """A dump line as the orchestrator wrote it before `details` existed (plus `extra`)."""
    return {"step": 3, "task_id": task_id, "prompt": [{"role": "user", "content": f"solve {task_id}"}],
            "completion": [{"role": "assistant", "content": "def f(): pass"}], "answer": "x", "reward": reward,
            "rewards": {"tests_passed": reward}, "advantage": 0.0, "min_version": 1, "max_version": 2,
            "stop_reason": "stop", "num_turns": 1, "num_loss_tokens": 4, "group": 0, **extra}  # fmt: skip


def test_small_details_are_kept_as_they_are():
    details = {"passed": 1, "total": 5, "error": "test 2: returned 3, expected 4", "failures": ["a", "b"]}
    assert cap_details(details) == details
    assert cap_details(None) is None


def test_a_huge_traceback_or_list_is_cut_and_the_whole_stays_under_the_cap():
    details = {"error": "Traceback\n" + "x" * 1_000_000, "failures": [f"test {i}" for i in range(10_000)]}
    capped = cap_details(details)
    assert len(json.dumps(capped, ensure_ascii=False)) <= DETAILS_MAX_CHARS
    assert capped["error"].startswith("Traceback\nxxx") and len(capped["error"]) == 500
    assert capped["failures"] == [f"test {i}" for i in range(10)] + ["… 9990 more"]
    # many keys, each small: the whole is still capped, the first keys kept whole
    wide = cap_details({f"key{i}": "v" * 400 for i in range(100)})
    assert list(wide) == ["key0", "key1", "key2", "key3", "truncated"] and wide["truncated"] == "96 more keys"
    assert wide["key3"] == "v" * 400
    assert len(json.dumps(wide, ensure_ascii=False)) <= DETAILS_MAX_CHARS


def test_values_json_cannot_hold_never_fail_the_dump():
    assert cap_details({"seen": {1}, "path": object})["seen"] == "{1}"
    assert cap_details("just a reason") == {"value": "just a reason"}
    assert set(cap_details({(1, 2): "tuple key"})) == {"unreadable"}
    cyclic: dict = {}
    cyclic["self"] = cyclic
    assert set(cap_details(cyclic)) == {"unreadable"}


def test_details_are_one_short_line():
    line = details_line({"passed": 0, "error": "Traceback:\n  File 'x'\n    boom", "failures": ["t1", "t2"]})
    assert line == "passed: 0; error: Traceback: File 'x' boom; failures: t1 / t2"
    assert len(details_line({"error": "y" * 5000})) == 200 and details_line(None) == details_line({}) == ""


def test_old_dump_lines_render_without_a_details_column_and_mixed_ones_with_it(tmp_path):
    write_dump(tmp_path, 3, [record("t0", 1.0), record("t1", 0.0)])  # a dump from before `details`
    assert [r.get("details") for r in read_dump(tmp_path, 3)] == [None, None]
    page = samples_page(tmp_path)
    header = next(line for line in page.splitlines() if line.startswith("| task |"))
    assert "details" not in header and header.count("|") == 9
    assert "| t1 | solve t1 |" in page

    # one sample explains itself, one (an older environment's) does not: its cell is empty
    write_dump(tmp_path, 4, [record("t0", 1.0), record("t1", 0.0, details={"error": "no code | block\nfound"})])
    page = samples_page(tmp_path, steps=1)
    lines = page.splitlines()
    header = next(line for line in lines if line.startswith("| task |"))
    assert "| reward | details | advantage |" in header and lines[lines.index(header) + 1].count("|") == 10
    assert "| 0.000 | error: no code \\| block found | +0.000 |" in page
    assert "| 1.000 |  | +0.000 |" in page


def test_the_console_samples_after_a_run_show_each_samples_details(tmp_path):
    """`gyre rl`'s closing lines (gyre.local.report.latest_samples) showed the reward and reply only: a code
    environment's 0 said nothing of why, though samples.md did."""
    from gyre.local.report import latest_samples

    write_dump(tmp_path, 4, [record("t0", 1.0), record("t1", 0.0, details={"error": "no python\nblock", "passed": 0})])
    lines = latest_samples(tmp_path)
    assert lines[0].startswith("samples of step 4")
    assert "t0" in lines[1] and "t1" in lines[2] and lines[3].strip() == "error: no python block; passed: 0"
    assert len(lines) == 4  # the sample without details gets no line of its own


def test_the_console_samples_of_a_mix_show_each_environment_and_an_episodes_last_reply(tmp_path):
    """The closing lines showed the dump's first three records: a mix's run showed three samples of one group of
    one environment, and a multi-turn episode's first reply beside the final answer it is graded on."""
    from gyre.local.report import latest_samples

    def turns(task_id, env, *replies):
        completion = [m for reply in replies for m in ({"role": "assistant", "content": reply},
                                                       {"role": "user", "content": "Add: Bo"})][:-1]  # fmt: skip
        return record(task_id, 0.5, env=env, completion=completion)

    group = [turns("s1", "sort", "Cy, Al", "Al, Bo, Cy")] * 3 + [turns("s2", "sort", "Al, Di", "Al, Bo, Di")]
    write_dump(tmp_path, 4, [*group, record("m1", 1.0, env="math"), record("m2", 0.0, env="math")])
    lines = latest_samples(tmp_path, count=3)
    assert [line.split(":")[0].split()[-2:] for line in lines[1:]] == [["sort", "s1"], ["math", "m1"], ["sort", "s2"]]
    assert "'Al, Bo, Cy'" in lines[1] and "Cy, Al" not in lines[1]  # the last reply, the one `answer` grades

    write_dump(tmp_path, 5, [record("t0", 1.0), record("t0", 0.0), record("t1", 1.0)])  # one environment: unnamed
    assert [line.split(":")[0].split()[-1] for line in latest_samples(tmp_path)[1:]] == ["t0", "t1"]
