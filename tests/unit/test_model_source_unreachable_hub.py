"""A hub id on a machine that cannot reach the hub: said at once, and a cached model still loads.

`check_model_source` (every `gyre rl` / `gyre sft` / service start with a hub id) asked transformers for the config,
and the hub client retried each request five times with a growing backoff: a user without network (or behind a
firewall) read "Retrying in 1s [Retry 1/5]" ... "Retrying in 8s [Retry 5/5]" for 25 s before the one line that
matters. Now one request says the hub is unreachable, and the check then looks in the hub cache alone: a model
cached there (fetched earlier, or by the chart's model-fetch) still passes.

The hub here is a port nobody listens on (HF_ENDPOINT), in a child process: the hub client reads its settings when
it is imported.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

CHECK = """
from gyre.model_source import ModelUnavailable, check_model_source
try:
    print("loaded as", check_model_source("acme/tiny-lm"))
except ModelUnavailable as e:
    print("unavailable:", e)
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: connections are refused


def check(home, endpoint: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, env=env)


def test_an_unreachable_hub_is_said_at_once_with_the_address_and_the_cache_looked_in(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    done = check(tmp_path / "hf", endpoint)
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip()
    assert said.startswith("unavailable: model.name = 'acme/tiny-lm' is not a local folder"), said
    assert f"cannot reach {endpoint} (" in said and f"not in the hub cache {tmp_path / 'hf' / 'hub'}" in said, said
    assert "Retrying" not in done.stderr, done.stderr  # one request, no backoff


def test_a_model_in_the_hub_cache_is_found_there_without_retrying_the_hub(tmp_path):
    # the hub cache's layout (huggingface_hub's "Manage your cache" docs): refs/main names the snapshot
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-lm"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "vocab_size": 300}')
    # a model, not a config alone: the snapshot gets a model folder's checks (test_model_source_hub_cache.py)
    (snapshot / "model.safetensors").write_bytes(b"")
    (snapshot / "tokenizer.json").write_text("{}")
    done = check(tmp_path / "hf", f"http://127.0.0.1:{closed_port()}")
    assert done.returncode == 0 and done.stdout.strip() == "loaded as hub id", (done.stdout, done.stderr)
    assert "Retrying" not in done.stderr, done.stderr
