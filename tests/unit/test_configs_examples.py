"""Every example under configs/ is a valid experiment: it parses and every service section resolves."""

from __future__ import annotations

from pathlib import Path

import pytest
from gyre.config import load_config
from gyre.config.rl import RLConfig
from gyre.launcher import resolve_configs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "configs").rglob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_resolves(path, tmp_path):
    files = ["@", str(path)]
    if path.name.startswith("async"):  # overlays of the demo
        files = ["@", str(ROOT / "configs/reverse_text/demo.toml"), *files]
    cfg = load_config(RLConfig, [*files, "--output-dir", str(tmp_path)])
    resolved = resolve_configs(cfg, str(tmp_path / "model"), "redis://127.0.0.1:1/0")
    assert resolved["trainer"].max_steps == cfg.max_steps == resolved["orchestrator"].max_steps
    assert resolved["orchestrator"].batch.seq_len == resolved["trainer"].data.seq_len
    assert len(resolved["inference"]) == cfg.inference_replicas


def test_async_overlays_set_the_level():
    for k in (0, 1, 2):
        cfg = load_config(RLConfig, ["@", str(ROOT / f"configs/reverse_text/async{k}.toml")])
        assert cfg.orchestrator["max_async_level"] == k
