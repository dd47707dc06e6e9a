"""The EndpointSlice part of a Kubernetes API server, for the orchestrator's `kubernetes` replica discovery.

No Kubernetes server can run here; this small HTTP server answers what the real `kubernetes` client asks
for when it lists and watches a Service's EndpointSlices: the JSON list (with a resourceVersion) and the
newline-delimited watch stream, which it ends after a second without events, as API servers end watches
now and then (the client must then list again). `apply` / `delete` change a slice the way the EndpointSlice
controller does (the listing and an event). `kubeconfig` writes a kubeconfig pointing at it.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def slice_json(name: str, ips_ready: dict[str, bool], http=8000, control=50051, service: str = "inf") -> dict:
    """An EndpointSlice of `service`: one endpoint per IP (ready or not), named ports `http` and `control`."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "resourceVersion": "1", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in ips_ready.items()],
        "ports": [{"name": "http", "port": http, "protocol": "TCP"}, {"name": "control", "port": control}],
    }


class FakeKubeAPI:
    """List and watch of the EndpointSlices of `service` in `namespace`, over HTTP, as the API server serves them."""

    def __init__(self, namespace: str = "gyre", service: str = "inf"):
        self.namespace, self.service = namespace, service
        self.slices: dict[str, dict] = {}
        self.events: queue.Queue = queue.Queue()
        self.requests: list[dict] = []
        self.errors: list[str] = []  # requests for anything else (a test asserts it stays empty)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                api.requests.append({"path": url.path, **query})
                expected = f"/apis/discovery.k8s.io/v1/namespaces/{api.namespace}/endpointslices"
                if url.path != expected or query.get("labelSelector") != f"kubernetes.io/service-name={api.service}":
                    api.errors.append(self.path)
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if query.get("watch") not in ("true", "True"):
                    listing = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                               "metadata": {"resourceVersion": "10"}, "items": list(api.slices.values())}  # fmt: skip
                    body = json.dumps(listing)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body.encode())
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while True:
                    try:
                        event = api.events.get(timeout=1.0)
                    except queue.Empty:
                        break  # the API server ends watches now and then: the client must re-list
                    line = (json.dumps(event) + "\n").encode()
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def apply(self, endpoint_slice: dict) -> None:
        """Create or change a slice: in the listing and as a watch event."""
        name = endpoint_slice["metadata"]["name"]
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.slices[name] = endpoint_slice
        self.events.put({"type": kind, "object": endpoint_slice})

    def delete(self, name: str) -> None:
        self.events.put({"type": "DELETED", "object": self.slices.pop(name)})

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig whose current context is this server (plain HTTP, a dummy token)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "unused"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": self.namespace}}],
        }  # fmt: skip
        path.write_text(json.dumps(config))
        return path

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
