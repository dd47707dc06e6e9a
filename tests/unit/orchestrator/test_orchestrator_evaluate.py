"""`evaluate`: avg@k, pass@k and the standard error of avg@k over tasks, on a dataset env with a fixed client.

The client is a test double (no model): it answers each prompt from a table, so every reward is known exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
import re

import pytest
from gyre.envs import SamplingParams, Turn, load_environment
from gyre_orchestrator.evaluate import EvalFailed, evaluate


class TableClient:
    """Replies `replies[prompt]` (a list, cycled per call) to the last user message."""

    def __init__(self, replies: dict[str, list[str]]) -> None:
        self.replies, self.calls = replies, {}

    async def chat(self, messages, *, tools=None, sampling: SamplingParams) -> Turn:
        prompt = messages[-1]["content"]
        n = self.calls[prompt] = self.calls.get(prompt, -1) + 1
        text = self.replies[prompt][n % len(self.replies[prompt])]
        return Turn(prompt_token_ids=[1], completion_token_ids=[5, 2], completion_logprobs=[-0.1, -0.2], text=text)


def dataset_env(tmp_path, replies):
    """A dataset env whose eval split is the prompts of `replies` (answer: the prompt upper-cased), exact reward."""
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": p, "answer": p.upper(), "split": "eval"} for p in replies] + [{"prompt": "zz", "answer": "ZZ"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_environment("dataset", path=str(path), reward="exact")


def run_eval(tmp_path, replies, *, num_examples, k, env=None):
    env = env or dataset_env(tmp_path, replies)
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    return asyncio.run(
        evaluate(env, TableClient(replies), env_name="dataset", num_examples=num_examples, k=k, sampling=sampling)
    )


def test_stderr_is_over_task_means(tmp_path):
    # Per-task means 1, 1, 0.5, 0: mean 0.625, sample std sqrt(0.6875 / 3), stderr that / sqrt(4).
    replies = {"ab": ["AB"], "cd": ["CD"], "ef": ["EF", "no"], "gh": ["no"]}
    result = run_eval(tmp_path, replies, num_examples=4, k=2)
    assert result.avg_at_k == 0.625
    assert result.pass_at_k == 0.75
    assert math.isclose(result.avg_at_k_stderr, math.sqrt(0.6875 / 3) / 2)
    assert result.record(step=0)["avg_at_k_stderr"] == result.avg_at_k_stderr


def test_stderr_is_zero_for_one_task(tmp_path):
    result = run_eval(tmp_path, {"ab": ["AB", "no"]}, num_examples=1, k=2)
    assert result.avg_at_k == 0.5 and result.avg_at_k_stderr == 0.0


def test_each_reward_function_is_reported_weight_zero_monitors_included(tmp_path):
    # docs/environments.md: a weight-0 judge is "logged (rewards, dumps, events, eval)"; the eval reported only the
    # weighted reward, so a monitor's grade was nowhere in eval.jsonl.
    replies = {"ab": ["AB", "no"], "cd": ["no"]}
    env = dataset_env(tmp_path, replies)

    def monitor(completion) -> float:
        return 0.5 if completion[-1]["content"] == "no" else 1.0

    env.rubric.add(monitor, weight=0.0)
    result = run_eval(tmp_path, replies, num_examples=2, k=2, env=env)
    assert result.avg_at_k == 0.25  # the monitor is not rewarded
    assert result.rewards_mean == {"exact_match": 0.25, "monitor": 0.625}
    assert result.record(step=3)["rewards_mean"] == {"exact_match": 0.25, "monitor": 0.625}


def test_a_full_score_that_a_weighted_sum_rounds_below_the_threshold_still_passes(tmp_path):
    # weights 0.7 + 0.2 + 0.1 of three reward functions that all give 1 sum to 0.9999999999999999 in floating point:
    # pass@k (threshold 1.0) counted every perfect sample of such a rubric as a failure, and reported 0
    replies = {"ab": ["AB"], "cd": ["no"]}
    env = dataset_env(tmp_path, replies)
    env.rubric.weights[0] = 0.7

    def well_formed() -> float:
        return 1.0

    def short() -> float:
        return 1.0

    env.rubric.add(well_formed, weight=0.2)
    env.rubric.add(short, weight=0.1)
    result = run_eval(tmp_path, replies, num_examples=2, k=2, env=env)
    assert result.avg_at_k == pytest.approx(0.65)  # "ab": 0.7 + 0.2 + 0.1, "cd": 0.2 + 0.1
    assert result.pass_at_k == 0.5  # "ab" passes, "cd" (0.3) does not


def test_a_reward_function_that_raises_is_counted_and_logged_once(tmp_path, caplog):
    replies = {"ab": ["AB"], "cd": ["no"]}
    env = dataset_env(tmp_path, replies)

    def broken(info) -> float:
        return info["difficulty"]

    env.rubric.add(broken)
    with caplog.at_level("WARNING", logger="gyre_orchestrator.evaluate"):
        result = run_eval(tmp_path, replies, num_examples=2, k=2, env=env)
    assert result.avg_at_k == 0.5 and result.reward_errors == {"broken": 4}
    warnings = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1 and "KeyError: 'difficulty'" in warnings[0]


def test_progress_is_reported_per_sample(tmp_path):
    # `gyre eval` showed nothing while it ran: evaluate reports every sample to its progress callback
    replies = {"ab": ["AB"], "cd": ["no"], "ef": ["EF"]}
    seen = []
    env = dataset_env(tmp_path, replies)
    asyncio.run(evaluate(env, TableClient(replies), env_name="dataset", num_examples=3, k=2,
                         sampling=SamplingParams(temperature=1.0, max_tokens=4),
                         progress=lambda done, total: seen.append((done, total))))  # fmt: skip
    assert seen == [(n, 6) for n in range(7)]


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_gyre_eval_draws_a_bar_on_a_terminal_and_nothing_in_a_log():
    from gyre_orchestrator.eval_command import EvalProgress

    for tty in (True, False):
        stream = _Stream(tty)
        progress = EvalProgress(stream)
        for done in range(5):
            progress(done, 4)
        progress.close()
        assert ("eval: 100%" in stream.getvalue() and "4/4" in stream.getvalue()) if tty else stream.getvalue() == ""


def test_gyre_eval_passes_its_bar_to_the_evaluation(tmp_path, monkeypatch):
    import gyre_orchestrator.eval_command as eval_command
    import gyre_orchestrator.evaluate as evaluate_module

    seen = {}

    async def fake_evaluate(env, client, **kwargs):
        seen.update(kwargs)
        kwargs["progress"](0, 1)
        return evaluate_module.EvalResult("reverse_text", 1.0, 1.0, 1, 1, 0, 0, 0.1)

    monkeypatch.setattr(evaluate_module, "evaluate", fake_evaluate)
    code = eval_command.main(["--output-dir", str(tmp_path), "--env.name", "reverse_text", "--inference.urls",
                              '["http://127.0.0.1:9"]', "--inference.startup-timeout-s", "0"])  # fmt: skip
    assert code == 0 and isinstance(seen.get("progress"), eval_command.EvalProgress)


def test_gyre_eval_names_the_env_key_for_an_unknown_environment_or_bad_arguments(tmp_path, capsys):
    # it was a traceback from inside the event loop (exit 1), after connecting to the replicas
    import gyre_orchestrator.eval_command as eval_command

    base = ["--output-dir", str(tmp_path), "--inference.urls", '["http://127.0.0.1:9"]']
    for argv in (["--env.name", "reverse_txt"], ["--env.name", "dataset", "--env.args", "{}"]):
        assert eval_command.main([*base, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gyre eval: error: config key 'env': ") and err.count("\n") == 1, err
    assert not (tmp_path / "events").exists()


def test_gyre_bench_orchestrator_names_its_keys_before_starting_anything(capsys):
    from gyre_orchestrator import bench

    assert bench.main(["--env", "reverse_txt"]) == 2
    assert capsys.readouterr().err.startswith("gyre bench orchestrator: error: config key 'env': unknown environment")
    assert bench.main(["--real-model", "/nonexistent/model"]) == 2
    assert capsys.readouterr().err.startswith("gyre bench orchestrator: error: real_model = '/nonexistent/model'")


class FlakyEnv:
    """The dataset env whose next rollouts fail as `failures` says, in order: a string is an episode the environment
    broke off (`Rollout.error`, half an answer: what `Environment.rollout` returns when `env_response` raises), an
    exception is raised (inference failed after the client's retries)."""

    def __init__(self, env, failures) -> None:
        self.env, self.failures = env, list(failures)

    def tasks(self, split):
        return self.env.tasks(split)

    async def score(self, task, rollout):
        return await self.env.score(task, rollout)

    async def rollout(self, client, task, sampling):
        rollout = await self.env.rollout(client, task, sampling)
        if not self.failures:
            return rollout
        failure = self.failures.pop(0)
        if isinstance(failure, Exception):
            raise failure
        half = [{"role": "assistant", "content": rollout.completion[-1]["content"][:1]}]
        return dataclasses.replace(rollout, completion=half, error=failure, stop_reason="error")


def test_a_failed_eval_sample_is_generated_again_never_scored_as_half_an_episode(tmp_path):
    # audit: an episode the environment broke off (Rollout.error) was scored into avg@k and pass@k as it stood (0
    # here: the policy answers every task right), and one sample whose inference failed failed the whole eval;
    # training generates both again (sample_attempts)
    replies = {"ab": ["AB"], "cd": ["CD"]}
    failures = ["env_response failed: ValueError: tool down", RuntimeError("request failed after 4 attempts")]
    result = run_eval(tmp_path, replies, num_examples=2, k=2, env=FlakyEnv(dataset_env(tmp_path, replies), failures))
    assert (result.avg_at_k, result.pass_at_k, result.failed_rollouts) == (1.0, 1.0, 2)
    assert result.record(step=2)["failed_rollouts"] == 2


def test_an_eval_sample_that_fails_every_attempt_fails_the_eval_naming_it(tmp_path):
    replies = {"ab": ["AB"], "cd": ["CD"]}
    env = FlakyEnv(dataset_env(tmp_path, replies), ["env_response failed: ValueError: tool down"] * 100)
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    client = TableClient(replies)
    with pytest.raises(EvalFailed, match=r"sample \d of task .* failed 2 times: environment error: env_response"):
        asyncio.run(evaluate(env, client, env_name="d", num_examples=2, k=2, sampling=sampling, attempts=2))
    assert sum(client.calls.values()) + len(client.calls) <= 2 * 2 * 2  # nothing ran on after it failed


def test_a_failed_eval_sample_is_generated_again_with_a_fresh_seed(tmp_path):
    # with sampling.seed, each sample's request had one seed for every attempt: a deterministic engine gave the same
    # answer again, an environment that broke off on that answer broke off again, and the retries only failed the
    # eval. A retry now has its own seed; the first attempt keeps the seed every version's eval shares.
    replies = {"ab": ["AB"]}
    env = FlakyEnv(dataset_env(tmp_path, replies), ["env_response failed: ValueError: unparsable answer"])

    class SeedClient(TableClient):
        seeds: list = []

        async def chat(self, messages, *, tools=None, sampling):
            self.seeds.append(sampling.seed)
            return await super().chat(messages, tools=tools, sampling=sampling)

    client = SeedClient(replies)
    sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=7)
    result = asyncio.run(evaluate(env, client, env_name="d", num_examples=1, k=1, sampling=sampling))
    assert result.failed_rollouts == 1 and result.avg_at_k == 1.0
    first, retry = client.seeds
    assert first == sampling.for_request("eval", 0, 0).seed  # unchanged: evals of two versions draw alike
    assert retry != first


def training_eval(tmp_path, replies, versions, *, done=(), env=None):
    """A TrainingEval of `env` (the dataset env) every 2 versions, started on `versions` (a VersionWatch); returns it
    and its eval.jsonl path."""
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.events import EventLog
    from gyre_orchestrator.metrics import OrchestratorMetrics
    from gyre_orchestrator.training_eval import TrainingEval

    class Client(TableClient):
        def for_version(self, version, *, priority=None):
            return self

        async def chat(self, messages, *, tools=None, sampling):  # from a replica serving version 100
            turn = await super().chat(messages, tools=tools, sampling=sampling)
            return dataclasses.replace(turn, policy_version_min=100, policy_version_max=100)

    class NoWandb:
        def log(self, *args, **kwargs):
            pass

    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path), eval={"interval": 2, "num_examples": 1})
    path = tmp_path / "eval.jsonl"
    evals = TrainingEval(cfg, env or dataset_env(tmp_path, replies), Client(replies), events=EventLog(path),
                         wandb=NoWandb(), metrics=OrchestratorMetrics("t"))  # fmt: skip
    evals.start(versions, at_start=False, done=done)
    return evals, path


def test_a_restarted_orchestrator_evaluates_the_due_version_the_replicas_already_serve(tmp_path):
    # audit: the relay reaches the served version before TrainingEval starts listening, so an orchestrator restarted
    # while (or before) version 4 was evaluated never evaluated it: eval.jsonl had no line for 4, ever
    from gyre.events import read_events
    from gyre_orchestrator.scheduler import VersionWatch

    async def main():
        versions = VersionWatch(4)
        evals, path = training_eval(tmp_path, {"ab": ["AB"]}, versions, done={0, 2})
        await asyncio.wait_for(evals._queue.join(), timeout=10)  # before any newer version, before finish()
        first = [e["step"] for e in read_events(path)]
        versions.set(5)  # not due (interval 2)
        versions.set(6)
        await asyncio.wait_for(evals._queue.join(), timeout=10)
        await evals.stop()
        return first, [e["step"] for e in read_events(path)]

    assert asyncio.run(main()) == ([4], [4, 6])


def test_a_restarted_orchestrator_does_not_evaluate_a_version_again(tmp_path):
    from gyre.events import read_events
    from gyre_orchestrator.scheduler import VersionWatch

    async def main():
        evals, path = training_eval(tmp_path, {"ab": ["AB"]}, VersionWatch(4), done={0, 2, 4})
        await evals.finish(4)
        await evals.stop()
        return read_events(path)

    assert asyncio.run(main()) == []


def test_the_versions_evaluated_before_are_those_of_eval_jsonl_the_store_still_publishes(tmp_path):
    """After a rewind to step 4 the evals of steps 6 and 8 were of the abandoned policy: the new 6 is due again."""
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.events import EventLog
    from gyre.weights import WeightStore
    from gyre_orchestrator.service import OrchestratorService

    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path), run_id="evals")
    store = WeightStore(tmp_path / "weights")
    for step in (2, 4):
        store.publish(step, lambda folder: (folder / "model.safetensors").write_bytes(b"w"))
    with EventLog(tmp_path / "events" / "eval.jsonl") as log:
        for step in (0, 2, 4, 6, 8):
            log.append({"step": step, "avg_at_k": 0.5})

    async def main():  # the service is made inside an event loop, as `gyre orchestrator` makes it
        orch = OrchestratorService(cfg)
        try:
            return orch._evaluated_versions()
        finally:
            orch.redis.close()

    assert asyncio.run(main()) == {0, 2, 4}


def test_an_eval_sample_older_than_the_version_evaluated_is_generated_again(tmp_path):
    # audit: the eval of version 3 scored the answer of a replica restarted on version 1 (routing knew it as 3 until
    # the relay's next probe) into avg@k; training drops such a sample (admission), the eval now does too
    replies = {"ab": ["no"], "cd": ["CD"]}

    class Versions(TableClient):
        def __init__(self, replies, versions):
            super().__init__(replies)
            self.versions = list(versions)

        async def chat(self, messages, *, tools=None, sampling):
            turn = await super().chat(messages, tools=tools, sampling=sampling)
            v = self.versions.pop(0) if self.versions else 3
            return dataclasses.replace(turn, policy_version_min=v, policy_version_max=v)

    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    client = Versions({"ab": ["AB"], "cd": ["CD"]}, [1, 1])  # the first two answers: the restarted replica's
    result = asyncio.run(evaluate(dataset_env(tmp_path, replies), client, env_name="d", num_examples=2, k=1,
                                  sampling=sampling, min_version=3))  # fmt: skip
    assert (result.min_version, result.dropped_stale, result.failed_rollouts) == (3, 2, 0)
    assert result.avg_at_k == 1.0 and result.record(step=3)["dropped_stale"] == 2


def test_an_eval_whose_answers_keep_coming_from_an_older_version_fails_instead_of_looping(tmp_path):
    replies = {"ab": ["AB"]}
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    with pytest.raises(EvalFailed, match="eval of version 3: sample 0 of task .* older version 20 times"):
        asyncio.run(evaluate(dataset_env(tmp_path, replies), TableClient(replies), env_name="d", num_examples=1, k=1,
                             sampling=sampling, min_version=3))  # fmt: skip


# ---- gyre eval waits for the policy's server, bounded (inference.startup_timeout_s) -------------------------------


def inference_client(url: str):
    from gyre_orchestrator.client import InferenceClient
    from gyre_orchestrator.replicas import ReplicaSet, static_endpoints

    replicas = ReplicaSet()
    replicas.set_endpoints(static_endpoints([url], None, 50051))
    return InferenceClient(replicas, timeout_s=5, retries=0)


async def waited(client, limit_s: float, **kwargs):
    from gyre_orchestrator.client import close_replica_clients
    from gyre_orchestrator.eval_command import wait_for_inference

    try:
        await wait_for_inference(client, limit_s, **kwargs)
    finally:
        await close_replica_clients(list(client.replicas))


def test_gyre_eval_waits_for_a_replica_still_loading_and_says_so(caplog):
    """A server that answers 503 (a model loading) is asked again until it answers; the wait says what it waits for
    at once and every log_s, and that inference is up."""
    from support.judge_server import ScriptedServer

    with ScriptedServer() as server, caplog.at_level("INFO", logger="gyre_orchestrator.eval_command"):
        server.models_script[:] = [('{"error": "loading"}', "application/json", 503)] * 6
        asyncio.run(waited(inference_client(server.url), 30, poll_s=0.05, log_s=0.1))
        assert server.models_script == []
    lines = [r.getMessage() for r in caplog.records if r.name == "gyre_orchestrator.eval_command"]
    assert lines[0].startswith(f"waiting for inference ({server.url}: 503") and "of 30s" in lines[0], lines
    assert any(line.startswith("still waiting for inference") for line in lines), lines
    assert lines[-1] == f"inference is up: {server.url}"


def test_gyre_eval_stops_at_once_on_a_refused_key_or_an_unknown_host_and_past_its_bound_on_a_closed_port():
    import socket
    import time

    from gyre_orchestrator.client import InferenceError
    from support.judge_server import ScriptedServer

    with ScriptedServer() as server:  # a key or a URL no wait mends
        server.models_script[:] = [('{"error": {"message": "bad key"}}', "application/json", 401)]
        start = time.monotonic()
        with pytest.raises(InferenceError, match=r"/v1/models refused the request: 401 .*inference.api_key"):
            asyncio.run(waited(inference_client(server.url), 30, poll_s=0.05))
        assert time.monotonic() - start < 10
    with pytest.raises(InferenceError, match=r"the host name does not resolve \(inference.urls\)"):
        asyncio.run(waited(inference_client("http://no-such-host.invalid:8000"), 30, poll_s=0.05))
    with socket.socket() as closed:  # a port nothing listens on: waited for (a server starting), then named
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(InferenceError, match=rf"no replica answered /v1/models within 0.5s \(last: {url}: "):
        asyncio.run(waited(inference_client(url), 0.5, poll_s=0.05))


def test_an_openai_base_url_is_read_as_the_replicas_root():
    # vLLM's and the openai client's users give http://host:8000/v1: every request went to /v1/v1/... (a 404)
    from gyre.config import load_config
    from gyre.config.orchestrator import GyreEvalConfig

    cfg = load_config(
        GyreEvalConfig, ["--inference.urls", '["http://a:8000/v1", "http://b:8000/v1/", "http://c:8000"]']
    )
    assert cfg.inference.urls == ["http://a:8000", "http://b:8000", "http://c:8000"]


def undrawable_envs():
    """Environments whose eval tasks cannot be had: an empty eval split, and a task space too small for num_eval
    (every task asks the same question: `distinct_tasks` gives up)."""
    from gyre.envs import Task, TaskSource

    empty = load_environment("arithmetic", num_eval=2)
    train = empty.tasks
    empty.tasks = lambda split, seed=0: TaskSource(lambda i: None, 0) if split == "eval" else train(split, seed)
    same = load_environment("arithmetic", num_eval=2)
    same.make_task = lambda rng, task_id: Task(id=task_id, prompt=[{"role": "user", "content": "1+1?"}], answer="2")
    return {"the eval split is empty": empty, "cannot draw the eval tasks: .*lower num_eval": same}


@pytest.mark.parametrize("why", list(undrawable_envs()))
def test_gyre_eval_without_eval_tasks_is_one_line_naming_the_keys_before_connecting(tmp_path, capsys, monkeypatch, why):
    # it was a traceback after the wait for inference, however clear the last line; an empty split a ZeroDivisionError
    import gyre.envs
    import gyre_orchestrator.eval_command as eval_command

    monkeypatch.setattr(gyre.envs, "load_environment", lambda name, **args: undrawable_envs()[why])
    monkeypatch.setattr(eval_command, "_run_once", lambda *args: pytest.fail("connected"))
    code = eval_command.main(["--output-dir", str(tmp_path), "--env.name", "arithmetic", "--eval.num-examples",
                              "5", "--inference.urls", '["http://127.0.0.1:9"]'])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.match(rf"gyre eval: error: env 'arithmetic', eval.num_examples = 5: {why}", err), err


@pytest.mark.parametrize("why", list(undrawable_envs()))
def test_an_orchestrator_evaluating_during_training_refuses_an_eval_split_it_cannot_draw_at_start(tmp_path, why):
    # each eval failed with an error in the log, and training ran on without one eval
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre_orchestrator.training_eval import TrainingEval

    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path), eval={"interval": 2})
    with pytest.raises(ValueError, match=rf"env '{cfg.env.name}', eval.num_examples = \d+: {why}"):
        TrainingEval(cfg, undrawable_envs()[why], None, events=None, wandb=None, metrics=None)
    off = load_config(OrchestratorConfig, [], output_dir=str(tmp_path))  # no evals: not asked
    TrainingEval(off, undrawable_envs()[why], None, events=None, wandb=None, metrics=None)


def test_gyre_eval_stops_at_once_on_a_model_the_server_does_not_serve():
    # a vLLM user's hub id against a server started with --served-model-name: each sample a 404, retried three times
    from gyre_orchestrator.client import InferenceError
    from support.judge_server import ScriptedServer

    with ScriptedServer() as server:
        client = inference_client(server.url)
        client.model = "Qwen/Qwen3-0.6B"
        with pytest.raises(InferenceError, match=r"does not serve inference.model = 'Qwen/Qwen3-0.6B': it serves "
                                                 r"'judge-model' \(unset"):  # fmt: skip
            asyncio.run(waited(client, 30, poll_s=0.05))
        client = inference_client(server.url)
        client.model = "judge-model"
        asyncio.run(waited(client, 30, poll_s=0.05))  # listed: up


def test_an_eval_sample_refused_for_the_key_or_model_fails_the_eval_at_once(tmp_path):
    # each sample was generated three times, each a 404 or 401, before `gyre eval` stopped
    from gyre_orchestrator.client import SetupRefused

    class Refusing(TableClient):
        async def chat(self, messages, *, tools=None, sampling):
            self.calls["refused"] = self.calls.get("refused", 0) + 1
            raise SetupRefused("http://r:8000 rejected the request: 401 (check inference.api_key)")

    client, env = Refusing({}), dataset_env(tmp_path, {"ab": ["AB"]})
    with pytest.raises(SetupRefused, match="401"):
        asyncio.run(evaluate(env, client, env_name="dataset", num_examples=1, k=1, sampling=SamplingParams()))
    assert client.calls["refused"] == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--inference.urls", "localhost:8000"], "inference.urls[0] = 'localhost:8000' is not an http(s) URL"),
        (["--inference.discovery", "dns"], "inference.discovery = 'dns' needs inference.dns_name"),
    ],
)
def test_gyre_eval_refuses_replicas_it_cannot_find_in_one_line_before_connecting(tmp_path, capsys, monkeypatch,
                                                                                  argv, message):  # fmt: skip
    # a host:port without a scheme (as vLLM's --host/--port read) was a traceback from inside the event loop
    import gyre_orchestrator.eval_command as eval_command

    monkeypatch.setattr(eval_command, "_run_once", lambda *args: pytest.fail("connected"))
    code = eval_command.main(["--output-dir", str(tmp_path), "--env.name", "reverse_text", *argv])
    assert code == 2 and capsys.readouterr().err == f"gyre eval: error: {message}\n"


def test_each_entry_of_a_mix_is_evaluated_at_its_own_interval(tmp_path):
    """PRIME-RL's per-environment eval interval: "a" every 2 versions (eval.interval), "b" every 3 (its own); a
    version due for one entry evaluates that one, the line's top figures weighted over the entries evaluated."""
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.events import EventLog, read_events
    from gyre_orchestrator.metrics import OrchestratorMetrics
    from gyre_orchestrator.scheduler import VersionWatch
    from gyre_orchestrator.training_eval import TrainingEval

    replies = {"ab": ["AB"]}

    class Client(TableClient):
        def for_version(self, version, *, priority=None):
            return self

        async def chat(self, messages, *, tools=None, sampling):
            turn = await super().chat(messages, tools=tools, sampling=sampling)
            return dataclasses.replace(turn, policy_version_min=100, policy_version_max=100)

    class NoWandb:
        def log(self, *args, **kwargs):
            pass

    env = dataset_env(tmp_path, replies)
    args = {"path": str(tmp_path / "d.jsonl"), "reward": "exact"}
    entries = [{"name": "dataset", "label": "a", "args": args, "ratio": 3},
               {"name": "dataset", "label": "b", "args": args, "eval": {"interval": 3}}]  # fmt: skip
    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path), env=entries, max_steps=7,
                      eval={"interval": 2, "num_examples": 1})  # fmt: skip
    path = tmp_path / "eval.jsonl"

    async def main():
        versions = VersionWatch(0)
        evals = TrainingEval(cfg, {"a": env, "b": env}, Client(replies), events=EventLog(path), wandb=NoWandb(),
                             metrics=OrchestratorMetrics("t"))  # fmt: skip
        evals.start(versions, at_start=True)
        for version in range(1, 8):
            versions.set(version)
            await asyncio.wait_for(evals._queue.join(), timeout=10)
        await evals.stop()

    asyncio.run(main())
    lines = read_events(path)
    evaluated = [(line["step"], sorted(line["envs"]) if "envs" in line else [line["env"]]) for line in lines]
    assert evaluated == [(0, ["a", "b"]), (2, ["a"]), (3, ["b"]), (4, ["a"]), (6, ["a", "b"])]
    assert lines[0]["avg_at_k"] == pytest.approx(0.75 * lines[0]["envs"]["a"]["avg_at_k"]
                                                 + 0.25 * lines[0]["envs"]["b"]["avg_at_k"])  # fmt: skip


def test_an_eval_sample_whose_judge_failed_is_scored_again_not_generated_again(tmp_path):
    """A judge failing past its retries (a 503, retries = 0) made the eval generate the sample again: here the policy
    answers right only at its first try, so avg@k read 0 where the completion it failed on was worth 1 (the samples a
    judge struggles with left the score). The same completion is scored again now. The judge is a real HTTP server
    (the scripted one of the judge tests), asked by the rubric's Judge."""
    from gyre.config.endpoint import JudgeConfig
    from gyre.envs.judge import add_to_rubric
    from support.judge_server import ScriptedServer

    replies = {"ab": ["AB", "no"]}
    env = dataset_env(tmp_path, replies)
    with ScriptedServer() as judge:
        judge.script = [("status", 503), "Score: 10"]
        config = JudgeConfig(url=judge.url, model="judge-model", prompt="{response}", retries=0, weight=0.0,
                             startup_timeout_s=0, cache_size=0)  # fmt: skip
        signals = add_to_rubric(env, [config], [])
        client = TableClient(replies)
        sampling = SamplingParams(temperature=1.0, max_tokens=4)

        async def scenario():  # one event loop: the judge's client belongs to it
            try:
                return await evaluate(env, client, env_name="d", num_examples=1, k=1, sampling=sampling)
            finally:
                await signals["judge"].aclose()

        result = asyncio.run(scenario())
        asked = [body["messages"][-1]["content"] for kind, body in judge.requests if kind == "chat"]
    assert asked == ["AB", "AB"] and client.calls == {"ab": 0}
    assert (result.avg_at_k, result.failed_rollouts, result.rewards_mean["judge"]) == (1.0, 0, 1.0)
    assert result.scoring_failures == 1 and result.record(step=0)["scoring_failures"] == 1


def test_the_training_evals_failed_scorings_are_counted_as_trainings_are(tmp_path):
    """A judge failing in an eval (a 503 past its retries) was scored again without a count: training counts its
    failed scorings (gyre_orchestrator_scoring_failures_total, scoring_failures), an eval's were nowhere, so a judge
    failing only on eval samples went unseen. They are in eval.jsonl and gyre_orchestrator_eval_scoring_failures_total
    now, counted as they happen (an eval that then fails counts them too). A real HTTP judge, as above."""
    from gyre.config.endpoint import JudgeConfig
    from gyre.envs.judge import add_to_rubric
    from gyre.events import read_events
    from gyre_orchestrator.scheduler import VersionWatch
    from support.judge_server import ScriptedServer

    replies = {"ab": ["AB"]}
    env = dataset_env(tmp_path, replies)
    with ScriptedServer() as judge:
        judge.script = [("status", 503), ("status", 503), "Score: 10"]
        config = JudgeConfig(url=judge.url, model="judge-model", prompt="{response}", retries=0, weight=0.0,
                             startup_timeout_s=0, cache_size=0)  # fmt: skip
        signals = add_to_rubric(env, [config], [])

        async def main():
            versions = VersionWatch(2)
            evals, path = training_eval(tmp_path, replies, versions, env=env)
            await asyncio.wait_for(evals._queue.join(), timeout=30)
            await evals.stop()
            await signals["judge"].aclose()
            return evals.metrics, path

        metrics, path = asyncio.run(main())
    [line] = read_events(path)
    assert line["scoring_failures"] == 2 and line["avg_at_k"] == 1.0
    total = "gyre_orchestrator_eval_scoring_failures_total"
    assert metrics.registry.get_sample_value(total, {"run_id": "t", "env": line["env"]}) == 2


def test_an_eval_sample_scored_inside_its_episode_is_generated_again_when_its_judge_failed(tmp_path):
    """verifiers scores inside its episode: a judge server's failure is recorded with the trace, and `score` reads it
    again however often it is asked (a ScoringError that is not `rescorable`). Scored again like a Gyre judge's, it
    failed every attempt and the eval; it is generated again, as before."""
    from gyre.envs import ScoringError

    replies = {"ab": ["no", "AB"]}

    class EpisodeScored(FlakyEnv):
        async def score(self, task, rollout):
            if rollout.completion[-1]["content"] == "no":  # the episode whose judge failed: the same failure each time
                failure = ScoringError("a verifiers judge's server failed: scoring: APIConnectionError")
                failure.rescorable = False
                raise failure
            return await self.env.score(task, rollout)

    env = EpisodeScored(dataset_env(tmp_path, replies), [])
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    result = asyncio.run(evaluate(env, TableClient(replies), env_name="d", num_examples=1, k=1, sampling=sampling))
    assert (result.avg_at_k, result.failed_rollouts) == (1.0, 1)
