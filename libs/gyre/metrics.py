"""Prometheus helpers: metrics that follow the naming conventions, and the /metrics HTTP server.

Conventions (enforced by `check_metric_name`, so a bad name fails at import time, not in a dashboard):
- `gyre_` prefix, lower snake case, no colons (reserved for recording rules), no `__`;
- base units with a unit suffix (`_seconds`, `_bytes`), never `_ms`/`_milliseconds`/`_percent`;
  ratios are `_ratio` in 0..1;
- `_total` on counters and only on counters (throughput is a counter that dashboards `rate()`).

Names are given exactly as they appear in PromQL (`counter("gyre_trainer_tokens_total", ...)`).
prometheus_client (0.20+) strips a trailing `_total` from a counter's name and appends it again
when exposing; we pass the stem explicitly so the exposed name does not depend on that munging.

The helpers are get-or-create per registry: asking twice for the same name with the same kind and
labels returns the same metric (modules can be re-imported, tests can build two servers), asking
with a different kind or labels raises.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_NAME = re.compile(r"^gyre_[a-z][a-z0-9_]*[a-z0-9]$")
_LABEL = re.compile(r"^[a-z][a-z0-9_]*$")
_BAD_UNITS = ("_ms", "_milliseconds", "_microseconds", "_us", "_ns", "_kb", "_mb", "_gb", "_percent", "_pct")
_RESERVED_SUFFIXES = ("_bucket", "_count", "_sum", "_created", "_info")
KINDS = ("counter", "gauge", "histogram")

_lock = threading.Lock()
_made: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, tuple[str, tuple[str, ...], object]]] = (
    weakref.WeakKeyDictionary()
)


def check_metric_name(name: str, kind: str, labels: Sequence[str] = ()) -> None:
    """Raise ValueError unless `name` (as exposed) and `labels` follow the conventions for `kind`."""
    if kind not in KINDS:
        raise ValueError(f"unknown metric kind {kind!r}; expected one of {KINDS}")
    if not _NAME.match(name) or "__" in name:
        raise ValueError(f"metric {name!r}: must match {_NAME.pattern} (gyre_ prefix, lower snake case, no colons)")
    if kind == "counter" and not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end with _total")
    if kind != "counter" and name.endswith("_total"):
        raise ValueError(f"{kind} {name!r} must not end with _total (only counters do)")
    stem = name.removesuffix("_total")
    if stem.endswith(_RESERVED_SUFFIXES):
        raise ValueError(f"metric {name!r}: suffixes {_RESERVED_SUFFIXES} are reserved for the series of a metric")
    if any(stem.endswith(bad) or f"{bad}_" in stem for bad in _BAD_UNITS):
        raise ValueError(f"metric {name!r}: use base units (_seconds, _bytes, _ratio), not {_BAD_UNITS}")
    for label in labels:
        if not _LABEL.match(label):
            raise ValueError(f"metric {name!r}: label {label!r} must be lower snake case")
        if kind == "histogram" and label == "le":
            raise ValueError(f"histogram {name!r}: label 'le' is reserved")
    if len(set(labels)) != len(labels):
        raise ValueError(f"metric {name!r}: duplicate labels {list(labels)}")


def _get_or_create(kind: str, name: str, doc: str, labels: Sequence[str], registry, make):
    labels = tuple(labels)
    check_metric_name(name, kind, labels)
    if not doc:
        raise ValueError(f"metric {name!r} needs a description")
    registry = REGISTRY if registry is None else registry
    with _lock:
        made = _made.setdefault(registry, {})
        if name in made:
            old_kind, old_labels, metric = made[name]
            if (old_kind, old_labels) != (kind, labels):
                raise ValueError(f"metric {name!r} already exists as {old_kind} with labels {list(old_labels)}")
            return metric
        metric = make(registry)
        made[name] = (kind, labels, metric)
        return metric


def counter(name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry | None = None) -> Counter:
    """A counter exposed as `name` (which must end with `_total`)."""
    stem = name.removesuffix("_total")
    return _get_or_create(
        "counter", name, doc, labels, registry, lambda r: Counter(stem, doc, tuple(labels), registry=r)
    )


def gauge(name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry | None = None) -> Gauge:
    return _get_or_create("gauge", name, doc, labels, registry, lambda r: Gauge(name, doc, tuple(labels), registry=r))


class _FunctionFamily:
    """A counter or gauge family whose samples are read at scrape time ({label values: value})."""

    def __init__(self, family, name: str, doc: str, labels: tuple[str, ...], read: Callable[[], dict[tuple, float]]):
        self.family, self.name, self.doc, self.labels, self.read = family, name, doc, labels, read

    def describe(self):
        return [self.family(self.name, self.doc, labels=self.labels)]

    def collect(self):
        family = self.family(self.name, self.doc, labels=self.labels)
        for values, value in self.read().items():
            family.add_metric(values, value)
        yield family


def _function(kind: str, name: str, doc: str, labels: Sequence[str], registry, read) -> _FunctionFamily:
    # prometheus_client's counter family takes the stem and appends `_total` itself
    family, exposed = (
        (CounterMetricFamily, name.removesuffix("_total")) if kind == "counter" else (GaugeMetricFamily, name)
    )

    def make(r):
        collector = _FunctionFamily(family, exposed, doc, tuple(labels), read)
        (REGISTRY if r is None else r).register(collector)
        return collector

    return _get_or_create(kind, name, doc, labels, registry, make)


def counter_function(
    name: str,
    doc: str,
    labels: Sequence[str],
    registry: CollectorRegistry | None,
    read: Callable[[], dict[tuple, float]],
) -> _FunctionFamily:
    """A counter exposed as `name` whose samples `read()` returns at each scrape ({label values: value}, never
    decreasing): for counters something else keeps (an engine thread's statistics), like `Gauge.set_function`."""
    return _function("counter", name, doc, labels, registry, read)


def gauge_function(
    name: str,
    doc: str,
    labels: Sequence[str],
    registry: CollectorRegistry | None,
    read: Callable[[], dict[tuple, float]],
) -> _FunctionFamily:
    """A gauge exposed as `name` whose samples `read()` returns at each scrape ({label values: value}): like
    `Gauge.set_function`, for a set of series that changes (one per adapter a server serves now)."""
    return _function("gauge", name, doc, labels, registry, read)


def histogram(
    name: str,
    doc: str,
    labels: Sequence[str] = (),
    registry: CollectorRegistry | None = None,
    buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
) -> Histogram:
    return _get_or_create(
        "histogram",
        name,
        doc,
        labels,
        registry,
        lambda r: Histogram(name, doc, tuple(labels), registry=r, buckets=tuple(buckets)),
    )


def start_metrics_server(
    port: int, registry: CollectorRegistry | None = None, host: str = "0.0.0.0"
) -> tuple[WSGIServer, int]:
    """Serve `/metrics` from a daemon thread; `port=0` picks a free port. Returns (server, actual port).

    The default host is all interfaces because Prometheus scrapes pods from outside; tests and local
    tools pass `host="127.0.0.1"`. Stop with `server.shutdown(); server.server_close()`.
    """
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY if registry is None else registry)
    return server, int(server.server_port)
