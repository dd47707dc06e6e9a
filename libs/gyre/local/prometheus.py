"""LocalPrometheus: a real Prometheus server (Debian's ``/usr/bin/prometheus``) scraping local services.

``gyre rl --prometheus`` starts one next to the three services so a user without a cluster can
query the same metrics the Grafana dashboards use; tests use it to prove every dashboard query and
alert expression against real data.

    prom = LocalPrometheus(out / "prometheus", {"trainer": ["127.0.0.1:9101"]}, run_id="demo")
    prom.start()                      # generated config, free port, waits for /-/ready
    prom.query("gyre_trainer_step")   # -> [{"metric": {...}, "value": [ts, "3"]}]
    prom.stop()

Unless told otherwise (``rule_files=``), the server loads Gyre's alert rules
(``deploy/prometheus/alerts.yaml``) when running from a source checkout, so a local run shows the same
alerts at ``/alerts`` as a cluster.

Every scraped series gets the target labels ``component`` (the job name), ``namespace="local"``
and ``run_id``, so the dashboards' ``namespace`` / ``run_id`` template variables work unchanged on a
local run. ``honor_labels`` is on: a label the service exports itself (e.g. ``run_id``) wins over
the target label instead of being renamed to ``exported_run_id``.

The TSDB lives under ``workdir/data`` and survives ``stop()``: starting a new LocalPrometheus on the
same ``workdir`` with no targets reopens a finished run's metrics for querying.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from gyre.fsio import write_atomic
from gyre.net import free_port
from gyre.proc import set_pdeathsig

PROMETHEUS = Path("/usr/bin/prometheus")
LOCAL_NAMESPACE = "local"
# libs/gyre/local/prometheus.py -> the repository root of a source checkout (absent in a wheel install)
BUNDLED_RULES = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "alerts.yaml"


class PrometheusError(RuntimeError):
    """The server could not start, or answered a query with an error (the message is Prometheus's)."""


def bundled_rule_files() -> list[Path]:
    """Gyre's alert rules when this is a source checkout (editable install), else nothing."""
    return [BUNDLED_RULES] if BUNDLED_RULES.is_file() else []


def render_config(
    targets: dict[str, list[str]],
    run_id: str,
    scrape_interval: str = "1s",
    rule_files: list[Path] | tuple[Path, ...] = (),
) -> str:
    """The prometheus.yml for `targets` ({job: ["host:port", ...]}) as text (JSON is valid YAML)."""
    jobs = []
    for job, addresses in targets.items():
        if not addresses:
            continue
        jobs.append(
            {
                "job_name": job,
                "honor_labels": True,
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "metrics_path": "/metrics",
                "static_configs": [
                    {
                        "targets": list(addresses),
                        "labels": {"component": job, "namespace": LOCAL_NAMESPACE, "run_id": run_id},
                    }
                ],
            }
        )
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": [str(Path(p).resolve()) for p in rule_files],
        "scrape_configs": jobs,
    }
    return json.dumps(config, indent=2) + "\n"


class LocalPrometheus:
    """A Prometheus child process on a free port of 127.0.0.1; `start()`/`stop()` or a context manager.

    Invariant: while started, `url` answers /-/ready and is this process (its reported TSDB path is
    ours, so a port grabbed by someone else's server is never mistaken for it); after `stop()` the
    process is gone and the TSDB is closed (safe to reopen).
    """

    def __init__(
        self,
        workdir: Path,
        targets: dict[str, list[str]],
        run_id: str,
        scrape_interval: str = "1s",
        *,
        rule_files: list[Path] | tuple[Path, ...] | None = None,
        binary: Path = PROMETHEUS,
        retention: str = "15d",
        startup_timeout: float = 60.0,
    ):
        self.workdir = Path(workdir)
        self.targets = {job: list(addresses) for job, addresses in targets.items()}
        self.run_id = run_id
        self.scrape_interval = scrape_interval
        # None: Gyre's own alert rules when available; () loads none
        self.rule_files = tuple(Path(p) for p in (bundled_rule_files() if rule_files is None else rule_files))
        self.binary = Path(binary)
        self.retention = retention
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def config_path(self) -> Path:
        return self.workdir / "prometheus.yml"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        if self.port is None:
            raise PrometheusError("LocalPrometheus is not started")
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> LocalPrometheus:
        if self.proc is not None:
            return self
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise PrometheusError(
                f"{self.binary} not found: install Debian's prometheus "
                "(apt-get install -y --no-install-recommends prometheus)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        # atomic, as the services' configs: a launch killed mid-write never leaves half a scrape config in the run
        config = render_config(self.targets, self.run_id, self.scrape_interval, self.rule_files)
        write_atomic(self.config_path, config.encode())
        last_error = ""
        for _ in range(3):  # a picked port can be taken before prometheus binds it
            self.port = free_port()
            args = [
                str(self.binary),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.data_dir}",
                f"--storage.tsdb.retention.time={self.retention}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # stop() signals the whole group; Ctrl-C of the parent does not race it
                    preexec_fn=set_pdeathsig,  # a SIGKILLed parent leaves no server behind
                )
            if self._wait_ready():
                return self
            last_error = f"exit code {self.proc.poll()}; log tail:\n{self._log_tail()}"
            self.stop()
        raise PrometheusError(f"{self.binary} did not become ready within {self.startup_timeout}s: {last_error}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        flags = self._get("/api/v1/status/flags")
                        return Path(flags.get("storage.tsdb.path", "")).resolve() == self.data_dir.resolve()
            except (OSError, PrometheusError):
                pass
            time.sleep(0.1)
        return False

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate (SIGTERM flushes the TSDB head), then kill after `timeout`; idempotent."""
        proc, self.proc = self.proc, None
        self.port = None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the pid is the group id thanks to start_new_session=True
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- HTTP API -------------------------------------------------------------------------------
    def _get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422 carry Prometheus's own error message
            try:
                body = json.loads(e.read())
            except ValueError:
                raise PrometheusError(f"GET {path}: HTTP {e.code}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """Instant query at unix time `at` (default: now); returns the result vector.

        A scalar result becomes one sample without labels. A bad query raises PrometheusError.
        """
        data = self._get("/api/v1/query", query=promql, time=at)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, promql: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """Range query (what a Grafana time-series panel runs); returns the matrix's series."""
        return self._get("/api/v1/query_range", query=promql, start=start, end=end, step=step)["result"]

    def label_values(
        self, label: str, match: str | None = None, start: float | None = None, end: float | None = None
    ) -> list[str]:
        """Values of `label` on series matching `match` (what Grafana's `label_values(match, label)` asks)."""
        params = {"match[]": match, "start": start, "end": end}
        return self._get(f"/api/v1/label/{urllib.parse.quote(label)}/values", **params)

    def targets_health(self) -> dict[str, str]:
        """{scrape url: "up" | "down" | "unknown"} of the active targets."""
        return {t["scrapeUrl"]: t["health"] for t in self._get("/api/v1/targets")["activeTargets"]}

    def wait_for_targets(self, timeout: float = 60.0) -> None:
        """Block until every configured target has been scraped successfully at least once."""
        expected = sum(len(a) for a in self.targets.values())
        deadline = time.monotonic() + timeout
        health: dict[str, str] = {}
        while time.monotonic() < deadline:
            health = self.targets_health()
            if len(health) == expected and all(h == "up" for h in health.values()):
                return
            time.sleep(0.2)
        raise PrometheusError(f"targets not all up after {timeout:.0f}s: {health}")

    def rules(self) -> list[dict]:
        """Every loaded rule (alerting and recording) with its `health` and `lastError`."""
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def __repr__(self) -> str:
        state = f"url={self.url}" if self.port else "stopped"
        return f"LocalPrometheus({self.workdir}, {state})"
