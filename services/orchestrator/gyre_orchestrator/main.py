"""`gyre orchestrator @ exp.toml#orchestrator [--key value ...]`: run the orchestrator until max_steps.

Exit status: 0 when done and after a clean stop on SIGTERM/SIGINT (the batch being pushed completes, progress is
saved), 2 for a bad config or environment, 1 when the run fails, 143 when a second signal stopped it at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from gyre.config import parse_or_exit
from gyre.config.orchestrator import OrchestratorConfig
from gyre.logging import setup_logging

log = logging.getLogger("gyre_orchestrator")
# dead letters of one batch before giving up: a batch generated again and rejected again has a cause that
# generating cannot cure (e.g. trainer and orchestrator disagree on the batch shape); each try keeps a payload
MAX_REJECTIONS = 3


async def serve(cfg: OrchestratorConfig) -> int:
    from gyre.endpoint import EndpointError
    from gyre.net import PortInUse
    from gyre.runlock import LockHeld, RunLock
    from gyre.streams import RunIdTaken

    from gyre_orchestrator.client import SetupRefused
    from gyre_orchestrator.relay import WeightsRefused
    from gyre_orchestrator.service import OrchestratorService  # imported after logging is set up
    from gyre_orchestrator.stream_guard import StreamLost

    try:
        service = OrchestratorService(cfg)
    except ValueError as e:  # unknown environment, bad env args, inconsistent settings
        log.error("%s", e)
        return 2
    try:
        # one orchestrator per run folder; its requested rewind, for a trainer rewinding beside it to check
        lock = RunLock(cfg.output_dir, "orchestrator").acquire(info={"resume_step": cfg.resume_step})
    except LockHeld as e:
        log.error("%s", e)
        return 2
    signals: list[str] = []  # received, in order

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig.name)
        service.stop(sig.name)  # the current service: a StreamLost restart replaces it

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, on_signal, sig)
    try:
        rejections: dict[int, int] = {}  # step -> times the trainer dead-lettered its batch
        while True:
            if signals:  # it came while the last one closed: the new one stops before it starts
                service.stop(signals[-1])
            run = asyncio.create_task(service.run())
            try:
                return await run
            except StreamLost as e:  # start over in this process: the resume rule regenerates the lost batches
                if e.rejected is not None:
                    rejections[e.step] = rejections.get(e.step, 0) + 1
                    if rejections[e.step] >= MAX_REJECTIONS:
                        log.error(
                            "the trainer rejected batch %d %d times (last reason: %s); not generating it again: "
                            "fix the cause, then restart",
                            e.step,
                            rejections[e.step],
                            e.rejected,
                        )
                        return 1
                log.warning("%s", e)
                service = OrchestratorService(cfg)  # a rewind is done once: pending_rewind says it was
    except asyncio.CancelledError:
        # exit 0 like the trainer and inference after a clean stop (a pod's or the docker smoke's SIGTERM); the
        # shell's 128 + 15 says it was cut short: a second signal, or a push that outlasted the stop's grace
        clean = len(signals) == 1 and not service.stop_cut_short
        log.info("stopped by signal (%s)%s", ", ".join(signals) or "cancelled", "" if clean else ", at once")
        return 0 if clean else 143
    except (PortInUse, RunIdTaken) as e:  # RunIdTaken: another experiment's run id on a shared Redis
        log.error("%s", e)
        return 2
    except (EndpointError, SetupRefused, WeightsRefused) as e:  # a judge, reward model, teacher or the policy's
        # server that never came up, or refused the key or the model (or a version of it): one line naming the
        # setting, no traceback
        log.error("%s", e)
        return 1
    except Exception:
        log.exception("orchestrator failed")
        return 1
    finally:
        lock.release()


def main(argv: list[str]) -> int:
    cfg = parse_or_exit(OrchestratorConfig, argv, "gyre orchestrator", OrchestratorConfig.__doc__ or "")
    setup_logging(cfg.log.level, cfg.log.file, "orchestrator", cfg.log.format, cfg.run_id)
    if cfg.log.level != "DEBUG":  # the openai client's HTTP stack logs a line per request at INFO
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    return asyncio.run(serve(cfg))
