"""Resume equivalence: 4 steps straight == 2 steps + checkpoint + restart + 2 steps (deterministic mode).

The trainer runs in this process here (`service.run`), on a real Redis, so the three runs cost one
model load each instead of a Python + torch start-up each.
"""

from __future__ import annotations

import pytest
import torch
from gyre.streams import BatchStream
from trainer_testlib import load_weights, push_batches, run_in_process, trained_steps, trainer_args

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]


def train(tiny_model, out, redis_url, run_id, max_steps, **extra) -> None:
    # warmup makes the LR differ per step, so a scheduler restored at the wrong step would show
    opts = {"ckpt.interval": 2, "optim.warmup-steps": 5, **extra}
    assert run_in_process(trainer_args(tiny_model, out, redis_url, run_id, max_steps, **opts)) == 0


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture
def stream(redis_url, unique_run_id):
    s = BatchStream(redis_url, unique_run_id)
    push_batches(s, range(1, 5))
    yield s
    s.redis.close()


def test_two_plus_two_equals_four(tiny_model, redis_url, unique_run_id, stream, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    push_batches(BatchStream(redis_url, unique_run_id + "-straight"), range(1, 5))
    train(tiny_model, straight, redis_url, unique_run_id + "-straight", 4)
    train(tiny_model, resumed, redis_url, unique_run_id, 2)
    assert trained_steps(resumed) == [1, 2]
    train(tiny_model, resumed, redis_url, unique_run_id, 4, **{"ckpt.resume-step": -1})
    assert trained_steps(resumed) == [1, 2, 3, 4]
    assert_same(load_weights(resumed / "weights/step_4"), load_weights(straight / "weights/step_4"))

    # rewind: back to checkpoint 2, abandoning 3 and 4; the orchestrator re-pushes them
    push_batches(stream, (3, 4))
    train(tiny_model, resumed, redis_url, unique_run_id, 4, **{"ckpt.resume-step": 2})
    assert trained_steps(resumed)[-2:] == [3, 4]
    assert_same(load_weights(resumed / "weights/step_4"), load_weights(straight / "weights/step_4"))


def test_sparse_checkpoints_resume_from_published_weights(tiny_model, redis_url, unique_run_id, stream, tmp_path):
    train(tiny_model, tmp_path, redis_url, unique_run_id, 3)  # checkpoint 2, weights 3
    train(tiny_model, tmp_path, redis_url, unique_run_id, 4)
    assert trained_steps(tmp_path) == [1, 2, 3, 4]  # step 3 was published, so it is never trained again
    assert stream.pending().count == 0


def test_a_rewind_the_orchestrator_cannot_follow_is_refused_before_anything_is_deleted(
    tiny_model, redis_url, unique_run_id, stream, tmp_path
):
    """Trainer checkpoints 2 and 4, orchestrator progress checkpoints 3 and 4 only (e.g. the trainer keeps every
    `ckpt.keep_interval`-th checkpoint, the orchestrator its newest few). A rewind to 2: the orchestrator refuses it
    (it needs progress checkpoint 2) while the trainer, started beside it in Kubernetes, deleted checkpoint 4 and
    weights 3 and 4 and rewound alone. The trainer refuses it too now, before deleting anything."""
    from gyre.runstate import orchestrator_progress
    from gyre_trainer.checkpoint import CheckpointError

    train(tiny_model, tmp_path, redis_url, unique_run_id, 4)  # checkpoints 2 and 4
    for step in (3, 4):  # what the orchestrator writes (gyre_orchestrator.progress)
        (tmp_path / "checkpoints/orchestrator").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"checkpoints/orchestrator/step_{step}.json").write_text(f'{{"step": {step}, "task_index": 0}}')
    assert orchestrator_progress(tmp_path) == [3, 4]
    with pytest.raises(CheckpointError, match=r"resume_step=2: the orchestrator has no progress checkpoint of step 2"):
        train(tiny_model, tmp_path, redis_url, unique_run_id, 2, **{"ckpt.resume-step": 2})
    assert (tmp_path / "checkpoints/trainer/step_4").is_dir() and (tmp_path / "weights/step_4").is_dir()


def test_a_resumed_run_draws_the_dropout_masks_the_uninterrupted_one_draws(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    """The RNG half of an exact resume: with LoRA dropout every step draws masks, so the checkpoint's RNG state must
    come back and nothing may draw between loading it and the next step (the head probe of the first forward runs
    under fork_rng). A resume that reseeded instead (a checkpoint without its rng file) ends elsewhere: checked."""
    from safetensors.torch import load_file

    lora = {"lora.rank": 4, "lora.dropout": 0.3, "lora.publish": "adapter", "ckpt.interval": 1}
    straight, resumed, reseeded = tmp_path / "straight", tmp_path / "resumed", tmp_path / "reseeded"
    for suffix in ("-straight", "", "-reseeded"):
        push_batches(BatchStream(redis_url, unique_run_id + suffix), range(1, 5))
    train(tiny_model, straight, redis_url, unique_run_id + "-straight", 4, **lora)
    for out, suffix in ((resumed, ""), (reseeded, "-reseeded")):
        train(tiny_model, out, redis_url, unique_run_id + suffix, 2, **lora)
        if out == reseeded:
            (out / "checkpoints/trainer/step_2/rng_rank0.pt").unlink()
        train(tiny_model, out, redis_url, unique_run_id + suffix, 4, **lora)
        assert trained_steps(out) == [1, 2, 3, 4]

    def adapter(out):
        return load_file(out / "weights/step_4/adapter_model.safetensors")

    expected, reseeded_adapter = adapter(straight), adapter(reseeded)
    assert_same(adapter(resumed), expected)
    assert any(not torch.equal(reseeded_adapter[name], value) for name, value in expected.items())


def test_a_rewind_beside_a_running_orchestrator_that_does_not_rewind_is_refused(
    tiny_model, redis_url, unique_run_id, stream, tmp_path
):
    """`gyre trainer --ckpt.resume-step 2` started by hand beside a running `gyre orchestrator` (no resume_step):
    the trainer deleted checkpoint 4 and weights 3-4 and waited forever for batch 3, which the orchestrator had
    pushed already. Refused now before anything is deleted; beside an orchestrator that asked for the same rewind
    (gyre rl, the chart) it goes on."""
    import json
    import socket
    import subprocess
    import sys

    from gyre_trainer.checkpoint import CheckpointError

    train(tiny_model, tmp_path, redis_url, unique_run_id, 4)  # checkpoints 2 and 4
    for step in (2, 3, 4):  # what the orchestrator writes (gyre_orchestrator.progress)
        (tmp_path / "checkpoints/orchestrator").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"checkpoints/orchestrator/step_{step}.json").write_text(f'{{"step": {step}, "task_index": 0}}')
    orchestrator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        lock = tmp_path / "locks/orchestrator.lock"  # as gyre.runlock writes it for the orchestrator
        lock.parent.mkdir(exist_ok=True)
        holder = {"pid": orchestrator.pid, "host": socket.gethostname(), "command": "gyre orchestrator"}
        lock.write_text(json.dumps({**holder, "resume_step": None}))
        with pytest.raises(CheckpointError, match=rf"resume_step=2: an orchestrator \(pid {orchestrator.pid}\) is "):
            train(tiny_model, tmp_path, redis_url, unique_run_id, 2, **{"ckpt.resume-step": 2})
        assert (tmp_path / "checkpoints/trainer/step_4").is_dir() and (tmp_path / "weights/step_4").is_dir()
        lock.write_text(json.dumps({**holder, "resume_step": 2}))
        push_batches(stream, (3, 4))
        train(tiny_model, tmp_path, redis_url, unique_run_id, 4, **{"ckpt.resume-step": 2})
        assert trained_steps(tmp_path)[-2:] == [3, 4]
    finally:
        orchestrator.kill()
        orchestrator.wait()


def test_a_resume_with_another_micro_batch_size_continues_the_same_run(
    tiny_model, redis_url, unique_run_id, stream, tmp_path
):
    """data.micro_batch_size is how a step is computed, not what it computes (the gradient of the whole batch,
    normalised by its global counts): a run stopped after step 2 and resumed with 2 rows per forward instead of 1
    ends where the uninterrupted run ends, up to float summation order."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    push_batches(BatchStream(redis_url, unique_run_id + "-straight"), range(1, 5))
    train(tiny_model, straight, redis_url, unique_run_id + "-straight", 4, **{"data.micro-batch-size": 1})
    train(tiny_model, resumed, redis_url, unique_run_id, 2, **{"data.micro-batch-size": 1})
    train(tiny_model, resumed, redis_url, unique_run_id, 4, **{"data.micro-batch-size": 2})
    assert trained_steps(resumed) == [1, 2, 3, 4]
    a, b = load_weights(straight / "weights/step_4"), load_weights(resumed / "weights/step_4")
    base = load_weights(tiny_model)
    assert any(not torch.equal(a[name], base[name]) for name in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
