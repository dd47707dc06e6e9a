"""Gyre's Grafana dashboards as code (grafana-foundation-sdk) -> charts/gyre/dashboards/*.json.

    .venv/bin/python deploy/grafana/build_dashboards.py           # write the JSON files
    .venv/bin/python deploy/grafana/build_dashboards.py --check   # exit 1 if they are stale

The chart ships every ``charts/gyre/dashboards/*.json`` as a ConfigMap for the Grafana sidecar.
Three dashboards: the experiment overview, inference, trainer. Every query is filtered by the
``namespace`` and ``run_id`` template variables and every panel has a unit; the metric names are the
services' real ones (docs/metrics.md). tests/integration/observability proves that every query returns
data from a real Prometheus scraping a real `gyre rl` run, and that the JSON files are up to date.

This file is the command and the list of dashboards; each dashboard is a module of the `dashboards`
package next to it, built from the shared helpers in `dashboards/panels.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dashboards.inference import inference
from dashboards.overview import overview
from dashboards.trainer import trainer
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "charts" / "gyre" / "dashboards"

DASHBOARDS = {"overview.json": overview, "inference.json": inference, "trainer.json": trainer}


def to_json(dashboard: db.Dashboard) -> dict:
    """The dashboard as plain JSON, panels numbered 1.. in layout order (links and viewPanel need ids)."""
    model = json.loads(json.dumps(dashboard.build(), cls=JSONEncoder))
    for i, p in enumerate(model["panels"], start=1):
        p["id"] = i
    return model


def render() -> dict[str, str]:
    """{file name: dashboard JSON text}."""
    return {name: json.dumps(to_json(make()), indent=2, sort_keys=True) + "\n" for name, make in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if the files differ from the code.")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="Where to write (default: the chart).")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out_dir / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (run {Path(__file__).relative_to(ROOT)}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
