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


def test_a_zero_median_judges_no_spike():
    # steps without signal (every advantage 0) have gradient norm 0: the trainer of a rewind test reached such a
    # history and died on the next real gradient (ZeroDivisionError formatting the "spike"); judged against 0,
    # every later step would be a spike forever, since bad steps never join the history
    watch = GradNormWatch(spike_factor=10.0, window=4)
    assert [watch.observe(n) for n in (0.0, 0.0, 0.0, 0.7, 0.5)] == [None] * 5
    assert list(watch.history) == [0.0, 0.0, 0.7, 0.5]
    assert watch.observe(80.0) is not None  # a scale again: median(0, 0, 0.7, 0.5) = 0.35
