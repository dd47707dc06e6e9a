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
