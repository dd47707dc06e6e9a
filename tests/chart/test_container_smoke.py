"""The container smoke's plan (deploy/docker/plan.py): rendered objects -> Docker containers, without Docker.

Each rule the smoke reproduces is checked on the chart's own render (kind values) or on a rendered object
edited the way a wiring mistake would change it; the smoke must name the pod and say why. The run itself
(images, probes, the kind smoke's checks) is `make smoke`; test_container_smoke_docker.py runs it broken.
"""

from __future__ import annotations

import base64
import copy
import stat
import sys
from pathlib import Path

import pytest
from chart_testlib import CHART, MONITORING_APIS, ROOT, load_values, named

sys.path.insert(0, str(ROOT / "deploy" / "docker"))
import cluster as C  # noqa: E402
import docker_args as D  # noqa: E402
import kube as K  # noqa: E402
import plan as P  # noqa: E402
import plan_model as M  # noqa: E402
import smoke as S  # noqa: E402

NS = "rl"
TRAINER, REDIS = "exp-gyre-trainer-0", "exp-gyre-redis-0"


def kind_objects(**overrides) -> list[dict]:
    values = load_values("values-kind.yaml")
    values = K.merge_values(values, overrides)
    return K.render_chart(CHART, values, release="exp", namespace=NS, api_versions=MONITORING_APIS)


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return kind_objects()


@pytest.fixture(scope="module")
def kind_plan(objects) -> M.Plan:
    return P.plan(objects, namespace=NS, release="exp")


def names(tmp_path: Path) -> D.Names:
    return D.Names("gyre-smoke-t", tmp_path)


def by_component(the_plan: M.Plan, component: str) -> list[M.Pod]:
    return [p for p in the_plan.pods if p.labels.get("app.kubernetes.io/component") == component]


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def secret(objects: list[dict], key: str) -> str:
    return base64.b64decode(named(objects, "Secret", "exp-gyre-secrets")["data"][key]).decode()


# ---- the kind render, pod by pod -------------------------------------------------------------------------


def test_every_rendered_workload_becomes_pods(kind_plan):
    components = {c: [p.name for p in by_component(kind_plan, c)] for c in ("redis", "trainer", "inference", "test")}
    assert components["redis"] == [REDIS] and components["trainer"] == [TRAINER]
    (inference,) = components["inference"]
    assert inference.startswith("exp-gyre-inference-") and len(inference.split("-")) == 5  # <deploy>-<hash>-<id>
    assert [p.name for p in kind_plan.test_pods] == ["exp-gyre-test-models"]
    assert all(not p.test_hook for p in kind_plan.workload_pods) and len(kind_plan.workload_pods) == 4
    # what has no container counterpart is listed, not silently dropped
    kinds = {entry.split()[0] for entry in kind_plan.not_emulated}
    assert {"NetworkPolicy", "PodDisruptionBudget", "ServiceMonitor", "ServiceAccount"} <= kinds


def test_trainer_container_runs_exactly_as_rendered(kind_plan, objects, tmp_path):
    trainer = named(objects, "StatefulSet", "exp-gyre-trainer")["spec"]["template"]["spec"]
    rendered = trainer["containers"][0]
    (c,) = kind_plan.pod(TRAINER).containers
    args = D.container_args(c, names(tmp_path), {"dev.gyre.smoke": "t"})
    # command and args: the rendered ones, in order, after the image (entrypoint = command[0])
    assert flag_values(args, "--entrypoint") == rendered["command"][:1]
    assert args[args.index(rendered["image"]) + 1 :] == rendered["command"][1:] + rendered["args"]
    # security context
    assert flag_values(args, "--user") == ["10001:10001"] and flag_values(args, "--group-add") == ["10001"]
    assert "--read-only" in args and flag_values(args, "--cap-drop") == ["ALL"]
    assert flag_values(args, "--security-opt") == ["no-new-privileges"]
    assert flag_values(args, "--memory") == [str(4 * 2**30)]  # limits.memory: 4Gi
    assert flag_values(args, "--network") == ["container:gyre-smoke-t-exp-gyre-trainer-0"]
    # its own PID namespace, whose PID 1 is the rendered command's init (tini): no shareProcessNamespace
    assert rendered["command"][0] == "tini" and not kind_plan.pod(TRAINER).shared_pid
    assert "--pid" not in args and "--init" not in D.sandbox_args(kind_plan.pod(TRAINER), "img", names(tmp_path), {})
    # Redis's pod shares it (its image has no init): the sandbox's init (Docker's, as the pause container) is PID 1
    redis = kind_plan.pod("exp-gyre-redis-0")
    (rc,) = redis.containers
    assert redis.shared_pid and "--init" in D.sandbox_args(redis, "img", names(tmp_path), {})
    redis_args = D.container_args(rc, names(tmp_path), {})
    assert flag_values(redis_args, "--pid") == ["container:gyre-smoke-t-exp-gyre-redis-0"]
    assert c.restart == "always" and "--restart" not in args  # the smoke restarts it (counting exits)
    # environment: every rendered name, Secrets resolved; values never on the command line
    assert flag_values(args, "--env") == [e["name"] for e in rendered["env"]]
    assert c.env == {e["name"]: e["value"] for e in rendered["env"]}  # secrets come as files, not env values
    # mounts: the ConfigMap and the Secret as files (read-only), the shared claim, emptyDirs per pod
    specs = flag_values(args, "--mount")
    # a volume comes as the kubelet made it: never filled from (or owned like) the image's folder
    assert all(s.endswith(",volume-nocopy") for s in specs if s.startswith("type=volume"))
    mounts = dict(s.removesuffix(",readonly").removesuffix(",volume-nocopy").split(",target=") for s in specs)
    assert mounts == {
        f"type=bind,source={tmp_path}/{TRAINER}-experiment": "/etc/gyre",
        f"type=bind,source={tmp_path}/{TRAINER}-secrets": "/run/secrets/gyre",
        "type=volume,source=gyre-smoke-t-pvc-exp-gyre-data": "/data",
        f"type=volume,source=gyre-smoke-t-{TRAINER}-tmp": "/tmp",
        f"type=volume,source=gyre-smoke-t-{TRAINER}-cache": "/cache",
        f"type=volume,source=gyre-smoke-t-{TRAINER}-shm": "/dev/shm",
    }
    assert [s for s in flag_values(args, "--mount") if s.endswith(",readonly")] == [
        f"type=bind,source={tmp_path}/{TRAINER}-experiment,target=/etc/gyre,readonly",
        f"type=bind,source={tmp_path}/{TRAINER}-secrets,target=/run/secrets/gyre,readonly",
    ]
    # the files the env's *_FILE variables name hold the Secret's values, readable by the pod's fsGroup only
    files = {v.name: v for v in kind_plan.file_volumes}[f"{TRAINER}-secrets"]
    assert c.env["GYRE_REDIS__PASSWORD_FILE"] == "/run/secrets/gyre/redis-password"
    assert files.files == {
        "redis-password": (secret(objects, "redis-password").encode(), 0o440),
        "control-token": (secret(objects, "control-token").encode(), 0o440),
    }
    assert files.group == 10001


def test_a_stop_is_judged_by_the_grace_period_and_the_documented_codes(kind_plan):
    """The smoke's `helm uninstall` step: each pod's grace period as rendered; 0 is a clean stop (the trainer's
    torchrun exits 0 after a clean stop: gyre_trainer.torchrun), torchrun's 1 with its SignalException is not, nor
    143 (the orchestrator's push cut short: it waited out its grace for the Redis stopped with it); a SIGKILL (137,
    or the whole grace) never."""
    trainer, (inference,) = kind_plan.pod(TRAINER), by_component(kind_plan, "inference")
    assert (trainer.grace_s, inference.grace_s, kind_plan.pod(REDIS).grace_s) == (120, 60, 30)
    torchrun, gyre = trainer.containers[0], inference.containers[0]
    signal_log = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15"
    ok = {"killed": False, "code": 0, "log": ""}
    assert S.stopped_cleanly(ok, gyre) and not S.stopped_cleanly({**ok, "code": 143}, gyre)
    assert not S.stopped_cleanly({**ok, "code": 1, "log": signal_log}, gyre)
    assert S.stopped_cleanly(ok, torchrun) and not S.stopped_cleanly({**ok, "code": 1, "log": signal_log}, torchrun)
    assert not S.stopped_cleanly({**ok, "code": 1, "log": "ChildFailedError"}, torchrun)
    assert not S.stopped_cleanly({**ok, "killed": True}, gyre)


def test_init_containers_and_the_model_wait(kind_plan):
    trainer, (inference,) = kind_plan.pod(TRAINER), by_component(kind_plan, "inference")
    assert [c.name for c in trainer.init_containers] == ["model-init"]
    init = trainer.init_containers[0]
    assert init.restart == "no" and init.env["POD_NAME"] == TRAINER  # fieldRef metadata.name
    assert [c.name for c in inference.init_containers] == ["wait-for-model"]
    assert {m.target: m.read_only for m in inference.init_containers[0].mounts} == {"/data": True, "/tmp": False}


def test_one_claim_is_one_volume_shared_by_the_pods_that_mount_it(kind_plan):
    users = {p.name for p in kind_plan.pods for c in p.containers for m in c.mounts if m.volume == "pvc-exp-gyre-data"}
    assert {TRAINER, *(p.name for p in by_component(kind_plan, "inference"))} <= users
    assert len(users) == 3  # inference, orchestrator, trainer
    volumes = {v.name: v for v in kind_plan.volumes}
    assert not volumes["pvc-exp-gyre-data"].empty_dir
    assert volumes[f"redis-data-{REDIS}"].origin == f"PersistentVolumeClaim redis-data-{REDIS}"  # volumeClaimTemplate
    shm = volumes[f"{TRAINER}-shm"]
    assert shm.empty_dir and shm.tmpfs_bytes == 256 * 2**20  # medium: Memory, sizeLimit 256Mi
    assert volumes[f"{TRAINER}-tmp"].tmpfs_bytes is None
    assert kind_plan.pod(TRAINER).fs_group == 10001 and not kind_plan.pod(TRAINER).fs_group_always


def test_service_names_follow_readiness_unless_published_early(kind_plan):
    redis, trainer = kind_plan.pod(REDIS), kind_plan.pod(TRAINER)
    domain = f"{NS}.svc.cluster.local"
    assert redis.aliases_when_ready == {
        "exp-gyre-redis-headless": [f"exp-gyre-redis-headless.{domain}", f"{REDIS}.exp-gyre-redis-headless.{domain}"],
        "exp-gyre-redis": [f"exp-gyre-redis.{domain}"],
    }
    # the trainer's headless Service publishes not-ready pods (the rendezvous comes first)
    assert trainer.aliases_at_start == [
        f"exp-gyre-trainer-headless.{domain}",
        f"{TRAINER}.exp-gyre-trainer-headless.{domain}",
    ]
    assert trainer.dns_search == [domain, "svc.cluster.local", "cluster.local"] and trainer.dns_options == ["ndots:5"]
    assert kind_plan.service("exp-gyre-trainer").pods == [TRAINER]  # selects pod 0 by its pod-name label


def test_sandbox_publishes_every_port_and_holds_the_pod_names(kind_plan, tmp_path):
    args = D.sandbox_args(kind_plan.pod(TRAINER), "img:1", names(tmp_path), {})
    assert flag_values(args, "--publish") == [f"127.0.0.1::{p}" for p in (8081, 9101, 29500, 50071)]
    assert flag_values(args, "--hostname") == [TRAINER]
    assert flag_values(args, "--domainname") == [f"exp-gyre-trainer-headless.{NS}.svc.cluster.local"]
    assert flag_values(args, "--network") == ["gyre-smoke-t"] and args[-2:] == ["img:1", "infinity"]


def test_probes_resolve_named_ports(kind_plan):
    (inference,) = by_component(kind_plan, "inference")
    probes = inference.containers[0].probes
    assert (probes["readinessProbe"].action, probes["readinessProbe"].port, probes["readinessProbe"].path) == (
        "http",
        8000,
        "/ready",
    )
    assert probes["startupProbe"].budget_s == 600  # periodSeconds 5 x failureThreshold 120
    (orchestrator,) = by_component(kind_plan, "orchestrator")
    assert orchestrator.containers[0].probes["readinessProbe"].action == "grpc"
    assert kind_plan.pod(REDIS).containers[0].probes["readinessProbe"].action == "exec"


def test_scrape_targets_are_the_service_monitors_endpoints(kind_plan):
    targets = S.scrape_targets(kind_plan)
    (inference,) = by_component(kind_plan, "inference")
    (orchestrator,) = by_component(kind_plan, "orchestrator")
    assert targets == sorted([
        ("exp-gyre-inference-headless", inference.name, 9100, "/metrics"),
        ("exp-gyre-orchestrator", orchestrator.name, 9102, "/metrics"),
        ("exp-gyre-trainer", TRAINER, 9101, "/metrics"),
    ])  # fmt: skip


def test_two_trainer_nodes_are_two_pods_each_with_its_name():
    the_plan = P.plan(kind_objects(trainer={"nnodes": 2}), namespace=NS)
    pods = by_component(the_plan, "trainer")
    assert [p.name for p in pods] == [TRAINER, "exp-gyre-trainer-1"]
    assert pods[1].aliases_at_start[-1] == f"exp-gyre-trainer-1.exp-gyre-trainer-headless.{NS}.svc.cluster.local"
    assert the_plan.service("exp-gyre-trainer").pods == [TRAINER]
    assert pods[1].init_containers[0].env["POD_NAME"] == "exp-gyre-trainer-1"


# ---- wiring mistakes: the smoke names the pod and says why, before anything starts ------------------------


def test_a_wrong_secret_key_names_the_pod_container_and_key():
    """The issue's example: the trainer pointed at a Redis password key the Secret does not have."""
    wrong = {
        "name": "GYRE_REDIS__PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "exp-gyre-secrets", "key": "redis-pass"}},
    }
    objects = kind_objects(trainer={"env": [wrong]})
    with pytest.raises(M.WiringError) as failure:
        P.plan(objects, namespace=NS)
    assert failure.value.where == f"pod {TRAINER}, container trainer"
    assert "env GYRE_REDIS__PASSWORD: Secret exp-gyre-secrets has no key 'redis-pass'" in failure.value.why
    assert "redis-password" in failure.value.why  # the keys it does have


def test_the_smoke_command_reports_it_before_starting_anything(tmp_path, capsys, monkeypatch):
    """`make smoke` with that override: exit 1, the pod, container and reason, and no docker command run."""
    override = tmp_path / "wrong-key.yaml"
    override.write_text(
        "trainer:\n  env:\n    - name: GYRE_REDIS__PASSWORD\n"
        "      valueFrom: {secretKeyRef: {name: smoke-gyre-secrets, key: redis-pass}}\n"
    )
    for module in (S, C):
        monkeypatch.setattr(module, "docker", lambda *a, **k: pytest.fail(f"docker {a} ran"))
    assert S.main(["-f", str(ROOT / "deploy" / "values-kind.yaml"), "-f", str(override)]) == 1
    out = capsys.readouterr().out
    assert ("SMOKE FAILED: pod smoke-gyre-trainer-0, container trainer: env GYRE_REDIS__PASSWORD: "
            "Secret smoke-gyre-secrets has no key 'redis-pass'") in out  # fmt: skip


def test_a_mount_of_a_volume_the_pod_lacks_is_named(objects):
    broken = copy.deepcopy(objects)
    trainer = named(broken, "StatefulSet", "exp-gyre-trainer")["spec"]["template"]["spec"]["containers"][0]
    next(m for m in trainer["volumeMounts"] if m["mountPath"] == "/etc/gyre")["name"] = "experiment-config"
    with pytest.raises(M.WiringError, match=r"volumeMount /etc/gyre refers to volume 'experiment-config'") as failure:
        P.plan(broken, namespace=NS)
    assert failure.value.where == f"pod {TRAINER}, container trainer"


def test_a_service_targeting_an_undeclared_port_is_named(objects):
    broken = copy.deepcopy(objects)
    named(broken, "Service", "exp-gyre-trainer")["spec"]["ports"][0]["targetPort"] = "status"
    with pytest.raises(M.WiringError) as failure:
        P.plan(broken, namespace=NS)
    assert failure.value.where == "Service exp-gyre-trainer"
    assert f"targets port 'status', which pod {TRAINER} does not declare" in failure.value.why


def test_a_service_selecting_no_pod_is_named(objects):
    broken = copy.deepcopy(objects)
    named(broken, "Service", "exp-gyre-redis")["spec"]["selector"]["app.kubernetes.io/component"] = "cache"
    with pytest.raises(M.WiringError, match="selects no pod") as failure:
        P.plan(broken, namespace=NS)
    assert failure.value.where == "Service exp-gyre-redis"


def test_a_probe_on_an_undeclared_port_is_named(objects):
    broken = copy.deepcopy(objects)
    container = named(broken, "Deployment", "exp-gyre-orchestrator")["spec"]["template"]["spec"]["containers"][0]
    container["livenessProbe"]["tcpSocket"]["port"] = "grcp"
    with pytest.raises(M.WiringError, match=r"livenessProbe uses port 'grcp'"):
        P.plan(broken, namespace=NS)


# ---- Secrets and ConfigMaps as files, env sources, quantities --------------------------------------------


def test_secret_files_get_the_kubelets_modes_and_group(objects, tmp_path):
    """Secrets mounted as files (whole Secret, items, defaultMode): contents, paths, read-only, root:fsGroup."""
    edited = copy.deepcopy(objects)
    spec = named(edited, "StatefulSet", "exp-gyre-trainer")["spec"]["template"]["spec"]
    spec["volumes"] += [
        {"name": "secrets", "secret": {"secretName": "exp-gyre-secrets", "defaultMode": 0o400}},
        {"name": "one", "secret": {"secretName": "exp-gyre-secrets", "items": [{"key": "api-key", "path": "k/api"}]}},
    ]
    spec["containers"][0]["volumeMounts"] += [
        {"name": "secrets", "mountPath": "/etc/gyre-secrets"},
        {"name": "one", "mountPath": "/run/key", "subPath": "k/api"},
    ]
    the_plan = P.plan(edited, namespace=NS)
    files = {v.name: v for v in the_plan.file_volumes}[f"{TRAINER}-secrets"]
    assert files.files["redis-password"] == (secret(objects, "redis-password").encode(), 0o400)
    assert files.group == 10001
    mounts = {m.target: m for m in the_plan.pod(TRAINER).containers[0].mounts}
    assert mounts["/etc/gyre-secrets"].read_only and mounts["/etc/gyre-secrets"].files
    args = D.container_args(the_plan.pod(TRAINER).containers[0], names(tmp_path), {})
    assert f"type=bind,source={tmp_path}/{TRAINER}-one/k/api,target=/run/key,readonly" in flag_values(args, "--mount")

    cluster = C.Cluster.__new__(C.Cluster)  # only its file writer: no Docker involved
    cluster.names = names(tmp_path)
    cluster.write_files(files)
    written = tmp_path / f"{TRAINER}-secrets" / "redis-password"
    assert written.read_text() == secret(objects, "redis-password")
    info = written.stat()
    assert stat.S_IMODE(info.st_mode) == 0o440 and (info.st_uid, info.st_gid) == (0, 10001)  # 0400 | group read


def test_env_sources_follow_the_kubelet():
    docs = [
        {"kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"A": "1", "B": "2"}},
        {"kind": "Secret", "metadata": {"name": "s"}, "stringData": {"tok": "x"}},
        {"kind": "Pod", "metadata": {"name": "p", "labels": {"app": "a"}},
         "spec": {"restartPolicy": "Never", "enableServiceLinks": False, "containers": [{
             "name": "c", "image": "i:1", "command": ["sh", "-c"], "args": ["echo $(A) $(C) $$(A) $(NOPE)"],
             "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}, {"configMapRef": {"name": "cm"}}],
             "env": [{"name": "C", "value": "$(A)-$(B)"},
                     {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "tok"}}},
                     {"name": "O", "valueFrom": {"secretKeyRef": {"name": "s", "key": "none", "optional": True}}},
                     {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                     {"name": "L", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                     {"name": "M", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}}],
             "resources": {"limits": {"memory": "1536Mi", "cpu": "500m"}}}]}},
    ]  # fmt: skip
    (pod,) = P.plan(docs, namespace=NS).pods
    (c,) = pod.containers
    assert c.env == {"CM_A": "1", "CM_B": "2", "A": "1", "B": "2", "C": "1-2", "T": "x", "IP": M.POD_IP, "L": "a",
                     "M": "1536"}  # fmt: skip
    assert c.command == ["sh", "-c"] and c.args == ["echo 1 1-2 $(A) $(NOPE)"]
    assert pod.run_once and c.restart == "no" and c.cpus == 0.5


def test_quantities():
    assert K.quantity("4Gi") == 4 * 2**30 and K.quantity("500m") == 0.5 and K.quantity("1.5") == 1.5
    assert K.quantity("2k") == 2000 and K.quantity(3) == 3
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        K.quantity("4 GB")


def test_the_reason_is_the_first_error_line_of_the_log():
    log = "error_file: <N/A>\nINFO starting\ngyre trainer: error: config file not found: /x.toml\nTraceback ...\n"
    assert C.first_error(log) == "gyre trainer: error: config file not found: /x.toml"
    assert C.first_error("a\nredis.exceptions.AuthenticationError: invalid password\n").startswith("redis.exceptions")
    assert C.first_error("all fine\nlast line") == "last line"


def test_the_docs_say_what_the_smoke_proves_and_quote_a_passing_run():
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    section = text[text.index("## The container smoke (`make smoke`)") : text.index("## The kind smoke deploy")]
    assert "| | container smoke (every CI run) | kind workflow only |" in section
    quoted = section[section.index("A passing run") :].split("```")[1]
    for line in ("GET /v1/models (official openai client)", "token_ids [", "policy_version", "trainer (svc/",
                 ">= 3", "scraped ", "helm test pod", "orphans reaped", "stopped as by `helm uninstall`",
                 "nothing left", "SMOKE PASSED in"):  # fmt: skip
        assert line in quoted, line
    assert "_TIME" not in text and "SMOKE_OUTPUT" not in text  # measured numbers, not placeholders


def test_a_judge_server_the_chart_adds_is_planned_like_any_deployment():
    """Generic over what the chart renders: a `servers` entry (an extra `gyre inference` Deployment and its
    Service) becomes a pod with its init containers, probes, secret files, Service name and scrape target,
    with no smoke change."""
    with_judge = kind_objects(servers=[{"name": "judge", "model": "/data/model"}])
    the_plan = P.plan(with_judge, namespace=NS)
    (judge,) = by_component(the_plan, "server-judge")
    assert judge.owner == "Deployment exp-gyre-server-judge"
    assert judge.aliases_when_ready == {"exp-gyre-server-judge": [f"exp-gyre-server-judge.{NS}.svc.cluster.local"]}
    assert [c.name for c in judge.init_containers] == ["wait-for-model"]  # the policy's model, made by trainer pod 0
    (c,) = judge.containers
    assert c.command == ["tini", "-s", "--", "gyre"] and c.args[0] == "inference" and "readinessProbe" in c.probes
    assert any(m.volume == "pvc-exp-gyre-data" for m in c.mounts)
    files = {v.name: v for v in the_plan.file_volumes}[f"{judge.name}-secrets"].files
    assert files["api-key"][0].decode() == secret(with_judge, "api-key")  # the key the orchestrator sends
    assert ("exp-gyre-server-judge", judge.name, 9100, "/metrics") in S.scrape_targets(the_plan)
