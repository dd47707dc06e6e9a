"""Reward functions as a verifiers user brings them: one rubric over a dataset mixing tasks, told apart by the
dataset's `task` column, which verifiers passes to every reward function as a string ("default" without one).

Used by tests/unit/envs/test_env_verifiers_rewards.py through the `dataset` environment
(`reward = ["vf_mixed_rewards:correct", "vf_mixed_rewards:task_seen"]`), with this folder on PYTHONPATH.
"""

from __future__ import annotations

SEEN: list[dict] = []  # what each call of `task_seen` was given


def correct(completion, answer, task, parser, **kwargs) -> float:
    """Math rows compare numbers, every other task compares text (verifiers' mixed-task idiom)."""
    reply = parser.parse_answer(completion)
    if reply is None:
        return 0.0
    if task == "math":
        try:
            return float(float(reply) == float(answer))
        except ValueError:
            return 0.0
    return float(reply.strip() == answer.strip())


def task_seen(prompt, completion, answer, state, task, info) -> float:
    """Records what verifiers' arguments were (their types are what a verifiers reward relies on)."""
    SEEN.append({"prompt": prompt, "completion": completion, "answer": answer, "state": state, "task": task,
                 "info": info})  # fmt: skip
    return 0.0
