"""`gyre.packing`: first-fit-decreasing rows and their assignment to data-parallel ranks (the orchestrator packs
real batches with them, the trainer's bench its fake ones)."""

from __future__ import annotations

import pytest
from gyre.packing import assign_to_ranks, first_fit_decreasing
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=60), st.integers(100, 300))
def test_ffd_places_every_sample_once_within_capacity(lengths, capacity):
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # First fit never leaves two bins that could be merged, so at most one bin is half empty or worse.
    assert sum(sum(lengths[i] for i in b) <= capacity / 2 for b in bins) <= 1


def test_ffd_is_optimal_on_a_tight_instance():
    lengths = [2, 5, 2, 5, 8, 8]  # first fit in arrival order needs 4 rows of 10; sorted first, 3 full ones
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(sorted(lengths[i] for i in b) for b in bins) == [[2, 8], [2, 8], [5, 5]]
    with pytest.raises(ValueError, match="more than the row capacity"):
        first_fit_decreasing([13], 12)


def test_ffd_is_tight_on_a_known_instance():
    # 6+4, 5+5, 3+3+2+2 fill three rows of 10 exactly
    lengths = [6, 5, 5, 4, 3, 3, 2, 2]
    bins = first_fit_decreasing(lengths, 10)
    assert len(bins) == 3
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [10, 10, 10]


def test_too_long_sample_is_an_error_not_a_silent_cut():
    with pytest.raises(ValueError, match="longer than seq_len"):
        first_fit_decreasing([5, 11], 10)


def test_rows_are_split_so_every_rank_gets_work():
    # four short samples fit one row, but two ranks need two rows: the row is split, not padded
    lengths = [3, 3, 3, 3]
    ranks = assign_to_ranks(first_fit_decreasing(lengths, 100), lengths, 2)
    assert [sum(lengths[i] for b in r for i in b) for r in ranks] == [6, 6]


def test_ranks_are_balanced_by_tokens():
    lengths = [60, 50, 40, 30, 20, 10, 10, 10]
    ranks = assign_to_ranks(first_fit_decreasing(lengths, 64), lengths, 2)
    loads = [sum(lengths[i] for b in r for i in b) for r in ranks]
    assert max(loads) - min(loads) <= 20
