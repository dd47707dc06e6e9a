"""Export a trainer checkpoint as a Hugging Face model folder that transformers and vLLM load.

    python -m gyre_trainer.export @ {output_dir}/configs/trainer.toml --step 100 --to exported/step_100
    python -m gyre_trainer.export --model.name Qwen/Qwen3-0.6B --output-dir outputs/run --to exported

A published version (`weights/step_s`) is such a folder already; a checkpoint (`checkpoints/trainer/step_s`,
DCP shards with the optimizer state) is not, and it is what a run keeps for good (`ckpt.keep_interval`) once the
weights of that step are pruned (`weights_keep_last`). The export reads only the model's tensors of the
checkpoint onto the run's base model (`model.name`; with `trainer.lora`, the adapter onto the base, which is then
merged), in the dtype they were trained in, and writes `model.safetensors`, `config.json`, the base model's
tokenizer and generation files, `gyre_step.json` (the step's record) and, for a LoRA run, `lora/` (the adapter
in PEFT's format). The folder appears complete or not at all; the run's folder is not changed, and a running
trainer is no obstacle (checkpoints are immutable once committed).

Options besides the trainer's own config (the same `@ file#table` and `--key value` arguments as `gyre trainer`):
`--to DIR` (required; must not exist), `--step N` (default: the newest checkpoint) and, for a multi-run trainer
(`runs`, `runs_dir`), `--run NAME`: the run whose checkpoint (in its own output_dir) and adapter are exported.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger("gyre_trainer.export")


class ExportError(RuntimeError):
    """The checkpoint cannot be exported as asked (no such step, a target folder that exists, ...)."""


def parse(argv: list[str]) -> tuple[Any, int | None, Path, str | None]:
    from gyre.config import parse_or_exit
    from gyre.config.trainer import TrainerConfig

    # no abbreviations: `--run` must not take the trainer's own `--runs`
    own = argparse.ArgumentParser(prog="python -m gyre_trainer.export", add_help=False, allow_abbrev=False)
    own.add_argument("--to", type=Path)
    own.add_argument("--step", type=int)
    own.add_argument("--run")
    known, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    cfg = parse_or_exit(TrainerConfig, rest, "python -m gyre_trainer.export")
    if known.to is None:
        print("python -m gyre_trainer.export: error: --to DIR (the folder to write) is required", file=sys.stderr)
        raise SystemExit(2)
    return cfg, known.step, known.to, known.run


def training_dtype(configured: str, recorded: str | None, saved: set):
    """The dtype to export in: `model.dtype` when set (not `auto`), else the one the checkpoint records (progress.json
    `dtype`), else the model tensors' own when they agree (a checkpoint older than the record), else float32. A LoRA
    checkpoint holds float32 adapters (peft keeps them so for a bf16 base): their dtype alone gave a bf16 run's export
    in float32, twice the size of the weights it published."""
    import torch

    from gyre_trainer.model import resolve_dtype

    if configured != "auto":
        return resolve_dtype(configured, torch.device("cpu"))
    if recorded is not None:
        return resolve_dtype(recorded, torch.device("cpu"))
    return saved.copy().pop() if len(saved) == 1 else torch.float32


def chosen_run(cfg, run: str | None) -> tuple[Path, Any, str]:
    """(output_dir, lora config, peft adapter name) of the run to export: the trainer's own, or a multi-run trainer's
    run `run` (its folder, its adapter shape, its adapter's name, which its checkpoint's tensors carry)."""
    from gyre.config.loader import load_config
    from gyre.config.trainer import RunConfig

    if not (cfg.runs or cfg.runs_dir):
        if run is not None:
            raise ExportError(f"--run {run}: this trainer config has no runs (trainer.runs, runs_dir); drop --run")
        return Path(cfg.output_dir), cfg.lora, "default"
    specs = {spec.name: spec for spec in cfg.runs}
    if cfg.runs_dir is not None and Path(cfg.runs_dir).is_dir():  # runs added as files: {runs_dir}/<name>.toml
        import tomllib

        for file in sorted(Path(cfg.runs_dir).glob("*.toml")):
            data = tomllib.loads(file.read_text())
            specs.setdefault(file.stem, load_config(RunConfig, [], **{"name": file.stem, **data.get("run", data)}))
    names = ", ".join(specs) or "none"
    if run is None:
        raise ExportError(f"a multi-run trainer's runs have checkpoints of their own: name one with --run ({names})")
    if run not in specs:
        raise ExportError(f"--run {run}: no such run ({names})")
    spec = specs[run]
    return Path(spec.output_dir), spec.lora or cfg.lora, spec.name


def export_checkpoint(cfg, step: int | None, to: Path, run: str | None = None) -> Path:
    """Write checkpoint `step` (None: the newest) of the run `cfg` describes (of a multi-run trainer: of its run
    `run`) as an HF folder at `to`; returns it."""
    from gyre.fsio import commit_dir, write_file
    from torch.distributed.checkpoint import FileSystemReader

    from gyre_trainer.checkpoint import CheckpointManager, load_model_state, read_progress
    from gyre_trainer.dist import DistContext
    from gyre_trainer.model import load_model
    from gyre_trainer.publish import STEP_RECORD, write_hf_folder

    out, lora, adapter_name = chosen_run(cfg, run)
    to = Path(to)
    if to.exists():
        raise ExportError(f"--to {to} exists: export into a new folder (nothing is overwritten)")
    checkpoints = CheckpointManager(out / "checkpoints" / "trainer", DistContext())
    available = checkpoints.steps()
    if step is None:
        if not available:
            weights = out / "weights"
            raise ExportError(f"no checkpoint in {checkpoints.root} (set trainer.ckpt.interval to keep some; "
                              f"published versions in {weights} are HF folders already)")  # fmt: skip
        step = available[-1]
    elif step not in available:
        # a run without --ckpt keeps no checkpoint, but its recent versions are published as HF folders: say so
        # (`gyre export outputs/demo --step 120` on the demo read as a failed export, not as "copy weights/step_120")
        published = out / "weights" / f"step_{step}"
        also = (f"; {published} is that version published, a Hugging Face folder already: copy it"
                if (published / "config.json").is_file() else "")  # fmt: skip
        raise ExportError(f"--step {step}: no such checkpoint in {checkpoints.root} (have {available or 'none'}; "
                          f"keep some with trainer.ckpt.interval, `gyre rl --ckpt`){also}")  # fmt: skip
    folder = checkpoints.path(step)
    saved = FileSystemReader(str(folder / "state")).read_metadata().state_dict_metadata
    dtypes = {meta.properties.dtype for key, meta in saved.items()
              if key.startswith("model.") and hasattr(meta, "properties")}  # fmt: skip
    dtype = training_dtype(cfg.model.dtype, read_progress(folder, step).get("dtype"), dtypes)
    model = load_model(cfg.model, "cpu", dtype)
    hf_config = model.config
    if lora is not None:
        from gyre_trainer.lora import apply_lora

        model = apply_lora(model, lora, adapter_name=adapter_name)
    progress = load_model_state(folder, step, model)
    state = {name: value.detach() for name, value in model.state_dict().items()}
    adapter = None
    if lora is not None:
        from gyre_trainer.lora import adapter_state_dict, merged_state_dict

        adapter, state = adapter_state_dict(state), merged_state_dict(state, lora)
    tmp = to.parent / f".tmp-{to.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        write_hf_folder(tmp, state, hf_config, cfg.model.name)
        write_file(tmp / STEP_RECORD, json.dumps(progress.get("record") or {"step": step}, sort_keys=True).encode())
        if adapter is not None:
            from gyre_trainer.lora import write_adapter_folder

            write_adapter_folder(tmp / "lora", adapter, lora, str(cfg.model.name))
        commit_dir(tmp, to)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported checkpoint step %d (%s) to %s", step, folder, to)
    return to


def main(argv: list[str] | None = None) -> int:
    from gyre.logging import setup_logging

    cfg, step, to, run = parse(sys.argv[1:] if argv is None else list(argv))
    setup_logging(cfg.log.level, None, "export", cfg.log.format, cfg.run_id)
    from gyre_trainer.checkpoint import CheckpointError

    try:
        export_checkpoint(cfg, step, to, run)
    except (ExportError, CheckpointError, ValueError) as e:  # a wrong step, folder, model or adapter: one line
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
