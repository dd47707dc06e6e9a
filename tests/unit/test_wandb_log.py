"""`gyre.wandb_log`: a real wandb run in offline mode (WANDB_MODE=offline, nothing leaves the machine)."""

from __future__ import annotations

import json

import pytest
from gyre.config.shared import WandbConfig
from gyre.wandb_log import SAMPLE_COLUMNS, WandbLogger

pytest.importorskip("wandb", reason="the wandb extra is part of the dev install")

RECORD = {"step": 3, "prompt": [{"role": "user", "content": "Reverse: abc"}], "task_id": "row-1",
          "completion": [{"role": "assistant", "content": "cba"}], "answer": "cba", "reward": 1.0, "advantage": 0.5,
          "min_version": 1, "max_version": 2, "stop_reason": "done"}  # fmt: skip


def test_offline_run_records_metrics_and_a_samples_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(WandbConfig(enabled=True, samples=2), service="orchestrator", run_id="wb-test",
                         output_dir=tmp_path, config={"batch_size": 4})  # fmt: skip
    assert logger.run.name == "wb-test-orchestrator" and logger.run.group == "wb-test"
    for step in (1, 2, 3):
        logger.log({"step": step, "reward_mean": 0.25 * step, "env": "dataset", "flag": True})
    logger.log({"step": 2, "avg_at_k": 0.75}, prefix="eval")
    # an environment's explanation of a sample (`details`) is its one line; a record without one (an older dump's) ""
    explained = {**RECORD, "reward": 0.0, "details": {"passed": 0, "error": "no ```python code block"}}
    logger.samples([explained, RECORD, {**RECORD, "task_id": "row-2"}], step=3)
    logger.finish()
    import wandb

    wandb.teardown()  # stops wandb's writer process, which flushes the run file (a service process exiting does this)

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    for key in (b"orchestrator/reward_mean", b"orchestrator/step", b"eval/avg_at_k", b"samples"):
        assert key in data, key
    assert b"orchestrator/env" not in data and b"orchestrator/flag" not in data  # only numbers are metrics
    (table,) = run_dir.glob("files/media/table/samples_*.table.json")
    content = json.loads(table.read_text())
    assert content["columns"] == SAMPLE_COLUMNS
    assert content["data"] == [  # the first `samples`
        [3, "row-1", "Reverse: abc", "cba", "cba", 0.0, 0.5, 1, 2, "done", "passed: 0; error: no ```python code block"],
        [3, "row-1", "Reverse: abc", "cba", "cba", 1.0, 0.5, 1, 2, "done", ""],
    ]


def test_disabled_is_a_no_op(tmp_path):
    logger = WandbLogger(WandbConfig(), service="trainer", run_id="x", output_dir=tmp_path, config={})
    logger.log({"step": 1, "loss": 0.5})
    logger.samples([RECORD], step=1)
    logger.finish()
    assert logger.run is None and not (tmp_path / "wandb").exists()


def test_a_launch_of_the_same_run_folder_continues_its_wandb_run(tmp_path, monkeypatch):
    # each launch opened a new W&B run under the same name: a resumed run's curves were split across W&B runs
    import shutil

    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    def launch(folder, service="orchestrator") -> str:
        logger = WandbLogger(WandbConfig(enabled=True), service=service, run_id="wb-resume", output_dir=folder,
                             config={})  # fmt: skip
        logger.log({"step": 1, "reward_mean": 0.5})
        identity = logger.run.id
        logger.finish()
        return identity

    run = tmp_path / "run"
    first = launch(run)
    assert launch(run) == first and (run / "wandb/orchestrator.id").read_text() == first
    wandb.teardown()
    launches = list((run / "wandb").glob("offline-run-*"))
    assert len(launches) == 2 and all(first in p.name for p in launches)  # both launches: one W&B run (`wandb sync`)
    trainer = launch(run, "trainer")
    assert trainer != first and launch(run, "trainer") == trainer  # one W&B run per service, as named
    assert launch(tmp_path / "other") != first  # another run folder: another W&B run
    (run / "wandb/orchestrator.id").write_text("../not an id\n")  # damaged by hand: a new run, never a crash
    renewed = launch(run)
    assert renewed != first and (run / "wandb/orchestrator.id").read_text() == renewed
    shutil.rmtree(run / "wandb")  # what `gyre rl --fresh` does: the run starts over, in a new W&B run
    assert launch(run) not in (first, renewed)
    wandb.teardown()


def test_the_run_config_masks_every_secret(tmp_path, monkeypatch):
    """The W&B run's config is the service's config with its secrets masked: the orchestrator's inference API key and
    control tokens went to W&B in clear once (every project member reads a run's config)."""
    from gyre.config.orchestrator import OrchestratorConfig

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OrchestratorConfig(inference={"api_key": "sk-policy-s3cret", "control_token": "ctl-s3cret"},
                             server={"control_token": "srv-s3cret"}, redis={"password": "redis-s3cret"},
                             batch_size=7)  # fmt: skip
    logger = WandbLogger(WandbConfig(enabled=True), service="orchestrator", run_id="wb-secret", output_dir=tmp_path,
                         config=cfg)  # fmt: skip
    assert logger.run.config["inference"]["api_key"] == "**********"
    assert logger.run.config["server"]["control_token"] == "**********" and logger.run.config["batch_size"] == 7
    logger.finish()
    import wandb

    wandb.teardown()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    written = next(run_dir.glob("run-*.wandb")).read_bytes()  # the config as the sync uploads it
    assert b"batch_size" in written
    for secret in (b"sk-policy-s3cret", b"ctl-s3cret", b"srv-s3cret", b"redis-s3cret"):
        assert secret not in written, secret


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    """A machine where nobody ran `wandb login`: no WANDB_API_KEY, no netrc, no W&B settings; not a terminal."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    import wandb

    # wandb.login sets up wandb's process-wide settings from this environment (online): a later wandb.init in the
    # same process kept them, ignoring its own WANDB_MODE=offline
    wandb.teardown()


def test_online_without_an_api_key_is_one_clear_error_before_and_at_start(tmp_path, no_wandb_key):
    # the trainer crashed with wandb's UsageError traceback once every service of the run had started
    from gyre.wandb_log import WandbUnavailable, check_wandb

    cfg = WandbConfig(enabled=True)
    with pytest.raises(WandbUnavailable, match=r"no API key here .*`wandb login`.*WANDB_API_KEY.*mode = 'offline'"):
        check_wandb(cfg)
    with pytest.raises(WandbUnavailable, match=r"no API key"):  # a service given the config alone says the same
        WandbLogger(cfg, service="trainer", run_id="x", output_dir=tmp_path / "run", config={})


def test_offline_a_key_or_disabled_need_nothing_more(no_wandb_key, monkeypatch):
    from gyre.wandb_log import check_wandb

    check_wandb(WandbConfig())  # disabled
    check_wandb(WandbConfig(enabled=True, mode="offline"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_wandb(WandbConfig(enabled=True))
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)  # checked by wandb.init, not here: no request leaves the machine
    check_wandb(WandbConfig(enabled=True))


def test_gyre_rl_refuses_online_wandb_without_a_key_before_anything_starts(tmp_path, no_wandb_key):
    from pathlib import Path

    from gyre.config import ConfigError, load_config
    from gyre.config.rl import RLConfig
    from gyre.local.launcher import Launcher

    ci = Path(__file__).resolve().parents[2] / "configs" / "ci.toml"
    cfg = load_config(RLConfig, ["@", str(ci), "--output-dir", str(tmp_path / "run"), "--wandb.enabled", "true"])
    with pytest.raises(ConfigError, match=r"^config key 'wandb.enabled': wandb.enabled = true logs online"):
        Launcher(cfg).validate()
    assert not (tmp_path / "run").exists()
