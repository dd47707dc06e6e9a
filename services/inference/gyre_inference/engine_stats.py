"""What the torch engine did, as counters: the periodic engine log line, Prometheus, and `gyre bench inference`.

The engine thread only adds to an `EngineStats`; readers (the event loop's log task, a metrics scrape) take a
snapshot (`TorchBackend.engine_stats`, with the gauges of the moment: rows running and waiting, KV cache in
use) and compare two snapshots. Every ten seconds of activity the service logs one line, as vLLM does, so a
slow RL step can be read off the inference log: where the engine's time went (decode steps and their device
share, prefills, CUDA graph captures, weight swaps), how full the batch and the KV cache were, and how much
of the prompts the prefix cache saved (docs/inference.md, "Engine log line").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine started (the gauges are filled in a snapshot only)."""

    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0  # wall time of decode steps, host work included
    device_seconds: float = 0.0  # of which inside the step's graphs/kernels
    prefills: int = 0  # prefill forwards (one per admission of a set of sequences)
    prefill_seconds: float = 0.0
    admitted_tokens: int = 0  # prompt tokens of admitted sequences (a preempted one's generated tokens included)
    prefilled: int = 0  # of which computed (prefix-cache hits and group followers excluded)
    overlapped_steps: int = 0  # decode steps launched before the previous one was read (the overlapped loop)
    wasted_rows: int = 0  # rows a step computed for nothing: their sequence stopped at the step before
    captures: int = 0  # CUDA graphs captured (decode forwards and samplers)
    capture_seconds: float = 0.0
    swaps: int = 0  # weight (or adapter) swaps applied
    swap_seconds: float = 0.0  # the engine thread's part: the copy into the parameters
    preemptions: int = 0  # rows preempted for want of KV blocks (they are recomputed when readmitted)
    # gauges, set by a snapshot
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of the KV cache's blocks held by sequences

    def snapshot(self, **gauges) -> EngineStats:
        return dataclasses.replace(self, **gauges)


def stats_line(now: EngineStats, before: EngineStats, seconds: float, loop_cpu: float | None = None) -> str | None:
    """The log line for the interval between two snapshots `seconds` apart; None when the engine was idle
    all along (nothing computed, nothing running or waiting). `loop_cpu`: CPU seconds the event loop's thread
    used in the interval. That thread and the engine's share one interpreter lock, so a loop busy most of the
    time (HTTP, requests, responses) holds back a GPU whose steps wait on host work."""
    steps = now.decode_steps - before.decode_steps
    prefills = now.prefills - before.prefills
    if not (steps or prefills or now.running or now.waiting):
        return None
    seconds = max(seconds, 1e-9)
    admitted = now.admitted_tokens - before.admitted_tokens
    computed = now.prefilled - before.prefilled
    generated = now.decode_tokens - before.decode_tokens
    parts = [
        f"engine: {now.running} running, {now.waiting} waiting, KV cache {now.kv_cache_usage:.0%} used",
        f"prompt {admitted / seconds:,.0f} tokens/s"
        + (f" ({1 - computed / admitted:.0%} from the prefix cache)" if admitted else ""),
        f"generation {generated / seconds:,.0f} tokens/s",
    ]
    if steps:
        step_ms = (now.decode_seconds - before.decode_seconds) / steps * 1e3
        device_ms = (now.device_seconds - before.device_seconds) / steps * 1e3
        overlapped = (now.overlapped_steps - before.overlapped_steps) / steps
        parts.append(f"decode {steps:,} steps of {generated / steps:.0f} rows, {step_ms:.2f} ms each (device "
                     f"{device_ms:.2f} ms, {overlapped:.0%} overlapped)")  # fmt: skip
    if prefills:
        parts.append(f"prefill {_count(prefills, 'call')}, {now.prefill_seconds - before.prefill_seconds:.2f} s")
    if now.captures > before.captures:
        parts.append(f"graphs captured {now.captures - before.captures} "
                     f"({now.capture_seconds - before.capture_seconds:.2f} s)")  # fmt: skip
    if now.preemptions > before.preemptions:  # block pressure: recomputation (vLLM warns of it too)
        parts.append(f"preempted {_count(now.preemptions - before.preemptions, 'row')} (KV cache full)")
    if now.swaps > before.swaps:
        parts.append(f"weight swaps {now.swaps - before.swaps} ({now.swap_seconds - before.swap_seconds:.2f} s)")
    if loop_cpu is not None:
        parts.append(f"event loop {loop_cpu / seconds:.0%} busy")
    return " | ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
