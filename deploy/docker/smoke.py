"""Container smoke: the chart's own pods in Docker, exactly as rendered, then what the kind smoke checks.

    deploy/docker/smoke.py                    # deploy/values-kind.yaml, release smoke, namespace gyre
    make smoke                                # the same (after `make images`)
    deploy/docker/smoke.py --clean            # remove what an interrupted smoke left behind

1. Render charts/gyre with the values (and the Prometheus operator's APIs, as the kind workflow installs
   them) and plan every pod as Docker containers (deploy/docker/plan.py says how each Kubernetes rule is
   reproduced). A wiring mistake the plan can see (a Secret key, ConfigMap or volume that does not exist, a
   Service port no pod declares, a root image under runAsNonRoot) fails here, before anything starts.
2. Start every pod at once: its sandbox, its volumes prepared (fsGroup), its init containers in order, then
   its containers; a pod's Service names appear when its readiness probes pass.
3. Wait until every pod is ready: startup probes within their failureThreshold x periodSeconds, no
   container exited more than --max-restarts times (exited containers restart after a back-off).
4. Check what deploy/kind/smoke.sh checks, through published ports (its port-forwards): the OpenAI API
   answers the official `openai` client (models, a chat completion with token ids and a policy version),
   the trainer completes --min-steps RL steps and a later completion is served by trained weights, every
   ServiceMonitor endpoint's /metrics scrapes, every `helm test` pod's command passes, every startup
   and liveness probe still passes, and every pod reaps an orphan (no zombie left to its PID 1).
5. Stop every pod at once, as `helm uninstall` does (SIGTERM, SIGKILL after terminationGracePeriodSeconds):
   each container must exit within its grace period with the code its service documents for SIGTERM.
6. Tear everything down (containers, networks, volumes, files), on failure and on SIGINT/SIGTERM too.

A failure names the pod and container and says why, with the container's last log lines. Needs a local
Docker daemon (files are bind-mounted from the host, as a kubelet does) and the images the values name
(`make images`); an image that cannot be pulled here is replaced per --image-fallback (Docker Hub's Redis
by Debian's, built by deploy/docker/build.sh), and the output says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "deploy" / "kind")]
import smoke_client  # noqa: E402
from cluster import LABEL, Cluster, SmokeFailure, docker, remove_labelled, say, tail  # noqa: E402
from kube import merge_values, render_chart, selects  # noqa: E402
from plan import plan  # noqa: E402
from plan_model import Container, Plan, Service, Unsupported, WiringError  # noqa: E402
from probes import run_probe  # noqa: E402

MONITORING_APIS = (
    "monitoring.coreos.com/v1",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)
DEFAULT_FALLBACKS = ("redis=gyre-local/redis:7-bookworm",)


# ---- images ----------------------------------------------------------------------------------------------


def image_present(ref: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", ref], capture_output=True).returncode == 0


def resolve_images(the_plan: Plan, fallbacks: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """rendered image -> local image to run, and what was substituted. Like the kubelet: `Never` must be
    present, `IfNotPresent` is pulled when missing, `Always` is pulled (a local copy serves if that fails)."""
    resolved, notes = {}, []
    for c in [c for pod in the_plan.pods for c in pod.init_containers + pod.containers]:
        if c.image in resolved:
            continue
        present = image_present(c.image)
        if c.pull_policy == "Never" and not present:
            raise SmokeFailure(c.label, f"image {c.image} is not present (imagePullPolicy: Never): run `make images`")
        if present and c.pull_policy != "Always":
            resolved[c.image] = c.image
            continue
        pull = subprocess.run(["docker", "pull", "-q", c.image], capture_output=True, text=True, timeout=600)
        if pull.returncode == 0 or present:
            resolved[c.image] = c.image
            continue
        stand_in = fallbacks.get(c.image.split("@")[0].rsplit("/", 1)[-1].split(":")[0])  # by repository name
        if stand_in and image_present(stand_in):
            resolved[c.image] = stand_in
            notes.append(
                f"{c.image} cannot be pulled here ({pull.stderr.strip().splitlines()[-1][:120]}): {stand_in} stands in"
            )
            continue
        raise SmokeFailure(c.label, f"image {c.image} cannot be pulled: {pull.stderr.strip()[:300]}")
    return resolved, notes


def check_non_root(the_plan: Plan, images: dict[str, str]) -> None:
    """runAsNonRoot as the kubelet checks it: the effective user must be numeric and not 0."""
    for c in [c for pod in the_plan.pods for c in pod.init_containers + pod.containers]:
        if not c.run_as_non_root:
            continue
        user = c.user or docker("image", "inspect", "-f", "{{.Config.User}}", images[c.image]).strip()
        uid = user.split(":")[0]
        if not uid.isdigit():
            raise SmokeFailure(
                c.label,
                f"runAsNonRoot, but the image's user {uid or 'root'!r} is not numeric: "
                "the kubelet cannot verify it is not root",
            )
        if int(uid) == 0:
            raise SmokeFailure(c.label, "runAsNonRoot, but it would run as root (uid 0)")


# ---- the checks ------------------------------------------------------------------------------------------


def find_service(the_plan: Plan, component: str, port: str) -> Service:
    """The ClusterIP Service of a component with a port of that name (what `kubectl port-forward svc/...` uses)."""
    for service in the_plan.services:
        is_component = service.labels.get("app.kubernetes.io/component") == component
        if is_component and not service.headless and port in service.ports:
            return service
    raise SmokeFailure("check", f"no Service of component {component} with a port named {port!r}")


def secret_value(the_plan: Plan, key: str) -> str:
    import base64

    for obj in the_plan.objects:
        if obj["kind"] == "Secret" and key in (obj.get("data") or {}):
            return base64.b64decode(obj["data"][key]).decode()
    raise SmokeFailure("check", f"no rendered Secret has the key {key!r}")


def scrape_targets(the_plan: Plan) -> list[tuple[str, str, int, str]]:
    """(Service, pod, port, path) Prometheus scrapes: each ServiceMonitor's endpoints on the pods of the
    Services it selects; without ServiceMonitors, every Service port named `metrics`."""
    monitors = [o for o in the_plan.objects if o["kind"] == "ServiceMonitor"]
    targets = set()
    for monitor in monitors:
        selector = monitor["spec"]["selector"].get("matchLabels", {})
        for service in the_plan.services:
            if selects(selector, service.labels):
                for endpoint in monitor["spec"]["endpoints"]:
                    port = service.ports[endpoint["port"]]
                    targets |= {(service.name, pod, port, endpoint.get("path", "/metrics")) for pod in service.pods}
    if not monitors:
        targets = {
            (s.name, pod, s.ports["metrics"], "/metrics")
            for s in the_plan.services
            if "metrics" in s.ports
            for pod in s.pods
        }
    return sorted(targets)


def scrape(host_port: int, path: str) -> tuple[int, int, list[str]]:
    """(families, samples, gyre_* family names) of a /metrics page in the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{host_port}{path}", timeout=10) as response:
        text = response.read().decode()
    families = [f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")]
    samples = sum(len(f.samples) for f in families)
    return len(families), samples, sorted(f.name for f in families if f.name.startswith("gyre_"))


def chat_after_training(base_url: str, api_key: str, model: str, deadline: float) -> tuple[str, list[int], int]:
    """A completion served by trained weights (policy version >= 1): the weights went trainer -> volume ->
    orchestrator -> inference over the containers' network."""
    while True:
        reply = smoke_client.chat_once(base_url, api_key, model)
        if reply[2] >= 1 or time.monotonic() > deadline:
            return reply
        time.sleep(3)


def checks(cluster: Cluster, min_steps: int, timeout: float) -> dict:
    the_plan, out = cluster.the_plan, {}
    deadline = time.monotonic() + timeout
    api = find_service(the_plan, "inference", "http")
    api_port = cluster.host_ports[api.pods[0]][api.ports["http"]]
    base_url, api_key = f"http://127.0.0.1:{api_port}/v1", secret_value(the_plan, "api-key")
    say(f"  OpenAI API: svc/{api.name}:{api.ports['http']} published at {base_url} (the port-forward)")
    model = cluster.guarded(smoke_client.wait_for_model, base_url, api_key, deadline, timeout=timeout)
    say(f"  GET /v1/models (official openai client): {model!r}")
    text, token_ids, version = cluster.guarded(smoke_client.chat_once, base_url, api_key, model, timeout=300)
    say(f"  chat completion: {text!r}, token_ids {token_ids}, policy_version {version}")
    out["chat"] = {"text": text, "token_ids": token_ids, "policy_version": version}

    trainer = find_service(the_plan, "trainer", "grpc")
    address = f"127.0.0.1:{cluster.host_ports[trainer.pods[0]][trainer.ports['grpc']]}"
    step = cluster.guarded(smoke_client.wait_for_steps, address, min_steps, deadline, timeout=timeout)
    say(f"  trainer (svc/{trainer.name}:{trainer.ports['grpc']}, gRPC GetStatus): step {step} >= {min_steps}")
    text, token_ids, version = cluster.guarded(
        chat_after_training, base_url, api_key, model, time.monotonic() + 180, timeout=240
    )
    if version < 1:
        raise SmokeFailure(
            f"pod {api.pods[0]}",
            f"still serves policy version {version} after {step} trained steps: "
            "the trained weights never reached inference",
        )
    say(f"  chat completion after training: {text!r}, token_ids {token_ids}, policy_version {version}")
    out["steps"], out["chat_after_training"] = step, {"text": text, "token_ids": token_ids, "policy_version": version}

    out["metrics"] = []
    for service, pod, port, path in scrape_targets(the_plan):
        try:
            families, samples, gyre = scrape(cluster.host_ports[pod][port], path)
        except OSError as error:
            why = f"{path} on port {port} (Service {service}) does not scrape: {error}"
            raise SmokeFailure(f"pod {pod}", why) from None
        if not gyre:
            raise SmokeFailure(f"pod {pod}", f"{path} on port {port} has no gyre_* metrics")
        say(
            f"  scraped {service} -> pod {pod}:{port}{path}: {families} families, {samples} samples, "
            f"{len(gyre)} gyre_* (e.g. {', '.join(gyre[:3])})"
        )
        out["metrics"].append({"service": service, "pod": pod, "port": port, "families": families, "samples": samples})

    out["tests"] = []
    for pod in the_plan.test_pods:
        logs = cluster.run_to_completion(pod, timeout=300)
        say(f"  helm test pod {pod.name}: passed: {logs.splitlines()[-1] if logs else ''}")
        out["tests"].append({"pod": pod.name, "log": logs})

    for name, c in cluster.running.items():  # every probe still holds (liveness failures would restart it)
        if c.pod in {p.name for p in the_plan.test_pods}:
            continue
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind in c.probes:
                probe = c.probes[kind]
                passed, what = run_probe(probe, cluster.host_ports[c.pod].get(probe.port), name)
                if not passed:
                    raise SmokeFailure(c.label, f"{kind} fails after training: {what}", tail(name))
    out["reaping"] = check_reaping(cluster)
    out["restarts"] = {name.removeprefix(cluster.names.prefix + "-"): w.restarts for name, w in cluster.watch.items()}
    restarted = {name: n for name, n in out["restarts"].items() if n}
    say(f"  startup, liveness and readiness probes all pass; restarts: {restarted or 'none'}")
    return out


# Processes of a container's PID namespace, one "pid state ppid comm" line each (images without `ps`).
PS = 'for p in /proc/[0-9]*; do s=$(cat "$p/stat" 2>/dev/null) && echo "${s%% *} $(echo "${s##*) }" | cut -d" " -f1,2) $(cat "$p/comm")"; done'  # noqa: E501


def check_reaping(cluster: Cluster) -> dict[str, str]:
    """Every pod reaps orphans: a process whose parent exits is re-parented to the pod's PID 1, which must
    wait for it when it exits (a service as PID 1 never does: zombies pile up to the pids limit)."""
    out = {}
    pods = [p for p in cluster.the_plan.workload_pods if not p.run_once]
    for pod in pods:  # an orphan in each pod: the shell exits at once, its `sleep` 1 s later
        docker("exec", cluster.names.container(pod.name, pod.containers[0].name), "sh", "-c", "sleep 1 & exit 0")
    time.sleep(4)
    for pod in pods:
        name = cluster.names.container(pod.name, pod.containers[0].name)
        processes = [line.split(maxsplit=3) for line in docker("exec", name, "sh", "-c", PS).splitlines()]
        pid1 = next((p[3] for p in processes if p[0] == "1"), "?")
        zombies = [f"{p[3]} (pid {p[0]})" for p in processes if p[1] == "Z"]
        if zombies:
            why = (
                f"orphans are not reaped: zombie {', '.join(zombies)}; PID 1 is {pid1!r} (a Gyre container's"
                " command starts with tini; a pod of an image without an init needs shareProcessNamespace)"
            )
            raise SmokeFailure(f"pod {pod.name}", why)
        out[pod.name] = pid1
    say(f"  orphans reaped in every pod (PID 1: {', '.join(sorted(set(out.values())))})")
    return out


def stopped_cleanly(result: dict, container: Container) -> bool:
    """Not killed, and the exit code every service documents for a SIGTERM: 0, a clean stop. The trainer's
    torchrun (`python -m gyre_trainer.torchrun`) exits 0 once every worker stopped cleanly; torchrun's own 1 with
    a SignalException, whatever the workers did, is no longer taken for a clean stop; nor the orchestrator's 143
    (a push cut short: it once waited out its stop grace for the Redis stopped beside it, then exited 143)."""
    return not result["killed"] and result["code"] == 0


def stop_all(cluster: Cluster) -> list[dict]:
    """`helm uninstall`: every pod SIGTERMed at once; each container must stop within its grace period with
    its code, not be SIGKILLed (a checkpoint or the requests in flight would be lost)."""
    pods = [p for p in cluster.the_plan.workload_pods if not p.run_once]
    results = cluster.stop_pods(pods)
    containers = {(p.name, c.name): c for p in pods for c in p.containers}
    for r in results:
        c = containers[(r["pod"], r["container"])]
        if not stopped_cleanly(r, c):
            how = "SIGKILLed" if r["killed"] else f"exited with code {r['code']}"
            why = f"{how} {r['seconds']} s after SIGTERM (terminationGracePeriodSeconds {r['grace_s']})"
            raise SmokeFailure(c.label, why, r["log"])
    say(
        "  stopped as by `helm uninstall` (SIGTERM to every pod at once): "
        + ", ".join(f"{r['pod']}/{r['container']} code {r['code']} in {r['seconds']} s" for r in results)
    )
    return [{k: v for k, v in r.items() if k != "log"} for r in results]


# ---- the whole run ---------------------------------------------------------------------------------------


@dataclass
class Options:
    release: str = "smoke"
    namespace: str = "gyre"
    min_steps: int = 3
    timeout: float = 900
    max_restarts: int = 3
    fallbacks: dict[str, str] = field(default_factory=lambda: dict(f.split("=", 1) for f in DEFAULT_FALLBACKS))
    keep: bool = False


def render(values_files: list[Path], release: str, namespace: str) -> tuple[list[dict], str]:
    """The release's objects as the kind workflow installs it, and the cluster domain its values set."""
    import yaml

    chart = ROOT / "charts" / "gyre"
    values: dict = {}
    for path in values_files:
        values = merge_values(values, yaml.safe_load(path.read_text()) or {})
    defaults = yaml.safe_load((chart / "values.yaml").read_text())
    domain = merge_values(defaults, values).get("clusterDomain") or "cluster.local"
    docs = render_chart(chart, values, release=release, namespace=namespace, api_versions=MONITORING_APIS)
    return docs, domain


def run(objects: list[dict], options: Options, domain: str = "cluster.local") -> dict:
    """Plan, start, wait, check, tear down. Raises SmokeFailure (or WiringError) naming the pod and why."""
    started = time.monotonic()
    the_plan = plan(objects, namespace=options.namespace, release=options.release, domain=domain)
    workloads = the_plan.workload_pods
    say(
        f"plan: {len(workloads)} pods ({', '.join(p.name for p in workloads)}), {len(the_plan.test_pods)} test pods, "
        f"{len(the_plan.services)} Services, {len(the_plan.volumes)} volumes, "
        f"{len(the_plan.file_volumes)} ConfigMap/Secret volumes"
    )
    if the_plan.not_emulated:
        say(f"not emulated (the kind workflow covers them): {', '.join(the_plan.not_emulated)}")
    for note in the_plan.notes:
        say(f"note: {note}")
    images, substituted = resolve_images(the_plan, options.fallbacks)
    for note in substituted:
        say(f"image: {note}")
    check_non_root(the_plan, images)
    summary = {"images": {}}
    for ref in sorted(set(images.values())):
        size = int(docker("image", "inspect", "-f", "{{.Size}}", ref).strip())
        summary["images"][ref] = size
        say(f"image {ref}: {size / 1e6:.0f} MB")

    cluster = Cluster(the_plan, images, options.max_restarts)
    say(f"run id {cluster.run_id}: Docker objects labelled {LABEL}={cluster.run_id}")
    try:
        cluster.create_shared()
        cluster.start(workloads)
        cluster.wait_ready(workloads, time.monotonic() + options.timeout)
        summary["ready_s"] = round(time.monotonic() - started)
        say(f"all {len(workloads)} pods ready after {summary['ready_s']} s")
        monitor = cluster.start_monitor()
        summary.update(checks(cluster, options.min_steps, options.timeout))
        if not options.keep:
            cluster.stop_monitor.set()  # it would restart what exits
            monitor.join()
            summary["stop"] = stop_all(cluster)
        summary["seconds"] = round(time.monotonic() - started)
        return summary
    finally:
        if options.keep:
            say(f"--keep: left running; remove with: {Path(__file__).name} --clean")
        else:
            say(f"teardown: {cluster.teardown()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--values", "-f", action="append", type=Path, help="values file(s) (default: deploy/values-kind.yaml)"
    )
    parser.add_argument("--release", default="smoke", help="release name (default: smoke)")
    parser.add_argument("--namespace", "-n", default="gyre", help="namespace (default: gyre)")
    parser.add_argument("--min-steps", type=int, default=3, help="training steps to wait for (default: 3)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for readiness, and for the checks")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts of a container tolerated before the smoke fails (default: 3)",
    )
    parser.add_argument(
        "--image-fallback",
        action="append",
        default=[],
        metavar="NAME=IMAGE",
        help="run IMAGE where an image whose repository ends in NAME cannot be pulled "
        f"(default: {' '.join(DEFAULT_FALLBACKS)})",
    )
    parser.add_argument("--summary", type=Path, help="write the results as JSON here")
    parser.add_argument("--keep", action="store_true", help="leave the containers running (debugging)")
    parser.add_argument("--clean", action="store_true", help=f"remove every object labelled {LABEL} and exit")
    args = parser.parse_args(argv)
    if args.clean:
        say(remove_labelled(LABEL))
        return 0
    options = Options(args.release, args.namespace, args.min_steps, args.timeout, args.max_restarts, keep=args.keep)
    options.fallbacks.update(dict(f.split("=", 1) for f in args.image_fallback))
    values = args.values or [ROOT / "deploy" / "values-kind.yaml"]

    def terminate(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through run()'s teardown

    previous = signal.signal(signal.SIGTERM, terminate)
    say(f"== container smoke: release {args.release} in namespace {args.namespace}, values {[str(v) for v in values]}")
    try:
        objects, domain = render(values, args.release, args.namespace)
        summary = run(objects, options, domain)
    except (SmokeFailure, WiringError) as failure:
        say(f"\nSMOKE FAILED: {failure.where}: {failure.why}")
        if getattr(failure, "logs", ""):
            say(f"--- last log lines of {failure.where}:\n{failure.logs}")
        return 1
    except Unsupported as error:
        say(f"\nSMOKE FAILED: the container smoke cannot run this: {error}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")
    say(f"SMOKE PASSED in {summary['seconds']} s")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
