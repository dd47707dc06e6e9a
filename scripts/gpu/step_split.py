"""Per-step time split of a finished `gyre rl` run, from its event logs (docs/benchmarks.md).

python3 scripts/gpu/step_split.py outputs/gpu-one
"""

import statistics
import sys
from pathlib import Path

from gyre.events import read_events

out = Path(sys.argv[1]) / "events"
trainer = read_events(out / "trainer_steps.jsonl")
orchestrator = read_events(out / "orchestrator_steps.jsonl")
relay = read_events(out / "weight_relay.jsonl")
print(f"{'step':>4} {'generation s':>13} {'training s':>11} {'weight swap s':>14} {'wall s':>8} {'tokens':>8}")
previous = None
for t in trainer:
    gen = next((o["step_seconds"] for o in orchestrator if o["step"] == t["step"]), float("nan"))
    swap = [r["seconds"] for r in relay if r["step"] == t["step"] and r.get("ok", True)]
    wall = t["time"] - previous if previous else float("nan")
    previous = t["time"]
    print(
        f"{t['step']:>4} {gen:>13.2f} {t['step_seconds']:>11.2f} {max(swap) if swap else float('nan'):>14.2f} "
        f"{wall:>8.2f} {int(t['num_tokens']):>8}"
    )
steady = trainer[1:]
if len(steady) >= 2:
    print(
        f"median after step 1: training {statistics.median(t['step_seconds'] for t in steady):.2f} s, "
        f"wall per step {(steady[-1]['time'] - trainer[0]['time']) / len(steady):.2f} s"
    )
