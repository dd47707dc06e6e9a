"""`gyre bench async`: the same short run with max_async_level 0 and 1, side by side.

    gyre bench async [@ configs/ci.toml ...] [--max-steps 8] [--levels 0,1] [--output-dir D] [-- gyre rl options]

Options this command does not know (`--trainer.device cuda`) go to every `gyre rl` run, wherever they
stand; everything after `--` goes there too. The experiment (`@ file`, several merged as by `gyre rl`; a bare
path also works) and those options are checked as `gyre rl` checks them before any run.

Prints, per level, the steady-state step time (wall time between trainer steps, first step
excluded: it includes start-up), and the idle fraction of the trainer and of inference; then the
ratio k=1 ÷ k=0. With equal generation and training times the physical limit is 0.5: at k=0 the
two alternate, at k=1 generation of batch s overlaps training of step s-1.

Idle fractions come from the event logs: trainer busy = sum of its step_seconds; inference busy =
sum of the orchestrator's batch generation seconds (the union of generation intervals, so
overlapping batches are not counted twice), both over the same steady-state window.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from gyre.events import read_events

ROOT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ci.toml"


def _union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def measure(output_dir: Path) -> dict[str, float]:
    """Steady-state step time and idle fractions of one finished run."""
    events = output_dir / "events"
    trainer = read_events(events / "trainer_steps.jsonl")
    orch = read_events(events / "orchestrator_steps.jsonl")
    if len(trainer) < 3:
        raise SystemExit(f"{output_dir}: need at least 3 trained steps to measure, got {len(trainer)}")
    lo, hi = trainer[0]["time"], trainer[-1]["time"]
    window = hi - lo
    steps = len(trainer) - 1
    train_busy = _union_seconds([(t["time"] - t["step_seconds"], t["time"]) for t in trainer[1:]], lo, hi)
    gen_busy = _union_seconds([(o["time"] - o["step_seconds"], o["time"]) for o in orch], lo, hi)
    return {
        "step_seconds": window / steps,
        "trainer_idle": 1 - train_busy / window,
        "inference_idle": 1 - gen_busy / window,
        "train_seconds": sum(t["step_seconds"] for t in trainer[1:]) / steps,
        "generate_seconds": sum(o["step_seconds"] for o in orch[1:]) / max(1, len(orch) - 1),
    }


def _rl_argv(configs: list[str], level: int, max_steps: int, out: Path, extra: list[str]) -> list[str]:
    # --fresh: a benchmark measures a run from its start; in a kept --output-dir the previous benchmark's finished
    # run was "already finished" and its old event logs were reported as this benchmark's numbers
    files = [arg for config in configs for arg in ("@", config)]
    return [*files, "--output-dir", str(out), "--max-steps", str(max_steps),
            "--orchestrator.max-async-level", str(level), "--fresh", *extra]  # fmt: skip


def run_level(configs: list[str], level: int, max_steps: int, out: Path, extra: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "gyre.cli", "rl", *_rl_argv(configs, level, max_steps, out, extra)]
    print(f"$ {' '.join(cmd)}", flush=True)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _, stderr = proc.communicate()
        except KeyboardInterrupt:
            # Ctrl-C: gyre rl stops its services itself (it got the terminal's SIGINT too, or gets it here); killed,
            # as subprocess.run does, its services died as in a crash while the temp folder was being deleted
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:  # reading its pipes on: a gyre rl blocked writing to a full one never stopped, and was killed
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if proc.returncode != 0:
        raise SystemExit(f"run with max_async_level={level} failed:\n{stderr[-3000:]}")
    return measure(out)


def _levels(text: str) -> list[int]:
    """--levels: distinct max_async_level values >= 0 (a typo was a traceback after the first run's set-up)."""
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if any(k < 0 for k in levels) or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"each level once, each >= 0: {text!r}")
    return levels


def _steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if steps < 3:  # `measure` needs 3 trained steps: fewer failed after every run had been made
        raise argparse.ArgumentTypeError(f"{steps}: the measurement needs at least 3 steps")
    return steps


OWN_OPTIONS = ("--max-steps", "--levels", "--output-dir")


def _split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(experiment files, this command's options, options to pass on), each option with its value. An unknown
    option's value was taken for the experiment file (`--trainer.optim.lrr 1`: "config file not found: 1"), and
    `@ file`, as every other command takes it, was passed on as a file named '@'."""
    files, own, passed = [], [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or arg.startswith("@"):
            path = arg[1:] or (argv[i + 1] if i + 1 < len(argv) else "")
            files.append(path)
            i += 1 if arg != "@" else 2
            continue
        if not arg.startswith("-"):
            files.append(arg)  # a bare path (this command's positional, before `@`)
            i += 1
            continue
        takes_value = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith(("-", "@"))
        if arg in ("-h", "--help"):
            takes_value = False
        target = own if arg.split("=", 1)[0] in (*OWN_OPTIONS, "-h", "--help") else passed
        target += argv[i : i + 1 + takes_value]
        i += 1 + takes_value
    return files, own, passed


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's options (anywhere before `--`) and the `gyre rl` options to pass on."""
    p = argparse.ArgumentParser(
        prog="gyre bench async",
        usage="gyre bench async [@ config.toml ...] [--max-steps N] [--levels 0,1] [--output-dir D] [gyre rl options]",
        description=__doc__.splitlines()[0],
        epilog="Unknown options, and everything after `--`, are passed to each `gyre rl` run.",
    )
    p.add_argument("config", nargs="*", help="Experiment files, as `@ file.toml` (default: configs/ci.toml).")
    p.add_argument("--max-steps", type=_steps, default=8, help="RL steps per run, >= 3 (default 8).")
    p.add_argument(
        "--levels", type=_levels, default=[0, 1], help="Comma-separated max_async_level values (default 0,1)."
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="Keep the runs here, in async<k>/ (default: a temp folder); each is started over (gyre rl --fresh).",
    )
    before, after = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    files, own, passed = _split(before)
    args = p.parse_args(own)
    if "" in files:
        p.error("'@' must be followed by a TOML file path")
    args.config = files or [str(ROOT_CONFIG)]
    return args, passed + after


def check(args: argparse.Namespace, extra: list[str], base: Path) -> None:
    """Every level's `gyre rl` run checked as it checks itself before anything starts: a missing file or a mistyped
    key failed only when the first run started (`@ file` was even passed on as a file named '@'), and a kept
    --output-dir's folder that --fresh refuses only after the other levels' runs had been made."""
    from gyre.config import ConfigError, load_config
    from gyre.config.rl import RLConfig
    from gyre.local.launcher import Launcher

    for level in args.levels:
        try:
            rl_argv = _rl_argv(args.config, level, args.max_steps, base / f"async{level}", extra)
            Launcher(load_config(RLConfig, rl_argv)).validate()
        except ConfigError as e:
            raise SystemExit(f"gyre bench async: error: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else list(argv))
    levels = args.levels
    with tempfile.TemporaryDirectory(prefix="gyre-bench-async-") as tmp:
        base = args.output_dir or Path(tmp)
        check(args, extra, base)
        results = {k: run_level(args.config, k, args.max_steps, base / f"async{k}", extra) for k in levels}
    print(
        f"\n{'max_async_level':>16} {'step s':>8} {'train s':>8} {'gen s':>8} {'trainer idle':>13} {'infer idle':>11}"
    )
    for k, r in results.items():
        print(
            f"{k:>16} {r['step_seconds']:>8.2f} {r['train_seconds']:>8.2f} {r['generate_seconds']:>8.2f} "
            f"{r['trainer_idle']:>13.1%} {r['inference_idle']:>11.1%}"
        )
    if 0 in results and 1 in results:
        ratio = results[1]["step_seconds"] / results[0]["step_seconds"]
        print(
            f"\nstep time ratio k=1 / k=0: {ratio:.2f}  (physical limit 0.5 when generation == training; target <= 0.7)"
        )
    return 0
