"""`gyre rl` with `[[runs]]` end to end: two runs on one trainer and one inference server.

configs/multirun/two_runs.toml cut down (no SFT, 3 and 2 steps, checkpoints kept), with run "beta" on its own mix of
environments: every run trains exactly its own steps into its own folder on its own environments, publishes its
adapter alone, and its orchestrator brought the replica's adapter of that run (and only that run) to the final
version; a re-run of a finished experiment does nothing; `gyre export --run` writes a run's checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.events import read_events
from gyre.weights import WeightStore

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/multirun/two_runs.toml"
BETA_MIX = [{"name": "reverse_text", "ratio": 1}, {"name": "arithmetic", "label": "math", "ratio": 1}]
RUNS = [
    {"name": "alpha"},
    {"name": "beta", "max_steps": 2, "trainer": {"lora": {"rank": 8, "alpha": 16}}, "orchestrator": {"env": BETA_MIX}},
]
pytestmark = pytest.mark.slow


def gyre(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre.cli", *args], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)  # fmt: skip


def gyre_rl(out: Path) -> subprocess.CompletedProcess:
    return gyre("rl", "@", str(CONFIG), "--output-dir", str(out), "--sft.enabled", "false", "--max-steps", "3",
                "--runs", json.dumps(RUNS), "--orchestrator.eval.interval", "null", "--ckpt")  # fmt: skip


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    out = tmp_path_factory.mktemp("multirun") / "multi"
    res = gyre_rl(out)
    assert res.returncode == 0, res.stderr[-4000:]
    return out, res


def test_two_runs_share_one_trainer_and_one_replica(experiment):
    out, _ = experiment
    for name, steps in (("alpha", 3), ("beta", 2)):
        run = out / "runs" / name
        assert [r["step"] for r in read_events(run / "events" / "trainer_steps.jsonl")] == list(range(1, steps + 1))
        assert [r["step"] for r in read_events(run / "events" / "orchestrator_steps.jsonl")] == list(
            range(1, steps + 1)
        )
        store = WeightStore(run / "weights")
        assert store.latest() == steps
        assert sorted(p.name for p in store.path(steps).iterdir() if p.suffix != ".json") == [
            "adapter_model.safetensors"
        ]
        relayed = read_events(run / "events" / "weight_relay.jsonl")
        assert relayed and all(r["ok"] for r in relayed) and max(r["step"] for r in relayed) == steps
    assert not (out / "weights").exists()  # nothing is published outside the runs' folders
    again = gyre_rl(out)
    assert again.returncode == 0 and "already finished" in again.stdout


def test_each_run_trains_on_its_own_environments_and_reports_each(experiment):
    out, res = experiment
    alpha = read_events(out / "runs/alpha/events/orchestrator_steps.jsonl")
    beta = read_events(out / "runs/beta/events/orchestrator_steps.jsonl")
    assert {p["env"] for p in alpha} == {"reverse_text"} and all(set(p["envs"]) == {"reverse_text"} for p in alpha)
    assert {p["env"] for p in beta} == {"reverse_text,math"} and all(set(p["envs"]) == {"reverse_text", "math"}
                                                                      for p in beta)  # fmt: skip
    # beta drew groups of both entries (a 1:1 mix, 8 groups a step); each sample it dumped names its entry
    assert all(p["envs"][label]["generated_groups"] > 0 for p in beta for label in ("reverse_text", "math"))
    from gyre.rollouts import read_dump

    assert {r["env"] for r in read_dump(out / "runs/beta", 1)} <= {"reverse_text", "math"}
    assert {r["env"] for r in read_dump(out / "runs/alpha", 1)} == {"reverse_text"}
    # the closing summary has beta's reward per entry, alpha's none
    beta_summary = res.stdout[res.stdout.index("run beta:") :]
    alpha_summary = res.stdout[res.stdout.index("run alpha:") : res.stdout.index("run beta:")]
    assert "  reverse_text " in beta_summary and "  math " in beta_summary
    assert "  math " not in alpha_summary
    assert "(OpenAI API; model 'alpha', 'beta')" in res.stdout  # the replica serves each run's adapter by its name


def test_gyre_export_writes_a_runs_checkpoint_with_its_own_adapter(experiment, tmp_path):
    # the export refused every multi-run experiment: its trainer config has trainer.runs, its checkpoints are the runs'
    from gyre.lora import merge, split_lora
    from safetensors.torch import load_file

    out, _ = experiment
    refused = gyre("export", str(out), "--to", str(tmp_path / "none"))
    assert refused.returncode == 2 and "name the run to export with --run (alpha, beta)" in refused.stderr
    assert not (tmp_path / "none").exists()

    for name, args in (("beta", [str(out), "--run", "beta"]), ("alpha", [str(out / "runs/alpha")])):  # or its folder
        to = tmp_path / name
        res = gyre("export", *args, "--step", "2", "--to", str(to))
        assert res.returncode == 0, res.stderr[-4000:]
        # its adapter is the one the run published at that step; the weights are the base with it merged
        adapter, published = (
            load_file(to / "lora/adapter_model.safetensors"),
            load_file(out / "runs" / name / "weights/step_2/adapter_model.safetensors"),
        )
        assert adapter.keys() == published.keys() and all((adapter[k] == published[k]).all() for k in published)
        config = json.loads((to / "lora/adapter_config.json").read_text())
        assert config["r"] == (8 if name == "beta" else 16)
        base, _ = split_lora(load_file(out / "model/model.safetensors"))
        _, pairs = split_lora(adapter)
        expected = merge(base, pairs, config["lora_alpha"] / config["r"])
        got = load_file(to / "model.safetensors")
        assert got.keys() == expected.keys() and all((got[k] - expected[k]).abs().max() < 1e-6 for k in expected), (
            f"{name}: the merged weights are not base + its adapter"
        )
        assert json.loads((to / "gyre_step.json").read_text())["step"] == 2
