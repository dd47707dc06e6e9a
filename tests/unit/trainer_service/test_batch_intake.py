"""BatchIntake on a real Redis: strict order, dead letters, ack only on commit, restart takeover."""

from __future__ import annotations

import numpy as np
import pytest
from gyre.batch import MicroBatch, TrainBatch
from gyre.codec import encode_batch
from gyre.streams import BatchStream
from gyre_trainer.intake import BatchIntake, BatchRejected, check_trainable


def batch(step: int, *, ranks: int = 1, token: int = 7, advantage: float = 1.0) -> TrainBatch:
    sample = {
        "input_ids": [3, 4, token, token],
        "loss_mask": [False, False, True, True],
        "advantages": [advantage] * 4,
        "inference_logprobs": [0.0, 0.0, -1.0, -2.0],
        "sample_index": 0,
    }
    mbs = [[MicroBatch.from_samples([sample])] for _ in range(ranks)]
    return TrainBatch(step=step, micro_batches=mbs, samples=[{}], num_loss_tokens=2 * ranks, num_samples=ranks)


@pytest.fixture
def stream(redis_url, unique_run_id):
    s = BatchStream(redis_url, unique_run_id)
    yield s
    s.redis.delete(s.key, s.dead_key)
    s.redis.close()


def intake(ctx, stream, trained=0):
    return BatchIntake(ctx, stream, trained, vocab_size=1024, poll_ms=50, reclaim_every_s=0.2)


def never():
    return False


def next_with_deadline(intake_, seconds=3.0):
    """next(), but give up (stop) after `seconds` so a test cannot hang."""
    import time

    deadline = time.monotonic() + seconds
    return intake_.next(lambda: time.monotonic() > deadline)


def test_steps_come_in_order_and_are_acked_only_on_commit(ctx, stream):
    for step in (2, 3, 1):
        stream.push(step, encode_batch(batch(step)))
    reader = intake(ctx, stream)
    got = []
    for _ in range(3):
        item = next_with_deadline(reader)
        got.append(item.step)
        assert stream.pending().count == 3 - len(got) + 1  # the delivered entry is still pending
        reader.commit(item)
    assert got == [1, 2, 3]
    assert stream.pending().count == 0
    assert next_with_deadline(reader, 0.3) is None  # step 4 is missing: waited for, never skipped


def test_malformed_entries_are_dead_lettered_and_training_continues(ctx, stream, tmp_path):
    stream.redis.xadd(stream.key, {"step": "1", "schema": "1", "payload": b"\x93garbage"})
    stream.redis.xadd(stream.key, {"step": "x", "schema": "1", "payload": b""})
    stream.push(1, encode_batch(batch(1)), schema=9)  # a schema this trainer does not know
    stream.push(1, encode_batch(batch(2)))  # entry says 1, batch says 2
    stream.push(1, encode_batch(batch(1, ranks=2)))  # split for 2 ranks, trainer has 1
    stream.push(1, encode_batch(batch(1, token=5000)))  # token outside the vocabulary
    stream.push(1, encode_batch(batch(1, advantage=float("nan"))))
    stream.push(1, encode_batch(batch(1)), path_threshold=10, spill_dir=tmp_path)  # the good one, spilled to a file
    reader = intake(ctx, stream)
    item = next_with_deadline(reader)
    assert item.step == 1 and item.batch.micro_batches[0][0].input_ids.tolist() == [3, 4, 7, 7]
    reasons = [d.fields["reason"].decode() for d in stream.dead_letters()]
    # every dead letter is counted (gyre_trainer_rejected_batches_total), also those the StepReader judged itself
    # (step, schema): it counted 5 of 7, and a stream of unknown schema looked clean on the dashboard
    assert len(reasons) == 7 and reader.rejected == 7
    for expected in ("not a msgpack document", "unparsable step", "unsupported schema '9'", "batch says step 2",
                     "2 ranks", "vocabulary", "NaN"):  # fmt: skip
        assert any(expected in r for r in reasons), (expected, reasons)


def test_spill_paths_that_are_not_file_names_are_dead_lettered_not_a_crash_loop(ctx, stream):
    # audit: a path field that is not UTF-8 or holds a NUL byte raised UnicodeDecodeError / ValueError out of
    # intake, killing the trainer; the restarted trainer reclaimed the same entry and died again
    for path in (b"\xff\xfe.bin", b"/tmp/step\x001.bin"):
        stream.redis.xadd(stream.key, {"step": "1", "schema": "1", "path": path, "digest": "00"})
    stream.push(1, encode_batch(batch(1)))
    item = next_with_deadline(intake(ctx, stream))
    assert item.step == 1
    reasons = [d.fields["reason"].decode() for d in stream.dead_letters()]
    assert len(reasons) == 2 and all("cannot read spilled payload" in r for r in reasons), reasons


def test_an_entry_with_a_binary_field_name_is_dead_lettered(ctx, stream):
    # audit: a field name that is not UTF-8 raised out of the stream reader (trainer crash loop) and out of
    # the orchestrator's resume scan (steps_after: it could not start)
    bad = stream.redis.xadd(stream.key, {b"\xff": b"x", "step": "1", "schema": "1", "payload": b"junk"})
    assert stream.steps_after(0) == [1]
    stream.push(1, encode_batch(batch(1)))
    item = next_with_deadline(intake(ctx, stream))
    assert item.step == 1
    assert [d.fields["original_id"] for d in stream.dead_letters()] == [bad]


def test_restarted_trainer_takes_over_pending_and_skips_trained_steps(ctx, stream):
    for step in (1, 2, 3):
        stream.push(step, encode_batch(batch(step)))
    first = intake(ctx, stream)
    item1 = next_with_deadline(first)
    first.commit(item1)
    next_with_deadline(first)  # step 2 delivered, then the trainer "dies" before committing it
    assert stream.pending().count == 2  # 2 delivered-not-acked, 3 read into the buffer
    # the new incarnation resumes after step 2 (it was published before the crash, not acked)
    second = intake(ctx, stream, trained=2)
    item3 = next_with_deadline(second)
    assert item3.step == 3
    second.commit(item3)
    assert stream.pending().count == 0  # the replay of step 2 was acked and skipped


def test_check_trainable_names_the_problem():
    with pytest.raises(BatchRejected, match="split for 2 ranks"):
        check_trainable(batch(1, ranks=2), world_size=1, vocab_size=1024)
    with pytest.raises(BatchRejected, match=r"\[0, 7\)"):
        check_trainable(batch(1, token=7), world_size=1, vocab_size=7)
    b = batch(1)
    b.micro_batches[0][0].inference_logprobs[2] = np.inf
    with pytest.raises(BatchRejected, match="inference_logprobs contains NaN or infinity"):
        check_trainable(b, world_size=1, vocab_size=1024)
    check_trainable(batch(1), world_size=1, vocab_size=1024)


def test_batch_with_wrong_normalisers_is_dead_lettered_not_a_crash_loop(ctx, stream):
    # audit: num_loss_tokens below the batch's own loss tokens passed intake and made train_step raise
    # ValueError, killing the trainer; the restarted trainer reclaimed the same entry and died again
    bad = batch(1)
    bad.num_loss_tokens = 1  # the row has 2 loss tokens
    with pytest.raises(BatchRejected, match="num_loss_tokens=1"):
        check_trainable(bad, world_size=1, vocab_size=1024)
    no_samples = batch(1)
    no_samples.num_samples = 0
    with pytest.raises(BatchRejected, match="num_samples=0"):
        check_trainable(no_samples, world_size=1, vocab_size=1024)
    two_ranks = batch(1, ranks=2)
    two_ranks.num_loss_tokens = 3  # each rank alone has 2 (fine for step.py's per-rank check), together 4
    with pytest.raises(BatchRejected, match="num_loss_tokens=3"):
        check_trainable(two_ranks, world_size=2, vocab_size=1024)
    # counts above the batch's own (or fewer samples) scaled the gradient silently: the loss divides by them
    for name, value in (("num_loss_tokens", 3), ("num_samples", 2)):
        scaled = batch(1)
        setattr(scaled, name, value)
        with pytest.raises(BatchRejected, match=f"{name}={value}.* not the batch's own 2 loss tokens and 1 samples"):
            check_trainable(scaled, world_size=1, vocab_size=1024)
    two_ranks.num_loss_tokens, two_ranks.num_samples = 4, 1  # one sample on each rank: 2
    with pytest.raises(BatchRejected, match="num_samples=1"):
        check_trainable(two_ranks, world_size=2, vocab_size=1024)
    stream.push(1, encode_batch(bad))
    stream.push(1, encode_batch(batch(1)))
    item = next_with_deadline(intake(ctx, stream))
    assert item.step == 1 and item.batch.num_loss_tokens == 2
    assert "num_loss_tokens=1" in stream.dead_letters()[0].fields["reason"].decode()


def test_defect_9_stop_is_honoured_while_redis_is_down(ctx, unique_run_id):
    # issue 17, defect 9: the intake retried a dead Redis forever and ignored SIGTERM (the stop flag)
    import threading
    import time

    from gyre.net import free_port

    dead = BatchStream(f"redis://127.0.0.1:{free_port()}/0", unique_run_id)  # nothing listens there
    stop = threading.Event()
    result = {}

    def run():
        taken = BatchIntake(ctx, dead, 0, vocab_size=1024, poll_ms=50, redis_retry_s=0.2, should_stop=stop.is_set)
        result["item"] = taken.next(stop.is_set)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.0)  # several retries against the dead port
    assert thread.is_alive()
    stopped_at = time.monotonic()
    stop.set()
    thread.join(timeout=3)
    assert not thread.is_alive(), "intake did not stop while Redis was down"
    assert time.monotonic() - stopped_at < 1.5
    assert result["item"] is None


def test_padding_rows_of_the_packer_are_no_samples():
    """The orchestrator's packer fills a rank without a sample with a padding row (one token, metadata
    {"padding": true}); num_samples counts real samples only, and such a batch is trainable."""
    from gyre_orchestrator.packing import TrainSample, pack_batch

    one = TrainSample(input_ids=[3, 4, 5], loss_mask=[False, True, True], inference_logprobs=[0.0, -1.0, -1.0],
                      advantage=1.0)  # fmt: skip
    packed = pack_batch(1, [one], seq_len=16, world_size=2).batch
    assert packed.num_samples == 1 and any(s.get("padding") for s in packed.samples)
    check_trainable(packed, world_size=2, vocab_size=1024)
    packed.num_samples = 2  # the padding row counted as a sample
    with pytest.raises(BatchRejected, match="num_samples=2"):
        check_trainable(packed, world_size=2, vocab_size=1024)
