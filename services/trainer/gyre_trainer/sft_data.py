"""`gyre sft`'s data: conversations from their source, rendered with the chat template, masked and packed into rows.

Sources (`load_conversations`): `data.path` (JSONL, `read_jsonl`), `data.env` (an environment's reference answers,
`environment_conversations`) or `data.fake` (`fake_conversations`). `tokenize` renders a conversation as inference
does and masks what the model generates (`assistant_mask`, or the template's `{% generation %}` blocks); `pack` puts
conversations back to back into rows of `data.seq_len`; `prepare_rows` does all of it for a config, and
`rows_for_step` is the pure function from a step to its rows (the exact data order a resume continues).

Apart from the training loop (`gyre_trainer.sft`) because it is the part that needs no model, no torch and no
output folder: it is tested on its own, and the re-run checks (`gyre_trainer.sft_checks`) digest its rows. It imports
neither of them.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gyre.chat import content_problem, template_messages
from gyre.config.trainer import SFTConfig, SFTDataConfig

log = logging.getLogger("gyre_trainer.sft")  # gyre sft's log lines keep one logger name, whichever module writes them


class SFTDataError(ValueError):
    """The dataset is unusable; the message names the file and line (or the setting) at fault."""


class SFTInterrupted(Exception):  # noqa: N818 - a stop the user asked for, not an error
    """SIGTERM/SIGINT: the loop stopped between steps (`step` done, `checkpoint` the newest saved, None if none;
    `saved`: the stop checkpointed `step` itself). Here, not in `gyre_trainer.sft`, because `prepare_rows` raises it
    too: a stop while the data is tokenized."""

    def __init__(self, step: int, checkpoint: int | None, saved: bool = False):
        super().__init__(step, checkpoint, saved)
        self.step, self.checkpoint, self.saved = step, checkpoint, saved


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
