"""What the observability tests share: the catalogue (docs/metrics.md), the dashboards' queries and
variables, the alert rules, and the services' declared metrics.

PromQL is never parsed here beyond picking out metric names and Grafana's `$variables`; whether a query
is valid and returns data is always asked of a real Prometheus.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
CATALOGUE = ROOT / "docs" / "metrics.md"
DASHBOARD_DIR = ROOT / "charts" / "gyre" / "dashboards"
BUILD_DASHBOARDS = ROOT / "deploy" / "grafana" / "build_dashboards.py"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
CHART = ROOT / "charts" / "gyre"
CHART_RULES = CHART / "prometheus" / "rules.yaml"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

# Read by the alert rules when exported, with a documented fallback (the default async bound k = 1)
# while it is not: see the header of deploy/prometheus/alerts.yaml.
OPTIONAL_METRICS: set[str] = set()  # every metric the rules read is exported now
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
_METRIC = re.compile(r"\b(gyre_[a-z0-9_]+)")
_SELECTOR = re.compile(r"\b(gyre_[a-z0-9_]+)(\{[^}]*\})?")


# ---- catalogue --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CatalogueRow:
    name: str
    kind: str
    unit: str
    labels: tuple[str, ...]
    meaning: str


def catalogue(path: Path = CATALOGUE) -> dict[str, CatalogueRow]:
    """Rows of the metric tables in docs/metrics.md ("| `name` | type | unit | `l1`, `l2` | meaning |")."""
    rows: dict[str, CatalogueRow] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`gyre_"):
            continue
        name = cells[0].strip("`")
        if name in rows:
            raise AssertionError(f"{name} is listed twice in {path}")
        labels = tuple(label.strip().strip("`") for label in cells[3].split(",") if label.strip())
        rows[name] = CatalogueRow(name, cells[1], cells[2], labels, cells[4])
    return rows


def series_base(name: str, histograms: set[str]) -> str:
    """`x_bucket` / `x_sum` / `x_count` of a histogram `x` -> `x`; any other name unchanged."""
    for suffix in HISTOGRAM_SERIES:
        if name.endswith(suffix) and name.removesuffix(suffix) in histograms:
            return name.removesuffix(suffix)
    return name


def metric_names(expr: str) -> set[str]:
    """gyre_ metric names in `expr` (label values and regex matchers in quotes are not names)."""
    return set(_METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, "{...}" or "") for every gyre_ metric in `expr`."""
    return _SELECTOR.findall(expr)


# Labels a scrape adds to every series: Prometheus's `job` and `instance`; the Prometheus operator's `namespace`,
# `service`, `pod`, `container`, `endpoint` (and `node`); the chart's ServiceMonitors' `gyre_release`; `gyre rl
# --prometheus`'s `namespace` and `component`. docs/metrics.md, Conventions.
SCRAPE_LABELS = frozenset(
    {"job", "instance", "namespace", "service", "pod", "container", "endpoint", "node", "gyre_release", "component"}
)
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def series_labels(name: str, rows: dict) -> set[str]:
    """The labels a series `name` can carry: its catalogue row's, `le` on a histogram's buckets, the scrape's."""
    histograms = {n for n, r in rows.items() if r.kind == "histogram"}
    base = series_base(name, histograms)
    own = set(rows[base].labels) if base in rows else set()
    return own | SCRAPE_LABELS | ({"le"} if name.endswith("_bucket") and base in histograms else set())


def _parenthesised(expr: str, start: int) -> str:
    """The text inside the first balanced (...) at or after `start`."""
    open_at = expr.index("(", start)
    depth = 0
    for i in range(open_at, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return expr[open_at + 1 : i]
    raise AssertionError(f"unbalanced parentheses in {expr!r}")


def label_problems(expr: str, rows: dict) -> list[str]:
    """Label names in `expr` no series can carry: a selector's matcher on a label its metric lacks, an aggregation
    `by (...)` over a label none of the metrics it aggregates has, an `on`/`ignoring`/`group_*` label of no metric
    in the expression. Such a query is valid PromQL and silently returns nothing, or one line instead of several."""
    problems = []
    text = re.sub(r'"[^"]*"', '""', expr)
    # `{__name__=~"gyre_orchestrator_.+"}` selects the metrics its regex matches (taken for the whole expression)
    by_name = {n for regex in re.findall(r'__name__\s*=~?\s*"([^"]*)"', expr) for n in rows if re.fullmatch(regex, n)}
    for metric, matchers in _SELECTOR.findall(text):
        for label in _MATCHER.findall(matchers):
            if label not in series_labels(metric, rows):
                problems.append(f"{metric} has no label {label}")
    for match in _GROUPING.finditer(text):
        keyword, labels = match.group(1), [x.strip() for x in match.group(2).split(",") if x.strip()]
        tail = text[match.end() :]
        # `sum by (x) (...)` aggregates what follows it; a join's labels (and the rarer `sum (...) by (x)`) are
        # looked up in the whole expression
        scope = _parenthesised(text, match.end()) if keyword in ("by", "without") and tail.lstrip()[:1] == "(" else text
        known = set().union(set(), *(series_labels(m, rows) for m in metric_names(scope) | by_name))
        for label in labels:
            if label not in known | SCRAPE_LABELS:
                problems.append(f"{keyword} ({label}): no metric it applies to has that label")
    return problems


def rated_metrics(expr: str) -> set[str]:
    """Metric names that appear inside rate(...) / increase(...) / irate(...)."""
    found = set()
    for match in re.finditer(r"\b(?:rate|irate|increase)\(\s*(gyre_[a-z0-9_]+)", expr):
        found.add(match.group(1))
    return found


# ---- dashboards -------------------------------------------------------------------------------------
def load_build_dashboards():
    """deploy/grafana/build_dashboards.py as a module. It is a script that imports the `dashboards`
    package next to it, so its folder goes on sys.path as it does when the script runs."""
    folder = str(BUILD_DASHBOARDS.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(BUILD_DASHBOARDS.stem)


def dashboards() -> dict[str, dict]:
    """{file name: dashboard model} of every dashboard the chart ships."""
    found = {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}
    assert found, f"no dashboards under {DASHBOARD_DIR}"
    return found


def panels(model: dict) -> list[dict]:
    """Every panel, including those nested in (collapsed) rows; rows themselves left out."""
    out = []
    for panel in model.get("panels", []):
        if panel.get("type") == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}: {self.expr}"


def panel_queries() -> list[PanelQuery]:
    return [
        PanelQuery(name, panel["title"], target["refId"], target["expr"])
        for name, model in dashboards().items()
        for panel in panels(model)
        for target in panel.get("targets", [])
    ]


@dataclass(frozen=True)
class Variable:
    name: str
    match: str  # series selector of label_values(match, label)
    label: str


def query_variables(model: dict) -> list[Variable]:
    """The dashboard's `label_values(selector, label)` query variables, in order."""
    out = []
    for var in model["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
        m = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", query.strip())
        assert m, f"variable {var['name']}: unsupported query {query!r}"
        out.append(Variable(var["name"], m.group(1), m.group(2)))
    return out


def promql_regex_escape(value: str) -> str:
    """Escape regex metacharacters inside a PromQL string literal, as Grafana does (`a.b` -> `a\\\\.b`):
    the backslash itself must be doubled because the regex lives in a double-quoted string."""
    return re.sub(r"([\\.+*?^$()\[\]{}|])", r"\\\\\1", value)


def substitute(expr: str, values: dict[str, list[str]], rate_interval: str) -> str:
    """Grafana's interpolation for the variables the dashboards use: `=~` selectors get a regex
    alternation of the chosen values; `$__rate_interval` becomes a fixed window."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name, chosen in sorted(values.items(), key=lambda kv: -len(kv[0])):
        regex = "|".join(promql_regex_escape(v) for v in chosen)
        expr = expr.replace(f"${{{name}}}", regex).replace(f"${name}", regex)
    assert "$" not in expr, f"unsubstituted variable left in {expr!r}"
    return expr


# ---- alerts ---------------------------------------------------------------------------------------
def alert_rules(path: Path = ALERTS) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


# ---- the services' metrics ---------------------------------------------------------------------------
def service_registries() -> dict[str, object]:
    """A fresh metrics registry of each service, built by the services' own metrics classes."""
    from gyre_inference.metrics import InferenceMetrics
    from gyre_inference.torch_backend import TorchBackend
    from gyre_orchestrator.metrics import OrchestratorMetrics
    from gyre_trainer.metrics import TrainerMetrics

    # An unstarted backend: constructing it loads nothing; the gauges read its (empty) load at scrape time.
    backend = TorchBackend(ROOT / "no-model-needed", device="cpu", dtype="float32")
    return {
        "trainer": TrainerMetrics("catalogue").registry,
        "orchestrator": OrchestratorMetrics("catalogue").registry,
        "inference": InferenceMetrics("catalogue", backend).registry,
    }


def declared(registry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{exposed name: (kind, label names)} of the metrics created on `registry` via gyre.metrics.

    Label names are not in an exposition until a child exists, so they are read from the
    get-or-create table of gyre.metrics (every service creates its metrics through it).
    """
    from gyre import metrics

    return {name: (kind, labels) for name, (kind, labels, _metric) in metrics._made.get(registry, {}).items()}


def exposition_families(text: str) -> dict[str, str]:
    """{exposed metric name: type} from the `# TYPE` lines of a text exposition (counters get `_total`).

    prometheus_client adds an `x_created` gauge family next to each counter and histogram `x`; those
    companions are left out (they are timestamps, not metrics of their own).
    """
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            out[name + "_total" if kind == "counter" and not name.endswith("_total") else name] = kind
    for name in [n for n in out if n.endswith("_created")]:
        stem = name.removesuffix("_created")
        if out.get(stem) == "histogram" or out.get(stem + "_total") == "counter":
            del out[name]
    return out
