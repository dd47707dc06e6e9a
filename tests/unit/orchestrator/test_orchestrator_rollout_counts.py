"""`gyre_orchestrator_rollouts_total` counts each finished rollout once, by outcome, through the service's real
scheduler, environment (reverse_text) and push (a real redis-server); only the model is a test double."""

from __future__ import annotations

import asyncio

from gyre.config import load_config
from gyre.config.orchestrator import OrchestratorConfig
from gyre.envs import Turn
from gyre.redis_server import EmbeddedRedis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


class VersionedClient:
    """A `ModelClient` whose answers come from the policy versions `versions`, in order (then 1)."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = list(versions)

    def for_version(self, min_version: int, *, priority: int | None = None) -> VersionedClient:
        return self

    async def chat(self, messages, *, tools=None, sampling) -> Turn:
        v = self.versions.pop(0) if self.versions else 1
        return Turn(prompt_token_ids=[1, 2, 3], completion_token_ids=[5, 2], completion_logprobs=[-0.1, -0.2],
                    text="cba", policy_version_min=v, policy_version_max=v)  # fmt: skip


def test_a_stale_rollout_counts_once_as_stale_not_also_as_ok(tmp_path):
    # audit: a rollout was counted ok (or truncated) when it finished and again as stale when admission dropped it,
    # so the outcomes of gyre_orchestrator_rollouts_total summed to more rollouts than were generated
    from gyre_orchestrator.mix import TaskMix
    from gyre_orchestrator.service import OrchestratorService

    server = EmbeddedRedis().start()
    cfg = load_config(
        OrchestratorConfig, [], output_dir=str(tmp_path), run_id="counts", redis={"url": server.url},
        batch_size=1, rollouts_per_example=2, max_async_level=0, max_steps=2, advantage={"drop_zero_signal": False},
    )  # fmt: skip

    async def main():
        orch = OrchestratorService(cfg)
        try:
            orch.client = VersionedClient([0, 1, 1])  # batch 2's floor is version 1: the first answer is stale
            orch.versions.set(1)
            orch.sampler = TaskMix({"reverse_text": orch.env.tasks("train", seed=0)}, {"reverse_text": 1.0})
            orch.scheduler = orch._new_scheduler(start_step=2)
            st = await asyncio.wait_for(orch.scheduler.next_batch(), timeout=10)
            await orch.push(st)
            await orch.scheduler.stop()
            return st, generate_latest(orch.metrics.registry).decode()
        finally:
            orch.redis.close()

    try:
        st, text = asyncio.run(main())
    finally:
        server.stop()
    outcomes = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "gyre_orchestrator_rollouts_total"}  # fmt: skip
    assert st.dropped_stale == 1 and len(st.samples) == 2
    assert outcomes.get("stale") == 1
    assert outcomes.get("ok", 0) + outcomes.get("truncated", 0) == 2  # the two admitted, and only they
    assert sum(outcomes.values()) == 3  # every rollout generated, once
