"""Run lifecycle (issue 17): locks, Redis dying with its parent, config checked before anything starts,
hub ids, the derived batch split, TOML writing, run segments and the report's eval line.

Each `test_defect_N_*` reproduces defect N of the issue and failed on the code before the fix.
Everything here is real: real redis-server processes, real `gyre rl` / `gyre orchestrator` processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
from gyre.config import load_config, to_toml
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.rl import RLConfig
from gyre.config.trainer import TrainerConfig
from gyre.events import EventLog, read_events
from gyre.local.runs import resolve_configs
from support.locks import hold_run_lock

# New modules are imported inside the tests, so that on the old code each test fails on its own
# defect rather than the whole file failing to import.

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "configs/ci.toml"


def gyre(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gyre.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


# ---- 3: one launch per output folder ------------------------------------------------------------


def test_lock_names_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    from gyre.runlock import LockHeld, RunLock

    holder = hold_run_lock(tmp_path, "trainer")
    try:
        with pytest.raises(LockHeld, match=f"pid {holder.pid}"):
            RunLock(tmp_path, "trainer").acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path, "trainer").acquire()  # the holder died without releasing: stale
    assert lock.took_over == holder.pid
    lock.release()
    again = RunLock(tmp_path, "trainer").acquire()
    assert again.took_over is None  # released cleanly this time
    again.release()


def test_defect_3_second_gyre_rl_on_one_folder_fails_at_once_naming_the_pid(tmp_path):
    out = tmp_path / "run"
    holder = hold_run_lock(out, "rl")
    try:
        started = time.monotonic()
        res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out))
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"pid {holder.pid}" in res.stderr and "another gyre rl is using this output folder" in res.stderr
        assert time.monotonic() - started < 30
        assert not (out / "redis").exists() and not (out / "model").exists()
    finally:
        holder.kill()
        holder.wait()


def test_standalone_orchestrator_refuses_a_held_role(tmp_path):
    holder = hold_run_lock(tmp_path, "orchestrator")
    try:
        res = gyre("orchestrator", "--output-dir", str(tmp_path), "--redis.url", "redis://127.0.0.1:1/0")
        assert res.returncode == 2
        assert f"pid {holder.pid}" in res.stderr
    finally:
        holder.kill()
        holder.wait()


# ---- 5: redis-server dies with its parent; scratch folders go ------------------------------------


def test_defect_5_redis_dies_with_a_sigkilled_parent_and_its_scratch_folder_goes(tmp_path):
    code = textwrap.dedent(
        """
        from gyre.redis_server import EmbeddedRedis
        r = EmbeddedRedis().start()
        print(r.proc.pid, r._workdir, flush=True)
        input()
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid_text, workdir = parent.stdout.readline().split()
    redis_pid = int(pid_text)
    assert alive(redis_pid) and Path(workdir).is_dir()
    parent.kill()  # no atexit, no finally: only the kernel can clean up now
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(redis_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(redis_pid), "redis-server outlived its SIGKILLed parent"
    from gyre.redis_server import EmbeddedRedis

    with EmbeddedRedis():  # the next start on this machine sweeps the dead owner's scratch folder
        assert not Path(workdir).exists()


def test_persistent_redis_keeps_the_stream_across_a_sigkill(tmp_path):
    from gyre.redis_server import EmbeddedRedis
    from gyre.streams import BatchStream

    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    stream = BatchStream(server.url, "keep")
    stream.push(1, b"one")
    stream.push(2, b"two")
    stream.redis.close()
    os.kill(server.proc.pid, signal.SIGKILL)  # no shutdown save: only the append-only file remains
    server.proc.wait()
    server.stop()
    with EmbeddedRedis(data_dir=tmp_path / "redis") as again:
        assert BatchStream(again.url, "keep").steps_after(0) == [2, 1]


# ---- 6: hub ids and missing folders --------------------------------------------------------------


def test_defect_6_hub_id_that_cannot_be_fetched_is_a_clear_error_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    res = gyre(
        "rl",
        "@",
        str(CI_CONFIG),
        "--output-dir",
        str(out),
        "--model.name",
        "Qwen/Qwen3-0.6B",
        "--model.init-preset",
        "none",
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Qwen/Qwen3-0.6B" in res.stderr and "hub" in res.stderr and "gyre model init" in res.stderr
    assert not out.exists() and not (ROOT / "Qwen").exists()  # no random model created in its place


def test_sft_on_a_hub_id_that_cannot_be_fetched_is_a_clear_error_before_anything_starts(tmp_path):
    # `gyre rl` said so at once; `gyre sft` took its lock, prepared its data and died in the hub client's traceback
    out = tmp_path / "run"
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    res = gyre("sft", "--model.name", "Qwen/Qwen3-0.6B", "--data.fake", "--output-dir", str(out), env=env, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    said = "gyre sft: error: model.name = 'Qwen/Qwen3-0.6B' is not a local folder, and as a Hugging Face hub id it "
    assert said + "cannot be fetched" in res.stderr
    assert "Traceback" not in res.stderr and not out.exists()


def test_defect_6_missing_local_folder_and_no_implicit_random_model(tmp_path):
    out = tmp_path / "run"
    res = gyre("rl", "--output-dir", str(out), "--model.name", str(tmp_path / "nope" / "model"))
    assert res.returncode == 2
    assert "does not exist" in res.stderr and "init_preset" in res.stderr
    assert not out.exists()
    assert RLConfig().model.init_preset is None  # a random model only when asked for


def test_a_model_folder_without_weights_is_refused_before_anything_starts(tmp_path, tiny_model):
    # a folder holding config.json alone passed the launcher's check: Redis and the services started, and the run
    # failed only when the inference replica loaded it (the policy's folder, or a [[servers]] entry's)
    import shutil

    from gyre.config import ConfigError
    from gyre.local.launcher import Launcher

    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", half / "config.json")
    out = tmp_path / "run"
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--model.name", str(half),
               "--model.init-preset", "null")  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"model.name = '{half}': the model folder {half} holds no weights" in res.stderr, res.stderr[-2000:]
    assert not out.exists()
    server = ["--servers", f'[{{"name": "judge", "model": "{half}"}}]', "--model.name", str(tiny_model)]
    with pytest.raises(ConfigError, match="servers.judge.model = .* holds no weights"):
        Launcher(load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(out), *server])).validate()


def test_a_trainer_started_on_a_missing_model_folder_says_so_and_exits_2(tmp_path):
    # it once died with a FileNotFoundError traceback (after binding its ports)
    missing = tmp_path / "no" / "model"
    res = gyre("trainer", "--model.name", str(missing), "--output-dir", str(tmp_path / "run"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"gyre trainer: error: model.name = '{missing}'" in res.stderr and "gyre model init" in res.stderr
    assert "Traceback" not in res.stderr


def test_sft_on_a_missing_model_folder_says_so_and_exits_2(tmp_path):
    # it was the hub client's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'" traceback
    missing = tmp_path / "no" / "model"
    res = gyre("sft", "--model.name", str(missing), "--data.env", "reverse_text", "--output-dir", str(tmp_path))
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"gyre sft: error: model.name = '{missing}'" in res.stderr and "Traceback" not in res.stderr


def test_eval_with_nothing_serving_is_one_error_line(tmp_path):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    res = gyre("eval", "--env.name", "reverse_text", "--inference.urls", f'["{url}"]', "--inference.retries", "0",
               "--inference.startup-timeout-s", "1", "--eval.num-examples", "1",
               "--output-dir", str(tmp_path))  # fmt: skip
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"gyre eval: error: no replica answered /v1/models within 1s (last: {url}: " in res.stderr
    assert "Traceback" not in res.stderr


# ---- 7: the batch split follows the trainer -------------------------------------------------------


def test_defect_7_dp_world_size_and_seq_len_are_derived_from_the_trainer(tmp_path):
    cfg = load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(tmp_path), "--trainer-nproc", "2"])
    resolved = resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
    assert resolved.orchestrator.batch.dp_world_size == 2
    only_trainer = load_config(RLConfig, ["--output-dir", str(tmp_path), "--trainer.data.seq-len", "300"])
    resolved = resolve_configs(only_trainer, "m", "redis://127.0.0.1:1/0")
    assert resolved.orchestrator.batch.seq_len == resolved.trainer.data.seq_len == 300


def test_requests_in_flight_fill_every_replicas_batch_unless_the_user_says(tmp_path):
    # A 256-row engine behind the orchestrator's default of 64 requests in flight decoded a quarter-full batch
    # (the one-GPU loop, configs/gpu/one-gpu-torch.toml): gyre rl derives the concurrency from the replicas.
    args = ["--output-dir", str(tmp_path), "--inference.engine.max-batch-size", "96", "--inference-replicas", "2"]
    resolved = resolve_configs(load_config(RLConfig, args), "m", "redis://127.0.0.1:1/0")
    assert resolved.orchestrator.inference.max_concurrency == 192
    chosen = load_config(RLConfig, [*args, "--orchestrator.inference.max-concurrency", "40"])
    assert resolve_configs(chosen, "m", "redis://127.0.0.1:1/0").orchestrator.inference.max_concurrency == 40


def test_setting_a_checkpoint_or_sft_key_turns_the_section_on_unless_it_is_turned_off(tmp_path, monkeypatch):
    # `gyre rl --ckpt.interval 5` (PRIME-RL's way to checkpoint) and an [sft.args] table without `enabled = true`
    # were silently ignored: no checkpoint, no warm-up
    def resolved(*args: str):
        return resolve_configs(load_config(RLConfig, ["--output-dir", str(tmp_path), *args]), "m", "redis://x:1/0")

    assert resolved().trainer.ckpt.interval is None
    on = resolved("--ckpt.interval", "5")
    assert on.trainer.ckpt.interval == 5 and on.orchestrator.ckpt_interval == 5
    assert resolved("--ckpt.keep-last", "4").trainer.ckpt.keep_last == 4
    assert resolved("--ckpt.enabled", "false", "--ckpt.interval", "5").trainer.ckpt.interval is None
    assert resolved("--ckpt.resume-step", "0").trainer.ckpt.interval is None  # a rewind alone writes none
    monkeypatch.setenv("GYRE_CKPT__INTERVAL", "3")
    assert resolved().trainer.ckpt.interval == 3
    sft = tmp_path / "sft.toml"
    sft.write_text("[sft.args]\nmax_steps = 3\n")
    assert load_config(RLConfig, ["@", str(sft)]).sft.enabled
    assert not load_config(RLConfig, ["@", str(sft), "--sft.enabled", "false"]).sft.enabled
    # a bare --sft, as a bare --ckpt: "Input should be a valid dictionary or instance of SFTWarmupConfig (got 'true')"
    assert (
        load_config(RLConfig, ["--sft"]).sft.enabled
        and load_config(RLConfig, ["--sft", "--max-steps", "2"]).sft.enabled
    )
    assert load_config(RLConfig, ["@", str(sft), "--sft"]).sft.args == {"max_steps": 3}
    ckpt = tmp_path / "ckpt.toml"  # a file's section and a bare flag: the flag replaced the table
    ckpt.write_text("[ckpt]\nenabled = false\ninterval = 5\n")
    assert load_config(RLConfig, ["@", str(ckpt), "--ckpt"]).ckpt.model_dump(include={"enabled", "interval"}) == {
        "enabled": True, "interval": 5}  # fmt: skip


def test_contradicting_batch_split_is_refused(tmp_path):
    from gyre.config import ConfigError

    cfg = load_config(
        RLConfig, ["--trainer-nproc", "2", "--orchestrator.batch.dp-world-size", "1", "--output-dir", str(tmp_path)]
    )
    with pytest.raises(ConfigError, match="dp_world_size"):
        resolve_configs(cfg, "m", "redis://127.0.0.1:1/0")
    cfg = load_config(
        RLConfig,
        ["--trainer.data.seq-len", "256", "--orchestrator.batch.seq-len", "512", "--output-dir", str(tmp_path)],
    )
    with pytest.raises(ConfigError, match="seq_len"):
        resolve_configs(cfg, "m", "redis://127.0.0.1:1/0")


# ---- 8: everything validated first; TOML by a library; ports named ------------------------------


def test_defect_8_unknown_loss_fails_before_any_folder_or_server_exists(tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--trainer.loss.type", "nope", timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "trainer.loss.type" in res.stderr and "nope" in res.stderr
    assert not out.exists()
    assert time.monotonic() - started < 60


def test_an_sft_warmup_environment_typo_fails_before_anything(tmp_path):
    # the launcher checked the orchestrator's environment only: a typo in the warm-up's started Redis and the base
    # model, then the SFT child failed
    out = tmp_path / "run"
    args = '{"data": {"env": "reverse_text", "env_args": {"num_exampels": 5}}}'
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--sft.args", args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "config key 'sft.args.data.env': environment 'reverse_text': bad arguments" in res.stderr
    assert not out.exists()


def test_unknown_environment_fails_before_anything(tmp_path):
    out = tmp_path / "run"
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--orchestrator.env.name", "nope")
    assert res.returncode == 2 and "orchestrator.env" in res.stderr and "nope" in res.stderr
    assert not out.exists()


def test_an_output_dir_that_cannot_be_a_folder_is_a_clear_error_not_a_traceback(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(not_a_folder / "run"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "config key 'output_dir'" in res.stderr and "Not a directory" in res.stderr
    assert "Traceback" not in res.stderr


def test_gyre_rl_environment_variables_reach_the_services_without_being_misread_by_them(tmp_path):
    # GYRE_INFERENCE__... was once also read by the orchestrator as its own `inference` (replica urls) table,
    # GYRE_ORCHESTRATOR__... by the trainer as its `orchestrator` (notify address), GYRE_CKPT__ENABLED by the
    # trainer's ckpt: `gyre rl` refused documented environment variables with a wrong key
    out = tmp_path / "run"
    env = {"GYRE_INFERENCE__ENGINE__SEED": "7", "GYRE_ORCHESTRATOR__SEED": "5", "GYRE_CKPT__ENABLED": "true"}
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--max-steps", "1", env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    configs = {
        name: tomllib.loads((out / "configs" / f"{name}.toml").read_text()) for name in ("inference", "orchestrator")
    }
    assert configs["inference"]["engine"]["seed"] == 7 and configs["orchestrator"]["seed"] == 5
    assert (out / "checkpoints" / "trainer").is_dir()


@pytest.mark.parametrize(
    ("variable", "meant"),
    [("GYRE_MAX_STEPZ", "GYRE_MAX_STEPS"), ("GYRE_TRAINER_OPTIM__LR", "GYRE_TRAINER__OPTIM__LR"),
     ("GYRE_OUTPUTDIR", "GYRE_OUTPUT_DIR"), ("GYRE_ENGINE__SEED", None)],
)  # fmt: skip
def test_a_misspelt_gyre_rl_environment_variable_is_refused_naming_it(tmp_path, variable, meant):
    # pydantic-settings reads only the variables matching a key: these were silently ignored, and the run started
    # with the default (20 steps, a learning rate of 1e-6, outputs/run) instead of the value the user set
    out = tmp_path / "run"
    missing = str(tmp_path / "no-model")  # old code: this error (after ignoring the variable), and nothing starts
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--model.name", missing,
               "--model.init-preset", "null", env={variable: "1"})  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"set by the environment variable {variable}" in res.stderr, res.stderr[-2000:]
    assert (f"did you mean {meant}?" in res.stderr) if meant else ("did you mean" not in res.stderr)
    assert not out.exists()


@pytest.mark.parametrize(
    ("command", "variable", "key"),
    [(["rl", "@", str(CI_CONFIG)], "GYRE_TRAINER__OPTIM__LRR", "trainer.optim.lrr"),
     (["rl", "@", str(CI_CONFIG)], "GYRE_SFT__ARGS__MAX_STEPZ", "sft.args.max_stepz"),
     (["trainer"], "GYRE_OPTIM__LRR", "optim.lrr")],
)  # fmt: skip
def test_a_key_misspelt_below_a_section_by_an_environment_variable_names_the_variable(tmp_path, command, variable, key):
    # the section's "unknown key" error named the key alone: the user looked for it in their command line and files
    res = gyre(*command, "--output-dir", str(tmp_path / "run"), env={variable: "1"})
    assert res.returncode == 2 and f"error: config key '{key}': unknown key" in res.stderr, res.stderr[-2000:]
    assert f"(set by the environment variable {variable})" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_gyre_variables_that_are_no_config_key_are_left_alone():
    from gyre.config.mistakes import check_environment_keys

    others = {"GYRE_CACHE_DIR": "/c", "GYRE_API_KEY": "k", "GYRE_TRAINER_CRASH_AT": "x", "GYRE_RUN_SEGMENT": "s",
              "GYRE_INFERENCE__ENGINE__SEED": "7", "GYRE_MAX_STEPS": "3", "PATH": "/bin"}  # fmt: skip
    check_environment_keys(RLConfig, others)


def test_gyre_rl_log_file_is_every_services_log_file(tmp_path):
    # `gyre rl --log.file F` ("also append logs to this file") was accepted and ignored
    log = tmp_path / "all.log"
    cfg = load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(tmp_path), "--log.file", str(log)])
    resolved = resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
    for service in (resolved.trainer, resolved.orchestrator, *resolved.inference):
        assert service.log.file == log and service.log.level == "INFO"


@pytest.mark.parametrize("step", ["3", "-1"])
def test_a_rewind_to_a_checkpoint_that_does_not_exist_fails_before_anything_starts(tmp_path, step):
    # it once started every service, deleted the stream's batches after the step, and only then the
    # trainer failed with a traceback
    out = tmp_path / "run"
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--ckpt", "--ckpt.resume-step", step)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "config key 'ckpt.resume_step'" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


def test_the_orchestrator_keeps_a_progress_checkpoint_for_every_trainer_checkpoint_a_rewind_can_use(tmp_path):
    """`gyre rl --ckpt.keep-last 5` kept the trainer's last 5 checkpoints but the orchestrator's last 3 (its own
    default): `--ckpt.resume-step` to the oldest one then passed the launcher's check, the trainer rewound (deleting
    its newer checkpoints and weights) and the orchestrator failed for want of its progress checkpoint. It keeps
    keep_last + max_async_level + 1 (it checkpoints as it pushes, that far ahead of the trainer); a rewind to a step
    it has none of is refused before anything starts."""

    def keep(*args: str) -> int:
        cfg = load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(tmp_path), "--ckpt", *args])
        return resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0").orchestrator.ckpt_keep_last

    async_level = load_config(RLConfig, ["@", str(CI_CONFIG)]).orchestrator.get("max_async_level", 1)
    assert keep("--ckpt.keep-last", "5") == 5 + async_level + 1
    assert keep("--ckpt.keep-last", "5", "--orchestrator.max-async-level", "3") == 9
    assert keep("--ckpt.keep-last", "5", "--orchestrator.ckpt-keep-last", "4") == 4  # the user's value wins

    out = tmp_path / "run"
    for step in range(1, 6):  # what a run with the old retention left: trainer 1..5, orchestrator 3..5
        (out / "checkpoints" / "trainer" / f"step_{step}").mkdir(parents=True)
        (out / "checkpoints" / "trainer" / f"step_{step}" / "progress.json").write_text("{}")
    for step in (3, 4, 5):
        (out / "checkpoints" / "orchestrator").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints" / "orchestrator" / f"step_{step}.json").write_text("{}")
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--ckpt", "--ckpt.resume-step", "1")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "config key 'ckpt.resume_step': no orchestrator progress checkpoint of step 1" in res.stderr
    assert sorted(p.name for p in (out / "checkpoints" / "trainer").iterdir()) == [f"step_{s}" for s in range(1, 6)]


def test_an_external_redis_that_cannot_be_reached_fails_before_anything_starts(tmp_path):
    # every service once started and retried forever (every 30 s) under a progress bar stuck at 0
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    out = tmp_path / "run"
    res = gyre(
        "rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--redis.url", f"redis://u:s3cret@127.0.0.1:{port}/0"
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"config key 'redis.url': cannot reach Redis at 127.0.0.1:{port}" in res.stderr
    assert "s3cret" not in res.stderr and not out.exists()


def test_an_external_redis_holding_another_experiments_batches_under_the_run_id_is_refused(tmp_path):
    # two experiments with the default run_id on one Redis (or a run folder deleted by hand): the new launch's
    # orchestrator counted the other's batches as its own pushed steps and its trainer waited forever for them
    from gyre.redis_server import EmbeddedRedis
    from gyre.streams import BatchStream

    with EmbeddedRedis() as redis:
        stream = BatchStream(redis.url, "ci")
        stream.push(1, b"another experiment's batch")
        out = tmp_path / "run"
        res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--redis.url", redis.url)
        assert res.returncode == 2, res.stderr[-2000:]
        assert ("config key 'redis.url': its stream gyre:ci:batches holds 1 batches (up to step 1) that "
                f"{out} never pushed: another experiment uses run id 'ci'") in res.stderr  # fmt: skip
        assert not out.exists() and stream.length() == 1  # nothing created, nothing of theirs deleted
        stream.redis.close()


def test_defect_8_env_args_with_a_list_of_tables_round_trip_through_toml():
    args = {"levels": [{"name": "easy", "n": 1}, {"name": "hard", "n": 2, "tags": ["a", "b"]}], "q": 'say "hi"\n'}
    cfg = load_config(OrchestratorConfig, [], env={"name": "x.y:z", "args": args})
    text = to_toml(cfg)
    assert tomllib.loads(text)["env"]["args"] == args
    reloaded = load_config(OrchestratorConfig, [], **tomllib.loads(text))
    assert reloaded.env.args == args


def test_defect_8_port_in_use_names_the_option(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = gyre(
            "orchestrator",
            "--output-dir",
            str(tmp_path),
            "--redis.url",
            "redis://127.0.0.1:1/0",
            "--metrics.port",
            "0",
            "--server.port",
            str(port),
        )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--server.port" in res.stderr and str(port) in res.stderr
    assert "Traceback" not in res.stderr


def test_trainer_port_in_use_names_the_option(tmp_path, tiny_model):
    pytest.importorskip("torch")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = gyre(
            "trainer",
            "--output-dir",
            str(tmp_path),
            "--model.name",  # a real folder passes the start-up model check (offline, a hub id would stop it first)
            str(tiny_model),
            "--redis.url",
            "redis://127.0.0.1:1/0",
            "--metrics.port",
            str(port),
            "--server.port",
            "0",
            timeout=120,
        )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--metrics.port" in res.stderr and str(port) in res.stderr
    assert "Traceback" not in res.stderr


def test_builtin_loss_names_match_the_trainer_registry():
    pytest.importorskip("torch")
    from gyre.config.trainer import BUILTIN_LOSSES
    from gyre_trainer.loss import LOSSES

    assert set(BUILTIN_LOSSES) == set(LOSSES)
    assert load_config(TrainerConfig, [], loss={"type": "my.module:objective"}).loss.type == "my.module:objective"


# ---- 10: run segments and the report ------------------------------------------------------------


def test_resumed_curves_continue_and_eval_off_says_so(tmp_path):
    from gyre.events import latest_per_step
    from gyre.local.report import _per_wall_second, summarize, summary_numbers

    path = tmp_path / "events" / "orchestrator_steps.jsonl"
    with EventLog(path, segment="a") as first:
        for step in (1, 2, 3):
            first.append(
                {"step": step, "reward_mean": 0.1 * step, "num_tokens": 9, "step_seconds": 1.0, "time": 100.0 + step}
            )
    with EventLog(path, segment="b") as second:  # the re-run regenerated step 3 and went on, an hour later
        for step in (3, 4, 5):
            second.append(
                {"step": step, "reward_mean": 0.1 * step, "num_tokens": 9, "step_seconds": 1.0, "time": 3700.0 + step}
            )
    records = read_events(path)
    assert {r["segment"] for r in records} == {"a", "b"}
    latest = latest_per_step(records)
    assert [r["step"] for r in latest] == [1, 2, 3, 4, 5]
    assert latest[2]["segment"] == "b"
    steps, rates = _per_wall_second(latest, None)
    assert steps == sorted(steps) and len(steps) == len(set(steps))
    assert min(rates) > 0.5  # no window spans the hour between the two launches
    (tmp_path / "events" / "trainer_steps.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "num_tokens": 10, "step_seconds": 1.0, "time": 100.0 + s}) + "\n" for s in (1, 2)
        )
    )
    assert summary_numbers(tmp_path)["steps_trained"] == 2
    text = summarize(tmp_path)
    assert "eval off" in text and "nan -> nan" not in text
    # the summary names the versions evaluated: one eval read "0.250 -> 0.250", as if the final model was too
    evals = tmp_path / "events" / "eval.jsonl"
    evals.write_text(json.dumps({"step": 0, "avg_at_k": 0.25, "time": 100.0}) + "\n")
    assert "0.250 (version 0, the only eval)" in summarize(tmp_path)
    evals.write_text(
        "".join(json.dumps({"step": s, "avg_at_k": a, "time": 100.0 + s}) + "\n" for s, a in [(0, 0.25), (8, 0.85)])
    )
    assert "0.250 (version 0) -> 0.850 (version 8)" in summarize(tmp_path)


def test_the_progress_bar_ignores_an_earlier_launchs_records_past_where_this_one_starts(tmp_path):
    # `--ckpt.resume-step 3` of a run at step 5: the bar showed 5 steps done at once, with step 5's numbers, from the
    # records of the steps the rewind discarded
    from gyre.local.progress import RunProgress
    from gyre.local.runs import Run

    events = tmp_path / "events"
    with EventLog(events / "trainer_steps.jsonl", segment="old") as log:
        for step in range(1, 6):
            log.append({"step": step, "num_tokens": 10, "step_seconds": float(step), "time": 100.0 + step})
    with EventLog(events / "orchestrator_steps.jsonl", segment="old") as log:
        for step in range(1, 7):
            log.append({"step": step, "reward_mean": step / 10, "time": 100.0 + step})
    progress = RunProgress([Run("r", tmp_path, 8)], {"r": 3}, segment="new")
    try:
        progress.update()
        assert progress.bar.n == 3 and progress._post["step_s"] == "3.0" and progress._post["reward"] == "0.300"
        with EventLog(events / "trainer_steps.jsonl", segment="new") as log:
            log.append({"step": 4, "num_tokens": 10, "step_seconds": 0.5, "time": 900.0})
        progress.update()
        assert progress.bar.n == 4 and progress._post["step_s"] == "0.5"
    finally:
        progress.close()


def test_a_runs_own_rewind_is_where_its_progress_starts(tmp_path):
    from gyre.local.launcher import Launcher
    from gyre.local.runs import experiment_runs

    runs = '[{"name": "alpha", "trainer": {"resume_step": 3}}, {"name": "beta"}]'
    cfg = load_config(RLConfig, ["@", str(ROOT / "configs/multirun/two_runs.toml"), "--runs", runs])
    alpha, beta = experiment_runs(cfg)
    assert Launcher(cfg)._start_step(alpha, 9) == 3 and Launcher(cfg)._start_step(beta, 9) == 9


def test_gyre_report_out_into_a_new_folder_or_an_unknown_format(tmp_path):
    # --out reports/run1.png (a folder not made yet) and --out report.txt were tracebacks
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "trainer_steps.jsonl").write_text(json.dumps({"step": 1, "num_tokens": 5, "time": 1.0}))
    made = gyre("report", str(tmp_path), "--out", str(tmp_path / "reports" / "run1.png"))
    assert made.returncode == 0 and (tmp_path / "reports" / "run1.png").is_file(), made.stderr[-2000:]
    bad = gyre("report", str(tmp_path), "--out", str(tmp_path / "report.txt"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.startswith(f"gyre report: error: --out {tmp_path / 'report.txt'}: Format 'txt' is not supported")


def test_a_finished_runs_summary_shows_no_wall_time_of_its_own(tmp_path):
    # the launch that found the run finished printed "wall time 0.0 min" for a run of many minutes
    out = tmp_path / "run"
    (out / "checkpoints" / "trainer" / "step_3").mkdir(parents=True)
    (out / "checkpoints" / "trainer" / "step_3" / "progress.json").write_text("{}")
    done = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--max-steps", "3")
    assert done.returncode == 0 and "run already finished" in done.stdout, done.stderr[-2000:]
    assert "steps trained" in done.stdout and "wall time" not in done.stdout
    from gyre.local.report import summarize

    assert "wall time (this launch)" in summarize(out, wall_seconds=90.0)  # a launch that trained: its own time


def test_fresh_on_a_project_folder_refuses_before_writing_anything(tmp_path):
    # a project's own configs/ made `--fresh --output-dir .` a "gyre run" and delete README.md and src/
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.toml").write_text("x")
    (tmp_path / "README.md").write_text("mine")
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(tmp_path), "--fresh")
    assert res.returncode == 2 and "README.md" in res.stderr, res.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "configs"]  # not even locks/


def test_fresh_refuses_a_folder_that_is_not_a_gyre_run(tmp_path):
    from gyre.config import ConfigError
    from gyre.local.output_folder import start_fresh

    (tmp_path / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="thesis.tex"):
        start_fresh(tmp_path)
    assert (tmp_path / "thesis.tex").exists()
    (tmp_path / "configs").mkdir()  # a project's own configs/ (no run's file in it) is no gyre run
    (tmp_path / "configs" / "mine.toml").write_text("x")
    with pytest.raises(ConfigError, match="thesis.tex"):
        start_fresh(tmp_path)
    assert (tmp_path / "configs" / "mine.toml").exists()
    (tmp_path / "events").mkdir()  # a gyre run (with a file of the user's in it): emptied
    (tmp_path / "events" / "trainer_steps.jsonl").write_text("")
    start_fresh(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_fresh_says_it_deleted_a_run_only_when_there_was_one(tmp_path, monkeypatch):
    # `make demo` on a fresh machine said "--fresh: deleted the previous run" before its first run: the folder held
    # only the lock the launch had just taken
    from gyre.local import output_folder

    said = []
    monkeypatch.setattr(output_folder, "console", said.append)
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "rl.lock").write_text("")
    output_folder.start_fresh(tmp_path)
    assert said == [] and sorted(p.name for p in tmp_path.iterdir()) == ["locks"]
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "trainer_steps.jsonl").write_text("")
    output_folder.start_fresh(tmp_path)
    assert said == [f"--fresh: deleted the previous run in {tmp_path}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locks"]


def test_fresh_takes_what_a_launch_stopped_during_start_up_left_half_written(tmp_path):
    # Ctrl-C while `gyre model init` wrote the base model left `.tmp-model-*` beside locks/ and redis/, and
    # `--fresh` refused the folder: "holds files gyre did not write (.tmp-model-...)"
    from gyre.local.output_folder import check_fresh, start_fresh

    for name in (".tmp-model-x1/config.json", ".tmp-sft-y2/model.safetensors", "locks/rl.lock", "redis/a.aof"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    check_fresh(tmp_path)
    start_fresh(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locks"]


def test_an_interrupted_fresh_leaves_no_part_of_the_old_run_and_the_next_launch_finishes_it(tmp_path, monkeypatch):
    # --fresh deleted entry by entry: a Ctrl-C (or crash) half way left, say, checkpoints and rollouts without the
    # run's configs and events, which a plain re-run resumed from and a second --fresh refused ("holds files gyre did
    # not write (rollouts, samples.md)")
    import shutil

    from gyre.local.output_folder import check_fresh, remove_staging, start_fresh

    for name in ("configs/trainer.toml", "events/trainer_steps.jsonl", "weights/step_1/model.safetensors",
                 "checkpoints/trainer/step_1/progress.json", "rollouts/step_1.jsonl", "samples.md", "debug/step_1/x",
                 "locks/rl.lock"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("old run")
    cfg = load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(tmp_path), "--fresh"])

    def interrupted(path, *args, **kwargs):  # Ctrl-C while the old run's weights are being deleted
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", interrupted)
        with pytest.raises(KeyboardInterrupt):
            start_fresh(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left[0].startswith(".tmp-fresh-") and left[1:] == ["locks"]  # nothing of the old run to resume from
    remove_staging(cfg)  # what the interrupted launch's shutdown, or the next launch, does
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locks"]
    (tmp_path / "rollouts").mkdir()  # what the old code left in place: a run's entries, not the user's files
    (tmp_path / "samples.md").write_text("")
    check_fresh(tmp_path)


def test_a_ctrl_c_just_after_a_service_started_still_stops_it(tmp_path, monkeypatch, tiny_model):
    # the launcher listed a service child only after starting it: a Ctrl-C between the two left a running
    # inference (or trainer) that shutdown() never stopped, holding its ports until the launcher itself exited
    from gyre.events import SEGMENT_ENV
    from gyre.local import launcher as launcher_module

    monkeypatch.setenv(SEGMENT_ENV, "test")  # run() sets it for its services
    started = []
    real_start = launcher_module.InferenceProcess.start

    def start_then_ctrl_c(self, *args, **kwargs):
        started.append(real_start(self, *args, **kwargs))
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher_module.InferenceProcess, "start", start_then_ctrl_c)
    cfg = load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(tmp_path / "run"),
                                 "--model.name", str(tiny_model), "--model.init-preset", "null"])  # fmt: skip
    launcher = launcher_module.Launcher(cfg)
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run()
    finally:
        launcher.shutdown()
    try:
        assert len(started) == 1 and started[0].poll() is not None, "the started inference outlived shutdown()"
    finally:
        started[0].kill()


def test_a_stop_gives_the_trainer_its_stop_budget_not_15_seconds(tmp_path):
    # Child.stop's 15 s default SIGKILLed a trainer that was still writing its stop checkpoint (ckpt.on_stop): a larger
    # model lost every step since its last checkpoint. The trainer (and the SFT warm-up) now get trainer_stop_timeout_s.
    from gyre.local.launcher import Launcher
    from gyre.proc import Child

    slow_stop = textwrap.dedent("""
        import signal, sys, time
        def stop(*_):
            time.sleep(18)  # a checkpoint that takes longer than the old 15 s
            open(sys.argv[1], "w").write("saved")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(600)
    """)
    cfg = load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(tmp_path), "--trainer-stop-timeout-s", "60"])
    launcher = Launcher(cfg)
    ready = []
    trainer = Child("trainer", [sys.executable, "-c", slow_stop, str(tmp_path / "saved")], tmp_path / "trainer.log",
                    on_line=ready.append).start(quiet=True)  # fmt: skip
    launcher.children.append(trainer)
    try:
        deadline = time.monotonic() + 30
        while not ready and time.monotonic() < deadline:
            time.sleep(0.05)
        began = time.monotonic()
        launcher.shutdown()
        assert trainer.poll() == 0 and (tmp_path / "saved").read_text() == "saved"
        assert 17 < time.monotonic() - began < 50
    finally:
        trainer.kill()


def test_torchrun_gets_the_trainers_stop_budget_as_its_shutdown_timeout(tmp_path):
    # torchrun SIGKILLs its workers --shutdown-timeout (30 s by default) after forwarding SIGTERM: whatever the launcher
    # waited, a multi-process trainer's stop checkpoint had 30 s
    from gyre.local.launcher import Launcher

    argv = ["@", str(CI_CONFIG), "--output-dir", str(tmp_path), "--trainer-nproc", "2"]
    launcher = Launcher(load_config(RLConfig, [*argv, "--trainer-stop-timeout-s", "450.5"]))
    command = launcher.trainer_argv(tmp_path / "trainer.toml")
    assert command[command.index("gyre_trainer.torchrun") + 1 :].count("--shutdown-timeout=451") == 1
    assert "--shutdown-timeout=300" in Launcher(load_config(RLConfig, argv)).trainer_argv(tmp_path / "trainer.toml")


def test_an_sft_warm_up_that_exits_0_without_its_result_fails_the_launch(tmp_path, monkeypatch):
    # `gyre sft` stopped by a SIGTERM of its own checkpoints and exits 0: the launch went on to start the services on
    # a model folder that did not exist
    from gyre.local import launcher as launcher_module
    from gyre.local.supervision import RunFailed

    monkeypatch.setattr(launcher_module, "_gyre", lambda *args: [sys.executable, "-c", "print('stopped after step 3')"])
    cfg = load_config(RLConfig, ["@", str(CI_CONFIG), "--output-dir", str(tmp_path)],
                      sft={"enabled": True, "args": {"data": {"fake": True}}})  # fmt: skip
    launcher = launcher_module.Launcher(cfg)
    with pytest.raises(RunFailed, match=r"(?s)sft stopped before it finished .*stopped after step 3"):
        launcher._sft(str(tmp_path / "model"))


@pytest.mark.parametrize(
    ("command", "variable", "meant"),
    [("trainer", "GYRE_MAX_STEPZ", "GYRE_MAX_STEPS"), ("orchestrator", "GYRE_ENVS__NAME", "GYRE_ENV__NAME"),
     ("inference", "GYRE_SERVR__PORT", "GYRE_SERVER__PORT"), ("sft --data.fake", "GYRE_EPOCS", "GYRE_EPOCHS")],
)  # fmt: skip
def test_a_misspelt_environment_variable_of_a_service_run_on_its_own_is_refused_naming_it(
    tmp_path, command, variable, meant
):
    # only `gyre rl` checked its GYRE_ variables: a service run on its own (as the chart runs them, configured by GYRE_
    # variables) ignored a misspelt one and trained or served with the default
    out = tmp_path / "run"
    res = gyre(*command.split(), "--output-dir", str(out), env={variable: "3"})
    assert res.returncode == 2, res.stderr[-2000:]
    assert (
        f"gyre {command.split()[0]}: error: " in res.stderr
        and f"set by the environment variable {variable}" in res.stderr
    )
    assert (f"did you mean {meant}?" in res.stderr) if meant else ("did you mean" not in res.stderr), res.stderr
    assert not out.exists()


def test_the_charts_environment_variables_are_keys_of_the_pods_that_get_them():
    # what charts/gyre sets on each pod (docs/kubernetes.md, "Secrets are files"), and variables gyre reads itself:
    # none may stop a service now that services check their GYRE_ variables
    from gyre.config.inference import InferenceConfig
    from gyre.config.mistakes import check_environment_keys

    ambient = {"GYRE_CACHE_DIR": "/c", "GYRE_RUN_SEGMENT": "s", "GYRE_TRAINER_CRASH_AT": "x", "GYRE_API_KEY": "k"}
    pods = {
        TrainerConfig: ("GYRE_ORCHESTRATOR__CONTROL_TOKEN_FILE", "GYRE_REDIS__URL", "GYRE_REDIS__PASSWORD_FILE"),
        OrchestratorConfig: ("GYRE_INFERENCE__API_KEY_FILE", "GYRE_INFERENCE__CONTROL_TOKEN_FILE",
                             "GYRE_SERVER__CONTROL_TOKEN_FILE", "GYRE_REDIS__URL", "GYRE_REDIS__PASSWORD_FILE"),
        InferenceConfig: ("GYRE_AUTH__API_KEY_FILE", "GYRE_AUTH__CONTROL_TOKEN_FILE"),
    }  # fmt: skip
    for cls, names in pods.items():
        check_environment_keys(cls, {**ambient, **dict.fromkeys(names, "x")})


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line names `text` (a run's folder: its services' configs live there)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def test_inference_slower_than_inference_ready_timeout_s_names_the_key_and_where_the_logs_are(tmp_path):
    # the wait for each inference process to load its model was a fixed 300 s, and nothing was said meanwhile: a
    # large model under vLLM (minutes of loading, compiling, CUDA graphs) stopped every run with "not ready after
    # 300s", and a user saw a silent console with no hint of the logs to read
    out = tmp_path / "run"
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--max-steps", "1",
               "--inference-ready-timeout-s", "0.5", timeout=180)  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert f"logs: {out / 'logs'}/{{inference,trainer,orchestrator}}.log" in res.stdout
    assert f"waiting for inference to load {out / 'model'} (up to 0.5s: inference_ready_timeout_s)" in res.stdout
    assert "inference not ready after 0.5s (raise inference_ready_timeout_s" in res.stderr
    assert _processes_naming(str(out)) == []  # the replica and the trainer it started are stopped
    assert load_config(RLConfig, []).inference_ready_timeout_s == 600


def test_gyre_rl_says_where_the_policy_is_served_on_the_port_the_user_set(tmp_path):
    # the console never said where the policy answers (PRIME-RL users evaluate or curl it as it trains), and a port
    # set for it was replaced by a random one
    from gyre.net import free_port

    out, port = tmp_path / "run", free_port()
    res = gyre("rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--max-steps", "1", "--inference.server.port",
               str(port), timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"inference: http://127.0.0.1:{port}/v1 (OpenAI API; model '{out / 'model'}')" in res.stdout
    assert tomllib.loads((out / "configs/inference.toml").read_text())["server"]["port"] == port


def test_the_bar_counts_the_orchestrators_finished_rollouts_while_a_step_is_generated(tmp_path, monkeypatch):
    # a large model's first step took minutes with the bar at 0 and nothing else moving: no sign the run was alive
    from gyre.local import progress as progress_module
    from gyre.local.progress import RunProgress
    from gyre.local.runs import Run
    from gyre.net import free_port
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    from gyre.metrics import counter

    rollouts = counter("gyre_orchestrator_rollouts_total", "rollouts", ("run_id", "env", "outcome"), registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    clock = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    progress = RunProgress([Run("r", tmp_path, 4)], {"r": 0}, metrics_url=f"http://127.0.0.1:{port}/metrics")
    try:
        progress.update()
        assert progress.bar.n == 0 and progress._post == {"rollouts": "0"}
        rollouts.labels("r", "reverse_text", "ok").inc(30)
        rollouts.labels("r", "reverse_text", "truncated").inc(7)
        rollouts.labels("r", "reverse_text", "stale").inc(5)  # dropped, generated again: not progress
        progress.update()
        assert progress._post == {"rollouts": "0"}  # read every 2 s, not at each 0.5 s update
        clock[0] += 2.0
        progress.update()
        assert progress._post == {"rollouts": "37"}
        server.shutdown()  # the orchestrator restarting: the last count stays
        clock[0] += 2.0
        progress.update()
        assert progress._post == {"rollouts": "37"}
    finally:
        progress.close()
        server.server_close()
