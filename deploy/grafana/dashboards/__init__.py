"""Gyre's Grafana dashboards, one module each (overview, inference, trainer), built from the shared
query and panel helpers in `panels`. deploy/grafana/build_dashboards.py lists them and writes the JSON."""
