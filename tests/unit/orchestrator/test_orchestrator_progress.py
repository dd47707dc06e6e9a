"""Progress checkpoints and the resume rule: never repeat a step, never skip one."""

from __future__ import annotations

import pytest
from gyre_orchestrator.progress import Progress, ProgressError, ProgressStore, resume_point


def test_save_load_and_retention(tmp_path):
    store = ProgressStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        store.save(Progress(step=step, task_index=10 * step, counters={"num_samples": step}))
    assert store.steps() == [2, 3]
    latest = store.load(-1)
    assert (latest.step, latest.task_index, latest.counters) == (3, 30, {"num_samples": 3})
    assert store.load(2).task_index == 20
    with pytest.raises(ProgressError, match="no progress checkpoint for step 1"):
        store.load(1)
    store.path(3).write_text("{not json")
    with pytest.raises(ProgressError, match="not a valid progress checkpoint"):
        store.load(3)


def test_fresh_start(tmp_path):
    point = resume_point(None, ProgressStore(tmp_path), stream_latest=None, weights_latest=None)
    assert (point.start_step, point.task_index) == (1, 0)


def test_latest_without_any_checkpoint_starts_fresh_unless_the_stream_says_otherwise(tmp_path):
    store = ProgressStore(tmp_path)
    assert resume_point(-1, store, None, None).start_step == 1
    assert resume_point(-1, store, stream_latest=4, weights_latest=3).start_step == 5


def test_checkpoint_then_stream_then_weights(tmp_path):
    store = ProgressStore(tmp_path)
    store.save(Progress(step=5, task_index=40))
    assert resume_point(-1, store, None, None).start_step == 6
    # batches 6 and 7 were pushed after the checkpoint: continue at 8, after the tasks batch 7 used
    point = resume_point(-1, store, stream_latest=7, weights_latest=6, stream_task_index=57)
    assert (point.start_step, point.task_index) == (8, 57)
    # the stream was trimmed, but the trainer published 9: batch 9 was pushed
    assert resume_point(5, store, stream_latest=None, weights_latest=9).start_step == 10
    # an explicit checkpoint that does not exist is an error, not a silent fresh start
    with pytest.raises(ProgressError):
        resume_point(4, store, None, None)
