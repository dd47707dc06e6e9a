"""`gyre report OUTPUT_DIR`: the run's curves as a PNG, a summary table and a samples page, from its files.

The same picture as the Grafana overview dashboard's main panels, without Grafana: reward and eval
reward, step rate, step time, async lag, MFU, trainer and inference tokens/s, weight sync latency,
stale and dropped samples, per step, from ``{output_dir}/events/*.jsonl`` (for a mix of environments, each entry's
train and eval reward too); and ``samples.md``, the newest
rollout dumps (``{output_dir}/rollouts/step_{s}.jsonl``) as tables of prompt, completion, reward, advantage.

A resumed run appends to the same logs: per step the newest record counts (`latest_per_step`), and
rates are computed within one run segment, so the curves of a resumed run continue where they were.

The run is named as the other commands name it too: `--output-dir OUTPUT_DIR`, or `@ experiment.toml` (its
`output_dir`, as `gyre rl` reads it).
"""

from __future__ import annotations

import argparse
import math
import sys
from itertools import chain, zip_longest
from pathlib import Path

from gyre.events import latest_per_step, read_events
from gyre.fsio import write_atomic
from gyre.rollouts import details_line, dumped_steps, read_dump, samples_page


def _load(output_dir: Path) -> dict[str, list[dict]]:
    events = Path(output_dir) / "events"
    return {
        "trainer": latest_per_step(read_events(events / "trainer_steps.jsonl")),
        "orchestrator": latest_per_step(read_events(events / "orchestrator_steps.jsonl")),
        "eval": latest_per_step(read_events(events / "eval.jsonl")),
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
        "eval_versions": [e["step"] for e in evals],
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
    ev = _load(output_dir)  # a mix: each entry's rewards under the run's (the entries' weighted mean)
    orch, evals = ev["orchestrator"], ev["eval"]
    rows = [
        ("steps trained", f"{n['steps_trained']}"),
        ("train reward (first 20% -> last 20%)", f"{n['reward_first']:.3f} -> {n['reward_last']:.3f}"),
        *_entry_rows(orch, "reward_mean", fifths=True),
        ("eval reward (first -> last)", _eval_text(n)),
        *_entry_rows(evals, "avg_at_k", fifths=False),
        ("mean step time", f"{n['step_seconds_mean']:.2f} s"),
        ("trainer throughput", f"{n['trainer_tokens_per_s']:.0f} tok/s"),
        ("MFU (mean)", f"{100 * n['mfu_mean']:.2f} %"),
        ("async lag (mean, steps)", f"{n['lag_mean']:.2f}"),
        ("samples dropped: stale / zero-signal", f"{n['dropped_stale']} / {n['dropped_zero_signal']}"),
    ]
    if wall_seconds is not None:
        rows.append(("wall time (this launch)", f"{wall_seconds / 60:.1f} min"))  # a resumed run's: since the resume
    png = draw(output_dir)
    rows.append(("plot", str(png)))
    if dumped_steps(output_dir):
        rows.append(("samples", str(write_samples(output_dir))))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 30)
    return "\n".join([line, *(f"{k.ljust(width)}  {v}" for k, v in rows), line, *latest_samples(output_dir)])


def _entry_rows(events: list[dict], key: str, fifths: bool) -> list[tuple[str, str]]:
    """A mix's rows under the run's: each entry's `key`, 'first -> last' as the means of its first and last fifth
    (fifths, as the train reward's row) or its first and last value (as the eval's); none for a single environment."""
    rows = []
    for label in mix_labels(events):
        values = _steps(entry_events(events, label), key)[1]
        k = max(1, len(values) // 5) if fifths else 1
        rows.append((f"  {label}", f"{_mean(values[:k]):.3f} -> {_mean(values[-k:]):.3f}" if values else "none"))
    return rows


def write_samples(output_dir: Path) -> Path:
    """Write ``samples.md`` (the newest rollout dumps as tables) into the output folder; returns its path."""
    return write_atomic(Path(output_dir) / "samples.md", samples_page(output_dir).encode())  # never half a page


def latest_samples(output_dir: Path, count: int = 3, width: int = 60) -> list[str]:
    """A few lines of the newest dump for the console: reward, the completion's last reply, its details if any.

    One sample per task (a group's samples share the prompt: three of one group said little), a mix's environments
    in turn and named; the last reply, since `answer` is what the episode's end is graded on (a multi-turn one's
    first reply was shown beside the final answer)."""
    steps = dumped_steps(output_dir)
    if not steps:
        return []
    by_env: dict[str | None, dict[str, dict]] = {}
    for r in read_dump(output_dir, steps[-1]):
        by_env.setdefault(r.get("env"), {}).setdefault(r["task_id"], r)
    per_env = [list(tasks.values()) for tasks in by_env.values()]
    records = [r for r in chain.from_iterable(zip_longest(*per_env)) if r is not None]  # environments in turn
    lines = [f"samples of step {steps[-1]} (all in samples.md):"]
    for r in records[:count]:
        replies = [m.get("content") or "" for m in r["completion"] if m.get("role") == "assistant"]
        reply = " ".join((replies[-1] if replies else "").split())
        env = f"{r['env']} " if len(by_env) > 1 else ""
        lines.append(f"  reward {r['reward']:.2f}  {env}{r['task_id']}: {reply[:width]!r} "
                     f"(answer {r['answer'][:width]!r})")  # fmt: skip
        if r.get("details"):  # why it scored what it did (a code env's failing test), as samples.md shows it
            lines.append(f"      {details_line(r['details'], limit=2 * width)}")
    return lines


def _eval_text(n: dict[str, float]) -> str:
    if math.isnan(n["eval_first"]) and math.isnan(n["eval_last"]):
        return "eval off (no eval records; set orchestrator.eval.interval)"
    # which versions: the last eval is not the final model's when max_steps is no multiple of eval.interval
    versions = n.get("eval_versions") or []
    if len(versions) == 1:
        return f"{n['eval_first']:.3f} (version {versions[0]}, the only eval)"
    if versions:
        return f"{n['eval_first']:.3f} (version {versions[0]}) -> {n['eval_last']:.3f} (version {versions[-1]})"
    return f"{n['eval_first']:.3f} -> {n['eval_last']:.3f}"


def _steps(events: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the events that have a finite `key`."""
    pairs = [(e["step"], e.get(key)) for e in events if isinstance(e.get(key), int | float)]
    pairs = [(s, float(v)) for s, v in pairs if math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _per_wall_second(events: list[dict], key: str | None, window: int = 3) -> tuple[list[int], list[float]]:
    """(step, per-second rate over the last `window` steps) of `key` (None: of steps themselves).

    The wall clock of step s is its event's `time`; a segment's start is taken as its first event's
    time minus its own `step_seconds`, so the first step of every segment has a rate too. A trailing
    window smooths steps that land together (with max_async_level >= 1 batches can be pushed back to
    back). Windows never span two run segments: the pause between a crash and the re-run is not a rate.
    """
    ordered = sorted((e for e in events if "time" in e), key=lambda e: e["step"])
    segments: list[list[dict]] = []
    for e in ordered:
        if segments and segments[-1][-1].get("segment") == e.get("segment"):
            segments[-1].append(e)
        else:
            segments.append([e])
    steps, rates = [], []
    for part in segments:
        times = [part[0]["time"] - float(part[0].get("step_seconds") or 0.0)] + [e["time"] for e in part]
        for i in range(1, len(times)):
            j = max(0, i - window)
            if times[i] <= times[j]:
                continue
            amount = i - j if key is None else sum(float(e.get(key) or 0) for e in part[j:i])
            steps.append(part[i - 1]["step"])
            rates.append(amount / (times[i] - times[j]))
    return steps, rates


def mix_labels(events: list[dict]) -> list[str]:
    """A mix's entry labels in the records' `envs` (orchestrator step lines, eval lines; docs/orchestrator.md, "Several
    environments: a mix"), in order of first appearance; [] for a single environment, whose one curve is the run's."""
    labels = list(dict.fromkeys(label for e in events for label in (e.get("envs") or {})))
    return labels if len(labels) > 1 else []


def entry_events(events: list[dict], label: str) -> list[dict]:
    """One mix entry's part of each record (`envs[label]`), at the record's step."""
    return [{**e["envs"][label], "step": e["step"]} for e in events if label in (e.get("envs") or {})]


def reward_curves(orch: list[dict], evals: list[dict]) -> list[tuple[str, list[int], list[float], dict]]:
    """(label, steps, values, line style) of the Reward panel: the run's train and eval reward and, for a mix, each
    entry's (its reward_mean, its avg@k): the run's curves are the mix's weighted means, which hid an entry that
    does not learn behind one that does."""
    curves = [("train reward", *_steps(orch, "reward_mean"), {}),
              ("eval reward (avg@k)", *_steps(evals, "avg_at_k"), {})]  # fmt: skip
    curves += [(f"train: {label}", *_steps(entry_events(orch, label), "reward_mean"), {"linestyle": "--"})
               for label in mix_labels(orch)]  # fmt: skip
    curves += [(f"eval: {label}", *_steps(entry_events(evals, label), "avg_at_k"), {"linestyle": ":"})
               for label in mix_labels(evals)]  # fmt: skip
    return curves


def _line(ax, xs, ys, label: str, **kwargs) -> None:
    if xs:
        ax.plot(xs, ys, label=label, marker=".", **kwargs)


def draw(output_dir: Path, path: Path | None = None) -> Path:
    """Write ``report.png`` into the output folder and return its path.

    The nine panels are the main panels of the Grafana overview dashboard (same titles, same order),
    computed from the event logs instead of Prometheus: per step rather than per second, so a
    counter's ``rate()`` becomes the step's tokens over its duration. Inference throughput is
    approximated by the orchestrator's batch tokens (prompt + completion of kept samples) per second of
    batch generation, since the event logs do not record the inference servers' own counters.
    """
    import logging

    import matplotlib

    # its first import on a machine builds a font cache and says so at INFO ("generated new fontManager"), which
    # landed between `gyre rl`'s progress bar and its summary on a fresh machine: its warnings are enough
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ev = _load(output_dir)
    trainer, orch, evals, relay = ev["trainer"], ev["orchestrator"], ev["eval"], ev["relay"]
    fig, axes = plt.subplots(3, 3, figsize=(15, 11), constrained_layout=True)
    (reward, rate, step_time), (lag, mfu, train_tps), (infer_tps, sync, dropped) = axes

    for label, xs, ys, style in reward_curves(orch, evals):
        _line(reward, xs, ys, label, **style)
    reward.set(title="Reward", xlabel="step", ylabel="reward")

    for events, label in ((trainer, "trainer"), (orch, "orchestrator")):
        xs, per_s = _per_wall_second(events, None)
        _line(rate, xs, [60 * v for v in per_s], label)
    rate.set(title="Step rate", xlabel="step", ylabel="steps/min")

    _line(step_time, *_steps(trainer, "step_seconds"), "trainer compute")
    _line(step_time, *_steps(orch, "step_seconds"), "batch generation")
    step_time.set(title="Step time", xlabel="step", ylabel="seconds")

    _line(lag, *_steps(orch, "lag_mean"), "mean")
    _line(lag, *_steps(orch, "lag_max"), "max")
    lag.set(title="Async lag", xlabel="step", ylabel="steps")

    xs, ys = _steps(trainer, "mfu")
    _line(mfu, xs, [100 * y for y in ys], "mean over ranks")
    mfu.set(title="MFU", xlabel="step", ylabel="%")

    _line(train_tps, *_per_wall_second(trainer, "num_tokens"), "per wall second")
    per_compute = [(t["step"], t["num_tokens"] / t["step_seconds"]) for t in trainer if t.get("step_seconds")]
    _line(train_tps, [s for s, _ in per_compute], [v for _, v in per_compute], "per compute second")
    train_tps.set(title="Trainer tokens/s", xlabel="step", ylabel="tokens/s")

    gen = [(o["step"], o["num_tokens"] / o["step_seconds"]) for o in orch if o.get("step_seconds")]
    _line(infer_tps, [s for s, _ in gen], [v for _, v in gen], "batch tokens per generation second")
    infer_tps.set(title="Inference tokens/s", xlabel="step", ylabel="tokens/s")

    for replica in sorted({r["replica"] for r in relay}):
        ok = [r for r in relay if r["replica"] == replica and r.get("ok")]
        _line(sync, [r["step"] for r in ok], [r["seconds"] for r in ok], f"UpdateWeights {replica}")
    sync.set(title="Weight sync latency", xlabel="step", ylabel="seconds")

    steps = [o["step"] for o in orch]
    dropped.bar([s - 0.2 for s in steps], [o.get("dropped_stale", 0) for o in orch], width=0.4, label="stale samples")
    dropped.bar(
        [s + 0.2 for s in steps], [o.get("dropped_zero_signal", 0) for o in orch], width=0.4, label="zero-signal"
    )
    most = max([o.get("dropped_stale", 0) for o in orch] + [o.get("dropped_zero_signal", 0) for o in orch] + [0])
    dropped.set(title="Stale and dropped samples", xlabel="step", ylabel="per step", ylim=(0, max(1, 1.1 * most)))

    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(f"gyre run: {Path(output_dir).name}")
    path = path or Path(output_dir) / "report.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _experiment_files(argv: list[str], parser: argparse.ArgumentParser) -> tuple[Path | None, list[str]]:
    """(the output_dir of the `@ experiment.toml` files in argv, as `gyre rl` reads them (later files win; unset:
    gyre rl's default), the rest of argv)."""
    from gyre.config import ConfigError
    from gyre.config.rl import RLConfig
    from gyre.config.toml_io import read_toml

    files, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == "@" and i + 1 < len(argv):
            files, i = [*files, argv[i + 1]], i + 2
        elif argv[i].startswith("@") and len(argv[i]) > 1:
            files, i = [*files, argv[i][1:]], i + 1
        else:
            rest, i = [*rest, argv[i]], i + 1
    if not files:
        return None, rest
    output_dir = RLConfig.model_fields["output_dir"].default
    for file in files:
        try:
            output_dir = read_toml(file).get("output_dir", output_dir)
        except ConfigError as e:
            parser.error(str(e))
    return Path(output_dir), rest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gyre report",
        usage="gyre report OUTPUT_DIR | --output-dir OUTPUT_DIR | @ experiment.toml [--out PNG]",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("output_dir", type=Path, nargs="?", help="Output folder of a run (holds events/).")
    # every other gyre command names the folder --output-dir, and `gyre rl` takes the experiment file: a user typing
    # either got "unrecognized arguments: --output-dir" / "the following arguments are required"
    parser.add_argument("--output-dir", "--output_dir", dest="output_dir_option", type=Path, metavar="OUTPUT_DIR",
                        help="The same, as gyre rl's option.")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: OUTPUT_DIR/report.png).")
    argv = sys.argv[1:] if argv is None else list(argv)
    experiment, argv = _experiment_files(argv, parser)
    args = parser.parse_args(argv)
    chosen = {str(p): p for p in (args.output_dir, args.output_dir_option) if p is not None}
    if len(chosen) > 1:
        parser.error(f"two output folders: {' and '.join(chosen)}; give one")
    if chosen:
        args.output_dir = next(iter(chosen.values()))
    elif experiment is not None:
        args.output_dir = experiment
    else:
        parser.error("which run? give its output folder (gyre report outputs/run) or its experiment file "
                     "(gyre report @ experiment.toml)")  # fmt: skip
    if not (args.output_dir / "events").is_dir():
        parser.error(f"{args.output_dir} has no events/ folder: not a gyre run output")
    try:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)  # `--out reports/run1.png`: a traceback without it
        print(summarize(args.output_dir) if args.out is None else draw(args.output_dir, args.out))
    except OSError as e:  # a read-only run folder, a file where a folder should be
        parser.exit(2, f"gyre report: error: cannot write {e.filename or args.out}: {e.strerror or e}\n")
    except ValueError as e:  # matplotlib: `--out report.txt` ("Format 'txt' is not supported")
        parser.exit(2, f"gyre report: error: --out {args.out}: {e}\n")
    return 0
