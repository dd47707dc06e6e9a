"""A dataset's rows as an environment's tasks: JSONL/parquet files (or rows given in code) read, checked and split.

`RowTasks` is what `Environment(dataset=...)` uses (any environment: multi-turn and tools included) and what the
`dataset` environment (`gyre.envs.dataset`, whose docstring describes the row format and the splits) is built on.
A row that cannot be used fails loading with the file and line (or parquet row) named.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from gyre.envs.splits import hold_out
from gyre.envs.types import Messages, Split, Task

log = logging.getLogger(__name__)

EVAL_SPLITS = frozenset({"eval", "test", "validation", "val"})
ROLES = frozenset({"system", "user", "assistant", "tool"})


class DatasetError(ValueError):
    """A dataset file or row cannot be used; the message names the file and the line (or parquet row)."""


def read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of a .jsonl/.parquet file; `where` is "file:line" or "file row N"."""
    if not path.is_file():
        what = "is a directory, not a .jsonl or .parquet file" if path.is_dir() else "does not exist"
        raise DatasetError(f"dataset file {str(path)!r} {what}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install 'gyre[datasets]')") from exc
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as exc:  # pyarrow's errors (ArrowInvalid, ...) are these
            raise DatasetError(f"{path}: not a readable parquet file ({exc})") from exc
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(rows)]
    if path.suffix not in (".jsonl", ".json"):
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    out = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:  # decoded per line, so a bad byte is reported at its line; a BOM (Windows editors) is allowed
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start]
                raise DatasetError(f"{where}: not UTF-8 text (byte {bad:#04x} at offset {exc.start})") from None
            if not line.strip():
                continue
            if not out and line.lstrip().startswith("["):  # `json.dump(rows, f)`: read line by line it failed as
                # "not valid JSON (Expecting value)" or "expected a JSON object, got list", never saying why
                raise DatasetError(
                    f"{where}: the file is a JSON array; a dataset file is JSON Lines, one object per line "
                    f"(convert it: jq -c '.[]' {path} > {path.with_suffix('.jsonl').name})"
                )
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
            except RecursionError:
                raise DatasetError(f"{where}: JSON nested too deeply to read") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
            out.append((where, row))
    if not out:
        raise DatasetError(f"{path}: the file has no rows")
    return out


#: column names that usually hold the prompt / the reference answer (verifiers', HF's and verl's datasets)
_PROMPT_COLUMNS = ("question", "problem", "query", "instruction", "input", "messages")
_ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "target", "output", "label", "reward_model")


def lookup(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, following dots into nested objects; KeyError when any part is missing."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


class RowTasks:
    """The tasks of a dataset's rows for an environment (`Environment(dataset=...)`: any kind, multi-turn and tools
    included; `DatasetEnv` is the single-turn one): `train` and `eval` lists, split as the module docstring says.
    `rows` is a `.jsonl`/`.parquet` path or a list of row dicts (a `datasets.Dataset` iterates as one); None with
    `eval_rows` is an eval-only dataset (`train` empty)."""

    def __init__(self, env: Any, rows: Any, eval_rows: Any = None, *, prompt_key: str = "prompt",
                 answer_key: str = "answer", split_key: str = "split") -> None:  # fmt: skip
        self.env, self.prompt_key, self.answer_key, self.split_key = env, prompt_key, answer_key, split_key
        source = _source(rows, "dataset") if rows is not None else _source(eval_rows, "eval_dataset")
        train, evals = [], []
        for where, row in _rows(rows, "dataset") if rows is not None else []:
            split = self._split_of(where, row)
            task = self._task(where, row, f"row-{len(train) + len(evals)}")
            (evals if split == "eval" and eval_rows is None else train).append(task)
        if eval_rows is not None:
            held = _rows(eval_rows, "eval_dataset")
            evals = [self._task(where, row, f"eval-{i}") for i, (where, row) in enumerate(held)]
        elif not evals:
            if len(train) <= env.num_eval:
                raise DatasetError(
                    f"{source}: {len(train)} rows and num_eval={env.num_eval} leave no training rows; lower num_eval, "
                    "give an eval file (eval_path; eval_dataset for an Environment), or mark rows with a 'split' column"
                )
            train, evals = hold_out(train, env.num_eval, f"{env.name}/eval/{env.eval_seed}")
        # A prompt in both splits (a duplicated row, or an eval file overlapping the train file) would be trained on
        # and then scored as held out: its train copies go.
        eval_keys = {task.key for task in evals}
        kept = [task for task in train if task.key not in eval_keys]
        if len(kept) < len(train):
            log.warning("%s: %d train rows repeat an eval prompt and are left out of training", source,
                        len(train) - len(kept))  # fmt: skip
        train = kept
        if not train and rows is not None:
            raise DatasetError(f"{source}: every row is in the eval split; nothing to train on")
        self.train, self.eval = train, evals

    def _split_of(self, where: str, row: dict[str, Any]) -> Split:
        value = row.get(self.split_key, "train")
        if value == "train":
            return "train"
        if value in EVAL_SPLITS:
            return "eval"
        raise DatasetError(f"{where}: {self.split_key!r} is {value!r}; use 'train' or one of {sorted(EVAL_SPLITS)}")

    def _task(self, where: str, row: dict[str, Any], task_id: str) -> Task:
        try:
            prompt_key = self.prompt_key
            if prompt_key == "prompt" and "prompt" not in row and "question" in row:
                # verifiers' rule: a row without a `prompt` is asked its `question` (after the system prompt and
                # few_shot); a verifiers environment's dataset (question, answer, info, task) failed to load here
                prompt_key = "question"
            prompt, answer = lookup(row, prompt_key), lookup(row, self.answer_key)
        except KeyError as exc:
            # which setting names the column, and the row's likeliest one (a verifiers/HF dataset's "question")
            setting = "prompt_key" if exc.args[0] == self.prompt_key else "answer_key"
            likely = _PROMPT_COLUMNS if setting == "prompt_key" else _ANSWER_COLUMNS
            guess = next((column for column in likely if column in row), None)
            example = f', e.g. {setting} = "{guess}"' if guess else ""
            raise DatasetError(f"{where}: no {exc.args[0]!r} field (the row has: {', '.join(row)}); set "
                               f"{setting}{example}") from None  # fmt: skip
        if isinstance(answer, bool | int | float):
            answer = str(answer)
        if not isinstance(answer, str):
            raise DatasetError(f"{where}: {self.answer_key!r} must be text or a number, got {type(answer).__name__}")
        return Task(id=task_id, prompt=self._messages(where, prompt), answer=answer, info=_info(row))

    def _messages(self, where: str, prompt: Any) -> Messages:
        if isinstance(prompt, str):
            return self.env.format_prompt(prompt)
        ok = (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in prompt
            )
        )
        if not ok:
            raise DatasetError(
                f"{where}: {self.prompt_key!r} must be text or a list of {{'role', 'content'}} messages "
                f"(roles {sorted(ROLES)}), got {json.dumps(prompt)[:200]}"
            )
        if self.env.few_shot:  # verifiers adds few_shot only to a question; a silent drop would surprise as much
            raise DatasetError(f"{where}: {self.prompt_key!r} is a message list, and few_shot examples go before a "
                               f"text prompt's question: put them in the rows' messages, or drop few_shot")  # fmt: skip
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if self.env.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.env.system_prompt})
        return messages


def _info(row: dict[str, Any]) -> dict[str, Any]:
    """`task.info`: the row, plus the keys of its `info` column when that is an object (or its JSON text, as a
    dataset saved to parquet holds it). A verifiers dataset keeps a task's data there (`question`, `answer`, `info`,
    `task` columns), and its rewards read `info["key"]`: that was a KeyError, a silent 0 for every sample. The row's
    own columns win a clash, and `info["info"]` is still the column."""
    nested = row.get("info")
    if isinstance(nested, str) and nested.lstrip().startswith("{"):
        with contextlib.suppress(ValueError, RecursionError):  # not JSON after all: a text column like any other
            nested = json.loads(nested)
    return {**nested, **row} if isinstance(nested, dict) else dict(row)


def _source(rows: Any, setting: str) -> str:
    return str(rows) if isinstance(rows, str | Path) else f"{setting} (rows given in code)"


def _rows(rows: Any, setting: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) pairs of a file (`read_rows`) or of rows given in code: a list of dicts, or a `datasets.Dataset`
    (anything iterable of dicts); anything else is refused naming the setting."""
    if isinstance(rows, str | Path):
        return read_rows(Path(rows))
    if isinstance(rows, dict) or not hasattr(rows, "__iter__"):
        raise DatasetError(f"{setting}: a .jsonl or .parquet path, or a list of row dicts, got {type(rows).__name__}")
    pairs = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{setting} row {i}: a row is a dict of columns, got {type(row).__name__}")
        pairs.append((f"{setting} row {i}", row))
    if not pairs:
        raise DatasetError(f"{setting}: no rows")
    return pairs
