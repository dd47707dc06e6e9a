"""Signals from other models through real services: judges, a reward model and a distillation teacher.

Every model here is a real `gyre inference` process: the policy replicas (tiny model), a judge (the same tiny model
behind a second server, its replies constrained to {"score": 0..10} by structured outputs so a random model gives
readable, varying grades), a reward model (`--runner pooling`, a tiny LlamaForSequenceClassification) and a teacher
(the tiny model again: the student's own weights, so its log-probs must equal the sampler's at T = 1).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
from gyre.config.endpoint import JudgeConfig
from gyre.envs import load_environment
from gyre.envs.judge import Judge
from gyre_orchestrator.rescoring import ScoringFailed
from orchestrator_testlib import first_batch, orchestrator_config
from support.judge_server import ScriptedServer
from support.models import reward_model_path

pytestmark = pytest.mark.asyncio

JUDGE = {"score": "json", "structured": True, "max_score": 10, "max_tokens": 16, "prompt": "Grade: {response}"}


@pytest.fixture(scope="module")
def judge(start_replica):
    return start_replica()


@pytest.fixture(scope="module")
def reward_server(start_replica, tmp_path_factory):
    return start_replica("--runner", "pooling", model=reward_model_path(tmp_path_factory))


def dump(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.output_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()]


def events(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.output_dir / "events" / "orchestrator_steps.jsonl").open()]


async def test_judges_and_a_reward_model_score_rollouts_and_reach_the_advantages(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, judge, reward_server
):
    monitor_prompt = {"prompt": "Style of: {response}"}
    judges = [{"name": "judge", "url": judge.url, "weight": 1.0, **JUDGE},
              {"name": "monitor", "url": judge.url, "weight": 0.0, **JUDGE, **monitor_prompt}]  # fmt: skip
    models = [{"name": "rm", "url": reward_server.url, "weight": 0.5, "max_batch": 4}]
    # seeded rollouts: which grades a random judge gives depends on the completions, and unseeded ones were now
    # and then all graded alike (1 run in ~8), failing the check that the grades vary for no fault of the code
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1, judges=judges,
                              reward_models=models, advantage={"drop_zero_signal": False},
                              sampling={"seed": 7})  # fmt: skip
    batch = await first_batch(cfg, tiny_model)

    records = dump(cfg)
    assert len(records) == len(batch.samples) == 8
    # every judge grade and reward-model score equals an independent call on the same conversation
    fresh = Judge(JudgeConfig(name="judge", url=judge.url, **JUDGE))
    monitor = Judge(JudgeConfig(name="monitor", url=judge.url, **{**JUDGE, **monitor_prompt}))
    async with httpx.AsyncClient(base_url=reward_server.url, timeout=60) as http:
        for record in records:
            rewards = record["rewards"]
            assert set(rewards) == {"lcs_reward", "judge", "monitor", "rm"}
            assert rewards["judge"] == await fresh(record["prompt"], record["completion"], record["answer"])
            assert rewards["monitor"] == await monitor(record["prompt"], record["completion"], record["answer"])
            ids = (await http.post("/tokenize", json={"messages": record["prompt"] + record["completion"],
                                                       "add_generation_prompt": False})).json()["tokens"]  # fmt: skip
            direct = (await http.post("/classify", json={"input": [ids], "use_activation": False})).json()
            assert rewards["rm"] == pytest.approx(direct["data"][0]["probs"][0], abs=1e-5)
            # weight 0: logged, not rewarded
            expected = rewards["lcs_reward"] + rewards["judge"] + 0.5 * rewards["rm"]
            assert record["reward"] == pytest.approx(expected, abs=1e-9)
    await fresh.aclose()
    await monitor.aclose()
    # the judge's grade reaches the advantages (drgrpo: reward minus the group's mean)
    for group in {r["group"] for r in records}:
        members = [r for r in records if r["group"] == group]
        mean = np.mean([r["reward"] for r in members])
        assert [r["advantage"] for r in members] == pytest.approx([r["reward"] - mean for r in members], abs=1e-6)
    grades = sorted(r["rewards"]["judge"] for r in records)
    assert len(set(grades)) > 1, grades  # the grades vary: a signal, not a constant
    for rank in batch.micro_batches:
        for mb in rank:
            starts = np.cumsum(mb.sample_lengths) - mb.sample_lengths
            for index, length, start in zip(mb.sample_index, mb.sample_lengths, starts, strict=True):
                assert np.all(mb.advantages[start : start + length] == np.float32(batch.samples[index]["advantage"]))
    event = events(cfg)[0]
    assert event["rewards_mean"]["monitor"] == pytest.approx(np.mean([r["rewards"]["monitor"] for r in records]))
    judged = event["signals"]["judge"]
    assert judged["ok"] + judged.get("cache_hits", 0) >= 8 and event["signals"]["rm"]["batches"] >= 2
    assert event["scoring_failures"] == 0


async def test_a_judge_that_times_out_is_counted_and_retried(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, start_replica
):
    """The judge's process is stopped (SIGSTOP) before the run and resumed once its calls have timed out (1 s):
    they are counted and retried, and the step completes with every grade."""
    from gyre_orchestrator.service import OrchestratorService

    slow = start_replica()
    # startup_timeout_s = 0: the calls are to time out, not the start-up wait (which would wait for it)
    judges = [{"name": "judge", "url": slow.url, "timeout_s": 1.0, "retries": 6, "startup_timeout_s": 0, **JUDGE}]
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1, judges=judges,
                              advantage={"drop_zero_signal": False})  # fmt: skip
    service = OrchestratorService(cfg)
    os.kill(slow.proc.pid, signal.SIGSTOP)
    try:
        run = asyncio.create_task(service.run())
        while service.signals["judge"].stats["timeouts"] < 2 and not run.done():
            await asyncio.sleep(0.1)
        os.kill(slow.proc.pid, signal.SIGCONT)
        assert await asyncio.wait_for(run, timeout=120) == 0
    finally:
        os.kill(slow.proc.pid, signal.SIGCONT)
        slow.stop()
    counts = events(cfg)[0]["signals"]["judge"]
    assert counts["timeouts"] >= 1 and counts["retries"] >= counts["timeouts"] and counts.get("failures", 0) == 0
    records = dump(cfg)
    assert len(records) == 8 and all("judge" in record["rewards"] for record in records)


async def test_a_judge_that_fails_fails_the_scoring_loudly(tmp_path, redis_url, unique_run_id, replicas, tiny_model):
    """A judge that cannot answer at all: every sample's scoring fails, is counted and scored again, and the run
    stops with the reason (never a reward of 0)."""
    from gyre_orchestrator.service import OrchestratorService

    # nothing listens; startup_timeout_s = 0: no wait for it to come up, so its calls fail
    judges = [{"name": "judge", "url": "http://127.0.0.1:9", "retries": 0, "timeout_s": 2, "startup_timeout_s": 0}]
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1, judges=judges,
                              sample_attempts=2)  # fmt: skip
    service = OrchestratorService(cfg)
    service.rescore_backoff_s = 0.05
    with pytest.raises(ScoringFailed, match="task .*: scoring failed 2 times on the same completion .*judge 'judge'"):
        await asyncio.wait_for(service.run(), timeout=120)
    failures = service.metrics.registry.get_sample_value(
        "gyre_orchestrator_scoring_failures_total", {"run_id": unique_run_id, "env": "reverse_text"}
    )
    assert failures >= 2


async def run_judged_by(judge: ScriptedServer, retries: int, tmp_path, redis_url, run_id, replicas):
    """One step graded by the scripted `judge` (its reply to `{response}`, no cache, `retries`), a failed scoring
    scored again at once: the run's config, and the response of each request the judge had, in order."""
    from gyre_orchestrator.service import OrchestratorService

    judges = [{"name": "judge", "url": judge.url, "model": "judge-model", "prompt": "{response}", "retries": retries,
               "startup_timeout_s": 0, "cache_size": 0}]  # fmt: skip
    cfg = orchestrator_config(tmp_path, redis_url, run_id, replicas, max_steps=1, judges=judges,
                              advantage={"drop_zero_signal": False}, sampling={"seed": 3})  # fmt: skip
    service = OrchestratorService(cfg)
    service.rescore_backoff_s = 0.05
    assert await asyncio.wait_for(service.run(), timeout=120) == 0
    return cfg, [body["messages"][-1]["content"] for kind, body in judge.requests if kind == "chat"]


async def test_a_completion_whose_judge_failed_is_scored_again_not_generated_again(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    """A judge failing past its retries (here a 503, retries = 0) made the sample be generated again: the completion
    it failed on never reached training (those a judge struggles with left every batch unseen). The same completion
    is scored again now: the judge is asked twice about it, it is in the batch with the judge's grade, no rollout
    is generated again, and the failure is counted."""
    with ScriptedServer() as judge:
        judge.script = [("status", 503)]  # the first call fails; every other answers "5"
        cfg, asked = await run_judged_by(judge, 0, tmp_path, redis_url, unique_run_id, replicas)
    failed_on = asked[0]
    assert asked.count(failed_on) >= 2  # asked again about the same completion
    records = dump(cfg)
    assert len(records) == 8 and all(record["rewards"]["judge"] == 0.5 for record in records)
    assert any(record["completion"][-1]["content"] == failed_on for record in records)
    event = events(cfg)[0]
    assert event["scoring_failures"] == 1 and event["failed_rollouts"] == 0
    assert len(asked) == 9  # 8 samples, one asked twice: nothing generated again


async def test_a_completion_the_judge_gives_no_verdict_on_is_trained_on_scored_0_and_counted(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    """A judge that answers one completion with no readable verdict (here it declines, twice: retries = 1) failed
    its scoring, and the sample was generated again: a completion that confuses the judge was never trained on. It
    is trained on now, the judge's 0 named in its dumped details, counted in reward_errors and in the judge's
    `unreadable`, and nothing is generated or scored again."""
    first: list[str] = []

    def decline_the_first(response: str) -> str | None:  # the first completion asked about, every time; else "5"
        first[:] = first or [response]
        return "I cannot grade this." if response == first[0] else None

    with ScriptedServer() as judge:
        judge.reply_for = decline_the_first
        cfg, asked = await run_judged_by(judge, 1, tmp_path, redis_url, unique_run_id, replicas)
    records = dump(cfg)
    declined = [r for r in records if r["rewards"]["judge"] == 0.0]
    assert len(records) == 8 and len(declined) == 1 and len(asked) == 9  # 8 samples, the declined one asked twice
    assert declined[0]["completion"][-1]["content"] == first[0] and asked.count(first[0]) == 2
    assert "verdict was unreadable" in declined[0]["details"]["reward_errors"]["judge"]
    assert all(r["rewards"]["judge"] == 0.5 for r in records if r is not declined[0])
    event = events(cfg)[0]
    assert event["reward_errors"] == {"judge": 1} and event["signals"]["judge"]["unreadable"] == 1
    assert event["scoring_failures"] == 0 and event["failed_rollouts"] == 0


async def test_a_judge_still_starting_is_waited_for_before_the_first_rollout(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, caplog
):
    """The judge's server listens only seconds after the start and then answers 503 twice (a pod loading its model,
    as the Helm chart starts it beside the orchestrator). Its calls failed (here retries = 0, sample_attempts = 1:
    the run stopped); now the orchestrator waits for it with health NOT_SERVING, and the step completes with every
    grade."""
    import socket
    import threading

    from grpc import aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from gyre_orchestrator.service import OrchestratorService
    from support.judge_server import ScriptedServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judges = [{"name": "judge", "url": f"http://127.0.0.1:{port}", "retries": 0, "timeout_s": 5}]
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1, judges=judges,
                              sample_attempts=1, advantage={"drop_zero_signal": False})  # fmt: skip
    service = OrchestratorService(cfg)
    checked, up, stop = threading.Event(), threading.Event(), threading.Event()
    loading = ('{"error": {"message": "loading"}}', "application/json", 503)

    def serve_later():  # once the test has seen the health, and 2 s more
        checked.wait(30)
        if stop.wait(2):
            return
        with ScriptedServer(port=port) as server:
            server.models_script[:] = [loading, loading]
            up.set()
            stop.wait(120)

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    try:
        with caplog.at_level("INFO", logger="gyre.endpoint"):
            run = asyncio.create_task(service.run())
            while service.server.port is None and not run.done():
                await asyncio.sleep(0.05)
            async with aio.insecure_channel(f"127.0.0.1:{service.server.port}") as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            checked.set()
            assert not up.is_set() and health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await asyncio.wait_for(run, timeout=120) == 0
    finally:
        stop.set()
        thread.join(10)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for judge 'judge'")]
    assert len(waits) == 1 and f"127.0.0.1:{port}" in waits[0]
    assert events(cfg)[0]["scoring_failures"] == 0
    assert all(record["rewards"]["judge"] == 0.5 for record in dump(cfg))


@pytest.mark.parametrize("route", ["generate", "completions"])
async def test_the_teacher_logprobs_of_every_sampled_token_reach_the_batch(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, judge, route
):
    """The teacher is the student's own model (another server): at T = 1 its log-prob of every sampled token equals
    the sampler's, to 1e-4; off the loss mask the batch holds 0; groups of equal rewards are kept."""
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1,
                              teacher={"url": judge.url, "route": route})  # fmt: skip
    batch = await first_batch(cfg, tiny_model)
    assert batch.has_teacher and len(batch.samples) == 8  # nothing dropped for zero signal
    for rank in batch.micro_batches:
        for mb in rank:
            assert np.allclose(mb.teacher_logprobs[mb.loss_mask], mb.inference_logprobs[mb.loss_mask], atol=1e-4)
            assert not mb.teacher_logprobs[~mb.loss_mask].any()
    assert abs(events(cfg)[0]["teacher_kl"]) < 1e-4


CONTEXT = 64  # the policy's and the teacher's context in the tests below


@pytest.fixture(scope="module")
def short_policy(start_replica):
    return start_replica("--engine.max-model-len", str(CONTEXT))


@pytest.fixture(scope="module")
def short_teacher(start_replica):
    return start_replica("--engine.max-model-len", str(CONTEXT))


def prompts_env(tmp_path, *prompts: str) -> dict:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": p, "answer": "x"} for p in prompts] + [{"prompt": "cd", "answer": "x", "split": "eval"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"name": "dataset", "args": {"path": str(path)}}


def prompt_lengths(server, env: dict) -> dict[str, int]:
    """Task id -> tokens of its prompt as the policy renders it for a rollout (chat template, generation prompt)."""
    lengths = {}
    for task in load_environment("dataset", **env["args"]).train_tasks:
        body = {"messages": task.prompt, "add_generation_prompt": True}
        lengths[task.id] = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["count"]
    return lengths


def teacher_calls(service, outcome: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "gyre_orchestrator_signal_calls_total", {"run_id": service.cfg.run_id, "signal": "teacher", "outcome": outcome}
    )
    return value or 0.0


@pytest.mark.parametrize("server", ["gyre", "vllm"])
async def test_a_sample_that_fills_the_context_is_scored_by_a_teacher_of_the_same_context(
    tmp_path, redis_url, unique_run_id, short_policy, short_teacher, tiny_model, monkeypatch, server
):
    """The policy and the teacher serve a 64-token context; most samples run to it (prompt + completion = 64: the
    random tiny model rarely ends its turn). Prompt + the one generated token of the scoring request is 65: the
    teacher refused it, the sample was failed 3 times and the run stopped. Now the sample is scored as a prompt
    alone (echo, max_tokens 0), every token of it, equal to the sampler's log-probs (the teacher is the student).
    "vllm": the teacher refuses echo with max_tokens 0 as vLLM does (max_tokens >= 1): all but the last token are
    scored and the sample is trained whole, its last token without a distillation term (teacher_mask)."""
    if server == "vllm":
        from gyre.endpoint import RequestRefused
        from gyre_orchestrator.teacher import Teacher

        async def refused(self, token_ids):
            raise RequestRefused("teacher: 400 max_tokens must be at least 1, got 0 (vLLM)", 400)

        monkeypatch.setattr(Teacher, "_echoed", refused)
    env = prompts_env(tmp_path, "ab")
    room = CONTEXT - prompt_lengths(short_policy, env)["row-0"]
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, [short_policy], env=env, max_steps=1,
                              sampling={"max_tokens": room}, advantage={"drop_zero_signal": False},
                              teacher={"url": short_teacher.url})  # fmt: skip
    batch = await first_batch(cfg, tiny_model)
    lengths = [s["num_tokens"] for s in batch.samples]
    counts = events(cfg)[0]["signals"]["teacher"]
    assert len(batch.samples) == 8 and counts["refused"] >= 4, (lengths, counts)  # refused: the samples of 64
    assert lengths.count(CONTEXT) == counts["refused"]  # trained whole either way
    unscored = sum(int((mb.loss_mask & ~mb.teacher_mask).sum()) if mb.teacher_mask is not None else 0
                   for rank in batch.micro_batches for mb in rank)  # fmt: skip
    if server == "gyre":
        assert "cut" not in counts and unscored == 0  # every token scored
    else:
        assert counts["cut"] == counts["refused"] == unscored  # the last token of each: no teacher term
    for rank in batch.micro_batches:
        for mb in rank:
            scored = mb.loss_mask if mb.teacher_mask is None else mb.loss_mask & mb.teacher_mask
            assert np.allclose(mb.teacher_logprobs[scored], mb.inference_logprobs[scored], atol=1e-4)
    assert counts["ok"] >= 8 and "skipped" not in counts


async def test_a_sample_the_teacher_cannot_score_trains_on_its_reward_counted_and_the_run_goes_on(
    tmp_path, redis_url, unique_run_id, short_policy, start_replica, tiny_model, caplog
):
    """A teacher of a shorter context (40 tokens) than the policy's (64): the samples of the long prompt do not fit
    it even as a prompt alone; they are trained on their reward alone (teacher_mask False on every token: no
    distillation term without the teacher's log-probs), counted and logged once. Before, they were left out of the
    batch, their reward term with them."""
    teacher = start_replica("--engine.max-model-len", "40")
    env = prompts_env(tmp_path, "ab", "the quick brown fox jumps over the lazy dog, then it runs far far away")
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, [short_policy], env=env, max_steps=1,
                              sampling={"max_tokens": 8}, advantage={"drop_zero_signal": False},
                              teacher={"url": teacher.url})  # fmt: skip
    lengths = prompt_lengths(short_policy, env)
    # every sample of the short prompt fits the teacher, none of the long one (its prompt alone does not)
    assert lengths["row-0"] + 8 <= 40 < lengths["row-1"] and lengths["row-1"] + 8 <= CONTEXT, lengths
    with caplog.at_level("WARNING", logger="gyre_orchestrator.teacher"):
        batch = await first_batch(cfg, tiny_model)
    assert batch.has_teacher and {s["task_id"] for s in batch.samples} == {"row-0", "row-1"} and len(batch.samples) == 8
    for rank in batch.micro_batches:
        for mb in rank:
            for k, i in enumerate(mb.sample_index):
                start = int(mb.sample_lengths[:k].sum())
                scored = mb.teacher_mask[start : start + int(mb.sample_lengths[k])]
                assert scored.all() if batch.samples[i]["task_id"] == "row-0" else not scored.any()
    event = events(cfg)[0]
    assert event["signals"]["teacher"]["skipped"] == 4 and event["scoring_failures"] == 0
    warnings = [r.getMessage() for r in caplog.records if "refused a sample" in r.getMessage()]
    assert len(warnings) == 1 and "context length is 40" in warnings[0] and "on its reward alone" in warnings[0]


async def test_a_teacher_with_another_tokenizer_is_refused_before_the_run_starts(
    tmp_path, redis_url, unique_run_id, replicas
):
    """The student's token ids go to the teacher as they are: a teacher tokenizing differently (here a scripted
    server, one token per character) would score other text. It was used anyway; now the run stops before any
    sample, naming the setting."""
    from gyre_orchestrator.service import OrchestratorService
    from support.judge_server import ScriptedServer

    with ScriptedServer() as other:
        cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1,
                                  teacher={"url": other.url})  # fmt: skip
        service = OrchestratorService(cfg)
        with pytest.raises(ValueError, match="orchestrator.teacher: the teacher at .* tokenizes differently"):
            await asyncio.wait_for(service.run(), timeout=60)
        assert other.count("chat") == 0 and not [r for r in other.requests if r[0] != "tokenize"]


def other_special_tokens(tiny_model: Path, tmp_path_factory) -> Path:
    """The tiny model with its special tokens renamed, ids kept (as DeepSeek-R1-Distill-Qwen names Qwen's
    <|im_start|> / <|im_end|> ids <｜User｜> / <｜Assistant｜>): plain text tokenizes exactly as the policy's."""
    import shutil

    path = tmp_path_factory.getbasetemp() / "tiny-model-other-special-tokens"
    if (path / "config.json").exists():
        return path
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(tiny_model, staging)
    renamed = {"<|im_start|>": "<|User|>", "<|im_end|>": "<|Assistant|>"}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        text = (staging / name).read_text()
        for old, new in renamed.items():
            text = text.replace(old, new)
        (staging / name).write_text(text)
    staging.rename(path)
    return path


async def test_a_teacher_reading_the_chat_templates_special_tokens_as_others_is_refused(
    replicas, start_replica, tiny_model, tmp_path_factory
):
    """A teacher whose plain text tokenizes as the policy's but whose special tokens are others under the same ids
    passed the check: every prompt's role markers were other tokens to it, and its log-probs of the student's
    replies were those of another conversation. Now it is refused, naming both readings."""
    from gyre.config.endpoint import TeacherConfig
    from gyre_orchestrator.teacher import PROBE, Teacher

    other = start_replica(model=other_special_tokens(tiny_model, tmp_path_factory))
    probe = {"prompt": PROBE, "add_special_tokens": False}
    same_text = [httpx.post(f"{server.url}/tokenize", json=probe, timeout=30).json()["tokens"]
                 for server in (replicas[0], other)]  # fmt: skip
    assert same_text[0] == same_text[1]  # what the check compared before
    teacher = Teacher(TeacherConfig(url=other.url))
    with pytest.raises(ValueError, match=r"reads the token ids of the policy's chat template as other text "
                                         r"\('<\|im_start\|>user.* to the policy, '<\|User\|>user"):  # fmt: skip
        await teacher.check_tokenizer_once(replicas[0].url)
    await teacher.aclose()


async def test_the_tokenizer_check_runs_once_and_its_refusal_stays(replicas):
    """Where no replica is known at start (a fleet still starting) the check runs at the first sample: once, and
    every later sample gets the same refusal without asking again; the same tokenizer passes."""
    from gyre.config.endpoint import TeacherConfig
    from gyre_orchestrator.teacher import Teacher
    from support.judge_server import ScriptedServer

    with ScriptedServer() as other:
        teacher = Teacher(TeacherConfig(url=other.url))
        for _ in range(3):
            with pytest.raises(ValueError, match="tokenizes differently"):
                await teacher.check_tokenizer_once(replicas[0].url)
        assert other.count("tokenize") == 1
        await teacher.aclose()
    same = Teacher(TeacherConfig(url=replicas[1].url))
    await same.check_tokenizer_once(replicas[0].url)
    await same.aclose()


async def test_a_judge_too_short_for_a_rollout_scores_it_unjudged_and_the_run_goes_on(
    tmp_path, redis_url, unique_run_id, replicas, short_teacher, tiny_model, caplog
):
    """A real judge of a 64-token context: the long task's judge prompt does not fit it (400 context length), the
    short one's does. The long task's samples score 0 for the judge, named in their errors, counted
    (`reward_errors`, the judge's `refused`) and logged once; before, each was a scoring failure, generated again
    and refused again, and the run stopped."""
    env = prompts_env(tmp_path, "ab", "the quick brown fox jumps over the lazy dog, then it runs far far away")
    judges = [{"name": "judge", "url": short_teacher.url, **JUDGE, "prompt": "{question} {question}"}]
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, env=env, max_steps=1, judges=judges,
                              advantage={"drop_zero_signal": False})  # fmt: skip
    with caplog.at_level("WARNING"):
        await first_batch(cfg, tiny_model)
    records = dump(cfg)
    long = [r for r in records if r["task_id"] == "row-1"]
    assert len(long) == 4 and all(r["rewards"]["judge"] == 0.0 for r in long)
    event = events(cfg)[0]
    assert event["scoring_failures"] == 0 and event["reward_errors"] == {"judge": 4}
    assert event["signals"]["judge"]["refused"] >= 1  # shared in flight / cached: one request may serve several
    warnings = [r.getMessage() for r in caplog.records if "reward function 'judge' failed" in r.getMessage()]
    assert len(warnings) == 1 and "maximum context length is 64" in warnings[0]


VF_ENVS = Path(__file__).resolve().parents[2] / "verifiers_envs"


def judge_rubric_env(port: int) -> dict:
    """A ported verifiers environment graded by `vf.JudgeRubric` (tests/verifiers_envs/vf_hub_judge.py: its own
    `AsyncOpenAI` judge client, model "judge-model") on a training split, its judge at `port`."""
    rows = [{"question": "Reverse: abc", "answer": "cba"}, {"question": "Reverse: xyz", "answer": "zyx"}]
    return {"name": "vf_hub_judge:load_environment",
            "args": {"judge_base_url": f"http://127.0.0.1:{port}/v1", "dataset": rows}}  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_judge_rubric_judge_still_starting_is_waited_for_and_counted_as_a_configured_judge(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, caplog, monkeypatch
):
    """An environment's own `vf.JudgeRubric` judge whose server listens only seconds after the start and then
    answers 503 (a judge pod loading its model): it was not waited for, so its calls failed (retries = 0,
    sample_attempts = 1: the run stopped), and its counters were in no step line or metric. Now it is waited for
    like a `[[orchestrator.judges]]` one, named by its judge_model, and its calls are counted in the step line's
    `signals` and `gyre_orchestrator_signal_calls_total`."""
    import threading

    from gyre_orchestrator.service import OrchestratorService
    from support.judge_server import ScriptedServer

    monkeypatch.syspath_prepend(str(VF_ENVS))
    port = free_port()
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1, env=judge_rubric_env(port),
                              sample_attempts=1, advantage={"drop_zero_signal": False})  # fmt: skip
    service = OrchestratorService(cfg)
    stop, served = threading.Event(), []
    loading = ('{"error": {"message": "loading"}}', "application/json", 503)

    def serve_later():
        if stop.wait(3):
            return
        with ScriptedServer(port=port) as server:
            server.models_script[:] = [loading]
            server.script[:] = ["yes"] * 8
            served.append(server)
            stop.wait(120)

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    try:
        with caplog.at_level("INFO", logger="gyre.endpoint"):
            assert await asyncio.wait_for(service.run(), timeout=120) == 0
        requests = served[0].count("chat")
    finally:
        stop.set()
        thread.join(10)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for judge 'judge-model'")]
    assert len(waits) == 1 and f"127.0.0.1:{port}" in waits[0]
    event = events(cfg)[0]
    assert event["scoring_failures"] == 0
    # its counters, as a configured judge's: one request per rollout (two reward functions read one verdict)
    assert event["signals"]["judge-model"]["ok"] == requests == 8
    calls = service.metrics.registry.get_sample_value(
        "gyre_orchestrator_signal_calls_total", {"run_id": unique_run_id, "signal": "judge-model", "outcome": "ok"}
    )
    assert calls == 8


async def test_a_judge_rubric_judge_that_never_answers_stops_the_start_naming_it(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, monkeypatch
):
    """Nothing ever listens at the JudgeRubric's judge: the start fails with the judge's name, its URL and the
    wait's bound, before any rollout (its calls failed instead, as a scoring failure of the first samples)."""
    from gyre.endpoint import EndpointError
    from gyre_orchestrator.service import OrchestratorService

    monkeypatch.syspath_prepend(str(VF_ENVS))
    port = free_port()
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1, env=judge_rubric_env(port),
                              sample_attempts=1)  # fmt: skip
    service = OrchestratorService(cfg)
    service.signals["judge-model"].config.startup_timeout_s = 2  # 1800 s by default, as a configured judge's
    with pytest.raises(EndpointError, match=rf"judge 'judge-model': .*127.0.0.1:{port}/v1/models did not answer "
                                            r"within startup_timeout_s = 2s"):  # fmt: skip
        await asyncio.wait_for(service.run(), timeout=60)
    assert not (cfg.output_dir / "rollouts" / "step_1.jsonl").exists()
