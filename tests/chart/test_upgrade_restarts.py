"""What a `helm upgrade` restarts: a pod is replaced when something it runs with changes, and only then.

Kubernetes replaces a workload's pods when its pod template changes; the chart's annotations
(`checksum/experiment`, the trainer's `gyre.dev/trainer-job`) are part of the template. Each test renders
the values before and after an upgrade and compares the templates."""

from __future__ import annotations

import pytest
from chart_testlib import manifests, pod_templates, render

SEED = {"secrets": {"seed": "s" * 40}}  # the same Secret in every render


def templates(values: dict) -> dict[str, dict]:
    """component -> pod template of the release's workloads (the `helm test` pod is made anew each run)."""
    pods = pod_templates(manifests(render({**SEED, **values})))
    return {comp: pod for comp, pod in pods.items() if comp != "test"}


@pytest.mark.parametrize("nnodes", [1, 2])
def test_toggling_the_trainer_budget_for_a_drain_replaces_no_pod(nnodes):
    """docs/kubernetes.md, "Draining a trainer node": `--set trainer.pdb.enabled=false` lets a drain through
    without restarting anything; the budget is no part of a pod, so no template may change (before, the
    trainer's job hash covered it: the single trainer pod was replaced, killing the step in flight, and a
    multi-node pod recreated later would wait at a rendezvous id its peers do not have)."""
    trainer = {"nnodes": nnodes, "gpusPerNode": 8}
    on = templates({"trainer": trainer})
    off = templates({"trainer": {**trainer, "pdb": {"enabled": False}}})
    assert off == on


def changed(before: dict, after: dict) -> set[str]:
    old, new = templates(before), templates(after)
    assert set(old) == set(new)
    return {comp for comp in old if old[comp] != new[comp]}


GYRE = {"inference", "orchestrator", "trainer"}


@pytest.mark.parametrize(
    ("before", "after", "restarted"),
    [
        # more replicas: the orchestrator's derived max_concurrency grows; the trainer and the running
        # replicas read nothing of it (before, every pod restarted, the trainer's step in flight killed)
        ({"inference": {"replicas": 2}}, {"inference": {"replicas": 4}}, {"orchestrator"}),
        ({"experiment": {"orchestrator": {"batch_size": 8}}}, {"experiment": {"orchestrator": {"batch_size": 16}}},
         {"orchestrator"}),
        ({"experiment": {"trainer": {"optim": {"lr": 1e-5}}}}, {"experiment": {"trainer": {"optim": {"lr": 1e-6}}}},
         {"trainer"}),
        ({"experiment": {"inference": {"engine": {"max_model_len": 2048}}}},
         {"experiment": {"inference": {"engine": {"max_model_len": 4096}}}}, {"inference"}),
        # shared keys reach every service
        ({"experiment": {"max_steps": 100}}, {"experiment": {"max_steps": 200}}, GYRE),
        ({"experiment": {"log": {"level": "INFO"}}}, {"experiment": {"log": {"level": "DEBUG"}}}, GYRE),
    ],
)  # fmt: skip
def test_an_experiment_change_restarts_the_services_that_read_it(before, after, restarted):
    assert changed(before, after) == restarted


def test_a_multi_node_trainer_job_changes_identity_with_its_runs():
    """The rendezvous id ends with the job hash: pods trained on other runs must never join the old job."""
    base = {"trainer": {"nnodes": 2}, "experiment": {"trainer": {"lora": {"rank": 8}}}}

    def job(runs):
        return templates({**base, "runs": runs})["trainer"]["metadata"]["annotations"]["gyre.dev/trainer-job"]

    assert job([{"name": "alpha"}]) != job([{"name": "alpha"}, {"name": "beta"}])
    assert job([{"name": "alpha"}]) == job([{"name": "alpha"}])
    # a run's orchestrator-only keys are no part of the trainer job: a new seed restarts that orchestrator alone
    assert job([{"name": "alpha", "orchestrator": {"seed": 1}}]) == job(
        [{"name": "alpha", "orchestrator": {"seed": 2}}]
    )


# Values added in chart 0.6.0. `helm upgrade --reuse-values` renders the new chart with the previous release's
# values in place of its values.yaml (Helm swaps the chart's defaults for the old ones), so an upgrade from 0.5.0
# sees none of these keys: the templates must read them absent as their default.
NEW_IN_0_6 = [
    ("commonLabels",),
    ("initResources",),
    *[("tests", key) for key in ("resources", "podAnnotations", "podLabels")],
    *[(component, "topologySpreadConstraints") for component in ("inference", "orchestrator", "trainer", "redis")],
]


def test_an_upgrade_with_reuse_values_from_the_previous_chart_renders_as_the_defaults(tmp_path):
    import shutil

    import yaml
    from chart_testlib import CHART

    old = tmp_path / "gyre"
    shutil.copytree(CHART, old)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in NEW_IN_0_6:
        parent = values
        for key in path[:-1]:
            parent = parent[key]
        assert path[-1] in parent, path  # still a value of the chart (else this list is stale)
        del parent[path[-1]]
    (old / "values.yaml").write_text(yaml.safe_dump(values))
    reused = {c: p for c, p in pod_templates(manifests(render(SEED, chart=old))).items() if c != "test"}
    assert reused == templates({})
