"""`gyre sft`: supervised fine-tuning on chat conversations, loss on assistant tokens only.

    gyre sft --model.name outputs/model --data.path chats.jsonl --max-steps 300
    gyre sft --model.name outputs/model --data.env reverse_text --data.num-examples 2000
    gyre sft --model.name outputs/model --data.fake                 # generated data, no files needed
    torchrun --nproc-per-node 2 -m gyre_trainer.sft ...             # FSDP2, like the RL trainer

Data: one source out of `data.path` (JSONL, one `{"messages": [...], "tools": [...]?}` per line),
`data.env` (an environment's reference answers, `Environment.sft_example`) or `data.fake`
(deterministic copy/count conversations). Every conversation is rendered with the tokenizer's chat
template and only what the model generates is learned: each assistant turn (text, tool calls, a
reasoning block the template adds) and its end-of-turn token, never prompts, tool outputs or the
template's text between turns (`sft_data.assistant_mask`). Conversations are
packed back to back into rows of `data.seq_len` tokens (position ids restart per conversation, so
attention never crosses them); one that does not fit (or is longer than the model's context) is truncated, and said
so.

Step `s` always trains the same rows (epoch and offset follow from `s`; each epoch is a seeded
shuffle), so resuming from a checkpoint continues the exact data order. The result is a
servable HF folder (`save_dir`, default `{output_dir}/sft`) that `model.name` of an RL run can use.
Checkpoints go to `{output_dir}/checkpoints/sft/` with the trainer's machinery; one line per step
is appended to `{output_dir}/events/sft_steps.jsonl` (and logged to W&B as `sft/*` with `wandb.enabled`).

Re-runs (as `gyre rl`): the same command again continues where the SFT stands. A finished one (its result in
`save_dir` records its step in `gyre_sft.json`) says so and exits 0 without training; a larger `max_steps`
continues it after its last step (an SFT that keeps checkpoints checkpoints its last step too), and without
checkpoints is refused (it would start over from `model.name` and replace the result); a `save_dir` holding anything
else is never replaced.
`ckpt.resume_step = N` rewinds and trains again from checkpoint N (0: from `model.name`). A checkpoint N that does not
exist, or a `max_steps` below the checkpoint training would resume from, is refused before the model loads. Training
records its settings in `{output_dir}/configs/sft.toml` (what `gyre rl` writes for its warm-up); a re-run that would go
on from (or find finished) an SFT of other settings (`model.name`, `data.*`, `optim.*`, `seed`...; how far it goes,
`max_steps` / `epochs`, is free) is refused before anything loads, naming every changed key: the steps of two
configs were mixed into one result, recorded as the second. So is one whose data changed under the same settings (an
edited `data.path` file): checkpoints and the result record the SHA-256 of the packed rows
(`sft_checks.check_same_data`).
`--ckpt.resume-step 0` trains again from `model.name`. Training in the folder of a `gyre rl` run (running, or one
that has trained, pushed a batch or written its trainer config) is refused naming `output_dir`
(`sft_checks.check_not_an_rl_run`): the SFT result there is the base of the run's steps; a `save_dir` holding the
result of another output folder's SFT, naming `save_dir` (`sft_checks.check_save_dir_is_ours`).

Stopping (as the RL trainer, docs/trainer.md "Stopping"): SIGTERM or SIGINT (Kubernetes, `gyre rl`, Ctrl-C, torchrun
forwarding either to its workers) finishes the step in flight on every rank, checkpoints it (`ckpt.on_stop`, unless it
has its checkpoint already) and exits 0; the same command resumes after it, every step trained once. A second Ctrl-C of
a single process stops at once (exit 130; torchrun's workers are stopped by torchrun's own `--shutdown-timeout`).

Layout: this module is the command (`main`: locks, checks, signals, exit codes) and the training loop (`run`: stop
handling, checkpoints, the result's save); the data (sources, chat-template masks, packing, step order) is
`gyre_trainer.sft_data`, and what a start or re-run may do (the checks above, the result's marker and the save_dir
lock) is `gyre_trainer.sft_checks`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

from gyre.config import parse_or_exit, to_toml
from gyre.config.trainer import SFTConfig
from gyre.logging import setup_logging

from gyre_trainer.sft_checks import (
    RESULT_MARKER,
    check_lora_targets,
    check_not_an_rl_run,
    check_rerun,
    check_resume,
    check_same_data,
    finished_step,
    read_json_object,
    rows_digest,
    save_dir_lock,
    save_dir_of,
    save_lock_error,
)
from gyre_trainer.sft_data import SFTDataError, SFTInterrupted, prepare_rows, rows_for_step, unseen_per_epoch
from gyre_trainer.stopping import StopSignals

log = logging.getLogger("gyre_trainer.sft")  # also when run as `python -m gyre_trainer.sft`

SFT_STEPS = "sft_steps.jsonl"

# Set by SIGTERM/SIGINT (main): the loop stops before its next step, never inside a checkpoint save (torch's
# checkpoint writer turns a KeyboardInterrupt raised there into a CheckpointException); a second Ctrl-C of a single
# process stops at once (gyre_trainer.stopping).
STOP = threading.Event()
# Set while the steps are trained (and the result saved): before, a stop has no step to finish (the data is being
# prepared, the model loaded), and its line says so.
TRAINING = threading.Event()


# ---- training -----------------------------------------------------------------------------------


def run(cfg: SFTConfig) -> int:
    from gyre.events import EventLog, events_dir
    from gyre.wandb_log import WandbLogger
    from tqdm import tqdm

    from gyre_trainer import dist
    from gyre_trainer.checkpoint import PROGRESS, CheckpointManager, plan_resume
    from gyre_trainer.model import load_model, load_tokenizer, model_context, resolve_dtype
    from gyre_trainer.optim import build_optimizer, build_scheduler
    from gyre_trainer.step import sft_step

    ctx = dist.init_distributed(cfg.device)
    wandb = None
    try:
        data = cfg.data
        if data.batch_size % ctx.world_size or (data.batch_size // ctx.world_size) < 1:
            raise SFTDataError(f"data.batch_size={data.batch_size} must be a multiple of the {ctx.world_size} ranks")
        dist.seed_everything(cfg.seed, cfg.deterministic)
        # one process stops while tokenizing; torchrun's ranks (signalled at different instants) agree before the
        # model loads (stop_requested below), so that none waits in a collective for one that left
        try:
            rows = prepare_rows(cfg, load_tokenizer(cfg.model), model_context(cfg.model),
                                None if ctx.distributed else STOP)  # fmt: skip
        except SFTInterrupted:
            raise _stopped_before_training(cfg) from None
        steps_per_epoch = len(rows) // data.batch_size
        total = min(cfg.max_steps, cfg.epochs * steps_per_epoch) if cfg.epochs else cfg.max_steps
        if unseen := unseen_per_epoch(len(rows), data.batch_size, ctx.world_size):
            log.warning("%d of %d rows per epoch are not trained (fewer than the %d ranks; a different few each "
                        "epoch)", unseen, len(rows), ctx.world_size)  # fmt: skip
        save_dir, output_dir = save_dir_of(cfg), Path(cfg.output_dir)
        checkpoints = CheckpointManager(
            output_dir / "checkpoints" / "sft", ctx, cfg.ckpt.keep_last, cfg.ckpt.keep_interval
        )
        have_checkpoints = bool(checkpoints.steps())
        rewind = cfg.ckpt.resume_step is not None and cfg.ckpt.resume_step >= 0  # asked for: trains again from there
        digest = rows_digest(rows)
        if not rewind and (done := finished_step(save_dir, total, have_checkpoints)) is not None:
            check_same_data(cfg, digest, read_json_object(save_dir / RESULT_MARKER), f"the SFT in {save_dir}")
            if ctx.is_main:
                print(
                    f"gyre sft: already finished: {save_dir} holds the result of step {done} (max_steps {total}); "
                    f"delete it to train again{'' if have_checkpoints else ' from model.name'}",
                    flush=True,
                )
            return 0
        check_not_an_rl_run(cfg)  # it would train: not into an RL run's folder
        check_resume(cfg, checkpoints.steps(), total, output_dir / "checkpoints" / "sft")
        plan = plan_resume(cfg.ckpt.resume_step, checkpoints.steps(), None)
        if plan.checkpoint_step:  # before anything loads: its rows are the ones it goes on with
            check_same_data(cfg, digest, read_json_object(checkpoints.path(plan.checkpoint_step) / PROGRESS),
                            f"checkpoint step {plan.checkpoint_step} in {checkpoints.root}")  # fmt: skip
        if ctx.is_main:  # what the re-run compares with (check_rerun); atomic: a kill mid-write leaves the old one
            from gyre.config.rerun import SFT_RECORD
            from gyre.fsio import write_atomic

            write_atomic(output_dir / SFT_RECORD, to_toml(cfg).encode(), mode=0o600)
        if (newest := max(checkpoints.steps(), default=0)) and not rewind:  # what a re-run does, before it loads
            log.info(
                "%d steps per epoch; continuing from checkpoint step %d to step %d", steps_per_epoch, newest, total
            )
        else:
            log.info("%d steps per epoch; training %d steps", steps_per_epoch, total)

        if stop_requested(ctx):  # while the data was prepared: stopped now, not after the model has loaded
            raise _stopped_before_training(cfg)
        dtype = resolve_dtype(cfg.model.dtype, ctx.device)
        model = load_model(cfg.model, ctx.device, dtype)
        hf_config = model.config  # the base model's: the result is the base with the adapter merged in
        if cfg.lora is not None:
            from gyre_trainer.lora import apply_lora

            model = apply_lora(model, cfg.lora, key="lora")  # the base frozen: the optimizer and checkpoints hold it
        model = dist.shard_model(model, ctx)
        optimizer = build_optimizer(model, cfg.optim, cfg.lora.lr_ratio_b if cfg.lora else 1.0)
        scheduler = build_scheduler(optimizer, cfg.optim, total)
        if ctx.is_main and plan.discard_after is not None:
            checkpoints.discard_after(plan.discard_after)
        dist.barrier(ctx)
        start = plan.checkpoint_step or 0
        if start:
            checkpoints.load(start, model, optimizer, scheduler)

        events = EventLog(events_dir(output_dir) / SFT_STEPS) if ctx.is_main else None
        if ctx.is_main:  # `sft/*` per step, like the trainer's `trainer/*` (a no-op unless wandb.enabled)
            wandb = WandbLogger(cfg.wandb, service="sft", run_id=cfg.run_id, output_dir=output_dir,
                                config=cfg)  # fmt: skip
        bar = tqdm(total=total, initial=start, desc="sft", unit="step", disable=not ctx.is_main, file=sys.stderr)
        checkpointed, last = start or None, None  # the newest step saved or loaded; (step, record) trained last
        TRAINING.set()
        for step in range(start + 1, total + 1):
            if stop_requested(ctx):
                bar.close()
                saved = checkpoint_on_stop(
                    cfg, checkpoints, last, checkpointed, model, optimizer, scheduler, data_sha256=digest
                )
                if events:
                    events.close()
                dist.barrier(ctx)  # ranks leave together (the save is collective; so is the process group's end)
                raise SFTInterrupted(step - 1, max(checkpoints.steps(), default=None), saved)
            epoch, batch = rows_for_step(rows, step, data.batch_size, cfg.seed, ctx.world_size)
            began = time.perf_counter()
            metrics = sft_step(
                model,
                optimizer,
                scheduler,
                batch[ctx.rank :: ctx.world_size],
                max_grad_norm=cfg.optim.max_grad_norm,
                micro_batch_size=data.micro_batch_size,
                world_size=ctx.world_size,
            ).metrics
            seconds = time.perf_counter() - began
            record = {"step": step, "epoch": epoch, **metrics, "step_seconds": seconds,
                      # the step's tokens, all ranks, over its wall time: the RL trainer's `tokens_per_second`
                      "tokens_per_second": metrics["num_tokens"] / seconds if seconds > 0 else 0.0}  # fmt: skip
            if events:
                wandb.log(events.append(record))
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", epoch=epoch)
            bar.update(1)
            last = (step, record)
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                checkpoints.save(step, model, optimizer, scheduler, record, data_sha256=digest)
                checkpointed = step
        bar.close()
        if last is not None and checkpointed != total and (cfg.ckpt.interval or checkpointed is not None):
            # the last step too, when this SFT keeps checkpoints: a re-run with a larger max_steps continues from the
            # newest one, and steps after the last interval checkpoint (5 of max_steps 5, interval 2) were trained
            # again there and logged twice
            checkpoints.save(total, model, optimizer, scheduler, last[1], data_sha256=digest)
        state_dict = dist.full_state_dict(model, ctx)
        if ctx.is_main:
            adapter = None
            if cfg.lora is not None:  # merged: what RL, inference and from_pretrained load; the adapter kept beside
                from gyre_trainer.lora import adapter_state_dict, merged_state_dict

                adapter, state_dict = adapter_state_dict(state_dict), merged_state_dict(state_dict, cfg.lora)
            save_hf_model(save_dir, state_dict, hf_config, cfg.model.name, step=total, data_sha256=digest,
                          output_dir=output_dir, adapter=adapter, lora=cfg.lora)  # fmt: skip
            log.info("SFT done after %d steps: %s (use it as model.name)", total, save_dir)
            events.close()
        dist.barrier(ctx)
        return 0
    finally:
        TRAINING.clear()
        if wandb is not None:
            wandb.finish()
        dist.shutdown(ctx)


def stop_requested(ctx) -> bool:
    """Whether any rank got SIGTERM/SIGINT, agreed by every rank (torchrun forwards a signal to each worker, not at the
    same instant: ranks that stopped at different steps would hang in the next step's collectives)."""
    from gyre_trainer import dist

    if not ctx.distributed:
        return STOP.is_set()
    return any(flags[0] for flags in dist.gather_floats([float(STOP.is_set())], ctx))


def _stopped_before_training(cfg: SFTConfig) -> SFTInterrupted:
    """A stop before the first step: what the same command does next, from the checkpoint it resumes from, if any."""
    from gyre.runstate import sft_checkpoints

    resume = cfg.ckpt.resume_step
    at = resume if resume is not None and resume >= 0 else max(sft_checkpoints(cfg.output_dir), default=0)
    return SFTInterrupted(at, at or None)


def checkpoint_on_stop(cfg: SFTConfig, checkpoints, last, checkpointed, model, optimizer, scheduler, **extra) -> bool:
    """A graceful stop: checkpoint the last trained step (`ckpt.on_stop`) unless it has its checkpoint already, as the
    RL trainer's `RunState.checkpoint_on_stop` does, with the same `CheckpointManager.save` (every rank, atomic), so
    the same command resumes after it (`plan_resume`). Nothing when nothing was trained since the resume.
    `extra`: kept in the checkpoint's progress.json (`data_sha256`). True when it saved."""
    if last is None:
        return False
    step, record = last
    if checkpointed == step:
        log.info("stopping: step %d has its checkpoint already", step)
        return False
    if not cfg.ckpt.on_stop:
        log.info("stopping without a checkpoint of step %d (ckpt.on_stop = false)", step)
        return False
    log.info("stopping: checkpointing step %d first (ckpt.on_stop)", step)
    checkpoints.save(step, model, optimizer, scheduler, record, **extra)
    return True


def save_hf_model(
    save_dir: Path,
    state_dict,
    config,
    base_model: str,
    step: int | None = None,
    data_sha256: str | None = None,
    output_dir: Path | None = None,
    adapter: dict | None = None,
    lora=None,
) -> Path:
    """Write the HF folder next to `save_dir` and swap it in with renames: never half a model there.
    `step`: the SFT step it holds, recorded in RESULT_MARKER (`finished_step`) with `data_sha256` (`rows_digest`)
    and `output_dir`, the SFT's folder (`check_save_dir_is_ours`). `adapter` (a LoRA SFT's, merged into
    `state_dict`): also written alone as the PEFT folder `lora/` (its `lora` config)."""
    from gyre.fsio import commit_dir

    from gyre_trainer.publish import write_hf_folder

    save_dir = Path(save_dir)
    save_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = save_dir.parent / f".tmp-{save_dir.name}-{uuid.uuid4().hex}"
    try:
        write_hf_folder(tmp, state_dict, config, base_model)
        if adapter is not None:
            from gyre_trainer.lora import write_adapter_folder

            write_adapter_folder(tmp / "lora", adapter, lora, str(base_model))
        if step is not None:
            made_in = str(Path(output_dir).resolve()) if output_dir is not None else None
            marker = {"step": step, "data_sha256": data_sha256, "output_dir": made_in}
            (tmp / RESULT_MARKER).write_text(json.dumps(marker) + "\n")
        commit_dir(tmp, save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return save_dir


def main(argv: list[str] | None = None) -> int:
    from gyre_trainer.torchrun import run_worker

    return run_worker(_main, argv)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_or_exit(SFTConfig, argv, "gyre sft")
    # a gyre rl run's folder without an SFT result to find finished (run() checks that case, once the data is read):
    # refused now, not after fetching the model and tokenizing the data, nor holding the sft lock its warm-up needs
    if not (save_dir_of(cfg) / RESULT_MARKER).is_file():
        try:
            check_not_an_rl_run(cfg)
        except SFTDataError as e:
            print(f"gyre sft: error: {e}", file=sys.stderr)
            return 2
    from gyre.model_source import check_service_model

    if (code := check_service_model(cfg.model.name, "gyre sft", hub=True, config=cfg)) is not None:
        return code  # not the hub client's "Repo id must be in the form ..." traceback
    rank = int(os.environ.get("RANK", "0"))
    from gyre.runlock import LockHeld, RunLock

    # one SFT per output folder: two at once interleaved their step records and deleted each other's checkpoints
    lock = RunLock(cfg.output_dir, "sft") if rank == 0 else None
    save_lock = save_dir_lock(cfg) if rank == 0 else None
    try:
        if lock is not None:
            lock.acquire()
    except LockHeld as e:
        print(f"gyre sft: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # not a folder, not writable...
        print(f"gyre sft: error: config key 'output_dir': cannot use {cfg.output_dir}: {e}", file=sys.stderr)
        return 2
    try:
        if save_lock is not None:  # one SFT per save_dir too: two output folders given one --save-dir
            save_lock.acquire()
    except (LockHeld, OSError) as e:
        lock.release()
        print(f"gyre sft: error: {save_lock_error(cfg, e)}", file=sys.stderr)
        return 2
    try:
        from gyre.config.loader import collect
        from gyre.config.rerun import dotted_keys
        from gyre.wandb_log import WandbUnavailable, check_wandb

        check_rerun(cfg, dotted_keys(collect(argv, SFTConfig)))
        check_wandb(cfg.wandb)  # before the data and the model load (minutes), not at the first step
        check_lora_targets(cfg)
    except (SFTDataError, WandbUnavailable) as e:
        for held in (save_lock, lock):
            if held is not None:
                held.release()
        print(f"gyre sft: error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, cfg.log.file, "sft" if rank == 0 else f"sft-rank{rank}", cfg.log.format, cfg.run_id)
    # Every rank, SIGTERM too (Kubernetes, `gyre rl`, torchrun forwarding it): only SIGINT was handled, and only in a
    # single process, so a SIGTERM killed the SFT mid-step with nothing saved since its last interval.
    signals = StopSignals(STOP, log, step_running=TRAINING.is_set).install()
    try:
        return run(cfg)
    except SFTDataError as e:
        print(f"gyre sft: error: {e}", file=sys.stderr)
        return 2
    except SFTInterrupted as e:  # a graceful stop: what a re-run does next, not a traceback
        if rank == 0:
            print(f"gyre sft: stopped{_resume_hint(cfg, e)}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:  # a second Ctrl-C
        return _forced(cfg)
    except Exception:
        if signals.forced.is_set():  # a second Ctrl-C inside a checkpoint save: torch re-raises it as its own error
            return _forced(cfg)
        log.exception("sft failed")
        return 1
    finally:
        signals.restore()  # main() runs in-process too (tests)
        for held in (save_lock, lock):
            if held is not None:
                held.release()


def _resume_hint(cfg: SFTConfig, e: SFTInterrupted) -> str:
    ckpt_dir = Path(cfg.output_dir) / "checkpoints" / "sft"
    if e.checkpoint is not None:
        saved = " (saved on this stop)" if e.saved else ""
        where = f"checkpoint step {e.checkpoint}{saved} in {ckpt_dir}"
        return f" after step {e.step}; the same command resumes from {where}"
    why = "ckpt.on_stop = false" if not cfg.ckpt.on_stop else "nothing trained yet"
    return f" after step {e.step}; no checkpoint ({why}): the same command starts over"


def _forced(cfg: SFTConfig) -> int:
    ckpt_dir = Path(cfg.output_dir) / "checkpoints" / "sft"
    print(f"gyre sft: interrupted at once; the same command resumes from the newest complete checkpoint in {ckpt_dir}"
          ", if any (else it starts over)", file=sys.stderr)  # fmt: skip
    return 130


if __name__ == "__main__":
    raise SystemExit(main())
