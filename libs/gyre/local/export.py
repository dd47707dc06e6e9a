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

HELP = f"""usage: {PROG} RUN_DIR [--step N] --to DIR [--key value ...]
       {PROG} @ trainer.toml [--step N] --to DIR [--key value ...]

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
  --step N         the checkpoint to export (default: the newest one); a step with no checkpoint is refused
                   with the list of those there are (keep some with trainer.ckpt.interval)
  --to DIR         the folder to write (required); it must not exist: nothing is overwritten
  --key value      any of the trainer's config keys, after the run's own (e.g. --model.dtype bfloat16 to
                   export in another dtype); `gyre trainer --help` lists them
  -h, --help       this text

A published version ({{output_dir}}/weights/step_N) is such a folder already; a checkpoint is what a run keeps
for good (trainer.ckpt.keep_interval) once those are pruned. A multi-run experiment's runs ([[runs]]) are not
exported by this command (their adapters share one trainer).
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
    if not config.is_file():
        is_sft = (run_dir / "configs" / "sft.toml").is_file()
        sft = " (it holds an SFT run: its result is an HF folder already, its sft/)" if is_sft else ""
        raise _fail(f"{run_dir} has no {SAVED_CONFIG}, the trainer config `gyre rl` saves in a run's folder{sft}; "
                    "for another run pass its trainer config: gyre export @ trainer.toml --to DIR")  # fmt: skip
    return ["@", str(config), "--output-dir", str(run_dir), *_rebased_model(config, run_dir), *rest]


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
