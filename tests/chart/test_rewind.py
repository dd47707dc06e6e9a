"""Resume and rewind as the chart wires them: the rendered containers run as local processes (test_wiring's
LocalCluster), a `helm upgrade` is a second render whose changed pods are stopped and started again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import helm_python
import pytest
from chart_testlib import experiment_toml, load_values, manifests, objects, pod_templates, render
from test_wiring import LocalCluster, _descendants

GYRE = ("inference", "orchestrator", "trainer")


def checksums(docs: list[dict]) -> dict[str, str]:
    return {comp: pod_templates(docs)[comp]["metadata"]["annotations"]["checksum/experiment"] for comp in GYRE}


def trained(cluster: LocalCluster) -> list[int]:
    events = cluster.shared / "events" / "trainer_steps.jsonl"
    return [json.loads(line)["step"] for line in events.read_text().splitlines()] if events.exists() else []


def end(cluster: LocalCluster, pods: list[str], sig: signal.Signals) -> None:
    """Stop these pods' main containers with `sig`, their children too (torchrun's workers run in their own
    sessions: a worker left running would still train and write the log of its successor)."""
    for label, proc, _ in [entry for entry in cluster.procs if entry[0].split("/")[0] in pods]:
        family = _descendants(proc.pid)
        os.killpg(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert proc.poll() is not None, label
    cluster.procs = [entry for entry in cluster.procs if entry[1].poll() is None]


def wait_for(cluster: LocalCluster, what: str, done, deadline: float) -> None:
    while not done():
        for label, proc, _ in cluster.procs:
            assert proc.poll() is None, f"{label} exited ({proc.returncode}) before {what}:\n{cluster.all_tails()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{cluster.all_tails()}"
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_helm_upgrade_setting_the_trainers_resume_step_rewinds_the_run(tmp_path):
    """The chart's defaults wrote no orchestrator progress checkpoints, and the trainer's `ckpt.resume_step` reached
    only the trainer: a `helm upgrade --set experiment.trainer.ckpt.resume_step=N` restarted the trainer alone, which
    deleted its checkpoints and weights after N while the orchestrator went on pushing batches of the abandoned steps
    (and a second key, `experiment.orchestrator.resume_step`, failed with exit 2: no progress checkpoint N). Now the
    trainer's ckpt.* is the one knob: the orchestrator keeps a progress checkpoint for every trainer checkpoint and
    rewinds with it, to the oldest trainer checkpoint too; pods that crash afterwards, still with that resume_step,
    resume where the run stands instead of rewinding it again."""
    values = load_values("values-kind.yaml")
    values["experiment"]["trainer"]["ckpt"] = {"interval": 1}
    values["secrets"] = {"seed": "rewind-test-" * 4}  # the upgrade's render keeps the Secret, as `helm upgrade` does
    docs = manifests(render(values))
    cluster = LocalCluster(docs, tmp_path)
    try:
        deadline = time.monotonic() + 600
        (redis,) = cluster.pod_names["redis"]
        (inference,) = cluster.pod_names["inference"]
        (orchestrator,) = cluster.pod_names["orchestrator"]
        (trainer,) = cluster.pod_names["trainer"]
        main = {comp: cluster.pods[comp]["spec"]["containers"][0]["name"] for comp in GYRE}
        cluster.start(redis, "redis")
        cluster.wait_ready([(redis, "redis")], deadline)
        for pod in (trainer, inference):
            for init in cluster.pods[cluster.comp_of(pod)]["spec"].get("initContainers", []):
                cluster.run_to_completion(pod, init["name"], timeout=240)
        cluster.start(inference, main["inference"])
        cluster.start(trainer, main["trainer"])
        cluster.wait_ready([(inference, main["inference"])], deadline)
        cluster.start(orchestrator, main["orchestrator"])
        ckpts = cluster.shared / "checkpoints" / "trainer"
        # a checkpoint of step 3 or later: step_3 itself lives two steps (keep_last 2), less than one poll on a
        # fast machine, and the wait once missed it and ran on until the run ended
        newest = lambda: max((int(p.name.removeprefix("step_")) for p in ckpts.glob("step_[0-9]*")), default=0)  # noqa: E731
        wait_for(cluster, "trainer checkpoint 3", lambda: newest() >= 3, deadline)

        # `helm upgrade --set experiment.trainer.ckpt.resume_step=N`: the pods whose checksum changed are replaced
        # (stopped, then started from the new template); N is the oldest checkpoint the trainer still keeps.
        end(cluster, [orchestrator, trainer], signal.SIGTERM)
        have = sorted(int(p.name.removeprefix("step_")) for p in ckpts.glob("step_*"))
        assert len(have) == 2, have  # ckpt.keep_last's default
        rewind = have[0]
        values["experiment"]["trainer"]["ckpt"]["resume_step"] = rewind
        upgraded = manifests(render(values))
        old, new = checksums(docs), checksums(upgraded)
        assert new["inference"] == old["inference"]
        assert new["trainer"] != old["trainer"] and new["orchestrator"] != old["orchestrator"], (
            "a helm upgrade setting the trainer's resume_step must restart the orchestrator too"
        )
        assert f"resume_step = {rewind}" in experiment_toml(upgraded).split("[orchestrator]")[1].split("[trainer]")[0]
        before = len(trained(cluster))
        cluster.docs, cluster.pods = upgraded, pod_templates(upgraded)
        for pod in (orchestrator, trainer):  # the new experiment file in their ConfigMap volume
            shutil.rmtree(tmp_path / pod / "configmap", ignore_errors=True)
        cluster.start(trainer, main["trainer"])
        cluster.start(orchestrator, main["orchestrator"])
        wait_for(cluster, f"step {rewind + 2} trained after the rewind",
                 lambda: rewind + 2 in trained(cluster)[before:], time.monotonic() + 420)  # fmt: skip

        assert f"rewinding to step {rewind}" in cluster.tail(trainer, main["trainer"], 400), cluster.all_tails()
        log = cluster.tail(orchestrator, main["orchestrator"], 400)
        assert f"starting at step {rewind + 1} (rewind to {rewind})" in log, cluster.all_tails()
        # every step after the rewind is trained once, in order, from the rewound step on
        after = trained(cluster)[before:]
        assert after[: after.index(rewind + 2) + 1] == list(range(rewind + 1, rewind + 3)), after

        # A crash of both pods, which restart with the same template and so the same resume_step: they rewound the
        # run again (deleting what it trained since, and training those steps a second time).
        end(cluster, [orchestrator, trainer], signal.SIGKILL)
        logged = trained(cluster)
        cluster.start(trainer, main["trainer"])
        cluster.start(orchestrator, main["orchestrator"])
        wait_for(cluster, "two steps trained after the crash", lambda: len(trained(cluster)) >= len(logged) + 2,
                 time.monotonic() + 420)  # fmt: skip
        trainer_log, log = (
            cluster.tail(trainer, main["trainer"], 400),
            cluster.tail(orchestrator, main["orchestrator"], 400),
        )
        assert "rewinding" not in trainer_log, trainer_log
        assert f"ckpt.resume_step = {rewind}: rewound to it before" in trainer_log, trainer_log
        assert f"resume_step = {rewind}: rewound to it before" in log and "(rewind to" not in log, cluster.all_tails()
        again = trained(cluster)[len(logged) :]
        assert again[:2] == [logged[-1] + 1, logged[-1] + 2], (logged, again)  # on from where the crash left it
    finally:
        cluster.stop()


def test_the_orchestrators_progress_checkpoints_follow_the_trainers_ckpt_settings():
    """One knob: the trainer's ckpt.* sets the orchestrator's progress checkpoints (always written, as `gyre rl`
    does) and its rewind; the orchestrator's own resume_step is refused at install, naming the key to set."""
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.config.trainer import CkptConfig

    def orchestrator_table(**trainer_ckpt) -> str:
        values = load_values("values-kind.yaml")
        values["experiment"]["trainer"]["ckpt"] = trainer_ckpt
        toml = experiment_toml(manifests(render(values)))
        return toml.split("[orchestrator]")[1].split("[orchestrator.")[0]

    keep, ahead = CkptConfig.model_fields["keep_last"].default, 1 + 1  # values-kind's max_async_level 1, plus one
    assert OrchestratorConfig.model_fields["max_async_level"].default == 1  # the chart's default when unset
    table = orchestrator_table()
    assert "ckpt_interval = 1\n" in table and f"ckpt_keep_last = {keep + ahead}\n" in table
    assert "resume_step" not in table
    table = orchestrator_table(interval=5, keep_last=3, resume_step=10)
    assert "ckpt_interval = 5\n" in table and f"ckpt_keep_last = {3 + ahead}\n" in table
    assert "resume_step = 10\n" in table
    assert "resume_step = 0\n" in orchestrator_table(resume_step=0)  # a rewind to the base model

    values = load_values("values-kind.yaml")
    values["experiment"]["orchestrator"]["resume_step"] = 3
    with pytest.raises(helm_python.HelmError, match=r"resume_step.*set experiment\.trainer\.ckpt\.resume_step"):
        render(values)

    # multi-run: a run's own trainer resume_step rewinds that run's orchestrator; its max_async_level sizes its
    # progress checkpoints
    values = load_values("values-kind.yaml")
    values["experiment"]["trainer"]["lora"] = {"rank": 4}
    values["runs"] = [{"name": "run-a", "trainer": {"resume_step": 0}, "orchestrator": {"max_async_level": 3}},
                      {"name": "run-b"}]  # fmt: skip
    args = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["args"]
            for d in objects(manifests(render(values)), "Deployment")}  # fmt: skip
    run_a = args["exp-gyre-orchestrator-run-a"]
    assert run_a[run_a.index("--resume_step") + 1] == "0"
    assert run_a[run_a.index("--ckpt_keep_last") + 1] == str(keep + 3 + 1)
    assert "--resume_step" not in args["exp-gyre-orchestrator-run-b"]
