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
template's text between turns (`assistant_mask`). Conversations are
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
edited `data.path` file): checkpoints and the result record the SHA-256 of the packed rows (`check_same_data`).
`--ckpt.resume-step 0` trains again from `model.name`. Training in the folder of a `gyre rl` run (running, or one
that has trained, pushed a batch or written its trainer config) is refused naming `output_dir`
(`check_not_an_rl_run`): the SFT result there is the base of the run's steps; a `save_dir` holding the result of
another output folder's SFT, naming `save_dir` (`check_save_dir_is_ours`).

Stopping (as the RL trainer, docs/trainer.md "Stopping"): SIGTERM or SIGINT (Kubernetes, `gyre rl`, Ctrl-C, torchrun
forwarding either to its workers) finishes the step in flight on every rank, checkpoints it (`ckpt.on_stop`, unless it
has its checkpoint already) and exits 0; the same command resumes after it, every step trained once. A second Ctrl-C of
a single process stops at once (exit 130; torchrun's workers are stopped by torchrun's own `--shutdown-timeout`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gyre.chat import content_problem, template_messages
from gyre.config import parse_or_exit, to_toml
from gyre.config.trainer import SFTConfig, SFTDataConfig
from gyre.logging import setup_logging

from gyre_trainer.stopping import StopSignals

log = logging.getLogger("gyre_trainer.sft")  # also when run as `python -m gyre_trainer.sft`

SFT_STEPS = "sft_steps.jsonl"
# In the result folder (save_dir), written with it: the step it holds. A re-run reads it to know the SFT is done
# (without checkpoints a re-run trained everything again and replaced the result with a copy of itself).
RESULT_MARKER = "gyre_sft.json"


class SFTDataError(ValueError):
    """The dataset is unusable; the message names the file and line (or the setting) at fault."""


class SFTInterrupted(Exception):  # noqa: N818 - a stop the user asked for, not an error
    """SIGTERM/SIGINT: the loop stopped between steps (`step` done, `checkpoint` the newest saved, None if none;
    `saved`: the stop checkpointed `step` itself)."""

    def __init__(self, step: int, checkpoint: int | None, saved: bool = False):
        super().__init__(step, checkpoint, saved)
        self.step, self.checkpoint, self.saved = step, checkpoint, saved


# Set by SIGTERM/SIGINT (main): the loop stops before its next step, never inside a checkpoint save (torch's
# checkpoint writer turns a KeyboardInterrupt raised there into a CheckpointException); a second Ctrl-C of a single
# process stops at once (gyre_trainer.stopping).
STOP = threading.Event()


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    where: str = field(default="", compare=False)  # where it came from (file:line), for error messages


@dataclass
class PackedRow:
    """Conversations back to back: what `gyre_trainer.step.sft_step` trains on (numpy, length T)."""

    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # bool: assistant tokens
    sample_lengths: np.ndarray  # int32, sums to T


# ---- data sources -----------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[Conversation]:
    """Every line of `path` as a conversation; the first bad line is an `SFTDataError` naming it."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise SFTDataError(f"data.path {path}: {e.strerror or e}") from None
    conversations = []
    # split the bytes on \n, then decode each line: a file that is not UTF-8 was a UnicodeDecodeError traceback naming
    # no line, and str.splitlines() also split a JSON line at an unescaped U+2028 or \x1c inside a string
    for lineno, line_bytes in enumerate(raw.removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):  # a BOM: Windows
        where = f"{path}:{lineno}"
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SFTDataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise SFTDataError(f"{where}: not JSON ({e})") from None
        messages = doc.get("messages") if isinstance(doc, dict) else None
        if not isinstance(messages, list) or not messages:
            raise SFTDataError(f'{where}: expected {{"messages": [...]}} with at least one message')
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise SFTDataError(f"{where}: messages[{i}] must be an object with a role")
            if problem := content_problem(message):  # before the template renders it its own way, silently
                raise SFTDataError(f"{where}: messages[{i}].{problem[0]}: {problem[1]}")
        if not any(m["role"] == "assistant" for m in messages):
            raise SFTDataError(f"{where}: no assistant message, nothing to learn")
        tools = doc.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise SFTDataError(f"{where}: tools must be a list of function schemas")
        conversations.append(Conversation(messages, tools, where))
    if not conversations:
        raise SFTDataError(f"data.path {path}: no conversations")
    return conversations


def environment_conversations(name: str, args: dict[str, Any], num: int, seed: int) -> list[Conversation]:
    """The first `num` train tasks of environment `name` with their reference replies."""
    from gyre.envs import EnvironmentLoadError, load_environment
    from gyre.envs.rows import DatasetError

    try:
        env = load_environment(name, **args)
        source = env.tasks("train", seed=seed)
    except EnvironmentLoadError as e:  # a mistyped name or argument: the message lists what would work
        raise SFTDataError(f"config key 'data.env': {e}") from None
    except DatasetError as e:  # the dataset its arguments name is unusable (empty, eval rows only, a bad row)
        raise SFTDataError(f"config key 'data.env_args': {e}") from None
    rows = env.row_tasks.train if env.row_tasks is not None else None
    if rows is not None and num != len(rows):  # a dataset's train split is endless: its rows again, or a part of them
        what = f"trains each {num / len(rows):.1f} times" if num > len(rows) else f"trains {num} of them"
        log.warning("environment %s has %d train rows: data.num_examples=%d %s (%d trains each once)",
                    name, len(rows), num, what, len(rows))  # fmt: skip
    return [Conversation(env.sft_example(source[i]), env.tool_schemas, f"environment {name}, train task {i}")
            for i in range(num)]  # fmt: skip


_WORDS = ("apple", "river", "stone", "cloud", "green", "quick", "seven", "tiger", "lemon", "paper", "north", "light")


def fake_conversations(num: int, seed: int) -> list[Conversation]:
    """Deterministic, learnable chats: repeat some words, or count between two numbers."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        if rng.random() < 0.5:
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))
            prompt, answer = f"Repeat: {words}", words
        else:
            start = rng.randint(0, 20)
            stop = start + rng.randint(2, 6)
            prompt, answer = f"Count from {start} to {stop}.", " ".join(str(n) for n in range(start, stop + 1))
        out.append(Conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]))
    return out


def load_conversations(data: SFTDataConfig, seed: int) -> list[Conversation]:
    if data.path is not None:
        return read_jsonl(data.path)
    if data.env:
        return environment_conversations(data.env, data.env_args, data.num_examples, seed)
    return fake_conversations(data.num_examples, seed)


# ---- tokenisation and packing -----------------------------------------------------------------------


# `verbose` of the tokenizer on a conversation: False, because `prepare_rows` cuts one that is too long itself (and
# says so); verbose, transformers logged "Token indices sequence length is longer than the specified maximum sequence
# length for this model ... will result in indexing errors", for tokens that are never indexed past the context.
LENGTH_IS_CHECKED = False
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def tokenize(conversation: Conversation, tokenizer, end_ids: Collection[int] = ()) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered chat and its assistant mask (`assistant_mask`); `end_ids`: the end-of-turn ids.
    The chat is rendered as inference renders it (`gyre.chat.template_messages`: a `developer` turn is `system`)."""
    conversation = Conversation(template_messages(conversation.messages), conversation.tools, conversation.where)
    if _GENERATION_MARKER.search(tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(
            conversation.messages,
            tools=conversation.tools,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenizer_kwargs={"verbose": LENGTH_IS_CHECKED},
        )
        ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        mask = _through_end_of_turn(ids, mask, end_ids or _eos_of(tokenizer))
    else:
        ids, mask = assistant_mask(conversation, tokenizer, end_ids or _eos_of(tokenizer))
    if mask:
        mask[0] = False  # the first token of a sample is never in the loss (nothing predicts it)
    _check_tool_calls_are_learned(conversation, tokenizer, ids, mask)
    _check_reasoning_is_learned(conversation, tokenizer, ids, mask)
    return ids, mask


def _through_end_of_turn(ids: list[int], mask: list[bool], end_ids: Collection[int]) -> list[bool]:
    """`mask` (a template's `{% generation %}` mask) with each learned run that holds no end-of-turn token extended
    over the one right after it. A block around the reply's text alone (`<|im_end|>` written after
    `{% endgeneration %}`) taught every reply but never where it ends: inference stops only at that token, so the
    fine-tuned model did not learn to stop."""
    mask = list(mask)
    in_run = ended = False
    for t, token in enumerate(ids):
        if mask[t]:
            ended = (ended if in_run else False) or token in end_ids
            in_run = True
            continue
        if in_run and not ended and token in end_ids:
            mask[t] = True
        in_run = False
    return mask


def _check_tool_calls_are_learned(conversation: Conversation, tokenizer, ids: list[int], mask: list[bool]) -> None:
    """A template that does not render `tool_calls` (SmolLM2's) would teach an empty turn where the model should
    call a tool: refuse that conversation rather than train the model out of calling tools, silently."""
    names = {call.get("function", {}).get("name") for m in conversation.messages if m.get("role") == "assistant"
             for call in m.get("tool_calls") or [] if isinstance(call, dict)}  # fmt: skip
    names.discard(None)
    if not names:
        return
    learned = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    if missing := sorted(n for n in names if n not in learned):
        raise SFTDataError(
            f"the chat template does not render the assistant's tool calls ({', '.join(missing)}), so they "
            "cannot be learned (the turn would teach an empty reply); use a model whose template renders "
            "tool_calls, or data without them"
        )


def _check_reasoning_is_learned(conversation: Conversation, tokenizer, ids: list[int], mask: list[bool]) -> None:
    """Reasoning given apart (`reasoning_content`, vLLM's field; newer vLLM's `reasoning`) is rendered only by a
    template that reads it (Qwen3's); any other trained the replies without their reasoning, silently. Refuse a
    conversation none of whose reasoning is learned. (Qwen3's template renders it only after the last user message:
    earlier turns' reasoning is that template's rule, not a loss.)"""
    given = [m.get("reasoning_content") or m.get("reasoning") for m in conversation.messages
             if m.get("role") == "assistant"]  # fmt: skip
    thoughts = [thought.strip() for thought in given if isinstance(thought, str) and thought.strip()]
    if not thoughts:
        return
    learned = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    if not any(thought in learned for thought in thoughts):
        raise SFTDataError(
            "the chat template does not render the assistant's reasoning_content, so it cannot be learned (the "
            "replies would be taught without their reasoning); put the reasoning in the content (a <think> block "
            "before the reply) or use a model whose template renders reasoning_content"
        )


def _eos_of(tokenizer) -> frozenset[int]:
    from gyre.eos import end_of_turn_ids

    return end_of_turn_ids(None, tokenizer)


def assistant_mask(conversation: Conversation, tokenizer, end_ids: Collection[int]) -> tuple[list[int], list[bool]]:
    """The mask of a template without `{% generation %}` markers (most real ones: Llama 3, Qwen, SmolLM), by
    rendering growing prefixes of the conversation, as verl's multi-turn SFT does.

    Assistant message `i` starts where `messages[:i]` rendered with the generation prompt ends (what the
    model is given at inference; message 0: `_first_turn_prefix`) and runs up to and including its first
    end-of-turn token (`end_ids`, what inference stops at); text the template puts after that token (ChatML's
    newline) is not generated, so not learned. Without an end-of-turn token the turn ends where
    `messages[:i+1]` rendered alone ends (a template whose later rendering of a turn differs, as Qwen3's
    thinking blocks, only needs the start).
    Character offsets map this onto the tokens of the whole rendering, so the ids are exactly those of
    `apply_chat_template` (a token that spans the prompt's last characters and the reply's first is learned).
    A template that renders the earlier turns differently once more follow cannot be
    masked this way: `SFTDataError`, naming the message.
    """
    messages, tools = conversation.messages, conversation.tools

    def render(part: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(part, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages, False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=LENGTH_IS_CHECKED)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = render(messages[:i], True) if i else _first_turn_prefix(render(messages[:1], False), render)
        if not text.startswith(prefix):
            raise SFTDataError(
                f"the chat template renders the turns before message {i} differently once more turns follow, so "
                "the assistant's tokens cannot be found; mark them with {% generation %} ... {% endgeneration %}"
            )
        turn = render(messages[: i + 1], False)
        stop = len(turn) if text.startswith(turn) else len(text)
        for t, (begin, end) in enumerate(offsets):
            if end > len(prefix) and begin < stop:  # a token across the boundary carries reply text: learned
                mask[t] = True
                if ids[t] in end_ids:
                    break
    return ids, mask


def _first_turn_prefix(turn: str, render) -> str:
    """What precedes a conversation's opening assistant message in `turn` (that message rendered alone): the
    template's preamble (a default system prompt: SmolLM2, Qwen2.5, Llama 3.1) and its generation prompt.

    transformers renders no empty conversation, so the generation prompt is taken from a one-message probe:
    what `add_generation_prompt` adds to it. (An empty prefix made such a chat learn the default system
    prompt up to its end-of-turn token, and not the assistant's own reply.)"""
    probe = [{"role": "user", "content": "?"}]
    plain, prompted = render(probe, False), render(probe, True)
    header = prompted[len(plain) :] if prompted.startswith(plain) else ""
    start = turn.find(header) if header else -1
    if start < 0:
        raise SFTDataError(
            "the chat template's generation prompt is not where the opening assistant message (message 0) starts, "
            "so its tokens cannot be found; mark them with {% generation %} ... {% endgeneration %}"
        )
    return turn[: start + len(header)]


def pack(
    samples: Iterable[tuple[list[int], list[bool]]], seq_len: int, max_sample_len: int | None = None
) -> tuple[list[PackedRow], int, int]:
    """Greedy in-order packing into rows of at most `seq_len` tokens; returns (rows, truncated, dropped).

    A sample longer than `max_sample_len` (default `seq_len`) is cut to it; a sample with no loss token (left) is
    dropped.
    """
    cut = min(seq_len, max_sample_len or seq_len)
    rows: list[PackedRow] = []
    row: list[tuple[list[int], list[bool]]] = []
    used = truncated = dropped = 0
    for ids, mask in samples:
        if len(ids) > cut:
            truncated += 1
            ids, mask = ids[:cut], mask[:cut]
        if not any(mask):
            dropped += 1
            continue
        if used + len(ids) > seq_len:
            rows.append(_packed_row(row))
            row, used = [], 0
        row.append((ids, mask))
        used += len(ids)
    if row:
        rows.append(_packed_row(row))
    return rows, truncated, dropped


def _packed_row(samples: list[tuple[list[int], list[bool]]]) -> PackedRow:
    return PackedRow(
        input_ids=np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in samples]),
        loss_mask=np.concatenate([np.asarray(mask, dtype=np.bool_) for _, mask in samples]),
        sample_lengths=np.asarray([len(ids) for ids, _ in samples], dtype=np.int32),
    )


def prepare_rows(
    cfg: SFTConfig, tokenizer, context: int | None = None, stop: threading.Event | None = None
) -> list[PackedRow]:
    """Load, render, mask and pack the dataset; `SFTDataError` when it cannot fill one batch, `SFTInterrupted` when
    `stop` is set meanwhile (tokenizing a large dataset takes minutes: a Ctrl-C waited for all of it, then for the
    model to load, to stop before the first step).

    `context`: the model's (`max_position_embeddings`). A conversation is cut to it when `data.seq_len` is longer
    (position ids restart per conversation, so a row of `data.seq_len` may hold several shorter ones): a conversation
    of 2,700 tokens trained a 1,024-token model at positions it was never trained for and is never served at (a model
    with learned position embeddings, GPT-2's, has none past its context)."""
    data = cfg.data
    from gyre.eos import end_of_turn_ids

    conversations = load_conversations(data, cfg.seed)
    end_ids = end_of_turn_ids(cfg.model.name, tokenizer)
    limit = min(data.seq_len, context or data.seq_len)
    where = f"data.seq_len={data.seq_len}" if limit == data.seq_len else f"the model's context, {limit} tokens"
    samples = (_tokenize_or_explain(c, tokenizer, end_ids) for c in _until(stop, conversations))
    rows, truncated, dropped = pack(samples, data.seq_len, limit)
    if dropped == len(conversations):
        raise SFTDataError(f"no conversation has an assistant token to learn within {where}")
    if truncated or dropped:
        log.warning("%d of %d conversations were cut to %s; %d had nothing to learn and were dropped",
                    truncated, len(conversations), where, dropped)  # fmt: skip
    if len(rows) < data.batch_size:
        raise SFTDataError(
            f"{len(conversations)} conversations pack into {len(rows)} rows of {data.seq_len} tokens, fewer "
            f"than data.batch_size={data.batch_size}: add data or lower data.batch_size / data.seq_len"
        )
    log.info("%d conversations -> %d rows of <= %d tokens", len(conversations), len(rows), data.seq_len)
    return rows


def _until(stop: threading.Event | None, conversations: list[Conversation]) -> Iterable[Conversation]:
    for conversation in conversations:
        if stop is not None and stop.is_set():
            raise SFTInterrupted(0, None)
        yield conversation


def _stopped_before_training(cfg: SFTConfig) -> SFTInterrupted:
    """A stop before the first step: what the same command does next, from the checkpoint it resumes from, if any."""
    from gyre.runstate import sft_checkpoints

    resume = cfg.ckpt.resume_step
    at = resume if resume is not None and resume >= 0 else max(sft_checkpoints(cfg.output_dir), default=0)
    return SFTInterrupted(at, at or None)


def _tokenize_or_explain(conversation: Conversation, tokenizer, end_ids: Collection[int]):
    """`tokenize`, with a conversation the chat template cannot render (a message shape it does not know, a
    `raise_exception` in it) or mask an `SFTDataError` naming where it came from, not a Jinja traceback."""
    from jinja2 import TemplateError

    where = conversation.where or "a conversation"
    try:
        return tokenize(conversation, tokenizer, end_ids)
    except SFTDataError as e:
        raise SFTDataError(f"{where}: {e}") from None
    except (TemplateError, TypeError, ValueError) as e:
        raise SFTDataError(f"{where}: the model's chat template cannot render this conversation ({e})") from None


def rows_for_step(
    rows: list[PackedRow], step: int, batch_size: int, seed: int, world_size: int = 1
) -> tuple[int, list[PackedRow]]:
    """(epoch, rows) of optimizer step `step` (1-based): a pure function, so resumes continue exactly.

    The last step of an epoch also takes the rows that do not fill a batch (as many as split evenly over the
    ranks: FSDP needs the same number of micro-batches on each), so every row is trained once per epoch instead
    of a different `len(rows) % batch_size` of them being skipped each epoch; `unseen_per_epoch` counts the rest.
    """
    steps_per_epoch = len(rows) // batch_size
    epoch, index = divmod(step - 1, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(rows))
    end = (index + 1) * batch_size
    if index == steps_per_epoch - 1:
        end = len(rows) - unseen_per_epoch(len(rows), batch_size, world_size)
    return epoch, [rows[i] for i in order[index * batch_size : end]]


def unseen_per_epoch(num_rows: int, batch_size: int, world_size: int) -> int:
    """Rows an epoch leaves out: those beyond the last full batch that do not split evenly over the ranks."""
    return num_rows % batch_size % world_size


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
        save_dir, output_dir = _save_dir(cfg), Path(cfg.output_dir)
        checkpoints = CheckpointManager(
            output_dir / "checkpoints" / "sft", ctx, cfg.ckpt.keep_last, cfg.ckpt.keep_interval
        )
        have_checkpoints = bool(checkpoints.steps())
        rewind = cfg.ckpt.resume_step is not None and cfg.ckpt.resume_step >= 0  # asked for: trains again from there
        digest = rows_digest(rows)
        if not rewind and (done := finished_step(save_dir, total, have_checkpoints)) is not None:
            check_same_data(cfg, digest, _json_of(save_dir / RESULT_MARKER), f"the SFT in {save_dir}")
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
            check_same_data(cfg, digest, _json_of(checkpoints.path(plan.checkpoint_step) / PROGRESS),
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
        if wandb is not None:
            wandb.finish()
        dist.shutdown(ctx)


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
    output_dir, save_dir = Path(cfg.output_dir), _save_dir(cfg)
    if save_dir.resolve().is_relative_to(output_dir.resolve()):
        return
    made_in = _json_of(save_dir / RESULT_MARKER).get("output_dir")
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
    output_dir, save_dir = Path(cfg.output_dir), _save_dir(cfg)
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


def _json_of(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


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


def _save_dir(cfg: SFTConfig) -> Path:
    return Path(cfg.save_dir) if cfg.save_dir else Path(cfg.output_dir) / "sft"


def check_resume(cfg: SFTConfig, steps: list[int], total: int, ckpt_dir: Path) -> None:
    """SFTDataError naming the key, before the model loads, when training cannot resume as asked
    (`gyre.runstate.sft_resume_problem`)."""
    from gyre.runstate import sft_resume_problem

    if (problem := sft_resume_problem(cfg.ckpt.resume_step, steps, total, ckpt_dir)) is not None:
        raise SFTDataError(f"config key '{problem[0]}': {problem[1]}")


def stop_requested(ctx) -> bool:
    """Whether any rank got SIGTERM/SIGINT, agreed by every rank (torchrun forwards a signal to each worker, not at the
    same instant: ranks that stopped at different steps would hang in the next step's collectives)."""
    from gyre_trainer import dist

    if not ctx.distributed:
        return STOP.is_set()
    return any(flags[0] for flags in dist.gather_floats([float(STOP.is_set())], ctx))


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
    from gyre_trainer.torchrun import follow_launcher, report_exit

    follow_launcher()  # under `python -m gyre_trainer.torchrun`: dies with it, even SIGKILLed (own session)
    code = _main(argv)

    report_exit(code)  # under `python -m gyre_trainer.torchrun`: a clean stop on SIGTERM exits 0, not torchrun's 1
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_or_exit(SFTConfig, argv, "gyre sft")
    # a gyre rl run's folder without an SFT result to find finished (run() checks that case, once the data is read):
    # refused now, not after fetching the model and tokenizing the data, nor holding the sft lock its warm-up needs
    if not (_save_dir(cfg) / RESULT_MARKER).is_file():
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
        print(f"gyre sft: error: {_save_lock_error(cfg, e)}", file=sys.stderr)
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
    signals = StopSignals(STOP, log).install()
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


def save_dir_lock(cfg: SFTConfig):
    """The lock on `save_dir`, `{its parent}/locks/save-{its name}.lock` (`gyre.runlock`): two SFTs of other output
    folders given one `--save-dir` at once both trained and wrote the result, the last one's kept, and neither
    `output_dir`'s lock nor `check_save_dir_is_ours` (which reads a finished result) saw the other."""
    from gyre.runlock import RunLock

    save_dir = _save_dir(cfg).resolve()
    return RunLock(save_dir.parent, f"save-{save_dir.name}")


def _save_lock_error(cfg: SFTConfig, e: Exception) -> str:
    """The error of a `save_dir_lock` held by another SFT (naming its pid), or that cannot be taken."""
    from gyre.runlock import LockHeld

    if isinstance(e, LockHeld):
        who = e.holder
        return (f"config key 'save_dir': {_save_dir(cfg)} is being written by another gyre sft: pid "
                f"{who.get('pid', '?')} on {who.get('host', '?')} ({who.get('command', 'unknown command')}); wait "
                "for it to finish or choose another --save-dir")  # fmt: skip
    return f"config key 'save_dir': cannot use {_save_dir(cfg)}: {e}"


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
