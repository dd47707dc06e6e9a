"""`gyre report`: the overview dashboard's main panels drawn from event logs (PNG), and the per-second
rates it derives from event times."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
from gyre.events import EventLog
from gyre.local.report import _per_wall_second, draw
from observability_support import ROOT, dashboards


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def write_run(out, steps: int = 4) -> None:
    """Event logs of a small run, shaped like the services write them (docs/architecture.md)."""
    with EventLog(out / "events" / "trainer_steps.jsonl") as log:
        for s in range(1, steps + 1):
            log.append(
                {"step": s, "loss": 0.1 / s, "entropy": 6.0, "mismatch_kl": 0.01, "grad_norm": 0.5, "lr": 1e-3,
                 "num_tokens": 600, "num_samples": 16, "step_seconds": 2.0, "mfu": 0.01 * s,
                 "min_version": s - 2, "max_version": s - 1, "time": 1000.0 + 5 * s}
            )  # fmt: skip
    with EventLog(out / "events" / "orchestrator_steps.jsonl") as log:
        for s in range(1, steps + 1):
            log.append(
                {"step": s, "reward_mean": 0.1 * s, "reward_std": 0.1, "num_samples": 16, "dropped_stale": s % 2,
                 "dropped_zero_signal": 0, "min_version": s - 2, "max_version": s - 1, "lag_mean": 0.5,
                 "lag_max": 1, "num_tokens": 600, "step_seconds": 4.0, "time": 998.0 + 5 * s}
            )  # fmt: skip
    with EventLog(out / "events" / "weight_relay.jsonl") as log:
        for s in range(1, steps + 1):
            log.append({"step": s, "replica": "http://127.0.0.1:1", "ok": True, "seconds": 0.2, "time": 1001.0 + 5 * s})
    with EventLog(out / "events" / "eval.jsonl") as log:
        log.append({"step": 0, "env": "reverse_text", "avg_at_k": float("nan"), "pass_at_k": 0.0, "k": 1,
                    "num_examples": 4, "time": 999.0})  # fmt: skip
        log.append({"step": 2, "env": "reverse_text", "avg_at_k": 0.3, "pass_at_k": 0.0, "k": 1,
                    "num_examples": 4, "time": 1011.0})  # fmt: skip


def test_rates_come_from_event_times_over_a_trailing_window():
    events = [{"step": s, "time": 100.0 + 10 * s, "step_seconds": 4.0, "num_tokens": 50 * s} for s in (1, 2, 3, 4)]
    steps, per_s = _per_wall_second(events, None, window=2)
    # the run starts at time(1) - step_seconds(1) = 106; step 1 took 4 s, later ones 10 s each
    assert steps == [1, 2, 3, 4]
    assert per_s == pytest.approx([1 / 4, 2 / 14, 2 / 20, 2 / 20])
    steps, tokens = _per_wall_second(events, "num_tokens", window=2)
    assert tokens == pytest.approx([50 / 4, (50 + 100) / 14, (100 + 150) / 20, (150 + 200) / 20])
    assert _per_wall_second([], "num_tokens") == ([], [])


def test_draws_the_overview_panels(tmp_path):
    write_run(tmp_path)
    png = draw(tmp_path)
    assert png == tmp_path / "report.png"
    assert png_size(png) == (1200, 880)  # 3 x 3 panels, 15 x 11 in at 80 dpi
    overview = dashboards()["overview.json"]
    main_titles = {p["title"] for p in overview["panels"] if p["type"] == "timeseries"}
    for title in ("Reward", "Step rate", "Step time", "Async lag", "MFU", "Trainer tokens/s",
                  "Inference tokens/s", "Weight sync latency", "Stale and dropped samples"):  # fmt: skip
        assert title in main_titles, f"the report draws {title!r}, which the overview dashboard lacks"


def test_report_cli_on_an_empty_and_on_a_non_run_folder(tmp_path):
    (tmp_path / "run" / "events").mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "report", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert png_size(tmp_path / "x.png") == (1200, 880)
    bad = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "report", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 2 and "not a gyre run output" in bad.stderr


def write_mix(out, labels: tuple[str, ...]) -> None:
    """Orchestrator step lines and eval lines of a mix of `labels` (docs/orchestrator.md, "Several environments")."""
    with EventLog(out / "events" / "orchestrator_steps.jsonl") as log:
        for s in range(1, 6):
            envs = {label: {"num_samples": 8, "reward_mean": 0.1 * s * (i + 1), "total_samples": 8 * s}
                    for i, label in enumerate(labels)}  # fmt: skip
            if len(labels) > 1 and s == 3:
                envs[labels[1]]["reward_mean"] = None  # drew no group that step
            log.append({"step": s, "reward_mean": 0.1 * s, "num_samples": 16, "num_tokens": 600, "step_seconds": 4.0,
                        "env": ",".join(labels), "envs": envs, "time": 998.0 + 5 * s})  # fmt: skip
    with EventLog(out / "events" / "eval.jsonl") as log:
        for s in (0, 4):
            envs = {label: {"env": label, "avg_at_k": 0.2 * (i + 1) + 0.1 * s} for i, label in enumerate(labels)}
            log.append({"step": s, "env": ",".join(labels), "avg_at_k": 0.3, "k": 1, "envs": envs, "time": 999.0 + s})


@pytest.mark.parametrize("labels", [("reverse_text", "math"), ("reverse_text",)], ids=["mix", "single"])
def test_a_mix_has_a_reward_and_an_eval_curve_per_environment(tmp_path, monkeypatch, labels):
    # a mix's report drew only the run's rewards (the entries' weighted mean): an entry that did not learn was hidden
    from gyre.local import report

    write_mix(tmp_path, labels)
    drawn = {}
    monkeypatch.setattr(report, "_line", lambda ax, xs, ys, label, **kw: drawn.setdefault(label, (xs, ys)))
    report.draw(tmp_path)
    rewards = {k: v for k, v in drawn.items() if "reward" in k or k.startswith(("train:", "eval:"))}
    if len(labels) == 1:  # unchanged: the run's two curves
        assert set(rewards) == {"train reward", "eval reward (avg@k)"}
        assert "  reverse_text" not in report.summarize(tmp_path)
        return
    assert set(rewards) == {"train reward", "eval reward (avg@k)", "train: reverse_text", "train: math",
                            "eval: reverse_text", "eval: math"}  # fmt: skip
    assert rewards["train: math"] == ([1, 2, 4, 5], pytest.approx([0.2, 0.4, 0.8, 1.0]))  # step 3: no group of it
    assert rewards["eval: reverse_text"] == ([0, 4], pytest.approx([0.2, 0.6]))
    lines = report.summarize(tmp_path).splitlines()
    assert "  reverse_text" in lines[3] and lines[3].endswith("0.100 -> 0.500")  # under the train reward
    assert "  math" in lines[4] and lines[4].endswith("0.200 -> 1.000")
    assert "eval reward" in lines[5] and lines[6].endswith("0.200 -> 0.600") and lines[7].endswith("0.400 -> 0.800")


def test_a_mix_samples_page_has_each_entrys_mean_and_samples_with_an_env_column(tmp_path):
    # samples.md showed the step's best and worst samples (all of one entry here) and only the mix's mean reward
    from gyre.local.report import write_samples
    from gyre.rollouts import write_dump

    def sample(env, i, reward):
        return {"step": 2, "task_id": f"{env}-{i}", "env": env, "prompt": [{"role": "user", "content": f"q{i}"}],
                "completion": [{"role": "assistant", "content": f"a{i}"}], "reward": reward, "advantage": 0.0,
                "min_version": 1, "max_version": 1, "stop_reason": "stop"}  # fmt: skip

    records = [sample("reverse_text", i, 0.9 + i / 100) for i in range(8)] + [sample("math", i, 0.0) for i in range(4)]
    write_dump(tmp_path, 2, records)
    page = write_samples(tmp_path).read_text()
    assert "## Step 2: 12 samples, mean reward 0.623 (reverse_text 0.935 over 8, math 0.000 over 4)" in page
    assert "| task | env | prompt |" in page
    rows = [line for line in page.splitlines() if line.startswith("| ") and "-" in line.split("|")[1]]
    assert sum("| math |" in row for row in rows) == 4 and sum("| reverse_text |" in row for row in rows) == 4

    write_dump(tmp_path, 2, [{**r, "env": "reverse_text"} for r in records[:8]])  # one environment: as it was
    page = write_samples(tmp_path).read_text()
    assert "## Step 2: 8 samples, mean reward 0.935\n" in page and "| task | prompt |" in page
