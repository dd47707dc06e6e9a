"""Values that must agree with each other fail `helm install` naming the key (templates/validate.yaml), and
NOTES.txt says what each workload really runs on."""

from __future__ import annotations

import helm_python
import pytest
from chart_testlib import load_values, render


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # two Deployments and Services of one name: the second silently replaced the first at apply
        ({"servers": [{"name": "judge", "model": "org/a"}, {"name": "judge", "model": "org/b"}]},
         r'servers\[1\].name "judge": servers\[0\] has that name already'),
        ({"experiment": {"trainer": {"lora": {"rank": 8}}}, "runs": [{"name": "alpha"}, {"name": "alpha"}]},
         r'runs\[1\].name "alpha": runs\[0\] has that name already'),
        # one port twice in a pod: the API server refuses the pod, or the second server cannot bind
        ({"inference": {"httpPort": 9100}}, "inference.httpPort and inference.metricsPort are both 9100"),
        ({"orchestrator": {"metricsPort": 50061}}, "orchestrator.grpcPort and orchestrator.metricsPort are both 50061"),
        ({"trainer": {"healthPort": 9101}}, "trainer.healthPort and trainer.metricsPort are both 9101"),
        ({"servers": [{"name": "rm", "model": "org/rm", "metricsPort": 8000}]},
         r"servers\[0\].httpPort and servers\[0\].metricsPort are both 8000"),
        # the shared volume over the root, the secrets or a scratch folder: an invalid pod, or one missing its files
        ({"persistence": {"mountPath": "/"}}, 'persistence.mountPath "/": the pods already mount /etc/gyre there'),
        ({"persistence": {"mountPath": "/tmp"}}, 'persistence.mountPath "/tmp": the pods already mount /tmp there'),
        ({"persistence": {"mountPath": "/run"}},
         'persistence.mountPath "/run": the pods already mount /run/secrets/gyre'),
        ({"persistence": {"mountPath": "/cache/data"}},
         'persistence.mountPath "/cache/data": the pods already mount /cache'),
    ],
)  # fmt: skip
def test_values_that_disagree_are_refused_naming_the_key(values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def test_distinct_names_and_ports_render():
    render({"persistence": {"mountPath": "/mnt/shared"}})
    render({"persistence": {"mountPath": "/datasets"}})  # a name that merely starts like /data's neighbours
    render({"servers": [{"name": "judge", "model": "org/a"}, {"name": "rm", "model": "org/b", "metricsPort": 9200}]})
    render({"experiment": {"trainer": {"lora": {"rank": 8}}}, "runs": [{"name": "alpha"}, {"name": "beta"}]})


def test_notes_say_what_each_workload_runs_on():
    notes = render(
        {
            "inference": {"gpus": 0},
            "trainer": {"gpuResourceName": "nvidia.com/mig-3g.40gb"},
            "servers": [{"name": "judge", "model": "Qwen/Qwen3-8B"}],
        }
    )["gyre/templates/NOTES.txt"]
    # before: "(0 nvidia.com/gpu each)" for a CPU replica, the trainer's GPUs not at all, servers never named
    assert "Deployment exp-gyre-inference (on CPU)" in notes
    assert "1 pod(s) x 1 torchrun process(es) (1 nvidia.com/mig-3g.40gb each)" in notes
    # a server takes the inference component's gpus unless it sets its own
    assert "server        judge: Qwen/Qwen3-8B, 1 replica(s) of Deployment exp-gyre-server-judge (on CPU)" in notes
    multi = render(load_values("values-multi-node.yaml"))["gyre/templates/NOTES.txt"]
    assert "2 pod(s) x 8 torchrun process(es) (8 nvidia.com/gpu each)" in multi


def test_notes_warn_when_autoscaling_has_no_demand_to_read():
    """KEDA reads the demand the ServiceMonitor scrapes (its gyre_release label): without one, the replicas
    silently stayed at minReplicas."""
    from chart_testlib import KEDA_APIS, MONITORING_APIS

    autoscaled = {"inference": {"autoscaling": {"enabled": True}}}
    warning = "WARNING: inference.autoscaling.enabled without the orchestrator's ServiceMonitor"
    assert warning in render(autoscaled, api_versions=KEDA_APIS)["gyre/templates/NOTES.txt"]
    both = KEDA_APIS + MONITORING_APIS
    assert (
        warning
        in render({**autoscaled, "monitoring": {"enabled": False}}, api_versions=both)["gyre/templates/NOTES.txt"]
    )
    assert warning not in render(autoscaled, api_versions=both)["gyre/templates/NOTES.txt"]
    assumed = {**autoscaled, "assumeApiVersions": ["keda.sh/v1alpha1", "monitoring.coreos.com/v1"]}
    assert warning not in render({**assumed, "monitoring": {"enabled": True}})["gyre/templates/NOTES.txt"]
