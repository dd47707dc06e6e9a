"""`gyre rl` SIGKILLed as a whole (launcher, services and redis-server at once) at a random step, then
the same command again: the run finishes with every step trained exactly once and published, and
no process of either launch outlives it (issue 17: the re-run used to hang or retrain steps).

Also: a plain re-run of a finished run says so and exits 0, `--fresh` starts over, and a launcher
SIGKILLed alone takes every child (redis-server included) with it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gyre.events import latest_per_step, read_events
from gyre.weights import WeightStore

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "configs/ci.toml"
pytestmark = pytest.mark.slow


def command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gyre.cli", "rl", "@", str(CI_CONFIG), "--output-dir", str(out), *args]


def _stat(pid: int) -> tuple[int, int, str, str] | None:
    """(ppid, start time, state, name) of a live process, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0], name


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """{pid: (start time, name)} of every live process below `root`."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) and st[2] != "Z":
            children.setdefault(st[0], []).append(int(entry.name))
            info[int(entry.name)] = (st[1], st[3])
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = info[child]
            todo.append(child)
    return found


def survivors(seen: dict[int, tuple[int, str]]) -> list[str]:
    """The processes of `seen` still running (same pid and start time: not a reused pid)."""
    left = []
    for pid, (start, name) in seen.items():
        st = _stat(pid)
        if st is not None and st[1] == start and st[2] != "Z":
            left.append(f"{pid} {name}")
    return left


class Watched:
    """A `gyre rl` launch whose process tree is recorded while it runs."""

    def __init__(self, out: Path, *args: str):
        self.proc = subprocess.Popen(
            command(out, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.seen: dict[int, tuple[int, str]] = {}

    def record(self) -> None:
        self.seen.update(descendants(self.proc.pid))

    def wait(self, timeout: float) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.record()
            time.sleep(0.3)
        if self.proc.poll() is None:
            self.proc.kill()
        self.stdout, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err

    def ctrl_c_when(self, ready, timeout: float, never: str, poll_s: float) -> tuple[int, str]:
        """Once `ready()` (recording the tree meanwhile), a terminal's Ctrl-C; (exit status, stderr) when it ends."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, never
            self.record()
            time.sleep(poll_s)
        self.record()
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, err


def trained_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_events(out / "events" / "trainer_steps.jsonl")]


def wait_gone(seen: dict, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := survivors(seen)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize(
    ("seed", "extra"),
    # LoRA, whose published versions must give the adapter back (merged weights keep it beside them):
    # the run sets no ckpt.interval, so the re-run resumes from the newest version alone
    [(1, ()), (2, ()), (3, ("--trainer.lora.rank", "4", "--trainer.optim.lr", "1e-2"))],
    ids=["full-1", "full-2", "lora-3"],
)
def test_sigkill_whole_tree_at_a_random_step_then_rerun(tmp_path, seed, extra):
    rng = random.Random(seed)
    # Steps of the CI config take well under a second on a quiet machine: leave room after the kill
    # step so that "a random moment after it" still lands before the run's end.
    n = 10
    kill_at = rng.randint(1, 3)  # the trainer has logged this step; a random moment after that
    out = tmp_path / "run"
    first = Watched(out, "--max-steps", str(n), *extra)
    deadline = time.monotonic() + 400
    while not any(s >= kill_at for s in trained_steps(out)):
        assert first.proc.poll() is None, first.proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first launch never reached the kill step"
        first.record()
        time.sleep(0.2)
    # A random moment after it, cut short while the run is still 3 steps from its end: batches generated ahead
    # (async) let the trainer take several steps a second on a fast machine (CI once reached step 8 within it).
    moment = time.monotonic() + rng.uniform(0.0, 1.0)
    while time.monotonic() < moment and max(trained_steps(out)) < n - 3:
        time.sleep(0.02)
    first.record()
    assert any(name.startswith("redis-server") for _, name in first.seen.values())
    for pid in [first.proc.pid, *first.seen]:  # the whole tree at once: nothing gets to clean up
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.proc.communicate(timeout=30)
    assert wait_gone(first.seen) == []
    assert trained_steps(out) and max(trained_steps(out)) < n, "killed too late to test a resume"

    second = Watched(out, "--max-steps", str(n), *extra)  # the same command again
    code, err = second.wait(timeout=400)
    assert code == 0, err[-4000:]
    trained = trained_steps(out)
    assert sorted(trained) == list(range(1, n + 1)), f"killed after step {kill_at}: trained {trained}"
    store = WeightStore(out / "weights")
    assert store.steps() == list(range(1, n + 1))
    for s in store.steps():
        store.verify(s)
    pushed = latest_per_step(read_events(out / "events" / "orchestrator_steps.jsonl"))
    assert [p["step"] for p in pushed] == list(range(1, n + 1))
    assert len({r["segment"] for r in read_events(out / "events" / "trainer_steps.jsonl")}) == 2
    assert any(name.startswith("redis-server") for _, name in second.seen.values())
    assert wait_gone(second.seen) == [], "a process of the re-run outlived it"


def test_finished_run_says_so_fresh_starts_over_and_a_killed_launcher_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    first = Watched(out, "--max-steps", "2")
    code, err = first.wait(timeout=400)
    assert code == 0, err[-4000:]
    assert trained_steps(out) == [1, 2]

    again = subprocess.run(command(out, "--max-steps", "2"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished" in again.stdout + again.stderr
    assert trained_steps(out) == [1, 2]

    old_segment = read_events(out / "events" / "trainer_steps.jsonl")[0]["segment"]
    fresh = Watched(out, "--max-steps", "4", "--fresh")
    deadline = time.monotonic() + 400
    while not any(r["segment"] != old_segment for r in read_events(out / "events" / "trainer_steps.jsonl")):
        assert fresh.proc.poll() is None, fresh.proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        fresh.record()
        time.sleep(0.2)
    fresh.record()
    os.kill(fresh.proc.pid, signal.SIGKILL)  # the launcher alone: its children must follow it
    fresh.proc.communicate(timeout=30)
    assert wait_gone(fresh.seen) == [], "children outlived the SIGKILLed launcher"
    assert any(name.startswith("redis-server") for _, name in fresh.seen.values())
    steps = trained_steps(out)
    assert steps == list(range(1, len(steps) + 1))  # the old run's events are gone: no step twice
    assert len({r["segment"] for r in read_events(out / "events" / "trainer_steps.jsonl")}) == 1


def test_external_redis_restarted_empty_mid_run(tmp_path):
    """An external Redis without persistence restarts mid-run and comes back empty: the orchestrator
    notices the lost batches and regenerates them, the trainer gets them, the run finishes."""
    from gyre.redis_server import EmbeddedRedis

    out = tmp_path / "run"
    n = 5
    redis = EmbeddedRedis().start()
    port = redis.port
    run = Watched(out, "--max-steps", str(n), "--redis.url", redis.url)
    try:
        deadline = time.monotonic() + 400
        pushed = out / "events" / "orchestrator_steps.jsonl"
        # wait for a moment when a pushed batch is not trained yet: that batch is what Redis loses
        while not trained_steps(out) or len(read_events(pushed)) <= max(trained_steps(out)):
            assert run.proc.poll() is None, run.proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            run.record()
            time.sleep(0.05)
        redis.stop()  # everything in it is gone
        time.sleep(2.0)
        redis = EmbeddedRedis(port=port).start()
        code, err = run.wait(timeout=400)
        assert code == 0, err[-4000:]
    finally:
        redis.stop()
    trained = trained_steps(out)
    assert sorted(trained) == list(range(1, n + 1)), trained
    assert WeightStore(out / "weights").steps() == list(range(1, n + 1))
    assert wait_gone(run.seen) == []


def test_ctrl_c_twice_kills_the_services_at_once_and_the_rerun_trains_every_step_once(tmp_path):
    """Ctrl-C stops the services gracefully; a second one while they stop used to abort the launcher's shutdown
    with a KeyboardInterrupt traceback, leaving the services to PDEATHSIG. Now it kills them at once, quietly,
    and the same command again finishes the run with each step trained once."""
    out, n = tmp_path / "run", 6
    first = Watched(out, "--max-steps", str(n))
    deadline = time.monotonic() + 400
    while not trained_steps(out):
        assert first.proc.poll() is None, first.proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first launch never trained a step"
        first.record()
        time.sleep(0.2)
    first.record()
    first.proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends (the services have their own groups)
    time.sleep(1.5)
    first.proc.send_signal(signal.SIGINT)
    _, err = first.proc.communicate(timeout=60)
    assert first.proc.returncode == 130, err[-3000:]
    assert "interrupted, stopping services" in err and "Traceback" not in err, err[-3000:]
    assert wait_gone(first.seen, timeout=10) == [], "a service outlived the launcher"

    second = Watched(out, "--max-steps", str(n))  # the same command again
    code, err = second.wait(timeout=400)
    assert code == 0, err[-4000:]
    assert sorted(trained_steps(out)) == list(range(1, n + 1))
    assert WeightStore(out / "weights").steps() == list(range(1, n + 1))
    assert wait_gone(second.seen) == []


def test_ctrl_c_while_the_base_model_is_created_leaves_no_half_model_and_fresh_starts_over(tmp_path):
    """`gyre model init` stopped by the launcher's SIGTERM left its `.tmp-model-*` staging folder (a model's size) in
    the run's folder, and `--fresh` then refused the folder: "holds files gyre did not write (.tmp-model-...)"."""
    out = tmp_path / "run"
    first = Watched(out, "--max-steps", "1")
    code, err = first.ctrl_c_when(
        lambda: out.is_dir() and any(p.name.startswith(".tmp-model-") for p in out.iterdir()),
        timeout=120, never="the model was never created", poll_s=0.01,
    )  # fmt: skip
    assert code == 130, err[-3000:]
    assert wait_gone(first.seen, timeout=10) == []
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]
    (out / ".tmp-model-left-by-an-older-launch").mkdir()  # what the old code left: --fresh takes it too
    fresh = Watched(out, "--max-steps", "1", "--fresh")
    code, err = fresh.wait(timeout=400)
    assert code == 0, err[-4000:]
    assert trained_steps(out) == [1] and not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]
    # how the model was made, which a re-run asking for another preset or seed is refused by
    assert 'init_preset = "tiny"' in (out / "configs" / "model-init.toml").read_text()


def test_fresh_with_an_external_redis_deletes_the_previous_runs_batches(tmp_path):
    """`--fresh` deleted the run's folder but not its stream on an external Redis: the orchestrator counted the
    old run's batches (consumed long ago) as pushed, and the trainer waited forever for step 1."""
    from gyre.redis_server import EmbeddedRedis
    from gyre.streams import BatchStream

    out = tmp_path / "run"
    with EmbeddedRedis() as redis:
        old = BatchStream(redis.url, "ci")  # a finished run's stream: steps 1-2 pushed, read and acked
        old.ensure_group()
        for step in (1, 2):
            old.push(step, b"old batch")
        for entry in old.read("trainer-0", count=2):
            old.ack(entry.id)
        fresh = Watched(out, "--max-steps", "1", "--fresh", "--redis.url", redis.url)
        code, err = fresh.wait(timeout=240)
        assert code == 0, err[-4000:]
        assert trained_steps(out) == [1]
        assert all(fields.get(b"payload") != b"old batch" for _, fields in old.redis.xrange(old.key))  # gone
        old.redis.close()
    assert wait_gone(fresh.seen) == []


def test_ctrl_c_during_the_sft_warm_up_checkpoints_it_and_the_rerun_resumes_it(tmp_path):
    """The launcher's stop reaches `gyre sft` as SIGTERM, which killed it on the spot (only SIGINT was handled): every
    step since its last interval checkpoint was trained again by the next launch. Now it finishes its step, checkpoints
    it and exits within the trainer's stop budget; the same command resumes after that step."""
    import json

    out = tmp_path / "run"
    sft_args = {"max_steps": 60, "device": "cpu", "data": {"fake": True, "num_examples": 120, "seq_len": 64,
                                                          "batch_size": 4, "micro_batch_size": 2}}  # fmt: skip
    args = ("--max-steps", "1", "--sft.args", json.dumps(sft_args))
    sft_steps = out / "events" / "sft_steps.jsonl"

    def steps() -> list[int]:
        return [r["step"] for r in read_events(sft_steps)] if sft_steps.exists() else []

    first = Watched(out, *args)
    code, err = first.ctrl_c_when(
        lambda: len(steps()) >= 2, timeout=300, never="the SFT warm-up never trained a step", poll_s=0.02
    )
    assert code == 130, err[-3000:]
    assert "the SFT warm-up checkpoints its last step first" in err, err[-3000:]  # it said the trainer
    assert wait_gone(first.seen, timeout=10) == []
    done = steps()[-1]
    assert steps() == list(range(1, done + 1)) and done < 60
    assert [p.name for p in (out / "checkpoints" / "sft").iterdir()] == [f"step_{done}"]
    assert f"gyre sft: stopped after step {done}" in (out / "logs" / "sft.log").read_text()

    # a re-run with another key of the warm-up: refused before anything starts (it was mixed into the checkpoint)
    changed = subprocess.run(command(out, *args, "--sft.args.optim.lr", "0.5"), capture_output=True, text=True,
                             timeout=120, cwd=ROOT)  # fmt: skip
    assert changed.returncode == 2 and "config key 'sft.args.optim.lr'" in changed.stderr, changed.stderr[-3000:]
    assert steps()[-1] == done

    second = Watched(out, *args)  # the same command again
    code, err = second.wait(timeout=400)
    assert code == 0, err[-4000:]
    assert steps() == list(range(1, 61))  # each SFT step once
    assert trained_steps(out) == [1]
    assert wait_gone(second.seen) == []


def test_the_embedded_redis_killed_mid_run_is_started_again_and_the_run_finishes(tmp_path):
    """The launcher's own redis-server killed mid-run (OOM killer, `kill -9`): the services retried it forever (backing
    off to 30 s) and the launcher waited for them, a hang with no word of why. Now the launcher starts it again on its
    port and append-only file: the stream, the consumer group and its pending entries come back, and the run finishes
    with every step trained once, on the batch the orchestrator pushed for it."""
    out, n = tmp_path / "run", 8
    run = Watched(out, "--max-steps", str(n))
    deadline = time.monotonic() + 400
    while not trained_steps(out) or max(trained_steps(out)) < 2:
        assert run.proc.poll() is None, run.proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the launch never trained step 2"
        run.record()
        time.sleep(0.1)
    run.record()
    redis = [pid for pid, (_, name) in run.seen.items() if name.startswith("redis-server") and _stat(pid)]
    assert len(redis) == 1, run.seen
    os.kill(redis[0], signal.SIGKILL)
    killed_at = max(trained_steps(out))
    code, err = run.wait(timeout=120)  # the rest of the run takes seconds; the old launcher hung here for good
    assert code == 0, err[-4000:]
    assert "embedded redis was killed by SIGKILL; starting it again" in run.stdout, run.stdout[-3000:]
    assert killed_at < n, "killed too late to test anything"
    assert sorted(trained_steps(out)) == list(range(1, n + 1))
    assert WeightStore(out / "weights").steps() == list(range(1, n + 1))
    pushed = latest_per_step(read_events(out / "events" / "orchestrator_steps.jsonl"))
    trained = {r["step"]: r for r in read_events(out / "events" / "trainer_steps.jsonl")}
    assert [p["step"] for p in pushed] == list(range(1, n + 1))
    # each step trained on the batch the orchestrator's newest line describes (its token count)
    assert [trained[p["step"]]["num_tokens"] for p in pushed] == [p["num_tokens"] for p in pushed]
    assert len([name for _, name in run.seen.values() if name.startswith("redis-server")]) == 2
    assert wait_gone(run.seen) == []
