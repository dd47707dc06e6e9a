"""Redis stream transport of training batches: orchestrator -> trainer.

Keys (see docs/architecture.md, "Redis streams"):
- `gyre:{run}:batches`      one entry per step: `step`, `schema`, and `payload` (codec bytes) or
                            `path` + `digest` (sha256 hex of the spilled file) for large payloads.
- `gyre:{run}:batches:dead` dead letters: the original fields plus `reason` (moved: deleted from the
                            batches stream, so the orchestrator sees the step as missing and regenerates it).
                            Holds the newest `dead_maxlen` (the trainer's `intake.dead_letter_maxlen`, default
                            `DEAD_MAXLEN`; exact); the oldest are trimmed and counted in
                            `gyre:{run}:batches:dead:trimmed`.

The trainer reads through the consumer group `trainer`. Delivery is at-least-once: an entry stays in
the group's pending list until acked, and the trainer acks batch `s` only after weights `s` are
published, so a trainer that dies mid-step finds the entry again (`reclaim`, XAUTOCLAIM) and nothing
is lost. Replays are made harmless by step numbers: `StepReader` acks and skips steps that are
already trained, buffers steps that arrive early and waits for a missing one, never skipping it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from gyre.batch import TrainBatch
from gyre.codec import SCHEMA_VERSION, CodecError, decode_batch
from gyre.fsio import write_atomic

log = logging.getLogger(__name__)

GROUP = "trainer"
# Dead letters are for inspection: the newest are kept, the oldest trimmed. An entry is a whole batch (up to
# `batch.inline_max_bytes`, 8 MiB), so the bound is what Redis memory allows, not what one might read: 1000 entries
# were up to 8 GiB per run, in a Redis with maxmemory and noeviction, whose filling stops the run. 16 are at most
# a quarter of the batch stream's default 64 and outlast the orchestrator's 3 rejections of one step.
DEAD_MAXLEN = 16


def batches_key(run_id: str) -> str:
    return f"gyre:{run_id}:batches"


def dead_key(run_id: str) -> str:
    return f"gyre:{run_id}:batches:dead"


def dead_trimmed_key(run_id: str) -> str:
    return f"gyre:{run_id}:batches:dead:trimmed"


def owner_key(run_id: str) -> str:
    return f"gyre:{run_id}:owner"


class RunIdTaken(RuntimeError):
    """Another experiment holds this run id on the Redis (`gyre:{run}:owner`); `holder` is what it recorded."""

    def __init__(self, run_id: str, holder: str, owner: str):
        key = owner_key(run_id)
        super().__init__(
            f"redis.owner: run id {run_id!r} on this Redis belongs to {holder} (key {key}), not to {owner}: two "
            f"experiments with one run id would train each other's batches. Give this one another run_id (a Helm "
            f"release: experiment.run_id); if that experiment is gone, delete its keys: redis-cli DEL {key} "
            f"{batches_key(run_id)} {dead_key(run_id)}"
        )
        self.run_id, self.holder = run_id, holder


def claim_run_id(client: redis.Redis, run_id: str, owner: str, *, check_only: bool = False,
                 take_over: bool = False) -> None:  # fmt: skip
    """Record that `run_id`'s keys on this Redis (its stream, dead letters, push count) belong to `owner` (SET NX
    on `gyre:{run}:owner`), or with `check_only` just read it. Two experiments with one run_id on one Redis (the
    default id, a copied values file, two releases of one name in two namespaces) both found the stream empty and
    both pushed into it: each trainer trained the other's batches. RunIdTaken when another owner holds the id;
    `take_over` records `owner` whatever was there (`gyre rl --fresh`, which deletes the old run's batches)."""
    key = owner_key(run_id)
    if take_over:
        client.set(key, owner)
        return
    held = client.get(key) if check_only else (None if client.set(key, owner, nx=True) else client.get(key))
    holder = held.decode() if isinstance(held, bytes) else held
    if holder is not None and holder != owner:
        raise RunIdTaken(run_id, holder, owner)


# Move one entry to the dead stream, atomically: add it (fields as ARGV[4..]), trim the dead stream to its newest
# ARGV[1] entries and count what that trimmed, ack and delete the original (ARGV[3], group ARGV[2]).
_DEAD_LETTER_LUA = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
local trimmed = redis.call('XTRIM', KEYS[1], 'MAXLEN', ARGV[1])
local total = 0
if trimmed > 0 then total = redis.call('INCRBY', KEYS[3], trimmed) end
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
return {id, trimmed, total}
"""


def stream_id(text: str) -> tuple[int, int]:
    """A stream entry id `ms-seq` as a tuple that orders as Redis orders ids."""
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _show(value: bytes | None) -> str:
    """A field value for an error message: `'3'`, `'\\xff'` or `missing`."""
    return "missing" if value is None else repr(value.decode(errors="backslashreplace")[:40])


@dataclass
class StreamEntry:
    """One stream entry. `step` is None when the `step` field is missing or not plain decimal digits."""

    id: str
    fields: dict[str, bytes]
    step: int | None = field(init=False)

    def __post_init__(self) -> None:
        try:
            text = self.fields["step"].decode("ascii")
        except (KeyError, UnicodeDecodeError):
            text = ""
        # digits only, as `push` writes them: int() also read "-3" (a replay, acked and gone), " 2", "+2", "2_0" (20)
        self.step = int(text) if text.isdigit() else None

    @property
    def schema(self) -> int | None:
        try:
            return int(self.fields["schema"].decode("ascii"))
        except (KeyError, ValueError, UnicodeDecodeError):
            return None

    @property
    def spill_path(self) -> Path | None:
        return Path(self.fields["path"].decode()) if "path" in self.fields else None

    def load_payload(self) -> bytes:
        """The codec bytes, inline or from the spilled file (sha256-verified); `CodecError` if unusable."""
        if "payload" in self.fields:
            return self.fields["payload"]
        if "path" not in self.fields or "digest" not in self.fields:
            raise CodecError(f"entry {self.id} has neither payload nor path+digest")
        try:
            path = self.spill_path
            data = path.read_bytes()
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, or a NUL byte: no file name at all
            where = self.fields["path"].decode(errors="backslashreplace")
            raise CodecError(
                f"entry {self.id}: cannot read spilled payload {where}: {getattr(e, 'strerror', None) or e}"
            ) from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.fields["digest"].decode(errors="replace"):
            raise CodecError(f"entry {self.id}: {path} has sha256 {digest}, entry says {_show(self.fields['digest'])}")
        return data

    def decode(self) -> TrainBatch:
        """Load and decode the `TrainBatch`; `CodecError` if malformed or its step disagrees with the entry's."""
        if self.schema != SCHEMA_VERSION:
            raise CodecError(f"entry {self.id}: schema {_show(self.fields.get('schema'))}, expected {SCHEMA_VERSION}")
        batch = decode_batch(self.load_payload())
        if batch.step != self.step:
            raise CodecError(f"entry {self.id}: entry step {self.step} but batch step {batch.step}")
        return batch


@dataclass
class PendingInfo:
    """Summary of the group's pending entries (delivered, not yet acked)."""

    count: int
    min_id: str | None
    max_id: str | None
    consumers: dict[str, int]


class BatchStream:
    """Producer and consumer-group operations on `gyre:{run}:batches`.

    `client` is a redis-py client (must NOT use decode_responses: payloads are bytes) or a URL.
    The stream is bounded with approximate `MAXLEN ~ maxlen`: the producer must not run further
    ahead of the trainer than that (max_async_level keeps it a handful of steps).
    """

    def __init__(
        self,
        client: redis.Redis | str,
        run_id: str,
        maxlen: int = 64,
        group: str = GROUP,
        *,
        dead_maxlen: int = DEAD_MAXLEN,
    ):
        if isinstance(client, str):
            client = redis.Redis.from_url(client)
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("BatchStream needs a redis client without decode_responses (payloads are bytes)")
        if not run_id or any(c in run_id for c in "{}: \n"):
            raise ValueError(f"run_id {run_id!r} must be non-empty without braces, colons or whitespace")
        self.redis = client
        self.run_id = run_id
        self.key = batches_key(run_id)
        self.dead_key = dead_key(run_id)
        self.maxlen = maxlen
        if isinstance(dead_maxlen, bool) or not isinstance(dead_maxlen, int) or dead_maxlen < 1:
            raise ValueError(f"dead_maxlen must be an int >= 1, got {dead_maxlen!r}")
        self.dead_maxlen = dead_maxlen
        self.dead_trimmed_key = dead_trimmed_key(run_id)
        self._dead_letter_script = client.register_script(_DEAD_LETTER_LUA)
        self.group = group
        self.group_resets = 0  # times the group was found missing and recreated (see `_with_group`)

    # ---- producer -------------------------------------------------------------------------------
    def push(
        self,
        step: int,
        payload: bytes,
        *,
        path_threshold: int | None = None,
        spill_dir: Path | None = None,
        schema: int = SCHEMA_VERSION,
    ) -> str:
        """Append batch `step`; payloads larger than `path_threshold` bytes go to `spill_dir/step_{s}.bin`.

        The file is complete (written to a temp name, fsynced, renamed) before the entry that names
        it exists, so a consumer never sees a partial file.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        fields: dict[str, bytes | str | int] = {"step": str(step), "schema": str(schema)}
        if path_threshold is not None and len(payload) > path_threshold:
            if spill_dir is None:
                raise ValueError(f"payload of {len(payload)} bytes exceeds path_threshold but no spill_dir given")
            path = write_atomic(Path(spill_dir) / f"step_{step}.bin", payload)
            fields["path"] = str(path.resolve())
            fields["digest"] = hashlib.sha256(payload).hexdigest()
        else:
            fields["payload"] = payload
        try:
            return _str(self.redis.xadd(self.key, fields, maxlen=self.maxlen, approximate=True))
        except redis.OutOfMemoryError:
            # Redis at maxmemory with noeviction (the chart's setting) refused it: MAXLEN trims trained entries
            # only at a push that succeeds, so free them here and try once more; with none to free, the caller
            # backs off (gyre.redis_retry) while the trainer trains and acks what the stream holds
            if not self.trim_trained():
                raise
            return _str(self.redis.xadd(self.key, fields, maxlen=self.maxlen, approximate=True))

    def trim_trained(self) -> int:
        """Delete the entries the trainer's group has acknowledged (delivered and no longer pending: trained and
        published), which MAXLEN would trim later anyway; entries pending or not yet delivered stay. Returns how
        many were deleted."""
        groups = {_str(g["name"]): g for g in self.redis.xinfo_groups(self.key)}
        if self.group not in groups:
            return 0
        ms, seq = stream_id(_str(groups[self.group]["last-delivered-id"]))
        keep_from = self.pending().min_id or f"{ms}-{seq + 1}"
        trimmed = int(self.redis.xtrim(self.key, minid=keep_from, approximate=False))
        if trimmed:
            log.warning("redis is full (maxmemory): trimmed %d trained entries of %s to make room", trimmed, self.key)
        return trimmed

    def newest(self) -> StreamEntry | None:
        """The newest entry still in the stream (None if empty)."""
        newest = self.redis.xrevrange(self.key, count=1)
        return self._entry(*newest[0]) if newest else None

    def latest_step(self) -> int | None:
        """Step of the newest entry still in the stream (None if empty or unparsable)."""
        newest = self.newest()
        return newest.step if newest else None

    def length(self) -> int:
        return int(self.redis.xlen(self.key))

    def holds(self, entry_id: str) -> bool:
        """True while entry `entry_id` is still in the stream (not deleted by a rewind, a dead letter or a trim)."""
        return bool(self.redis.xrange(self.key, min=entry_id, max=entry_id, count=1))

    def steps_after(self, step: int) -> list[int]:
        """Steps of the entries newer than the newest entry of a step <= `step`, newest first.

        Reads backwards one entry at a time, so only the few batches pushed ahead of the trainer are
        fetched (payloads can be megabytes), never the whole stream.
        """
        found: list[int] = []
        end = "+"
        while True:
            newest = self.redis.xrevrange(self.key, max=end, count=1)
            if not newest:
                return found
            entry = self._entry(*newest[0])
            if entry.step is not None and entry.step <= step:
                return found
            if entry.step is not None:
                found.append(entry.step)
            end = "(" + entry.id

    def discard_after(self, step: int) -> list[int]:
        """Delete (and ack, for the group) the entries of steps > `step` at the stream's end.

        A rewound run abandons them: the trainer must never train a batch of the abandoned future.
        Returns the steps deleted, newest first.
        """
        dropped: list[int] = []
        self.ensure_group()  # XACK needs it; the trainer creates it the same way (from the start)
        while True:
            newest = self.redis.xrevrange(self.key, count=1)
            if not newest:
                return dropped
            entry = self._entry(*newest[0])
            if entry.step is not None and entry.step <= step:
                return dropped
            pipe = self.redis.pipeline(transaction=True)
            pipe.xack(self.key, self.group, entry.id)
            pipe.xdel(self.key, entry.id)
            pipe.execute()
            dropped.append(entry.step if entry.step is not None else -1)

    # ---- consumer group -------------------------------------------------------------------------
    def ensure_group(self, start_id: str = "0") -> None:
        """Create the consumer group (and the stream) if missing; idempotent."""
        try:
            self.redis.xgroup_create(self.key, self.group, id=start_id, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read(self, consumer: str, block_ms: int | None = None, count: int = 16) -> list[StreamEntry]:
        """New entries for `consumer` (XREADGROUP >); waits up to `block_ms` (None: don't wait)."""
        if block_ms is not None and block_ms <= 0:
            block_ms = None  # redis treats BLOCK 0 as "forever"; never hang a caller by accident
        reply = self._with_group(
            lambda: self.redis.xreadgroup(self.group, consumer, {self.key: ">"}, count=count, block=block_ms)
        )
        entries = []
        for _key, items in reply or []:
            for entry_id, fields in items:
                entries.append(self._entry(entry_id, fields))
        return entries

    def _with_group(self, command):
        """Run `command`; if the group is gone (Redis restarted without persistence, key deleted),
        recreate it from the start of the stream and run it once more, so nothing pushed is lost.
        Redis 7 answers a blocked read whose key was deleted with UNBLOCKED: the same case."""
        try:
            return command()
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e) and "UNBLOCKED" not in str(e):
                raise
            log.warning("consumer group %s of %s was missing; recreating it", self.group, self.key)
            self.group_resets += 1
            self.ensure_group()
            return command()

    def ack(self, entry_id: str) -> int:
        """XACK; returns 1 if the entry was pending, 0 if it was already acked."""
        return int(self.redis.xack(self.key, self.group, entry_id))

    def dead_letter(self, entry: StreamEntry, reason: str) -> str:
        """Move `entry` with `reason` to the dead stream: copy, ack, delete, atomically (a Lua script).

        Deleted so that its step no longer counts as pushed: the orchestrator's resume rule and its
        stream watch (`steps_after`) then see the gap and generate the step again, which the trainer
        is waiting for. Left in place, it would have been taken for a pushed step forever.

        The dead stream keeps the newest `dead_maxlen` entries: an exact XTRIM in the same atomic step (a Lua
        script), which adds the count of entries it trimmed to `gyre:{run}:batches:dead:trimmed`. Not `MAXLEN ~`:
        that trims whole radix-tree nodes only, up to 100 small entries late.
        """
        fields = [x for name, value in {**entry.fields, "reason": reason, "original_id": entry.id}.items()
                  for x in (name, value)]  # fmt: skip
        try:
            dead_id, trimmed, total = self._dead_letter_script(
                keys=[self.dead_key, self.key, self.dead_trimmed_key],
                args=[self.dead_maxlen, self.group, entry.id, *fields],
            )
        except redis.OutOfMemoryError:
            raise
        except redis.ResponseError as e:
            # Redis 6.2 reports a write refused at maxmemory inside a script as a plain script error (7.x as OOM):
            # the XADD was refused, so nothing was written, and the caller's retry (gyre.redis_retry) must see it
            if "OOM command not allowed" in str(e):
                raise redis.OutOfMemoryError(str(e)) from e
            raise
        log.warning("dead-lettered entry %s (step %s) of %s: %s", entry.id, entry.step, self.key, reason)
        if trimmed:
            log.warning("%s keeps its newest %d dead letters: trimmed the oldest %d (%d in all, counted in %s)",
                        self.dead_key, self.dead_maxlen, trimmed, total, self.dead_trimmed_key)  # fmt: skip
        return _str(dead_id)

    def dead_trimmed(self) -> int:
        """How many dead letters were trimmed from the dead stream (the oldest ones), in all."""
        return int(self.redis.get(self.dead_trimmed_key) or 0)

    def dead_letters(self) -> list[StreamEntry]:
        return [self._entry(i, f) for i, f in self.redis.xrange(self.dead_key)]

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        """Take over entries pending for more than `min_idle_ms` (e.g. from a dead consumer), via XAUTOCLAIM.

        Redis 6.2 replies `[next_id, entries]` and reports entries trimmed from the stream as nil
        (leaving them pending); 7.x replies `[next_id, entries, deleted_ids]` and drops them itself.
        Both are handled: trimmed entries cannot be delivered, so they are acked and logged.
        """
        claimed: list[StreamEntry] = []
        saw_trimmed = False
        start = "0-0"
        while True:
            reply = self._with_group(
                lambda start=start: self.redis.xautoclaim(
                    self.key, self.group, consumer, min_idle_ms, start_id=start, count=count
                )
            )
            next_id, items = reply[0], reply[1]
            deleted = reply[2] if len(reply) > 2 else []
            for entry_id, fields in items:
                if entry_id is None or fields is None:
                    saw_trimmed = True
                else:
                    claimed.append(self._entry(entry_id, fields))
            if deleted:
                log.warning("pending entries of %s trimmed before delivery: %s", self.key, deleted)
            start = _str(next_id)
            if start == "0-0":
                break
        if saw_trimmed:
            self._ack_trimmed(consumer)
        return claimed

    def _ack_trimmed(self, consumer: str) -> None:
        # 6.2 only: find this consumer's pending ids that no longer exist in the stream
        pending = self.redis.xpending_range(self.key, self.group, min="-", max="+", count=10_000, consumername=consumer)
        gone = [p["message_id"] for p in pending if not self.redis.xrange(self.key, p["message_id"], p["message_id"])]
        if gone:
            log.warning("%d pending entries of %s were trimmed before delivery: %s", len(gone), self.key, gone)
            self.redis.xack(self.key, self.group, *gone)

    def pending(self) -> PendingInfo:
        info = self._with_group(lambda: self.redis.xpending(self.key, self.group))
        return PendingInfo(
            count=int(info["pending"]),
            min_id=_str(info["min"]) if info["min"] else None,
            max_id=_str(info["max"]) if info["max"] else None,
            consumers={_str(c["name"]): int(c["pending"]) for c in info["consumers"]},
        )

    @staticmethod
    def _entry(entry_id: bytes | str, fields: dict) -> StreamEntry:
        # a field name that is not UTF-8 must not stop the reader: the entry is judged (dead-lettered) like any other
        names = (k.decode(errors="backslashreplace") if isinstance(k, bytes) else k for k in fields)
        return StreamEntry(id=_str(entry_id), fields=dict(zip(names, fields.values(), strict=True)))


class StepReader:
    """Delivers stream entries in strict step order, starting at `already_trained + 1`.

    - entries with step <= already trained are replays: acked and skipped;
    - entries that arrive early are buffered (still pending, so a crash loses nothing);
    - a missing step is waited for, never skipped: `next()` returns None on timeout;
    - entries whose `step` or `schema` cannot be understood go to the dead-letter stream;
    - a buffered entry that left the stream before its turn is forgotten: a rewinding orchestrator deletes the
      batches of the abandoned future (`discard_after`) and pushes their steps again.

    Usage (the trainer acks only after publishing weights):

        reader = StepReader(stream, "trainer-0", already_trained=resume_step)
        while (entry := reader.next(block_ms=1000)) is None: ...
        batch = entry.decode()          # CodecError -> reader.reject(entry, str(e)) and wait again
        train(batch); publish(step)
        reader.done(entry)              # ack + advance
    """

    def __init__(
        self,
        stream: BatchStream,
        consumer: str,
        already_trained: int = 0,
        *,
        reclaim_idle_ms: int = 0,
        reclaim_every_s: float = 5.0,
    ):
        self.stream = stream
        self.consumer = consumer
        self.trained = already_trained
        self.reclaim_idle_ms = reclaim_idle_ms
        self.reclaim_every_s = reclaim_every_s
        self._buffer: dict[str, StreamEntry] = {}  # entry id -> entry with step > trained
        # entries this reader moved to the dead stream, whoever judged them (this reader: step or schema; the
        # caller: the payload, through `reject`): the trainer's gyre_trainer_rejected_batches_total counts them all
        self.dead_lettered = 0
        self._last_reclaim = float("-inf")
        self._group_resets = stream.group_resets
        stream.ensure_group()

    @property
    def next_step(self) -> int:
        return self.trained + 1

    @property
    def buffered_steps(self) -> list[int]:
        return sorted({e.step for e in self._buffer.values()})

    def next(self, block_ms: int = 1000) -> StreamEntry | None:
        """The entry of step `next_step`, or None if it did not arrive within `block_ms`."""
        deadline = time.monotonic() + block_ms / 1000
        # one read that does not wait, before serving the buffer: it notices a stream lost since (`_forget_lost`)
        self._admit(self._forget_lost(self.stream.read(self.consumer)))
        while True:
            if time.monotonic() - self._last_reclaim >= self.reclaim_every_s:
                # first call: take back what a previous incarnation of the trainer had in flight;
                # later, while waiting: entries stuck on a consumer that died
                self._last_reclaim = time.monotonic()
                self._admit(self._forget_lost(self.stream.reclaim(self.consumer, self.reclaim_idle_ms)))
            ready = self._pop_next()
            if ready is not None:
                return ready
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            self._admit(self._forget_lost(self.stream.read(self.consumer, block_ms=min(remaining_ms, 1000))))

    def done(self, entry: StreamEntry) -> None:
        """Mark `entry.step` trained: ack it, and ack any buffered duplicates of it."""
        if entry.step != self.next_step:
            raise ValueError(f"done() for step {entry.step}, but the next step to train is {self.next_step}")
        self.stream.ack(entry.id)
        self.trained = entry.step
        self._buffer.pop(entry.id, None)
        self._admit(list(self._buffer.values()))

    def reject(self, entry: StreamEntry, reason: str) -> None:
        """Dead-letter an entry whose payload is unusable; its step will be waited for again."""
        self._buffer.pop(entry.id, None)
        self.stream.dead_letter(entry, reason)
        self.dead_lettered += 1

    def _forget_lost(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        """`entries`, after dropping what was read ahead from a stream that has since lost its group (deleted,
        flushed, Redis restarted empty): the orchestrator pushes those steps again, and the batch trained must
        be the one it pushed last (its event log describes that one)."""
        if self.stream.group_resets != self._group_resets:
            self._group_resets = self.stream.group_resets
            if self._buffer:
                log.warning("the stream was lost: forgetting steps %s read ahead from it", self.buffered_steps)
                self._buffer.clear()
        return entries

    def _admit(self, entries: Iterable[StreamEntry]) -> None:
        for entry in entries:
            if entry.step is None:
                self.reject(entry, f"unparsable step {_show(entry.fields.get('step'))}")
            elif entry.schema != SCHEMA_VERSION:
                schema = _show(entry.fields.get("schema"))
                self.reject(entry, f"unsupported schema {schema} (expected {SCHEMA_VERSION})")
            elif entry.step <= self.trained:
                self._buffer.pop(entry.id, None)
                self.stream.ack(entry.id)
                log.info("skipping replayed step %d (entry %s): already trained", entry.step, entry.id)
            else:
                self._buffer[entry.id] = entry

    def _pop_next(self) -> StreamEntry | None:
        candidates = [e for e in self._buffer.values() if e.step == self.next_step]
        # duplicates of a step (orchestrator re-pushed after a crash): the oldest entry wins, the
        # others stay buffered and are acked by done() as replays
        for entry in sorted(candidates, key=lambda e: stream_id(e.id)):
            # read ahead, perhaps long ago: a rewinding orchestrator (resume_step) has deleted the batches of the
            # abandoned future since, generated by weights the rewound trainer no longer has, and pushes them again
            if self.stream.holds(entry.id):
                return entry
            log.warning("step %d (entry %s) left the stream since it was read: waiting for it again", entry.step,
                        entry.id)  # fmt: skip
            del self._buffer[entry.id]
        return None
