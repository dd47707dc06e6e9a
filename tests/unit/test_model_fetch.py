"""`gyre model fetch` (the chart's model-fetch init container): a model that fits the cache is downloaded
where the services look for it; one that does not fit fails at once with the sizes, downloading nothing.

There is no Hugging Face hub here, so the real `gyre model fetch` CLI and the real huggingface_hub client
talk to a small local HTTP server that serves one repository the way the hub does (the repository API
and the `resolve` file endpoint with the hub's commit, ETag and size headers): the stand-in is the hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-lm"
MIB = 2**20


class FakeHub:
    """One model repository: JSON files and a 3 MiB safetensors file, plus a .bin copy nobody should fetch."""

    def __init__(self):
        self.files = {
            "config.json": json.dumps({"model_type": "llama"}).encode(),
            "tokenizer.json": b"{}",
            "model.safetensors": os.urandom(3 * MIB),
            "pytorch_model.bin": os.urandom(2 * MIB),
        }
        self.downloads: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _file(self) -> tuple[str, bytes] | None:
                path = unquote(urlsplit(self.path).path)
                prefix = f"/{REPO}/resolve/"
                if not path.startswith(prefix):
                    return None
                name = path[len(prefix) :].split("/", 1)[1]
                return (name, hub.files[name]) if name in hub.files else None

            def _headers(self, name: str, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hub.etag(name)}"')
                self.end_headers()

            def do_HEAD(self):  # noqa: N802
                found = self._file()
                if found is None:
                    self.send_error(404)
                    return
                self._headers(*found)

            def do_GET(self):  # noqa: N802
                path = urlsplit(self.path).path
                if path.startswith(f"/api/models/{REPO}/tree/"):  # the file listing, with sizes
                    body = json.dumps([hub.entry(n) for n in hub.files]).encode()
                elif path.startswith(f"/api/models/{REPO}"):  # the repository (its commit and files)
                    info = {"id": REPO, "modelId": REPO, "sha": COMMIT, "private": False,
                            "siblings": [{"rfilename": n} for n in hub.files]}  # fmt: skip
                    body = json.dumps(info).encode()
                else:
                    body = None
                if body is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                found = self._file()
                if found is None:
                    self.send_error(404)
                    return
                hub.downloads.append(found[0])
                self._headers(*found)
                self.wfile.write(found[1])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def etag(self, name: str) -> str:
        """The hub's ETag: the sha256 of an LFS file (weights), the git blob id of any other."""
        body = self.files[name]
        if name.endswith((".safetensors", ".bin")):
            return hashlib.sha256(body).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()

    def entry(self, name: str) -> dict:
        """One file of the tree listing, as the hub's API returns it."""
        body = self.files[name]
        entry = {"type": "file", "path": name, "size": len(body), "oid": self.etag(name)}
        if name.endswith((".safetensors", ".bin")):
            entry["lfs"] = {"oid": self.etag(name), "size": len(body), "pointerSize": 134}
        return entry

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    fake = FakeHub()
    yield fake
    fake.close()


def fetch(hub: FakeHub, home, *args: str) -> subprocess.CompletedProcess:
    # CI runs offline (HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1: huggingface_hub honours both); the fake hub is local
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1")
    return subprocess.run([sys.executable, "-m", "gyre.cli", "model", "fetch", "--name", REPO, *args],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip


def test_a_model_that_does_not_fit_fails_at_once_with_the_sizes_and_downloads_nothing(hub, tmp_path):
    home = tmp_path / "huggingface"
    done = fetch(hub, home, "--max-size", str(2 * MIB), "--size-setting", "modelCache.size")
    assert done.returncode == 1, done.stderr
    message = done.stderr.strip().splitlines()[-1]
    # 3 MiB of weights and two small JSON files, in a cache limited to 2 MiB
    assert message.startswith(f"gyre model fetch: error: {REPO} needs 3.0 MiB more in {home} but only 2.0 MiB fit"), (
        message
    )
    assert "raise modelCache.size" in message and "nothing was downloaded" in message
    assert hub.downloads == []
    assert not list(home.rglob("*.safetensors"))


def test_a_model_that_fits_lands_where_the_services_load_it_without_other_weight_formats(hub, tmp_path):
    home = tmp_path / "huggingface"
    done = fetch(hub, home, "--cache-dir", str(home), "--max-size", str(8 * MIB))
    assert done.returncode == 0, done.stderr
    assert sorted(hub.downloads) == ["config.json", "model.safetensors", "tokenizer.json"]  # no .bin
    snapshot = home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert str(snapshot) in done.stdout
    # what a service then loads offline (HF_HUB_OFFLINE=1 in the chart): the cached file, by hub id
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    probe = "from huggingface_hub import hf_hub_download; print(hf_hub_download('acme/tiny-lm', 'config.json'))"
    cached = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert cached.returncode == 0 and cached.stdout.strip() == str(snapshot / "config.json"), cached.stderr
    # a second fetch finds everything cached: nothing more to download, even with no room left
    hub.downloads.clear()
    again = fetch(hub, home, "--max-size", str(MIB))
    assert again.returncode == 0, again.stderr
    assert hub.downloads == []
