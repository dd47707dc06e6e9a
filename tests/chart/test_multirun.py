"""The chart's `runs` value (multi-run): one orchestrator per run, one trainer training every run's
adapter, replicas serving each run's adapter by name; every rendered command loads as a service config
and the trainer's addresses are the runs' own Services. With `runs` empty nothing changes."""

from __future__ import annotations

import json

import helm_python
import pytest
from chart_testlib import fullname, manifests, named, objects, pod_templates, render, service_config
from gyre.config.trainer import RunConfig

RUNS = [
    {"name": "alpha", "maxSteps": 40},
    {"name": "beta", "trainer": {"optim": {"lr": 2e-3}, "lora": {"rank": 32, "alpha": 64}},
     "orchestrator": {"seed": 20251126, "env": {"name": "reverse_text"}, "inference": {"retries": 5}}},
]  # fmt: skip
VALUES = {"experiment": {"trainer": {"lora": {"rank": 8, "alpha": 16}}}, "runs": RUNS}


def test_each_run_gets_its_orchestrator_adapter_and_model_name(tmp_path):
    docs = manifests(render(VALUES))
    base = fullname()
    deployments = {d["metadata"]["name"] for d in objects(docs, "Deployment")}
    assert {f"{base}-orchestrator-alpha", f"{base}-orchestrator-beta"} <= deployments
    assert f"{base}-orchestrator" not in deployments
    selectors = []
    for run in ("alpha", "beta"):
        service = named(docs, "Service", f"{base}-orchestrator-{run}")
        deployment = named(docs, "Deployment", f"{base}-orchestrator-{run}")
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert deployment["spec"]["template"]["metadata"]["labels"]["gyre.dev/run"] == run
        selectors.append(service["spec"]["selector"])
    assert selectors[0] != selectors[1]  # a run's Service never reaches the other run's orchestrator

    orchestrators = {run: service_config(docs, tmp_path, "orchestrator", f"{base}-orchestrator-{run}")
                     for run in ("alpha", "beta")}  # fmt: skip
    for run, cfg in orchestrators.items():
        assert (cfg.run_id, cfg.inference.model) == (run, run)
        assert str(cfg.output_dir).endswith(f"/runs/{run}")
    # a date-like seed: Helm reads numbers as floats, which printed as "2.0251126e+07", no integer setting's value
    assert orchestrators["alpha"].max_steps == 40 and orchestrators["beta"].seed == 20251126
    assert orchestrators["beta"].inference.retries == 5  # a run's own [inference] keys keep the run's model

    trainer = service_config(docs, tmp_path, "trainer", f"{base}-trainer")
    assert [r.name for r in trainer.runs] == ["alpha", "beta"]
    port = named(docs, "Service", f"{base}-orchestrator-alpha")["spec"]["ports"][0]["port"]
    for r in trainer.runs:
        assert r.orchestrator.address.startswith(f"{base}-orchestrator-{r.name}.") and r.orchestrator.address.endswith(
            f":{port}"
        )
        assert r.output_dir == orchestrators[r.name].output_dir
    assert trainer.runs[0].max_steps == 40 and trainer.runs[1].lora.rank == 32 and trainer.runs[1].optim.lr == 2e-3

    inference = service_config(docs, tmp_path, "inference", f"{base}-inference")
    assert inference.lora.adapters == ["alpha", "beta"]
    assert (inference.lora.max_loras, inference.lora.max_rank) == (2, 32)  # one adapter per run, the largest rank

    # vLLM keeps a request on the adapter version it started with: two per run, so a swap never makes requests wait
    vllm = manifests(render({**VALUES, "experiment": {**VALUES["experiment"], "inference": {"backend": "vllm"}}}))
    inference = service_config(vllm, tmp_path, "inference", f"{base}-inference")
    assert (inference.backend, inference.lora.max_loras, inference.lora.max_rank) == ("vllm", 4, 32)


def test_one_run_publishing_adapters_to_vllm_turns_lora_on(tmp_path):
    """Not multi-run, but the same wiring: vLLM serves adapter versions only with LoRA on, so the chart passes
    lora.max_loras = 2 and the trainer's rank unless experiment.inference.lora sets them (gyre rl does the same)."""
    base = fullname()

    def served(trainer_lora: dict, inference: dict):
        values = {"experiment": {"trainer": {"lora": trainer_lora}, "inference": inference}}
        return service_config(manifests(render(values)), tmp_path, "inference", f"{base}-inference").lora

    adapter, vllm = {"rank": 8, "publish": "adapter"}, {"backend": "vllm"}
    assert (served(adapter, vllm).max_loras, served(adapter, vllm).max_rank) == (2, 8)
    assert served(adapter, {**vllm, "lora": {"max_loras": 3}}).max_loras == 3  # the user's value wins
    assert served({"rank": 8}, vllm).max_loras == 0  # merged versions are full weights
    assert served(adapter, {}).max_loras == 0  # the torch backend merges adapter versions itself


def test_without_runs_the_release_is_unchanged():
    docs = manifests(render({}))
    pods = pod_templates(docs)
    assert named(docs, "Deployment", f"{fullname()}-orchestrator")
    assert "gyre.dev/run" not in pods["orchestrator"]["metadata"]["labels"]
    for comp in ("inference", "trainer"):
        assert not any("--runs" in c.get("args", []) or "--lora.adapters" in c.get("args", [])
                       for c in pods[comp]["spec"]["containers"])  # fmt: skip
    seeded = {"secrets": {"seed": "s" * 40}}  # the same Secret in both renders
    assert json.dumps(render(seeded)) == json.dumps(render({**seeded, "runs": []}))


@pytest.mark.parametrize("bad", [[{"name": "Has.Dot"}], [{"maxSteps": 3}], [{"name": "x", "trainer": {"loss": {}}}]])
def test_bad_runs_are_refused_naming_the_key(bad):
    with pytest.raises(helm_python.HelmError, match="runs"):
        render({"runs": bad})


@pytest.mark.parametrize("name", ["a", "or", "lora"])
def test_a_run_name_inside_lora_prefix_is_refused_at_install(name):
    """The trainer's RunConfig refuses such a name (peft finds adapter tensors by "lora_"); the chart accepted
    it, so the install succeeded and the trainer pod crash-looped on its config."""
    with pytest.raises(helm_python.HelmError, match=f'runs: name "{name}" is part of "lora_"'):
        render({"runs": [{"name": "alpha"}, {"name": name}]})
    with pytest.raises(ValueError, match="lora_"):  # the trainer's own check, which the chart now mirrors
        RunConfig(name=name, output_dir="/data/runs/x")
    render({"runs": [{"name": "lora-b"}, {"name": "ab"}]})  # longer names, or ones merely sharing letters, pass
