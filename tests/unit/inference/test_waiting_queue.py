"""The engine's waiting queue: lower priority first, first come first served within a priority, and a sequence
sent back keeps the place it first got."""

from __future__ import annotations

import asyncio

from gyre_inference.backend import SamplingParams
from gyre_inference.batch import Sequence
from gyre_inference.waiting_queue import WaitingQueue


def _seq(name: str, priority: int) -> Sequence:
    seq = Sequence([1, 2], SamplingParams(max_tokens=1, priority=priority), asyncio.Queue(), seed=0)
    seq.name = name  # dataclass without slots: a label for the assertions
    return seq


def _drain(queue: WaitingQueue) -> list[str]:
    return [queue.popleft().name for _ in range(len(queue))]


def test_lower_priority_values_come_first_then_arrival_order():
    queue = WaitingQueue()
    for name, priority in [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 3), ("f", -1)]:
        queue.append(_seq(name, priority))
    assert len(queue) == 6 and {s.name for s in queue} == set("abcdef")
    assert _drain(queue) == ["f", "b", "d", "c", "a", "e"]
    assert not queue


def test_a_sequence_sent_back_goes_before_later_arrivals_of_its_priority():
    queue = WaitingQueue()
    first, second = _seq("first", 0), _seq("second", 0)
    queue.append(first)
    queue.append(second)
    taken = queue.popleft()  # admitted, then preempted (or no blocks yet) and sent back
    queue.append(_seq("later", 0))
    queue.append(_seq("urgent", -5))
    queue.extend([taken])
    assert _drain(queue) == ["urgent", "first", "second", "later"]


def test_clear_empties_it():
    queue = WaitingQueue()
    queue.extend([_seq("a", 0), _seq("b", 1)])
    queue.clear()
    assert len(queue) == 0 and list(queue) == []


def test_a_discarded_sequence_is_no_longer_counted_or_seen_and_the_rest_keep_their_order():
    queue = WaitingQueue()
    seqs = {name: _seq(name, 0) for name in "abcd"}
    for seq in seqs.values():
        queue.append(seq)
    queue.discard(seqs["b"])
    queue.discard(seqs["b"])  # twice: once is enough
    assert len(queue) == 3 and {s.name for s in queue} == set("acd")
    # popleft may hand the discarded entry out when it comes up (the engine skips cancelled sequences)
    popped = [queue.popleft().name for _ in range(4)]
    assert popped == ["a", "b", "c", "d"] and not queue and len(queue) == 0
    queue.discard(seqs["a"])  # not queued any more: nothing changes
    assert len(queue) == 0
    queue.append(seqs["c"])  # sent back (preempted): counted again
    assert len(queue) == 1 and [s.name for s in queue] == ["c"]
