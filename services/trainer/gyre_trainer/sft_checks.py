"""What `gyre sft` checks before it trains: whether it may train here, and what it does with the SFT it finds.

A start is refused (an `SFTDataError` naming the config key, before the data or the model load where it can be)
in the folder of a `gyre rl` run (`check_not_an_rl_run`), with a `save_dir` that holds another output folder's result
(`check_save_dir_is_ours`) or is being written by another SFT (`save_dir_lock`), with LoRA targets that name no layer
(`check_lora_targets`). A re-run goes on from the SFT in its folders only when it is the same SFT: the same settings
(`check_rerun`, against `{output_dir}/configs/sft.toml`), the same packed rows (`rows_digest`, `check_same_data`), a
checkpoint to resume from (`check_resume`); a finished one (`RESULT_MARKER` in `save_dir`) is found done
(`finished_step`).

Apart from the training loop (`gyre_trainer.sft`), which calls them, because they read the folders and the config
only: they are the rules of a re-run in one place, and never touch the model. They import the data side
(`gyre_trainer.sft_data`) for its rows and its error, never the loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gyre.config import to_toml
from gyre.config.trainer import SFTConfig

from gyre_trainer.sft_data import PackedRow, SFTDataError

# In the result folder (save_dir), written with it: the step it holds. A re-run reads it to know the SFT is done
# (without checkpoints a re-run trained everything again and replaced the result with a copy of itself).
RESULT_MARKER = "gyre_sft.json"


def save_dir_of(cfg: SFTConfig) -> Path:
    """Where the SFT's result goes: `save_dir`, by default `{output_dir}/sft`."""
    return Path(cfg.save_dir) if cfg.save_dir else Path(cfg.output_dir) / "sft"


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (a RESULT_MARKER, a checkpoint's progress.json); {} when there is none."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def check_not_an_rl_run(cfg: SFTConfig) -> None:
    """SFTDataError naming `output_dir` when this SFT would train in a `gyre rl` run's folder (`rl_run_in`: a launch
    running there, a step trained, a batch pushed, or its trainer config written): the SFT result there
    (`{output_dir}/sft`, its warm-up's or one `gyre rl --model.name outputs/run/sft` started from) is the base model of
    that run's steps, and of the batches it has pushed. `gyre sft` and `gyre rl` share the default `outputs/run`, so a
    larger `max_steps`, or `--ckpt.resume-step 0` (what `check_rerun`'s refusal offers), replaced the base under the
    run's checkpoints and LoRA adapters (before its first step too: the stream's batches were generated from the old
    one); without one it put an SFT result where a re-run with `sft.enabled` would take it for its own. A finished SFT
    found again trains nothing and is not refused; neither is the launch's own warm-up."""
    from gyre.runstate import rl_run_in

    output_dir = Path(cfg.output_dir)
    if why := rl_run_in(output_dir):
        raise SFTDataError(
            f"config key 'output_dir': {output_dir} holds a gyre rl run ({why}); the SFT result there "
            f"({output_dir / 'sft'}), if any, is the base model of its steps, and training would replace it or put "
            "another SFT into the run's folder: give gyre sft its own --output-dir (gyre sft and gyre rl both default "
            "to outputs/run)"
        )


def check_save_dir_is_ours(cfg: SFTConfig) -> None:
    """SFTDataError naming `save_dir` when it holds the result of an SFT trained in another output folder that still
    exists (its RESULT_MARKER's `output_dir`): two experiments sharing one `--save-dir` took each other's result for
    their own: the second said "already finished" (settings and data unchecked: they are the first folder's), went on
    from its own checkpoints over the first's result, or replaced it with `--ckpt.resume-step 0`. A folder moved as a
    whole (`mv outputs/a outputs/b`) is the same SFT: its old path no longer exists; a save_dir inside output_dir (the
    default) goes with its folder, copies (`cp -r`) included."""
    output_dir, save_dir = Path(cfg.output_dir), save_dir_of(cfg)
    if save_dir.resolve().is_relative_to(output_dir.resolve()):
        return
    made_in = read_json_object(save_dir / RESULT_MARKER).get("output_dir")
    if not isinstance(made_in, str) or not Path(made_in).is_dir() or Path(made_in) == output_dir.resolve():
        return
    raise SFTDataError(
        f"config key 'save_dir': {save_dir} holds the result of the SFT trained in {made_in}, not in {output_dir}; "
        "this SFT would take it for its own (find it finished, or continue over it): choose another --save-dir"
    )


def check_rerun(cfg: SFTConfig, explicit: set[str]) -> None:
    """SFTDataError naming every changed key when this run would go on from, or find finished, an SFT trained with
    other settings than `cfg` (its record, `SFT_RECORD`): a re-run with another dataset resumed the old checkpoint (or
    said "already finished") and silently mixed the two, as `gyre rl` refuses for its warm-up. How far it goes
    (`max_steps`, `epochs`) is free: `finished_step` and `check_resume` judge it. `explicit`: the keys this command
    sets (one only the record or only `cfg` has counts just then: a key added to gyre sft since is no change)."""
    import tomllib

    from gyre.config.rerun import SFT_RECORD, sft_changes, sft_refusal
    from gyre.runstate import SFT_CHECKPOINTS, sft_checkpoints

    check_save_dir_is_ours(cfg)
    if cfg.ckpt.resume_step == 0:
        return  # trains again from model.name: nothing of the old one is kept
    output_dir, save_dir = Path(cfg.output_dir), save_dir_of(cfg)
    finished = (save_dir / RESULT_MARKER).is_file()
    if not finished and not sft_checkpoints(output_dir):
        return
    try:
        old = tomllib.loads((output_dir / SFT_RECORD).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return  # an SFT of a gyre before the record: nothing to compare with
    if changes := sft_changes(old, tomllib.loads(to_toml(cfg)), explicit, in_progress=True):
        half_way = f"the SFT stopped half way (resumed from its checkpoint in {output_dir / SFT_CHECKPOINTS})"
        what = f"the SFT in {save_dir}" if finished else half_way
        raise SFTDataError(sft_refusal(changes, what, "a re-run continues it, it does not start over: use "
                                       "--ckpt.resume-step 0 (trains again from model.name, replacing it) or another "
                                       "--output-dir"))  # fmt: skip


def check_lora_targets(cfg: SFTConfig) -> None:
    """SFTDataError naming `lora.target_modules` when an entry names no layer of the model, checked on its skeleton
    before the data and the model load: it was a traceback once they had."""
    from gyre.lora import lora_targets_problem

    if cfg.lora and (
        problem := lora_targets_problem(cfg.model.name, [("lora.target_modules", cfg.lora.target_modules)])
    ):
        raise SFTDataError(problem)


def rows_digest(rows: list[PackedRow]) -> str:
    """SHA-256 of the packed rows (tokens, loss mask, conversation lengths) in order: what every step trains on."""
    import hashlib

    digest = hashlib.sha256()
    for row in rows:
        for part in (row.input_ids, row.loss_mask, row.sample_lengths):
            digest.update(np.ascontiguousarray(part).tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def check_same_data(cfg: SFTConfig, digest: str, recorded: dict[str, Any], what: str) -> None:
    """SFTDataError naming the data key when `what` (a checkpoint's progress.json or the result's RESULT_MARKER,
    `recorded`) was trained on other rows than `digest`. `check_rerun` compares the settings only: an edited
    `data.path` file (or another tokenizer or chat template in model.name's folder, another version of `data.env`)
    gave the same settings other rows, and the re-run went on from the old steps (or found them finished) with the
    new data, silently mixing the two. Nothing to compare when the record predates the digest."""
    old = recorded.get("data_sha256")
    if not old or old == digest:
        return
    data = cfg.data
    key, source = (("data.path", f"{data.path} changed since") if data.path is not None
                   else ("data.env", f"environment {data.env}'s tasks changed since") if data.env
                   else ("data.fake", "the generated data changed since"))  # fmt: skip
    raise SFTDataError(
        f"config key '{key}': the data is not what {what} was trained on (the same settings give other rows: "
        f"{source}, or model.name's tokenizer or chat template did); a re-run continues it, it does not start over: "
        "put the data back, or use --ckpt.resume-step 0 (trains again from model.name, replacing it) or another "
        "--output-dir"
    )


def check_resume(cfg: SFTConfig, steps: list[int], total: int, ckpt_dir: Path) -> None:
    """SFTDataError naming the key, before the model loads, when training cannot resume as asked
    (`gyre.runstate.sft_resume_problem`)."""
    from gyre.runstate import sft_resume_problem

    if (problem := sft_resume_problem(cfg.ckpt.resume_step, steps, total, ckpt_dir)) is not None:
        raise SFTDataError(f"config key '{problem[0]}': {problem[1]}")


def finished_step(save_dir: Path, total: int, have_checkpoints: bool) -> int | None:
    """The step of the SFT result in `save_dir` when a run to `total` steps has nothing left to do (None: train).

    Raises SFTDataError when training would replace something it cannot continue: a result of fewer steps with no
    checkpoint to continue from (the run would start over from model.name), or a folder gyre sft did not write."""
    if not save_dir.exists() or (save_dir.is_dir() and not any(save_dir.iterdir())):
        return None
    try:
        step = int(json.loads((save_dir / RESULT_MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise SFTDataError(
            f"config key 'save_dir': {save_dir} exists and is not a gyre sft result (no {RESULT_MARKER}): "
            "refusing to replace it; choose another save_dir (or output_dir), or delete it"
        ) from None
    if step >= total:
        return step
    if not have_checkpoints:
        raise SFTDataError(
            f"config key 'max_steps': {save_dir} holds the finished SFT of {step} steps and no checkpoint continues "
            f"it (ckpt.interval was unset): training to {total} would start over from model.name and replace it; "
            "delete it (or choose another save_dir) to do that"
        )
    return None  # continued from the newest checkpoint


def save_dir_lock(cfg: SFTConfig):
    """The lock on `save_dir`, `{its parent}/locks/save-{its name}.lock` (`gyre.runlock`): two SFTs of other output
    folders given one `--save-dir` at once both trained and wrote the result, the last one's kept, and neither
    `output_dir`'s lock nor `check_save_dir_is_ours` (which reads a finished result) saw the other."""
    from gyre.runlock import RunLock

    save_dir = save_dir_of(cfg).resolve()
    return RunLock(save_dir.parent, f"save-{save_dir.name}")


def save_lock_error(cfg: SFTConfig, e: Exception) -> str:
    """The error of a `save_dir_lock` held by another SFT (naming its pid), or that cannot be taken."""
    from gyre.runlock import LockHeld

    if isinstance(e, LockHeld):
        who = e.holder
        return (f"config key 'save_dir': {save_dir_of(cfg)} is being written by another gyre sft: pid "
                f"{who.get('pid', '?')} on {who.get('host', '?')} ({who.get('command', 'unknown command')}); wait "
                "for it to finish or choose another --save-dir")  # fmt: skip
    return f"config key 'save_dir': cannot use {save_dir_of(cfg)}: {e}"
