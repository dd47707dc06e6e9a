"""Rollout dumps: the generations of a step as JSONL, `{output_dir}/rollouts/step_{s}.jsonl`.

The orchestrator writes one every `rollouts.interval` steps (and for step 1), one line per trained sample:

    {"step", "task_id", "prompt": [messages], "completion": [messages], "answer", "reward", "rewards": {fn: value},
     "advantage", "min_version", "max_version", "stop_reason", "num_turns", "num_loss_tokens", "group", "details"}

`details` (optional; older dumps lack it) is the environment's short per-sample explanation, e.g. why a reply
scored 0: whatever dict it put in `rollout.state["details"]` (the key `DETAILS`), made JSON-safe and capped by
`cap_details` so a huge traceback cannot bloat the dumps.

Files are written atomically (readers see a whole dump or none). `gyre report` renders the newest dumps as a
samples page; `read_dump` / `dumped_steps` are for anything else that wants them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gyre.fsio import write_atomic

ROLLOUTS_DIR = "rollouts"
DETAILS = "details"  # the `rollout.state` key an environment sets to explain a sample (dumped, shown in samples.md)
DETAILS_MAX_CHARS = 2000  # one sample's details in a dump, as JSON
_DETAILS_STR_CHARS = 500  # a string in them (a traceback keeps its start)
_DETAILS_LIST_ITEMS = 10
_DUMP = re.compile(r"^step_(\d+)\.jsonl$")


def dump_path(output_dir: Path | str, step: int) -> Path:
    return Path(output_dir) / ROLLOUTS_DIR / f"step_{step}.jsonl"


def write_dump(output_dir: Path | str, step: int, records: list[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
    return write_atomic(dump_path(output_dir, step), text.encode())


def cap_details(details: Any, limit: int = DETAILS_MAX_CHARS) -> dict[str, Any] | None:
    """`details` as a dump carries them: JSON-safe (anything else as its `str`), strings cut to 500 characters,
    lists to 10 items, and the whole at most `limit` characters of JSON (beyond that: the first keys that fit and
    `"truncated": "N more keys"`). None stays None; a non-dict is kept as `{"value": ...}`. Never raises: an
    environment's odd value must not fail the step that dumps it."""
    if details is None:
        return None
    if not isinstance(details, dict):
        details = {"value": details}
    try:
        safe = _shrink(json.loads(json.dumps(details, ensure_ascii=False, default=str)))
    except (TypeError, ValueError, RecursionError) as e:  # keys that are not strings/numbers, a cycle
        return {"unreadable": f"{type(e).__name__}: {e}"[:_DETAILS_STR_CHARS]}
    if len(json.dumps(safe, ensure_ascii=False)) <= limit:
        return safe
    # too big still (many keys, deep nesting): the first keys that fit, and how many were left out
    kept: dict[str, Any] = {}
    size = 2 + 40  # the braces, and room for the "truncated" note
    for key, value in safe.items():
        size += len(json.dumps({key: value}, ensure_ascii=False))  # its `"key": value` + 2: the ", " between
        if size > limit:
            break
        kept[key] = value
    kept["truncated"] = f"{len(safe) - len(kept)} more keys"
    return kept


def _shrink(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= _DETAILS_STR_CHARS else value[: _DETAILS_STR_CHARS - 1] + "…"
    if isinstance(value, list):
        more = len(value) - _DETAILS_LIST_ITEMS
        return [_shrink(v) for v in value[:_DETAILS_LIST_ITEMS]] + ([f"… {more} more"] if more > 0 else [])
    if isinstance(value, dict):
        return {k: _shrink(v) for k, v in value.items()}
    return value


def details_line(details: dict[str, Any] | None, limit: int = 200) -> str:
    """One short line of a sample's details for samples.md: `key: value; ...` (lists joined by ` / `)."""
    if not details:
        return ""
    parts = []
    for key, value in details.items():
        if isinstance(value, list):
            value = " / ".join(str(v) for v in value)
        parts.append(f"{key}: {value}")
    text = " ".join("; ".join(parts).split())  # one line: a traceback's newlines and indents folded
    return text if len(text) <= limit else text[: limit - 1] + "…"


def dumped_steps(output_dir: Path | str) -> list[int]:
    folder = Path(output_dir) / ROLLOUTS_DIR
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _DUMP.match(p.name)))


def read_dump(output_dir: Path | str, step: int) -> list[dict[str, Any]]:
    with dump_path(output_dir, step).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def message_text(messages: list[dict[str, Any]], role: str | None = None) -> str:
    """The text of the messages (of one role), tool calls shown as `name(arguments)`, joined by blank lines."""
    parts = []
    for m in messages:
        if role is not None and m.get("role") != role:
            continue
        text = m.get("content") or ""
        calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls") or []]
        parts.append(" ".join([text, *calls]).strip())
    return "\n\n".join(p for p in parts if p)


def samples_page(output_dir: Path | str, steps: int = 3, per_step: int = 8) -> str:
    """Markdown: the newest `steps` dumps, `per_step` samples each (best and worst rewards first, then the rest)."""
    found = dumped_steps(output_dir)
    lines = [f"# Samples of {Path(output_dir).name}", ""]
    if not found:
        return "\n".join(lines + ["No rollout dumps (rollouts.interval unset, or no step finished yet).", ""])
    for step in reversed(found[-steps:]):
        records = read_dump(output_dir, step)
        # a mix of environments (each line's `env`): each entry's mean and its own best and worst samples, with an env
        # column; the step's best and worst alone were often all one entry's, and its mean hid the others'
        labels = list(dict.fromkeys(r["env"] for r in records if r.get("env")))
        groups = [[r for r in records if r.get("env") == label] for label in labels] if len(labels) > 1 else [records]
        share = max(2, per_step // len(groups))
        unique = list({id(r): r for group in groups for r in _best_and_worst(group, share)}.values())
        mean = sum(r["reward"] for r in records) / len(records)
        by_env = ", ".join(f"{label} {sum(r['reward'] for r in group) / len(group):.3f} over {len(group)}"
                           for label, group in zip(labels, groups, strict=True)) if len(groups) > 1 else ""  # fmt: skip
        header = f"## Step {step}: {len(records)} samples, mean reward {mean:.3f}"
        lines += [f"{header} ({by_env})" if by_env else header, ""]
        env = ["env"] if by_env else []
        # a details column only where the step's environment explains its samples (older dumps have none)
        details = ["details"] if any(r.get(DETAILS) for r in unique) else []
        columns = ["task", *env, "prompt", "completion", "answer", "reward", *details, "advantage", "versions", "stop"]
        lines += ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
        for r in unique:
            cells = [
                r["task_id"],
                *([r.get("env", "")] if env else []),
                message_text(r["prompt"], "user"),
                message_text(r["completion"]),
                r.get("answer", ""),
                f"{r['reward']:.3f}",
                *([details_line(r.get(DETAILS))] if details else []),
                f"{r['advantage']:+.3f}",
                f"{r['min_version']}..{r['max_version']}",
                r["stop_reason"],
            ]
            lines.append("| " + " | ".join(_cell(str(c)) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _best_and_worst(records: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Up to `count` records: the best rewards first (half), then the worst."""
    ordered = sorted(records, key=lambda r: -r["reward"])
    return (ordered[: count // 2] + ordered[::-1][: count - count // 2])[: len(records)]


def _cell(text: str, limit: int = 300) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|").replace("\n", "<br>")
