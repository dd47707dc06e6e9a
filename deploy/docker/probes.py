"""The kubelet's probes, run from the host: HTTP, TCP and gRPC health against a pod's published port, exec
with `docker exec` in the container."""

from __future__ import annotations

import socket
import ssl
import subprocess
import urllib.error
import urllib.request

from plan_model import Probe, Unsupported


def run_probe(probe: Probe, host_port: int | None, container: str) -> tuple[bool, str]:
    """(passed, what happened), from the host: HTTP, TCP and gRPC against the pod's published port (the
    kubelet dials the pod IP on that port), exec with `docker exec` in the container."""
    timeout = probe.timeout_s
    try:
        if probe.action == "http":
            scheme = probe.scheme.lower()
            request = urllib.request.Request(f"{scheme}://127.0.0.1:{host_port}{probe.path}", headers=probe.headers)
            context = ssl._create_unverified_context() if scheme == "https" else None  # the kubelet does not verify
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                return 200 <= response.status < 400, f"GET {probe.path}: HTTP {response.status}"
        if probe.action == "tcp":
            with socket.create_connection(("127.0.0.1", host_port), timeout=timeout):
                return True, f"TCP {probe.port}: open"
        if probe.action == "grpc":
            return grpc_serving(host_port, probe.service, timeout)
        if probe.action == "exec":
            proc = subprocess.run(
                ["docker", "exec", container, *probe.command], capture_output=True, text=True, timeout=timeout + 5
            )
            return proc.returncode == 0, f"exec {probe.command}: exit {proc.returncode} {proc.stderr.strip()[:200]}"
    except urllib.error.HTTPError as error:
        return False, f"GET {probe.path}: HTTP {error.code}"
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"{probe.action} probe on port {probe.port}: {type(error).__name__}: {error}"
    raise Unsupported(f"probe {probe}")


def grpc_serving(port: int | None, service: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            return False, f"grpc health: {error.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return status == "SERVING", f"grpc health: {status}"
