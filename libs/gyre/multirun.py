"""`gyre rl` with `[[runs]]`: several runs on one base model, one trainer and the same inference replicas.

    gyre rl @ configs/multirun/two_runs.toml

What changes against a single run (docs/architecture.md, "Multi-run"):
- every run has its own folder `{output_dir}/runs/{name}` (weights, checkpoints, events, rollouts),
  Redis stream `gyre:{name}:batches` and orchestrator process (`orchestrator-{name}`, its own port),
  which sends its requests under the model name `{name}` and relays the run's versions to that name;
- the one trainer gets `trainer.runs` (one LoRA adapter, optimizer and schedule per run) and exits once
  every run reached its `max_steps`;
- every inference replica serves the base model plus each run's adapter under the run's name
  (`lora.adapters`; `lora.max_loras` one per run, two on vLLM, `lora.max_rank` the largest run rank).
Shared: the base model (and SFT warm-up), Redis, the replicas, the trainer's model/loss/data keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from gyre.config import ConfigError
from gyre.config.inference import InferenceConfig, loras_for_runs
from gyre.config.loader import deep_merge
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.rl import RLConfig
from gyre.config.trainer import TrainerConfig
from gyre.events import read_events
from gyre.net import free_port


def run_dir(cfg: RLConfig, name: str) -> Path:
    return Path(cfg.output_dir) / "runs" / name


def run_steps(cfg: RLConfig) -> dict[str, int]:
    """Each run's max_steps (a run without its own takes the top-level one)."""
    return {r.name: r.max_steps or cfg.max_steps for r in cfg.runs}


def resolve_multirun_configs(cfg: RLConfig, shared: dict, model: dict, redis_url: str) -> dict[str, Any]:
    """The services' configs of a multi-run experiment (the single-run `launcher.resolve_configs` otherwise)."""
    from gyre.launcher import _derived_seq_len, _validated

    if cfg.trainer_nproc != 1:
        raise ConfigError("config key 'runs': multi-run trains in one trainer process; set trainer_nproc = 1")
    steps, seq_len = run_steps(cfg), _derived_seq_len(cfg)
    orch_ports = {r.name: free_port() for r in cfg.runs}
    trainer_ckpt = {"interval": cfg.ckpt.interval, "keep_last": cfg.ckpt.keep_last} if cfg.ckpt.enabled else {}
    runs = [
        deep_merge(
            {"name": r.name, "output_dir": str(run_dir(cfg, r.name)), "max_steps": steps[r.name],
             "orchestrator": {"address": f"127.0.0.1:{orch_ports[r.name]}"},
             **({"resume_step": cfg.ckpt.resume_step} if cfg.ckpt.resume_step is not None else {})},
            r.trainer,
        )
        for r in cfg.runs
    ]  # fmt: skip
    trainer = _validated(TrainerConfig, "trainer", cfg.trainer, {
        **shared, "model": model, "server": {"port": free_port()}, "metrics": {"port": free_port()},
        "ckpt": trainer_ckpt, "data": {"seq_len": seq_len}, "runs": runs,
    })  # fmt: skip
    max_rank = max((r.lora or trainer.lora).rank for r in trainer.runs)
    names = [r.name for r in cfg.runs]
    max_loras = loras_for_runs(cfg.inference.get("backend", "torch"), len(names))
    replicas = []
    for i in range(cfg.inference_replicas):
        values = {**shared, "model": model, "server": {"port": free_port()}, "control": {"port": free_port()},
                  "lora": {"adapters": names, "max_loras": max_loras, "max_rank": max_rank}}  # fmt: skip
        replicas.append(_validated(InferenceConfig, f"inference.{i}", cfg.inference, values))
    orchestrators = {}
    for r in cfg.runs:
        launcher_values = {
            **shared, "run_id": r.name, "output_dir": str(run_dir(cfg, r.name)), "max_steps": steps[r.name],
            "server": {"port": orch_ports[r.name]}, "metrics": {"port": free_port()},
            "inference": {
                "urls": [f"http://127.0.0.1:{c.server.port}" for c in replicas],
                "control_urls": [f"127.0.0.1:{c.control.port}" for c in replicas], "model": r.name,
            },
            "batch": {"dp_world_size": 1, "seq_len": seq_len},
            "ckpt_interval": cfg.ckpt.interval if cfg.ckpt.enabled else 1,
            **({"resume_step": cfg.ckpt.resume_step} if cfg.ckpt.resume_step is not None else {}),
        }  # fmt: skip
        user = deep_merge(cfg.orchestrator, r.orchestrator)
        orchestrators[r.name] = _validated(OrchestratorConfig, "orchestrator", user, launcher_values)
    return {"inference": replicas, "trainer": trainer, "orchestrators": orchestrators,
            "orchestrator": orchestrators[names[0]]}  # fmt: skip


def finished(cfg: RLConfig) -> bool:
    from gyre.runstate import committed_step

    return all(committed_step(run_dir(cfg, name)) >= n for name, n in run_steps(cfg).items())


class MultiRunProgress:
    """One bar over every run's steps; the postfix shows each run's step and latest train reward."""

    def __init__(self, cfg: RLConfig):
        self.dirs = {name: run_dir(cfg, name) / "events" for name in run_steps(cfg)}
        self.bar = tqdm(total=sum(run_steps(cfg).values()), desc="rl", unit="step", dynamic_ncols=True)
        self.done = 0
        self._post: dict = {}

    def update(self) -> None:
        done, post = 0, {}
        for name, folder in self.dirs.items():
            trained = read_events(folder / "trainer_steps.jsonl")
            orch = read_events(folder / "orchestrator_steps.jsonl")
            step = max((e["step"] for e in trained), default=0)
            done += step
            reward = f" r={orch[-1].get('reward_mean', float('nan')):.2f}" if orch else ""
            post[name] = f"{step}{reward}"
        if done > self.done:
            self.bar.update(done - self.done)
            self.done = done
        if post != self._post:
            self._post = post
            self.bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        self.bar.close()


def summarize_runs(cfg: RLConfig, wall_seconds: float | None = None) -> str:
    from gyre.report import summarize

    return "\n".join(f"run {name}:\n{summarize(run_dir(cfg, name), wall_seconds)}" for name in run_steps(cfg))
