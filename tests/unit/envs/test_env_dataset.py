"""`dataset` environments: JSONL/parquet rows -> tasks, splits, rewards, and bad rows named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from envs_doubles import ScriptedClient
from gyre.envs import load_environment
from gyre.envs.dataset import DatasetError

SHIPPED = Path(__file__).parent / "data" / "reverse_words.jsonl"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


async def reward_of(env, task, reply: str, sampling) -> float:
    rollout = await env.rollout(ScriptedClient([reply]), task, sampling)
    return (await env.score(task, rollout)).reward


def test_shipped_dataset_splits_by_column():
    env = load_environment("dataset", path=str(SHIPPED), system_prompt="Reverse the text.")
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert env.tasks("eval").size == len(evals) == 8
    task = env.tasks("eval")[0]
    assert task.prompt == [
        {"role": "system", "content": "Reverse the text."},
        {"role": "user", "content": evals[0]["prompt"]},
    ]
    assert task.answer == evals[0]["answer"] and task.info["level"] == evals[0]["level"]


def test_train_split_is_endless_epochs_of_every_train_row():
    env = load_environment("dataset", path=str(SHIPPED))
    source = env.tasks("train", seed=3)
    assert source.size is None
    first, second = [source[i].id for i in range(40)], [source[i].id for i in range(40, 80)]
    assert sorted(first) == sorted(second) and len(set(first)) == 40  # each epoch visits every train row once
    assert first != second  # in a fresh order
    again = load_environment("dataset", path=str(SHIPPED)).tasks("train", seed=3)
    assert [again[i].id for i in range(40)] == first  # deterministic: a resumed run sees the same order
    assert [env.tasks("train", seed=4)[i].id for i in range(40)] != first
    eval_ids = {t.id for t in env.tasks("eval")}
    assert not eval_ids & set(first)


def test_held_out_split_and_second_file(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    env = load_environment("dataset", path=str(path), num_eval=5, eval_seed=1)
    evals = [t.answer for t in env.tasks("eval")]
    assert len(evals) == 5 and evals == [t.answer for t in load_environment("dataset", path=str(path), num_eval=5,
                                                                          eval_seed=1).tasks("eval")]  # fmt: skip
    train = {env.tasks("train")[i].answer for i in range(15)}
    assert train | set(evals) == {str(i) for i in range(20)} and not train & set(evals)

    eval_file = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "x", "answer": "y"}])
    env = load_environment("dataset", path=str(path), eval_path=str(eval_file))
    assert [t.answer for t in env.tasks("eval")] == ["y"]
    assert {env.tasks("train")[i].answer for i in range(20)} == {str(i) for i in range(20)}


def test_chat_prompts_and_verl_layout_nested_answer(tmp_path):
    rows = [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": f"What is 2+{3 + i}?"}],
            "reward_model": {"style": "rule", "ground_truth": 5 + i},
            "split": "test" if i == 0 else "train",
        }
        for i in range(3)
    ]
    path = write_jsonl(tmp_path / "verl.jsonl", rows)
    env = load_environment("dataset", path=str(path), answer_key="reward_model.ground_truth", system_prompt="Sys.")
    task = env.tasks("eval")[0]
    assert task.prompt == [{"role": "system", "content": "Sys."}, {"role": "user", "content": "What is 2+3?"}]
    assert task.answer == "5"


def test_parquet_files_load(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": f"Reverse: ab{i}", "answer": f"{i}ba", "split": "eval" if i < 2 else "train"} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet")
    env = load_environment("dataset", path=str(tmp_path / "data.parquet"))
    assert [t.answer for t in env.tasks("eval")] == ["0ba", "1ba"]
    assert env.tasks("train")[0].answer in {"2ba", "3ba", "4ba", "5ba"}


@pytest.mark.asyncio
async def test_exact_and_math_rewards(tmp_path, sampling):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1/2 + 1/4?", "answer": "3/4", "split": "eval"},
                                              {"prompt": "p", "answer": "a"}])  # fmt: skip
    exact = load_environment("dataset", path=str(path))
    task = exact.tasks("eval")[0]
    assert await reward_of(exact, task, "  3/4 \n", sampling) == 1.0
    assert await reward_of(exact, task, "0.75", sampling) == 0.0
    math = load_environment("dataset", path=str(path), reward="math")
    assert await reward_of(math, task, "0.75", sampling) == 1.0
    assert await reward_of(math, task, "The answer is \\boxed{\\frac{3}{4}}", sampling) == 1.0
    assert await reward_of(math, task, "1/2", sampling) == 0.0
    # Echoing the question's expression is no answer (math-verify evaluates it to 3/4).
    assert await reward_of(math, task, "\\boxed{1/2 + 1/4}", sampling) == 0.0
    assert await reward_of(math, task, "6/8", sampling) == 0.0


@pytest.mark.asyncio
async def test_a_small_or_large_numeric_answer_column_is_gradable(tmp_path, sampling):
    """A JSON number becomes its Python text: 0.00001 is "1e-05", which math-verify read as 1*E - 5, so no reply
    ever scored on such a row."""
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "tiny?", "answer": 0.00001, "split": "eval"},
                                              {"prompt": "huge?", "answer": 1e22, "split": "eval"},
                                              {"prompt": "p", "answer": "a"}])  # fmt: skip
    env = load_environment("dataset", path=str(path), reward="math")
    tiny, huge = env.tasks("eval")
    assert (tiny.answer, huge.answer) == ("1e-05", "1e+22")
    assert await reward_of(env, tiny, "0.00001", sampling) == 1.0
    assert await reward_of(env, tiny, "The answer is $1 \\times 10^{-5}$.", sampling) == 1.0
    assert await reward_of(env, tiny, "0.00002", sampling) == 0.0
    assert await reward_of(env, huge, "1e22", sampling) == 1.0


REWARD_MODULE = '''
def starts_like(completion, answer, info) -> float:
    """Reward by a column the environment does not know about."""
    reply = completion[-1]["content"]
    return 0.5 * (reply[:1] == answer[:1]) + 0.5 * (len(reply) == info["level"])
'''


@pytest.mark.asyncio
async def test_user_reward_function_by_import_path(tmp_path, monkeypatch, sampling):
    (tmp_path / "my_rewards_i13.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("dataset", path=str(SHIPPED), reward="my_rewards_i13:starts_like")
    task = env.tasks("eval")[0]
    assert await reward_of(env, task, task.answer, sampling) == 1.0
    assert await reward_of(env, task, task.answer[0], sampling) == 0.5
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_environment("dataset", path=str(SHIPPED), reward="my_rewards_i13:nope")
    with pytest.raises(ValueError, match="exact"):
        load_environment("dataset", path=str(SHIPPED), reward="fuzzy")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "answer": ', "bad.jsonl:3: not valid JSON"),
        ('["prompt", "answer"]', "bad.jsonl:3: expected a JSON object, got list"),
        ('{"problem": "a", "answer": "b"}', "bad.jsonl:3: no 'prompt' field (the row has: problem, answer)"),
        ('{"prompt": "a"}', "bad.jsonl:3: no 'answer' field (the row has: prompt); set answer_key"),
        # what to set, with the row's likeliest column
        (
            '{"problem": "a", "answer": "b"}',
            "no 'prompt' field (the row has: problem, answer); set prompt_key, e.g. prompt_key = \"problem\"",
        ),
        ('{"prompt": "a", "solution": "b"}', 'set answer_key, e.g. answer_key = "solution"'),
        ('{"prompt": "a", "answer": ["b"]}', "bad.jsonl:3: 'answer' must be text or a number"),
        ('{"prompt": [{"role": "robot", "content": "a"}], "answer": "b"}', "bad.jsonl:3: 'prompt' must be text or"),
        ('{"prompt": "a", "answer": "b", "split": "dev"}', "bad.jsonl:3: 'split' is 'dev'"),
        ('{"prompt": "a", "answer": ' + "[" * 5000 + "]" * 5000 + "}", "bad.jsonl:3: JSON nested too deeply"),
    ],
)
def test_a_malformed_line_is_named_by_file_and_line(tmp_path, line, message):
    good = json.dumps({"prompt": "p", "answer": "a"})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", line, good])  # line 2 is blank (allowed)
    with pytest.raises(DatasetError) as info:
        load_environment("dataset", path=str(path), num_eval=1)
    assert message in str(info.value)


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_file_is_named_as_such(tmp_path, indent):
    """`json.dump(rows, f)` (one line or pretty-printed) failed as "not valid JSON" or "got list" at line 1."""
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "p", "answer": "a"}, {"prompt": "q", "answer": "b"}], indent=indent))
    with pytest.raises(DatasetError, match=r"rows.json:1: the file is a JSON array; a dataset file is JSON Lines"):
        load_environment("dataset", path=str(path), num_eval=1)


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    """A stray Latin-1 byte failed loading with a bare UnicodeDecodeError that named neither the file nor the line."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9"):
        load_environment("dataset", path=str(path), num_eval=1)
    bom = tmp_path / "bom.jsonl"  # what some Windows editors write: still a valid file
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    assert load_environment("dataset", path=str(bom), num_eval=1).tasks("eval").size == 1


def test_a_corrupt_parquet_file_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="broken.parquet: not a readable parquet file"):
        load_environment("dataset", path=str(path))


@pytest.mark.parametrize("seed", range(6))
def test_a_prompt_is_never_in_both_splits(tmp_path, seed):
    """Duplicated rows were held out on one side and trained on the other (with 4 rows, 3 of these 6 seeds)."""
    rows = [{"prompt": "a", "answer": "1"}] * 2 + [{"prompt": p, "answer": "1"} for p in "bcd"]
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    env = load_environment("dataset", path=str(path), num_eval=1, eval_seed=seed)
    eval_prompts = {t.prompt[-1]["content"] for t in env.tasks("eval")}
    train_prompts = {env.tasks("train")[i].prompt[-1]["content"] for i in range(10)}
    assert not eval_prompts & train_prompts
    split_file = write_jsonl(tmp_path / "split.jsonl", [*rows[2:], {"prompt": "b", "answer": "1", "split": "eval"}])
    env = load_environment("dataset", path=str(split_file))
    assert {env.tasks("train")[i].prompt[-1]["content"] for i in range(10)} == {"c", "d"}
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "c", "answer": "1"}])
    env = load_environment("dataset", path=str(split_file), eval_path=str(eval_file))
    assert {env.tasks("train")[i].prompt[-1]["content"] for i in range(10)} == {"b", "d"}


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_environment("dataset", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="is a directory, not a .jsonl or .parquet file"):  # said "does not exist"
        load_environment("dataset", path=str(tmp_path))
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="use .jsonl or .parquet"):
        load_environment("dataset", path=str(tmp_path / "data.csv"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_environment("dataset", path=str(tmp_path / "empty.jsonl"))
    small = write_jsonl(tmp_path / "small.jsonl", [{"prompt": "p", "answer": "a"}] * 3)
    with pytest.raises(DatasetError, match="3 rows and num_eval=64 leave no training rows"):
        load_environment("dataset", path=str(small))


def test_reference_answers_are_sft_examples():
    env = load_environment("dataset", path=str(SHIPPED))
    task = env.tasks("train")[0]
    assert env.sft_example(task)[-1] == {"role": "assistant", "content": task.answer}


@pytest.mark.asyncio
@pytest.mark.parametrize("as_text", [False, True])
async def test_a_verifiers_datasets_info_column_is_read_by_its_rewards(tmp_path, monkeypatch, sampling, as_text):
    """A verifiers dataset keeps a task's data in an `info` column ({"question", "answer", "info": {...}}), and its
    rewards read `info["level"]`: Gyre's info was the row, so that was a KeyError, 0 for every sample (named in the
    errors, but the run trained on nothing). Now the column's keys are in `task.info` too (the row's own win a
    clash); a parquet file's info column saved as JSON text is read alike."""
    info = {"level": 2, "answer": "not this"}
    row = {"question": "Reverse: ab", "answer": "ba", "info": json.dumps(info) if as_text else info}
    path = write_jsonl(tmp_path / "vf.jsonl", [row, {**row, "question": "Reverse: cd", "answer": "dc"}])
    (tmp_path / "vf_rewards_i13.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("dataset", path=str(path), prompt_key="question", reward="vf_rewards_i13:starts_like",
                           num_eval=1)  # fmt: skip
    task = env.tasks("eval")[0]
    assert task.info["level"] == 2 and task.info["answer"] == task.answer and task.info["info"] == row["info"]
    assert await reward_of(env, task, task.answer, sampling) == 1.0  # both halves: the level read from info


BRIEF_MODULE = """
def brief(completion) -> float:
    return float(len(completion[-1]["content"]) <= 2)
"""


@pytest.mark.asyncio
async def test_several_rewards_with_weights_from_the_config(tmp_path, monkeypatch, sampling):
    """`reward` took one function: a rubric of several weighted ones (verifiers' funcs and weights) needed a Python
    loader. Now `reward` may be a list, with `weights`, each function reported on its own."""
    (tmp_path / "brief_rewards_i13.py").write_text(BRIEF_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = {"path": str(SHIPPED), "reward": ["exact", "brief_rewards_i13:brief"], "weights": [1.0, 0.25]}
    env = load_environment("dataset", **args)
    task = env.tasks("eval")[0]
    rollout = await env.rollout(ScriptedClient([task.answer]), task, sampling)
    score = await env.score(task, rollout)
    assert score.per_function == {"exact_match": 1.0, "brief": float(len(task.answer) <= 2)}
    assert score.reward == pytest.approx(1.0 + 0.25 * score.per_function["brief"])
    with pytest.raises(ValueError, match=r"weights: 1 weights for 2 rewards \['exact', 'math'\]: give one per reward"):
        load_environment("dataset", path=str(SHIPPED), reward=["exact", "math"], weights=[1.0])
    with pytest.raises(ValueError, match=r"reward: \['exact', 'exact'\] names a reward function twice"):
        load_environment("dataset", path=str(SHIPPED), reward=["exact", "exact"])
    with pytest.raises(ValueError, match="reward: a name or import path, or a non-empty list of them, got \\[\\]"):
        load_environment("dataset", path=str(SHIPPED), reward=[])
