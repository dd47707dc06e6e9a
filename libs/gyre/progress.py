"""Console progress of a local run, read from the event logs the services append to."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from gyre.events import read_events

EVENTS = "events"


class RunProgress:
    """A tqdm bar over RL steps: advances as the trainer logs steps; shows the latest numbers."""

    def __init__(self, output_dir: Path, max_steps: int, start_step: int = 0):
        self.dir = Path(output_dir) / EVENTS
        self.bar = tqdm(total=max_steps, initial=start_step, desc="rl", unit="step", dynamic_ncols=True)
        self.step = start_step
        self._last_post: dict = {}

    def update(self) -> None:
        trainer = read_events(self.dir / "trainer_steps.jsonl")
        orch = read_events(self.dir / "orchestrator_steps.jsonl")
        evals = read_events(self.dir / "eval.jsonl")
        if not trainer and not orch:
            return
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
            step = max(e["step"] for e in trainer)
            if step > self.step:
                self.bar.update(step - self.step)
                self.step = step
        if post != self._last_post:  # redraw only on news: keeps non-TTY logs readable
            self._last_post = post
            self.bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        self.bar.close()
