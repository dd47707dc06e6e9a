"""`helm upgrade` values the cluster cannot apply are refused before anything changes, naming the value and
what to do instead. Before, the API server refused the Redis StatefulSet (a volume claim template never
changes) or the shared claim (access modes and class never change, the size never shrinks) halfway through
the upgrade, with a message naming no value. The tests play the live objects (chart_testlib.render_live)."""

from __future__ import annotations

import helm_python
import pytest
from chart_testlib import manifests, named, render, render_live

SEED = {"secrets": {"seed": "s" * 40}}


def live_objects(values: dict) -> dict[str, dict]:
    """What the cluster holds after installing `values`: the Redis StatefulSet, the claims, the experiment file."""
    docs = manifests(render({**SEED, **values}))
    found = {}
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "PersistentVolumeClaim") or doc["metadata"]["name"] == "exp-gyre-experiment":
            found[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return found


@pytest.mark.parametrize(
    ("installed", "upgraded", "message"),
    [
        ({}, {"redis": {"persistence": {"size": "16Gi"}}},
         r"redis.persistence.size: 16Gi, but StatefulSet exp-gyre-redis was created with 8Gi; grow the claim itself "
         r"\(`kubectl -n rl patch pvc redis-data-exp-gyre-redis-0 .*--cascade=orphan"),
        ({}, {"redis": {"persistence": {"enabled": False}}},
         "redis.persistence.enabled: false, but StatefulSet exp-gyre-redis was created with it true"),
        ({"redis": {"persistence": {"enabled": False}}}, {},
         "redis.persistence.enabled: true, but StatefulSet exp-gyre-redis was created with it false"),
        ({"redis": {"persistence": {"storageClass": "fast"}}}, {"redis": {"persistence": {"storageClass": "slow"}}},
         'redis.persistence.storageClass: "slow", but StatefulSet exp-gyre-redis was created with "fast"'),
        ({}, {"persistence": {"accessMode": "ReadWriteOnce"}},
         "persistence.accessMode: ReadWriteOnce, but PersistentVolumeClaim exp-gyre-data was created ReadWriteMany"),
        ({"persistence": {"storageClass": "nfs"}}, {"persistence": {"storageClass": "efs"}},
         'persistence.storageClass: "efs", but PersistentVolumeClaim exp-gyre-data was created with "nfs"'),
        ({}, {"persistence": {"size": "50Gi"}},
         "persistence.size: 50Gi, but PersistentVolumeClaim exp-gyre-data already holds 100Gi and a claim "
         "never shrinks"),
        ({"modelCache": {"type": "pvc"}}, {"modelCache": {"type": "pvc", "size": "10Gi"}},
         "modelCache.size: 10Gi, but PersistentVolumeClaim exp-gyre-model-cache already holds 20Gi"),
    ],
)  # fmt: skip
def test_an_upgrade_the_cluster_cannot_apply_is_refused_naming_the_value(tmp_path, installed, upgraded, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render_live({**SEED, **upgraded}, live_objects(installed), tmp_path)


@pytest.mark.parametrize(
    "upgraded",
    [
        {},  # the same values
        {"persistence": {"size": "200Gi"}},  # a claim grows (if its class allows expansion)
        {"redis": {"maxmemory": "1gb"}, "inference": {"replicas": 3}},  # anything in the pod templates
        {"persistence": {"existingClaim": "elsewhere"}},  # the chart's claim is no longer used
    ],
)
def test_upgrades_the_cluster_can_apply_render(tmp_path, upgraded):
    docs = manifests(render_live({**SEED, **upgraded}, live_objects({}), tmp_path))
    assert named(docs, "StatefulSet", "exp-gyre-redis")


def test_a_live_claim_of_the_default_class_accepts_an_unset_class(tmp_path):
    # the cluster writes its default class into a claim created without one: unset still means "as it is"
    live = live_objects({})
    live["PersistentVolumeClaim/exp-gyre-data"]["spec"]["storageClassName"] = "standard"
    render_live(SEED, live, tmp_path)


def test_sizes_in_other_units_than_the_cluster_writes_them_upgrade(tmp_path):
    """The schema takes `1.5Ti` for a claim's size and the API server stores it as 1536Gi: every upgrade after
    the install failed with `cannot read "1.5Ti" as a size` (the check read whole numbers only)."""
    sizes = {"persistence": {"size": "1.5Ti"}, "redis": {"persistence": {"size": "1.5Gi"}}}
    live = live_objects(sizes)
    live["PersistentVolumeClaim/exp-gyre-data"]["spec"]["resources"]["requests"]["storage"] = "1536Gi"
    live["StatefulSet/exp-gyre-redis"]["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"][
        "storage"
    ] = "1536Mi"
    assert manifests(render_live({**SEED, **sizes}, live, tmp_path))
    with pytest.raises(helm_python.HelmError, match="persistence.size: 1.4Ti, but .* already holds 1536Gi"):
        render_live({**SEED, **sizes, "persistence": {"size": "1.4Ti"}}, live, tmp_path)
    with pytest.raises(helm_python.HelmError, match="redis.persistence.size: 2Gi, but StatefulSet exp-gyre-redis was"):
        render_live(
            {**SEED, "persistence": sizes["persistence"], "redis": {"persistence": {"size": "2Gi"}}}, live, tmp_path
        )


HUB = {"modelInit": {"enabled": False}, "experiment": {"model": {"name": "Qwen/Qwen3-0.6B"}}}
FRESH = "a release trains one run: install a new release for another (or `helm uninstall`, `kubectl -n rl delete pvc "


@pytest.mark.parametrize(
    ("installed", "upgraded", "message"),
    [
        (HUB, {**HUB, "experiment": {"model": {"name": "Qwen/Qwen3-1.7B"}}},
         'experiment.model.name: these values train "Qwen/Qwen3-1.7B", but this release\'s run trains '
         '"Qwen/Qwen3-0.6B" (ConfigMap exp-gyre-experiment), and its checkpoints'),
        ({}, {"modelInit": {"preset": "small"}},
         'modelInit: these values train "gyre model init --preset small --seed 0", but this release\'s run trains '
         '"gyre model init --preset tiny --seed 0"'),
        ({}, {"modelInit": {"seed": 1}}, "modelInit: these values train"),
        ({}, HUB, 'experiment.model.name: these values train "Qwen/Qwen3-0.6B", but this release\'s run trains '
         '"gyre model init'),
        ({}, {"experiment": {"run_id": "exp-2"}},
         'experiment.run_id: "exp-2", but this release\'s run is "exp" (ConfigMap exp-gyre-experiment)'),
    ],
)  # fmt: skip
def test_an_upgrade_that_would_change_the_runs_model_or_id_is_refused(tmp_path, installed, upgraded, message):
    """A day-two `helm upgrade` with another model (or run_id) under a running experiment: the volume holds the
    run's checkpoints and weights, which the restarted trainer resumed (the old model's weights under the new
    name; a new modelInit was ignored outright). Refused before anything is applied, with what to do instead."""
    with pytest.raises(helm_python.HelmError) as caught:
        render_live({**SEED, **upgraded}, live_objects(installed), tmp_path)
    assert message in str(caught.value), str(caught.value)
    assert FRESH + "exp-gyre-data` and install again" in str(caught.value)


@pytest.mark.parametrize(
    "upgraded",
    [
        {"experiment": {"trainer": {"optim": {"lr": 1e-5}}, "max_steps": 400}},  # a trainer setting, more steps
        {"inference": {"replicas": 3, "resources": {"requests": {"cpu": "4"}}}},
        {"experiment": {"model": {"dtype": "float32"}}},  # another setting of the same model
    ],
)
def test_upgrades_of_the_same_run_render(tmp_path, upgraded):
    render_live({**SEED, **upgraded}, live_objects({}), tmp_path)


def test_a_release_of_an_older_chart_upgrades_and_records_its_run(tmp_path):
    """An experiment ConfigMap and claim without the record (an older chart's) have nothing to compare: the
    upgrade goes through and records the run's id and model for the next one."""
    live = live_objects({})
    del live["ConfigMap/exp-gyre-experiment"]["metadata"]["annotations"]
    live["PersistentVolumeClaim/exp-gyre-data"]["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    docs = manifests(render_live({**SEED, "modelInit": {"preset": "small"}}, live, tmp_path))
    record = {"gyre.dev/run-id": "exp", "gyre.dev/model": "gyre model init --preset small --seed 0",
              "gyre.dev/claim": "exp-gyre-data"}  # fmt: skip
    assert named(docs, "ConfigMap", "exp-gyre-experiment")["metadata"]["annotations"] == record
    assert named(docs, "PersistentVolumeClaim", "exp-gyre-data")["metadata"]["annotations"] == {
        "helm.sh/resource-policy": "keep", **record}  # fmt: skip


def test_a_new_install_on_the_kept_volume_of_another_model_is_refused(tmp_path):
    """`helm uninstall` keeps the shared volume (persistence.keep) and removes the ConfigMap: installing the release
    again with another model resumed the old run's weights under it. The claim's record refuses it; the same model
    resumes the run, and another release (another claim) starts its own."""
    kept = {k: v for k, v in live_objects(HUB).items() if k == "PersistentVolumeClaim/exp-gyre-data"}
    other = {**HUB, "experiment": {"model": {"name": "Qwen/Qwen3-1.7B"}}}
    with pytest.raises(helm_python.HelmError) as caught:
        render_live({**SEED, **other}, kept, tmp_path)
    assert 'but this release\'s run trains "Qwen/Qwen3-0.6B" (PersistentVolumeClaim exp-gyre-data)' in str(caught.value)
    assert manifests(render_live({**SEED, **HUB}, kept, tmp_path))
    assert manifests(render_live({**SEED, **other}, kept, tmp_path, name="exp2"))


def test_a_second_release_on_a_claim_another_release_uses_is_refused(tmp_path):
    """`persistence.existingClaim` (a team volume) is mounted at its root as every service's output_dir: a second
    release on it published weights and checkpoints over the first's step by step, and each resumed the other's run.
    The experiment ConfigMaps of the namespace (the claim's) say which claim each release writes to."""
    first = manifests(render({**SEED, "persistence": {"existingClaim": "team-vol"}}, name="alpha"))
    alpha = named(first, "ConfigMap", "alpha-gyre-experiment")
    assert alpha["metadata"]["annotations"]["gyre.dev/claim"] == "team-vol"
    created = named(manifests(render(SEED, name="beta")), "ConfigMap", "beta-gyre-experiment")
    live = {"ConfigMap/": {"items": [alpha, created]}, "ConfigMap/alpha-gyre-experiment": alpha}
    with pytest.raises(helm_python.HelmError) as caught:
        render_live({**SEED, "persistence": {"existingClaim": "team-vol"}}, live, tmp_path, name="gamma")
    assert ('persistence.existingClaim: "team-vol" is already the shared volume of release "alpha" (ConfigMap '
            'alpha-gyre-experiment, run "alpha")') in str(caught.value)  # fmt: skip
    with pytest.raises(helm_python.HelmError, match='shared volume of release "beta"'):  # a claim the chart made
        render_live({**SEED, "persistence": {"existingClaim": "beta-gyre-data"}}, live, tmp_path, name="gamma")
    # the release itself upgrades on its claim; another claim is free
    assert manifests(render_live({**SEED, "persistence": {"existingClaim": "team-vol"}}, live, tmp_path, name="alpha"))
    assert manifests(render_live({**SEED, "persistence": {"existingClaim": "other-vol"}}, live, tmp_path, name="gamma"))
