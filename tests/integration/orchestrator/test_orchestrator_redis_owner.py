"""Two experiments with one run id on one Redis (a shared `redis.external.url`: two Helm releases of one name in two
namespaces, or a copied `experiment.run_id`): both orchestrators found the stream theirs and pushed into it, and their
trainers trained each other's batches. With `redis.owner` (the chart sets `<namespace>/<release>`) a real
`gyre orchestrator` whose run id another owner holds stops at start (exit 2, one line naming the key) before it
touches the stream; the owner's own orchestrator pushes as before.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from gyre.streams import BatchStream, owner_key
from orchestrator_testlib import orchestrator_config

pytestmark = pytest.mark.timeout(300)


def run_orchestrator(cfg, tmp_path) -> tuple[int, str]:
    from gyre.config import to_toml

    path = tmp_path / f"orchestrator-{cfg.redis.owner.replace('/', '-')}.toml"
    path.write_text(to_toml(cfg))
    cmd = [sys.executable, "-m", "gyre.cli", "orchestrator", "@", str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return res.returncode, res.stdout + res.stderr


def test_an_orchestrator_of_another_owner_pushes_nothing_and_the_owners_pushes(
    tmp_path, redis_url, unique_run_id, replicas
):
    stream = BatchStream(redis_url, unique_run_id)
    stream.redis.set(owner_key(unique_run_id), "rl-a/exp")  # the experiment that runs under this id
    try:
        other = orchestrator_config(tmp_path / "b", redis_url, unique_run_id, replicas, max_steps=1,
                                    redis={"owner": "rl-b/exp"})  # fmt: skip
        code, said = run_orchestrator(other, tmp_path)
        assert code == 2, said[-3000:]
        assert f"redis.owner: run id '{unique_run_id}' on this Redis belongs to rl-a/exp" in said
        assert "Traceback" not in said
        assert stream.length() == 0 and not stream.redis.exists(f"gyre:{unique_run_id}:batches:pushed")
        assert stream.redis.get(owner_key(unique_run_id)) == b"rl-a/exp"

        own = orchestrator_config(tmp_path / "a", redis_url, unique_run_id, replicas, max_steps=1,
                                  redis={"owner": "rl-a/exp"})  # fmt: skip
        code, said = run_orchestrator(own, tmp_path)
        assert code == 0, said[-3000:]
        assert stream.length() == 1 and stream.latest_step() == 1
    finally:
        stream.redis.delete(stream.key, stream.dead_key, owner_key(unique_run_id))
        stream.redis.close()
