"""The container smoke's plan: a rendered Helm release as Docker containers, networks and volumes.

Pure functions over the rendered Kubernetes objects (no Docker here), so every rule is unit-tested: plan()
builds a plan_model.Plan, docker_args.py turns it into `docker run` command lines, and smoke.py runs it.
What a kubelet does, and what stands in for it:

- A pod is a sandbox container (Kubernetes' pause container: it holds the pod's network namespace, hostname,
  DNS search path and published ports) and the pod's containers, joined to it (`--network container:`).
  Init containers run to completion first, in order; every pod starts at once, as in a cluster.
- Deployments run `replicas` pods, StatefulSets `<name>-<i>` (hostname and subdomain set, a volume per
  volumeClaimTemplate and pod), DaemonSets one pod, Jobs and bare Pods one; `helm test` hooks run last.
- A Service is DNS names on the pods it selects: `<svc>.<ns>.svc.<domain>`, plus `<pod>.<svc>...` for the
  StatefulSet pods of a headless Service; the pods' DNS search path (`<ns>.svc.<domain>` ...) resolves the
  short forms, as in a cluster. A pod's names appear once it is ready (a Docker network per Service, which
  the pod joins when its readiness probes pass), or at once with `publishNotReadyAddresses`.
  Clients reach the pods directly, so a Service port must equal its target port.
- Environment: `env` and `envFrom` resolved as the kubelet does (ConfigMaps and Secrets of the release,
  the downward API, `$(VAR)` expansion in values, command and args).
- Volumes: a PersistentVolumeClaim is one Docker volume shared by every pod that mounts it; emptyDir a
  volume per pod (tmpfs with `medium: Memory`), 0777 like the kubelet's; ConfigMap, Secret, projected
  and downwardAPI volumes are files written on the host and bind-mounted read-only, with the modes and
  the fsGroup ownership the kubelet gives them. fsGroup: volumes group-owned (setgid), the group added.
- Security: runAsUser/runAsGroup (`--user`), fsGroup and supplementalGroups (`--group-add`),
  readOnlyRootFilesystem (`--read-only`), capabilities (`--cap-drop`/`--cap-add`), allowPrivilegeEscalation
  (`no-new-privileges`), privileged, seccomp; runAsNonRoot is checked against the image's user.
- Resource limits: memory and CPU limits (`--memory`, `--cpus`); requests only schedule, so they are unused.

Objects with no container counterpart (NetworkPolicy, PodDisruptionBudget, RBAC, ServiceMonitor, ...) are
listed as not emulated. A wiring mistake (a Secret key, ConfigMap or volume that does not exist, a
Service port no pod declares) raises `WiringError` naming the pod or Service and why, before anything runs.
"""

from __future__ import annotations

import hashlib
import json
import re

from kube import config_data, expand, kind_name, quantity, selects
from plan_model import (
    POD_IP,
    Container,
    DockerVolume,
    FileVolume,
    Mount,
    Plan,
    Pod,
    Probe,
    Service,
    Unsupported,
    WiringError,
)

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod")
# kinds whose effect the container smoke does not reproduce (listed in its output)
NOT_EMULATED = (
    "NetworkPolicy", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding", "ClusterRole",
    "ClusterRoleBinding", "ServiceMonitor", "PodMonitor", "PrometheusRule", "HorizontalPodAutoscaler",
    "Ingress", "PriorityClass", "StorageClass", "PersistentVolume",
)  # fmt: skip


def plan(objects: list[dict], *, namespace: str, release: str = "", domain: str = "cluster.local") -> Plan:
    """The Docker plan of a rendered release; `WiringError` / `Unsupported` say what cannot run and where."""
    builder = _Builder(objects, namespace, domain)
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            builder.add_workload(obj)
    services = [builder.service(s) for s in objects if s["kind"] == "Service"]
    not_emulated = sorted(kind_name(o) for o in objects if o["kind"] in NOT_EMULATED)
    known = {*WORKLOADS, *NOT_EMULATED, "Service", "ConfigMap", "Secret", "PersistentVolumeClaim"}
    not_emulated += sorted(kind_name(o) for o in objects if o["kind"] not in known)
    return Plan(
        release,
        namespace,
        domain,
        builder.pods,
        [s for s in services if s],
        list(builder.volumes.values()),
        list(builder.file_volumes.values()),
        objects,
        not_emulated,
        builder.notes,
    )


class _Builder:
    def __init__(self, objects: list[dict], namespace: str, domain: str):
        self.objects, self.namespace, self.domain = objects, namespace, domain
        self.by_kind: dict[tuple[str, str], dict] = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        self.pods: list[Pod] = []
        self.templates: list[tuple[dict, dict]] = []  # (pod labels, pod spec) of every workload, for Services
        self.volumes: dict[str, DockerVolume] = {}
        self.file_volumes: dict[str, FileVolume] = {}
        self.notes: list[str] = []

    # ---- workloads -> pods
    def add_workload(self, obj: dict) -> None:
        kind, name, meta = obj["kind"], obj["metadata"]["name"], obj["metadata"]
        template = {"metadata": meta, "spec": obj["spec"]} if kind == "Pod" else obj["spec"]["template"]
        labels = dict(template["metadata"].get("labels") or {})
        spec = template["spec"]
        self.templates.append((labels, spec))
        hook = (meta.get("annotations") or {}).get("helm.sh/hook", "")
        if kind == "StatefulSet":
            names = [f"{name}-{i}" for i in range(obj["spec"].get("replicas", 1))]
        elif kind == "Deployment":
            digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
            names = [
                f"{name}-{_pod_suffix(digest, 10)}-{_pod_suffix(digest + str(i), 5)}"
                for i in range(obj["spec"].get("replicas", 1))
            ]
        else:
            names = [name if kind == "Pod" else f"{name}-{_pod_suffix(name, 5)}"]
        for pod_name in names:
            pod_labels = dict(labels)
            if kind == "StatefulSet":
                pod_labels["statefulset.kubernetes.io/pod-name"] = pod_name
            annotations = dict(template["metadata"].get("annotations") or {})
            self.pods.append(self.pod(obj, pod_name, pod_labels, annotations, spec, "test" in hook.split(",")))

    def pod(self, owner: dict, name: str, labels: dict, annotations: dict, spec: dict, test_hook: bool) -> Pod:
        where = f"pod {name}"
        if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
            raise Unsupported(f"{where}: host namespaces (hostNetwork/hostPID/hostIPC)")
        restart = spec.get("restartPolicy", "Always")
        security = spec.get("securityContext") or {}
        subdomain = spec.get("subdomain") or (
            owner["spec"].get("serviceName") if owner["kind"] == "StatefulSet" else ""
        )
        pod = Pod(
            name=name,
            owner=kind_name(owner),
            labels=labels,
            annotations=annotations,
            hostname=(spec.get("hostname") or name)[:63],
            domain=f"{subdomain}.{self.namespace}.svc.{self.domain}" if subdomain else "",
            test_hook=test_hook,
            run_once=restart != "Always" or owner["kind"] == "Job",
            fs_group=security.get("fsGroup"),
            fs_group_always=security.get("fsGroupChangePolicy", "Always") == "Always",
            shared_pid=bool(spec.get("shareProcessNamespace", False)),
            grace_s=int(spec.get("terminationGracePeriodSeconds", 30)),
        )
        if spec.get("dnsPolicy", "ClusterFirst") in ("ClusterFirst", "ClusterFirstWithHostNet"):
            ns = self.namespace
            pod.dns_search = [f"{ns}.svc.{self.domain}", f"svc.{self.domain}", self.domain]
            pod.dns_options = ["ndots:5"]
        dns_config = spec.get("dnsConfig") or {}
        pod.dns_search += dns_config.get("searches", [])
        pod.dns_options += [
            f"{o['name']}:{o['value']}" if "value" in o else o["name"] for o in dns_config.get("options", [])
        ]
        if spec.get("enableServiceLinks", True):
            self.notes.append(f"{where}: enableServiceLinks (Service environment variables) is not emulated")
        volumes = self.pod_volumes(owner, name, spec, pod)
        pod.volumes = sorted({v for v in volumes.values() if v in self.volumes})
        # Pods that run once (Jobs, `helm test`) are watched to their first exit: no restarts.
        docker_restart = "no" if pod.run_once else "always"
        for init in spec.get("initContainers", []):
            pod.init_containers.append(self.container(pod, owner, spec, init, volumes, init=True, restart="no"))
        for main in spec["containers"]:
            pod.containers.append(self.container(pod, owner, spec, main, volumes, init=False, restart=docker_restart))
        return pod

    # ---- volumes
    def pod_volumes(self, owner: dict, pod_name: str, spec: dict, pod: Pod) -> dict[str, str]:
        """pod volume name -> plan volume name (Docker volume or file volume)."""
        out = {}
        if owner["kind"] == "StatefulSet":
            for template in owner["spec"].get("volumeClaimTemplates", []):
                claim = f"{template['metadata']['name']}-{pod_name}"
                self.volumes.setdefault(claim, DockerVolume(claim, f"PersistentVolumeClaim {claim}"))
                out[template["metadata"]["name"]] = claim
        for volume in spec.get("volumes", []):
            name, where = volume["name"], f"pod {pod_name}, volume {volume['name']}"
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if ("PersistentVolumeClaim", claim) not in self.by_kind and claim not in self.volumes:
                    self.notes.append(
                        f"{where}: PersistentVolumeClaim {claim} is not rendered (an existing claim): "
                        "an empty volume stands in"
                    )
                self.volumes.setdefault(f"pvc-{claim}", DockerVolume(f"pvc-{claim}", f"PersistentVolumeClaim {claim}"))
                out[name] = f"pvc-{claim}"
            elif "emptyDir" in volume:
                empty = volume["emptyDir"] or {}
                size = None
                if empty.get("medium") == "Memory":
                    size = int(quantity(empty["sizeLimit"])) if empty.get("sizeLimit") else None
                    size = size or 64 * 2**20
                key = f"{pod_name}-{name}"
                self.volumes[key] = DockerVolume(key, f"emptyDir {name} of pod {pod_name}", True, size)
                out[name] = key
            elif any(k in volume for k in ("configMap", "secret", "projected", "downwardAPI")):
                key = f"{pod_name}-{name}"
                self.file_volumes[key] = FileVolume(
                    key, f"{where}", self.volume_files(volume, pod_name, pod, where), pod.fs_group
                )
                out[name] = key
            else:
                kinds = sorted(set(volume) - {"name"})
                raise Unsupported(
                    f"{where}: volume type {kinds} (the container smoke runs PersistentVolumeClaim, "
                    "emptyDir, configMap, secret, projected and downwardAPI volumes)"
                )
        return out

    def volume_files(self, volume: dict, pod_name: str, pod: Pod, where: str) -> dict[str, tuple[bytes, int]]:
        if "projected" in volume:
            mode = volume["projected"].get("defaultMode", 0o644)
            sources = volume["projected"].get("sources") or []  # null: an empty volume
        else:
            kind = next(k for k in ("configMap", "secret", "downwardAPI") if k in volume)
            mode = volume[kind].get("defaultMode", 0o644)
            sources = [{kind: volume[kind]}]
        files: dict[str, tuple[bytes, int]] = {}
        for source in sources:
            if "configMap" in source or "secret" in source:
                kind = "ConfigMap" if "configMap" in source else "Secret"
                ref = source["configMap" if kind == "ConfigMap" else "secret"]
                name = ref.get("name") or ref.get("secretName")
                obj = self.by_kind.get((kind, name))
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise WiringError(where, f"{kind} {name} does not exist (it is not rendered by the chart)")
                data = config_data(obj)
                items = ref.get("items") or [{"key": k, "path": k} for k in sorted(data)]
                for item in items:
                    if item["key"] not in data:
                        if ref.get("optional"):
                            continue
                        raise WiringError(
                            where, f"{kind} {name} has no key {item['key']!r} (keys: {', '.join(sorted(data))})"
                        )
                    files[item["path"]] = (data[item["key"]], item.get("mode", mode))
            elif "downwardAPI" in source:
                for item in source["downwardAPI"].get("items", []):
                    if "fieldRef" not in item:
                        raise Unsupported(f"{where}: downwardAPI item {item} (only fieldRef)")
                    text = self.field_ref(item["fieldRef"]["fieldPath"], pod, where, volume_file=True)
                    files[item["path"]] = (text.encode(), item.get("mode", mode))
            else:
                raise Unsupported(f"{where}: projected source {sorted(source)} (an API server's token cannot run here)")
        return files

    # ---- containers
    def container(self, pod: Pod, owner: dict, spec: dict, c: dict, volumes: dict, *, init: bool, restart: str):
        kind = "init container" if init else "container"
        where = f"pod {pod.name}, {kind} {c['name']}"
        env = self.environment(c, pod, where)
        pod_sc, sc = spec.get("securityContext") or {}, c.get("securityContext") or {}

        def setting(key: str, default=None):
            return sc.get(key, pod_sc.get(key, default))

        uid, gid = setting("runAsUser"), setting("runAsGroup")
        if gid is not None and uid is None:
            raise Unsupported(f"{where}: runAsGroup without runAsUser")
        caps = sc.get("capabilities") or {}
        seccomp = (setting("seccompProfile") or {}).get("type", "RuntimeDefault")
        if seccomp == "Localhost":
            raise Unsupported(f"{where}: a Localhost seccomp profile")
        limits = (c.get("resources") or {}).get("limits") or {}
        ports = {}
        for p in c.get("ports", []):
            if p.get("protocol", "TCP") != "TCP":
                raise Unsupported(f"{where}: port {p} is not TCP")
            ports[p.get("name") or str(p["containerPort"])] = p["containerPort"]
        container = Container(
            pod=pod.name,
            name=c["name"],
            image=c["image"],
            pull_policy=c.get("imagePullPolicy") or ("Always" if c["image"].endswith(":latest") else "IfNotPresent"),
            init=init,
            command=[expand(w, env) for w in c["command"]] if "command" in c else None,
            args=[expand(w, env) for w in c["args"]] if "args" in c else None,
            env=env,
            user=None if uid is None else (f"{uid}:{gid}" if gid is not None else str(uid)),
            run_as_non_root=bool(setting("runAsNonRoot", False)),
            group_add=sorted(
                {*([pod_sc["fsGroup"]] if "fsGroup" in pod_sc else []), *pod_sc.get("supplementalGroups", [])}
            ),
            read_only=bool(sc.get("readOnlyRootFilesystem", False)),
            privileged=bool(sc.get("privileged", False)),
            no_new_privileges=sc.get("allowPrivilegeEscalation") is False,
            cap_drop=list(caps.get("drop", [])),
            cap_add=list(caps.get("add", [])),
            seccomp_unconfined=seccomp == "Unconfined",
            mounts=self.mounts(c, volumes, where),
            memory_bytes=int(quantity(limits["memory"])) if "memory" in limits else None,
            cpus=quantity(limits["cpu"]) if "cpu" in limits else None,
            workdir=c.get("workingDir"),
            ports=ports,
            shared_pid=pod.shared_pid,
            restart=restart,
        )
        for kind_ in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind_ in c:
                if init:
                    raise Unsupported(f"{where}: probes on an init container (sidecar containers)")
                container.probes[kind_] = self.probe(c[kind_], ports, where, kind_)
        return container

    def mounts(self, c: dict, volumes: dict[str, str], where: str) -> list[Mount]:
        out, seen = [], set()
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                raise WiringError(
                    where,
                    f"volumeMount {m['mountPath']} refers to volume {m['name']!r}, "
                    f"which the pod does not define (volumes: {', '.join(sorted(volumes))})",
                )
            if m["mountPath"] in seen:
                raise WiringError(where, f"two volumeMounts at {m['mountPath']}")
            if "subPathExpr" in m:
                raise Unsupported(f"{where}: volumeMount {m['mountPath']} uses subPathExpr")
            seen.add(m["mountPath"])
            files = volumes[m["name"]] in self.file_volumes  # ConfigMap, Secret, ...: always read-only
            out.append(
                Mount(m["mountPath"], volumes[m["name"]], bool(m.get("readOnly")) or files, m.get("subPath", ""), files)
            )
        return out

    def probe(self, p: dict, ports: dict[str, int], where: str, kind: str) -> Probe:
        timing = {
            "initial_delay_s": p.get("initialDelaySeconds", 0),
            "period_s": p.get("periodSeconds", 10),
            "timeout_s": p.get("timeoutSeconds", 1),
            "failure_threshold": p.get("failureThreshold", 3),
        }

        def port(value) -> int:
            if isinstance(value, int) or str(value).isdigit():
                return int(value)
            if value not in ports:
                raise WiringError(
                    where,
                    f"{kind} uses port {value!r}, which the container does not declare "
                    f"(ports: {', '.join(sorted(ports)) or 'none'})",
                )
            return ports[value]

        if "httpGet" in p:
            get = p["httpGet"]
            if get.get("host"):
                raise Unsupported(f"{where}: {kind} with httpGet.host")
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
            return Probe("http", port(get["port"]), get.get("path", "/"), get.get("scheme", "HTTP"), headers, **timing)
        if "tcpSocket" in p:
            return Probe("tcp", port(p["tcpSocket"]["port"]), **timing)
        if "grpc" in p:
            return Probe("grpc", port(p["grpc"]["port"]), service=p["grpc"].get("service", ""), **timing)
        if "exec" in p:
            return Probe("exec", command=list(p["exec"]["command"]), **timing)
        raise Unsupported(f"{where}: {kind} {p}")

    # ---- environment (the kubelet's rules)
    def environment(self, c: dict, pod: Pod, where: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in c.get("envFrom", []):
            kind = "ConfigMap" if "configMapRef" in source else "Secret"
            ref = source.get("configMapRef") or source.get("secretRef")
            obj = self.by_kind.get((kind, ref["name"]))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise WiringError(
                    where, f"envFrom: {kind} {ref['name']} does not exist (it is not rendered by the chart)"
                )
            for key, value in config_data(obj).items():
                env[source.get("prefix", "") + key] = value.decode()
        for var in c.get("env", []):
            name = var["name"]
            if "valueFrom" not in var:
                env[name] = expand(str(var.get("value", "")), env)
                continue
            source = var["valueFrom"]
            if "secretKeyRef" in source or "configMapKeyRef" in source:
                kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
                ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
                obj = self.by_kind.get((kind, ref["name"]))
                data = config_data(obj) if obj is not None else {}
                if ref["key"] in data:
                    env[name] = data[ref["key"]].decode()
                elif not ref.get("optional"):
                    why = (
                        f"{kind} {ref['name']} does not exist (it is not rendered by the chart)"
                        if obj is None
                        else f"{kind} {ref['name']} has no key {ref['key']!r} (keys: {', '.join(sorted(data))})"
                    )
                    raise WiringError(where, f"env {name}: {why}")
            elif "fieldRef" in source:
                env[name] = self.field_ref(source["fieldRef"]["fieldPath"], pod, where)
            elif "resourceFieldRef" in source:
                ref = source["resourceFieldRef"]
                resources = c.get("resources") or {}
                section, _, resource = ref["resource"].partition(".")
                value = (resources.get(section) or {}).get(resource)
                if value is None:
                    raise Unsupported(f"{where}: env {name}: {ref['resource']} is not set (node allocatable)")
                divisor = quantity(ref.get("divisor", "1"))
                env[name] = str(int(-(-quantity(value) // divisor)))  # the kubelet rounds up
            else:
                raise Unsupported(f"{where}: env {name}: {source}")
        return env

    def field_ref(self, path: str, pod: Pod, where: str, volume_file: bool = False) -> str:
        annotations = pod.annotations
        fixed = {
            "metadata.name": pod.name,
            "metadata.namespace": self.namespace,
            "spec.nodeName": "docker",
            "metadata.uid": str(hashlib.sha256(pod.name.encode()).hexdigest()[:32]),
            "status.podIP": POD_IP,
            "status.podIPs": POD_IP,
            "status.hostIP": "127.0.0.1",
        }
        if path in fixed:
            return fixed[path]
        match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if match:
            return (pod.labels if match[1] == "labels" else annotations).get(match[2], "")
        if volume_file and path in ("metadata.labels", "metadata.annotations"):
            found = pod.labels if path == "metadata.labels" else annotations
            return "".join(f'{k}="{v}"\n' for k, v in sorted(found.items()))
        raise Unsupported(f"{where}: fieldRef {path}")

    # ---- Services
    def service(self, svc: dict) -> Service | None:
        spec, name = svc["spec"], svc["metadata"]["name"]
        selector = spec.get("selector") or {}
        if spec.get("type") == "ExternalName" or not selector:
            self.notes.append(f"Service {name}: no selector (endpoints managed elsewhere), not emulated")
            return None
        pods = [p for p in self.pods if selects(selector, p.labels)]
        if not pods and not any(selects(selector, labels) for labels, _ in self.templates):  # not even at 0 replicas
            raise WiringError(f"Service {name}", f"selects no pod (selector {selector})")
        headless = spec.get("clusterIP") == "None"
        fqdn = f"{name}.{self.namespace}.svc.{self.domain}"
        ports = {}
        for port in spec.get("ports", []):
            number, target = port["port"], port.get("targetPort", port["port"])
            if port.get("protocol", "TCP") != "TCP":
                raise Unsupported(f"Service {name}: port {port} is not TCP")
            for pod in pods:
                declared = {k: v for c in pod.containers for k, v in c.ports.items()}
                if isinstance(target, str) and not target.isdigit() and target not in declared:
                    raise WiringError(
                        f"Service {name}",
                        f"port {port.get('name', number)} targets port {target!r}, "
                        f"which pod {pod.name} does not declare (ports: {', '.join(sorted(declared))})",
                    )
                resolved = declared[target] if target in declared else int(target)
                if resolved != number:
                    raise Unsupported(
                        f"Service {name}: port {number} -> target {resolved}: the container smoke "
                        "connects clients straight to the pods, so a Service port must equal its target"
                    )
            ports[port.get("name") or str(number)] = number
        publish = bool(spec.get("publishNotReadyAddresses"))
        for pod in pods:
            names = [fqdn]
            if headless and pod.domain == f"{name}.{self.namespace}.svc.{self.domain}":
                names.append(f"{pod.hostname}.{fqdn}")
            if publish:
                pod.aliases_at_start += names
            else:
                pod.aliases_when_ready[name] = names
        return Service(
            name, fqdn, selector, ports, [p.name for p in pods], headless, publish, svc["metadata"].get("labels") or {}
        )


def _pod_suffix(seed: str, n: int) -> str:
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # the characters Kubernetes uses in generated names
    digest = hashlib.sha256(seed.encode()).digest()
    return "".join(alphabet[b % len(alphabet)] for b in digest[:n])
