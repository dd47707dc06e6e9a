"""Rollout dumps: the generations of a step as JSONL, `{output_dir}/rollouts/step_{s}.jsonl`.

The orchestrator writes one every `rollouts.interval` steps (and for step 1), one line per trained sample:

    {"step", "task_id", "prompt": [messages], "completion": [messages], "answer", "reward", "rewards": {fn: value},
     "advantage", "min_version", "max_version", "stop_reason", "num_turns", "num_loss_tokens", "group"}

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
_DUMP = re.compile(r"^step_(\d+)\.jsonl$")


def dump_path(output_dir: Path | str, step: int) -> Path:
    return Path(output_dir) / ROLLOUTS_DIR / f"step_{step}.jsonl"


def write_dump(output_dir: Path | str, step: int, records: list[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
    return write_atomic(dump_path(output_dir, step), text.encode())


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
        lines += ["| " + " | ".join(["task", *env, "prompt", "completion", "answer", "reward", "advantage", "versions",
                                     "stop"]) + " |", "|---" * (8 + len(env)) + "|"]  # fmt: skip
        for r in unique:
            cells = [
                r["task_id"],
                *([r.get("env", "")] if env else []),
                message_text(r["prompt"], "user"),
                message_text(r["completion"]),
                r.get("answer", ""),
                f"{r['reward']:.3f}",
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
