"""The same trainer under `torchrun --nproc-per-node 2` (gloo, FSDP2) matches one process after 2 steps.

Both consume the same samples: the 2-rank batches deal the rows to the ranks, the 1-rank batches
keep both rows on rank 0. The trainer's global normalisation makes the gradients equal up to
float summation order, so the published weights agree within a tight tolerance.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch
from gyre.events import TRAINER_STEPS, latest_per_step, read_events
from gyre.streams import BatchStream
from safetensors.torch import load_file
from trainer_testlib import (
    PYTHON,
    REPO,
    child_env,
    kill_group,
    load_weights,
    push_batches,
    run_in_process,
    torchrun,
    trained_steps,
    trainer_args,
    wait_for_steps,
)

pytestmark = pytest.mark.slow


def test_fsdp2_two_ranks_match_single_process(tiny_model, redis_url, unique_run_id, tmp_path, isolated_torch_state):
    sharded_run, single_run = unique_run_id + "-fsdp", unique_run_id + "-single"
    push_batches(BatchStream(redis_url, sharded_run), (1, 2), ranks=2, rows_per_rank=1, num_samples=6)
    push_batches(BatchStream(redis_url, single_run), (1, 2), ranks=1, rows_per_rank=2, num_samples=6)
    # ckpt.interval=1 also exercises the sharded DCP checkpoint (one shard file per rank); the entropy bonus its
    # gradient through the chunked log-prob kernel on sharded parameters
    opts = {"ckpt.interval": 1, "data.micro-batch-size": 1, "loss.entropy-coeff": 0.01}

    log = tmp_path / "torchrun.log"
    rc = torchrun(trainer_args(tiny_model, tmp_path / "fsdp", redis_url, sharded_run, 2, **opts), log)
    assert rc == 0, log.read_text()[-5000:]
    assert run_in_process(trainer_args(tiny_model, tmp_path / "single", redis_url, single_run, 2, **opts)) == 0

    assert trained_steps(tmp_path / "fsdp") == trained_steps(tmp_path / "single") == [1, 2]
    sharded = load_weights(tmp_path / "fsdp" / "weights" / "step_2")
    single = load_weights(tmp_path / "single" / "weights" / "step_2")
    base = load_weights(tiny_model)
    assert sharded.keys() == single.keys()
    for name in single:
        assert not torch.equal(single[name], base[name]), f"{name} did not train"
        torch.testing.assert_close(sharded[name], single[name], rtol=1e-4, atol=1e-5, msg=name)
    shards = sorted(p.name for p in (tmp_path / "fsdp" / "checkpoints" / "trainer" / "step_2" / "state").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # the step records' batch-wide stats are those of one process: sums, and the ratio's extremes (MAX over ranks)
    records = {name: latest_per_step(read_events(tmp_path / name / "events" / TRAINER_STEPS))
               for name in ("fsdp", "single")}  # fmt: skip
    for sharded, single in zip(records["fsdp"], records["single"], strict=True):
        step = single["step"]
        assert single["ratio_max"] > single["ratio_mean"] > single["ratio_min"] > 0
        for key in ("loss", "entropy", "mismatch_kl", "ratio_mean", "ratio_min", "ratio_max", "num_loss_tokens"):
            assert sharded[key] == pytest.approx(single[key], rel=1e-4), (step, key)


@pytest.mark.parametrize("publish", ["merged", "adapter"])
def test_fsdp2_lora_resumes_from_its_published_adapter_like_one_process(
    tiny_model, redis_url, unique_run_id, tmp_path, isolated_torch_state, publish
):
    """LoRA under FSDP2 (adapters trainable, base frozen and sharded alike), restarted with no checkpoint:
    both ranks restore the adapter from the published version and train on; what every step publishes
    (merged weights, or the adapter alone: gathered without the frozen base) agrees with the same
    restart in one process."""
    sharded_run, single_run = unique_run_id + "-lora-fsdp", unique_run_id + "-lora-single"
    push_batches(BatchStream(redis_url, sharded_run), (1, 2, 3), ranks=2, rows_per_rank=1, num_samples=6)
    push_batches(BatchStream(redis_url, single_run), (1, 2, 3), ranks=1, rows_per_rank=2, num_samples=6)
    opts = {"data.micro-batch-size": 1, "lora.rank": 4, "lora.alpha": 8, "optim.lr": 1e-2, "lora.publish": publish}
    log = tmp_path / "torchrun.log"
    for max_steps in (2, 3):  # the second launch resumes after step 2 from weights/step_2 alone
        argv = trainer_args(tiny_model, tmp_path / "fsdp", redis_url, sharded_run, max_steps, **opts)
        assert torchrun(argv, log) == 0, log.read_text()[-5000:]
        argv = trainer_args(tiny_model, tmp_path / "single", redis_url, single_run, max_steps, **opts)
        assert run_in_process(argv) == 0
    assert trained_steps(tmp_path / "fsdp") == trained_steps(tmp_path / "single") == [1, 2, 3]
    assert not any((tmp_path / "fsdp" / "checkpoints" / "trainer").glob("step_*"))  # none: ckpt.interval unset
    base = load_weights(tiny_model)
    for step in (2, 3):
        if publish == "merged":
            sharded = load_weights(tmp_path / "fsdp" / "weights" / f"step_{step}")
            single = load_weights(tmp_path / "single" / "weights" / f"step_{step}")
        else:
            sharded, single = (load_file(tmp_path / run / "weights" / f"step_{step}" / "adapter_model.safetensors")
                               for run in ("fsdp", "single"))  # fmt: skip
        if publish == "merged":
            assert sharded.keys() == single.keys() == base.keys()
            assert any(not torch.equal(single[name], base[name]) for name in base)
        else:  # PEFT's adapter file alone
            assert sharded.keys() == single.keys() and all("lora_" in name for name in single)
        for name in single:
            torch.testing.assert_close(sharded[name], single[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")


def test_fsdp2_bf16_steps_float32_master_weights_and_checkpoints_them(
    tiny_model, redis_url, unique_run_id, tmp_path, isolated_torch_state
):
    # A GPU run's parameters are bf16: AdamW steps a float32 master copy of each (sharded like it, a DTensor),
    # and the sharded checkpoint holds that copy in float32 for an exact resume
    from torch.distributed.checkpoint import FileSystemReader

    sharded_run, single_run = unique_run_id + "-fsdp", unique_run_id + "-single"
    push_batches(BatchStream(redis_url, sharded_run), (1, 2), ranks=2, rows_per_rank=1, num_samples=6)
    push_batches(BatchStream(redis_url, single_run), (1, 2), ranks=1, rows_per_rank=2, num_samples=6)
    opts = {"ckpt.interval": 2, "data.micro-batch-size": 1, "model.dtype": "bfloat16"}
    log = tmp_path / "torchrun.log"
    assert torchrun(trainer_args(tiny_model, tmp_path / "fsdp", redis_url, sharded_run, 2, **opts), log) == 0, (
        log.read_text()[-5000:]
    )
    assert run_in_process(trainer_args(tiny_model, tmp_path / "single", redis_url, single_run, 2, **opts)) == 0
    sharded = load_weights(tmp_path / "fsdp" / "weights" / "step_2")
    single = load_weights(tmp_path / "single" / "weights" / "step_2")
    for name in single:
        assert sharded[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(sharded[name], single[name], rtol=2e-2, atol=2e-2, msg=name)
    state = tmp_path / "fsdp" / "checkpoints" / "trainer" / "step_2" / "state"
    meta = FileSystemReader(str(state)).read_metadata().state_dict_metadata
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert meta[f"optim.state.{weight}.master"].properties.dtype == torch.float32
    assert meta[f"optim.state.{weight}.master"].size == meta[f"model.{weight}"].size  # the whole tensor, sharded
    assert meta[f"optim.state.{weight}.exp_avg"].properties.dtype == torch.float32


def test_sigterm_to_torchrun_checkpoints_the_last_step_on_every_rank_and_the_restart_resumes_it(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    """What a Kubernetes trainer pod gets when it is evicted: SIGTERM to torchrun (the container's first process),
    which forwards it to its workers. Both ranks stop after the same step and save its checkpoint together (one
    shard per rank, no ckpt.interval); the restart loads it and trains on from the next step."""
    import signal
    import subprocess

    from trainer_testlib import PYTHON, REPO, child_env, kill_group, wait_for_steps

    stream = BatchStream(redis_url, unique_run_id)
    push_batches(stream, (1, 2), ranks=2, rows_per_rank=1, num_samples=6)
    argv = trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, 4, **{"data.micro-batch-size": 1})
    log = tmp_path / "torchrun.log"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "gyre_trainer.main"]
    with open(log, "ab") as out:
        proc = subprocess.Popen([*cmd, *argv], stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO,
                                start_new_session=True)  # fmt: skip
    try:
        assert wait_for_steps(tmp_path, 2, proc, timeout=240) == [1, 2], log.read_text()[-5000:]
        proc.send_signal(signal.SIGTERM)  # torchrun alone, as the kubelet does; it forwards it to the workers
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    folder = tmp_path / "checkpoints" / "trainer" / "step_2"
    assert sorted(p.name for p in (folder / "state").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (folder / "rng_rank0.pt").is_file() and (folder / "rng_rank1.pt").is_file(), log.read_text()[-5000:]

    push_batches(stream, (3, 4), ranks=2, rows_per_rank=1, num_samples=6)
    before = log.stat().st_size
    assert torchrun(argv, log) == 0, log.read_text()[-5000:]
    assert trained_steps(tmp_path) == [1, 2, 3, 4]
    resumed = log.read_text()[before:]
    assert "loaded checkpoint step 2" in resumed and "not bit-exact" not in resumed


def test_sigkill_of_rank_0_inside_a_checkpoint_and_a_publish_under_torchrun_resumes_bit_exactly(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    """Two ranks (gloo): rank 0 SIGKILLed with every shard of checkpoint 2 on disk but the folder not committed,
    then (second start) with the weights file of version 3 written but the version not committed. torchrun tears
    rank 1 down each time; the third start trains every step once and ends bit for bit where an uninterrupted
    2-rank run does, and no half-written folder was ever listed."""
    from gyre.runstate import CHECKPOINT_COMPLETE
    from gyre.steps import StepEntries
    from gyre.weights import WeightStore
    from trainer_testlib import child_env

    def start(argv, log, crash=None) -> int:
        return torchrun(argv, log, env={**child_env(), "GYRE_TRAINER_CRASH_AT": crash} if crash else None)

    steps, opts = 4, {"ckpt.interval": 1, "data.micro-batch-size": 1}
    final = {}
    for name, crashes in (("uninterrupted", []), ("crashed", ["mid_checkpoint:2", "mid_publish:3"])):
        out, run_id = tmp_path / name, f"{unique_run_id}-{name}"
        stream = BatchStream(redis_url, run_id)
        push_batches(stream, range(1, steps + 1), ranks=2, rows_per_rank=1, num_samples=6)
        argv, log = trainer_args(tiny_model, out, redis_url, run_id, steps, **opts), tmp_path / f"{name}.log"
        for crash in crashes:
            assert start(argv, log, crash) != 0, log.read_text()[-5000:]
            assert f"fault injection: SIGKILL at {crash.replace(':', ' of step ')}" in log.read_text()
            folder = out / ("checkpoints/trainer" if crash.startswith("mid_checkpoint") else "weights")
            assert any(p.name.startswith(".tmp-step_") for p in folder.iterdir()), crash  # cut short, not listed
        if crashes:
            assert StepEntries(out / "checkpoints/trainer", marker=CHECKPOINT_COMPLETE).latest() == 3
            assert WeightStore(out / "weights").latest() == 2
        assert start(argv, log) == 0, log.read_text()[-5000:]
        assert trained_steps(out) == list(range(1, steps + 1)) and stream.pending().count == 0
        final[name] = load_weights(out / "weights" / f"step_{steps}")
    for key, value in final["uninterrupted"].items():
        assert torch.equal(final["crashed"][key], value), key


def _stopped_torchrun(launcher: str, argv: list[str], out, log_path) -> int:
    """`launcher` (a torchrun module) with 2 trainer ranks, SIGTERM to the launcher alone (what the kubelet sends a
    container's first process) once step 2 is logged; its exit status."""
    cmd = [PYTHON, "-m", launcher, "--standalone", "--nproc-per-node=2", "-m", "gyre.cli", "trainer", *argv]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO,
                                start_new_session=True)  # fmt: skip
    try:
        wait_for_steps(out, 2, proc, timeout=240)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_group(proc)


def test_a_clean_sigterm_stop_under_the_trainers_torchrun_exits_0(tiny_model, redis_url, unique_run_id, tmp_path):
    """torchrun exits 1 with a SignalException on every SIGTERM, after workers that checkpointed and returned 0;
    `python -m gyre_trainer.torchrun` (the chart's trainer command) exits 0 when every worker did."""
    push_batches(BatchStream(redis_url, unique_run_id), (1, 2), ranks=2, rows_per_rank=1, num_samples=4)
    out, log_path = tmp_path / "run", tmp_path / "torchrun.log"
    argv = trainer_args(tiny_model, out, redis_url, unique_run_id, 6, **{"data.micro-batch-size": 1})
    code = _stopped_torchrun("gyre_trainer.torchrun", argv, out, log_path)
    log = log_path.read_text()
    assert code == 0, log[-5000:]
    assert trained_steps(out) == [1, 2]
    shards = sorted(p.name for p in (out / "checkpoints" / "trainer" / "step_2" / "state").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks saved the stop checkpoint
    assert "every worker stopped cleanly, exit 0" in log and "Traceback" not in log, log[-5000:]
