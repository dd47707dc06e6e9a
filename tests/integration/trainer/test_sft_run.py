"""`gyre sft` end to end on the tiny model: the loss falls, the result is a model transformers loads,
and a run resumed from its checkpoint ends with exactly the weights of a straight run."""

from __future__ import annotations

import json

import pytest
import torch
from gyre.config import load_config
from gyre.config.trainer import SFTConfig
from gyre.events import read_events
from gyre_trainer import sft
from gyre_trainer.sft_checks import RESULT_MARKER
from support.locks import hold_run_lock
from trainer_testlib import LORA, load_weights, sft_args

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]


def test_sft_on_generated_data_learns_and_loads_in_transformers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = sft_args(tiny_model, tmp_path, **{"data.fake": "true", "data.num-examples": 200, "max-steps": 16})
    assert sft.run(load_config(SFTConfig, args)) == 0
    records = read_events(tmp_path / "events" / sft.SFT_STEPS)
    losses = [r["loss"] for r in records]
    assert len(losses) == 16
    for r in records:  # throughput, as the RL trainer logs it: the step's real (unpadded) tokens over its time
        assert 0 < r["num_loss_tokens"] < r["num_tokens"] <= 4 * 64
        assert r["tokens_per_second"] == pytest.approx(r["num_tokens"] / r["step_seconds"])
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    trained = load_weights(tmp_path / "sft")
    assert any(not torch.equal(trained[k], v) for k, v in load_weights(tiny_model).items())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 3 to 6."}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_sft_resume_from_checkpoint_matches_a_straight_run(tiny_model, tmp_path, lora):
    # warmup: the LR differs per step, so a scheduler restored at the wrong step would show; with lora, the
    # checkpoint holds the adapter and its optimizer state alone (test_sft_lora.py)
    common = {"data.env": "reverse_text", "data.num-examples": 60, "ckpt.interval": 2, "optim.warmup-steps": 3}
    common |= {"lora": lora} if lora else {}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert sft.run(load_config(SFTConfig, sft_args(tiny_model, straight, **common, **{"max-steps": 4}))) == 0
    assert sft.run(load_config(SFTConfig, sft_args(tiny_model, resumed, **common, **{"max-steps": 2}))) == 0
    assert sft.run(load_config(SFTConfig, sft_args(tiny_model, resumed, **common, **{"max-steps": 4}))) == 0
    a, b = load_weights(straight / "sft"), load_weights(resumed / "sft")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _files(folder):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_a_finished_sft_without_checkpoints_is_not_trained_again(tiny_model, tmp_path, capsys):
    # the same command again trained every step again and replaced the result (no checkpoint said it was done)
    args = sft_args(tiny_model, tmp_path, **{"data.fake": "true", "data.num-examples": 40, "max-steps": 2})
    assert sft.main(args) == 0
    result = _files(tmp_path / "sft")
    capsys.readouterr()
    assert sft.main(args) == 0
    assert "gyre sft: already finished" in capsys.readouterr().out
    assert len(read_events(tmp_path / "events" / sft.SFT_STEPS)) == 2
    assert _files(tmp_path / "sft") == result

    # more steps without a checkpoint to continue from: refused, naming the key; the result stays
    more = sft_args(tiny_model, tmp_path, **{"data.fake": "true", "data.num-examples": 40, "max-steps": 3})
    assert sft.main(more) == 2
    err = capsys.readouterr().err
    assert "config key 'max_steps'" in err and "no checkpoint continues it" in err
    assert _files(tmp_path / "sft") == result and len(read_events(tmp_path / "events" / sft.SFT_STEPS)) == 2


def test_sft_never_replaces_a_folder_it_did_not_write(tiny_model, tmp_path, capsys):
    # save_dir = the base model's own folder (a slip of the user's) was overwritten by the SFT result
    before = _files(tiny_model)
    args = sft_args(tiny_model, tmp_path, **{"data.fake": "true", "data.num-examples": 40, "max-steps": 1,
                                             "save-dir": tiny_model})  # fmt: skip
    assert sft.main(args) == 2
    assert "config key 'save_dir'" in capsys.readouterr().err
    assert _files(tiny_model) == before


def test_a_resume_from_a_missing_checkpoint_or_one_past_max_steps_is_refused(tiny_model, tmp_path, capsys):
    # a missing --ckpt.resume-step was a traceback after the model loaded (exit 1); a max_steps below the newest
    # checkpoint trained nothing and saved that checkpoint's weights as the result of step max_steps
    common = {"data.fake": "true", "data.num-examples": 40, "ckpt.interval": 1}
    assert sft.main(sft_args(tiny_model, tmp_path, **common, **{"max-steps": 3})) == 0
    (tmp_path / "sft").rename(tmp_path / "first")  # kept: a new result would go to sft/
    capsys.readouterr()
    for extra, key, said in [
        ({"max-steps": 2}, "max_steps", "resumes from checkpoint step 3"),
        ({"max-steps": 4, "ckpt.resume-step": 7}, "ckpt.resume_step", "no SFT checkpoint of step 7"),
    ]:
        assert sft.main(sft_args(tiny_model, tmp_path, **common, **extra)) == 2
        err = capsys.readouterr().err
        assert f"gyre sft: error: config key '{key}'" in err and said in err and "Traceback" not in err, err
        assert not (tmp_path / "sft").exists() and len(read_events(tmp_path / "events" / sft.SFT_STEPS)) == 3
    # back to step 2 is a rewind to its checkpoint: the result is step 2's
    assert sft.main(sft_args(tiny_model, tmp_path, **common, **{"max-steps": 2, "ckpt.resume-step": 2})) == 0
    assert json.loads((tmp_path / "sft" / RESULT_MARKER).read_text())["step"] == 2


def test_a_larger_max_steps_continues_after_the_last_step_trained(tiny_model, tmp_path, capsys):
    # the last step had no checkpoint (max_steps 3, interval 2): a re-run to 5 resumed from step 2 and trained step 3
    # a second time, logging it twice
    common = {"data.fake": "true", "data.num-examples": 40, "ckpt.interval": 2}
    assert sft.main(sft_args(tiny_model, tmp_path, **common, **{"max-steps": 3})) == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "sft").iterdir()) == ["step_2", "step_3"]
    assert sft.main(sft_args(tiny_model, tmp_path, **common, **{"max-steps": 5})) == 0
    assert [r["step"] for r in read_events(tmp_path / "events" / sft.SFT_STEPS)] == [1, 2, 3, 4, 5]
    assert "continuing from checkpoint step 3 to step 5" in capsys.readouterr().err


def test_a_rerun_on_edited_data_is_refused_naming_the_file(tiny_model, tmp_path, capsys):
    # same settings, other rows: the file was edited in place. The re-run went on from the old checkpoint with the new
    # data (or said "already finished"), two datasets mixed into one result
    chats = tmp_path / "chats.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                      {"role": "assistant", "content": f"number {i} " * (1 + i % 4)}]})
             for i in range(40)]  # fmt: skip
    chats.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    common = {"data.path": chats, "ckpt.interval": 1}
    assert sft.main(sft_args(tiny_model, out, **common, **{"max-steps": 2})) == 0
    marker = (out / "sft" / RESULT_MARKER).read_text()
    chats.write_text("\n".join(lines).replace("number", "digit") + "\n")
    capsys.readouterr()
    for max_steps, what in [(2, f"the SFT in {out / 'sft'}"), (3, "checkpoint step 2 in")]:
        assert sft.main(sft_args(tiny_model, out, **common, **{"max-steps": max_steps})) == 2
        err = capsys.readouterr().err
        assert "gyre sft: error: config key 'data.path': the data is not what " in err and what in err, err
        assert f"{chats} changed since" in err and "--ckpt.resume-step 0" in err
        assert (out / "sft" / RESULT_MARKER).read_text() == marker
        assert len(read_events(out / "events" / sft.SFT_STEPS)) == 2
    chats.write_text("\n".join(lines) + "\n")  # put back: it goes on
    assert sft.main(sft_args(tiny_model, out, **common, **{"max-steps": 3})) == 0
    assert [r["step"] for r in read_events(out / "events" / sft.SFT_STEPS)] == [1, 2, 3]


def test_an_output_dir_holding_a_trained_rl_run_is_refused(tiny_model, tmp_path, capsys):
    # gyre sft and gyre rl share the default outputs/run: a stand-alone SFT in an RL run's folder went on as if it were
    # its own, and a larger max_steps or --ckpt.resume-step 0 replaced the SFT result the run's steps were trained from
    args = sft_args(tiny_model, tmp_path, **{"data.fake": "true", "data.num-examples": 40, "max-steps": 2,
                                             "ckpt.interval": 1})  # fmt: skip
    assert sft.main(args) == 0  # the run's SFT warm-up
    result = _files(tmp_path / "sft")
    trained = tmp_path / "checkpoints" / "trainer" / "step_3"  # the RL trainer's checkpoint (complete: progress.json)
    trained.mkdir(parents=True)
    (trained / "progress.json").write_text('{"step": 3}')
    capsys.readouterr()
    assert sft.main(args) == 0 and "already finished" in capsys.readouterr().out  # trains nothing: fine
    for extra in ({"max-steps": 4}, {"ckpt.resume-step": 0}, {"ckpt.resume-step": 0, "data.num-examples": 60}):
        assert sft.main([*args, *[x for k, v in extra.items() for x in (f"--{k}", str(v))]]) == 2
        err = capsys.readouterr().err
        assert f"gyre sft: error: config key 'output_dir': {tmp_path} holds a gyre rl run" in err, err
        assert "committed step 3" in err and "its own --output-dir" in err
    assert _files(tmp_path / "sft") == result and len(read_events(tmp_path / "events" / sft.SFT_STEPS)) == 2


@pytest.mark.parametrize("state", ["running", "batches pushed", "launched"])
def test_an_output_dir_of_an_rl_run_before_its_first_step_is_refused(tiny_model, tmp_path, capsys, monkeypatch, state):
    # refused only once the run's trainer had committed a step: before it, a larger max_steps or --ckpt.resume-step 0
    # replaced the SFT result the run's pushed batches were generated from (and the trainer then trained them on
    # another model), or raced the launch's own warm-up for the folder
    from gyre.runstate import RL_WARM_UP_ENV

    args = sft_args(tiny_model, tmp_path, **{"data.fake": "true", "data.num-examples": 40, "max-steps": 2,
                                             "ckpt.interval": 1})  # fmt: skip
    assert sft.main(args) == 0  # the run's SFT warm-up
    result, holder = _files(tmp_path / "sft"), None
    if state == "running":
        holder = hold_run_lock(tmp_path, "rl")
    elif state == "batches pushed":
        (tmp_path / "events" / "orchestrator_steps.jsonl").write_text('{"step": 1}\n')
    else:
        (tmp_path / "configs" / "trainer.toml").write_text('run_id = "run"\n')
    said = {"running": f"gyre rl pid {holder.pid if holder else 0} is running in it",
            "batches pushed": "its orchestrator has pushed batches, no step trained yet",
            "launched": "a launch wrote its configs/trainer.toml"}[state]  # fmt: skip
    capsys.readouterr()
    try:
        assert sft.main(args) == 0 and "already finished" in capsys.readouterr().out  # trains nothing: fine
        for extra in ({"max-steps": 4}, {"ckpt.resume-step": 0}):
            assert sft.main([*args, *[x for k, v in extra.items() for x in (f"--{k}", str(v))]]) == 2
            err = capsys.readouterr().err
            assert f"gyre sft: error: config key 'output_dir': {tmp_path} holds a gyre rl run ({said}" in err, err
        assert _files(tmp_path / "sft") == result and len(read_events(tmp_path / "events" / sft.SFT_STEPS)) == 2
        # the launch's own warm-up (gyre rl names its folder to it) goes on
        monkeypatch.setenv(RL_WARM_UP_ENV, str(tmp_path.resolve()))
        assert sft.main([*args, "--max-steps", "3"]) == 0
        assert [r["step"] for r in read_events(tmp_path / "events" / sft.SFT_STEPS)] == [1, 2, 3]
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


def test_an_rl_runs_folder_without_an_sft_result_is_refused_before_the_model_or_data_is_read(tmp_path, capsys):
    # refused only after the model was fetched (a hub id: downloaded) and the data tokenized, holding the sft lock
    # that the running launch's warm-up then found taken
    holder = hold_run_lock(tmp_path, "rl")
    try:
        args = sft_args(tmp_path / "no-model", tmp_path, **{"data.path": tmp_path / "no-data.jsonl"})
        assert sft.main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"gyre sft: error: config key 'output_dir': {tmp_path} holds a gyre rl run (gyre rl pid "
                              f"{holder.pid} is running in it)"), err  # fmt: skip
        assert not (tmp_path / "locks" / "sft.lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_save_dir_holding_the_result_of_another_output_dir_is_refused(tiny_model, tmp_path, capsys):
    # two experiments sharing one --save-dir: the second said "already finished" to settings it never trained (they
    # were the first folder's), or continued its own checkpoints over the first's result
    shared = tmp_path / "shared-sft"
    common = {"data.fake": "true", "data.num-examples": 40, "max-steps": 2, "save-dir": shared, "ckpt.interval": 1}
    assert sft.main(sft_args(tiny_model, tmp_path / "a", **common)) == 0
    result = _files(shared)
    capsys.readouterr()
    for extra in ({"optim.lr": 0.5}, {"max-steps": 3}, {"ckpt.resume-step": 0}):
        assert sft.main(sft_args(tiny_model, tmp_path / "b", **{**common, **extra})) == 2
        err = capsys.readouterr().err
        assert (f"gyre sft: error: config key 'save_dir': {shared} holds the result of the SFT trained in "
                f"{(tmp_path / 'a').resolve()}, not in {tmp_path / 'b'}") in err, err  # fmt: skip
    assert _files(shared) == result and not (tmp_path / "b" / "events").exists()
    # its own folder goes on; one moved as a whole is the same SFT
    assert sft.main(sft_args(tiny_model, tmp_path / "a", **{**common, "max-steps": 3})) == 0
    (tmp_path / "a").rename(tmp_path / "moved")
    assert sft.main(sft_args(tiny_model, tmp_path / "moved", **{**common, "max-steps": 3})) == 0
    assert "already finished" in capsys.readouterr().out


def test_two_sfts_of_other_output_dirs_with_one_save_dir_at_once_are_refused_naming_the_pid(tiny_model, tmp_path,
                                                                                            capsys):  # fmt: skip
    # each output folder has its lock, the save_dir none: both trained at once and wrote one --save-dir, the last
    # result kept under the other's record; the refusal of another folder's result reads a finished one only
    import subprocess
    import sys
    import time

    from gyre.runlock import read_holder

    shared = tmp_path / "shared-sft"
    common = {"data.fake": "true", "data.num-examples": 40, "save-dir": shared}
    first = subprocess.Popen([sys.executable, "-m", "gyre.cli", "sft",
                              *sft_args(tiny_model, tmp_path / "a", **common, **{"max-steps": 100000})],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        steps, deadline = tmp_path / "a" / "events" / sft.SFT_STEPS, time.monotonic() + 300
        while not (steps.exists() and read_events(steps)):  # it trains
            assert first.poll() is None and time.monotonic() < deadline, "the first gyre sft trained no step"
            time.sleep(0.2)
        assert sft.main(sft_args(tiny_model, tmp_path / "b", **common, **{"max-steps": 2})) == 2
        err = capsys.readouterr().err
        assert (f"gyre sft: error: config key 'save_dir': {shared} is being written by another gyre sft: pid "
                f"{first.pid} on ") in err and "choose another --save-dir" in err, err  # fmt: skip
        assert not (tmp_path / "b" / "events").exists() and not (tmp_path / "b" / "locks" / "sft.lock").read_text()
        assert read_holder(tmp_path / "locks" / "save-shared-sft.lock")["pid"] == first.pid  # beside save_dir
    finally:
        first.kill()
        first.wait()
    # its holder gone (however it died), the save_dir is free
    assert sft.main(sft_args(tiny_model, tmp_path / "b", **common, **{"max-steps": 2})) == 0
    assert (shared / RESULT_MARKER).is_file()
