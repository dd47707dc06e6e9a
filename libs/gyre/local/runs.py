"""`gyre rl`'s run resolution: an experiment's runs and one validated config per service.

An experiment has N runs. A single-run experiment is N = 1: the run is the experiment itself (`run_id`,
`output_dir`, `max_steps`). With `[[runs]]` (configs/multirun/two_runs.toml; docs/architecture.md,
"Multi-run") every run has its own folder `{output_dir}/runs/{name}` (weights, checkpoints, events,
rollouts), Redis stream `gyre:{name}:batches` and orchestrator process (its own port), which sends its
requests under the model name `{name}` and relays the run's versions to that name. The one trainer
then gets `trainer.runs` (one LoRA adapter, optimizer and schedule per run) and every inference replica
serves the base model plus each run's adapter under the run's name. Shared by every run: the base
model (and SFT warm-up), Redis, the replicas, the trainer's model/loss/data keys.

Every port is chosen here so nothing collides, and the orchestrators' packing shape is derived from the
trainer (`gyre.config.packing`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config import ConfigError, load_config
from gyre.config.inference import InferenceConfig, loras_for_runs
from gyre.config.loader import deep_merge
from gyre.config.mistakes import under_section
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.packing import PackingShape
from gyre.config.rerun import env_changes, moved_with, same_model
from gyre.config.rl import RLConfig
from gyre.config.trainer import TrainerConfig
from gyre.net import free_port
from gyre.runstate import committed_step


@dataclass(frozen=True)
class Run:
    """One run of an experiment: where it lives and how far it goes, plus its own keys."""

    name: str
    output_dir: Path
    max_steps: int
    trainer: dict[str, Any] = field(default_factory=dict)  # its keys of trainer.runs[] (multi-run)
    orchestrator: dict[str, Any] = field(default_factory=dict)  # its [orchestrator] keys that differ


def experiment_runs(cfg: RLConfig) -> list[Run]:
    """The experiment's runs: `[[runs]]`, or the experiment itself as its single run."""
    if not cfg.runs:
        return [Run(cfg.run_id, Path(cfg.output_dir), cfg.max_steps)]
    return [
        Run(r.name, Path(cfg.output_dir) / "runs" / r.name, r.max_steps or cfg.max_steps, r.trainer, r.orchestrator)
        for r in cfg.runs
    ]


@dataclass
class ServiceConfigs:
    """The validated config of every service of one launch."""

    inference: list[InferenceConfig]  # one per replica
    trainer: TrainerConfig
    orchestrators: dict[str, OrchestratorConfig]  # one per run, by run name
    servers: dict[str, InferenceConfig] = field(default_factory=dict)  # [[servers]]: judges, reward models, teacher

    @property
    def orchestrator(self) -> OrchestratorConfig:
        """The first run's orchestrator (a single run's only one)."""
        return next(iter(self.orchestrators.values()))


def resolve_configs(cfg: RLConfig, model_name: str, redis_url: str) -> ServiceConfigs:
    """Build and validate one config per service (errors name the section and key)."""
    runs, multi = experiment_runs(cfg), bool(cfg.runs)
    if multi and cfg.trainer_nproc != 1:
        raise ConfigError("config key 'runs': multi-run trains in one trainer process; set trainer_nproc = 1")
    _refuse_one_sided_rewinds(cfg)
    shape = PackingShape.derive(cfg.trainer, cfg.orchestrator, cfg.trainer_nproc)
    shared = {
        "run_id": cfg.run_id,
        "output_dir": str(cfg.output_dir),
        "redis": {"url": redis_url},
        "log": cfg.log.model_dump(exclude_none=True),  # log.file: every service appends to it too
        "wandb": cfg.wandb.model_dump(),
    }
    model = {"name": model_name, "dtype": cfg.model.dtype}
    resume = {"resume_step": cfg.ckpt.resume_step} if cfg.ckpt.resume_step is not None else {}
    orchestrator_ports = {run.name: free_port() for run in runs}

    trainer_values = {
        **shared, "model": model, "server": {"port": free_port()}, "metrics": {"port": free_port()},
        "ckpt": {"interval": cfg.ckpt.interval, "keep_last": cfg.ckpt.keep_last} if cfg.ckpt.enabled else {},
        "data": {"seq_len": shape.seq_len},
    }  # fmt: skip
    per_run = [
        {"output_dir": str(run.output_dir), "max_steps": run.max_steps,
         "orchestrator": {"address": f"127.0.0.1:{orchestrator_ports[run.name]}"}}
        for run in runs
    ]  # fmt: skip
    if multi:  # trainer.runs: each run's own keys on top
        trainer_values["runs"] = [
            deep_merge({"name": run.name, **values, **resume}, run.trainer)
            for run, values in zip(runs, per_run, strict=True)
        ]
    else:  # the run is the trainer's own: run_id and output_dir are the shared ones
        trainer_values |= {"max_steps": runs[0].max_steps, "orchestrator": per_run[0]["orchestrator"]}
        trainer_values["ckpt"] = {**trainer_values["ckpt"], **resume}
    try:
        trainer = _validated(TrainerConfig, "trainer", cfg.trainer, trainer_values)
    except ConfigError as e:
        raise _runs_entry_keys(e) if multi else e from None

    served = served_adapters(cfg, trainer, [run.name for run in runs] if multi else [])
    serving = {key: value for key, value in shared.items() if key in InferenceConfig.model_fields}  # no Redis, W&B
    replicas = []
    taken: set[int] = set()  # ports the user chose for this launch's servers: each once
    chosen = _user_port("inference.server.port", cfg.inference.get("server"), cfg.inference_replicas, taken)
    for i in range(cfg.inference_replicas):
        port = free_port() if chosen is None else chosen + i
        values = {**serving, "model": model, "server": {"port": port}, "control": {"port": free_port()}}
        replicas.append(_validated(InferenceConfig, f"inference.{i}", cfg.inference, values | served))

    servers = {}
    for server in cfg.servers:
        key = f"servers.{server.name}.args.server.port"
        port = _user_port(key, server.args.get("server"), taken=taken) or free_port()
        values = {**serving, "run_id": f"{cfg.run_id}-{server.name}", "model": {"name": server.model},
                  "server": {"port": port}, "control": {"port": free_port()}}  # fmt: skip
        servers[server.name] = _validated(InferenceConfig, f"servers.{server.name}.args", server.args, values)

    orchestrators = {}
    for index, run in enumerate(runs):
        user = _server_urls(_run_orchestrator(cfg.orchestrator, run.orchestrator, index), servers)
        # a rewind needs the orchestrator's progress checkpoint of every step the trainer still has one of; it writes
        # them as it pushes, up to max_async_level + 1 steps ahead of the trainer's
        ahead = int(user.get("max_async_level", OrchestratorConfig.model_fields["max_async_level"].default)) + 1
        own = run.trainer.get("resume_step")  # a [[runs]] entry's own rewind rewinds its orchestrator too
        run_resume = {"resume_step": own} if own is not None else resume
        values = {
            **shared, "run_id": run.name, "output_dir": str(run.output_dir), "max_steps": run.max_steps,
            "server": {"port": orchestrator_ports[run.name]}, "metrics": {"port": free_port()},
            "inference": {
                "urls": [f"http://127.0.0.1:{c.server.port}" for c in replicas],
                "control_urls": [f"127.0.0.1:{c.control.port}" for c in replicas],
                **({"model": run.name} if multi else {}),  # the run's adapter, by name
                # enough requests in flight to fill every replica's batch (the orchestrator's own default, 64,
                # left a 256-row engine a quarter full); a user's value wins
                "max_concurrency": sum(c.engine.max_batch_size for c in replicas),
            },
            **shape.orchestrator_values(),
            # progress checkpoints are a few hundred bytes: always on, so a re-run never repeats tasks
            "ckpt_interval": cfg.ckpt.interval if cfg.ckpt.enabled else 1,
            "ckpt_keep_last": cfg.ckpt.keep_last + ahead,
            **run_resume,
        }  # fmt: skip
        try:
            orchestrators[run.name] = _validated(OrchestratorConfig, "orchestrator", user, values)
        except ConfigError as e:
            if not run.orchestrator:
                raise
            # [orchestrator] alone is valid: the mistake is in this [[runs]] entry's table, so name that one
            # ("orchestrator.batch_sise" sent the user looking in [orchestrator] for a key that was not there)
            try:
                _validated(OrchestratorConfig, "orchestrator", _server_urls(cfg.orchestrator, servers), values)
            except ConfigError:
                raise e from None
            raise ConfigError(str(e).replace("'orchestrator.", f"'runs.{index}.orchestrator.")) from None
    if trainer.loss.distill > 0:
        lacking = [name for name, orch in orchestrators.items() if orch.teacher is None]
        if lacking:
            raise ConfigError(
                f"config key 'trainer.loss.distill': {trainer.loss.distill} needs a teacher: set "
                "[orchestrator.teacher] (e.g. url = 'server:teacher' with a [[servers]] entry named teacher; "
                "docs/algorithms.md)"
            )
    elif any(orch.teacher is not None for orch in orchestrators.values()):
        # the teacher's log-probs then train nothing, yet a teacher keeps every group of equal rewards (their zero
        # advantages count in the loss's token normaliser and shrink every other token's weight): an RL run that
        # looked like distillation, silently
        raise ConfigError(
            "config key 'trainer.loss.distill': 0 with [orchestrator.teacher] set: the teacher's log-probs would "
            "train nothing, and groups of equal rewards would still be kept for them; set trainer.loss.distill > 0 "
            "(e.g. 1; docs/algorithms.md, on-policy distillation) or remove [orchestrator.teacher]"
        )
    return ServiceConfigs(replicas, trainer, orchestrators, servers)


def _run_orchestrator(shared: dict[str, Any], own: dict[str, Any], index: int) -> dict[str, Any]:
    """A [[runs]] entry's orchestrator keys over [orchestrator]. Its `env` table naming an environment (`name`) is the
    run's own environment, also where [orchestrator] is a mix ([[orchestrator.env]]): that was refused as "config key
    'env': is a list of 2 tables", naming neither the entry nor a form a [[runs]] entry can write."""
    env, shared_env = own.get("env"), shared.get("env")
    if isinstance(env, dict) and isinstance(shared_env, list):
        if "name" in env:
            shared = {key: value for key, value in shared.items() if key != "env"}
        elif not all(key.isdigit() and int(key) < len(shared_env) and isinstance(v, dict) for key, v in env.items()):
            key = f"runs.{index}.orchestrator.env"
            raise ConfigError(
                f"config key '{key}': [orchestrator] trains a mix of {len(shared_env)} environments; give the run its "
                f"own environment (a table with its name), its own mix ([[runs.orchestrator.env]] entries), or set "
                f'keys of the shared entries by index (env = {{ "1" = {{ ratio = 3 }} }}), not {sorted(env)} alone'
            )
    return deep_merge(shared, own)


def _user_port(key: str, server: Any, count: int = 1, taken: set[int] | None = None) -> int | None:
    """The HTTP port at `key` (an `inference.server` or a `[[servers]]` entry's `args.server` table) when the user set
    it (replica i serves on port + i), else None (a free port each). PRIME-RL users set it to reach the policy
    (`vf-eval -b http://localhost:8000/v1`, curl): it was replaced by a random port, silently (a judge's too). A port
    that is taken, or that another of the launch's servers was given (`taken`, updated), is refused, naming the key,
    not a server that fails to bind."""
    import socket

    given = server.get("port") if isinstance(server, dict) else None
    if given is None:
        return None
    try:
        port = int(given)
    except (TypeError, ValueError):
        raise ConfigError(f"config key '{key}': {given!r} is not a port number") from None
    if port <= 0 or port + count - 1 > 65535:
        raise ConfigError(f"config key '{key}': {port} is no port for {count} server(s) (port + i for replica i); "
                          "unset it for free ports")  # fmt: skip
    host = str(server.get("host", "127.0.0.1"))
    taken = set() if taken is None else taken
    for one in range(port, port + count):
        if one in taken:
            raise ConfigError(f"config key '{key}': port {one} is another server's of this launch (replicas serve "
                              "on inference.server.port + i); choose another or unset it for a free port")  # fmt: skip
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
            try:
                sock.bind((host, one))
            except OSError as e:
                raise ConfigError(f"config key '{key}': port {one} on {host} is in use ({e.strerror}: another "
                                  "server, or a run still going?); choose another or unset it for a free "
                                  "port") from None  # fmt: skip
        taken.add(one)
    return port


SERVER_URL = "server:"  # url = "server:<name>" in orchestrator settings: a [[servers]] entry of gyre rl


def _server_urls(values: dict[str, Any], servers: dict[str, InferenceConfig]) -> dict[str, Any]:
    """`values` (orchestrator keys) with every `url = "server:<name>"` of its judges, reward models and teacher
    replaced by that local server's URL; ConfigError naming the key for a name no [[servers]] entry has."""

    def resolve(entry: Any, key: str) -> Any:
        url = entry.get("url") if isinstance(entry, dict) else None
        if not (isinstance(url, str) and url.startswith(SERVER_URL)):
            return entry
        name = url[len(SERVER_URL) :]
        if name not in servers:
            known = ", ".join(servers) or "none"
            raise ConfigError(f"config key 'orchestrator.{key}.url': no [[servers]] entry named {name!r} ({known})")
        return {**entry, "url": f"http://127.0.0.1:{servers[name].server.port}"}

    values = dict(values)
    for key in ("judges", "reward_models"):
        if isinstance(values.get(key), list):
            values[key] = [resolve(entry, f"{key}.{i}") for i, entry in enumerate(values[key])]
    if "teacher" in values:
        values["teacher"] = resolve(values["teacher"], "teacher")
    return values


def served_adapters(cfg: RLConfig, trainer: TrainerConfig, names: list[str]) -> dict[str, Any]:
    """[inference] LoRA defaults (keys the user set win).

    Several runs: every run's adapter under its name (`lora.adapters`), `lora.max_loras` enough to serve them
    all without waiting (`loras_for_runs`), `lora.max_rank` the largest run rank. A single run that publishes
    its adapter alone (`trainer.lora.publish = "adapter"`) to the vLLM backend, which serves adapters only with
    LoRA on: two slots (a request keeps the version it started with, so the previous one finishes while new
    requests use the next) of the trainer's rank. The torch backend merges such versions into its weights and
    needs neither."""
    backend = cfg.inference.get("backend", "torch")
    if names:
        rank = max((run.lora or trainer.lora).rank for run in trainer.runs)
        return {"lora": {"adapters": names, "max_loras": loras_for_runs(backend, len(names)), "max_rank": rank}}
    if backend != "vllm" or trainer.lora is None or trainer.lora.publish != "adapter":
        return {}
    return {"lora": {"max_loras": loras_for_runs(backend, 1), "max_rank": trainer.lora.rank}}


# Keys every service must share: set in a section they silently split the run (a trainer waiting for steps
# its orchestrator never makes, a stream or folder of their own, inference serving another model).
EXPERIMENT_KEYS = ("run_id", "output_dir", "max_steps", "redis.url", "model.name")


def _refuse_experiment_keys(section: str, user: dict) -> None:
    where = section.split(".")[0] if section.startswith("inference.") else section
    for dotted in EXPERIMENT_KEYS:
        *parents, last = dotted.split(".")
        node: Any = user
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            if where.startswith("servers."):
                instead = "the server's `model`" if dotted == "model.name" else f"the top-level {dotted}"
            else:
                instead = f"the top-level {dotted}" + (" (or a [[runs]] entry's)" if dotted == "max_steps" else "")
            raise ConfigError(
                f"config key '{where}.{dotted}': gyre rl gives every service the same {dotted}; set {instead}"
            )


def _refuse_one_sided_rewinds(cfg: RLConfig) -> None:
    """A rewind set in one service's section reached that service alone: a trainer rewound to N under an
    orchestrator that resumed after the abandoned batches waited for step N + 1 forever (and an orchestrator
    rewound alone regenerated steps the trainer had trained). gyre rl rewinds both, from the top-level key."""
    both = "set the top-level ckpt.resume_step (--ckpt.resume-step N): it rewinds trainer and orchestrator together"
    if isinstance(cfg.trainer.get("ckpt"), dict) and "resume_step" in cfg.trainer["ckpt"]:
        raise ConfigError(f"config key 'trainer.ckpt.resume_step': a trainer rewound alone waits forever for a batch "
                          f"its orchestrator has already pushed; {both}")  # fmt: skip
    if "resume_step" in cfg.orchestrator:
        raise ConfigError(f"config key 'orchestrator.resume_step': an orchestrator rewound alone generates again the "
                          f"steps its trainer has trained; {both}")  # fmt: skip
    if "runs" in cfg.trainer:
        raise ConfigError("config key 'trainer.runs': gyre rl builds it from the [[runs]] entries (their trainer keys "
                          "are the run's keys of trainer.runs[]); set [[runs]] instead")  # fmt: skip
    for index, run in enumerate(cfg.runs):
        if "resume_step" in run.orchestrator:
            raise ConfigError(f"config key 'runs.{index}.orchestrator.resume_step': set the run's trainer.resume_step "
                              "(trainer = {resume_step = N}): it rewinds the run's trainer and orchestrator "
                              "together")  # fmt: skip


def _runs_entry_keys(error: ConfigError) -> ConfigError:
    """`error` of the trainer's config with its `trainer.runs.N.` keys written as the user wrote them: the [[runs]]
    entry's own keys (`runs.N.name`, `runs.N.max_steps`) and its `trainer` table (`runs.N.trainer.optim.lr`); gyre rl
    builds trainer.runs, and refuses it set by hand, so 'trainer.runs.0.optim.lrr' named a key no file had."""

    def where(match: re.Match) -> str:
        index, key = match.group(1), match.group(2)
        own = key.split(".")[0] in ("name", "max_steps")
        return f"'runs.{index}.{key}" if own else f"'runs.{index}.trainer.{key}"

    return ConfigError(re.sub(r"'trainer\.runs\.(\d+)\.([\w.]+)", where, str(error)))


def _validated(cls, section: str, user: dict, launcher: dict):
    """Launcher-chosen values (ports, paths) under the user's section; errors name the section."""
    if isinstance(user.get("model"), str):  # `model = "m"`, the model's name (ModelConfig): refused as model.name
        user = {**user, "model": {"name": user["model"]}}
    _refuse_experiment_keys(section, user)
    values = deep_merge(launcher, user)
    # Ports and addresses are the launcher's: a user value would break the wiring.
    for key in ("server", "control"):
        if key in launcher and key in user and "port" in user[key]:
            values[key]["port"] = launcher[key]["port"]
    try:
        return load_config(cls, [], **values)
    except ConfigError as e:
        # `inference.0` (a replica) is the user's [inference]; `servers.judge.args` is that entry's own table
        raise under_section(e, section if section.startswith("servers.") else section.split(".")[0]) from None


def validate_extensions(configs: ServiceConfigs, cfg: RLConfig | None = None) -> None:
    """Names that the config models cannot check alone: the environment (built-in or import path, and
    its arguments) and the loss (built-in or import path). Raises ConfigError naming the key: a [[runs]]
    entry's own environment by its entry (`runs.1.orchestrator.env`; it named the shared one)."""
    from gyre.envs import load_environment

    entries = {run.name: (index, run) for index, run in enumerate(cfg.runs)} if cfg is not None else {}
    for name, orch in configs.orchestrators.items():
        index, run = entries.get(name, (None, None))
        own = run is not None and "env" in run.orchestrator
        key = f"runs.{index}.orchestrator.env" if own else "orchestrator.env"
        for i, entry in enumerate(orch.envs):  # a mix's entries ([[orchestrator.env]]) by their index
            try:
                load_environment(entry.name, **entry.args)
            except Exception as e:  # EnvironmentLoadError, or the environment's own argument checks
                raise ConfigError(f"config key '{key}{f'.{i}' if isinstance(orch.env, list) else ''}': {e}") from None
    loss = configs.trainer.loss.type
    if ":" in loss:
        from gyre.imports import load_callable

        try:
            load_callable(loss, f"loss {loss!r}")
        except ValueError as e:
            raise ConfigError(f"config key 'trainer.loss.type': {e}") from None


def _adapter_shape(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    """What of a LoRA config its checkpoints and published adapters are shaped by (None: full fine-tuning)."""
    if not lora:
        return None
    return {"rank": lora.get("rank"), "target_modules": sorted(lora.get("target_modules") or [])}


def refuse_changed_run_keys(cfg: RLConfig, configs: ServiceConfigs) -> None:
    """ConfigError naming the key when a re-run of an existing run (no --fresh) changes what the run is: its run_id
    (its stream, W&B runs and metrics), its environment (orchestrator.env, the whole dumped section: one environment
    or several) and its task sampler's seed, the policy model (model.name, the SFT warm-up on or off, or its base) or
    the LoRA adapter (on or off, rank, target modules). A run has started once a step is trained or a batch pushed
    (its samples wait in the stream). Its checkpoints and published weights cannot be loaded into another shape (the
    trainer failed only after every service had started) or, for another model of the same shape, would silently
    replace it. Read from the configs the previous launch wrote; a run rewound to 0 starts again from the base.
    Keys whose change a run absorbs (data.seq_len, trainer_nproc: batches of the old shape are rejected by the
    trainer and generated again; rollouts_per_example, lora.alpha, lr...) are left free."""
    import tomllib

    from gyre.runstate import run_started, trainer_checkpoints

    out = Path(cfg.output_dir)
    fresh_start = "use --fresh (starts the run over) or another --output-dir"

    def read(name: str) -> dict[str, Any] | None:
        try:
            return tomllib.loads((out / "configs" / name).read_text())
        except (OSError, tomllib.TOMLDecodeError):
            return None

    if cfg.fresh or (previous := read("trainer.toml")) is None:
        return
    runs = experiment_runs(cfg)
    # started: a step trained, or a batch pushed (its samples, of the old model and environment, wait in the stream)
    started = {run.name: max(committed_step(run.output_dir), *trainer_checkpoints(run.output_dir), 0)
               for run in runs if run_started(run.output_dir)}  # fmt: skip
    if not started:
        return

    def at(name: str) -> str:
        step = f"at step {started[name]}" if started[name] else "batches pushed, no step trained yet"
        return f"{out} (run {name!r} {step})" if cfg.runs else f"{out} ({step})"

    where = at(next(iter(started)))
    old_id = previous.get("run_id")
    if old_id is not None and old_id != cfg.run_id:  # a rewind keeps the run: its id stays too
        raise ConfigError(
            f"config key 'run_id': the run in {where} is {old_id!r}, this launch names it {cfg.run_id!r}; its "
            + ("" if cfg.runs else f"stream (gyre:{old_id}:batches), ")
            + f"W&B runs and metrics are the first's: {fresh_start} (or keep run_id = {old_id!r})"
        )
    rewound_to_base = {run.name for run in runs
                       if (run.trainer.get("resume_step", cfg.ckpt.resume_step)) == 0}  # fmt: skip
    started = {name: step for name, step in started.items() if name not in rewound_to_base}
    if not started:
        return
    for index, run in enumerate(runs):
        if run.name not in started or (recorded := read(_orchestrator_file(cfg, run.name))) is None:
            continue
        own = bool(cfg.runs) and "env" in run.orchestrator
        key = f"runs.{index}.orchestrator.env" if own else "orchestrator.env"
        if "env" not in recorded:
            continue
        now = configs.orchestrators[run.name].model_dump(mode="json").get("env")
        if changed := env_changes(recorded["env"], now):
            leaf, was, new = changed[0]
            raise ConfigError(
                f"config key '{key}{leaf}': the run in {at(run.name)} was trained with {key}{leaf} = {was!r}, this "
                f"launch sets {new!r}; its checkpoints, task position and stream batches belong to the first "
                f"environment: {fresh_start}"
            )
        # the task sampler's seed: task i (a dataset's epoch order) is a function of (seed, i), and the saved task
        # position is an index into that sequence: a new seed went on at the same index of another sequence (an epoch's
        # rows seen twice or never, a mix's draws shifted), unlike sampling.seed (only the rollouts to come)
        own = bool(cfg.runs) and "seed" in run.orchestrator
        key = f"runs.{index}.orchestrator.seed" if own else "orchestrator.seed"
        was, new = recorded.get("seed"), configs.orchestrators[run.name].seed
        if was is not None and was != new:
            raise ConfigError(
                f"config key '{key}': the run in {at(run.name)} was trained with {key} = {was!r}, this launch sets "
                f"{new!r}; its task position is an index into the tasks of the first seed (a new one repeats or "
                f"skips tasks): {fresh_start}"
            )
    trained = {name: step for name, step in started.items() if step > 0}
    where = at(next(iter(started)))
    old_model, new_model = (previous.get("model") or {}).get("name"), configs.trainer.model.name
    old_model = moved_with(old_model, previous.get("output_dir"), cfg.output_dir)  # a moved folder is the same run
    if not same_model(old_model, new_model):
        sft_dir = str(out / "sft")
        key = "sft.enabled" if (old_model == sft_dir) != (new_model == sft_dir) else "model.name"
        raise ConfigError(
            f"config key '{key}': the run in {where} was trained from {old_model}, this launch would load {new_model}; "
            f"its checkpoints and weights belong to the first: {fresh_start}"
        )
    if cfg.sft.enabled and (out / "sft" / "config.json").exists() and (sft := read("sft.toml")) is not None:
        old_base, new_base = (sft.get("model") or {}).get("name"), cfg.model.name or str(out / "model")
        old_base = moved_with(old_base, sft.get("output_dir"), cfg.output_dir)
        if not same_model(old_base, new_base):
            raise ConfigError(
                f"config key 'model.name': the SFT warm-up in {out / 'sft'} (which the run in {where} continues) was "
                f"trained from {old_base}, not {new_base}: {fresh_start}"
            )
    if not trained:  # batches pushed, no step trained: no checkpoint or weights of the adapter's shape yet
        return
    new = configs.trainer.model_dump(mode="json")
    old_runs = {entry.get("name"): entry for entry in previous.get("runs") or []}
    new_runs = {entry["name"]: entry for entry in new.get("runs") or []}
    for index, run in enumerate(runs):
        if run.name not in trained:
            continue
        if cfg.runs:
            if run.name not in old_runs:
                continue  # a run new to this experiment
            old = _adapter_shape(old_runs[run.name].get("lora") or previous.get("lora"))
            now = _adapter_shape(new_runs[run.name].get("lora") or new.get("lora"))
            key = f"runs.{index}.trainer.lora" if "lora" in run.trainer else "trainer.lora"
            where = f"{out} (run {run.name!r} at step {trained[run.name]})"
        else:
            old, now, key = _adapter_shape(previous.get("lora")), _adapter_shape(new.get("lora")), "trainer.lora"
        if old == now:
            continue
        if old is None or now is None:
            what = f"the run in {where} was trained {'without' if old is None else 'with'} LoRA; this launch turns it "
            what += "on" if old is None else "off"
        else:
            field = next(k for k in ("rank", "target_modules") if old[k] != now[k])
            key = f"{key}.{field}"
            what = f"the run in {where} trained an adapter of {field} {old[field]}, not {now[field]}"
        raise ConfigError(f"config key '{key}': {what}; its checkpoints and weights cannot be resumed so: "
                          f"{fresh_start}")  # fmt: skip


def _orchestrator_file(cfg: RLConfig, run_name: str) -> str:
    """The file under configs/ the launcher writes a run's orchestrator config to."""
    return f"orchestrator-{run_name}.toml" if cfg.runs else "orchestrator.toml"


def committed_steps(cfg: RLConfig) -> dict[str, int]:
    """Every run's committed step (`gyre.runstate.committed_step`), by name."""
    return {run.name: committed_step(run.output_dir) for run in experiment_runs(cfg)}


def summarize(cfg: RLConfig, wall_seconds: float | None = None) -> str:
    """The end-of-run summary of every run (`gyre.local.report.summarize`)."""
    from gyre.local.report import summarize as summarize_run

    runs = experiment_runs(cfg)
    if not cfg.runs:
        return summarize_run(runs[0].output_dir, wall_seconds)
    return "\n".join(f"run {run.name}:\n{summarize_run(run.output_dir, wall_seconds)}" for run in runs)
