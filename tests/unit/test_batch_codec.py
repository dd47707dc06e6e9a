"""gyre.batch schema invariants and the gyre.codec wire format (round trip + every malformed case)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from gyre.batch import ARRAY_FIELDS, BatchError, MicroBatch, TrainBatch, expected_positions
from gyre.codec import SCHEMA_VERSION, CodecError, decode_batch, encode_batch
from hypothesis import given, settings
from hypothesis import strategies as st


def make_micro_batch(lengths: list[int], rng: np.random.Generator, first_index: int = 0) -> MicroBatch:
    samples = []
    for j, n in enumerate(lengths):
        samples.append(
            {
                "input_ids": rng.integers(-(2**31), 2**31 - 1, size=n),
                "loss_mask": (rng.random(n) < 0.5) & (np.arange(n) > 0),  # never the first token
                "advantages": rng.standard_normal(n),
                "inference_logprobs": -rng.random(n) * 5,
                "sample_index": first_index + j,
            }
        )
    return MicroBatch.from_samples(samples)


def make_batch(step: int = 3, layout: list[list[list[int]]] | None = None, seed: int = 0) -> TrainBatch:
    """layout[rank][micro_batch] = sample lengths of that row."""
    layout = layout or [[[3, 2], [4]], [[1, 1, 1], [5]]]
    rng = np.random.default_rng(seed)
    ranks, index = [], 0
    for rank_layout in layout:
        rank = []
        for lengths in rank_layout:
            rank.append(make_micro_batch(lengths, rng, index))
            index += len(lengths)
        ranks.append(rank)
    samples = [{"reward": float(i % 2), "env": "gsm8k", "min_version": 1, "max_version": 2} for i in range(index)]
    loss_tokens = sum(mb.num_loss_tokens for rank in ranks for mb in rank)
    return TrainBatch(
        step=step,
        micro_batches=ranks,
        samples=samples,
        num_loss_tokens=loss_tokens,
        num_samples=index,
        temperature=0.7,
        max_tokens=48,
    )


def assert_same(a: TrainBatch, b: TrainBatch) -> None:
    assert (a.step, a.samples, a.num_loss_tokens, a.num_samples, a.created, a.temperature, a.max_tokens) == (
        b.step,
        b.samples,
        b.num_loss_tokens,
        b.num_samples,
        b.created,
        b.temperature,
        b.max_tokens,
    )
    assert [len(r) for r in a.micro_batches] == [len(r) for r in b.micro_batches]
    for ra, rb in zip(a.micro_batches, b.micro_batches, strict=True):
        for ma, mb in zip(ra, rb, strict=True):
            assert ma.equals(mb)
            for name, dtype in ARRAY_FIELDS.items():
                assert getattr(mb, name).dtype == dtype


# ---- schema -------------------------------------------------------------------------------------


def test_positions_restart_at_every_sample():
    assert expected_positions(np.array([2, 3, 1])).tolist() == [0, 1, 0, 1, 2, 0]
    assert expected_positions(np.array([], dtype=np.int32)).tolist() == []


def test_micro_batch_counts_and_positions():
    mb = make_micro_batch([3, 2], np.random.default_rng(1))
    assert mb.num_tokens == 5 and mb.num_samples == 2
    assert mb.num_loss_tokens == int(mb.loss_mask.sum())
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 1]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda mb: setattr(mb, "input_ids", mb.input_ids.astype(np.int64)), "dtype"),
        (lambda mb: setattr(mb, "loss_mask", mb.loss_mask[:-1]), "length"),
        (lambda mb: setattr(mb, "advantages", mb.advantages.reshape(1, -1)), "1-D"),
        (lambda mb: setattr(mb, "position_ids", np.arange(5, dtype=np.int32)), "position_ids"),
        (lambda mb: setattr(mb, "sample_lengths", np.array([3, 3], dtype=np.int32)), "sum"),
        (lambda mb: setattr(mb, "sample_lengths", np.array([5, 0], dtype=np.int32)), "at least one token"),
        (lambda mb: setattr(mb, "sample_index", np.array([0], dtype=np.int32)), "sample_index"),
        (lambda mb: setattr(mb, "inference_logprobs", [0.0] * 5), "numpy array"),
        (lambda mb: mb.loss_mask.__setitem__(3, True), "first token"),
    ],
)
def test_micro_batch_validate_rejects(mutate, message):
    mb = make_micro_batch([3, 2], np.random.default_rng(2))
    mutate(mb)
    with pytest.raises(BatchError, match=message):
        mb.validate()


def test_train_batch_validate_and_for_rank():
    batch = make_batch().validate()
    assert batch.num_ranks == 2
    assert batch.for_rank(1) is batch.micro_batches[1]
    assert batch.num_tokens == 5 + 4 + 3 + 5
    with pytest.raises(BatchError, match="no rank 2"):
        batch.for_rank(2)

    uneven = make_batch(layout=[[[2]], [[1], [1]]])
    with pytest.raises(BatchError, match="same number of micro batches"):
        uneven.validate()

    out_of_range = make_batch()
    out_of_range.samples = out_of_range.samples[:3]
    with pytest.raises(BatchError, match="out of range"):
        out_of_range.validate()

    with pytest.raises(BatchError, match="step"):
        TrainBatch(step=-1, micro_batches=[[]]).validate()
    for bad in (0.0, -1.0, float("nan"), float("inf"), "1.0"):
        with pytest.raises(BatchError, match="temperature"):
            TrainBatch(step=1, micro_batches=[[]], temperature=bad).validate()


# ---- codec round trip ---------------------------------------------------------------------------


def test_round_trip_preserves_everything():
    batch = make_batch(step=7, seed=3)
    batch.micro_batches[0][0].advantages[0] = np.nan  # bit-exact, even NaN and inf
    batch.micro_batches[0][0].advantages[1] = -np.inf
    decoded = decode_batch(encode_batch(batch))
    assert_same(batch, decoded)
    decoded.micro_batches[0][0].input_ids[0] += 1  # arrays are writable copies
    assert decoded.micro_batches[0][0].input_ids[0] != batch.micro_batches[0][0].input_ids[0]


def test_encode_rejects_non_native_byte_order():
    batch = make_batch()
    mb = batch.micro_batches[0][0]
    mb.advantages = mb.advantages.astype(">f4")  # big-endian float32 is a different dtype
    with pytest.raises(CodecError, match="dtype"):
        encode_batch(batch)


layouts = st.lists(  # ranks
    st.lists(st.lists(st.integers(1, 12), min_size=0, max_size=4), min_size=0, max_size=3),  # micro batches
    min_size=1,
    max_size=3,
).map(lambda ranks: [r[: min(len(x) for x in ranks)] for r in ranks])  # same count per rank


@settings(max_examples=60, deadline=None)
@given(layout=layouts, step=st.integers(0, 2**40), seed=st.integers(0, 2**32 - 1))
def test_round_trip_property(layout, step, seed):
    batch = make_batch(step=step, layout=layout, seed=seed)
    assert_same(batch, decode_batch(encode_batch(batch)))


# ---- malformed input ----------------------------------------------------------------------------


def tamper(data: bytes, edit) -> bytes:
    doc = msgpack.unpackb(data, raw=False)
    edit(doc)
    return msgpack.packb(doc, use_bin_type=True)


def first_mb(doc):
    return doc["micro_batches"][0][0]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(schema=SCHEMA_VERSION + 1), "schema version"),
        (lambda d: d.pop("schema"), "schema"),
        (lambda d: d.pop("samples"), "missing keys"),
        (lambda d: d.pop("num_loss_tokens"), "missing keys"),
        (lambda d: d.update(extra=1), "unknown keys"),
        (lambda d: d.update(step="3"), "step"),
        (lambda d: d.update(step=True), "step"),
        (lambda d: d.update(created="now"), "created"),
        (lambda d: d.pop("temperature"), "missing keys"),
        (lambda d: d.update(temperature=None), "temperature"),
        (lambda d: d.update(temperature=0.0), "temperature"),
        (lambda d: d.update(max_tokens="16"), "max_tokens"),
        (lambda d: d.update(max_tokens=-1), "max_tokens"),
        (lambda d: d.update(samples={"a": 1}), "samples"),
        (lambda d: d.update(micro_batches=[1]), "list of lists"),
        (lambda d: first_mb(d).pop("loss_mask"), "fields"),
        (lambda d: first_mb(d)["input_ids"].update(dtype="<i8"), "dtype"),
        (lambda d: first_mb(d)["input_ids"].update(dtype="|O"), "dtype"),
        (lambda d: first_mb(d)["input_ids"].update(shape=[1, 5]), "shape"),
        (lambda d: first_mb(d)["input_ids"].update(shape=[-5]), "shape"),
        (lambda d: first_mb(d)["input_ids"].update(data=first_mb(d)["input_ids"]["data"][:-4]), "bytes do not hold"),
        (lambda d: first_mb(d)["input_ids"].update(data="text"), "must be bytes"),
        (lambda d: first_mb(d).update(input_ids=[1, 2]), "map with dtype"),
        # consistent arrays, inconsistent lengths between them
        (
            lambda d: first_mb(d)["loss_mask"].update(data=first_mb(d)["loss_mask"]["data"][:-1], shape=[4]),
            "length",
        ),
        (
            lambda d: first_mb(d)["sample_lengths"].update(
                data=np.array([4, 2], dtype="<i4").tobytes(),
            ),
            "sum",
        ),
        (lambda d: d.update(samples=d["samples"][:2]), "out of range"),
    ],
)
def test_malformed_documents_raise_codec_error(edit, message):
    data = tamper(encode_batch(make_batch()), edit)
    with pytest.raises(CodecError, match=message) as info:
        decode_batch(data)
    assert info.value.reason == str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_batch_without_the_generation_budget_still_decodes():
    """`max_tokens` came after schema 1: a batch without it decodes with 0 (unknown)."""
    decoded = decode_batch(tamper(encode_batch(make_batch()), lambda d: d.pop("max_tokens")))
    assert decoded.max_tokens == 0
    assert decode_batch(encode_batch(make_batch())).max_tokens == 48


def test_truncated_bytes_raise_codec_error():
    data = encode_batch(make_batch())
    rng = np.random.default_rng(0)
    for cut in sorted({0, 1, 2, len(data) - 1, *rng.integers(1, len(data), size=40).tolist()}):
        with pytest.raises(CodecError):
            decode_batch(data[:cut])


def test_garbage_and_trailing_bytes_raise_codec_error():
    data = encode_batch(make_batch())
    with pytest.raises(CodecError, match="msgpack"):
        decode_batch(data + b"\x00")  # extra data after the document
    with pytest.raises(CodecError):
        decode_batch(bytes(np.random.default_rng(5).integers(0, 256, 300, dtype=np.uint8)))
    with pytest.raises(CodecError, match="top level"):
        decode_batch(msgpack.packb([1, 2, 3]))
    with pytest.raises(CodecError, match="expected bytes"):
        decode_batch("not bytes")  # type: ignore[arg-type]


def test_flipped_bytes_never_escape_as_other_errors():
    """Random single-byte corruption either still decodes to a valid batch or raises CodecError."""
    data = bytearray(encode_batch(make_batch()))
    rng = np.random.default_rng(11)
    outcomes = {"decoded": 0, "rejected": 0}
    for pos in rng.integers(0, len(data), size=200):
        corrupt = bytearray(data)
        corrupt[pos] ^= int(rng.integers(1, 256))
        try:
            decode_batch(bytes(corrupt)).validate()  # e.g. a flipped payload byte: still a valid batch
            outcomes["decoded"] += 1
        except CodecError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 0 and outcomes["decoded"] > 0


def test_encoding_an_invalid_batch_raises_codec_error():
    batch = make_batch()
    batch.micro_batches[0][0].position_ids[1] = 7
    with pytest.raises(CodecError, match="position_ids"):
        encode_batch(batch)
    batch = make_batch()
    batch.samples[0]["bad"] = object()
    with pytest.raises(CodecError, match="cannot encode"):
        encode_batch(batch)


# ---- optional per-token arrays (teacher log-probs for on-policy distillation) ---------------------------


def with_teacher(batch: TrainBatch, seed: int = 5) -> TrainBatch:
    rng = np.random.default_rng(seed)
    for rank in batch.micro_batches:
        for mb in rank:
            mb.teacher_logprobs = np.where(mb.loss_mask, -rng.random(mb.num_tokens) * 4, 0.0).astype(np.float32)
    return batch


def test_teacher_logprobs_round_trip_bit_exact():
    batch = with_teacher(make_batch(step=9))
    assert batch.validate().has_teacher and not make_batch().has_teacher
    decoded = decode_batch(encode_batch(batch))
    assert_same(batch, decoded)
    assert decoded.has_teacher
    for ra, rb in zip(batch.micro_batches, decoded.micro_batches, strict=True):
        for ma, mb in zip(ra, rb, strict=True):
            assert mb.teacher_logprobs.dtype == np.float32
            assert mb.teacher_logprobs.tobytes() == ma.teacher_logprobs.tobytes()
    plain = decode_batch(encode_batch(make_batch()))  # a batch without them: as before, the field is None
    assert all(mb.teacher_logprobs is None for rank in plain.micro_batches for mb in rank)
    assert not plain.micro_batches[0][0].equals(batch.micro_batches[0][0])


def test_a_batch_written_before_teacher_logprobs_still_decodes():
    """The wire format of schema 1 as it shipped (every micro batch exactly ARRAY_FIELDS) is unchanged."""
    batch = make_batch()
    data = encode_batch(batch)
    doc = msgpack.unpackb(data, raw=False)
    assert all(set(mb) == set(ARRAY_FIELDS) for rank in doc["micro_batches"] for mb in rank)
    assert doc["schema"] == SCHEMA_VERSION == 1
    assert_same(batch, decode_batch(data))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: setattr(b.micro_batches[0][0], "teacher_logprobs", np.zeros(2, np.float32)), "length"),
        (lambda b: setattr(b.micro_batches[0][0], "teacher_logprobs", np.zeros(5, np.float64)), "dtype"),
        (lambda b: setattr(b.micro_batches[1][1], "teacher_logprobs", None), "same ones"),
    ],
)
def test_teacher_logprobs_are_checked(mutate, message):
    batch = with_teacher(make_batch())
    mutate(batch)
    with pytest.raises(BatchError, match=message):
        batch.validate()
    with pytest.raises(CodecError, match=message):
        encode_batch(batch)


def test_a_malformed_teacher_array_is_a_codec_error():
    data = encode_batch(with_teacher(make_batch()))
    edit = lambda d: d["micro_batches"][0][0]["teacher_logprobs"].update(shape=[99])  # noqa: E731
    with pytest.raises(CodecError, match="teacher_logprobs"):
        decode_batch(tamper(data, edit))
    unknown = lambda d: first_mb(d).update(student_logprobs=first_mb(d)["advantages"])  # noqa: E731
    with pytest.raises(CodecError, match="optionally"):
        decode_batch(tamper(data, unknown))


def with_teacher_mask(batch: TrainBatch) -> TrainBatch:
    """Teacher log-probs, and a `teacher_mask` False on the batch's first sample (one the teacher refused)."""
    batch = with_teacher(batch)
    for rank in batch.micro_batches:
        for mb in rank:
            mb.teacher_mask = np.ones(mb.num_tokens, np.bool_)
            if mb.sample_index[0] == 0:
                mb.teacher_logprobs[: mb.sample_lengths[0]] = 0.0
                mb.teacher_mask[: mb.sample_lengths[0]] = False
    return batch


def test_teacher_mask_round_trips_and_is_left_out_when_absent():
    batch = with_teacher_mask(make_batch(step=4)).validate()
    decoded = decode_batch(encode_batch(batch))
    assert_same(batch, decoded)
    for ra, rb in zip(batch.micro_batches, decoded.micro_batches, strict=True):
        for ma, mb in zip(ra, rb, strict=True):
            assert mb.teacher_mask.dtype == np.bool_ and np.array_equal(mb.teacher_mask, ma.teacher_mask)
    assert not decoded.micro_batches[0][0].teacher_mask[:3].any()
    # a batch whose teacher scored every token carries no mask: the wire format older trainers read
    doc = msgpack.unpackb(encode_batch(with_teacher(make_batch())), raw=False)
    assert all("teacher_mask" not in mb for rank in doc["micro_batches"] for mb in rank)
    assert decode_batch(encode_batch(with_teacher(make_batch()))).micro_batches[0][0].teacher_mask is None


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: setattr(b.micro_batches[0][0], "teacher_mask", np.ones(2, np.bool_)), "teacher_mask: length"),
        (lambda b: setattr(b.micro_batches[0][0], "teacher_mask", np.ones(5, np.float32)), "teacher_mask: expected"),
        (lambda b: setattr(b.micro_batches[1][1], "teacher_mask", None), "same ones"),
        (lambda b: [setattr(mb, "teacher_logprobs", None) for r in b.micro_batches for mb in r], "without teacher_log"),
    ],
)
def test_teacher_mask_is_checked(mutate, message):
    batch = with_teacher_mask(make_batch())
    mutate(batch)
    with pytest.raises(BatchError, match=message):
        batch.validate()
    with pytest.raises(CodecError, match=message):
        encode_batch(batch)
