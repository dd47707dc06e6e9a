"""Tasks whose prompt does not fit the model's context, against a real replica serving a 64-token context.

The server refuses such a request with a 400 `context_length_exceeded`. A training run skips the task, counts it
(`skipped_overlong` in the step's line, `gyre_orchestrator_skipped_overlong_tasks_total`) and draws another; only a
split whose tasks (nearly) never fit stops the run, naming what to change. An eval leaves such tasks out and counts
them. (A later turn of a multi-turn episode that no longer fits ends the episode as a length stop:
`test_orchestrator_env_rollouts.py::test_a_turn_past_the_context_ends_the_episode`.)
"""

from __future__ import annotations

import asyncio
import json

import pytest
from gyre.envs import SamplingParams, load_environment
from gyre.events import read_events
from gyre_orchestrator.client import InferenceClient, close_replica_clients
from gyre_orchestrator.eval_command import main as eval_main
from gyre_orchestrator.evaluate import evaluate
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from gyre_orchestrator.service import OrchestratorService
from orchestrator_testlib import first_batch, orchestrator_config
from prometheus_client import generate_latest

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

CONTEXT = 64
SHORT = "ab"
LONG = "the quick brown fox jumps over the lazy dog " * 8  # far more than 64 tokens


@pytest.fixture(scope="module")
def short_context_replica(start_replica):
    return start_replica("--engine.max-model-len", str(CONTEXT))


def dataset(tmp_path, train: list[str], evals: tuple[str, ...] = ("cd",)) -> dict:
    path = tmp_path / "mixed.jsonl"
    rows = [{"prompt": p, "answer": "x"} for p in train]
    rows += [{"prompt": p, "answer": "x", "split": "eval"} for p in evals]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"name": "dataset", "args": {"path": str(path)}}


def config(tmp_path, redis_url, run_id, replica, env):
    return orchestrator_config(
        tmp_path, redis_url, run_id, [replica], env=env, max_steps=1, batch_size=2, rollouts_per_example=2,
        sampling={"max_tokens": 8}, advantage={"drop_zero_signal": False},
    )  # fmt: skip


async def test_a_prompt_too_long_is_skipped_counted_and_replaced(
    tmp_path, redis_url, unique_run_id, short_context_replica, tiny_model
):
    # one task of six fits: its two groups of the batch come from two epochs of the split, every other draw is
    # refused and skipped (before: retried 3 times, then the run died)
    cfg = config(tmp_path, redis_url, unique_run_id, short_context_replica, dataset(tmp_path, [SHORT] + [LONG] * 5))
    batch = await first_batch(cfg, tiny_model)
    assert batch.num_samples == 4
    assert {s["task_id"] for s in batch.samples} == {"row-0"}
    (line,) = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")
    assert line["skipped_overlong"] >= 5 and line["failed_rollouts"] == 0 and line["generated_groups"] == 2


async def test_a_split_that_never_fits_stops_the_run_naming_the_settings(
    tmp_path, redis_url, unique_run_id, short_context_replica
):
    cfg = config(tmp_path, redis_url, unique_run_id, short_context_replica, dataset(tmp_path, [LONG] * 3))
    service = OrchestratorService(cfg)
    with pytest.raises(RuntimeError) as caught:
        await service.run()
    message = str(caught.value)
    assert "tasks drawn were all too long for the model's context" in message
    assert f"maximum context length is {CONTEXT} tokens" in message  # the server's numbers
    assert "sampling.max_tokens" in message and "max_model_len" in message
    text = generate_latest(service.metrics.registry).decode()
    assert "gyre_orchestrator_skipped_overlong_tasks_total" in text
    # a mix entry with its own length: that key is named (it was sampling.max_tokens, which the entry does not read)
    entry = {**dataset(tmp_path, [LONG] * 3), "sampling": {"max_tokens": 8}}
    (tmp_path / "mix").mkdir()
    cfg = config(tmp_path / "mix", redis_url, f"{unique_run_id}-mix", short_context_replica, [entry])
    with pytest.raises(RuntimeError) as caught:
        await OrchestratorService(cfg).run()
    assert "prompt plus env.0.sampling.max_tokens" in str(caught.value), caught.value


async def test_an_eval_leaves_out_tasks_too_long_and_counts_them(tmp_path, short_context_replica):
    # eval prompts apart from the train prompt: a train row that repeats an eval prompt is left out of training
    env = load_environment("dataset", **dataset(tmp_path, [SHORT], evals=["ef", LONG, "cd"])["args"])
    replicas = ReplicaSet([Endpoint(short_context_replica.url, short_context_replica.control)])
    client = InferenceClient(replicas, timeout_s=60)
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    try:
        result = await evaluate(env, client, env_name="dataset", num_examples=3, k=2, sampling=sampling)
        only_long = load_environment("dataset", **dataset(tmp_path, [SHORT], evals=[LONG])["args"])
        with pytest.raises(RuntimeError, match="none of the 1 eval tasks fits the model's context"):
            await evaluate(only_long, client, env_name="dataset", num_examples=1, k=2, sampling=sampling)
    finally:
        await close_replica_clients(list(replicas))
    assert result.num_examples == 2 and result.skipped_overlong == 1
    assert result.record(step=0)["skipped_overlong"] == 1


async def test_gyre_eval_with_no_task_that_fits_says_so_in_one_line(tmp_path, short_context_replica, capsys):
    env = dataset(tmp_path, [SHORT], evals=[LONG])
    argv = ["--env.name", "dataset", "--env.args", json.dumps(env["args"]), "--output-dir", str(tmp_path / "out"),
            "--inference.urls", json.dumps([short_context_replica.url]), "--eval.num-examples", "1",
            "--sampling.max-tokens", "8"]  # fmt: skip
    assert await asyncio.to_thread(eval_main, argv) == 1
    err = capsys.readouterr().err
    assert "gyre eval: error:" in err and "none of the 1 eval tasks fits the model's context" in err
    assert "lower sampling.max_tokens" in err and "Traceback" not in err
    # a mix entry's own eval length is the key named (it was sampling.max_tokens, which it does not read)
    mix = json.dumps([{**env, "eval": {"max_tokens": 8}}])
    argv = [*argv[4:-2], "--env", mix, "--sampling.max-tokens", "4"]
    assert await asyncio.to_thread(eval_main, argv) == 1
    err = capsys.readouterr().err
    assert "prompt plus env.0.eval.max_tokens" in err and "lower env.0.eval.max_tokens" in err, err
