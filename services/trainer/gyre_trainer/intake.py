"""Batch intake: batch `s` from `gyre:{run}:batches`, strictly in step order, on every rank.

Rank 0 is the only Redis consumer. It reads through the consumer group with `gyre.streams.StepReader`
(replays of trained steps are acked and skipped, early steps are buffered, a missing step is waited
for, entries of a dead incarnation are reclaimed with XAUTOCLAIM), loads the payload (inline or from
the shared volume), validates it, and broadcasts the codec bytes to the other ranks, which decode
their own share (`batch.for_rank(rank)`).

Why one reader and a broadcast rather than every rank reading the same entry: the exactly-once
decisions (skip, dead-letter, ack) are then made in exactly one place, from one view of the stream;
the other ranks need no Redis connection at all; and the ranks cannot disagree about which entry
is batch `s` (two readers could, e.g. when a duplicate entry of a step is pending). The broadcast
is a few MB per step over the local interconnect, negligible next to the step itself.

Invariants:
- `next()` returns batches with consecutive steps `trained + 1, trained + 2, ...` and the same batch
  on every rank; it returns None on every rank at once when rank 0 decides to stop;
- an entry is acked only by `commit()`, which the trainer calls after weights `s` are published,
  so an uncommitted step is still pending in Redis after a crash;
- an entry that cannot be trained (undecodable, wrong world size, a row longer than `data.seq_len`, token
  ids outside the vocabulary, non-finite numbers) goes to the dead-letter stream with the reason, and its
  step is waited for again (the orchestrator sees it missing and generates it again); training never
  stops on bad input.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from gyre.batch import TrainBatch
from gyre.codec import CodecError, decode_batch
from gyre.redis_retry import Stopped, call_with_retry
from gyre.streams import BatchStream, StepReader, StreamEntry

from gyre_trainer.dist import DistContext, broadcast_bytes

log = logging.getLogger(__name__)

CONSUMER = "trainer-rank0"  # stable across restarts: a restarted trainer takes over its own pending entries
_WAIT, _BATCH, _STOP = 0, 1, 2
T = TypeVar("T")


@dataclass
class IntakeItem:
    """Batch `step` as delivered to this rank; `entry` is set on rank 0 only (it is what gets acked)."""

    step: int
    batch: TrainBatch
    num_bytes: int
    entry: StreamEntry | None = None


class BatchRejected(ValueError):
    """A decoded batch that this trainer cannot train on; the message is the dead-letter reason."""


def check_trainable(batch: TrainBatch, world_size: int, vocab_size: int, seq_len: int | None = None) -> None:
    """Raise `BatchRejected` unless this trainer can train `batch` (beyond the codec's schema checks): packed for
    its world size and (when given) its `data.seq_len` (`gyre.config.packing`), global normalisers equal to
    its own loss tokens and samples, token ids in its vocabulary, finite numbers."""
    if batch.num_ranks != world_size:
        raise BatchRejected(f"batch is split for {batch.num_ranks} ranks, but the trainer runs {world_size}")
    if not any(rank for rank in batch.micro_batches):
        raise BatchRejected("batch has no micro batches")
    # The loss divides by these global counts, and the batch holds every rank's rows, so they are exactly its own
    # loss tokens and samples (padding rows, `{"padding": true}`, are no samples). Counts below them made
    # train_step raise (a crash loop: the restarted trainer reclaims the same entry); counts above them, or fewer
    # samples, trained with a silently scaled gradient (e.g. num_samples 1 for 8 samples: seq-mean 8x).
    rows = [mb for rank in batch.micro_batches for mb in rank]
    loss_tokens = sum(mb.num_loss_tokens for mb in rows)
    samples = sum(not batch.samples[int(i)].get("padding") for mb in rows for i in mb.sample_index)
    if batch.num_loss_tokens != loss_tokens or batch.num_samples != samples:
        raise BatchRejected(
            f"global normalisers num_loss_tokens={batch.num_loss_tokens}, num_samples={batch.num_samples} "
            f"are not the batch's own {loss_tokens} loss tokens and {samples} samples"
        )
    for r, rank in enumerate(batch.micro_batches):
        for i, mb in enumerate(rank):
            where = f"micro_batches[{r}][{i}]"
            if seq_len is not None and mb.num_tokens > seq_len:
                raise BatchRejected(
                    f"{where}: a row of {mb.num_tokens} tokens, longer than this trainer's data.seq_len = {seq_len} "
                    "(the orchestrator's batch.seq_len must be the trainer's data.seq_len)"
                )
            if mb.num_tokens and (int(mb.input_ids.min()) < 0 or int(mb.input_ids.max()) >= vocab_size):
                raise BatchRejected(f"{where}: token ids outside the model's vocabulary [0, {vocab_size})")
            for name in ("advantages", "inference_logprobs", *mb.optional_fields):
                if not np.isfinite(getattr(mb, name)).all():
                    raise BatchRejected(f"{where}: {name} contains NaN or infinity")


class BatchIntake:
    """Delivers batch after batch to every rank; see the module docstring for the invariants."""

    def __init__(
        self,
        ctx: DistContext,
        stream: BatchStream | None,
        trained_step: int,
        *,
        vocab_size: int,
        seq_len: int | None = None,
        poll_ms: int = 1000,
        reclaim_every_s: float = 5.0,
        redis_retry_s: float = 1.0,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.ctx = ctx
        self.should_stop = should_stop or (lambda: False)
        self.stopped = False  # a stop arrived while Redis was down: next() returns None at once
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.poll_ms = poll_ms
        self.redis_retry_s = redis_retry_s
        self.trained_step = trained_step
        self.reader: StepReader | None = None
        self.group_resets = 0  # the stream's consumer-group losses already explained in the log
        self.gap_reported = 0  # the step whose absence behind later steps was last explained
        if ctx.is_main:
            if stream is None:
                raise ValueError("rank 0 needs the batch stream")
            # reclaim_idle_ms=0: whatever is pending belongs to a previous incarnation of this trainer
            try:
                self.reader = self._retry(
                    lambda: StepReader(
                        stream, CONSUMER, trained_step, reclaim_idle_ms=0, reclaim_every_s=reclaim_every_s
                    )
                )
            except Stopped:
                self.stopped = True

    def next(self, should_stop: Callable[[], bool], *, wait: bool = True) -> IntakeItem | None:
        """Batch `trained_step + 1` on every rank, or None on every rank when rank 0 stops.

        `wait=False` (one process only: the multi-run trainer) returns None after one empty read of
        `poll_ms` instead of waiting for the batch."""
        if not wait and self.ctx.distributed:
            raise ValueError("BatchIntake.next(wait=False) is for a single process")
        if not self.ctx.is_main:
            return self._receive()
        while True:
            if self.stopped or should_stop():
                broadcast_bytes(None, self.ctx, (_STOP, 0))
                return None
            try:
                entry = self._retry(lambda: self.reader.next(block_ms=self.poll_ms), should_stop)
            except Stopped:
                self.stopped = True
                continue
            self._explain_wait(entry)
            if entry is None:
                if not wait:
                    return None
                broadcast_bytes(None, self.ctx, (_WAIT, 0))  # heartbeat: the other ranks keep waiting
                continue
            try:
                payload = entry.load_payload()
                batch = decode_batch(payload)
                if batch.step != entry.step:
                    raise BatchRejected(f"entry says step {entry.step}, its batch says step {batch.step}")
                check_trainable(batch, self.ctx.world_size, self.vocab_size, self.seq_len)
            except (CodecError, BatchRejected) as e:
                try:
                    self._retry(lambda entry=entry, reason=str(e): self.reader.reject(entry, reason), should_stop)
                except Stopped:  # not dead-lettered: still pending, judged again after a restart
                    self.stopped = True
                log.error("batch entry %s rejected: %s; waiting for step %d again", entry.id, e, entry.step)
                if not wait:
                    return None
                broadcast_bytes(None, self.ctx, (_WAIT, 0))
                continue
            broadcast_bytes(payload, self.ctx, (_BATCH, batch.step))
            return IntakeItem(step=batch.step, batch=batch, num_bytes=len(payload), entry=entry)

    @property
    def rejected(self) -> int:
        """Entries moved to the dead-letter stream: a bad payload judged here, or a step or schema the reader could
        not understand (those never reach this loop; counted here they were missing from the metric)."""
        return self.reader.dead_lettered if self.reader is not None else 0

    def commit(self, item: IntakeItem) -> None:
        """Step `item.step` is durably published: ack its entry (rank 0) and move on to the next step."""
        if self.ctx.is_main:
            try:
                self._retry(lambda: self.reader.done(item.entry))
            except Stopped:  # published but not acked: a restarted trainer skips it as a replay
                self.stopped = True
        self.trained_step = item.step

    def _explain_wait(self, entry: StreamEntry | None) -> None:
        """Say why the trainer waits when the stream lost its batches (Redis restarted without its data, a key
        deleted or flushed) or holds later steps but not the next: otherwise the log fell silent, only
        `gyre.streams` noting that it recreated a consumer group, and a user could not tell a stall from a gap
        that training waits out (it never trains past a missing step)."""
        reader = self.reader
        if reader.stream.group_resets != self.group_resets:
            self.group_resets = reader.stream.group_resets
            log.warning("Redis lost the batch stream %s (restarted without its data, flushed or deleted): waiting "
                        "for step %d, which the orchestrator pushes again; steps up to %d are trained and are not "
                        "trained again", reader.stream.key, reader.next_step, reader.trained)  # fmt: skip
        ahead = reader.buffered_steps
        if entry is None and ahead and self.gap_reported != reader.next_step:
            self.gap_reported = reader.next_step
            log.warning("waiting for step %d: steps %s are in the stream but %d is not; a step is never trained "
                        "before the one it follows (the orchestrator generates a missing step again)",
                        reader.next_step, ahead, reader.next_step)  # fmt: skip

    def _receive(self) -> IntakeItem | None:
        while True:
            kind, step, data = broadcast_bytes(None, self.ctx)
            if kind == _STOP:
                return None
            if kind == _BATCH:
                # rank 0 validated these exact bytes; decoding them cannot fail differently here
                return IntakeItem(step=step, batch=decode_batch(data), num_bytes=len(data))

    def _retry(self, op: Callable[[], T], should_stop: Callable[[], bool] | None = None) -> T:
        """Run a Redis operation until Redis answers: an outage delays training, never kills it.

        A stop request (SIGTERM) during the outage raises `Stopped` within ~0.1 s. Safe because every
        operation used here is idempotent or re-derivable (a reclaim re-reads pending entries; an ack
        repeated after an unknown outcome is a no-op).
        """
        stop = self.should_stop if should_stop is None else (lambda: should_stop() or self.should_stop())
        return call_with_retry(op, what="batch intake", should_stop=stop, initial_s=self.redis_retry_s)
