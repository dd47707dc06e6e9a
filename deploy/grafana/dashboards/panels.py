"""What every dashboard is built from: PromQL helpers that filter each query on the experiment
(`$namespace`, `$run_id`), the time-series and stat panels (datasource and unit always set), the
template variables and the base dashboard (tags, links, refresh). One home, so all dashboards agree."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig, VizLegendOptions
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    StackingMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every query filters on the experiment; `run_id` is exported by the services themselves and
# `namespace` is added by the scrape (kube-prometheus-stack, or LocalPrometheus's "local").
RUN = 'namespace=~"$namespace", run_id=~"$run_id"'
RATE = "$__rate_interval"
TAGS = ["gyre"]

# Units (Grafana unit ids; "suffix:" makes a custom one).
TOKENS_PER_S = "suffix: tok/s"
STEPS = "suffix: steps"
NATS = "suffix: nats"


def sel(metric: str, extra: str = "") -> str:
    """`metric{namespace=~"$namespace", run_id=~"$run_id"[, extra]}`."""
    return f"{metric}{{{RUN}{', ' + extra if extra else ''}}}"


def rate(metric: str, by: str = "run_id", extra: str = "") -> str:
    return f"sum by ({by}) (rate({sel(metric, extra)}[{RATE}]))"


def rate_ratio(numerator: str, denominator: str, by: str = "run_id", extra: str = "") -> str:
    """rate(numerator{extra}) / rate(denominator), both summed by `by` (a share, or a mean per event)."""
    return f"{rate(numerator, by, extra)} / {rate(denominator, by)}"


def mean_of(histogram: str, by: str = "run_id") -> str:
    """Mean of a histogram's observations over the rate window."""
    return f"{rate(histogram + '_sum', by)} / {rate(histogram + '_count', by)}"


def quantile(q: float, histogram: str, by: str = "run_id", extra: str = "") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({sel(histogram + '_bucket', extra)}[{RATE}])))"


# Replica-wide inference series (load, engine, KV cache) carry the replica's own run_id: a replica serves every
# run of a multi-run experiment, whose runs are told apart only in its per-request and per-adapter series
# (docs/metrics.md). They are shown for the replicas serving a chosen run: those exporting its served version.
SERVING = f"and on (namespace, instance) {sel('gyre_inference_policy_version')}"


def replica_sel(metric: str, extra: str = "") -> str:
    """`metric{namespace=~"$namespace"[, extra]}`: a replica-wide series, to be limited by `SERVING`."""
    return f'{metric}{{namespace=~"$namespace"{", " + extra if extra else ""}}}'


def replica_rate(metric: str, by: str = "instance", extra: str = "") -> str:
    return f"sum by ({by}) (rate({replica_sel(metric, extra)}[{RATE}]) {SERVING})"


def replica_gauge(aggregation: str, metric: str, by: str = "instance") -> str:
    return f"{aggregation} by ({by}) ({replica_sel(metric)} {SERVING})"


def query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def panel(
    title: str,
    unit: str,
    queries: list[tuple[str, str]],
    description: str,
    *,
    width: int = 8,
    height: int = 8,
    minimum: float | None = None,
    stacked: bool = False,
) -> timeseries.Panel:
    """A time-series panel; `queries` are (PromQL, legend) pairs."""
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .fill_opacity(10 if not stacked else 40)
        .legend(
            VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
        )
    )
    if minimum is not None:
        p = p.min(minimum)
    if stacked:
        p = p.stacking(StackingConfig().mode(StackingMode.NORMAL))
    for i, (expr, legend) in enumerate(queries):
        p = p.with_target(query(expr, legend, chr(ord("A") + i)))
    return p


def stat_panel(title: str, unit: str, expr: str, description: str, width: int = 4) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(4)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(BigValueGraphMode.AREA)
        .color_mode(BigValueColorMode.VALUE)
        .with_target(query(expr, "{{run_id}}", "A"))
    )


def variables(anchor_metric: str) -> list:
    """datasource, namespace and run_id variables; `anchor_metric` is exported by every experiment (a metric name,
    or several as `a|b`: an experiment is listed while any of them has been scraped in the time range)."""
    if "|" in anchor_metric:
        everywhere, in_namespace = f'{{__name__=~"{anchor_metric}"}}', f'{{__name__=~"{anchor_metric}", '
    else:
        everywhere, in_namespace = anchor_metric, f"{anchor_metric}{{"
    datasource = db.DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus")
    namespace = (
        db.QueryVariable("namespace")
        .id("namespace")
        .label("Namespace")
        .datasource(DATASOURCE)
        .query(f"label_values({everywhere}, namespace)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )
    run_id = (
        db.QueryVariable("run_id")
        .id("run_id")
        .label("Experiment")
        .datasource(DATASOURCE)
        .query(f'label_values({in_namespace}namespace=~"$namespace"}}, run_id)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    return [datasource, namespace, run_id]


def base(uid: str, title: str, description: str, anchor_metric: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .variables(variables(anchor_metric))
        .link(
            db.DashboardLink("Gyre dashboards")
            .type(DashboardLinkType.DASHBOARDS)
            .tags(TAGS)
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
