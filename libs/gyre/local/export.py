"""`gyre export RUN_DIR --step N --to DIR`: a run's checkpoint as a Hugging Face folder (transformers, vLLM).

The export itself is the trainer's (`python -m gyre_trainer.export`, imported only when run, as every trainer-backed
`gyre` subcommand is); this front end names the run by its folder: it reads the trainer config `gyre rl` saved there
(`RUN_DIR/configs/trainer.toml`), so a `gyre rl` user need not know where the trainer's config is.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

PROG = "gyre export"
SAVED_CONFIG = Path("configs") / "trainer.toml"  # what `gyre rl` writes for its trainer (gyre.local.launcher)

HELP = f"""usage: {PROG} RUN_DIR [--run NAME] [--step N] --to DIR [--key value ...]
       {PROG} @ trainer.toml [--run NAME] [--step N] --to DIR [--key value ...]

Write a trainer checkpoint ({{output_dir}}/checkpoints/trainer/step_N) as a Hugging Face model folder that
transformers and vLLM load: model.safetensors, config.json, the base model's tokenizer and generation files,
gyre_step.json (the step's record) and, for a LoRA run, the adapter merged into the weights plus lora/ (the
adapter alone, in PEFT's format). The folder appears complete or not at all; the run is not changed, and a
running trainer is no obstacle.

arguments:
  RUN_DIR          a `gyre rl` run's folder (its output_dir, e.g. outputs/demo): the trainer config saved in
                   RUN_DIR/configs/trainer.toml is read, so base model, dtype and LoRA are the run's own
  @ trainer.toml   instead of RUN_DIR: a trainer config (`@ file#table` as for `gyre trainer`), for a run
                   `gyre rl` did not launch
  --run NAME       a multi-run experiment's ([[runs]]) run to export: its checkpoint (RUN_DIR/runs/NAME) and its
                   own adapter, merged into the base model; required there (an error lists the names). RUN_DIR
                   may also be the run's own folder (outputs/multirun/runs/alpha), which names it
  --step N         the checkpoint to export (default: the newest one); a step with no checkpoint is refused
                   with the list of those there are (keep some with trainer.ckpt.interval)
  --to DIR         the folder to write (required); it must not exist: nothing is overwritten
  --key value      any of the trainer's config keys, after the run's own (e.g. --model.dtype bfloat16 to
                   export in another dtype); `gyre trainer --help` lists them
  -h, --help       this text

A published version ({{output_dir}}/weights/step_N) is such a folder already (a multi-run run's: the adapter
alone); a checkpoint is what a run keeps for good (trainer.ckpt.keep_interval) once those are pruned.
"""


def _fail(message: str) -> SystemExit:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return SystemExit(2)


def export_argv(argv: list[str]) -> list[str]:
    """argv for the trainer's export: `RUN_DIR rest...` becomes `@ RUN_DIR/configs/trainer.toml --output-dir RUN_DIR
    rest...` (the folder given is the run read, wherever it was launched from); `@ file ...` and options pass as is."""
    if not argv or argv[0] == "@" or argv[0].startswith("-"):
        return list(argv)
    run_dir, rest = Path(argv[0]), argv[1:]
    if not run_dir.is_dir():
        raise _fail(f"RUN_DIR {run_dir} is no folder (a `gyre rl` run's output_dir, e.g. outputs/demo)")
    config = run_dir / SAVED_CONFIG
    experiment = run_dir.parent.parent
    if not config.is_file() and run_dir.parent.name == "runs" and (experiment / SAVED_CONFIG).is_file():
        # a multi-run run's own folder ({output_dir}/runs/NAME, where its checkpoints are): the experiment's run NAME
        named = _option(rest, "--run")
        if named is not None and named != run_dir.name:
            raise _fail(f"--run {named}: {run_dir} is the folder of run {run_dir.name!r}; drop --run or name that run")
        if named is None:
            rest = [*rest, "--run", run_dir.name]
        run_dir, config = experiment, experiment / SAVED_CONFIG
    if not config.is_file():
        is_sft = (run_dir / "configs" / "sft.toml").is_file()
        sft = " (it holds an SFT run: its result is an HF folder already, its sft/)" if is_sft else ""
        raise _fail(f"{run_dir} has no {SAVED_CONFIG}, the trainer config `gyre rl` saves in a run's folder{sft}; "
                    "for another run pass its trainer config: gyre export @ trainer.toml --to DIR")  # fmt: skip
    return ["@", str(config), "--output-dir", str(run_dir), *_rebased_model(config, run_dir),
            *_runs_in(config, run_dir, _option(rest, "--run")), *rest]  # fmt: skip


def _option(argv: list[str], name: str) -> str | None:
    """The value of option `name` (`--run alpha` or `--run=alpha`) in argv, else None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def _runs_in(config: Path, run_dir: Path, run: str | None) -> list[str]:
    """`--runs` of a multi-run experiment's saved trainer config with each run's folder in `run_dir` (gyre rl's
    layout, {output_dir}/runs/NAME: the saved folders are where it was launched from, maybe relative to another
    directory or moved since); a clear error, listing the runs, when `--run` names none of them or is missing."""
    import json
    import tomllib

    runs = tomllib.loads(config.read_text()).get("runs") or []
    if not runs:
        if run is not None:
            raise _fail(f"--run {run}: {run_dir} is a single run (no [[runs]]); drop --run")
        return []
    names = [entry.get("name") for entry in runs]
    if run is None or run not in names:
        what = "is a multi-run experiment: name the run to export with --run" if run is None else "has no such run"
        example = f"{PROG} {run_dir} --run {names[0]} --to DIR"
        raise _fail(f"{'' if run is None else f'--run {run}: '}{run_dir} {what} ({', '.join(names)}), e.g. {example}")
    return ["--runs", json.dumps([{**entry, "output_dir": str(run_dir / "runs" / entry["name"])} for entry in runs])]


def _rebased_model(config: Path, run_dir: Path) -> list[str]:
    """`--model.name` when the run's model is a folder inside the run given by a path relative to where it was launched
    (`gyre rl` without model.name: outputs/demo/model, or outputs/demo/sft after the SFT warm-up), so an export from
    another directory loads the run's own base model, not a missing or other folder."""
    import tomllib

    saved = tomllib.loads(config.read_text())
    name, out = (saved.get("model") or {}).get("name"), saved.get("output_dir")
    if not name or not out or Path(name).is_absolute() or Path(out).is_absolute():
        return []
    try:
        inside = Path(name).relative_to(out)
    except ValueError:
        return []
    return [] if Path(out) == run_dir else ["--model.name", str(run_dir / inside)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:  # answered here: the trainer's help is its config's keys only
        print(HELP)
        return 0
    if not argv:
        print(HELP, file=sys.stderr)
        return 2
    # the trainer's module by name, as gyre.cli dispatches: libs/gyre never imports a service (nor torch) to start
    try:
        module = importlib.import_module("gyre_trainer.export")
    except ModuleNotFoundError as e:
        if e.name in ("gyre_trainer", "gyre_trainer.export"):
            raise _fail(f"needs the trainer service (gyre_trainer), which this installation lacks ({e})") from None
        raise
    return int(module.main(export_argv(argv)) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
