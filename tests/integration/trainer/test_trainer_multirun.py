"""Multi-run: two runs on one trainer, one LoRA adapter each (docs/trainer.md, "Multi-run").

- a step of one run changes that run's adapter only: the other run's parameters are equal bit for bit;
- runs interleaved on one trainer publish exactly what each run trained alone publishes (so neither
  optimizer, schedule nor progress leaks between runs), and each finishes at its own max_steps;
- a run added later through `runs_dir` joins a running trainer and trains its own batches.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
import torch
from gyre.config import ConfigError, load_config
from gyre.config.trainer import TrainerConfig
from gyre.streams import BatchStream
from safetensors.torch import load_file
from trainer_testlib import kill_group, push_batches, start_trainer, trained_steps, wait_for_steps

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def multirun_config(tiny_model, redis_url, runs: list[dict], **extra) -> TrainerConfig:
    values = {
        "model": {"name": str(tiny_model)}, "redis": {"url": redis_url}, "device": "cpu", "deterministic": True,
        "metrics": {"port": 0}, "server": {"port": 0}, "lora": LORA, "optim": {"lr": 1e-2},
        "runs": [{"orchestrator": {"address": "127.0.0.1:9", "timeout_s": 0.5}, **r} for r in runs], **extra,
    }  # fmt: skip
    return load_config(TrainerConfig, [], **values)


def adapter(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


def test_a_step_of_one_run_leaves_the_other_runs_adapter_bit_for_bit(tiny_model, redis_url, unique_run_id, tmp_path):
    from gyre_trainer import dist
    from gyre_trainer.lora import named_adapter_state
    from gyre_trainer.multirun import MultiRunTrainer

    a, b = f"{unique_run_id}-a", f"{unique_run_id}-b"
    cfg = multirun_config(tiny_model, redis_url, [
        {"name": a, "output_dir": str(tmp_path / "a")}, {"name": b, "output_dir": str(tmp_path / "b")},
    ])  # fmt: skip
    push_batches(BatchStream(redis_url, a), [1, 2], seed=1)
    push_batches(BatchStream(redis_url, b), [1], seed=2)
    trainer = MultiRunTrainer(cfg, dist.init_distributed("cpu"))
    trainer._build()
    try:
        run_a, run_b = trainer.add_run(cfg.runs[0]), trainer.add_run(cfg.runs[1])
        for run, other in [(run_a, run_b), (run_b, run_a), (run_a, run_b)]:
            before_own, before_other = (
                named_adapter_state(trainer.model, run.name),
                named_adapter_state(trainer.model, other.name),
            )
            base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
            item = run.intake.next(lambda: False, wait=False)
            run.commit(item)
            after_own, after_other = (
                named_adapter_state(trainer.model, run.name),
                named_adapter_state(trainer.model, other.name),
            )
            assert any(not torch.equal(before_own[k], after_own[k]) for k in before_own), "own adapter must train"
            for name, value in before_other.items():
                assert torch.equal(value, after_other[name]), f"{other.name}: {name} changed"
            for name, p in trainer.model.named_parameters():
                if "lora_" not in name:
                    assert torch.equal(base_before[name], p), f"base {name} changed"
        # what each run published is its own adapter, under PEFT's names
        published = adapter(tmp_path / "a" / "weights" / "step_2")
        assert published.keys() == named_adapter_state(trainer.model, a).keys()
        for name, value in named_adapter_state(trainer.model, a).items():
            assert torch.equal(published[name], value)
    finally:
        trainer._close()


def run_trainer(cfg: TrainerConfig) -> int:
    from gyre_trainer import service

    return service.run(cfg, handle_signals=False)


def test_interleaved_runs_publish_what_each_run_trains_alone(tiny_model, redis_url, unique_run_id, tmp_path):
    names = {"a": f"{unique_run_id}-a", "b": f"{unique_run_id}-b"}
    steps = {"a": 3, "b": 2}
    # "alone" runs have the same names (a run's adapter starts from (seed, name)) in another Redis database
    alone_url = redis_url.rsplit("/", 1)[0] + "/1"
    for key, name in names.items():
        for url in (redis_url, alone_url):
            push_batches(BatchStream(url, name), range(1, steps[key] + 1), seed=ord(key))
    together = [{"name": names[k], "output_dir": str(tmp_path / "together" / k), "max_steps": steps[k]} for k in names]
    # the runs may differ in schedule and rank: each has its own optimizer, schedule and adapter shape
    together[1].update(optim={"lr": 5e-3, "warmup_steps": 2}, lora={**LORA, "rank": 2, "alpha": 4})
    assert run_trainer(multirun_config(tiny_model, redis_url, together)) == 0  # exits once both finished
    for key, spec in zip(names, together, strict=True):
        alone = {**spec, "output_dir": str(tmp_path / "alone" / key)}
        assert run_trainer(multirun_config(tiny_model, alone_url, [alone])) == 0

    for key in names:
        assert trained_steps(tmp_path / "together" / key) == list(range(1, steps[key] + 1))
        assert trained_steps(tmp_path / "alone" / key) == list(range(1, steps[key] + 1))
        last = f"weights/step_{steps[key]}"
        mixed, alone = adapter(tmp_path / "together" / key / last), adapter(tmp_path / "alone" / key / last)
        assert mixed.keys() == alone.keys()
        for name in mixed:
            assert torch.equal(mixed[name], alone[name]), f"run {key}: {name} differs from the run trained alone"
    rank_b = adapter(tmp_path / "together" / "b" / "weights/step_2")
    assert {t.shape[0] for n, t in rank_b.items() if "lora_A" in n} == {2}


@pytest.mark.parametrize("newest", ["published", "checkpoint"])
def test_a_run_relaunched_with_another_adapter_rank_is_told_which_key(
    tiny_model, redis_url, unique_run_id, tmp_path, newest
):
    """The multi-run resume is the single-run one: a run's adapter restored from its published version (or
    checkpoint) is checked against the relaunch's adapter shape first (it failed inside peft with a page
    of size mismatches), and nothing is trained."""
    from gyre_trainer import dist
    from gyre_trainer.multirun import MultiRunTrainer

    name = f"{unique_run_id}-a"
    push_batches(BatchStream(redis_url, name), [1, 2], seed=1)
    spec = {"name": name, "output_dir": str(tmp_path / "a"), "max_steps": 1}
    extra = {"ckpt": {"interval": 1}} if newest == "checkpoint" else {}
    assert run_trainer(multirun_config(tiny_model, redis_url, [spec], **extra)) == 0
    changed = multirun_config(tiny_model, redis_url, [{**spec, "max_steps": 2, "lora": {**LORA, "rank": 8}}], **extra)
    trainer = MultiRunTrainer(changed, dist.init_distributed("cpu"))
    trainer._build()
    try:
        with pytest.raises(ValueError, match="set trainer.lora.rank = 4"):
            trainer.add_run(changed.runs[0])
    finally:
        trainer._close()
    assert trained_steps(tmp_path / "a") == [1]
    assert (tmp_path / "a" / "checkpoints/trainer/step_1").exists() == (newest == "checkpoint")


def test_a_run_added_to_runs_dir_joins_the_running_trainer(tiny_model, redis_url, unique_run_id, tmp_path):
    from gyre.config import to_toml

    a, b = f"{unique_run_id}-a", f"{unique_run_id}-b"
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    cfg = multirun_config(
        tiny_model, redis_url, [{"name": a, "output_dir": str(tmp_path / "a"), "max_steps": 2}], runs_dir=str(runs_dir)
    )
    (tmp_path / "trainer.toml").write_text(to_toml(cfg))
    push_batches(BatchStream(redis_url, a), range(1, 3))
    proc = start_trainer(["@", str(tmp_path / "trainer.toml")], tmp_path / "trainer.log")
    try:
        assert wait_for_steps(tmp_path / "a", 2, proc) == [1, 2]
        (runs_dir / "broken.toml").write_text('max_steps = "many"\n')  # logged and skipped, nothing stops
        push_batches(BatchStream(redis_url, b), range(1, 3), seed=5)
        tmp = runs_dir / f".{b}.tmp"
        tmp.write_text(f'output_dir = "{tmp_path / "b"}"\nmax_steps = 2\n[orchestrator]\naddress = "127.0.0.1:9"\n')
        tmp.rename(runs_dir / f"{b}.toml")
        assert wait_for_steps(tmp_path / "b", 2, proc) == [1, 2]
        assert (tmp_path / "b" / "weights" / "step_2" / "adapter_model.safetensors").is_file()
        assert proc.poll() is None  # with runs_dir it waits for more runs
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.returncode == 0
        log = (tmp_path / "trainer.log").read_text()
        assert "broken.toml" in log and "max_steps" in log
    finally:
        if proc.poll() is None:
            kill_group(proc)


def test_every_runs_kl_reference_is_the_shared_base_with_adapters_off(tiny_model, redis_url, unique_run_id, tmp_path):
    """`loss.ref_kl_coef` in multi-run: each run's reference is the base (every adapter off, no copy of the
    weights): a run's first step, whose fresh adapter adds exactly zero, has ref_kl 0 even after the other
    run trained; its second step, after its own update, has ref_kl > 0."""
    from gyre.events import TRAINER_STEPS, read_events

    runs = [{"name": f"{unique_run_id}-{k}", "output_dir": str(tmp_path / k), "max_steps": 2} for k in "ab"]
    for run in runs:
        push_batches(BatchStream(redis_url, run["name"]), (1, 2), seed=len(run["name"]))
    cfg = multirun_config(tiny_model, redis_url, runs, loss={"ref_kl_coef": 0.1})
    assert run_trainer(cfg) == 0
    for key in "ab":
        records = read_events(tmp_path / key / "events" / TRAINER_STEPS)
        assert [r["step"] for r in records] == [1, 2]
        assert records[0]["ref_kl"] == 0.0 and records[1]["ref_kl"] > 1e-8, records


def test_multirun_config_errors_name_the_key(tiny_model, redis_url, tmp_path):
    run = {"name": "x", "output_dir": str(tmp_path / "x")}
    with pytest.raises(ConfigError, match="lora"):
        load_config(TrainerConfig, [], runs=[run])
    with pytest.raises(ConfigError, match="name"):
        multirun_config(tiny_model, redis_url, [run, {**run, "output_dir": str(tmp_path / "y")}])
    with pytest.raises(ConfigError, match="publish"):
        multirun_config(tiny_model, redis_url, [run], lora={**LORA, "publish": "merged"})
    with pytest.raises(ConfigError, match="name"):
        multirun_config(tiny_model, redis_url, [{**run, "name": "has.dot"}])
    with pytest.raises(ConfigError, match="lora_"):
        multirun_config(tiny_model, redis_url, [{**run, "name": "a"}])


def test_a_crash_mid_step_resumes_every_run_exactly_once(tiny_model, redis_url, unique_run_id, tmp_path):
    """SIGKILL right after a run publishes step 2 (before logging and acking it), then a restart: every
    run trains each step exactly once and ends bit for bit where an uninterrupted trainer ends."""
    from gyre.config import to_toml
    from trainer_testlib import child_env

    names = [f"{unique_run_id}-a", f"{unique_run_id}-b"]
    straight_url = redis_url.rsplit("/", 1)[0] + "/2"
    for i, name in enumerate(names):
        for url in (redis_url, straight_url):
            push_batches(BatchStream(url, name), range(1, 4), seed=20 + i)

    def config(url, folder):
        runs = [{"name": n, "output_dir": str(folder / n), "max_steps": 3} for n in names]
        path = folder / "trainer.toml"
        folder.mkdir()
        path.write_text(to_toml(multirun_config(tiny_model, url, runs, ckpt={"interval": 1})))
        return ["@", str(path)]

    crashed, straight = tmp_path / "crashed", tmp_path / "straight"
    argv = config(redis_url, crashed)
    proc = start_trainer(argv, crashed / "trainer.log", env={**child_env(), "GYRE_TRAINER_CRASH_AT": "after_publish:2"})
    assert proc.wait(timeout=300) == -signal.SIGKILL
    assert start_trainer(argv, crashed / "trainer.log").wait(timeout=300) == 0
    assert start_trainer(config(straight_url, straight), straight / "trainer.log").wait(timeout=300) == 0
    log = (straight / "trainer.log").read_text()
    for name in names:  # one line per step names the run and says how it learns (before: only "published ...")
        line = rf"run {name}: step 3: loss [-0-9.e]+, entropy [0-9.e]+, clip frac [0-9.e]+, .* tok/s, MFU [0-9.]+%\)"
        assert re.search(line, log), log
        assert trained_steps(crashed / name) == [1, 2, 3]
        mine, reference = adapter(crashed / name / "weights/step_3"), adapter(straight / name / "weights/step_3")
        for key in reference:
            assert torch.equal(mine[key], reference[key]), f"{name}: {key}"


def run_file(folder, name: str, output_dir, max_steps: int) -> None:
    """A runs_dir file, written atomically (the trainer may scan the folder at any time)."""
    tmp = folder / f".{name}.tmp"
    tmp.write_text(f'output_dir = "{output_dir}"\nmax_steps = {max_steps}\n'
                   '[orchestrator]\naddress = "127.0.0.1:9"\ntimeout_s = 0.5\n')  # fmt: skip
    tmp.rename(folder / f"{name}.toml")


def grpc_status(port: int):
    import grpc
    from gyre.v1 import trainer_pb2, trainer_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return trainer_pb2_grpc.TrainerStub(channel).GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)


def turn_until(trainer, done, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the trainer did not get there in time"
        trainer.turn()


def test_finished_runs_release_their_adapter_optimizer_and_metrics_and_never_retrain(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    import gc
    import weakref

    from gyre_trainer import dist
    from gyre_trainer.multirun import MultiRunTrainer

    def parameters() -> int:
        return sum(p.numel() for p in trainer.model.parameters())

    a, b = f"{unique_run_id}-a", f"{unique_run_id}-b"
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    cfg = multirun_config(tiny_model, redis_url, [{"name": a, "output_dir": str(tmp_path / "a"), "max_steps": 1}],
                          runs_dir=str(runs_dir))  # fmt: skip
    push_batches(BatchStream(redis_url, a), [1, 2], seed=1)  # step 2 is past a's max_steps: never trained
    push_batches(BatchStream(redis_url, b), [1, 2], seed=2)
    run_file(runs_dir, b, tmp_path / "b", max_steps=2)
    trainer = MultiRunTrainer(cfg, dist.init_distributed("cpu"))
    trainer._build()
    base = parameters()
    trainer._start_servers()  # real gRPC status and /metrics
    try:
        trainer.add_run(cfg.runs[0])
        assert [r.name for r in trainer.scan_runs_dir()] == [b]
        adapter_size = (parameters() - base) // 2  # both runs have the same adapter shape
        assert adapter_size > 0
        optimizers = [weakref.ref(run.optimizer) for run in trainer.runs.values()]

        turn_until(trainer, lambda: a not in trainer.runs)
        assert parameters() == base + adapter_size  # a's adapter left the model
        assert not any(f".{a}." in name for name, _ in trainer.model.named_parameters())
        assert trainer.registry.get_sample_value("gyre_trainer_step", {"run_id": a}) is None  # its series too
        turn_until(trainer, lambda: not trainer.runs)
        assert parameters() == base  # the plain base model again
        assert not any("lora_" in name for name, _ in trainer.model.named_parameters())
        gc.collect()
        assert [ref() for ref in optimizers] == [None, None]  # both optimizers (and their AdamW state) are gone
        assert (trained_steps(tmp_path / "a"), trained_steps(tmp_path / "b")) == ([1], [1, 2])
        status = grpc_status(trainer.grpc_port)
        assert {r.name: (r.step, r.finished) for r in status.runs} == {a: (1, True), b: (2, True)}
        assert status.tokens == sum(r.tokens for r in status.runs) > 0

        # a finished run added again resumes at its max_steps: released at once, step 2 never trains
        trainer.add_run(cfg.runs[0])
        trainer.turn()
        assert a not in trainer.runs and trained_steps(tmp_path / "a") == [1]
        assert trainer.scan_runs_dir() == []  # b's file did not change: b stays finished

        # b's file with a larger max_steps resumes b after step 2; removing the file stops it, released
        run_file(runs_dir, b, tmp_path / "b", max_steps=3)
        assert [r.name for r in trainer.scan_runs_dir()] == [b]
        assert trainer.runs[b].trained_step == 2 and parameters() == base + adapter_size
        (runs_dir / f"{b}.toml").unlink()
        trainer.scan_runs_dir()
        assert not trainer.runs and parameters() == base and trainer.status.runs[b].finished
        run_file(runs_dir, b, tmp_path / "b", max_steps=3)  # put back: it resumes where it stopped
        push_batches(BatchStream(redis_url, b), [3], seed=2)
        trainer.scan_runs_dir()
        turn_until(trainer, lambda: not trainer.runs)
        assert trained_steps(tmp_path / "b") == [1, 2, 3]  # every step once
        assert parameters() == base
    finally:
        trainer._close()


def test_a_multirun_trainer_reads_a_password_protected_redis(tiny_model, unique_run_id, tmp_path):
    """The chart always runs Redis with a password (`redis.password`, here from GYRE_REDIS__PASSWORD as a pod
    gets it): every run's stream must be read with it. A client built from `redis.url` alone is refused
    (AuthenticationError), which the intake retried until it was killed: no step trained."""
    from gyre.config import to_toml
    from gyre.redis_server import EmbeddedRedis
    from trainer_testlib import child_env

    password = "multi-run s3cret"
    names = [f"{unique_run_id}-a", f"{unique_run_id}-b"]
    with EmbeddedRedis(password=password) as server:
        with server.client() as client:
            for i, name in enumerate(names):
                push_batches(BatchStream(client, name), [1, 2], seed=30 + i)
        runs = [{"name": n, "output_dir": str(tmp_path / n), "max_steps": 2} for n in names]
        config = tmp_path / "trainer.toml"
        config.write_text(to_toml(multirun_config(tiny_model, server.url, runs)))  # the URL carries no password
        proc = start_trainer(["@", str(config)], tmp_path / "trainer.log",
                             env={**child_env(), "GYRE_REDIS__PASSWORD": password})  # fmt: skip
        try:
            code = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                kill_group(proc)
        assert code == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    for name in names:
        assert trained_steps(tmp_path / name) == [1, 2]


def test_multirun_steps_reach_each_runs_offline_wandb_run(tiny_model, redis_url, unique_run_id, tmp_path, monkeypatch):
    """Every service logs to W&B when `wandb.enabled` (docs/observability): a multi-run trainer logs each run's
    steps to a W&B run of its own (`<run>-trainer`, grouped with the run's orchestrator), in the run's folder."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra is part of the dev install")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    names = [f"{unique_run_id}-a", f"{unique_run_id}-b"]
    for i, name in enumerate(names):
        push_batches(BatchStream(redis_url, name), [1, 2], seed=40 + i)
    runs = [{"name": n, "output_dir": str(tmp_path / n), "max_steps": 2} for n in names]
    assert run_trainer(multirun_config(tiny_model, redis_url, runs, wandb={"enabled": True, "mode": "offline"})) == 0
    wandb.teardown()  # flushes the run files (a trainer process exiting does this)
    for name in names:
        (run_dir,) = (tmp_path / name / "wandb").glob("offline-run-*")
        data = next(run_dir.glob("run-*.wandb")).read_bytes()
        for key in (b"trainer/loss", b"trainer/step", f"{name}-trainer".encode()):
            assert key in data, (name, key)
