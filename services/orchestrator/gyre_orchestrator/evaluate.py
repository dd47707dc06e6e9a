"""Evaluation on an environment's held-out split: avg@k and pass@k.

For each of the first `num_examples` eval tasks, `k` rollouts are sampled and scored:
- `avg@k`  = mean reward over all `num_examples * k` samples;
- `avg@k stderr` = standard error of that mean with tasks as the unit (sample std of the per-task means over
  sqrt(num_examples)), so two evals on the same split compare with their noise in view;
- `pass@k` = fraction of tasks with at least one sample whose reward is >= `pass_threshold`
  (with exactly k samples per task this is the unbiased pass@k estimator's n = k case).

The service runs this every `eval.interval` weights versions (see service.py); `gyre eval` runs it
once against whatever the replicas serve and appends the result to `{output_dir}/events/eval.jsonl`:

    gyre eval --env.name reverse_text --inference.urls '["http://127.0.0.1:8000"]' --eval.num-examples 16
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass

from gyre.envs import Environment, SamplingParams
from gyre.envs.types import ModelClient

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    env: str
    avg_at_k: float
    pass_at_k: float
    k: int
    num_examples: int
    min_version: int
    max_version: int
    seconds: float
    avg_at_k_stderr: float = 0.0

    def record(self, step: int) -> dict:
        """The `eval.jsonl` line (docs/architecture.md, "Event logs") plus version/timing extras."""
        return {"step": step, **asdict(self)}


async def evaluate(
    env: Environment,
    client: ModelClient,
    *,
    env_name: str,
    num_examples: int,
    k: int,
    sampling: SamplingParams,
    pass_threshold: float = 1.0,
) -> EvalResult:
    """Evaluate `client`'s policy on the first `num_examples` eval tasks (fewer if the split is smaller)."""
    if num_examples < 1 or k < 1:
        raise ValueError("num_examples and k must be >= 1")
    source = env.tasks("eval")
    count = min(num_examples, source.size) if source.size is not None else num_examples
    tasks = [source[i] for i in range(count)]
    start = time.monotonic()

    async def one(i: int, j: int):
        # sample j of task i: with a seed, its own one, the same at every version evaluated (common random
        # numbers: the difference between two versions is less noisy than either score)
        rollout = await env.rollout(client, tasks[i], sampling.for_request("eval", i, j))
        score = await env.score(tasks[i], rollout)
        return score.reward, rollout.policy_version_min, rollout.policy_version_max

    results = await asyncio.gather(*(one(i, j) for i in range(count) for j in range(k)))
    rewards = [r for r, _, _ in results]
    per_task = [rewards[i * k : (i + 1) * k] for i in range(count)]
    task_means = [sum(group) / k for group in per_task]
    return EvalResult(
        env=env_name,
        avg_at_k=sum(rewards) / len(rewards),
        pass_at_k=sum(any(r >= pass_threshold for r in group) for group in per_task) / count,
        k=k,
        num_examples=count,
        min_version=min(v for _, v, _ in results),
        max_version=max(v for _, _, v in results),
        seconds=time.monotonic() - start,
        avg_at_k_stderr=statistics.stdev(task_means) / math.sqrt(count) if count > 1 else 0.0,
    )


def eval_sampling(cfg) -> SamplingParams:
    """Eval sampling: the train sampling settings with the eval temperature."""
    return SamplingParams(
        temperature=cfg.eval.temperature,
        top_p=cfg.sampling.top_p if cfg.eval.temperature > 0 else 1.0,
        max_tokens=cfg.sampling.max_tokens,
        seed=cfg.sampling.seed,
    )


async def _run_once(cfg) -> EvalResult:
    from gyre.envs import load_environment
    from gyre.events import EVAL, EventLog, events_dir

    from gyre_orchestrator.client import InferenceClient, close_replica_clients
    from gyre_orchestrator.replicas import ReplicaSet, make_discovery

    env = load_environment(cfg.env.name, **cfg.env.args)
    replicas = ReplicaSet(cooldown_s=cfg.inference.failure_cooldown_s)
    discovery = make_discovery(cfg.inference, replicas)
    await discovery.start()
    client = InferenceClient(
        replicas,
        model=cfg.inference.model,
        api_key=cfg.inference.api_key,
        max_concurrency=cfg.inference.max_concurrency,
        timeout_s=cfg.inference.timeout_s,
        retries=cfg.inference.retries,
    )
    try:
        result = await evaluate(
            env,
            client,
            env_name=cfg.env.name,
            num_examples=cfg.eval.num_examples,
            k=cfg.eval.k,
            sampling=eval_sampling(cfg),
            pass_threshold=cfg.eval.pass_threshold,
        )
    finally:
        aclose = getattr(env, "aclose", None)  # environments holding servers (verifiers) release them
        if aclose is not None:
            await aclose()
        await discovery.stop()
        await close_replica_clients(list(replicas))
    with EventLog(events_dir(cfg.output_dir) / EVAL) as events:
        events.append(result.record(step=result.min_version))
    return result


def main(argv: list[str]) -> int:
    """`gyre eval`: one evaluation of the served policy; prints the result as JSON."""
    from gyre.config import parse_or_exit
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.logging import setup_logging

    cfg = parse_or_exit(OrchestratorConfig, argv, "gyre eval")
    setup_logging(cfg.log.level, cfg.log.file, service="eval")
    if cfg.log.level != "DEBUG":  # the openai client's HTTP stack logs a line per request at INFO
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    result = asyncio.run(_run_once(cfg))
    print(json.dumps(result.record(step=result.min_version)))
    return 0
