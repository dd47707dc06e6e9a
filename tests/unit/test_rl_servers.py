"""`gyre rl` [[servers]]: other models served beside the policy, reached by `url = "server:<name>"`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gyre.config import ConfigError, load_config
from gyre.config.rl import RLConfig
from gyre.local.runs import resolve_configs

ROOT = Path(__file__).resolve().parents[2]


def resolve(tmp_path, *argv):
    cfg = load_config(RLConfig, [*argv, "--output-dir", str(tmp_path)])
    return resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")


def test_the_distillation_example_serves_its_teacher_and_wires_it(tmp_path):
    resolved = resolve(tmp_path, "@", str(ROOT / "configs/signals/distill.toml"))
    teacher = resolved.servers["teacher"]
    assert teacher.model.name == "outputs/demo/weights/step_300" and teacher.runner == "generate"
    assert resolved.orchestrator.teacher.url == f"http://127.0.0.1:{teacher.server.port}"
    ports = {c.server.port for c in resolved.inference} | {teacher.server.port}
    assert len(ports) == len(resolved.inference) + 1  # its own port
    assert resolved.trainer.loss.distill == 1.0 and resolved.trainer.loss.reward_weight == 0.0


def test_the_judge_example_wires_each_judge_to_its_server(tmp_path):
    resolved = resolve(tmp_path, "@", str(ROOT / "configs/signals/judge.toml"))
    url = f"http://127.0.0.1:{resolved.servers['judge'].server.port}"
    judges = [(j.name, j.url, j.weight) for j in resolved.orchestrator.judges]
    assert judges == [("judge", url, 0.5), ("style", url, 0.0)]


def test_a_reward_model_server_runs_the_pooling_runner(tmp_path):
    resolved = resolve(tmp_path, "--servers", '[{"name": "rm", "model": "m", "args": {"runner": "pooling"}}]',
                       "--orchestrator.reward-models", '[{"url": "server:rm"}]')  # fmt: skip
    assert resolved.servers["rm"].runner == "pooling"
    assert resolved.orchestrator.reward_models[0].url.endswith(str(resolved.servers["rm"].server.port))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--orchestrator.teacher", '{"url": "server:nobody"}'], "'orchestrator.teacher.url': no [[servers]] entry"),
        (["--trainer.loss.distill", "0.5"], "'trainer.loss.distill': 0.5 needs a teacher"),
        # a teacher without distill trained nothing from it, and kept every group of equal rewards for it
        (
            ["--servers", '[{"name": "teacher", "model": "m"}]', "--orchestrator.teacher", '{"url": "server:teacher"}'],
            "'trainer.loss.distill': 0 with [orchestrator.teacher] set",
        ),
        (["--servers", '[{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]'], "server names must differ"),
        (["--orchestrator.judges", '[{"url": "http://x", "api_key": "sk-1"}]'], "never go in config files"),
    ],
)
def test_mistakes_are_named_before_anything_starts(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve(tmp_path, *argv)


def test_a_servers_missing_model_names_its_own_key_not_the_policys_init_preset(tmp_path):
    from gyre.local.launcher import Launcher

    # it once said "config key 'servers' (judge): model.name = ...; set model.init_preset = 'tiny'",
    # advice that only creates the policy
    missing = tmp_path / "judge-model"
    argv = ["@", str(ROOT / "configs/ci.toml"), "--output-dir", str(tmp_path / "run"),
            "--servers", f'[{{"name": "judge", "model": "{missing}"}}]']  # fmt: skip
    with pytest.raises(ConfigError) as error:
        Launcher(load_config(RLConfig, argv)).validate()
    assert f"servers.judge.model = '{missing}'" in str(error.value) and "init_preset" not in str(error.value)


def test_a_model_name_that_cannot_be_fetched_says_how_to_get_one_for_its_own_key(tmp_path, monkeypatch, tiny_model):
    import huggingface_hub.constants
    from gyre.local.launcher import Launcher

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub: fails at once
    # the SmolLM2 recipe before `gyre model import`: its relative folder reads as a hub id; say how to import it
    recipe = ["@", str(ROOT / "configs/smollm2/arithmetic.toml"), "--output-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError) as error:
        Launcher(load_config(RLConfig, [*recipe, "--model.name", "outputs/not-imported"])).validate()
    assert "model.name = 'outputs/not-imported'" in str(error.value) and "gyre model import" in str(error.value)
    # a judge's hub id: its own hint, not the policy's init_preset (that hint was dropped on this path)
    with pytest.raises(ConfigError) as error:
        Launcher(
            load_config(
                RLConfig,
                [*recipe, "--model.name", str(tiny_model), "--servers", '[{"name": "judge", "model": "org/judge"}]'],
            )
        ).validate()
    assert "servers.judge.model = 'org/judge'" in str(error.value) and "init_preset" not in str(error.value)


@pytest.mark.parametrize(
    ("argv", "key"),
    [(["--trainer.max-steps", "5"], "trainer.max_steps"), (["--orchestrator.run-id", "x"], "orchestrator.run_id"),
     (["--trainer.output-dir", "/elsewhere"], "trainer.output_dir"),
     (["--inference.model.name", "m2"], "inference.model.name"),
     (["--orchestrator.redis.url", "redis://h:1/0"], "orchestrator.redis.url"),
     (["--servers", '[{"name": "j", "model": "m", "args": {"model": {"name": "x"}}}]'], "servers.j.args.model.name")],
)  # fmt: skip
def test_a_key_every_service_shares_is_refused_inside_a_section(tmp_path, argv, key):
    # `[trainer] max_steps = 5` under a top-level max_steps = 3 once left the trainer waiting forever for
    # steps its orchestrator never made; `[inference.model] name` served another model than the one trained
    with pytest.raises(ConfigError, match=rf"config key '{key}': gyre rl gives every service the same"):
        resolve(tmp_path, "@", str(ROOT / "configs/ci.toml"), *argv)


def test_a_typo_in_a_runs_orchestrator_table_names_that_table(tmp_path):
    # "config key 'orchestrator.batch_sise'" sent the user looking in [orchestrator] for a key that was not there
    runs = '[{"name": "alpha", "orchestrator": {"batch_sise": 3}}, {"name": "beta"}]'
    cfg = load_config(RLConfig, ["--output-dir", str(tmp_path), "--trainer.lora.rank", "4", "--runs", runs])
    with pytest.raises(ConfigError) as e:
        resolve_configs(cfg, "m", "redis://127.0.0.1:1/0")
    assert str(e.value) == (
        "config key 'runs.0.orchestrator.batch_sise': unknown key (did you mean 'runs.0.orchestrator.batch_size'?)"
    )
    shared = load_config(RLConfig, ["--output-dir", str(tmp_path), "--trainer.lora.rank", "4", "--runs", runs,
                                    "--orchestrator.max-asyn-level", "2"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^config key 'orchestrator.max_asyn_level': unknown key"):
        resolve_configs(shared, "m", "redis://127.0.0.1:1/0")  # the shared table's own mistake keeps its name


def test_a_mistake_in_a_runs_trainer_table_or_a_servers_args_names_the_key_as_written(tmp_path):
    # the [[runs]] entry's trainer keys were named 'trainer.runs.0.optim.lrr' (a table gyre rl refuses set by hand)
    # with the suggestion 'trainer.optim.lr' (another table); a server's args lost its entry: 'servers.engine.x'
    runs = '[{"name": "alpha", "trainer": {"optim": {"lrr": 1e-3}}}, {"name": "o"}]'
    cfg = load_config(RLConfig, ["--output-dir", str(tmp_path), "--trainer.lora.rank", "4", "--runs", runs])
    with pytest.raises(ConfigError) as e:
        resolve_configs(cfg, "m", "redis://127.0.0.1:1/0")
    lines = sorted(str(e.value).splitlines())
    assert lines[0] == "config key 'runs.0.trainer.optim.lrr': unknown key (did you mean 'runs.0.trainer.optim.lr'?)"
    assert lines[1].startswith("config key 'runs.1.name': ") and "'o' is part of 'lora_'" in lines[1]  # its own key
    servers = '[{"name": "judge", "model": "m", "args": {"engine": {"max_batch_sise": 3}}}]'
    with pytest.raises(ConfigError) as e:
        resolve(tmp_path, "--servers", servers)
    assert str(e.value) == ("config key 'servers.judge.args.engine.max_batch_sise': unknown key "
                            "(did you mean 'servers.judge.args.engine.max_batch_size'?)")  # fmt: skip


MIX = '[{"name": "reverse_text"}, {"name": "arithmetic", "label": "math"}]'


def test_a_runs_environment_over_a_shared_mix_is_the_runs_own_and_other_tables_name_the_entry(tmp_path):
    # [orchestrator] a mix, a [[runs]] entry `env = {name = "arithmetic"}`: refused as "config key 'env': is a list of 2
    # tables ... (--env.0.name ...)", naming neither the entry nor a form it can write
    runs = [{"name": "alpha"}, {"name": "beta", "orchestrator": {"env": {"name": "arithmetic"}}},
            {"name": "gamma", "orchestrator": {"env": {"1": {"ratio": 3}}}},
            {"name": "delta", "orchestrator": {"env": [{"name": "arithmetic", "args": {"max_value": 9}}]}}]  # fmt: skip
    base = ["--output-dir", str(tmp_path), "--trainer.lora.rank", "4", "--orchestrator.env", MIX]
    cfg = load_config(RLConfig, [*base, "--runs", json.dumps(runs)])
    orchestrators = resolve_configs(cfg, "m", "redis://127.0.0.1:1/0").orchestrators
    assert [(e.key, e.ratio) for e in orchestrators["alpha"].envs] == [("reverse_text", 1.0), ("math", 1.0)]
    assert not isinstance(orchestrators["beta"].env, list) and orchestrators["beta"].env.name == "arithmetic"
    assert [(e.key, e.ratio) for e in orchestrators["gamma"].envs] == [("reverse_text", 1.0), ("math", 3.0)]
    assert [(e.name, e.args) for e in orchestrators["delta"].envs] == [("arithmetic", {"max_value": 9})]

    args_only = [{"name": "alpha"}, {"name": "beta", "orchestrator": {"env": {"args": {"x": 1}}}}]
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.orchestrator.env': \[orchestrator\] trains a mix of 2"):
        resolve_configs(load_config(RLConfig, [*base, "--runs", json.dumps(args_only)]), "m", "redis://127.0.0.1:1/0")


def test_a_policy_port_the_user_sets_is_served_on_and_a_taken_one_is_refused_naming_the_key(tmp_path):
    # PRIME-RL users set the policy's port to reach it (vf-eval -b http://localhost:8000/v1): gyre rl replaced it by a
    # random one, silently
    import socket

    from gyre.net import free_port

    port = free_port()
    resolved = resolve(tmp_path, "@", str(ROOT / "configs/ci.toml"), "--inference.server.port", str(port),
                       "--inference-replicas", "2")  # fmt: skip
    assert [replica.server.port for replica in resolved.inference] == [port, port + 1]
    assert len({r.control.port for r in resolved.inference} | {port, port + 1}) == 4  # control ports: free, apart
    unset = resolve(tmp_path, "@", str(ROOT / "configs/ci.toml"), "--inference-replicas", "2")
    assert len({replica.server.port for replica in unset.inference}) == 2

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        said = rf"^config key 'inference.server.port': port {busy} on 127.0.0.1 is in use"
        with pytest.raises(ConfigError, match=said):
            resolve(tmp_path, "@", str(ROOT / "configs/ci.toml"), "--inference.server.port", str(busy))
    with pytest.raises(ConfigError, match=r"^config key 'inference.server.port': 'http' is not a port number"):
        resolve(tmp_path, "@", str(ROOT / "configs/ci.toml"), "--inference.server.port", "http")


def test_a_servers_port_the_user_sets_is_served_on_and_a_clash_is_refused_naming_its_key(tmp_path):
    # a [[servers]] entry's own args.server.port was replaced by a free port, silently (the policy's was too)
    from gyre.net import free_port

    port = free_port()
    judge = f'[{{"name": "judge", "model": "m", "args": {{"server": {{"port": {port}}}}}}}]'
    resolved = resolve(tmp_path, "--servers", judge, "--orchestrator.judges", '[{"url": "server:judge"}]')
    assert resolved.servers["judge"].server.port == port
    assert resolved.orchestrator.judges[0].url == f"http://127.0.0.1:{port}"  # the judge is asked there

    with pytest.raises(ConfigError, match=rf"^config key 'servers.judge.args.server.port': port {port} is another "
                                          "server's of this launch"):  # fmt: skip
        resolve(tmp_path, "--servers", judge, "--inference.server.port", str(port - 1), "--inference-replicas", "2")
