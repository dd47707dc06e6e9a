"""A step whose gradients go wrong is kept (`debug/step_N`) and `gyre replay` reproduces it exactly.

A real trainer process trains batches from Redis; batch 5's advantages are 1000x the others' (a
gradient-norm spike) and batch 6's 3e38x (its float32 gradient overflows: a non-finite norm). The
trainer keeps both steps with the parameters that produced their gradients, skips the non-finite
update, and goes on; `gyre replay` on the CPU, in the step's dtype and thread count, gives the
recorded loss and gradient norm bit for bit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from gyre.codec import encode_batch
from gyre.events import TRAINER_STEPS, read_events
from gyre.streams import BatchStream
from trainer_testlib import (
    REPO,
    child_env,
    kill_group,
    load_weights,
    make_batch,
    run_in_process,
    start_trainer,
    trainer_args,
)

pytestmark = pytest.mark.slow
STEPS = 6
SPIKE, NON_FINITE = 5, 6


def scaled(step: int, factor: float):
    batch = make_batch(step)
    for rank in batch.micro_batches:
        for mb in rank:
            mb.advantages = (np.asarray(mb.advantages) * factor).astype(np.float32)
    return batch


def replay(step_dir, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre.cli", "replay", "--step-dir", str(step_dir), *extra],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env())  # fmt: skip


@pytest.fixture(scope="module")
def run(tiny_model, redis_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("debug-run") / "run"
    run_id = "debug-replay"
    stream = BatchStream(redis_url, run_id)
    stream.redis.delete(stream.key)
    for step in range(1, STEPS + 1):
        factor = {SPIKE: 1000.0, NON_FINITE: 3e38}.get(step, 1.0)  # finite advantages (the intake rejects inf)
        stream.push(step, encode_batch(scaled(step, factor)))
    argv = trainer_args(tiny_model, out, redis_url, run_id, STEPS, **{"weights-keep-last": 6})
    proc = start_trainer(argv, out.parent / "trainer.log")
    try:
        assert proc.wait(timeout=240) == 0, (out.parent / "trainer.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_group(proc)
        stream.redis.close()
    return out


def test_bad_steps_are_kept_with_the_parameters_that_produced_their_gradients(run):
    kept = sorted(p.name for p in (run / "debug").iterdir())
    assert kept == [f"step_{SPIKE}", f"step_{NON_FINITE}"]  # steps 1-4 were healthy
    records = {r["step"]: r for r in read_events(run / "events" / TRAINER_STEPS)}
    assert sorted(records) == list(range(1, STEPS + 1))  # the run went on
    spike = json.loads((run / "debug" / f"step_{SPIKE}" / "step.json").read_text())
    assert "median" in spike["reason"] and spike["grad_norm"] == records[SPIKE]["grad_norm"]
    assert spike["loss"] == records[SPIKE]["loss"]
    assert (spike["world_size"], spike["dtype"], spike["torch_threads"]) == (1, "float32", 1)
    # before the update: step 5's parameters are those step 4 published
    before = load_weights(run / "debug" / f"step_{SPIKE}")
    published = load_weights(run / "weights" / f"step_{SPIKE - 1}")
    assert before.keys() <= published.keys()
    assert all(torch.equal(before[k], published[k]) for k in before)
    bad = json.loads((run / "debug" / f"step_{NON_FINITE}" / "step.json").read_text())
    assert bad["reason"].startswith("non-finite gradient norm") and not math.isfinite(bad["grad_norm"])
    assert records[NON_FINITE]["skipped"] == 1.0  # the non-finite update was not applied


@pytest.mark.parametrize("step", [SPIKE, NON_FINITE])
def test_replay_reproduces_the_loss_and_gradient_norm_exactly(run, step):
    done = replay(run / "debug" / f"step_{step}", "--strict")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()[2:] if line.strip()}
    assert lines["loss"].rstrip().endswith("exact") and lines["grad_norm"].rstrip().endswith("exact"), done.stdout


def test_replay_says_what_is_missing(tmp_path):
    done = replay(tmp_path)
    assert done.returncode == 2 and "is not a kept step" in done.stderr


@pytest.mark.usefixtures("isolated_torch_state")  # the trainer runs in this process
def test_a_multi_run_runs_spike_is_kept_in_its_own_folder_and_replays_exactly(tiny_model, redis_url, unique_run_id,
                                                                               tmp_path):  # fmt: skip
    """Multi-run: the spiking run's adapter (a named adapter of the shared base) is kept in the run's folder;
    replay puts it on the base as the model's one adapter and reproduces the step."""
    from gyre.config import load_config
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer import dist
    from gyre_trainer.multirun import MultiRunTrainer

    name = f"{unique_run_id}-a"
    cfg = load_config(TrainerConfig, [], **{
        "model": {"name": str(tiny_model)}, "redis": {"url": redis_url}, "device": "cpu", "deterministic": True,
        "metrics": {"port": 0}, "server": {"port": 0}, "optim": {"lr": 1e-2},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "runs": [{"name": name, "output_dir": str(tmp_path / "a"),
                  "orchestrator": {"address": "127.0.0.1:9", "timeout_s": 0.5}}],
    })  # fmt: skip
    stream = BatchStream(redis_url, name)
    for step in range(1, SPIKE + 1):
        stream.push(step, encode_batch(scaled(step, 1000.0 if step == SPIKE else 1.0)))
    trainer = MultiRunTrainer(cfg, dist.init_distributed("cpu"))
    trainer._build()
    try:
        (run,) = [trainer.add_run(cfg.runs[0])]
        for _ in range(SPIKE):
            run.commit(run.intake.next(lambda: False, wait=False))
    finally:
        trainer._close()
        stream.redis.close()
    kept = tmp_path / "a" / "debug" / f"step_{SPIKE}"
    assert json.loads((kept / "step.json").read_text())["adapter"] == name
    assert run.metrics.grad_norm_spikes._value.get() == 1
    done = replay(kept, "--strict")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.usefixtures("isolated_torch_state")  # the trainer runs in this process
def test_a_spike_right_after_a_resume_is_caught(tiny_model, redis_url, unique_run_id, tmp_path):
    """The spike detector's window is checkpointed: a run stopped after step 4 (checkpointed) and restarted judges
    step 5 against steps 1-4. Without it the restarted detector began empty, and no spike counted in the first
    3 steps after every resume (a pod restart)."""
    stream = BatchStream(redis_url, unique_run_id)
    for step in range(1, SPIKE + 1):
        stream.push(step, encode_batch(scaled(step, 1000.0 if step == SPIKE else 1.0)))
    stream.redis.close()
    out = tmp_path / "run"
    opts = {"ckpt.interval": 4}
    assert run_in_process(trainer_args(tiny_model, out, redis_url, unique_run_id, SPIKE - 1, **opts)) == 0
    progress = json.loads((out / "checkpoints" / "trainer" / f"step_{SPIKE - 1}" / "progress.json").read_text())
    norms = [r["grad_norm"] for r in read_events(out / "events" / TRAINER_STEPS)]
    assert progress["grad_norm_history"] == norms and len(norms) == SPIKE - 1
    assert run_in_process(trainer_args(tiny_model, out, redis_url, unique_run_id, SPIKE, **opts)) == 0
    spike = json.loads((out / "debug" / f"step_{SPIKE}" / "step.json").read_text())
    assert f"of the previous {SPIKE - 1} steps" in spike["reason"]


@pytest.mark.usefixtures("isolated_torch_state")
def test_a_checkpoint_without_the_window_still_resumes(tiny_model, redis_url, unique_run_id, tmp_path):
    """A checkpoint written before the window was kept (no `grad_norm_history`) loads: the detector starts empty."""
    stream = BatchStream(redis_url, unique_run_id)
    for step in (1, 2):
        stream.push(step, encode_batch(scaled(step, 1.0)))
    stream.redis.close()
    out = tmp_path / "run"
    assert run_in_process(trainer_args(tiny_model, out, redis_url, unique_run_id, 1, **{"ckpt.interval": 1})) == 0
    progress_file = out / "checkpoints" / "trainer" / "step_1" / "progress.json"
    progress = json.loads(progress_file.read_text())
    del progress["grad_norm_history"]
    progress_file.write_text(json.dumps(progress))
    assert run_in_process(trainer_args(tiny_model, out, redis_url, unique_run_id, 2, **{"ckpt.interval": 1})) == 0
    assert [r["step"] for r in read_events(out / "events" / TRAINER_STEPS)] == [1, 2]
