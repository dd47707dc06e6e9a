"""`gyre trainer`: train on batches from Redis, publish weights, notify the orchestrator.

gyre trainer @ exp.toml#trainer                      # one process
torchrun --nproc-per-node 2 -m gyre_trainer.main @ exp.toml#trainer   # FSDP2 (gloo on CPU)
python -m gyre_trainer.torchrun --nproc-per-node 2 -m gyre_trainer.main @ exp.toml#trainer  # same; SIGTERM exits 0
gyre trainer @ exp.toml#trainer --bench              # tokens/s and MFU on fake data, then exit
"""

from __future__ import annotations

import logging
import os
import sys

from gyre.config import parse_or_exit
from gyre.config.trainer import TrainerConfig
from gyre.logging import setup_logging


def main(argv: list[str] | None = None) -> int:
    from gyre_trainer.torchrun import run_worker

    return run_worker(_main, argv)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_or_exit(TrainerConfig, argv, "gyre trainer")
    if cfg.bench:  # the trainer's own model, shapes, loss and optimiser on fake packed batches
        from gyre_trainer.bench import bench_from_config

        bench_from_config(cfg)
        return 0
    from gyre.model_source import check_service_model

    if (code := check_service_model(cfg.model.name, "gyre trainer", config=cfg)) is not None:
        return code
    if (problem := _lora_targets_problem(cfg)) is not None:  # a traceback once the model had loaded (a pod's loop)
        from gyre.config.command_line import print_startup_error

        print_startup_error("gyre trainer", problem, config=cfg)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    service = "trainer" if rank == 0 else f"trainer-rank{rank}"
    setup_logging(cfg.log.level, cfg.log.file, service, cfg.log.format, cfg.run_id)
    from gyre.net import PortInUse
    from gyre.runlock import LockHeld
    from gyre.streams import RunIdTaken
    from gyre.wandb_log import WandbUnavailable

    from gyre_trainer.service import run  # torch is imported only now, after the config is known to be valid

    try:
        return run(cfg)
    except (LockHeld, PortInUse, RunIdTaken, WandbUnavailable) as e:  # a user mistake, not a crash: one line, exit 2
        logging.getLogger("gyre_trainer").error("%s", e)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (gyre_trainer.stopping)
        print("gyre trainer: interrupted at once; the same command resumes after the newest committed step "
              "(checkpoint or published weights) and trains the step it cut short again", file=sys.stderr)  # fmt: skip
        return 130
    except Exception:
        logging.getLogger("gyre_trainer").exception("trainer failed")
        return 1


def _lora_targets_problem(cfg: TrainerConfig) -> str | None:
    """The first LoRA target_modules entry (the trainer's, a run's) that names no layer of the model, on its skeleton
    (`gyre.lora.lora_targets_problem`)."""
    from gyre.lora import lora_targets_problem

    wanted = [("lora.target_modules", cfg.lora)] + [(f"runs.{i}.lora.target_modules", run.lora)
                                                     for i, run in enumerate(cfg.runs)]  # fmt: skip
    return lora_targets_problem(cfg.model.name, [(key, lora.target_modules) for key, lora in wanted if lora])


if __name__ == "__main__":
    raise SystemExit(main())
