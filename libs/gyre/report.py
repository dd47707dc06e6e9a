"""`gyre report OUTPUT_DIR`: the run's curves as a PNG and a summary table, from its event logs.

The same picture as the Grafana overview, without Grafana: reward and eval reward, step time,
throughput, and async lag per step. Reads only ``{output_dir}/events/*.jsonl``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from gyre.events import read_events


def _load(output_dir: Path) -> dict[str, list[dict]]:
    events = Path(output_dir) / "events"
    return {
        "trainer": read_events(events / "trainer_steps.jsonl"),
        "orchestrator": read_events(events / "orchestrator_steps.jsonl"),
        "eval": read_events(events / "eval.jsonl"),
        "relay": read_events(events / "weight_relay.jsonl"),
    }


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summary_numbers(output_dir: Path) -> dict[str, float]:
    ev = _load(output_dir)
    trainer, orch, evals = ev["trainer"], ev["orchestrator"], ev["eval"]
    rewards = [o.get("reward_mean") for o in orch]
    first_k = max(1, len(rewards) // 5)
    out = {
        "steps_trained": len(trainer),
        "reward_first": _mean(rewards[:first_k]),
        "reward_last": _mean(rewards[-first_k:]),
        "eval_first": evals[0]["avg_at_k"] if evals else float("nan"),
        "eval_last": evals[-1]["avg_at_k"] if evals else float("nan"),
        "step_seconds_mean": _mean([t.get("step_seconds") for t in trainer]),
        "trainer_tokens_per_s": _mean([t["num_tokens"] / t["step_seconds"] for t in trainer if t.get("step_seconds")]),
        "mfu_mean": _mean([t.get("mfu") for t in trainer]),
        "lag_mean": _mean([o.get("lag_mean") for o in orch]),
        "dropped_stale": sum(o.get("dropped_stale", 0) for o in orch),
        "dropped_zero_signal": sum(o.get("dropped_zero_signal", 0) for o in orch),
    }
    return out


def summarize(output_dir: Path, wall_seconds: float | None = None) -> str:
    n = summary_numbers(output_dir)
    rows = [
        ("steps trained", f"{n['steps_trained']}"),
        ("train reward (first 20% -> last 20%)", f"{n['reward_first']:.3f} -> {n['reward_last']:.3f}"),
        ("eval reward (first -> last)", f"{n['eval_first']:.3f} -> {n['eval_last']:.3f}"),
        ("mean step time", f"{n['step_seconds_mean']:.2f} s"),
        ("trainer throughput", f"{n['trainer_tokens_per_s']:.0f} tok/s"),
        ("MFU (mean)", f"{100 * n['mfu_mean']:.2f} %"),
        ("async lag (mean, steps)", f"{n['lag_mean']:.2f}"),
        ("samples dropped: stale / zero-signal", f"{n['dropped_stale']} / {n['dropped_zero_signal']}"),
    ]
    if wall_seconds is not None:
        rows.append(("wall time", f"{wall_seconds / 60:.1f} min"))
    png = draw(output_dir)
    rows.append(("plot", str(png)))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 30)
    return "\n".join([line, *(f"{k.ljust(width)}  {v}" for k, v in rows), line])


def draw(output_dir: Path, path: Path | None = None) -> Path:
    """Write ``report.png`` (2x2 panels) into the output folder and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = _load(output_dir)
    trainer, orch, evals = ev["trainer"], ev["orchestrator"], ev["eval"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    ax = axes[0][0]
    if orch:
        ax.plot([o["step"] for o in orch], [o.get("reward_mean") for o in orch], label="train reward", marker=".")
    if evals:
        ax.plot([e["step"] for e in evals], [e["avg_at_k"] for e in evals], label="eval reward", marker="o")
    ax.set(title="Reward", xlabel="step", ylabel="reward")
    ax.legend(loc="lower right")
    ax = axes[0][1]
    if trainer:
        ax.plot(
            [t["step"] for t in trainer], [t.get("step_seconds") for t in trainer], label="trainer step", marker="."
        )
    if orch:
        ax.plot([o["step"] for o in orch], [o.get("step_seconds") for o in orch], label="batch generation", marker=".")
    ax.set(title="Step time", xlabel="step", ylabel="seconds")
    ax.legend(loc="upper right")
    ax = axes[1][0]
    if trainer:
        ax.plot(
            [t["step"] for t in trainer],
            [t["num_tokens"] / t["step_seconds"] if t.get("step_seconds") else None for t in trainer],
            label="trainer tokens/s",
            marker=".",
        )
    ax.set(title="Throughput", xlabel="step", ylabel="tokens/s")
    ax = axes[1][1]
    if orch:
        ax.plot([o["step"] for o in orch], [o.get("lag_mean") for o in orch], label="mean lag", marker=".")
        ax.plot([o["step"] for o in orch], [o.get("lag_max") for o in orch], label="max lag", marker=".")
    ax.set(title="Async lag (policy versions behind)", xlabel="step", ylabel="steps")
    ax.legend(loc="upper right")
    fig.suptitle(f"gyre run: {Path(output_dir).name}")
    path = path or Path(output_dir) / "report.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre report", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="Output folder of a run (holds events/).")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: OUTPUT_DIR/report.png).")
    args = parser.parse_args(argv)
    if not (args.output_dir / "events").is_dir():
        parser.error(f"{args.output_dir} has no events/ folder: not a gyre run output")
    print(summarize(args.output_dir) if args.out is None else draw(args.output_dir, args.out))
    return 0
