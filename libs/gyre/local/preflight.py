"""What `gyre rl` checks before it creates anything (`validate`): every section's config, the model source, the
extension names, the settings against the model's config, and what a re-run may not change; on an external Redis,
that the run ids are this folder's (`claim_run_ids`). Each refusal is a ConfigError naming the key: a mistake found
after Redis and the services had started cost the user minutes, and some once corrupted a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.config import ConfigError, load_config, to_toml
from gyre.config.loader import expand_shorthands
from gyre.config.mistakes import under_section
from gyre.config.rerun import SFT_RECORD, dotted_keys, sft_changes, sft_refusal
from gyre.config.rl import RLConfig
from gyre.config.trainer import SFTConfig
from gyre.local.model_checks import check_against_the_model
from gyre.local.output_folder import check_fresh, inside
from gyre.local.runs import experiment_runs, refuse_changed_run_keys, resolve_configs, validate_extensions
from gyre.runstate import SFT_CHECKPOINTS, sft_checkpoints, sft_resume_problem

# What the launcher created the base model with (`model.init_preset`, `model.init_seed`), beside the services' configs.
MODEL_INIT_RECORD = "configs/model-init.toml"


def model_name(cfg: RLConfig) -> str:
    """What the services load: the SFT result, else the base model (`{output_dir}/model` by default)."""
    if cfg.sft.enabled:
        return str(cfg.output_dir / "sft")
    return cfg.model.name or str(cfg.output_dir / "model")


def check_model(name: str, **how: str) -> None:
    """ModelUnavailable unless `name` is a model folder with its weights (one holding config.json alone passed
    here, and its inference replica failed only after Redis and the services had started) or a hub id that can
    be fetched now."""
    from gyre.model_source import check_model_source

    check_model_source(name, hub=False, **how)  # a folder's weights
    check_model_source(name, **how)  # a folder's config.json (a file is none), a hub id's fetch


def sft_args(cfg: RLConfig) -> dict:
    """sft.args with `model = "x"` as {name = "x"}: the string replaced the model table the launcher gives the
    warm-up, and model.dtype was lost (the SFT ran at dtype auto), silently."""
    return expand_shorthands(SFTConfig, cfg.sft.args)


def validate(cfg: RLConfig) -> None:
    """Every config, the model source and extension names; raises ConfigError, creates nothing."""
    from gyre.config.loader import deep_merge
    from gyre.model_source import ModelUnavailable
    from gyre.wandb_log import WandbUnavailable, check_wandb

    out = cfg.output_dir
    base = cfg.model.name or str(out / "model")
    if cfg.model.init_preset is not None:
        from gyre.model_init import PRESETS

        if cfg.model.init_preset not in PRESETS:
            raise ConfigError(
                f"config key 'model.init_preset': unknown preset {cfg.model.init_preset!r} "
                f"(use one of {', '.join(PRESETS)})"
            )
        name = cfg.model.name
        if name is not None and not Path(name).exists() and not inside(Path(name), out):
            raise ConfigError(
                f"config key 'model.init_preset': a random model is only created in a folder the run owns; "
                f"model.name = {name!r} does not exist and is outside output_dir {out}: set model.name "
                "to an existing model (or hub id) without init_preset, or unset model.name"
            )
    if cfg.sft.enabled:
        sft_values = {
            "run_id": cfg.run_id,
            "output_dir": str(out),
            "model": {"name": base, "dtype": cfg.model.dtype},
            "save_dir": str(out / "sft"),
        }
        try:
            sft = load_config(SFTConfig, [], **deep_merge(sft_values, sft_args(cfg)))
        except ConfigError as e:
            raise under_section(e, "sft.args") from None
        if sft.data.env and not (out / "sft" / "config.json").exists():  # a typo there: now, not after Redis
            from gyre.envs import load_environment

            try:
                load_environment(sft.data.env, **sft.data.env_args)
            except Exception as e:  # EnvironmentLoadError, or the environment's own argument checks
                raise ConfigError(f"config key 'sft.args.data.env': {e}") from None
    refuse_ignored_settings(cfg, sft if cfg.sft.enabled else None)
    # the warm-up's own refusal came after Redis had started (the run failed: "sft failed with status 2")
    reused = (out / "sft" / "config.json").exists() and not cfg.fresh
    if cfg.sft.enabled and not reused:
        have = [] if cfg.fresh else sft_checkpoints(out)
        if problem := sft_resume_problem(sft.ckpt.resume_step, have, sft.max_steps, out / SFT_CHECKPOINTS):
            raise ConfigError(f"config key 'sft.args.{problem[0]}': {problem[1]}")
    configs = resolve_configs(cfg, model_name(cfg), "redis://127.0.0.1:6379/0")
    validate_extensions(configs, cfg)
    refuse_changed_run_keys(cfg, configs)  # the trainer failed on them only after every service had started
    # the model source last of the keys: a hub id is fetched (offline: half a minute of the hub client's retries,
    # before a misspelt section key, found in a second, was said)
    if cfg.model.init_preset is None and not (cfg.sft.enabled and (out / "sft" / "config.json").exists()):
        try:
            check_model(base)
        except ModelUnavailable as e:
            raise ConfigError(str(e)) from None
    for server in cfg.servers:
        try:
            # the server's own key, and no advice to set model.init_preset (the policy's alone)
            hint = "create one with `gyre model init --output-dir DIR` (or `gyre model import`) and use DIR"
            check_model(server.model, key=f"servers.{server.name}.model", hint=hint)
        except ModelUnavailable as e:
            raise ConfigError(str(e)) from None
    check_against_the_model(cfg, configs, base, sft if cfg.sft.enabled else None)
    check_resume_step(cfg)
    try:  # the trainer crashed with wandb's traceback once every service had started
        check_wandb(cfg.wandb)
    except WandbUnavailable as e:
        raise ConfigError(f"config key 'wandb.enabled': {e}") from None
    if cfg.redis.url:
        check_redis(cfg.redis.url)
        check_streams_are_ours(cfg, cfg.redis.url)
    if cfg.fresh:
        check_fresh(out)  # again under the lock, in start_fresh; here before locks/ is created


def refuse_ignored_settings(cfg: RLConfig, sft: SFTConfig | None) -> None:
    """ConfigError naming the key when a re-run asks for a base model or SFT warm-up unlike the one the folder
    holds: neither is made again once it exists, so `--model.init-preset` / `--model.init-seed` or a changed
    `[sft.args]` were silently ignored and the run went on from the old one. A warm-up stopped half way (Ctrl-C)
    is resumed from its checkpoint, so the same holds for it but for how far it goes (`max_steps`, `epochs`): a
    changed base model or `[sft.args]` key was silently mixed into it (steps from one, steps from the other,
    recorded as the second), unless `sft.args.ckpt.resume_step = 0` trains it again from the base."""
    import tomllib

    if cfg.fresh:
        return  # nothing of the old run is kept
    out = cfg.output_dir

    def read(name: str) -> dict[str, Any] | None:
        try:
            return tomllib.loads((out / name).read_text())
        except (OSError, tomllib.TOMLDecodeError):
            return None

    again = "it is not made again in a run: use --fresh (starts the run over) or another --output-dir"
    base = Path(cfg.model.name or out / "model")
    made = read(MODEL_INIT_RECORD) if cfg.model.init_preset is not None and base.exists() else None
    if made is not None and Path(made.get("output_dir", "")).resolve() == base.resolve():
        for key, now in (("init_preset", cfg.model.init_preset), ("init_seed", cfg.model.init_seed)):
            if made.get(key) != now:
                raise ConfigError(f"config key 'model.{key}': the base model {base} was created with "
                                  f"{key} = {made.get(key)!r}, not {now!r}; {again}")  # fmt: skip
    if sft is None:
        return
    finished = (out / "sft" / "config.json").exists()
    in_progress = not finished and sft.ckpt.resume_step != 0 and bool(sft_checkpoints(out))
    old = read(SFT_RECORD) if finished or in_progress else None
    if old is None:
        return
    new = tomllib.loads(to_toml(sft))
    what = f"the SFT warm-up in {out / 'sft'}"
    if in_progress:
        what = f"the SFT warm-up stopped half way (resumed from its checkpoint in {out / SFT_CHECKPOINTS})"
        again = ("it is resumed, not started again: use --sft.args.ckpt.resume-step 0 (the warm-up again from the "
                 "base model), --fresh (starts the run over) or another --output-dir")  # fmt: skip
    # a key one side lacks is compared only when this launch sets it: a key added to gyre sft since (with its
    # default) is no change the user made
    changes = sft_changes(old, new, dotted_keys(cfg.sft.args), in_progress)
    if changes:
        raise ConfigError(sft_refusal(changes, what, again, "sft.args."))


def check_redis(url: str) -> None:
    """An external Redis that cannot be reached fails here: the services would start and retry forever
    (what they must do in a cluster, where Redis may come up after them)."""
    from urllib.parse import urlsplit

    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    except (redis.RedisError, OSError) as e:
        where = urlsplit(url).netloc.rpartition("@")[2] or url  # no password in the message
        raise ConfigError(f"config key 'redis.url': cannot reach Redis at {where} ({e})") from None
    finally:
        client.close()


def check_streams_are_ours(cfg: RLConfig, url: str) -> None:
    """An external Redis may hold another experiment's batches under this run id (two experiments with the
    default run_id, or this folder deleted by hand): the orchestrator would count them as pushed and the
    trainer wait forever for batches its consumer group had read long ago. A run folder that never pushed
    a batch (no orchestrator step record, written before each push) owns no batch in the stream."""
    from gyre.events import ORCHESTRATOR_STEPS, events_dir
    from gyre.streams import BatchStream

    claim_run_ids(cfg, url, check_only=True)
    if cfg.fresh:
        return  # it deletes the stream's batches
    for run in experiment_runs(cfg):
        if (events_dir(run.output_dir) / ORCHESTRATOR_STEPS).exists():
            continue
        stream = BatchStream(url, run.name)
        try:
            count, newest = stream.length(), stream.latest_step()
        finally:
            stream.redis.close()
        if count:
            raise ConfigError(
                f"config key 'redis.url': its stream {stream.key} holds {count} batches (up to step {newest}) "
                f"that {run.output_dir} never pushed: another experiment uses run id {run.name!r} on this Redis. "
                "Choose another run_id; if that experiment is gone, --fresh deletes its batches"
            )


def claim_run_ids(cfg: RLConfig, url: str, check_only: bool = False) -> None:
    """Record on an external Redis which run folder each run id of this experiment belongs to (`gyre:{run
    id}:owner`, host and folder), or with `check_only` just check it. Two experiments started side by side with
    one run_id (the default, a copied file) both found the stream empty and both pushed into it: each trainer
    trained the other's batches. ConfigError naming run_id when another folder holds one; `--fresh` takes it
    over (and deletes its batches, as it says)."""
    import socket

    import redis

    from gyre.streams import RunIdTaken, claim_run_id

    me = f"{socket.gethostname()}:{cfg.output_dir.resolve()}"
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5, decode_responses=True)
    try:
        for index, run in enumerate(experiment_runs(cfg)):
            if cfg.fresh and check_only:
                continue  # --fresh takes the id over at the launch
            try:
                claim_run_id(client, run.name, me, check_only=check_only, take_over=cfg.fresh)
            except RunIdTaken as e:
                name = f"runs.{index}.name" if cfg.runs else "run_id"
                raise ConfigError(
                    f"config key '{name}': {name} {run.name!r} on the Redis of redis.url belongs to the run in "
                    f"{e.holder} (its stream gyre:{run.name}:batches): two experiments would train each other's "
                    f"batches. Choose another {name}; if that run is gone, --fresh takes the id over (deleting "
                    "its batches)"
                ) from None
    finally:
        client.close()


def check_resume_step(cfg: RLConfig) -> None:
    """A rewind to a checkpoint that does not exist fails here, before the launch deletes the stream's
    newer batches and the orchestrator its newer progress for it (the trainer would fail only then)."""
    from gyre.runstate import orchestrator_progress, trainer_checkpoints

    for index, run in enumerate(experiment_runs(cfg)):
        # a [[runs]] entry's own rewind too: it failed in the trainer, after every service had started
        own = "resume_step" in run.trainer
        step = run.trainer["resume_step"] if own else cfg.ckpt.resume_step
        key = f"runs.{index}.trainer.resume_step" if own else "ckpt.resume_step"
        if step is None or step == 0:
            continue
        have = [] if cfg.fresh else trainer_checkpoints(run.output_dir)
        where = f"{run.output_dir}" + (" after --fresh" if cfg.fresh else "")
        if step == -1 and not have:
            raise ConfigError(f"config key '{key}': -1 needs a trainer checkpoint, {where} has none")
        if step > 0 and step not in have:
            raise ConfigError(
                f"config key '{key}': no trainer checkpoint of step {step} in {where} "
                f"(have {have or 'none'}; 0 rewinds to the base model)"
            )
        progress = orchestrator_progress(run.output_dir) or []
        if step > 0 and step not in progress:  # the orchestrator rewinds its task position from it
            raise ConfigError(
                f"config key '{key}': no orchestrator progress checkpoint of step {step} in {where} "
                f"(have {progress or 'none'}; trainer checkpoints {have})"
            )
