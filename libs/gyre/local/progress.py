"""Console progress of a local run, read from the event logs the services append to, and `console`, the launcher's
one way to print a line to the terminal (above the bar while there is one)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from gyre.events import read_events
from gyre.local.runs import Run

_console_lock = threading.Lock()
_active: RunProgress | None = None  # the bar on the terminal now: a line printed past it would tear it


def console(text: str) -> None:
    """Print a line of the launcher's (its children's echoed log lines too): above the progress bar while it runs."""
    with _console_lock:
        if _active is not None:
            _active.bar.write(text)
        else:
            print(text, flush=True)


class RunProgress:
    """One tqdm bar over the RL steps of every run, advancing as the trainer logs steps.

    One run: the postfix shows its latest numbers (reward, lag, eval, step time, tokens/s, MFU); several: each
    run's step and latest train reward. `start` is where each run stands when the launch begins, `segment` the
    launch's id: a record of an earlier launch counts only up to `start`. Past it, it is of a step that launch did
    not commit or that a rewind discarded (--ckpt.resume-step 3 of a run at step 100 showed 100 steps done at once,
    with step 100's numbers, and advanced again only after step 101)."""

    def __init__(self, runs: Sequence[Run], start: dict[str, int], segment: str | None = None,
                 metrics_url: str | None = None):  # fmt: skip
        self.runs = list(runs)
        # a single run's orchestrator /metrics: its finished rollouts show that a long step is under way (a large
        # model's first step took minutes with a bar at 0 and nothing else moving)
        self.metrics_url = metrics_url if len(self.runs) == 1 else None
        self._rollouts: int | None = None
        self._polled = 0.0
        self.start = {run.name: start.get(run.name, 0) for run in self.runs}
        self.segment = segment
        self.steps = dict(self.start)
        total, initial = sum(run.max_steps for run in self.runs), sum(self.steps.values())
        self.bar = tqdm(total=total, initial=initial, desc="rl", unit="step", dynamic_ncols=True)
        self._post: dict = {}
        global _active
        _active = self

    def update(self) -> None:
        post = {}
        for run in self.runs:
            events = Path(run.output_dir) / "events"
            trainer, orch, evals = (self._valid(events / f"{name}.jsonl", self.start[run.name])
                                    for name in ("trainer_steps", "orchestrator_steps", "eval"))  # fmt: skip
            if trainer:
                step = max(e["step"] for e in trainer)
                if step > self.steps[run.name]:
                    self.bar.update(step - self.steps[run.name])
                    self.steps[run.name] = step
            if len(self.runs) > 1:
                reward = f" r={orch[-1].get('reward_mean', float('nan')):.2f}" if orch else ""
                post[run.name] = f"{self.steps[run.name]}{reward}"
            else:
                post = _numbers(trainer, orch, evals)
                if (rollouts := self._finished_rollouts()) is not None:
                    post["rollouts"] = str(rollouts)
        if post != self._post:  # redraw only on news: keeps non-TTY logs readable
            self._post = post
            self.bar.set_postfix(post, refresh=True)

    def _finished_rollouts(self) -> int | None:
        """The orchestrator's finished rollouts (gyre_orchestrator_rollouts_total, but the stale ones it dropped), read
        every 2 s; the last count while it does not answer (starting, restarting), None before it first has."""
        if self.metrics_url is None or time.monotonic() - self._polled < 2.0:
            return self._rollouts
        self._polled = time.monotonic()
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=0.5) as response:
                text = response.read().decode()
        except (OSError, ValueError):
            return self._rollouts
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "gyre_orchestrator_rollouts":  # the parser names a counter without _total
                total += sum(s.value for s in family.samples
                             if s.name.endswith("_total") and s.labels.get("outcome") != "stale")  # fmt: skip
        self._rollouts = int(total)
        return self._rollouts

    def _valid(self, path: Path, start: int) -> list[dict]:
        """The records of `path` that hold for this launch: its own, and those of steps up to where it started."""
        return [r for r in read_events(path) if r.get("segment") == self.segment or r.get("step", 0) <= start]

    def close(self) -> None:
        global _active
        if _active is self:
            _active = None
        self.bar.close()


def _numbers(trainer: list[dict], orch: list[dict], evals: list[dict]) -> dict[str, str]:
    """A single run's latest numbers."""
    post = {}
    if orch:
        last = orch[-1]
        post["reward"] = f"{last.get('reward_mean', float('nan')):.3f}"
        if "lag_mean" in last:
            post["lag"] = f"{last['lag_mean']:.2f}"
    if evals:
        post["eval"] = f"{evals[-1].get('avg_at_k', float('nan')):.3f}"
    if trainer:
        last = trainer[-1]
        secs = last.get("step_seconds") or 0
        post["step_s"] = f"{secs:.1f}"
        if secs:
            post["tok/s"] = f"{last.get('num_tokens', 0) / secs:.0f}"
        if last.get("mfu") is not None:
            post["mfu"] = f"{100 * last['mfu']:.1f}%"
    return post
