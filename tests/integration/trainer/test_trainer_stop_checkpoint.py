"""A graceful stop checkpoints the last trained step (`ckpt.on_stop`), once, for a single run and for each multi-run
run; the SIGTERM of a real trainer process and its exact resume: test_trainer_exactly_once.py."""

from __future__ import annotations

import logging
import threading

import pytest
from gyre.config import load_config
from gyre.config.trainer import TrainerConfig
from gyre.streams import BatchStream
from trainer_testlib import push_batches, trained_steps, trainer_args, wait_for_steps

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]


def stopped_after(trainer, out, steps: int) -> None:
    """Run `trainer` in this process and request its stop (what SIGTERM does) once `steps` steps are logged."""

    def stop() -> None:
        wait_for_steps(out, steps, timeout=120)
        trainer.stop_requested.set()

    threading.Thread(target=stop, daemon=True).start()
    assert trainer.run() == 0


def checkpoints(out) -> list[str]:
    folder = out / "checkpoints/trainer"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize(
    ("opts", "expected", "said"),
    [
        ({"ckpt.interval": 3}, ["step_2"], "stopping: checkpointing step 2 first (ckpt.on_stop)"),
        # step 2 had its interval checkpoint: not saved twice
        ({"ckpt.interval": 2}, ["step_2"], "stopping: step 2 has its checkpoint already"),
        ({"ckpt.on-stop": "false"}, [], "stopping without a checkpoint of step 2 (ckpt.on_stop = false)"),
    ],
)
def test_a_stop_checkpoints_the_last_step_once_unless_turned_off(
    tiny_model, redis_url, unique_run_id, tmp_path, caplog, opts, expected, said
):
    from gyre_trainer import dist
    from gyre_trainer.service import Trainer

    push_batches(BatchStream(redis_url, unique_run_id), (1, 2))  # then it waits for batch 3 and is stopped there
    cfg = load_config(TrainerConfig, trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, 6, **opts))
    with caplog.at_level(logging.INFO, logger="gyre_trainer"):
        stopped_after(Trainer(cfg, dist.init_distributed("cpu")), tmp_path, 2)
    assert trained_steps(tmp_path) == [1, 2]
    assert checkpoints(tmp_path) == expected
    saves = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved checkpoint step 2")]
    assert len(saves) == len(expected)
    assert said in caplog.text


def test_a_stop_right_after_a_resume_saves_nothing(tiny_model, redis_url, unique_run_id, tmp_path):
    """Nothing trained since the resume: the run's folder already reconstructs that state, a save would only copy it
    (or, from published weights with fresh moments, pass an inexact state off as an exact checkpoint)."""
    from gyre_trainer import dist
    from gyre_trainer.service import Trainer

    push_batches(BatchStream(redis_url, unique_run_id), (1, 2))
    argv = trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, 6, **{"ckpt.on-stop": "false"})
    stopped_after(Trainer(load_config(TrainerConfig, argv), dist.init_distributed("cpu")), tmp_path, 2)
    argv = trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, 6)
    stopped_after(Trainer(load_config(TrainerConfig, argv), dist.init_distributed("cpu")), tmp_path, 2)
    assert checkpoints(tmp_path) == []


def test_each_multirun_run_is_checkpointed_on_stop_and_a_removed_runs_file_too(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    from gyre_trainer import dist
    from gyre_trainer.multirun import MultiRunTrainer

    a, b = f"{unique_run_id}-a", f"{unique_run_id}-b"
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    push_batches(BatchStream(redis_url, a), (1, 2), seed=1)
    push_batches(BatchStream(redis_url, b), (1,), seed=2)
    (runs_dir / f"{b}.toml").write_text(f'output_dir = "{tmp_path / "b"}"\n[orchestrator]\naddress = "127.0.0.1:9"\n')
    values = {
        "model": {"name": str(tiny_model)}, "redis": {"url": redis_url}, "device": "cpu", "deterministic": True,
        "metrics": {"port": 0}, "server": {"port": 0}, "optim": {"lr": 1e-2},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "runs_dir": str(runs_dir),
        "runs": [{"name": a, "output_dir": str(tmp_path / "a"), "orchestrator": {"address": "127.0.0.1:9"}}],
    }  # fmt: skip
    trainer = MultiRunTrainer(load_config(TrainerConfig, [], **values), dist.init_distributed("cpu"))

    def remove_b_then_stop() -> None:
        wait_for_steps(tmp_path / "b", 1, timeout=120)
        (runs_dir / f"{b}.toml").unlink()  # run b stops: released at the next scan, checkpointed first
        wait_for_steps(tmp_path / "a", 2, timeout=120)
        deadline = 60
        while b in trainer.runs and deadline > 0:
            threading.Event().wait(0.1)
            deadline -= 0.1
        trainer.stop_requested.set()

    threading.Thread(target=remove_b_then_stop, daemon=True).start()
    assert trainer.run() == 0
    assert trained_steps(tmp_path / "a") == [1, 2] and trained_steps(tmp_path / "b") == [1]
    assert checkpoints(tmp_path / "a") == ["step_2"] and checkpoints(tmp_path / "b") == ["step_1"]


def test_a_stop_while_waiting_for_the_next_batch_does_not_promise_a_step(
    tiny_model, redis_url, unique_run_id, tmp_path, caplog
):
    """Most of an async run, the trainer waits for its next batch: a SIGTERM there said "stopping after the current
    step" with no step to finish. The real handler (`StopSignals`, as `gyre trainer` installs it) gets a real signal."""
    import os
    import signal
    import time

    from gyre_trainer import dist
    from gyre_trainer.service import Trainer
    from gyre_trainer.stopping import StopSignals

    push_batches(BatchStream(redis_url, unique_run_id), (1,))  # then it waits for batch 2
    cfg = load_config(TrainerConfig, trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, 6))
    trainer = Trainer(cfg, dist.init_distributed("cpu"))
    signals = StopSignals(trainer.stop_requested, logging.getLogger("gyre_trainer"), None, trainer.step_running.is_set)

    def sigterm_while_waiting() -> None:
        wait_for_steps(tmp_path, 1, timeout=120)
        while trainer.step_running.is_set():  # step 1's commit ends (ack, prune) just after its record is logged
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=sigterm_while_waiting, daemon=True).start()
    signals.install()
    try:
        with caplog.at_level(logging.INFO, logger="gyre_trainer"):
            assert trainer.run() == 0
    finally:
        signals.restore()
    assert trained_steps(tmp_path) == [1]
    assert "SIGTERM: stopping before the next step (none is running)" in caplog.text
    assert "after the current step" not in caplog.text
