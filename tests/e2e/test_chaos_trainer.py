"""The services run as pods do (each its own process, started from the files `gyre rl` wrote), and the trainer is
SIGKILLed at named points of its step (`GYRE_TRAINER_CRASH_AT`) and started again alone, as its pod would be, while
the orchestrator, an inference replica and Redis keep running: inside the optimizer step, while writing a checkpoint,
between the checkpoint and the weights, and after the ack before the notification. The run must finish with every
step trained once, in order, every version published and intact, the orchestrator's pushes and the trainer's steps
one to one, and the half-written checkpoint named and never loaded.

(`test_rl_crash_rerun.py` kills the whole `gyre rl` tree; under `gyre rl` a dead trainer stops the run. The same
windows against a trainer alone, compared bit for bit with an uninterrupted run:
`tests/integration/trainer/test_trainer_exactly_once.py`.)
"""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w
from gyre.events import latest_per_step, read_events
from gyre.redis_server import EmbeddedRedis
from gyre.weights import WeightStore
from test_chaos_orchestrator import Services, set_max_steps

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "configs/ci.toml"
pytestmark = pytest.mark.slow
CRASHES = ["mid_step:2", "mid_checkpoint:3", "after_checkpoint:4", "after_ack:5"]


def trained(out: Path) -> list[int]:
    return [r["step"] for r in read_events(out / "events" / "trainer_steps.jsonl")]


def test_a_trainer_killed_in_each_window_and_restarted_alone_trains_every_step_once(tmp_path, monkeypatch):
    out, n = tmp_path / "run", 6
    # a one-step run writes each service's config (free ports, the run's Redis with its AOF) and the tiny model
    first = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--max-steps", "1",
         "--trainer.ckpt.interval", "1"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    for name in ("trainer", "orchestrator"):
        set_max_steps(out / "configs" / f"{name}.toml", n)
    trainer_cfg = tomllib.loads((out / "configs" / "trainer.toml").read_text())
    assert trainer_cfg["ckpt"]["interval"] == 1
    trainer_cfg.get("ckpt", {}).pop("resume_step", None)  # a pod restarts with its arguments: a plain resume
    (out / "configs" / "trainer.toml").write_text(tomli_w.dumps(trainer_cfg))
    redis_url = tomllib.loads((out / "configs" / "orchestrator.toml").read_text())["redis"]["url"]
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    redis = EmbeddedRedis(port=port, data_dir=out / "redis").start()  # the run's Redis again, step 1 in its AOF
    services = Services(out)
    try:
        services.start("inference")  # one replica: its config is configs/inference.toml
        services.start("orchestrator")
        deadline = time.monotonic() + 300
        for point in [*CRASHES, None]:
            if point is None:
                monkeypatch.delenv("GYRE_TRAINER_CRASH_AT", raising=False)
            else:
                monkeypatch.setenv("GYRE_TRAINER_CRASH_AT", point)
            trainer = services.start("trainer")  # the pod (re)started
            while trainer.poll() is None:
                assert services.procs["orchestrator"].poll() in (None, 0), services.log("orchestrator")
                assert services.procs["inference"].poll() is None, services.log("inference")
                assert time.monotonic() < deadline, f"the run did not finish ({point})"
                time.sleep(0.1)
            assert trainer.returncode == (-9 if point else 0), f"{point}: {services.log('trainer')}"
        assert services.procs["orchestrator"].wait(120) == 0, services.log("orchestrator")

        assert trained(out) == list(range(1, n + 1))  # each step once, in order, across 5 restarts
        store = WeightStore(out / "weights")
        assert store.steps() == list(range(1, n + 1))  # ci.toml keeps every version
        for step in store.steps():
            store.verify(step)
        pushed = latest_per_step(read_events(out / "events" / "orchestrator_steps.jsonl"))
        assert [p["step"] for p in pushed] == list(range(1, n + 1))
        log = (out / "logs" / "trainer.log").read_text()
        partial = out / "checkpoints" / "trainer" / ".tmp-step_3"
        assert f"ignoring {partial}: a save cut short by a crash before its commit, never loaded; resuming from " \
               "checkpoint step 2" in log  # fmt: skip
        assert "loaded checkpoint step 4 " in log  # after_checkpoint:4: weights 4 published from checkpoint 4
    finally:
        services.stop()
        redis.stop()
