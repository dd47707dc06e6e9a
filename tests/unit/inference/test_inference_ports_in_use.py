"""A busy port stops `gyre inference` at start with one line naming the option, and what it started stops too."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


@pytest.mark.parametrize("option", ["control.port", "server.port", "metrics.port"])
def test_a_busy_port_is_one_line_naming_its_option_and_what_started_is_stopped(tiny_model, option):
    # the metrics port was bound after the HTTP and gRPC servers started: a traceback, and the gRPC server, never
    # stopped, complained from its finalizer once the event loop was closed ("Exception ignored ... loop is closed")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"server.port": "0", "control.port": "0", "metrics.port": "0", option: str(port)}
        argv = [sys.executable, "-m", "gyre.cli", "inference", "--model.name", str(tiny_model)]
        argv += [arg for key, value in ports.items() for arg in (f"--{key}", value)]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"--{option}" in res.stderr and str(port) in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr[-2000:]
