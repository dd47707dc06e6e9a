"""The release's secrets across `helm upgrade`: generated once and kept, rotated on purpose, and every pod that
reads a rotated key restarted (the services read their secret files once, at start: a pod left running keeps
the old key and its peers, restarted with the new one, refuse it).

`lookup` answers nothing offline, so these tests play the cluster: they render a copy of the chart whose one
`lookup` (`gyre.live`, chart_testlib.render_live) answers with the Secrets given, as `helm upgrade` sees them."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest
from chart_testlib import CHART, manifests, pod_templates, render, render_live, secret_data

NAME = "exp-gyre-secrets"
KEYS = ("api-key", "control-token", "redis-password")
# which pods read which key (docs/kubernetes.md, "Secrets")
READERS = {
    "api-key": {"inference", "orchestrator"},
    "control-token": {"inference", "orchestrator", "trainer"},
    "redis-password": {"orchestrator", "trainer", "redis"},
}


@pytest.fixture
def upgrade(tmp_path):
    """render(values, live) as `helm upgrade` sees a cluster holding `live` ({Secret name: Secret object})."""

    def render_with(values: dict, live: dict[str, dict]) -> list[dict]:
        return manifests(render_live(values, {f"Secret/{name}": obj for name, obj in live.items()}, tmp_path))

    return render_with


def secret_object(data: dict[str, str], version: str = "1") -> dict:
    return {
        "metadata": {"name": NAME, "uid": "0b6c1f4e", "resourceVersion": version},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def checksums(docs: list[dict]) -> dict[str, str]:
    return {
        comp: pod["metadata"]["annotations"]["checksum/secrets"]
        for comp, pod in pod_templates(docs).items()
        if comp != "test"  # the helm test pod is made anew on every `helm test`
    }


def test_an_upgrade_keeps_the_generated_secret_and_restarts_nothing(upgrade):
    installed = manifests(render({}))
    live = secret_data(installed)[NAME]
    upgraded = upgrade({}, {NAME: secret_object(live)})
    assert secret_data(upgraded)[NAME] == live
    assert checksums(upgraded) == checksums(installed)  # the same pod templates: nothing restarts
    assert set(checksums(installed)) == {"inference", "orchestrator", "trainer", "redis"}


@pytest.mark.parametrize("key", KEYS)
def test_rotating_one_key_restarts_exactly_the_pods_that_read_it(upgrade, key):
    """docs/kubernetes.md, "Rotating secrets": patch one key of the live Secret, then `helm upgrade`."""
    live = {k: f"old-{k}-value-0123456789abcdef" for k in KEYS}
    before = upgrade({}, {NAME: secret_object(live)})
    after = upgrade({}, {NAME: secret_object({**live, key: "rotated-value-0123456789abcdef"}, version="2")})
    assert secret_data(after)[NAME][key] == "rotated-value-0123456789abcdef"
    old, new = checksums(before), checksums(after)
    assert {comp for comp in old if old[comp] != new[comp]} == READERS[key]


def test_deleting_the_secret_rotates_every_key_and_restarts_every_pod(upgrade):
    live = {k: f"old-{k}-value-0123456789abcdef" for k in KEYS}
    before = upgrade({}, {NAME: secret_object(live)})
    after = upgrade({}, {})  # `kubectl delete secret exp-gyre-secrets`, then `helm upgrade`
    fresh = secret_data(after)[NAME]
    assert all(fresh[k] != live[k] and len(fresh[k]) == 48 for k in KEYS)
    old, new = checksums(before), checksums(after)
    assert all(old[comp] != new[comp] for comp in old)


def test_a_seed_wins_over_the_live_values_and_a_new_seed_rotates(upgrade):
    live = {k: f"old-{k}-value-0123456789abcdef" for k in KEYS}
    first = upgrade({"secrets": {"seed": "a" * 40}}, {NAME: secret_object(live)})
    again = manifests(render({"secrets": {"seed": "a" * 40}}))  # `helm template`: no cluster, same result
    assert secret_data(first) == secret_data(again) and checksums(first) == checksums(again)
    rotated = upgrade({"secrets": {"seed": "b" * 40}}, {NAME: secret_object(secret_data(first)[NAME])})
    old, new = checksums(first), checksums(rotated)
    assert all(old[comp] != new[comp] for comp in old)


def test_the_checksum_is_of_the_secret_the_pods_mount():
    docs = manifests(render({}))
    data = {k: base64.b64encode(v.encode()).decode() for k, v in secret_data(docs)[NAME].items()}
    for comp, keys in (("inference", ["api-key", "control-token"]), ("redis", ["redis-password"])):
        text = "\n".join(f"{k}={data[k]}" for k in keys)
        assert checksums(docs)[comp] == hashlib.sha256(text.encode()).hexdigest(), comp


def test_an_edited_existing_secret_restarts_its_readers_without_its_data_in_the_pods(upgrade):
    """`secrets.existingSecret`: the chart never reads its data into a pod template (a checksum of a guessable
    password can be brute-forced); its resourceVersion, which every edit changes, stands for it."""
    values = {"secrets": {"existingSecret": "mine"}}
    data = {k: "hunter2" for k in KEYS}
    v1 = upgrade(
        values, {"mine": {**secret_object(data), "metadata": {"name": "mine", "uid": "u", "resourceVersion": "1"}}}
    )
    v1_again = upgrade(
        values, {"mine": {**secret_object(data), "metadata": {"name": "mine", "uid": "u", "resourceVersion": "1"}}}
    )
    v2 = upgrade(
        values, {"mine": {**secret_object(data), "metadata": {"name": "mine", "uid": "u", "resourceVersion": "2"}}}
    )
    assert checksums(v1) == checksums(v1_again)
    assert all(checksums(v1)[comp] != checksums(v2)[comp] for comp in checksums(v1))
    hunter = base64.b64encode(b"hunter2").decode()
    for comp in checksums(v1):
        with_data = hashlib.sha256("\n".join(f"{k}={hunter}" for k in KEYS).encode()).hexdigest()
        assert checksums(v1)[comp] != with_data


def test_rotation_is_documented():
    text = (Path(CHART).parents[1] / "docs" / "kubernetes.md").read_text()
    section = text.split("### Rotating secrets", 1)[1].split("\n## ", 1)[0]
    for step in ("kubectl -n rl patch secret my-exp-gyre-secrets", "kubectl -n rl delete secret my-exp-gyre-secrets",
                 "secrets.seed", "checksum/secrets", "existingSecret"):  # fmt: skip
        assert step in section, step


@pytest.mark.parametrize("seed", ["x", "hunter2", "s" * 31])
def test_a_short_seed_is_refused_naming_the_key(seed):
    """Every key of the Secret is derived from the seed: a short one makes every secret guessable."""
    import helm_python

    with pytest.raises(helm_python.HelmError, match="secrets.seed: .*at least 32"):
        render({"secrets": {"seed": seed}})
    render({"secrets": {"seed": "s" * 32}})


def test_an_external_redis_gets_no_generated_password():
    """Its password is redis.external.existingSecret's: a generated one was a secret no pod ever read."""
    external = {"redis": {"external": {"url": "redis://redis.infra:6379/0", "existingSecret": "infra"}}}
    assert set(secret_data(manifests(render(external)))[NAME]) == {"api-key", "control-token"}
