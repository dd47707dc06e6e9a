"""`gyre sft` stopped by SIGTERM (Kubernetes, `gyre rl`) or SIGINT, as one process and under torchrun: it finishes the
step in flight, checkpoints it (`ckpt.on_stop`), exits 0, and the same command resumes after it, every step trained
once; the single-process resume ends with exactly the weights of a straight run."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch
from gyre.config import load_config
from gyre.config.trainer import SFTConfig
from gyre.events import read_events
from gyre_trainer import sft
from gyre_trainer.sft_checks import RESULT_MARKER
from trainer_testlib import PYTHON, REPO, child_env, kill_group, load_weights

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]

STEPS = 60  # more than the steps trained before the signal lands, by far


def sft_args(model, out, **extra) -> list[str]:
    opts = {
        "model.name": model, "output-dir": out, "device": "cpu", "deterministic": "true", "data.fake": "true",
        "data.num-examples": 120, "data.seq-len": 64, "data.batch-size": 4, "data.micro-batch-size": 2,
        "optim.warmup-steps": 5, "max-steps": STEPS, **extra,
    }  # fmt: skip
    return [x for key, value in opts.items() for x in (f"--{key}", str(value))]


def steps_of(out) -> list[int]:
    path = out / "events" / sft.SFT_STEPS
    return [r["step"] for r in read_events(path)] if path.exists() else []


def stopped(cmd: list[str], out, log_path, sig: int) -> tuple[int, int]:
    """Start `cmd`, send `sig` to it once 2 steps are logged (to the process alone: what the kubelet does to a
    container's first process; torchrun forwards it to its workers); (exit status, steps logged)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(steps_of(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        proc.send_signal(sig)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    return code, len(steps_of(out))


def checkpoints(out) -> list[str]:
    folder = out / "checkpoints" / "sft"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_sft_checkpoints_its_last_step_and_resumes_it_exactly(tiny_model, tmp_path, sig):
    straight, out = tmp_path / "straight", tmp_path / "stopped"
    assert sft.run(load_config(SFTConfig, sft_args(tiny_model, straight))) == 0
    cmd = [PYTHON, "-m", "gyre.cli", "sft", *sft_args(tiny_model, out)]
    log_path = tmp_path / "sft.log"
    code, done = stopped(cmd, out, log_path, sig)
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert 2 <= done < STEPS and steps_of(out) == list(range(1, done + 1))
    assert checkpoints(out) == [f"step_{done}"]  # no ckpt.interval: the stop's own checkpoint
    assert f"stopping: checkpointing step {done} first (ckpt.on_stop)" in log
    assert f"gyre sft: stopped after step {done}; the same command resumes from checkpoint step {done}" in log
    assert not (out / "sft").exists()

    rerun = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert steps_of(out) == list(range(1, STEPS + 1))  # each step once: none trained twice, none lost
    a, b = load_weights(straight / "sft"), load_weights(out / "sft")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_stop_saves_no_second_checkpoint_of_a_step_and_on_stop_false_saves_none(tiny_model, tmp_path):
    out = tmp_path / "off"
    cmd = [PYTHON, "-m", "gyre.cli", "sft", *sft_args(tiny_model, out, **{"ckpt.on-stop": "false"})]
    code, done = stopped(cmd, out, tmp_path / "off.log", signal.SIGTERM)
    log = (tmp_path / "off.log").read_text()
    assert code == 0, log[-3000:]
    assert checkpoints(out) == []
    assert f"stopping without a checkpoint of step {done} (ckpt.on_stop = false)" in log
    assert "no checkpoint (ckpt.on_stop = false): the same command starts over" in log


def test_torchrun_sft_stops_on_sigterm_on_every_rank_and_resumes(tiny_model, tmp_path):
    out = tmp_path / "fsdp"
    # gyre_trainer.torchrun: torchrun's own status after any SIGTERM is 1 (a SignalException), a clean stop's is 0
    cmd = [PYTHON, "-m", "gyre_trainer.torchrun", "--standalone", "--nproc-per-node=2", "-m", "gyre_trainer.sft",
           *sft_args(tiny_model, out)]  # fmt: skip
    log_path = tmp_path / "torchrun.log"
    code, done = stopped(cmd, out, log_path, signal.SIGTERM)
    log = log_path.read_text()
    assert code == 0 and "every worker stopped cleanly, exit 0" in log, log[-3000:]
    assert 2 <= done < STEPS and steps_of(out) == list(range(1, done + 1)), log[-3000:]
    assert checkpoints(out) == [f"step_{done}"], log[-3000:]
    shards = sorted(p.name for p in (out / "checkpoints" / "sft" / f"step_{done}" / "state").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks saved
    assert f"gyre sft: stopped after step {done}" in log
    assert "Traceback" not in log.split("Received")[0], log[-3000:]  # the workers stopped cleanly

    rerun = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert steps_of(out) == list(range(1, STEPS + 1))
    assert (out / "sft" / RESULT_MARKER).exists()


def test_sft_killed_inside_a_checkpoint_save_resumes_from_the_one_before_exactly(tiny_model, tmp_path):
    # SIGKILL (OOM killer, a node lost) while checkpoint step 4 is half written: the re-run must resume from step 2's,
    # not a partial step 4, train 3..6 with their own rows, and end with exactly the weights of a straight run
    extra = {"ckpt.interval": 2, "max-steps": 6}
    straight, out = tmp_path / "straight", tmp_path / "killed"
    assert sft.run(load_config(SFTConfig, sft_args(tiny_model, straight, **extra))) == 0
    cmd = [PYTHON, "-m", "gyre.cli", "sft", *sft_args(tiny_model, out, **extra)]
    killed = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**child_env(), "GYRE_TRAINER_CRASH_AT": "mid_checkpoint:4"})  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert checkpoints(out) == [".tmp-step_4", "step_2"] and not (out / "sft").exists()

    rerun = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "continuing from checkpoint step 2 to step 6" in rerun.stderr
    assert steps_of(out) == [1, 2, 3, 4, 3, 4, 5, 6]  # 3 and 4 were lost with the kill: trained again, logged again
    assert checkpoints(out) == ["step_4", "step_6"]  # the partial folder is gone
    a, b = load_weights(straight / "sft"), load_weights(out / "sft")
    for name in a:
        assert torch.equal(a[name], b[name]), name
