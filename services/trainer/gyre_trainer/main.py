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
    from gyre_trainer.torchrun import follow_launcher, report_exit

    follow_launcher()  # under `python -m gyre_trainer.torchrun`: dies with it, even SIGKILLed (own session)
    code = _main(argv)

    report_exit(code)  # under `python -m gyre_trainer.torchrun`: a clean stop on SIGTERM exits 0, not torchrun's 1
    return code


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


if __name__ == "__main__":
    raise SystemExit(main())
