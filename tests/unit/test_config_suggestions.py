"""A user coming from PRIME-RL writes keys the way PRIME-RL names or places them: each unknown key is named with the
key it most likely means, in its own section first (`orchestrator.env.id` was "did you mean 'orchestrator.env'?",
`wandb.name` 'wandb.mode'), else where it lives (a top-level `seq_len` had no suggestion), else with its section's
keys; PRIME-RL's array of environments says what to write."""

from __future__ import annotations

from pathlib import Path

import pytest
from gyre.config import ConfigError, load_config
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.rl import RLConfig

ROOT = Path(__file__).resolve().parents[2]
CI = ["@", str(ROOT / "configs/ci.toml")]


def error_of(argv: list[str], tmp_path: Path) -> str:
    from gyre.local.launcher import Launcher

    with pytest.raises(ConfigError) as e:
        Launcher(load_config(RLConfig, [*CI, "--output-dir", str(tmp_path / "run"), *argv])).validate()
    return str(e.value)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--seq-len", "512"],
         "config key 'seq_len': unknown key (did you mean 'trainer.data.seq_len' or 'orchestrator.batch.seq_len'?)"),
        (["--async-level", "2"],
         "config key 'async_level': unknown key (did you mean 'orchestrator.max_async_level'?)"),
        (["--max-norm", "1"], "config key 'max_norm': unknown key (did you mean 'trainer.optim.max_grad_norm'?)"),
        (["--rollouts-per-example", "8"],
         "config key 'rollouts_per_example': unknown key (did you mean 'orchestrator.rollouts_per_example'?)"),
        (["--orchestrator.env.id", "reverse_text"],
         "config key 'orchestrator.env.id': unknown key (did you mean 'orchestrator.env.name'?)"),
        (["--orchestrator.async-level", "2"],
         "config key 'orchestrator.async_level': unknown key (did you mean 'orchestrator.max_async_level'?)"),
        (["--trainer.optim.learning-rate", "1e-5"],
         "config key 'trainer.optim.learning_rate': unknown key (did you mean 'trainer.optim.lr'?)"),
        (["--sft.max-steps", "10"],  # gyre sft's keys under [sft] (was "did you mean 'max_steps'?", RL's)
         "config key 'sft.max_steps': unknown key (did you mean 'sft.args.max_steps'?)"),
        (["--inference.max-num-seqs", "4"],  # vLLM's name
         "config key 'inference.max_num_seqs': unknown key (did you mean 'inference.engine.max_batch_size'?)"),
        (["--wandb.name", "run-1"],  # was "wandb has: enabled, project, ...": none of them the run's name
         "config key 'wandb.name': unknown key; PRIME-RL's wandb.name is 'run_id' here (one W&B run per service, named "
         "{run_id}-{service}; wandb.group groups them)"),
        (["--orchestrator.client.base-url", "http://h:8000/v1"],
         "config key 'orchestrator.client': unknown key; PRIME-RL's client is 'orchestrator.inference.urls' here "
         "(client.base_url; "
         "the table's other keys are beside it: api_key_file, timeout_s)"),
        (["--client.base-url", "http://h:8000/v1"],
         "config key 'client': unknown key; PRIME-RL's client is 'orchestrator.inference.urls' here (client.base_url; "
         "the table's other keys are beside it: api_key_file, timeout_s)"),
        # PRIME-RL's rl.toml puts the adapter in the trainer's model table; its rl cleans the output folder
        (["--trainer.model.lora.rank", "8"],
         "config key 'trainer.model.lora': unknown key; PRIME-RL's model.lora is 'trainer.lora' here (the trainer's "
         "LoRA adapter: rank, alpha, dropout, target_modules)"),
        # verl's actor keys: clip_ratio_low was "did you mean 'trainer.loss.clip_ratio_c'?" (the dual clip, a near
        # miss by spelling), warmup_style 'trainer.optim.warmup_steps'; loss_agg_mode and grad_clip got no guess
        (["--trainer.loss.clip-ratio-low", "0.2"],
         "config key 'trainer.loss.clip_ratio_low': unknown key (did you mean 'trainer.loss.eps_low'?)"),
        (["--trainer.loss.clip-ratio", "0.2"],
         "config key 'trainer.loss.clip_ratio': unknown key (did you mean 'trainer.loss.eps_low' or "
         "'trainer.loss.eps_high'?)"),
        (["--trainer.optim.warmup-style", "cosine"],
         "config key 'trainer.optim.warmup_style': unknown key (did you mean 'trainer.optim.scheduler'?)"),
        (["--trainer.loss.loss-agg-mode", "token-mean"],
         "config key 'trainer.loss.loss_agg_mode': unknown key (did you mean 'trainer.loss.aggregation'?)"),
        (["--trainer.optim.grad-clip", "1"],
         "config key 'trainer.optim.grad_clip': unknown key (did you mean 'trainer.optim.max_grad_norm'?)"),
        # a key of gyre rl's [trainer] found in two places: the second was named without its section ('server.port')
        (["--trainer.port", "1"],
         "config key 'trainer.port': unknown key (did you mean 'trainer.metrics.port' or 'trainer.server.port'?)"),
        # PRIME-RL's env is always a list (--orchestrator.env.0.args.x); a single [orchestrator.env] table has no index
        (["--orchestrator.env.0.args.x", "1"],
         "config key 'orchestrator.env.0': unknown key; 'orchestrator.env' is one table here, not a list: drop the "
         "index (e.g. 'orchestrator.env.name'), or give it as a list of tables ([[...]] entries) to index them"),
        (["--clean"],
         "config key 'clean': unknown key; PRIME-RL's clean is 'fresh' here (it deletes the previous run in output_dir "
         "first; without it the same command continues that run, where PRIME-RL's rl cleaned by default)"),
    ],
)  # fmt: skip
def test_a_key_named_or_placed_as_prime_rl_does_is_suggested_where_gyre_has_it(argv, said, tmp_path):
    assert error_of(argv, tmp_path).splitlines()[0] == said
    assert not (tmp_path / "run").exists()


def test_a_near_miss_still_wins_and_a_key_of_no_likeness_gets_no_guess(tmp_path):
    assert "did you mean 'max_steps'?" in error_of(["--max-stepz", "3"], tmp_path)
    assert error_of(["--bogus-thing", "3"], tmp_path) == "config key 'bogus_thing': unknown key"


def test_an_array_of_environments_is_a_mix_and_prime_rl_s_id_is_named(tmp_path):
    # [[orchestrator.env]] was refused ("one environment per orchestrator"); it is a mix now (docs/orchestrator.md)
    (tmp_path / "o.toml").write_text('[[env]]\nname = "reverse_text"\n\n[[env]]\nname = "arithmetic"\n')
    assert [e.name for e in load_config(OrchestratorConfig, ["@", str(tmp_path / "o.toml")]).envs] == [
        "reverse_text", "arithmetic"]  # fmt: skip
    text = error_of(["--orchestrator.env", '[{"id": "reverse-text"}]'], tmp_path)
    assert text.startswith("config key 'orchestrator.env.0.id': unknown key (did you mean 'orchestrator.env.0.name'?)")


def test_an_environment_name_alone_stands_for_its_table(tmp_path):
    # `--orchestrator.env arithmetic` was refused as "Input should be a valid dictionary or instance of EnvConfig",
    # naming neither env.name nor the table form; a name (or a list of names: a mix) is the table with defaults
    one = load_config(OrchestratorConfig, ["--env", "arithmetic"])
    assert [(e.name, e.args, e.ratio) for e in one.envs] == [("arithmetic", {}, 1.0)]
    (tmp_path / "o.toml").write_text('env = ["reverse_text", "arithmetic"]\n')
    mix = load_config(OrchestratorConfig, ["@", str(tmp_path / "o.toml")])
    assert [(e.name, e.ratio) for e in mix.envs] == [("reverse_text", 1.0), ("arithmetic", 1.0)]
    assert "unknown environment 'reverse_txt': did you mean 'reverse_text'?" in error_of(
        ["--orchestrator.env", "reverse_txt"], tmp_path)  # fmt: skip


EXPERIMENT = """output_dir = "out/exp"
max_steps = 3
[model]
init_preset = "tiny"
[trainer.optim]
lr = 1e-3
[orchestrator]
batch_size = 4
rollouts_per_example = 4
[orchestrator.env]
name = "arithmetic"
[orchestrator.sampling]
max_tokens = 24
temperature = 0.8
[orchestrator.eval]
interval = 5
num_examples = 8
k = 2
"""


def test_an_experiment_file_given_whole_to_a_service_says_which_table_to_read(tmp_path):
    # every key of it was an "unknown key" line of its own (gyre eval @ exp.toml: 5 of them, none saying why)
    from gyre.config.orchestrator import GyreEvalConfig
    from gyre.config.trainer import TrainerConfig

    exp = tmp_path / "exp.toml"
    exp.write_text(EXPERIMENT)
    for cls, table in [(GyreEvalConfig, "orchestrator"), (TrainerConfig, "trainer"),
                       (OrchestratorConfig, "orchestrator")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(cls, ["@", str(exp)])
        assert str(e.value).startswith(f"{exp} is an experiment file") and f"'@ {exp}#{table}'" in str(e.value)
    load_config(RLConfig, ["@", str(exp)])  # gyre rl's own


def test_gyre_eval_reads_a_runs_orchestrator_table_less_its_training_keys(tmp_path):
    # `gyre eval @ exp.toml#orchestrator` (the run's environment and eval settings) failed on batch_size,
    # rollouts_per_example, eval.interval, sampling.temperature: keys of training, unknown to one evaluation
    from gyre.config.orchestrator import GyreEvalConfig

    exp = tmp_path / "exp.toml"
    exp.write_text(EXPERIMENT)
    cfg = load_config(GyreEvalConfig, ["@", f"{exp}#orchestrator"])
    assert (cfg.env.name, cfg.sampling.max_tokens, cfg.eval.num_examples, cfg.eval.k) == ("arithmetic", 24, 8, 2)
    assert str(cfg.output_dir) == "out/exp"
    exp.write_text(EXPERIMENT + "num_exampls = 3\n")  # a key neither has is still refused, by name
    with pytest.raises(ConfigError, match=r"'eval.num_exampls': unknown key \(did you mean 'eval.num_examples'"):
        load_config(GyreEvalConfig, ["@", f"{exp}#orchestrator"])
    with pytest.raises(ConfigError, match=r"config key 'batch_size': unknown key"):  # given as an option: refused
        load_config(GyreEvalConfig, ["--batch-size", "4"])


@pytest.mark.parametrize(
    ("variable", "meant"), [("GYRE_SEQ_LEN", "GYRE_TRAINER__DATA__SEQ_LEN"), ("GYRE_LR", "GYRE_TRAINER__OPTIM__LR")]
)
def test_a_section_key_set_by_a_top_level_variable_is_refused_naming_where_it_lives(variable, meant, monkeypatch):
    # GYRE_SEQ_LEN=512 (PRIME-RL's shared seq_len) was no key of gyre rl's, so not looked at: the run went on at 256
    from gyre.config.mistakes import check_environment_keys

    with pytest.raises(ConfigError) as e:
        check_environment_keys(RLConfig, {variable: "512"})
    assert f"set by the environment variable {variable} (did you mean {meant}?)" in str(e.value)
    check_environment_keys(RLConfig, {"GYRE_CACHE_DIR": "/x", "GYRE_RUN_SEGMENT": "s", "GYRE_API_KEY": "k"})  # not keys


def test_prime_rls_section_files_are_read_as_their_tables(tmp_path):
    # `gyre rl --trainer @ trainer.toml --orchestrator @ orch.toml` (PRIME-RL's `rl` command line) was "config key
    # 'trainer': the option needs a value", the files then read as whole configs
    (tmp_path / "trainer.toml").write_text("[optim]\nlr = 0.003\n[data]\nseq_len = 128\n")
    (tmp_path / "orch.toml").write_text('batch_size = 8\n[env]\nname = "arithmetic"\n')
    (tmp_path / "exp.toml").write_text(
        'max_steps = 7\n[orchestrator]\nbatch_size = 2\n[orchestrator.env]\nname = "x"\n'
    )
    (tmp_path / "all.toml").write_text('[model]\nname = "m"\ninit_preset = "tiny"\n')
    exp = str(tmp_path / "exp.toml")
    cfg = load_config(RLConfig, ["@", exp, "--trainer", "@", str(tmp_path / "trainer.toml"),
                                 "--orchestrator", f"@{tmp_path / 'orch.toml'}", "--orchestrator.batch-size", "16",
                                 "--fresh", "@", exp, "--model", "@", f"{tmp_path / 'all.toml'}#model"])  # fmt: skip
    assert cfg.trainer == {"optim": {"lr": 0.003}, "data": {"seq_len": 128}}
    # the section file beats the experiment file, an option beats both; a bare flag before a file stays a flag
    assert cfg.orchestrator == {"batch_size": "16", "env": {"name": "arithmetic"}} and cfg.fresh and cfg.max_steps == 7
    assert (cfg.model.name, cfg.model.init_preset) == ("m", "tiny")
    with pytest.raises(ConfigError, match=r"all.toml: no \[trainer\] table"):
        load_config(RLConfig, ["--trainer", "@", f"{tmp_path / 'all.toml'}#trainer"])


@pytest.mark.parametrize("cls", [RLConfig, OrchestratorConfig])
def test_a_log_level_in_any_case_is_taken(cls):
    # `--log.level debug`, PRIME-RL's spelling, was "Input should be 'DEBUG', 'INFO', 'WARNING' or 'ERROR'"
    assert load_config(cls, ["--log.level", "debug"]).log.level == "DEBUG"
    assert load_config(cls, ["--log.level", "Warning"]).log.level == "WARNING"
    with pytest.raises(ConfigError, match=r"config key 'log.level': Input should be 'DEBUG'"):
        load_config(cls, ["--log.level", "verbose"])


def test_a_misspelt_key_is_said_before_the_model_source_is_fetched(tmp_path, monkeypatch):
    # a hub id was fetched first: offline, half a minute of the hub client's retries, then the model's error alone;
    # the misspelt key came only on the next try
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--model.init-preset", "null", "--model.name", "org/not-here", "--orchestrator.batch-sise", "4"]
    assert error_of(argv, tmp_path).startswith("config key 'orchestrator.batch_sise': unknown key")
    assert "org/not-here" in error_of(argv[:4], tmp_path)  # the model is still checked, before anything starts


def test_a_name_found_in_several_sections_lists_each(tmp_path):
    # `gyre inference --port 8001` (vLLM's option) said "did you mean 'metrics.port'?": the first found, not HTTP's
    from gyre.config.inference import InferenceConfig

    with pytest.raises(ConfigError) as e:
        load_config(InferenceConfig, ["--port", "8001"])
    assert str(e.value) == ("config key 'port': unknown key (did you mean 'metrics.port' or 'server.port' or "
                            "'control.port'?)")  # fmt: skip


def test_a_runs_own_environment_is_named_by_its_entry_and_no_value_error_prefix(tmp_path):
    # a [[runs]] entry's unknown environment was "config key 'orchestrator.env'" (the shared one, which was fine), and
    # every validator's reason began with pydantic's "Value error, "
    multi = ["@", str(ROOT / "configs/multirun/two_runs.toml")]
    runs = '[{"name": "aa1"}, {"name": "bb2", "orchestrator": {"env": {"name": "bogus"}}}]'
    text = error_of([*multi, "--runs", runs], tmp_path)
    assert text.startswith("config key 'runs.1.orchestrator.env': unknown environment 'bogus'"), text
    text = error_of([*multi, "--runs", '[{"name": "a"}]'], tmp_path)
    assert text.startswith("config key 'runs.0.name': 'a' is part of 'lora_'") and "Value error" not in text, text
