"""The config loader: precedence CLI > @ TOML (merged left to right) > env GYRE_A__B > defaults."""

from __future__ import annotations

import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from gyre.config import ConfigError, help_text, load_config, to_toml
from gyre.config.inference import InferenceConfig
from gyre.config.loader import SECRET_FILE_FOR, collect, reveal
from gyre.config.orchestrator import GyreEvalConfig, OrchestratorConfig
from gyre.config.rl import RLConfig
from gyre.config.trainer import SFTConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("GYRE_"):
            monkeypatch.delenv(key)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults():
    cfg = load_config(TrainerConfig, [])
    assert cfg.optim.lr == 1e-5
    assert cfg.redis.url.startswith("redis://")
    assert cfg.ckpt.interval is None


def test_env_overrides_default(monkeypatch):
    monkeypatch.setenv("GYRE_OPTIM__LR", "0.5")
    monkeypatch.setenv("GYRE_RUN_ID", "from-env")
    cfg = load_config(TrainerConfig, [])
    assert cfg.optim.lr == 0.5 and cfg.run_id == "from-env"


def test_toml_overrides_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GYRE_OPTIM__LR", "0.5")
    f = write(tmp_path, "a.toml", "[optim]\nlr = 0.25\n")
    assert load_config(TrainerConfig, ["@", f]).optim.lr == 0.25


def test_env_still_fills_keys_the_toml_does_not_set(monkeypatch, tmp_path):
    monkeypatch.setenv("GYRE_OPTIM__WEIGHT_DECAY", "0.1")
    f = write(tmp_path, "a.toml", "[optim]\nlr = 0.25\n")
    cfg = load_config(TrainerConfig, ["@", f])
    assert cfg.optim.lr == 0.25 and cfg.optim.weight_decay == 0.1


def test_cli_overrides_toml(tmp_path):
    f = write(tmp_path, "a.toml", "[optim]\nlr = 0.25\n")
    assert load_config(TrainerConfig, ["@", f, "--optim.lr", "0.125"]).optim.lr == 0.125
    # position does not matter: CLI wins even when given before the file
    assert load_config(TrainerConfig, ["--optim.lr=0.125", "@", f]).optim.lr == 0.125


def test_multiple_files_merge_left_to_right(tmp_path):
    a = write(tmp_path, "a.toml", 'run_id = "a"\n[optim]\nlr = 0.1\nweight_decay = 0.2\n')
    b = write(tmp_path, "b.toml", "[optim]\nlr = 0.3\n")
    cfg = load_config(TrainerConfig, ["@", a, "@", b])
    assert cfg.run_id == "a" and cfg.optim.lr == 0.3 and cfg.optim.weight_decay == 0.2


def test_kebab_and_snake_case_and_bare_flags():
    cfg = load_config(TrainerConfig, ["--max-steps", "7", "--activation_checkpointing", "--ckpt.resume-step", "-1"])
    assert cfg.max_steps == 7 and cfg.activation_checkpointing is True and cfg.ckpt.resume_step == -1


def test_nested_keys_and_structured_values():
    cfg = load_config(
        OrchestratorConfig, ["--inference.urls", '["http://a:1", "http://b:2"]', "--env.args", '{"n": 3}']
    )
    assert cfg.inference.urls == ["http://a:1", "http://b:2"] and cfg.env.args == {"n": 3}


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config(TrainerConfig, ["--optim.lrr", "0.1"])
    assert "optim.lrr" in str(e.value) and "optim.lr" in str(e.value)


@pytest.mark.parametrize("argv", [["--config", "exp.toml"], ["--config-file", "exp.toml"]])
@pytest.mark.parametrize("cls", [RLConfig, SFTConfig, TrainerConfig], ids=lambda c: c.__name__)
def test_a_config_file_given_as_an_option_says_how_a_file_is_read(cls, argv):
    # `gyre rl --config exp.toml` (other tools' form) was "unknown key" alone, or "did you mean 'log.file'?"
    with pytest.raises(ConfigError) as e:
        load_config(cls, argv)
    key = argv[0][2:].replace("-", "_")
    assert str(e.value) == f"config key '{key}': unknown key; a config file is read with '@': @ x.toml (several " \
        "merge left to right)"  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "argv", "said"),
    [
        (OrchestratorConfig, ["--client.base-url", "http://h:8000/v1"], "'client': unknown key; PRIME-RL's client is "
         "'inference.urls' here"),
        (GyreEvalConfig, ["--client", '{"timeout": 5}'], "PRIME-RL's client is 'inference.urls' here"),
        (TrainerConfig, ["--wandb.name", "exp"], "'wandb.name': unknown key; PRIME-RL's wandb.name is 'run_id' here "
         "(one W&B run per service, named {run_id}-{service}"),
    ],
)  # fmt: skip
def test_a_prime_rl_key_that_gyre_has_elsewhere_names_the_gyre_key(cls, argv, said):
    # "wandb.name: unknown key; wandb has: enabled, project, ..." left a PRIME-RL user looking for the run's name
    with pytest.raises(ConfigError) as e:
        load_config(cls, argv)
    assert said in str(e.value), e.value


@pytest.mark.parametrize(
    "old, new",
    [("engine.max_lora_rank", "lora.max_rank"), ("engine.max_loras", "lora.max_loras"),
     ("lora.max_adapters", "lora.max_loras")],
)  # fmt: skip
def test_a_removed_inference_key_names_the_key_that_replaced_it(old, new, tmp_path, monkeypatch):
    from gyre.local.runs import _validated

    message = f"config key {old!r}: this key was removed; set config key {new!r} instead"
    section, _, key = old.partition(".")
    sources = {
        "cli": [f"--{old.replace('_', '-')}", "16"],
        "toml": ["@", write(tmp_path, "old.toml", f"[{section}]\n{key} = 16\n")],
    }
    for argv in sources.values():
        with pytest.raises(ConfigError) as e:
            load_config(InferenceConfig, argv)
        assert str(e.value) == message
    monkeypatch.setenv(f"GYRE_{section.upper()}__{key.upper()}", "16")
    with pytest.raises(ConfigError, match=message):
        load_config(InferenceConfig, [])
    monkeypatch.delenv(f"GYRE_{section.upper()}__{key.upper()}")
    with pytest.raises(ConfigError) as e:  # gyre rl: both keys get the section's prefix
        _validated(InferenceConfig, "inference.0", {section: {key: 16}}, {})
    assert str(e.value) == message.replace("config key '", "config key 'inference.")


def test_a_bare_option_that_is_not_on_off_needs_a_value():
    # `--output-dir` with its value forgotten once ran the whole experiment in a folder named "true"
    for argv, key in ((["--output-dir"], "output_dir"), (["--max-steps", "--bench"], "max_steps"),
                      (["--data.seq-len"], "data.seq_len")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"config key '{key}': the option needs a value"):
            load_config(TrainerConfig, argv)
    cfg = load_config(TrainerConfig, ["--bench", "--activation-checkpointing", "--max-steps", "2"])  # on/off stay
    assert cfg.bench is True and cfg.activation_checkpointing is True and cfg.max_steps == 2


def test_gyre_rl_names_a_sections_key_and_its_suggestion_under_the_section(tmp_path):
    from gyre.config.rl import RLConfig
    from gyre.local.runs import resolve_configs

    def resolve(*argv: str):
        cfg = load_config(RLConfig, ["--output-dir", str(tmp_path), *argv])
        return resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")

    with pytest.raises(ConfigError) as e:  # the suggestion is what to type: --trainer.optim.lr, not --optim.lr
        resolve("--trainer.optim.lrr", "0.1")
    assert str(e.value) == "config key 'trainer.optim.lrr': unknown key (did you mean 'trainer.optim.lr'?)"
    with pytest.raises(ConfigError, match=r"config key 'orchestrator.sampling.max_tokens': the option needs a value"):
        resolve("--orchestrator.sampling.max-tokens")
    assert resolve("--trainer.activation-checkpointing").trainer.activation_checkpointing is True


def test_unknown_key_in_toml_is_named(tmp_path):
    f = write(tmp_path, "a.toml", "[loss]\ntyp = 'gspo'\n")
    with pytest.raises(ConfigError, match=r"loss\.typ"):
        load_config(TrainerConfig, ["@", f])


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(InferenceConfig, ["--server.port", "eighty"])
    assert "server.port" in str(e.value) and "eighty" in str(e.value)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--optim.betas", "[0.9,"], "config key 'optim.betas': cannot parse '[0.9,' as JSON"),
        (["--data.env-args", "{seed: 1}"], "config key 'data.env_args': cannot parse '{seed: 1}' as JSON"),
        (["--data.env-args", "{bad", "json}"], "quoted for the shell: --data.env-args '{\"a\": 1}'"),  # unquoted
    ],
)
def test_a_list_or_table_that_does_not_parse_names_the_key(argv, said):
    # "cannot parse value '{seed: 1}': Expected '=' after a key": no option named, TOML's reason for a JSON value
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, argv)
    assert str(e.value).startswith("config key '") and said in str(e.value), e.value


def test_a_list_entry_set_by_a_dotted_option_says_how_a_list_is_set():
    # "config key 'servers': Input should be a valid list", with nothing on what to write instead
    with pytest.raises(ConfigError) as e:
        load_config(OrchestratorConfig, ["--judges.0.url", "http://x"])
    assert str(e.value).startswith("config key 'judges': Input should be a valid list; dotted options set table keys")
    assert "--judges '[...]' (JSON)" in str(e.value)


def test_a_bare_section_flag_turns_on_a_section_with_enabled_and_is_refused_for_one_without(tmp_path):
    # only ckpt's and sft's validators took a bare flag: `--wandb` and `gyre trainer --ckpt` failed with "Input should
    # be a valid dictionary or instance of WandbConfig (got 'true')"
    from gyre.config.rl import RLConfig

    assert load_config(RLConfig, ["--wandb"]).wandb.enabled
    assert load_config(SFTConfig, ["--wandb", "--wandb.project", "p", "--data.fake"]).wandb.enabled
    for cls, argv, key in [(TrainerConfig, ["--ckpt"], "ckpt"), (RLConfig, ["--log"], "log"),
                           (TrainerConfig, ["@", str(write(tmp_path, "t.toml", "[ckpt]\ninterval = 2\n")), "--ckpt"],
                            "ckpt")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(cls, argv)
        assert str(e.value).startswith(f"config key '{key}': a section, not an on/off option"), e.value


def test_bad_env_value_names_key(monkeypatch):
    monkeypatch.setenv("GYRE_DATA__SEQ_LEN", "long")
    with pytest.raises(ConfigError, match=r"data\.seq_len"):
        load_config(TrainerConfig, [])


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(TrainerConfig, ["@", str(tmp_path / "nope.toml")])
    bad = write(tmp_path, "bad.toml", "[optim\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(TrainerConfig, ["@", bad])


def test_a_folder_or_a_binary_file_given_as_a_config_file_is_named_not_a_traceback(tmp_path):
    # `gyre rl @ configs` (tab completion stopped at the folder), `@ model.safetensors`: IsADirectoryError and
    # UnicodeDecodeError tracebacks
    (tmp_path / "weights.safetensors").write_bytes(b"\x80\x00\xff" * 10)
    for argv, said in [(["@", str(tmp_path)], f"config file {tmp_path}: cannot read it: Is a directory"),
                       (["--optim", "@", str(tmp_path)], f"config file {tmp_path}: cannot read it: Is a directory"),
                       (["@", str(tmp_path / "weights.safetensors")], "weights.safetensors: not a TOML file (not "
                        "UTF-8 text")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(TrainerConfig, argv)
        assert said in str(e.value), e.value
    res = subprocess.run([sys.executable, "-m", "gyre.cli", "sft", "@", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 2 and res.stderr == f"gyre sft: error: config file {tmp_path}: cannot read it: Is a " \
        "directory\n", res.stderr  # fmt: skip


def test_experiment_table_inherits_shared_keys(tmp_path):
    exp = write(
        tmp_path,
        "exp.toml",
        'run_id = "exp1"\nmax_steps = 4\n[redis]\nurl = "redis://r:1/0"\n'
        "[inference.server]\nport = 9000\n[trainer.optim]\nlr = 0.01\n",
    )
    inf = load_config(InferenceConfig, ["@", exp + "#inference"])
    assert (inf.run_id, inf.server.port) == ("exp1", 9000) and "redis" not in InferenceConfig.model_fields
    tr = load_config(TrainerConfig, ["@", exp + "#trainer"])
    assert (tr.max_steps, tr.optim.lr, tr.run_id, tr.redis.url) == (4, 0.01, "exp1", "redis://r:1/0")


def test_a_service_reading_its_table_skips_gyre_rls_own_shared_keys(tmp_path):
    # `gyre trainer @ configs/ci.toml#trainer` once failed: "config key 'model.init_preset': unknown key"
    # (a `gyre rl` key in the shared [model] table); the service's own table is still checked strictly
    exp = write(tmp_path, "exp.toml", '[model]\nname = "m"\ninit_preset = "tiny"\n[trainer.optim]\nlr = 0.5\n')
    tr = load_config(TrainerConfig, ["@", exp + "#trainer"])
    assert tr.model.name == "m" and tr.optim.lr == 0.5
    inf = load_config(InferenceConfig, ["@", exp + "#inference"])
    assert inf.model.name == "m"
    bad = write(tmp_path, "bad.toml", "[trainer.optim]\nlrr = 0.5\n")
    with pytest.raises(ConfigError, match=r"optim\.lrr"):
        load_config(TrainerConfig, ["@", bad + "#trainer"])
    for name in ("ci.toml", "reverse_text/demo.toml"):  # the repository's own experiment files
        load_config(TrainerConfig, ["@", str(ROOT / "configs" / name) + "#trainer"])


def test_round_trip_through_toml_keeps_secrets(tmp_path):
    cfg = load_config(InferenceConfig, ["--auth.api-key", "s3cret", "--server.port", "1234"])
    path = write(tmp_path, "resolved.toml", to_toml(cfg))
    again = load_config(InferenceConfig, ["@", path])
    assert again == cfg and again.auth.api_key.get_secret_value() == "s3cret"


def test_secrets_are_read_from_files_given_on_the_command_line_or_in_the_environment(tmp_path, monkeypatch):
    """`<key>_file` (a mounted Kubernetes Secret): the file's text, one trailing newline dropped, lands
    in the secret key of every service; the file path, not the secret, is what travels."""
    key, token, password = (tmp_path / n for n in ("api-key", "control-token", "redis-password"))
    key.write_text("k3y\n")  # `kubectl create secret --from-file` keeps the newline
    token.write_text("t0ken")
    password.write_text("p@ss w/rd%\n")
    monkeypatch.setenv("GYRE_REDIS__PASSWORD_FILE", str(password))
    inf = load_config(InferenceConfig, ["--auth.api-key-file", str(key), "--auth.control-token-file", str(token)])
    assert inf.auth.api_key.get_secret_value() == "k3y" and inf.auth.control_token.get_secret_value() == "t0ken"
    assert inf.auth.api_key_file is None  # resolved: a child config written with to_toml carries the value
    orch = load_config(OrchestratorConfig, ["--inference.api-key-file", str(key),
                                            "--inference.control-token-file", str(token),
                                            "--server.control-token-file", str(token)])  # fmt: skip
    assert (reveal(orch.inference.api_key), reveal(orch.inference.control_token)) == ("k3y", "t0ken")
    assert reveal(orch.server.control_token) == "t0ken"
    trainer = load_config(TrainerConfig, ["--orchestrator.control-token-file", str(token)])
    assert reveal(trainer.orchestrator.control_token) == "t0ken"
    assert trainer.redis.password.get_secret_value() == "p@ss w/rd%"
    # `<key>` and `<key>_file` are one setting for precedence: the child's TOML (what `gyre rl` writes) and
    # a CLI option beat the environment's file, as they beat an environment variable
    again = load_config(InferenceConfig, ["@", write(tmp_path, "child.toml", to_toml(inf))])
    assert again.auth.api_key.get_secret_value() == "k3y"
    again = load_config(TrainerConfig, ["@", write(tmp_path, "child.toml", to_toml(trainer))])
    assert again.redis.password.get_secret_value() == "p@ss w/rd%"
    override = load_config(TrainerConfig, ["--redis.password", "given"])
    assert override.redis.password.get_secret_value() == "given"


def _sections(cls, seen=None):
    """Every config class reachable from `cls` through its fields (lists, unions and dicts of sections too)."""
    import typing

    from pydantic import BaseModel

    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)
    for field in cls.model_fields.values():
        todo = [field.annotation]
        while todo:
            kind = todo.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                _sections(kind, seen)
            todo += [a for a in typing.get_args(kind) if a is not type(None)]
    return seen


@pytest.mark.parametrize("root", [InferenceConfig, OrchestratorConfig, TrainerConfig, SFTConfig, RLConfig,
                                  GyreEvalConfig])  # fmt: skip
def test_every_secret_of_every_config_is_a_secret_str_so_no_repr_dump_or_log_shows_it(root):
    """A secret held as a plain str (the orchestrator's `inference.api_key`, the control tokens were) is printed by
    every repr, `model_dump` and traceback of its config; SecretStr masks itself everywhere but `to_toml`."""
    from pydantic import SecretStr

    secrets = [(cls.__name__, f.json_schema_extra[SECRET_FILE_FOR]) for cls in _sections(root)
               for f in cls.model_fields.values()
               if isinstance(f.json_schema_extra, dict) and SECRET_FILE_FOR in f.json_schema_extra]  # fmt: skip
    assert secrets or root in (SFTConfig, RLConfig)  # a service has the Redis password at least (gyre rl: its own)
    for owner, key in secrets:
        cls = next(c for c in _sections(root) if c.__name__ == owner)
        assert cls.model_fields[key].annotation == SecretStr | None, f"{owner}.{key} is not a SecretStr"


def test_the_orchestrators_and_trainers_secrets_are_masked_in_repr_and_dumps(tmp_path):
    orch = OrchestratorConfig(inference={"api_key": "sk-pol1cy", "control_token": "ctl-t0ken"},
                              server={"control_token": "srv-t0ken"})  # fmt: skip
    trainer = TrainerConfig(orchestrator={"control_token": "trn-t0ken"})
    for shown in (repr(orch), str(orch.model_dump()), orch.model_dump_json(), repr(trainer), trainer.model_dump_json()):
        assert not any(s in shown for s in ("sk-pol1cy", "ctl-t0ken", "srv-t0ken", "trn-t0ken")), shown
    assert reveal(orch.inference.api_key) == "sk-pol1cy" and reveal(None) is None
    # what `gyre rl` hands a child: the text itself
    child = load_config(OrchestratorConfig, ["@", write(tmp_path, "child.toml", to_toml(orch))])
    assert reveal(child.server.control_token) == "srv-t0ken"


def test_a_secret_file_that_cannot_be_read_or_a_secret_set_twice_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'auth'.*api_key_file = '.*missing'.*cannot read the file"):
        load_config(InferenceConfig, ["--auth.api-key-file", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="set control_token or control_token_file, not both"):
        load_config(TrainerConfig, ["--orchestrator.control-token", "x",
                                    "--orchestrator.control-token-file", write(tmp_path, "t", "y")])  # fmt: skip


def test_collect_rejects_stray_words():
    with pytest.raises(ConfigError, match="unexpected argument"):
        collect(["lr=3"])


@pytest.mark.parametrize("cls", [InferenceConfig, TrainerConfig, SFTConfig, OrchestratorConfig, GyreEvalConfig])
def test_every_field_is_documented_and_in_help(cls):
    text = help_text(cls, "gyre x")

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{cls.__name__}.{prefix}{name} has no description"
            annotation = field.annotation
            optional = [a for a in typing.get_args(annotation) if a is not type(None)]
            union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
            if union and len(optional) == 1:  # `Section | None` (an optional section such as trainer.lora)
                annotation = optional[0]
            # a table or a list of them (orchestrator.env, a mix), its members tagged: listed as the table's keys
            tables = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in optional]
            if union and any(getattr(a, "model_fields", None) for a in tables):
                annotation = next(a for a in tables if getattr(a, "model_fields", None))
            sub = getattr(annotation, "model_fields", None)
            if sub is not None:
                walk(annotation, prefix + name + ".")
            else:
                assert f"--{prefix}{name} " in text
            (entry,) = typing.get_args(annotation) if typing.get_origin(annotation) is list else (None,)
            if getattr(entry, "model_fields", None):  # [[judges]]-style lists: each entry's keys are listed
                block = text.split(f"each entry ([[{prefix}{name}]] in TOML) has:", 1)[1]
                for key, item in entry.model_fields.items():
                    assert item.description, f"{entry.__name__}.{key} has no description"
                    listed = block.split("\n--", 1)[0]
                    assert f" {key} " in listed or f"[{key}]" in listed, f"{prefix}{name}: {key} not in --help"

    walk(cls)


def test_cli_exits_2_naming_the_key():
    out = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "orchestrator", "--batch-size", "-3"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "batch_size" in out.stderr


def test_lora_keys_lr_ratio_b_and_lm_head_with_runs_are_checked_naming_the_key(tmp_path):
    lora = {"target_modules": ["q_proj", "lm_head"]}
    assert load_config(TrainerConfig, [], lora={**lora, "lr_ratio_b": 16}).lora.lr_ratio_b == 16
    with pytest.raises(ConfigError, match="lr_ratio_b"):
        load_config(TrainerConfig, [], lora={"lr_ratio_b": 0})
    run = {"name": "alpha", "output_dir": str(tmp_path / "alpha")}
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules: lm_head"):
        load_config(TrainerConfig, [], lora=lora, runs=[run])
    with pytest.raises(ConfigError, match=r"runs\.alpha\.lora\.target_modules: lm_head"):
        load_config(TrainerConfig, [], lora={}, runs=[{**run, "lora": lora}])


def test_a_stream_too_short_for_the_async_window_is_refused_naming_the_key():
    # MAXLEN trimmed entries the trainer had not read yet when max_async_level ran past stream_maxlen: the trainer
    # waited forever for a batch that was gone
    with pytest.raises(ConfigError) as e:
        load_config(OrchestratorConfig, ["--max-async-level", "63"])
    assert str(e.value).startswith("config key 'batch.stream_maxlen': 64 cannot hold the 64 batches")
    assert "set it >= 65" in str(e.value)
    cfg = load_config(OrchestratorConfig, ["--max-async-level", "63", "--batch.stream-maxlen", "65"])
    assert cfg.batch.stream_maxlen == 65


def test_greedy_training_samples_are_refused_before_anything_starts():
    """orchestrator.sampling.temperature = 0 passed the config; a step of rollouts later every group had no
    signal and the batch could not be built (the trainer scores at the batch's temperature, which must be > 0)."""
    with pytest.raises(ConfigError, match=r"sampling.temperature.*must be > 0.*eval.temperature = 0"):
        load_config(OrchestratorConfig, ["--sampling.temperature", "0"])
    assert load_config(OrchestratorConfig, ["--eval.temperature", "0"]).eval.temperature == 0  # greedy evals stay


@pytest.mark.parametrize(
    ("cls", "unused"),
    [
        (SFTConfig, ["redis.url", "redis.password", "metrics.port", "weights.full_verify"]),
        (InferenceConfig, ["redis.url", "redis.password_file", "wandb.enabled", "wandb.project"]),
        (
            GyreEvalConfig,
            ["run_id", "redis.url", "metrics.port", "wandb.enabled", "batch_size", "rollouts_per_example", "max_steps",
             "sampling.temperature", "eval.interval", "eval.at_start", "advantage.type", "teacher.url",
             "inference.health_interval_s", "inference.control_token", "ckpt_interval", "resume_step"],
        ),
    ],
)  # fmt: skip
def test_a_command_lists_and_accepts_only_the_keys_it_reads(cls, unused):
    """`gyre sft --help` listed --redis.*, --metrics.port and --weights.* (and `gyre eval --help` the whole
    orchestrator's: batch_size, sampling.temperature, eval.interval...), options the command accepted and ignored:
    `gyre eval --sampling.temperature 0.7` evaluated greedily."""
    text = help_text(cls, "gyre x")
    for key in unused:
        assert f"--{key} " not in text, key
        with pytest.raises(ConfigError, match=rf"config key '{key.split('.')[0]}(\.\w+)?': unknown key"):
            load_config(cls, [f"--{key}", "1", *(["--data.fake"] if cls is SFTConfig else [])])
    with pytest.raises(ConfigError, match=r"'sampling.temperature': unknown key \(did you mean 'eval.temperature'"):
        load_config(GyreEvalConfig, ["--sampling.temperature", "0.7"])


def test_help_shows_the_default_a_sections_own_default_sets():
    # `gyre sft --help` said --optim.lr defaults to 1e-05 (OptimConfig's); SFT's optim default is lr = 1e-3
    assert load_config(SFTConfig, ["--data.fake"]).optim.lr == 1e-3
    text = help_text(SFTConfig, "gyre sft")
    assert "--optim.lr float  (default: 0.001)" in text and "--optim.eps float  (default: 1e-08)" in text
    assert "--optim.lr float  (default: 1e-05)" in help_text(TrainerConfig, "gyre trainer")


def test_groups_that_cannot_carry_a_signal_are_refused_naming_the_key():
    """rollouts_per_example = 1 (and rloo with it) passed the config: every group advantage was 0, each step spent
    its whole oversample budget on zero-signal groups and trained on zeros; rloo's check only ran when the service
    started, after `gyre rl` had started everything (exit 1, no key named)."""
    with pytest.raises(ConfigError, match=r"^config key 'advantage.type': 'rloo' needs rollouts_per_example >= 2"):
        load_config(OrchestratorConfig, ["--advantage.type", "rloo", "--rollouts-per-example", "1"])
    with pytest.raises(ConfigError, match=r"^config key 'rollouts_per_example': 1 sample per task .* set it >= 2"):
        load_config(OrchestratorConfig, ["--rollouts-per-example", "1"])
    teacher = {"url": "http://127.0.0.1:9", "model": "teacher"}
    assert load_config(OrchestratorConfig, ["--rollouts-per-example", "1"], teacher=teacher).rollouts_per_example == 1
    assert load_config(OrchestratorConfig, ["--advantage.type", "rloo", "--rollouts-per-example", "2"])


def test_a_teacher_at_another_sampling_temperature_is_refused_naming_the_key():
    """The teacher's log-probs are at T = 1 and the trainer's at the sampling temperature: a distillation run at
    T = 0.7 started and trained the tempered student toward the teacher (a reverse KL to another distribution than
    the teacher's), silently; docs/algorithms.md said to distil at T = 1, nothing enforced it."""
    teacher = {"url": "http://127.0.0.1:9", "model": "teacher"}
    with pytest.raises(
        ConfigError,
        match=r"^config key 'sampling.temperature': 0.7 with \[teacher\].* set "
        r"sampling.temperature = 1",
    ):
        load_config(OrchestratorConfig, ["--sampling.temperature", "0.7"], teacher=teacher)
    assert load_config(OrchestratorConfig, [], teacher=teacher).sampling.temperature == 1
    assert load_config(OrchestratorConfig, ["--sampling.temperature", "0.7"]).teacher is None  # no teacher: free


def test_help_says_what_a_sections_shorthand_sets():
    # `--model Qwen/Qwen3-0.6B` (2621fd3) was said nowhere in --help
    assert "\n[model] Model to fine-tune (--model X sets model.name).\n" in help_text(SFTConfig, "gyre sft")
    assert "\n[optim] " in help_text(SFTConfig, "gyre sft")
    assert "--optim X" not in help_text(SFTConfig, "gyre sft")  # a section without a shorthand


def test_help_says_an_optional_section_is_unset_by_default():
    # `gyre orchestrator --help` listed `--teacher.url str  (required)` with nothing saying the teacher is optional
    text = help_text(OrchestratorConfig, "gyre orchestrator")
    assert "[teacher] (optional, unset by default) On-policy distillation" in text
    assert "[sampling] Sampling parameters." in text  # a section that is always there says nothing
    assert load_config(OrchestratorConfig, []).teacher is None


def test_a_list_option_takes_one_plain_value_as_its_one_entry(tmp_path):
    # `gyre eval --inference.urls http://host:8000/v1`, as vLLM and PRIME-RL users write one value, was refused:
    # "Input should be a valid list ... write a list"
    def urls(argv):
        return load_config(OrchestratorConfig, argv).inference.urls

    assert urls(["--inference.urls", "http://h:8000/v1"]) == ["http://h:8000"]  # its root (OrchestratorConfig's)
    # never split at a comma: a URL (or a path) may hold one; several entries are JSON
    assert urls(["--inference.urls=http://h:8000/a,b"]) == ["http://h:8000/a,b"]
    assert urls(["--inference.urls", '["http://a:1", "http://b:1"]']) == ["http://a:1", "http://b:1"]
    assert load_config(OrchestratorConfig, ["--inference.control-urls", "h:9"]).inference.control_urls == ["h:9"]
    assert load_config(TrainerConfig, ["--lora.target-modules", "q_proj"]).lora.target_modules == ["q_proj"]
    # gyre rl's sections are validated as the services' configs later: the option is a list there too
    from gyre.config.rl import RLConfig

    rl = collect(["--trainer.lora.target-modules", "q_proj", "--inference.lora.adapters", "/m/a,b"], RLConfig)
    assert rl == {"trainer": {"lora": {"target_modules": ["q_proj"]}}, "inference": {"lora": {"adapters": ["/m/a,b"]}}}
    # a list of tables takes no plain value; TOML is typed and unchanged: a string there is still no list
    with pytest.raises(ConfigError, match="config key 'judges': Input should be a valid list"):
        load_config(OrchestratorConfig, ["--judges", "http://x"])
    with pytest.raises(ConfigError) as e:
        load_config(OrchestratorConfig, ["@", write(tmp_path, "o.toml", '[inference]\nurls = "http://h:8000"\n')])
    assert str(e.value) == (
        "config key 'inference.urls': Input should be a valid list (got 'http://h:8000'); write a list: "
        """urls = ["http://h:8000"] in TOML, --inference.urls '["http://h:8000"]' as an option"""
    )
    assert "a list of plain values also takes one value as its one entry" in help_text(OrchestratorConfig, "x")


def test_an_environment_variable_reads_a_plain_list_entry_and_the_shorthand_as_an_option_does(monkeypatch):
    # GYRE_INFERENCE__URLS=http://h:8000/v1 and GYRE_MODEL=Qwen/... stopped the command with pydantic-settings'
    # traceback "error parsing value for field ..."
    monkeypatch.setenv("GYRE_INFERENCE__URLS", "http://h:8000/a,b")
    assert load_config(OrchestratorConfig, []).inference.urls == ["http://h:8000/a,b"]
    monkeypatch.setenv("GYRE_MODEL", "Qwen/Qwen3-0.6B")
    monkeypatch.setenv("GYRE_MODEL__DTYPE", "bfloat16")
    model = load_config(InferenceConfig, []).model
    assert (model.name, model.dtype) == ("Qwen/Qwen3-0.6B", "bfloat16")
    # gyre rl's sections, validated as the services' configs later: the variable is a list there too
    from gyre.config.rl import RLConfig

    monkeypatch.setenv("GYRE_TRAINER__LORA__TARGET_MODULES", "q_proj")
    assert load_config(RLConfig, []).trainer == {"lora": {"target_modules": ["q_proj"]}}
    # meant as JSON and broken: an error naming the key, as on the command line (was a traceback)
    monkeypatch.setenv("GYRE_INFERENCE__URLS", '["http://h:8000/v1"')
    with pytest.raises(ConfigError, match="config key 'inference': cannot parse its GYRE_ environment variable"):
        load_config(OrchestratorConfig, [])


def test_a_tables_model_by_name_keeps_the_shared_model_keys(tmp_path):
    # `@ exp.toml#inference` with a shared [model] dtype and the table's `model = "b"`: the table's string replaced the
    # shared table, and the dtype was lost, silently
    exp = write(tmp_path, "exp.toml", '[model]\nname = "a"\ndtype = "bfloat16"\n[inference]\nmodel = "b"\n')
    model = load_config(InferenceConfig, ["@", f"{exp}#inference"]).model
    assert (model.name, model.dtype) == ("b", "bfloat16")


def test_a_section_file_merges_with_the_sections_other_files(tmp_path):
    # `--optim @ a.toml --optim @ b.toml`, or gyre rl's `--trainer.optim @ optim.toml --trainer @ trainer.toml`: the
    # later file replaced the section's table, and the first file's keys were silently lost
    lr, decay = write(tmp_path, "lr.toml", "lr = 0.5\n"), write(tmp_path, "wd.toml", "weight_decay = 0.25\n")
    optim = load_config(TrainerConfig, ["--optim", "@", lr, "--optim", "@", decay]).optim
    assert (optim.lr, optim.weight_decay) == (0.5, 0.25)
    from gyre.config.rl import RLConfig

    trainer = write(tmp_path, "trainer.toml", "[data]\nseq_len = 64\n")
    values = collect(["--trainer.optim", "@", lr, "--trainer", "@", trainer], RLConfig)
    assert values == {"trainer": {"optim": {"lr": 0.5}, "data": {"seq_len": 64}}}


@pytest.mark.parametrize("cls", [OrchestratorConfig, GyreEvalConfig])
@pytest.mark.parametrize(
    "url", ["http://host:8000/v1/chat/completions", "http://host:8000/v1/completions/", "http://host:8000/v1/models"]
)
def test_an_inference_url_with_a_route_is_refused_naming_what_to_write(cls, url):
    # it was sent to .../v1/chat/completions/v1/chat/completions: a 404 once the orchestrator had started
    with pytest.raises(ConfigError) as e:
        load_config(cls, ["--inference.urls", f'["http://other:8000/v1", "{url}"]'])
    said = str(e.value)
    assert said.startswith("config key 'inference.urls': entry 1 "), said
    assert "which the client adds itself: give the server's root or its /v1 base (http://host:8000/v1)" in said
    # a root or an OpenAI base is what to write (the /v1 is the client's)
    assert load_config(cls, ["--inference.urls", "http://host:8000/v1/"]).inference.urls == ["http://host:8000"]


def test_gyre_eval_refuses_an_inference_url_with_a_route_before_connecting():
    argv = [sys.executable, "-m", "gyre.cli", "eval", "--inference.urls", "http://127.0.0.1:9/v1/chat/completions"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith("gyre eval: error: config key 'inference.urls': entry 0 "), res.stderr


def test_gyre_rl_help_says_how_a_run_continues_starts_over_and_rewinds():
    # a PRIME-RL user reads --help first: it said nothing of re-runs (PRIME-RL resumes with --ckpt.resume-step)
    from gyre.config.rl import RLConfig

    text = help_text(RLConfig, "gyre rl")
    head = text.split("Sources (highest first)")[0]
    assert "The same command again continues the run where it stands" in head
    assert "--fresh" in head and "--ckpt.resume-step N rewinds it" in head
    assert not [line for line in head.splitlines() if line.startswith(" ")], head  # the docstring's indent is gone


# keys where inf is a setting (no bound): the loss's bounds
INFINITE_OK = {"loss.eps_high", "loss.clip_ratio_c", "loss.delta", "loss.mask_high", "loss.is_cap"}


def _float_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a float (or optional float) leaf of `cls`, through its nested sections (not lists)."""
    from pydantic import BaseModel

    keys = []
    for name, field in cls.model_fields.items():
        if typing.get_origin(field.annotation) in (list, dict, tuple):
            continue
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        nested = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if nested:
            keys += _float_keys(nested[0], f"{prefix}{name}.")
        elif float in kinds:
            keys.append(f"{prefix}{name}")
    return keys


@pytest.mark.parametrize(
    "cls", [OrchestratorConfig, TrainerConfig, SFTConfig, InferenceConfig, GyreEvalConfig], ids=lambda c: c.__name__
)
def test_inf_and_nan_in_a_number_key_are_refused_naming_the_key(cls):
    # `--orchestrator.sampling.temperature inf` sampled uniform noise, `--optim.lr inf` trained NaN weights, an
    # infinite timeout waited for ever: all were accepted; the loss's bounds keep inf (no truncation)
    keys = _float_keys(cls)
    assert len(keys) > 3, keys
    for key in keys:
        for bad in ("inf", "nan", "-inf"):
            if bad == "inf" and key in INFINITE_OK:
                assert getattr(load_config(cls, [f"--{key}", bad]).loss, key.split(".")[1]) == float("inf")
                continue
            with pytest.raises(ConfigError, match=rf"(^|\n)config key '{key}': "):
                load_config(cls, [f"--{key}", bad])


def _leaf_keys(cls: type, wanted: typing.Callable[[typing.Any], bool], prefix: str = "") -> list[tuple[str, type]]:
    """Every dotted key of `cls` whose annotation is `wanted`, with that annotation, through its sections (not
    through a list or table of them)."""
    from pydantic import BaseModel

    keys = []
    for name, field in cls.model_fields.items():
        if wanted(field.annotation):
            keys.append((f"{prefix}{name}", field.annotation))
        elif typing.get_origin(field.annotation) not in (list, dict, tuple):
            kinds = typing.get_args(field.annotation) or (field.annotation,)
            nested = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
            if nested:
                keys += _leaf_keys(nested[0], wanted, f"{prefix}{name}.")
    return keys


def _number_keys(cls: type) -> list[str]:
    """Every dotted key of an int or float (or optional one) leaf of `cls`, not a bool, through its sections."""

    def number(annotation: typing.Any) -> bool:
        kinds = [k for k in typing.get_args(annotation) or (annotation,) if k is not type(None)]
        container = typing.get_origin(annotation) in (list, dict, tuple)
        return not container and bool(kinds) and all(k in (int, float) for k in kinds)

    return [key for key, _ in _leaf_keys(cls, number)]


@pytest.mark.parametrize(
    "cls", [OrchestratorConfig, TrainerConfig, SFTConfig, InferenceConfig, GyreEvalConfig], ids=lambda c: c.__name__
)
def test_true_or_false_in_a_number_key_is_refused_naming_the_key(cls, tmp_path):
    # pydantic's lax mode read a TOML `lr = true` as a learning rate of 1.0 and `max_steps = true` as one step
    keys = _number_keys(cls)
    assert len(keys) > 5, keys
    for key in keys:
        for bad in ("true", "false"):
            f = write(tmp_path, "bad.toml", f"{key} = {bad}\n")
            with pytest.raises(ConfigError, match=rf"(^|\n)config key '{key}': Input should be a number, not {bad}"):
                load_config(cls, ["@", f])


def test_gyre_rl_refuses_true_in_a_number_key_of_the_experiment_or_a_section(tmp_path):
    from gyre.local.runs import resolve_configs

    ci = ["@", str(ROOT / "configs/ci.toml"), "--output-dir", str(tmp_path)]
    with pytest.raises(ConfigError, match=r"config key 'max_steps': Input should be a number, not true"):
        load_config(RLConfig, [*ci, "@", write(tmp_path, "a.toml", "max_steps = true\n")])
    cfg = load_config(RLConfig, [*ci, "@", write(tmp_path, "b.toml", "[trainer.optim]\nlr = true\n")])
    with pytest.raises(ConfigError, match=r"config key 'trainer\.optim\.lr': Input should be a number, not true"):
        resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
    # a bool key still takes true, and a number key its number
    cfg = load_config(RLConfig, [*ci, "@", write(tmp_path, "c.toml", "[trainer]\ndeterministic = true\n")])
    assert resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0").trainer.deterministic is True


@pytest.mark.parametrize(
    ("cls", "argv", "key"),
    [
        (RLConfig, ["--max-steps", ""], "max_steps"),  # `--max-steps "$STEPS"` with STEPS unset
        (TrainerConfig, ["--optim.lr", ""], "optim.lr"),
    ],
)
def test_an_empty_option_value_is_a_config_error_not_a_crash(cls, argv, key):
    # "" is in every string: `raw[:1] in "[{"` read an empty value as JSON and the error path crashed (IndexError)
    with pytest.raises(ConfigError, match=rf"^config key '{key}': "):
        load_config(cls, argv)


@pytest.mark.parametrize("cls", [RLConfig, TrainerConfig, OrchestratorConfig])
def test_an_empty_output_dir_is_refused_not_the_current_folder(cls, tmp_path, monkeypatch):
    # Path("") is ".": `--output-dir "$DIR"` with DIR unset wrote the run into the folder gyre was started in
    said = r"config key 'output_dir': an empty path \(it would be the current folder\)"
    for argv in (["--output-dir", ""], ["@", write(tmp_path, "a.toml", 'output_dir = ""\n')]):
        with pytest.raises(ConfigError, match=said):
            load_config(cls, argv)
    monkeypatch.setenv("GYRE_OUTPUT_DIR", " ")
    with pytest.raises(ConfigError, match=said):
        load_config(cls, [])
    assert load_config(cls, ["--output-dir", "."]).output_dir == Path(".")  # asked for by name: taken


@pytest.mark.parametrize(
    "cls", [OrchestratorConfig, TrainerConfig, SFTConfig, InferenceConfig, GyreEvalConfig], ids=lambda c: c.__name__
)
def test_an_empty_text_or_list_entry_is_refused_naming_the_key(cls, tmp_path, monkeypatch):
    # GYRE_LORA__TARGET_MODULES= was the list [""] and the trainer died in peft with a traceback naming no key; an
    # empty --model.name "$M" failed in transformers the same way
    keys = _leaf_keys(cls, lambda annotation: annotation in (str, list[str]))  # not optional: None is their unset
    assert keys, keys
    for key, annotation in keys:
        is_list = annotation == list[str]
        said = rf"(^|\n)config key '{key}(\.0)?': (an empty value|entry 0 of)"
        for bad in ("", " "):
            with pytest.raises(ConfigError, match=said):
                load_config(cls, [f"--{key}", bad])
        toml_value = '[""]' if is_list else '""'
        section, _, leaf = key.rpartition(".")
        text = (f"[{section}]\n" if section else "") + f"{leaf} = {toml_value}\n"
        with pytest.raises(ConfigError, match=said):
            load_config(cls, ["@", write(tmp_path, "bad.toml", text)])
        env = "GYRE_" + key.upper().replace(".", "__")
        monkeypatch.setenv(env, "")
        with pytest.raises(ConfigError, match=said):
            load_config(cls, [])
        monkeypatch.delenv(env)


def test_gyre_rl_refuses_an_empty_target_modules_variable_before_starting(tmp_path, monkeypatch):
    from gyre.local.runs import resolve_configs

    monkeypatch.setenv("GYRE_TRAINER__LORA__TARGET_MODULES", "")
    cfg = load_config(RLConfig, ["@", str(ROOT / "configs/ci.toml"), "--output-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"config key 'trainer\.lora\.target_modules': entry 0 of \[''\] is empty"):
        resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
    # one real entry among them is still refused; real entries are taken
    monkeypatch.setenv("GYRE_TRAINER__LORA__TARGET_MODULES", '["q_proj", " "]')
    cfg = load_config(RLConfig, ["@", str(ROOT / "configs/ci.toml"), "--output-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"'trainer\.lora\.target_modules': entry 1 of"):
        resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
    monkeypatch.setenv("GYRE_TRAINER__LORA__TARGET_MODULES", '["q_proj", "v_proj"]')
    cfg = load_config(RLConfig, ["@", str(ROOT / "configs/ci.toml"), "--output-dir", str(tmp_path)])
    assert resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0").trainer.lora.target_modules == [
        "q_proj", "v_proj"
    ]  # fmt: skip
