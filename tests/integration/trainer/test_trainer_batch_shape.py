"""The trainer trains only batches packed to its own shape (`gyre.config.packing`): a row longer than its
`data.seq_len` is dead-lettered with a reason naming the key, and the step is trained from a well-packed entry."""

from __future__ import annotations

import pytest
from gyre.codec import encode_batch
from gyre.streams import BatchStream
from trainer_testlib import make_batch, run_in_process, trained_steps, trainer_args

pytestmark = pytest.mark.usefixtures("isolated_torch_state")
SEQ_LEN = 24  # the samples are 7 to 18 tokens: one per row fits, four in one row do not


def test_rows_longer_than_data_seq_len_are_refused_by_name(tiny_model, redis_url, unique_run_id, tmp_path):
    stream = BatchStream(redis_url, unique_run_id)
    too_long, fitting = make_batch(1, rows_per_rank=1), make_batch(1, rows_per_rank=4)
    assert max(mb.num_tokens for mb in too_long.micro_batches[0]) > SEQ_LEN
    assert max(mb.num_tokens for mb in fitting.micro_batches[0]) <= SEQ_LEN
    stream.push(1, encode_batch(too_long))  # packed for a longer seq_len than this trainer's
    stream.push(1, encode_batch(fitting))
    argv = trainer_args(tiny_model, tmp_path / "run", redis_url, unique_run_id, 1, **{"data.seq-len": SEQ_LEN})
    assert run_in_process(argv) == 0
    assert trained_steps(tmp_path / "run") == [1]
    [dead] = stream.dead_letters()
    reason = dead.fields["reason"].decode()
    assert f"longer than this trainer's data.seq_len = {SEQ_LEN}" in reason and "micro_batches[0][0]" in reason
    stream.redis.close()
