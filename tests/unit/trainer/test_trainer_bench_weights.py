"""`gyre bench weights` end to end: tiny model, one real `gyre inference` replica, two versions."""

from __future__ import annotations

import math

from gyre_trainer.bench_weights import WeightsBenchConfig, disk_write_read, run_bench


def test_disk_reference_writes_and_reads_the_bytes(tmp_path):
    write_s, read_s = disk_write_read(tmp_path, 3 << 20)
    assert write_s > 0 and read_s > 0 and list(tmp_path.iterdir()) == []


def test_bench_brings_the_replica_to_every_version_and_reports_a_ratio(tmp_path):
    # --dir on a run's folder (the volume to measure): the bench published into its weights/, pruned the run's
    # versions and deleted the folder at the end; it works in a folder of its own there now
    kept = tmp_path / "weights" / "step_7"
    kept.mkdir(parents=True)
    (kept / "model.safetensors").write_bytes(b"the run's")
    m = run_bench(WeightsBenchConfig(replicas=1, rounds=2, dir=tmp_path))
    assert (kept / "model.safetensors").read_bytes() == b"the run's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"] and list(kept.parent.iterdir()) == [kept]
    assert m["bytes"] > 1_000_000  # the tiny model's safetensors and tokenizer
    assert m["swap"] >= m["publish"] > 0 and m["relay"] >= m["load"] > 0 and m["gather"] > 0
    assert math.isclose(m["ratio"], m["swap"] / m["disk"])
