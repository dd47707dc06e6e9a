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


def test_the_progress_of_a_step_the_trainer_keeps_a_checkpoint_of_is_kept(tmp_path):
    """The trainer keeps checkpoints for good (ckpt.keep_interval: step 2 here) beyond the window of the newest that
    ckpt_keep_last keeps: a rewind to one (`ckpt.resume_step = 2`, the orchestrator's `resume_step = 2`) failed with
    "no progress checkpoint of step 2". Once the trainer deletes its checkpoint, the progress goes at the next save."""
    trainer = {2, 7}
    store = ProgressStore(tmp_path, keep_last=2, also_keep=lambda: trainer)
    for step in range(1, 9):
        store.save(Progress(step=step, task_index=step))
    assert store.steps() == [2, 7, 8]
    assert resume_point(2, store, committed=8, stream_steps=[]).task_index == 2  # the rewind reads it
    trainer.discard(2)
    store.save(Progress(step=9, task_index=9))
    assert store.steps() == [7, 8, 9]


def test_fresh_start(tmp_path):
    point = resume_point(None, ProgressStore(tmp_path), committed=0, stream_steps=[])
    assert (point.start_step, point.task_index) == (1, 0)
    assert resume_point(-1, ProgressStore(tmp_path), 0, []).start_step == 1


def test_continues_after_the_trainer_and_the_batches_still_in_the_stream(tmp_path):
    store = ProgressStore(tmp_path)
    store.save(Progress(step=5, task_index=40))
    # trainer committed 5, stream holds nothing newer: next is 6, tasks after the checkpoint's
    assert (resume_point(None, store, 5, []).start_step, resume_point(None, store, 5, []).task_index) == (6, 40)
    # batches 6 and 7 were pushed after the checkpoint: continue at 8, after the tasks batch 7 used
    point = resume_point(-1, store, committed=5, stream_steps=[7, 6], stream_task_index=57)
    assert (point.start_step, point.task_index) == (8, 57)
    # the trainer published 9 (its batches were pushed): 10
    assert resume_point(None, store, committed=9, stream_steps=[]).start_step == 10


def test_defect_1_lost_stream_batches_are_regenerated_not_waited_for(tmp_path):
    # issue 17, defect 1: checkpoint says 4, the trainer committed 3, Redis restarted empty. The old
    # rule started at 5 and the trainer waited for batch 4 forever.
    store = ProgressStore(tmp_path)
    store.save(Progress(step=4, task_index=32))
    point = resume_point(-1, store, committed=3, stream_steps=[])
    assert point.start_step == 4
    assert point.task_index == 32  # fresh tasks for the regenerated batch, none repeated
    # a gap in the stream (5 present, 4 lost) also restarts at the gap
    assert resume_point(-1, store, committed=3, stream_steps=[5]).start_step == 4
    # and it never starts past what the trainer can consume (the other hang: past max_steps)
    store.save(Progress(step=8, task_index=64))
    assert resume_point(None, store, committed=6, stream_steps=[]).start_step == 7


def test_defect_2_plain_restart_continues_instead_of_starting_at_step_1(tmp_path):
    # issue 17, defect 2: without resume_step the orchestrator restarted at step 1 while the trainer resumed
    store = ProgressStore(tmp_path)
    store.save(Progress(step=4, task_index=32))
    assert resume_point(None, store, committed=4, stream_steps=[]).start_step == 5


def test_rewind(tmp_path):
    store = ProgressStore(tmp_path)
    store.save(Progress(step=3, task_index=24))
    store.save(Progress(step=5, task_index=40))
    point = resume_point(3, store, committed=5, stream_steps=[6])
    assert (point.start_step, point.task_index) == (4, 24)
    assert resume_point(0, store, committed=5, stream_steps=[]).start_step == 1
    # an explicit checkpoint that does not exist is an error, not a silent fresh start
    with pytest.raises(ProgressError):
        resume_point(4, store, 5, [])


@pytest.mark.asyncio  # the service is built inside the event loop that runs it
async def test_a_rewind_to_a_step_without_a_progress_checkpoint_is_refused_before_anything_changes(tmp_path):
    """`resume_step = N` without progress checkpoint N failed only once the orchestrator had started its servers,
    relayed weights and deleted the stream's batches after N (a typo in N cost the run its pushed batches), with a
    traceback (exit 1). It is now refused when the service is built (`gyre orchestrator` exits 2, naming the key)."""
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre_orchestrator.service import OrchestratorService

    out = tmp_path / "run"
    ProgressStore(out / "checkpoints" / "orchestrator").save(Progress(step=2, task_index=16))
    cfg = load_config(OrchestratorConfig, [], output_dir=str(out), resume_step=3, redis={"url": "redis://127.0.0.1:9"})
    with pytest.raises(ValueError, match=r"^resume_step: no orchestrator progress checkpoint of step 3 .*have \[2\]"):
        OrchestratorService(cfg)
    for step in (-1, 0):  # the automatic resume, and a rewind to the base model, need none
        OrchestratorService(cfg.model_copy(update={"resume_step": step})).redis.close()


@pytest.mark.asyncio  # the service is built inside the event loop that runs it
async def test_a_restart_with_another_seed_or_environment_is_refused_naming_the_key(tmp_path):
    """A `helm upgrade` that changed the orchestrator's task `seed` or its environment mid-run restarted the pod, which
    went on at the saved task position: an index into the first seed's (environment's) tasks, so rows were repeated
    or skipped, and the stream's batches were of the first environment. Only `gyre rl` refused it (from the configs its
    previous launch wrote; no launcher sees a restarted pod). A progress checkpoint now records both, and the service
    refuses a resume from one made with others, naming the key; what a started run may change stays free."""
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre_orchestrator.service import OrchestratorService

    out = tmp_path / "run"
    redis = {"url": "redis://127.0.0.1:9"}
    first = load_config(OrchestratorConfig, [], output_dir=str(out), seed=7, redis=redis,
                        env={"name": "reverse_text"})  # fmt: skip
    env = first.model_dump(mode="json")["env"]
    ProgressStore(out / "checkpoints" / "orchestrator").save(Progress(step=2, task_index=16, seed=7, env=env))
    with pytest.raises(ValueError, match=r"^seed: the run's progress checkpoint .*step_2.json \(step 2\) was made with "
                                         r"seed = 7, this orchestrator has seed = 8"):  # fmt: skip
        OrchestratorService(first.model_copy(update={"seed": 8}))
    other = load_config(OrchestratorConfig, [], output_dir=str(out), seed=7, redis=redis, env={"name": "arithmetic"})
    with pytest.raises(ValueError, match=r"^env\.name: .* was made with env\.name = 'reverse_text', this orchestrator "
                                         r"has 'arithmetic'"):  # fmt: skip
        OrchestratorService(other)
    free = load_config(OrchestratorConfig, [], output_dir=str(out), seed=7, redis=redis,
                       env={"name": "reverse_text", "rollouts_per_example": 4})  # fmt: skip
    for cfg in (first, free, other.model_copy(update={"resume_step": 0})):  # the same run; a group size; a new start
        OrchestratorService(cfg).redis.close()


def test_a_progress_checkpoint_records_the_seed_and_environment_it_indexes(tmp_path):
    """What the restart check compares against: written by `save` and read back by `load` (a checkpoint from before has
    neither, and is not checked)."""
    store = ProgressStore(tmp_path)
    store.save(Progress(step=1, task_index=8, seed=3, env={"name": "arithmetic", "args": {"max_n": 9}}))
    saved = store.load(-1)
    assert (saved.seed, saved.env) == (3, {"name": "arithmetic", "args": {"max_n": 9}})
    (tmp_path / "step_2.json").write_text('{"step": 2, "task_index": 16}')
    assert (store.load(2).seed, store.load(2).env) == (None, None)
