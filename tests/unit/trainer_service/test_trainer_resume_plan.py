"""`plan_resume`: where a (re)starting trainer continues, for every combination of durable state."""

from __future__ import annotations

import pytest
from gyre_trainer.checkpoint import CheckpointError, ResumePlan, plan_resume


def test_fresh_run_starts_at_step_zero():
    assert plan_resume(None, [], None) == ResumePlan(trained_step=0)


def test_checkpoint_and_weights_of_the_same_step_resume_exactly():
    plan = plan_resume(None, [2, 4], 4)
    assert plan == ResumePlan(trained_step=4, checkpoint_step=4)
    assert plan.exact


def test_checkpoint_newer_than_weights_is_republished():
    # killed between saving checkpoint 5 and publishing weights 5: step 5 is committed, its weights are not out
    plan = plan_resume(None, [4, 5], 4)
    assert plan == ResumePlan(trained_step=5, checkpoint_step=5, republish=True)


def test_checkpoint_without_any_weights_is_republished():
    assert plan_resume(None, [1], None) == ResumePlan(trained_step=1, checkpoint_step=1, republish=True)


def test_weights_newer_than_checkpoint_win_and_are_not_exact():
    # sparse checkpoints: steps 5..7 were published after checkpoint 4; they must never train again
    plan = plan_resume(None, [4], 7)
    assert plan == ResumePlan(trained_step=7, checkpoint_step=4, weights_step=7)
    assert not plan.exact


def test_weights_without_checkpoints_resume_from_weights():
    assert plan_resume(None, [], 3) == ResumePlan(trained_step=3, weights_step=3)


def test_minus_one_requires_a_checkpoint():
    with pytest.raises(CheckpointError, match="no checkpoint"):
        plan_resume(-1, [], 3)
    assert plan_resume(-1, [2], 2) == ResumePlan(trained_step=2, checkpoint_step=2)


def test_explicit_step_rewinds_and_discards_newer_state():
    plan = plan_resume(2, [2, 4], 5)
    assert plan == ResumePlan(trained_step=2, checkpoint_step=2, republish=True, discard_after=2)


def test_explicit_step_must_exist():
    with pytest.raises(CheckpointError, match="resume_step=3"):
        plan_resume(3, [2, 4], 4)


def test_explicit_zero_restarts_from_the_base_model():
    assert plan_resume(0, [2], 2) == ResumePlan(trained_step=0, discard_after=0)
    assert plan_resume(0, [], None) == ResumePlan(trained_step=0)


@pytest.mark.parametrize(
    "steps, weights, expected",
    [
        ([1, 2], 2, "resumes after step 2 from published weights step 2 and checkpoint step 1"),
        ([1, 4], 2, "resumes after step 2 from published weights step 2 and checkpoint step 1, training steps 3..4 "
                    "again (their batches are still pending)"),
        ([4], None, "resumes after step 0 from the base model, training steps 1..4 again"),
    ],
    ids=["weights-as-new", "weights-older", "nothing-else"],
)  # fmt: skip
def test_a_damaged_checkpoint_says_where_the_run_resumes_without_it(tmp_path, steps, weights, expected):
    from gyre_trainer.checkpoint import CheckpointManager
    from gyre_trainer.dist import DistContext
    from gyre_trainer.run import without_checkpoint

    manager = CheckpointManager(tmp_path, DistContext())
    for step in steps:  # complete checkpoints as the trainer's resume lists them
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "progress.json").write_text("{}")
    hint = without_checkpoint(manager, steps[-1], weights)
    assert hint.startswith(f"To resume without it, move {tmp_path / f'step_{steps[-1]}'} out of {tmp_path}: the run ")
    assert expected in hint
