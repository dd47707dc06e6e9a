"""The local application: what runs on one machine around the services, not a contract between them.

- `launcher`: `gyre rl`, the three services as child processes around an embedded Redis;
- `runs`: an experiment's runs (a single run is N = 1) and one validated config per service;
- `progress`: the console progress bar, read from the event logs;
- `report`: `gyre report` and the end-of-run summary;
- `prometheus`: a local Prometheus scraping the services (`gyre rl --prometheus`);
- `bench_async`: `gyre bench async`.

The services never import this package; what they share with it (configs, event logs, the ready line,
the run's committed step) lives at the top of `gyre`.
"""
