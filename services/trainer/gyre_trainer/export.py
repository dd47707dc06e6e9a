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
`--to DIR` (required; must not exist) and `--step N` (default: the newest checkpoint).
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


def parse(argv: list[str]) -> tuple[Any, int | None, Path]:
    from gyre.config import parse_or_exit
    from gyre.config.trainer import TrainerConfig

    own = argparse.ArgumentParser(prog="python -m gyre_trainer.export", add_help=False)
    own.add_argument("--to", type=Path)
    own.add_argument("--step", type=int)
    known, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    cfg = parse_or_exit(TrainerConfig, rest, "python -m gyre_trainer.export")
    if known.to is None:
        print("python -m gyre_trainer.export: error: --to DIR (the folder to write) is required", file=sys.stderr)
        raise SystemExit(2)
    return cfg, known.step, known.to


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


def export_checkpoint(cfg, step: int | None, to: Path) -> Path:
    """Write checkpoint `step` (None: the newest) of the run `cfg` describes as an HF folder at `to`; returns it."""
    from gyre.fsio import commit_dir, write_file
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    from gyre_trainer.checkpoint import CheckpointManager, load_model_state, read_progress
    from gyre_trainer.dist import DistContext
    from gyre_trainer.model import load_model
    from gyre_trainer.publish import STEP_RECORD, write_hf_folder

    if cfg.runs or cfg.runs_dir:
        raise ExportError("a multi-run trainer's runs have checkpoints of their own: export one with its own "
                          "output_dir and trainer.lora (the run's folder), not trainer.runs")  # fmt: skip
    to = Path(to)
    if to.exists():
        raise ExportError(f"--to {to} exists: export into a new folder (nothing is overwritten)")
    checkpoints = CheckpointManager(Path(cfg.output_dir) / "checkpoints" / "trainer", DistContext())
    available = checkpoints.steps()
    if step is None:
        if not available:
            weights = Path(cfg.output_dir) / "weights"
            raise ExportError(f"no checkpoint in {checkpoints.root} (set trainer.ckpt.interval to keep some; "
                              f"published versions in {weights} are HF folders already)")  # fmt: skip
        step = available[-1]
    elif step not in available:
        # a run without --ckpt keeps no checkpoint, but its recent versions are published as HF folders: say so
        # (`gyre export outputs/demo --step 120` on the demo read as a failed export, not as "copy weights/step_120")
        published = Path(cfg.output_dir) / "weights" / f"step_{step}"
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
    if cfg.lora is not None:
        from gyre_trainer.lora import apply_lora

        model = apply_lora(model, cfg.lora)
    progress = load_model_state(folder, step, model)
    state = {name: value.detach() for name, value in model.state_dict().items()}
    adapter = None
    if cfg.lora is not None:
        from gyre_trainer.lora import adapter_state_dict, merged_state_dict

        adapter, state = adapter_state_dict(state), merged_state_dict(state, cfg.lora)
    tmp = to.parent / f".tmp-{to.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        write_hf_folder(tmp, state, hf_config, cfg.model.name)
        write_file(tmp / STEP_RECORD, json.dumps(progress.get("record") or {"step": step}, sort_keys=True).encode())
        if adapter is not None:
            from gyre_trainer.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config

            (tmp / "lora").mkdir()
            save_file(adapter, tmp / "lora" / ADAPTER_FILE, metadata={"format": "pt"})
            config = adapter_config(cfg.lora, str(cfg.model.name))
            write_file(tmp / "lora" / ADAPTER_CONFIG, json.dumps(config, indent=1, sort_keys=True).encode())
        commit_dir(tmp, to)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported checkpoint step %d (%s) to %s", step, folder, to)
    return to


def main(argv: list[str] | None = None) -> int:
    from gyre.logging import setup_logging

    cfg, step, to = parse(sys.argv[1:] if argv is None else list(argv))
    setup_logging(cfg.log.level, None, "export", cfg.log.format, cfg.run_id)
    from gyre_trainer.checkpoint import CheckpointError

    try:
        export_checkpoint(cfg, step, to)
    except (ExportError, CheckpointError, ValueError) as e:  # a wrong step, folder, model or adapter: one line
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
