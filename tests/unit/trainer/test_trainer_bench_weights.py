"""`gyre bench weights` end to end: tiny model, one real `gyre inference` replica, two versions."""

from __future__ import annotations

import math

from gyre_trainer.bench_weights import WeightsBenchConfig, disk_write_read, run_bench


def test_disk_reference_writes_and_reads_the_bytes(tmp_path):
    write_s, read_s = disk_write_read(tmp_path, 3 << 20)
    assert write_s > 0 and read_s > 0 and list(tmp_path.iterdir()) == []


def test_bench_brings_the_replica_to_every_version_and_reports_a_ratio(tmp_path):
    m = run_bench(WeightsBenchConfig(replicas=1, rounds=2, dir=tmp_path))
    assert m["bytes"] > 1_000_000  # the tiny model's safetensors and tokenizer
    assert m["swap"] >= m["publish"] > 0 and m["relay"] >= m["load"] > 0 and m["gather"] > 0
    assert math.isclose(m["ratio"], m["swap"] / m["disk"])
    assert not (tmp_path / "weights").exists()
