"""Which gradient norms the trainer treats as bad (and dumps): non-finite, or a spike over the recent median."""

from __future__ import annotations

import math

from gyre_trainer.debug import GradNormWatch


def test_a_spike_is_judged_against_the_median_of_the_previous_healthy_steps():
    watch = GradNormWatch(spike_factor=10.0, window=4)
    assert [watch.observe(n) for n in (1.0, 50.0, 2.0)] == [None, None, None]  # fewer than 3 steps: no verdict
    assert watch.observe(20.1) is not None  # median(1, 50, 2) = 2: 20.1 > 10 x 2
    assert watch.observe(19.9) is None  # the spike did not join the history; this one does
    assert "median" in (watch.observe(500.0) or "")  # median(1, 50, 2, 19.9) = 10.95
    assert list(watch.history) == [1.0, 50.0, 2.0, 19.9]


def test_non_finite_norms_are_bad_from_the_first_step():
    watch = GradNormWatch(spike_factor=10.0, window=20)
    for norm in (math.nan, math.inf):
        assert watch.observe(norm).startswith("non-finite gradient norm")
    assert list(watch.history) == []


def test_steps_without_signal_neither_judge_nor_join_the_history():
    # steps without signal (every advantage 0) have gradient norm 0 and their update is skipped: the trainer of a
    # rewind test reached a history of zeros and died on the next real gradient (ZeroDivisionError formatting the
    # "spike"); in the history they made the median 0, and a spike after a few of them went unnoticed
    watch = GradNormWatch(spike_factor=10.0, window=4)
    assert [watch.observe(n) for n in (0.0, 0.0, 0.7, 0.5, 0.6, 0.0, 0.0, 0.0)] == [None] * 8
    assert list(watch.history) == [0.7, 0.5, 0.6]
    assert watch.observe(80.0) is not None  # median(0.7, 0.5, 0.6); with the zeros in the window it was 0
