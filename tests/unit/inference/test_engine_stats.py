"""The engine's log line from two counter snapshots (engine_stats.py): pure arithmetic, no engine."""

from __future__ import annotations

from gyre_inference.engine_stats import EngineStats, stats_line


def test_an_idle_interval_logs_nothing_and_a_queue_alone_does():
    idle = EngineStats(decode_steps=10, decode_tokens=80)
    assert stats_line(idle.snapshot(), idle.snapshot(), 10.0) is None
    line = stats_line(idle.snapshot(waiting=3), idle.snapshot(), 10.0)
    assert line is not None and line.startswith("engine: 0 running, 3 waiting")


def test_the_line_reports_the_intervals_rates_and_the_step_split():
    before = EngineStats(decode_steps=100, decode_tokens=1000, decode_seconds=1.0, device_seconds=0.5,
                         prefills=4, prefill_seconds=0.2, admitted_tokens=500, prefilled=400, captures=2,
                         capture_seconds=0.3)  # fmt: skip
    now = EngineStats(decode_steps=300, decode_tokens=1000 + 200 * 64, decode_seconds=1.8, device_seconds=1.1,
                      overlapped_steps=150, prefills=6, prefill_seconds=0.5, admitted_tokens=500 + 8 * 256,
                      prefilled=400 + 256, captures=2, capture_seconds=0.3, swaps=1, swap_seconds=0.05,
                      preemptions=3, running=64, waiting=0, kv_cache_usage=0.25)  # fmt: skip
    line = stats_line(now, before, 2.0)
    parts = line.split(" | ")
    assert parts[0] == "engine: 64 running, 0 waiting, KV cache 25% used"
    assert parts[1] == "prompt 1,024 tokens/s (88% from the prefix cache)"  # 7 of a group's 8 prompts shared
    assert parts[2] == "generation 6,400 tokens/s"
    assert parts[3] == "decode 200 steps of 64 rows, 4.00 ms each (device 3.00 ms, 75% overlapped)"
    assert parts[4] == "prefill 2 calls, 0.30 s"
    assert parts[5] == "preempted 3 rows (KV cache full)"  # none before: all 3 in the interval
    assert parts[6] == "weight swaps 1 (0.05 s)"  # no capture in the interval: not mentioned
    assert len(parts) == 7
    assert "preempted" not in stats_line(now, now.snapshot(decode_steps=0), 2.0)  # none in the interval: not said


def test_the_line_ends_with_the_event_loops_busy_share_when_given():
    before = EngineStats(decode_steps=10, decode_tokens=80)
    now = EngineStats(decode_steps=20, decode_tokens=160)
    # 1.5 CPU seconds of the loop's thread in a 2 s interval: the loop was busy 75% of the time
    assert stats_line(now, before, 2.0, loop_cpu=1.5).endswith(" | event loop 75% busy")
    assert "event loop" not in stats_line(now, before, 2.0)
