"""Two experiments with one run id on one Redis (a shared `redis.external.url`: two Helm releases of one name in two
namespaces, or a copied `experiment.run_id`). Both trainers joined the consumer group `trainer` of the same stream,
so each took, trained and acked part of the other's batches. With `redis.owner` (the chart sets `<namespace>/<release>`)
a trainer whose run id another owner holds stops at once (exit 2, naming the key) without reading a batch; the
owner's own trainer, restarted, trains them all.
"""

from __future__ import annotations

import pytest
from gyre.streams import BatchStream, owner_key
from trainer_testlib import kill_group, push_batches, start_trainer, trained_steps, trainer_args

pytestmark = pytest.mark.slow
STEPS = 2


def test_a_trainer_of_another_owner_reads_nothing_and_the_owners_trains_everything(
    tiny_model, tmp_path, redis_url, unique_run_id
):
    stream = BatchStream(redis_url, unique_run_id)
    push_batches(stream, range(1, STEPS + 1))
    stream.redis.set(owner_key(unique_run_id), "rl-a/exp")  # the experiment that pushed them
    procs = []
    try:
        other, log = tmp_path / "other", tmp_path / "other.log"
        argv = trainer_args(tiny_model, other, redis_url, unique_run_id, STEPS, **{"redis.owner": "rl-b/exp"})
        procs.append(proc := start_trainer(argv, log))
        assert proc.wait(timeout=180) == 2, log.read_text()[-3000:]
        said = log.read_text()
        assert f"redis.owner: run id '{unique_run_id}' on this Redis belongs to rl-a/exp" in said
        assert f"redis-cli DEL {owner_key(unique_run_id)}" in said and "Traceback" not in said
        assert stream.pending().count == 0 and stream.length() == STEPS  # not a batch read, taken or acked
        assert trained_steps(other) == []
        assert stream.redis.get(owner_key(unique_run_id)) == b"rl-a/exp"  # the claim stays the owner's

        own, log = tmp_path / "own", tmp_path / "own.log"
        argv = trainer_args(tiny_model, own, redis_url, unique_run_id, STEPS, **{"redis.owner": "rl-a/exp"})
        procs.append(proc := start_trainer(argv, log))
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert trained_steps(own) == list(range(1, STEPS + 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
