"""`gyre rl` on an existing run (no --fresh): keys its state is shaped by cannot change, and are refused naming the
key before anything starts (the trainer failed on them only after Redis, inference and the orchestrator had).
Also: a rewind is the top-level ckpt.resume_step's alone (a trainer rewound by itself under a running orchestrator
waited for a step forever)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.config import ConfigError, load_config, to_toml
from gyre.config.rl import RLConfig
from gyre.local.runs import resolve_configs

ROOT = Path(__file__).resolve().parents[2]
CI = ["@", str(ROOT / "configs/ci.toml")]
LORA = ["--trainer.lora", '{"rank": 8}']


def launched(out: Path, *argv: str, step: int = 2, config: list[str] = CI, run: str = "") -> None:
    """`out` as a previous launch of `gyre rl @ ci.toml *argv` left it: its configs and a checkpoint of `step`
    (of the [[runs]] entry `run`)."""
    cfg = load_config(RLConfig, [*config, *argv, "--output-dir", str(out)])
    configs = resolve_configs(cfg, str(out / "sft") if cfg.sft.enabled else str(out / "model"), "redis://x:1/0")
    (out / "configs").mkdir(parents=True)
    (out / "configs" / "trainer.toml").write_text(to_toml(configs.trainer))
    for name, orch in configs.orchestrators.items():
        (out / "configs" / (f"orchestrator-{name}.toml" if cfg.runs else "orchestrator.toml")).write_text(to_toml(orch))
    folder = out / "runs" / run if run else out
    if step == 0:  # batches pushed, none trained: the orchestrator's step record alone
        (folder / "events").mkdir(parents=True)
        (folder / "events" / "orchestrator_steps.jsonl").write_text('{"step": 1}\n')
        return
    ckpt = folder / "checkpoints" / "trainer" / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "progress.json").write_text("{}")


TWO_RUNS = ["@", str(ROOT / "configs/multirun/two_runs.toml")]


def launched_two_runs(out: Path) -> Path:
    """`out` as a launch of two_runs.toml left it: its run 'beta' at step 2, the SFT warm-up done (reused)."""
    launched(out, config=TWO_RUNS, run="beta")
    (out / "sft").mkdir()
    (out / "sft" / "config.json").write_text("{}")
    return out


def validate(out: Path, *argv: str, config: list[str] = CI) -> None:
    from gyre.local.launcher import Launcher

    Launcher(load_config(RLConfig, [*config, *argv, "--output-dir", str(out)])).validate()


@pytest.mark.parametrize(
    ("before", "after", "key", "said"),
    [
        ([], LORA, "trainer.lora", "trained without LoRA; this launch turns it on"),
        (LORA, [], "trainer.lora", "trained with LoRA; this launch turns it off"),
        (LORA, ["--trainer.lora", '{"rank": 4}'], "trainer.lora.rank", "adapter of rank 8, not 4"),
        (LORA, [*LORA, "--trainer.lora.target-modules", '["q_proj"]'], "trainer.lora.target_modules", "q_proj"),
        ([], ["--model.name", str(ROOT / "configs")], "model.name", "was trained from"),
        # the experiment's identity: the run went on under another stream and W&B names, from the old checkpoints
        ([], ["--run-id", "other"], "run_id", "is 'ci', this launch names it 'other'"),
        (
            [],
            ["--orchestrator.env.name", "arithmetic"],
            "orchestrator.env.name",
            "= 'reverse_text', this launch sets 'arithmetic'",
        ),
        (
            [],
            ["--orchestrator.env.args", '{"max_length": 4}'],
            "orchestrator.env.args",
            "= {}, this launch sets {'max_length': 4}",
        ),
        (
            ["--orchestrator.env.args", '{"max_length": 4}'],
            ["--orchestrator.env.args", '{"max_length": 5}'],
            "orchestrator.env.args.max_length",
            "= 4, this launch sets 5",
        ),
        # task i is a function of (seed, i) and the saved task position an index: a new seed at the same index
        # repeated or skipped tasks (a dataset's epoch saw rows twice or never)
        ([], ["--orchestrator.seed", "3"], "orchestrator.seed", "orchestrator.seed = 0, this launch sets 3"),
    ],
)
@pytest.mark.parametrize("step", [2, 0])
def test_a_change_the_run_cannot_resume_is_refused_naming_the_key(tmp_path, before, after, key, said, step):
    # step 0: batches pushed, none trained yet (a Ctrl-C during the first step): they wait in the stream
    if step == 0 and key.startswith("trainer.lora"):
        pytest.skip("no adapter trained yet: any shape")
    out = tmp_path / "run"
    launched(out, *before, step=step)
    with pytest.raises(ConfigError) as e:
        validate(out, *after)
    assert str(e.value).startswith(f"config key '{key}':") and said in str(e.value), e.value
    assert "--fresh" in str(e.value) and "--output-dir" in str(e.value)


MIX = ["--orchestrator.env", '[{"name": "reverse_text", "ratio": 1}, {"name": "arithmetic", "ratio": 1}]']


def test_a_mix_of_environments_is_compared_whole_and_entry_by_entry(tmp_path):
    launched(tmp_path / "one")
    with pytest.raises(ConfigError, match=r"^config key 'orchestrator.env': .* was trained with orchestrator.env = "
                       r"\{'name': 'reverse_text'.*this launch sets \[\{'name': 'reverse_text'"):  # fmt: skip
        validate(tmp_path / "one", *MIX)
    launched(tmp_path / "mix", *MIX)
    validate(tmp_path / "mix", *MIX, "--max-steps", "9")  # the same mix
    # a mix's ratios stay free (reweighting between launches: each entry keeps its task position), its entries not
    validate(tmp_path / "mix", "--orchestrator.env", '[{"name": "reverse_text", "ratio": 3}, {"name": "arithmetic"}]')
    # so do an entry's group size and eval settings, as the orchestrator's own rollouts_per_example and eval.* are
    validate(tmp_path / "mix", "--orchestrator.env", '[{"name": "reverse_text", "rollouts_per_example": 4}, '
             '{"name": "arithmetic", "eval": {"enabled": false, "num_examples": 3}}]')  # fmt: skip
    # and its sampling lengths, training and eval, as the orchestrator's own sampling.max_tokens is
    validate(tmp_path / "mix", "--orchestrator.env", '[{"name": "reverse_text", "sampling": {"max_tokens": 512}, '
             '"eval": {"max_tokens": 32, "temperature": 0.6}}, {"name": "arithmetic"}]')  # fmt: skip
    other = '[{"name": "reverse_text", "ratio": 3}, {"name": "alphabet_sort", "ratio": 1}]'
    with pytest.raises(ConfigError, match=r"^config key 'orchestrator.env.1.name': .* = 'arithmetic', this launch "):
        validate(tmp_path / "mix", "--orchestrator.env", other)


def test_a_runs_own_environment_is_checked_and_named_by_its_entry(tmp_path):
    out = launched_two_runs(tmp_path / "multi")
    validate(out, "--max-steps", "9", config=TWO_RUNS)  # the same experiment, further
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.orchestrator.env.name': .*run 'beta' at step 2\).*"
                       r"'arithmetic'.*--fresh"):  # fmt: skip
        beta = '{"name": "beta", "orchestrator": {"env": {"name": "arithmetic"}}}'
        validate(out, "--runs", f'[{{"name": "alpha"}}, {beta}]', config=TWO_RUNS)
    with pytest.raises(ConfigError, match=r"^config key 'run_id': "):
        validate(out, "--run-id", "renamed", config=TWO_RUNS)
    beta = '{"name": "beta", "trainer": {"lora": {"rank": 8}}, "orchestrator": {"seed": %d}}'
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.orchestrator.seed': .*run 'beta' at step 2\).* = 1, "
                       r"this launch sets 5"):  # fmt: skip
        validate(out, "--runs", f'[{{"name": "alpha"}}, {beta % 5}]', config=TWO_RUNS)
    # alpha has pushed nothing: its seed may change
    validate(out, "--runs", f'[{{"name": "alpha", "orchestrator": {{"seed": 5}}}}, {beta % 1}]', config=TWO_RUNS)


def test_what_a_resume_may_change_and_a_rewind_to_the_base_are_not_refused(tmp_path):
    out = tmp_path / "run"
    launched(out)
    validate(out, "--max-steps", "9", "--trainer.optim.lr", "1e-4", "--orchestrator.eval.interval", "2",
             "--orchestrator.sampling.temperature", "0.7", "--orchestrator.sampling.seed", "3")  # fmt: skip
    (out / "checkpoints" / "trainer" / "step_2" / "progress.json").unlink()  # not a checkpoint: nothing started
    validate(out, "--run-id", "other", "--orchestrator.env.name", "arithmetic")
    launched(tmp_path / "again")
    # a rewind to the base model starts the run again in its folder (its id stays)
    validate(tmp_path / "again", "--ckpt.resume-step", "0", "--orchestrator.env.name", "arithmetic")
    with pytest.raises(ConfigError, match=r"^config key 'run_id'"):
        validate(tmp_path / "again", "--ckpt.resume-step", "0", "--run-id", "other")


def test_a_runs_own_adapter_is_checked_and_named_by_its_entry(tmp_path):
    out = launched_two_runs(tmp_path / "multi")
    entries = '[{"name": "alpha"}, {"name": "beta", "orchestrator": {"seed": 1}, "trainer": {"lora": {"rank": 4}}}]'
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.trainer.lora.rank': .*run 'beta' at step 2"):
        validate(out, "--runs", entries, config=TWO_RUNS)
    # alpha has trained nothing: its adapter may change
    validate(out, "--trainer.lora.rank", "4", "--runs", '[{"name": "alpha"}, {"name": "beta", "orchestrator": '
             '{"seed": 1}, "trainer": {"lora": {"rank": 8, "alpha": 16}}}]', config=TWO_RUNS)  # fmt: skip


def test_what_a_run_absorbs_or_starts_over_from_is_not_refused(tmp_path):
    out = tmp_path / "run"
    launched(out, *LORA)
    validate(out, *LORA, "--trainer.lora.alpha", "4", "--trainer.data.seq-len", "128",
             "--orchestrator.batch.seq-len", "128", "--orchestrator.rollouts-per-example", "8")  # fmt: skip
    validate(out, "--fresh")  # starts over
    (out / "checkpoints" / "trainer" / "step_2").rename(out / "checkpoints" / "trainer" / "step_0")
    validate(out)  # nothing trained: any shape


def test_the_check_comes_before_anything_starts(tmp_path):
    # the re-run that switched LoRA on started Redis, inference, the trainer and the orchestrator, and the trainer
    # failed on its checkpoint: now exit 2 with the key, and nothing started or written (no logs, no Redis folder)
    out = tmp_path / "run"
    launched(out)
    res = subprocess.run([sys.executable, "-m", "gyre.cli", "rl", *CI, *LORA, "--output-dir", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ))  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith("gyre rl: error: config key 'trainer.lora':")
    assert not (out / "logs").exists() and not (out / "redis").exists() and not (out / "locks").exists()


def test_a_reused_sft_warm_up_of_another_base_model_is_refused(tmp_path):
    # the finished warm-up is reused: a new model.name was silently ignored, RL went on from the old base's SFT
    out = tmp_path / "run"
    sft = ["--sft.args", '{"data": {"fake": true}}']
    launched(out, *sft)
    (out / "sft").mkdir()
    (out / "sft" / "config.json").write_text("{}")
    from gyre.config.trainer import SFTConfig

    trained = load_config(SFTConfig, ["--model.name", str(out / "model"), "--data.fake", "--output-dir", str(out)])
    (out / "configs" / "sft.toml").write_text(to_toml(trained))
    validate(out, *sft)
    with pytest.raises(ConfigError, match=r"^config key 'model.name': the SFT warm-up in .* was trained from"):
        validate(out, *sft, "--model.name", str(ROOT / "configs"))
    with pytest.raises(ConfigError, match=r"^config key 'sft.enabled': the run in .* was trained from .*sft"):
        validate(out)


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--trainer.ckpt.resume-step", "2"], "trainer.ckpt.resume_step"),
        (["--orchestrator.resume-step", "2"], "orchestrator.resume_step"),
        (
            ["--trainer.lora.rank", "4", "--trainer.runs", '[{"name": "alpha", "output_dir": "x", "resume_step": 2}]'],
            "trainer.runs",
        ),
        (
            ["--trainer.lora.rank", "4", "--runs", '[{"name": "alpha", "orchestrator": {"resume_step": 2}}]'],
            "runs.0.orchestrator.resume_step",
        ),
    ],
)
def test_a_rewind_of_one_service_alone_is_refused(tmp_path, argv, key):
    # `--trainer.ckpt.resume-step 2` reached the trainer alone: it deleted the newer checkpoints and weights and
    # waited for batch 3, which the orchestrator (resuming after the abandoned batches) never pushed again
    cfg = load_config(RLConfig, [*CI, *argv, "--output-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=rf"^config key '{key}': "):
        resolve_configs(cfg, str(tmp_path / "model"), "redis://x:1/0")
    resolved = resolve_configs(load_config(RLConfig, [*CI, "--ckpt.resume-step", "2", "--output-dir", str(tmp_path)]),
                               str(tmp_path / "model"), "redis://x:1/0")  # fmt: skip
    assert resolved.trainer.ckpt.resume_step == resolved.orchestrator.resume_step == 2  # the way to rewind


def test_a_runs_own_rewind_to_a_missing_checkpoint_is_refused_before_anything_starts(tmp_path):
    # checked by the trainer alone, after Redis, the replicas and every orchestrator had started
    entries = '[{"name": "alpha"}, {"name": "beta", "trainer": {"resume_step": 3}}]'
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.trainer.resume_step': no trainer checkpoint of step 3"):
        validate(tmp_path / "multi", "--runs", entries, config=TWO_RUNS)


def test_a_lock_holder_tells_what_it_asked_for_while_it_lives(tmp_path):
    # what a trainer rewinding by hand reads of the orchestrator beside it (gyre_trainer.run.check_orchestrator_rewinds)
    from gyre.runlock import running_holder
    from support.locks import hold_run_lock

    holder = hold_run_lock(tmp_path, "orchestrator", info={"resume_step": 2})
    try:
        found = running_holder(tmp_path, "orchestrator")
        assert found is not None and found["pid"] == holder.pid and found["resume_step"] == 2
    finally:
        holder.kill()
        holder.wait()
    assert running_holder(tmp_path, "orchestrator") is None  # died: its stale file tells nothing


SFT_ARGS = ["--sft.args", '{"max_steps": 2, "data": {"env": "reverse_text", "seq_len": 128}}']


def made(out: Path, *argv: str) -> None:
    """`out` as a launch of `gyre rl @ ci.toml *argv` left it before RL trained a step: the base model it created
    (and the record of how) and its finished SFT warm-up with the config it was trained with."""
    from gyre.config.loader import deep_merge
    from gyre.config.trainer import SFTConfig
    from gyre.local.launcher import Launcher
    from gyre.local.preflight import MODEL_INIT_RECORD

    cfg = load_config(RLConfig, [*CI, *argv, "--output-dir", str(out)])
    for folder in ("model", "sft"):
        (out / folder).mkdir(parents=True)
        (out / folder / "config.json").write_text("{}")
        (out / folder / "model.safetensors").write_text("")
    (out / "configs").mkdir()
    (out / MODEL_INIT_RECORD).write_text(f'init_preset = "tiny"\ninit_seed = 0\noutput_dir = "{out / "model"}"\n')
    values = {"run_id": cfg.run_id, "output_dir": str(out), "model": {"name": str(out / "model")},
              "save_dir": str(out / "sft"), "log": {"level": "INFO"}}  # fmt: skip
    (out / "configs" / "sft.toml").write_text(to_toml(load_config(SFTConfig, [], **deep_merge(values, cfg.sft.args))))
    assert Launcher(cfg).validate() is None  # the same command again: nothing changed


@pytest.mark.parametrize(
    ("argv", "key", "said"),
    [
        (["--model.init-seed", "1"], "model.init_seed", "created with init_seed = 0, not 1"),
        (["--model.init-preset", "small"], "model.init_preset", "created with init_preset = 'tiny', not 'small'"),
        (["--sft.args.max-steps", "5"], "sft.args.max_steps", "trained with max_steps = 2, not 5"),
        (["--sft.args.optim.lr", "0.5"], "sft.args.optim.lr", "not 0.5"),
        (["--sft.args.data.num-examples", "64"], "sft.args.data.num_examples", "not 64"),
    ],
)
def test_a_base_model_or_warm_up_unlike_the_one_made_is_refused_not_ignored(tmp_path, argv, key, said):
    # neither is made again once it exists: a re-run asking for another preset, seed or SFT went on silently from
    # the old ones (before RL trained a step too, which refuse_changed_run_keys leaves free)
    out = tmp_path / "run"
    made(out, *SFT_ARGS)
    with pytest.raises(ConfigError) as e:
        validate(out, *SFT_ARGS, *argv)
    assert str(e.value).startswith(f"config key '{key}':") and said in str(e.value), e.value
    assert "--fresh" in str(e.value)
    validate(out, *SFT_ARGS, *argv, "--fresh")  # starting over takes any
    validate(out, *SFT_ARGS, "--sft.args.log.level", "DEBUG", "--sft.args.ckpt.interval", "1")  # not the result's


def stopped_half_way(out: Path, *argv: str) -> None:
    """`out` as a launch of `gyre rl @ ci.toml *argv` left it when stopped (Ctrl-C) during its SFT warm-up: the SFT
    checkpoint of step 1 written on the stop, no result in `sft/`."""
    made(out, *argv)
    shutil.rmtree(out / "sft")
    (out / "checkpoints" / "sft" / "step_1").mkdir(parents=True)
    (out / "checkpoints" / "sft" / "step_1" / "progress.json").write_text("{}")


@pytest.mark.parametrize(
    ("argv", "key", "said"),
    [
        (["--sft.args.optim.lr", "0.5"], "sft.args.optim.lr", "trained with optim.lr = 0.001, not 0.5"),
        (["--sft.args.data.seq-len", "64"], "sft.args.data.seq_len", "trained with data.seq_len = 128, not 64"),
        (["--sft.args.data.env", "arithmetic"], "sft.args.data.env", "not 'arithmetic'"),
        (["--model.name", "OTHER"], "model.name", "was trained from"),
    ],
)
def test_a_warm_up_stopped_half_way_is_not_resumed_with_other_settings(tmp_path, argv, key, said):
    # the re-run resumed the SFT checkpoint with the new settings: a warm-up of steps from two configs (or two base
    # models), recorded as the second
    out, other = tmp_path / "run", tmp_path / "other"  # another base model of the same shape
    stopped_half_way(out, *SFT_ARGS)
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_text("")
    argv = [str(other) if arg == "OTHER" else arg for arg in argv]
    with pytest.raises(ConfigError) as e:
        validate(out, *SFT_ARGS, *argv)
    assert str(e.value).startswith(f"config key '{key}':") and said in str(e.value), e.value
    assert "stopped half way" in str(e.value) and "--sft.args.ckpt.resume-step 0" in str(e.value)
    validate(out, *SFT_ARGS, *argv[:2], "--sft.args.ckpt.resume-step", "0")  # trained again from the base: any
    validate(out, *SFT_ARGS, "--sft.args.max-steps", "5")  # how far it goes: `gyre sft`'s larger --max-steps


def test_a_warm_up_without_a_checkpoint_starts_again_with_any_settings(tmp_path):
    out = tmp_path / "run"
    stopped_half_way(out, *SFT_ARGS)
    shutil.rmtree(out / "checkpoints" / "sft" / "step_1")
    validate(out, *SFT_ARGS, "--sft.args.optim.lr", "0.5")


def test_a_warm_up_that_cannot_resume_as_asked_is_refused_before_anything_starts(tmp_path):
    # gyre sft refused these only once gyre rl had started Redis (the run failed: "sft failed with status 2")
    out = tmp_path / "run"
    stopped_half_way(out, *SFT_ARGS)
    (out / "checkpoints" / "sft" / "step_1").rename(out / "checkpoints" / "sft" / "step_3")  # past max_steps 2
    for argv, key, said in [
        ([], "sft.args.max_steps", "training resumes from checkpoint step 3 in"),
        (["--sft.args.ckpt.resume-step", "1"], "sft.args.ckpt.resume_step", "no SFT checkpoint of step 1 in"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(out, *SFT_ARGS, *argv)
        assert str(e.value).startswith(f"config key '{key}': {said}"), e.value
    validate(out, *SFT_ARGS, "--sft.args.max-steps", "4")
    validate(out, *SFT_ARGS, "--sft.args.ckpt.resume-step", "0")  # from the base model


def test_a_warm_ups_model_by_name_keeps_the_runs_dtype(tmp_path, monkeypatch):
    # `[sft.args] model = "x"` replaced the model table gyre rl gives the warm-up ({name, dtype}): it trained at dtype
    # auto, not the run's model.dtype, silently
    from gyre.config.trainer import SFTConfig
    from gyre.local import preflight

    seen, load = [], preflight.load_config
    monkeypatch.setattr(preflight, "load_config", lambda cls, *a, **kw: seen.append(load(cls, *a, **kw)) or seen[-1])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_text("")
    args = json.dumps({"model": str(other), "max_steps": 2, "data": {"env": "reverse_text", "seq_len": 128}})
    with contextlib.suppress(ConfigError):  # what the rest of the check says of this folder is not this test's
        validate(tmp_path / "out", "--model.dtype", "bfloat16", "--sft.args", args)
    (sft,) = [c for c in seen if isinstance(c, SFTConfig)]
    assert (sft.model.name, sft.model.dtype) == (str(other), "bfloat16")


def test_two_folders_with_one_run_id_on_one_redis_are_refused_and_fresh_takes_the_id_over(tmp_path):
    # two experiments started side by side with one run_id (the default, a copied file) on a shared Redis both found
    # its stream empty, and each trainer trained the other's batches
    from gyre.local.launcher import Launcher
    from gyre.local.preflight import claim_run_ids
    from gyre.redis_server import EmbeddedRedis

    with EmbeddedRedis() as redis:
        url = ["--redis.url", redis.url]
        first = Launcher(load_config(RLConfig, [*CI, *url, "--output-dir", str(tmp_path / "a")]))
        first.validate()
        claim_run_ids(first.cfg, redis.url)  # what its launch does under its lock
        with redis.client() as client:
            assert client.get("gyre:ci:owner").decode().endswith(str((tmp_path / "a").resolve()))
        with pytest.raises(ConfigError, match=r"^config key 'run_id': run_id 'ci' on the Redis of redis.url belongs "
                           r"to the run in .*/a \(its stream gyre:ci:batches\).*Choose another run_id"):  # fmt: skip
            validate(tmp_path / "b", *url)
        validate(tmp_path / "b", *url, "--run-id", "other")  # another id: its own stream
        first.validate()  # its own re-run
        # a launch that passed its check at the same moment as another loses the claim under its lock
        second = Launcher(load_config(RLConfig, [*CI, *url, "--output-dir", str(tmp_path / "b")]))
        with pytest.raises(ConfigError, match=r"^config key 'run_id'"):
            claim_run_ids(second.cfg, redis.url)
        # --fresh takes the id over (it deletes that run's batches, as it says); then the first is the other one
        fresh = Launcher(load_config(RLConfig, [*CI, *url, "--output-dir", str(tmp_path / "b"), "--fresh"]))
        fresh.validate()
        claim_run_ids(fresh.cfg, redis.url)
        with pytest.raises(ConfigError, match=r"belongs to the run in .*/b "):
            first.validate()


def test_a_run_folder_moved_or_renamed_is_the_same_run(tmp_path):
    # `mv outputs/a outputs/b`: its created base model (and SFT result) moved with it, and the re-run was refused as
    # "trained from outputs/a/model, this launch would load outputs/b/model"
    sft = ["--sft.args", '{"data": {"fake": true}}']
    launched(tmp_path / "a", *sft)
    (tmp_path / "a" / "sft").mkdir()
    (tmp_path / "a" / "sft" / "config.json").write_text("{}")
    from gyre.config.trainer import SFTConfig

    a = tmp_path / "a"
    argv = ["--model.name", str(a / "model"), "--data.fake", "--output-dir", str(a), "--save-dir", str(a / "sft")]
    (a / "configs" / "sft.toml").write_text(to_toml(load_config(SFTConfig, argv)))
    (tmp_path / "a").rename(tmp_path / "b")
    validate(tmp_path / "b", *sft, "--max-steps", "9")
    with pytest.raises(ConfigError, match=r"^config key 'model.name': the SFT warm-up in .*/b/sft was trained from "
                       r".*/b/model, not .*configs"):  # fmt: skip
        validate(tmp_path / "b", *sft, "--model.name", str(ROOT / "configs"))
    launched(tmp_path / "c")
    (tmp_path / "c").rename(tmp_path / "d")
    validate(tmp_path / "d")
    with pytest.raises(ConfigError, match=r"^config key 'model.name': .* trained from .*/d/model"):
        validate(tmp_path / "d", "--model.name", str(ROOT / "configs"))
