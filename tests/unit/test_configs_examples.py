"""Every example under configs/ is a valid experiment: it parses and every service section resolves."""

from __future__ import annotations

from pathlib import Path

import pytest
from gyre.config import load_config
from gyre.config.rl import RLConfig
from gyre.local.runs import resolve_configs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "configs").rglob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_resolves(path, tmp_path):
    files = ["@", str(path)]
    if path.name.startswith("async"):  # overlays of the demo
        files = ["@", str(ROOT / "configs/reverse_text/demo.toml"), *files]
    cfg = load_config(RLConfig, [*files, "--output-dir", str(tmp_path)])
    resolved = resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
    if cfg.runs:  # multi-run: each run's own max_steps, in its trainer entry and its orchestrator
        for run in resolved.trainer.runs:
            assert run.max_steps == resolved.orchestrators[run.name].max_steps
        assert set(resolved.inference[0].lora.adapters) == {r.name for r in cfg.runs}
    else:
        assert resolved.trainer.max_steps == cfg.max_steps == resolved.orchestrator.max_steps
    assert resolved.orchestrator.batch.seq_len == resolved.trainer.data.seq_len
    assert len(resolved.inference) == cfg.inference_replicas


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_passes_the_launchers_whole_check(path, tmp_path, monkeypatch):
    """What `gyre rl @ example` checks before it starts anything (`Launcher.validate`), beyond the service sections:
    [sft.args] (a typo there passed test_example_resolves and stopped the run after Redis had started), environment
    and extension names, [[servers]], a model.init_preset outside output_dir (configs/gpu/one-gpu-torch.toml was
    refused on a fresh checkout). Run from a folder of its own (its outputs/ there, its data files linked); the model
    source alone is not checked: a hub id would be fetched."""
    import gyre.local.launcher as launcher
    from gyre.local import preflight

    monkeypatch.chdir(tmp_path)
    for shipped in ("configs", "tests"):  # data files: configs/dataset/data, tests/unit/envs/data
        (tmp_path / shipped).symlink_to(ROOT / shipped)
    monkeypatch.setattr(preflight, "check_model", lambda *args, **how: None)
    files = ["@", str(path)]
    if path.name.startswith("async"):  # overlays of the demo
        files = ["@", str(ROOT / "configs/reverse_text/demo.toml"), *files]
    launcher.Launcher(load_config(RLConfig, files)).validate()
    assert not (tmp_path / "outputs").exists()  # it creates nothing


def test_multirun_replicas_get_one_adapter_per_run_or_two_on_vllm(tmp_path):
    """gyre rl [[runs]]: lora.max_loras = runs (torch: swaps in place), 2 x runs on vLLM (a request keeps its
    adapter version, so a run's two versions overlap after a swap); lora.max_rank = the largest run rank."""
    example = ["@", str(ROOT / "configs/multirun/two_runs.toml"), "--output-dir", str(tmp_path)]
    for backend, per_run in (("torch", 1), ("vllm", 2)):
        cfg = load_config(RLConfig, [*example, "--inference.backend", backend])
        resolved = resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
        ranks = [(r.lora or resolved.trainer.lora).rank for r in resolved.trainer.runs]
        for replica in resolved.inference:
            assert (replica.backend, replica.lora.max_loras) == (backend, per_run * len(cfg.runs))
            assert replica.lora.max_rank == max(ranks)


def test_a_single_run_publishing_adapters_to_vllm_gets_lora_turned_on(tmp_path):
    """gyre rl, one run, trainer.lora.publish = adapter: the vLLM replicas start with LoRA on (max_loras 2, the
    trainer's rank); merged publishing or the torch backend change nothing, and a user's own value wins."""
    demo = ["@", str(ROOT / "configs/reverse_text/demo.toml"), "@", str(ROOT / "configs/reverse_text/lora.toml"),
            "--output-dir", str(tmp_path), "--trainer.lora.rank", "8"]  # fmt: skip

    def served(*argv):
        cfg = load_config(RLConfig, [*demo, *argv])
        return resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0").inference[0].lora

    adapter, vllm = ("--trainer.lora.publish", "adapter"), ("--inference.backend", "vllm")
    lora = served(*adapter, *vllm)
    assert (lora.max_loras, lora.max_rank) == (2, 8)
    assert served(*adapter).max_loras == 0  # torch: merged into the weights, no slots needed
    assert served(*vllm).max_loras == 0  # merged versions: full weights
    assert served(*adapter, *vllm, "--inference.lora.max-loras", "4").max_loras == 4


def test_async_overlays_set_the_level():
    for k in (0, 1, 2):
        cfg = load_config(RLConfig, ["@", str(ROOT / f"configs/reverse_text/async{k}.toml")])
        assert cfg.orchestrator["max_async_level"] == k


LEARNING = sorted((ROOT / "configs/dataset").glob("*.toml")) + sorted((ROOT / "configs/reasoning_gym").glob("*.toml"))


@pytest.mark.parametrize("path", LEARNING, ids=lambda p: str(p.relative_to(ROOT)))
def test_learning_configs_load_their_environments(path, tmp_path, monkeypatch):
    """The env and the SFT warm-up's env load from the repository root (data files ship), and the eval split
    holds every example the config evaluates, so the measured before/after covers what docs/environments.md says."""
    from gyre.envs import load_environment

    monkeypatch.chdir(ROOT)
    cfg = load_config(RLConfig, ["@", str(path), "--output-dir", str(tmp_path)])
    orchestrator = resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0").orchestrator
    env = load_environment(orchestrator.env.name, **orchestrator.env.args)
    assert env.tasks("eval").size >= orchestrator.eval.num_examples
    assert env.tasks("train")[0].answer
    sft = cfg.sft.args["data"]
    sft_env = load_environment(sft["env"], **sft.get("env_args", {}))
    assert sft_env.sft_example(sft_env.tasks("train")[0])


def test_a_runs_own_resume_step_rewinds_its_orchestrator_too(tmp_path):
    """gyre rl [[runs]] trainer = {resume_step = N} (docs/local.md) reached the trainer alone: it rewound the run,
    deleting its newer checkpoints and weights, while the run's orchestrator resumed after the abandoned batches the
    stream still held and the trainer waited for step N+1 forever."""
    example = ["@", str(ROOT / "configs/multirun/two_runs.toml"), "--output-dir", str(tmp_path)]
    runs = '[{name = "alpha", trainer = {resume_step = 4}}, {name = "beta"}]'
    for argv, alpha, beta in (((), None, None), (("--runs", runs), 4, None),
                              (("--runs", runs, "--ckpt.resume-step", "2"), 4, 2)):  # fmt: skip
        cfg = load_config(RLConfig, [*example, *argv])
        orchestrators = resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0").orchestrators
        assert (orchestrators["alpha"].resume_step, orchestrators["beta"].resume_step) == (alpha, beta)
