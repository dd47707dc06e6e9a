"""`log.format = "json"`: every service's real output is one JSON object per line (docs/kubernetes.md, "Logs").

Real processes, read line by line as a log collector reads a container's output: a line that is not one JSON
object (a plain ready line, a traceback's continuation, a bare print) fails `json.loads`.
- trainer: two torchrun ranks, the format set by the environment (GYRE_LOG__FORMAT, a container's form), which
  every rank inherits; the per-step line carries `step`.
- inference: `--log.format json`, with uvicorn's own records, the ready line launchers wait for, and a stop.
- orchestrator: one step against that replica, its pushed-step line carrying `step`.
- `gyre rl --log.format json`: the three services' log files, while the launcher's own lines stay text.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.streams import BatchStream
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_testlib import REPO, child_env, push_batches, torchrun, trainer_args  # noqa: E402

pytestmark = pytest.mark.slow
FIELDS = {"time", "level", "severity", "service", "logger", "message"}


def json_records(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{path.name} line {number} is not JSON: {line!r}")
    assert records and all(set(r) >= FIELDS for r in records), records[:3]
    return records


def test_trainer_ranks_log_json(tiny_model, redis_url, unique_run_id, tmp_path):
    push_batches(BatchStream(redis_url, unique_run_id), (1,), ranks=2, rows_per_rank=1)
    log_path = tmp_path / "torchrun.log"
    argv = trainer_args(tiny_model, tmp_path / "run", redis_url, unique_run_id, 1, **{"data.micro-batch-size": 1})
    assert torchrun(argv, log_path, env=child_env() | {"GYRE_LOG__FORMAT": "json"}) == 0, log_path.read_text()[-3000:]
    records = json_records(log_path)
    assert {r["service"] for r in records} == {"trainer", "trainer-rank1"}
    assert {r["run_id"] for r in records} == {unique_run_id}
    assert [r["step"] for r in records if r["message"].startswith("step 1:")] == [1]


def test_inference_and_orchestrator_log_json(start_inference, tiny_model, redis_url, unique_run_id, tmp_path):
    server = start_inference("--log.format", "json", "--run-id", unique_run_id)  # its ready line came as JSON
    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=server.model_name, prompt="hi", max_tokens=2)

    orchestrator_log = tmp_path / "orchestrator.log"
    argv = [sys.executable, "-m", "gyre.cli", "orchestrator", "--log.format", "json", "--run-id", unique_run_id,
            "--output-dir", str(tmp_path / "run"), "--redis.url", redis_url, "--max-steps", "1",
            "--batch-size", "2", "--rollouts-per-example", "2", "--sampling.max-tokens", "8", "--batch.seq-len", "256",
            "--server.port", "0", "--metrics.port", "0", "--final-weights-timeout-s", "0",
            "--inference.urls", server.url, "--inference.control-urls", server.control]  # fmt: skip
    with orchestrator_log.open("wb") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=300,
                              env=child_env())  # fmt: skip
    assert proc.returncode == 0, orchestrator_log.read_text()[-3000:]
    assert server.stop() == 0

    served = json_records(server.log_path)
    assert {r["service"] for r in served} == {"inference"} and {r["run_id"] for r in served} == {unique_run_id}
    assert any(r["message"].startswith("ready: http://") for r in served)
    assert any(r["logger"].startswith("uvicorn") for r in served)  # uvicorn's records reach the same handler
    pushed = [r for r in json_records(orchestrator_log) if r["message"].startswith("pushed step")]
    assert [(r["service"], r["run_id"], r["step"]) for r in pushed] == [("orchestrator", unique_run_id, 1)]


def test_gyre_rl_services_log_json_its_own_lines_stay_text(tmp_path):
    # the launcher finds each replica's ready line inside its JSON record, and its terminal output stays text
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre.cli", "rl", "@", str(REPO / "configs" / "ci.toml"), "--output-dir", str(out),
           "--max-steps", "1", "--log.format", "json"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]
    for service in ("inference", "orchestrator", "trainer"):
        assert {r["service"] for r in json_records(out / "logs" / f"{service}.log")} == {service}
    assert "steps trained" in res.stdout and not any(line.startswith("{") for line in res.stdout.splitlines())
