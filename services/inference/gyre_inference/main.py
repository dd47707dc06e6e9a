"""`gyre inference`: serve one policy model over the OpenAI API with gRPC weight control.

    gyre inference --model.name outputs/run/model --server.port 8000 --control.port 50051
    gyre inference @ exp.toml#inference            # the [inference] table of an experiment file
    gyre inference --help                          # every option with its default

Prints `ready: http://HOST:PORT control: HOST:PORT version: N` once the model is loaded; exits 0
after a graceful SIGTERM, 1 when the model cannot be loaded, a port cannot be bound or the engine stopped on its own
(a weights load failed part way with no weights to go back to: the replica must be restarted), 2 on a bad
config key or value (a `model.name` folder that does not exist or holds no config.json or weights).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gyre.config import parse_or_exit
from gyre.config.inference import InferenceConfig
from gyre.logging import setup_logging


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_or_exit(InferenceConfig, None if argv is None else list(argv), "gyre inference")
    from gyre.model_source import check_service_model

    if (code := check_service_model(config.model.name, "gyre inference", config=config)) is not None:
        return code  # before any port is bound or torch is imported
    setup_logging(config.log.level, config.log.file, "inference", config.log.format, config.run_id)
    from gyre_inference.service import run_service  # torch and friends load only past argument parsing

    return asyncio.run(run_service(config))


if __name__ == "__main__":
    raise SystemExit(main())
