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
