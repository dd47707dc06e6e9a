"""Packing never exceeds seq_len, keeps every token of every sample, and splits evenly across ranks."""

from __future__ import annotations

import numpy as np
import pytest
from gyre.codec import decode_batch, encode_batch
from gyre_orchestrator.packing import TrainSample, pack_batch
from hypothesis import given, settings
from hypothesis import strategies as st


def make_sample(i: int, length: int, prompt: int | None = None) -> TrainSample:
    rng = np.random.default_rng(i)
    prompt = max(1, length // 3) if prompt is None else prompt
    mask = np.arange(length) >= prompt
    return TrainSample(
        input_ids=rng.integers(3, 1000, size=length),
        loss_mask=mask,
        inference_logprobs=np.where(mask, -rng.random(length), 0.0),
        advantage=float(i) - 0.5,
        meta={"id": i},
    )


def unpack(batch) -> dict[int, dict[str, np.ndarray]]:
    """Sample index -> its arrays, reassembled from the rows (fails if a sample is split or doubled)."""
    found: dict[int, dict[str, np.ndarray]] = {}
    for rank in batch.micro_batches:
        for mb in rank:
            start = 0
            for idx, n in zip(mb.sample_index.tolist(), mb.sample_lengths.tolist(), strict=True):
                if batch.samples[idx].get("padding"):
                    start += n
                    continue
                assert idx not in found, f"sample {idx} appears twice"
                sl = slice(start, start + n)
                found[idx] = {
                    "input_ids": mb.input_ids[sl],
                    "loss_mask": mb.loss_mask[sl],
                    "inference_logprobs": mb.inference_logprobs[sl],
                    "advantages": mb.advantages[sl],
                    "position_ids": mb.position_ids[sl],
                }
                start += n
    return found


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    seq_len=st.integers(64, 160),
    world_size=st.integers(1, 4),
)
def test_packing_invariants(lengths, seq_len, world_size):
    samples = [make_sample(i, n) for i, n in enumerate(lengths)]
    result = pack_batch(7, samples, seq_len=seq_len, world_size=world_size, temperature=0.7)
    batch = result.batch
    assert batch.num_ranks == world_size
    assert len({len(rank) for rank in batch.micro_batches}) == 1  # same row count on every rank
    for rank in batch.micro_batches:
        for mb in rank:
            assert mb.num_tokens <= seq_len
    found = unpack(batch)
    assert sorted(found) == list(range(len(samples)))  # every sample exactly once
    for i, s in enumerate(samples):
        got = found[i]
        assert np.array_equal(got["input_ids"], s.input_ids)
        assert np.array_equal(got["loss_mask"], s.loss_mask)
        assert np.array_equal(got["inference_logprobs"], s.inference_logprobs)
        assert np.all(got["advantages"] == np.float32(s.advantage))
        assert got["position_ids"].tolist() == list(range(s.length))
        assert batch.samples[i] == {"id": i}
    assert batch.num_samples == len(samples)
    assert batch.num_loss_tokens == sum(s.num_loss_tokens for s in samples)
    pad_rows = sum(1 for rank in batch.micro_batches for mb in rank if batch.samples[mb.sample_index[0]].get("padding"))
    assert batch.num_tokens == sum(lengths) + pad_rows  # nothing added but one token per padding row
    # padding only fills slots no split can: fewer than one per rank, and only when no row holds 2 samples
    assert pad_rows < world_size
    real_rows = [
        mb for rank in batch.micro_batches for mb in rank if not batch.samples[mb.sample_index[0]].get("padding")
    ]
    assert pad_rows == 0 or all(mb.num_samples == 1 for mb in real_rows)
    assert 0 < result.efficiency <= 1
    # survives the wire
    decoded = decode_batch(encode_batch(batch))
    assert decoded.temperature == pytest.approx(0.7)
    pairs = zip(decoded.micro_batches, batch.micro_batches, strict=True)
    assert all(a.equals(b) for ra, rb in pairs for a, b in zip(ra, rb, strict=True))


def test_unsplittable_rows_get_a_padding_row():
    result = pack_batch(1, [make_sample(0, 5)], seq_len=16, world_size=2)
    batch = result.batch
    assert batch.num_samples == 1 and batch.samples[1] == {"padding": True}
    pad = [mb for rank in batch.micro_batches for mb in rank if mb.sample_index.tolist() == [1]]
    assert len(pad) == 1 and pad[0].num_tokens == 1 and pad[0].num_loss_tokens == 0


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match="empty"):
        pack_batch(1, [], seq_len=16)


def test_a_sample_the_teacher_refused_is_packed_with_its_teacher_mask_false():
    """The orchestrator's half of `teacher_mask` (gyre_orchestrator.teacher.teacher_arrays): a refused sample (None)
    has no token scored, one scored but its last token has that one unscored, a whole one needs no mask; the batch
    carries the field only when a token is unscored, padding rows included."""
    from gyre_orchestrator.teacher import teacher_arrays

    assert teacher_arrays(None, 3)[0].tolist() == [0, 0, 0] and teacher_arrays(None, 3)[1].tolist() == [False] * 3
    assert teacher_arrays([0.0, -1.0], 3)[1].tolist() == [True, True, False]
    assert teacher_arrays([0.0, -1.0, -2.0], 3)[1] is None
    samples = [make_sample(i, 6) for i in range(3)]  # one row each at seq_len 6, 2 ranks: a padding row
    for sample, values in zip(samples, [None, [0.0] * 5 + [-1.0], [0.0] * 4 + [-2.0]], strict=True):
        sample.teacher_logprobs, sample.teacher_mask = teacher_arrays(values, sample.length)
    batch = decode_batch(encode_batch(pack_batch(1, [TrainSample(**vars(s)) for s in samples], seq_len=6,
                                                 world_size=2).batch))  # fmt: skip
    masks = {int(i): mb.teacher_mask[sum(mb.sample_lengths[:k]) :][: mb.sample_lengths[k]].tolist()
             for rank in batch.micro_batches for mb in rank for k, i in enumerate(mb.sample_index)}  # fmt: skip
    assert masks == {0: [False] * 6, 1: [True] * 6, 2: [True] * 5 + [False], 3: [False]}  # 3: the padding row
    plain = pack_batch(1, [make_sample(0, 6)], seq_len=6).batch
    assert plain.micro_batches[0][0].teacher_mask is None
