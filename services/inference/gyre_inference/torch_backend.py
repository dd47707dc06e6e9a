"""Torch backend: a transformers causal LM driven by our own continuous-batching decode loop.

One engine thread owns the model and the batch; the asyncio side only enqueues sequences and reads
their tokens from per-sequence queues (torch releases the GIL inside kernels, so HTTP stays responsive).

Batching scheme (simple, correct, and fast enough to beat one-at-a-time by an order of magnitude):
- The running batch shares one KV cache, RIGHT-aligned: every row's newest token is in the last
  column, shorter rows are left-padded, and a [B, L] attention mask marks real columns. Position ids
  are tracked per row, so padding never shifts a row's positions.
- Between decode steps, waiting sequences are prefilled together (left-padded) and their cache is
  merged into the batch by left-padding whichever side is shorter. Finished or cancelled rows are
  dropped by index; columns that became padding for every row are trimmed. Each layer's keys/values
  live in a buffer with spare columns, so a decode step appends in place instead of re-concatenating.
- A weight swap is applied between two steps. Rows in flight keep their KV cache (computed by the
  old weights) and continue on the new weights; every token reports the version that computed it.

Randomness: each sequence owns a `random.Random` seeded from its request (or from the engine's seeded
generator) and draws one uniform per token, so its tokens do not depend on what else is batched. (A
per-sequence `torch.Generator` gives the same guarantee but costs ~10 us per row per step to draw from.)

Only full-attention decoder models are supported (Llama, Qwen2 without sliding window, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from gyre_inference.backend import (
    Backend,
    BackendStoppedError,
    SamplingParams,
    TokenEvent,
    WeightsIncompatibleError,
)
from gyre_inference.cpus import default_engine_threads
from gyre_inference.sampling import sample_next

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    rng: random.Random  # this sequence's own random stream: one uniform per sampled token
    generated: int = 0
    finished: bool = False  # its last token has been emitted
    cancelled: bool = False  # set by the asyncio side; the engine drops the row before its next step


@dataclass
class _Swap:
    tensors: dict[str, torch.Tensor]
    version: int
    done: Future = field(default_factory=Future)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device is cuda but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


class TorchBackend(Backend):
    name = "torch"

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
        threads: int | None = None,
    ):
        self.model_path = Path(model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self._requested_max_len = max_model_len
        self._threads = threads
        self._rng = random.Random(seed)  # seeds of requests that bring none
        self._model = None
        self._max_model_len = 0
        self._version = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._swap: _Swap | None = None
        self._stopping = False
        self._admitting = 0  # sequences taken off the queue whose prefill is under way
        self._outbox: list[tuple[_Sequence, object]] = []  # events waiting for the event loop
        self._outbox_lock = threading.Lock()
        self._outbox_scheduled = False
        # Batch state, touched only by the engine thread.
        self._rows: list[_Sequence] = []
        self._cache = None  # transformers Cache of _GrowingLayer, right-aligned
        self._mask = torch.zeros(0, 0, dtype=torch.long)  # [B, L] 1 = real column
        self._next_input = torch.zeros(0, dtype=torch.long)  # [B] last sampled token, fed at the next step
        self._positions = torch.zeros(0, dtype=torch.long)  # [B] position id of that token

    # ---- Backend interface ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def threads(self) -> int:
        """torch threads of the engine on CPU: `engine.threads`, else what the container's CPU quota allows
        minus one core for the HTTP loop (see cpus.py)."""
        return self._threads or default_engine_threads()

    def load_stats(self) -> tuple[int, int]:
        # read without the lock: a scrape may be off by the sequences moving between the two lists
        return len(self._rows) + self._admitting, len(self._waiting)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load_model)
        self._thread = threading.Thread(target=self._run, name="gyre-torch-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if not self.ready:
            raise BackendStoppedError("the torch engine is not running")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = _Sequence(list(prompt), params, asyncio.Queue(), random.Random(seed))
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify()
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            seq.cancelled = True

    async def update_weights(self, path: Path, version: int) -> None:
        tensors = await asyncio.to_thread(self._read_weights, Path(path))
        await self._swap_in(tensors, version)

    async def reload_base(self) -> None:
        await self.update_weights(self.model_path, 0)

    # ---- loading --------------------------------------------------------------------------------
    def _load_model(self) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model.to(self.device).eval().requires_grad_(False)
        limit = getattr(model.config, "max_position_embeddings", None) or self._requested_max_len
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: set engine.max_model_len")
        if self._requested_max_len is not None and self._requested_max_len > limit:
            raise ValueError(f"engine.max_model_len {self._requested_max_len} exceeds the model's context {limit}")
        self._max_model_len = self._requested_max_len or limit
        self._pad_id = model.config.pad_token_id or 0
        self._model = model
        log.info("loaded %s (%s, %s), context %d", self.model_path, self.device, self.dtype, self._max_model_len)

    def _read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """Read and check every tensor of `path` against the served model (before touching it)."""
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsIncompatibleError(f"{path} holds no *.safetensors files")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                tensors.update(load_file(file))
            except Exception as error:  # safetensors raises its own error type for a malformed file
                raise WeightsIncompatibleError(f"{file}: not a readable safetensors file ({error})") from None
        state = self._model.state_dict(keep_vars=True)
        unknown = sorted(tensors.keys() - state.keys())
        if unknown:
            raise WeightsIncompatibleError(f"{path}: tensors the model does not have: {unknown[:5]}")
        # Tied weights (e.g. lm_head = embed_tokens) appear under several names; one of them is enough.
        groups: dict[int, list[str]] = {}
        for name, tensor in state.items():
            groups.setdefault(id(tensor), []).append(name)
        missing = [names[0] for names in groups.values() if not any(n in tensors for n in names)]
        if missing:
            raise WeightsIncompatibleError(f"{path}: missing tensors {missing[:5]}")
        for name, tensor in tensors.items():
            if tensor.shape != state[name].shape:
                raise WeightsIncompatibleError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, the model {tuple(state[name].shape)}"
                )
        return {name: tensor.to(self.device, self.dtype) for name, tensor in tensors.items()}

    async def _swap_in(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        swap = _Swap(tensors, version)
        with self._cond:
            if self._stopping or not self.ready:
                raise BackendStoppedError("the torch engine is not running")
            if self._swap is not None:  # the caller serialises updates; never drop one silently
                raise RuntimeError("a weight swap is already pending")
            self._swap = swap
            self._cond.notify()
        await asyncio.wrap_future(swap.done)

    def _apply_swap(self, swap: _Swap) -> None:
        state = self._model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in swap.tensors.items():
                state[name].copy_(tensor)
        self._version = swap.version
        swap.done.set_result(None)

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        if self.device.type == "cpu":
            # per thread: OpenMP's team size is a property of the calling thread, so set it here
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self._rows or self._swap):
                        self._cond.wait()
                    if self._stopping:
                        break
                    swap, self._swap = self._swap, None
                    admitted = []
                    while self._waiting and len(self._rows) + len(admitted) < self.max_batch_size:
                        seq = self._waiting.popleft()
                        if not seq.cancelled:
                            admitted.append(seq)
                    self._admitting = len(admitted)
                try:
                    if swap is not None:
                        self._apply_swap(swap)
                    self._keep([not seq.cancelled for seq in self._rows])
                    # Prefill newcomers, then one decode step for everyone: arrivals never starve the batch.
                    if admitted:
                        self._prefill(admitted)
                        self._admitting = 0
                    if self._rows:
                        self._decode()
                except Exception as error:  # a failed step fails its sequences, never the engine
                    log.exception("engine step failed")
                    if swap is not None and not swap.done.done():
                        swap.done.set_exception(error)
                    failed = {id(seq): seq for seq in self._rows + admitted}.values()
                    self._deliver([(seq, error) for seq in failed])
                    self._reset_batch()
                    self._admitting = 0
        with self._cond:
            stranded = self._rows + list(self._waiting)
            self._waiting.clear()
            if self._swap is not None:
                self._swap.done.set_exception(BackendStoppedError("engine stopped"))
        self._deliver([(seq, BackendStoppedError("the inference engine stopped")) for seq in stranded])
        self._reset_batch()

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Run the prompts of `seqs` (left-padded), sample their first tokens, merge them into the batch."""
        length = max(len(seq.prompt) for seq in seqs)
        ids = torch.full((len(seqs), length), self._pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        positions = torch.zeros(len(seqs), length, dtype=torch.long)
        for row, seq in enumerate(seqs):
            n = len(seq.prompt)
            ids[row, length - n :] = torch.tensor(seq.prompt)
            mask[row, length - n :] = 1
            positions[row, length - n :] = torch.arange(n)
        cache = Cache(layer_class_to_replicate=_GrowingLayer)
        logits = self._forward(ids, mask, positions, cache)
        tokens = self._sample_and_emit(seqs, logits)
        self._merge(seqs, cache, mask, tokens, torch.tensor([len(seq.prompt) for seq in seqs]))
        self._keep([not self._finished(seq) for seq in self._rows])

    def _decode(self) -> None:
        self._mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=torch.long)], dim=1)
        logits = self._forward(self._next_input[:, None], self._mask, self._positions[:, None], self._cache)
        self._next_input = self._sample_and_emit(self._rows, logits)
        self._positions = self._positions + 1
        self._keep([not self._finished(seq) for seq in self._rows])

    def _forward(self, ids, mask, positions, cache) -> torch.Tensor:
        # Without padding the causal mask is all there is: skip building a [B, 1, q, L] mask per layer call.
        out = self._model(
            input_ids=ids.to(self.device),
            attention_mask=None if bool(mask.all()) else mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _sample_and_emit(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        temperature = torch.tensor([seq.params.temperature for seq in seqs])
        top_p = torch.tensor([seq.params.top_p for seq in seqs])
        uniform = torch.tensor([seq.rng.random() for seq in seqs], dtype=torch.float64)
        tokens, logprobs = sample_next(logits, temperature, top_p, uniform)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        k = max(seq.params.top_logprobs for seq in seqs)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        top_values = top_values.tolist() if k else None
        top_ids = top_ids.tolist() if k else None
        token_list = tokens.tolist()
        events = []
        for row, seq in enumerate(seqs):
            token = token_list[row]
            seq.generated += 1
            if token in seq.params.stop_token_ids:
                reason = "stop"
            elif seq.generated >= seq.params.max_tokens or len(seq.prompt) + seq.generated >= self._max_model_len:
                reason = "length"
            else:
                reason = None
            n_top = seq.params.top_logprobs
            top = tuple(zip(top_ids[row][:n_top], top_values[row][:n_top], strict=True)) if n_top else ()
            events.append((seq, TokenEvent(token, chosen[row], self._version, top, reason)))
            seq.finished = reason is not None
        self._deliver(events)
        return tokens.cpu()

    @staticmethod
    def _finished(seq: _Sequence) -> bool:
        return seq.cancelled or seq.finished

    def _merge(self, seqs, cache, mask, next_input, positions) -> None:
        if not self._rows:
            self._rows, self._cache, self._mask = list(seqs), cache, mask
            self._next_input, self._positions = next_input, positions
            return
        old, new = self._mask.shape[1], mask.shape[1]
        width = max(old, new)
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width - old), _pad_left(theirs.keys, width - new)])
            mine.values = torch.cat([_pad_left(mine.values, width - old), _pad_left(theirs.values, width - new)])
        self._mask = torch.cat([F.pad(self._mask, (width - old, 0)), F.pad(mask, (width - new, 0))])
        self._rows += seqs
        self._next_input = torch.cat([self._next_input, next_input])
        self._positions = torch.cat([self._positions, positions])

    def _keep(self, keep: list[bool]) -> None:
        """Drop the rows whose flag is False, then trim columns that are padding in every remaining row."""
        if all(keep):
            return
        if not any(keep):
            self._reset_batch()
            return
        index = torch.tensor([i for i, k in enumerate(keep) if k])
        self._rows = [seq for seq, k in zip(self._rows, keep, strict=True) if k]
        self._mask, self._next_input, self._positions = (
            self._mask[index],
            self._next_input[index],
            self._positions[index],
        )
        self._cache.batch_select_indices(index.to(self.device))
        start = int(self._mask.any(dim=0).long().argmax())
        if start:
            self._mask = self._mask[:, start:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]

    def _reset_batch(self) -> None:
        self._rows, self._cache = [], None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._next_input = self._positions = torch.zeros(0, dtype=torch.long)

    def _deliver(self, items: list[tuple[_Sequence, object]]) -> None:
        """Hand events to their sequences' asyncio queues.

        Coalesced: while a delivery callback is scheduled but has not run yet (the event loop is busy),
        further steps append to it instead of waking the loop again, so a busy loop costs the engine
        no extra wake-ups and an idle loop still gets every token as soon as it is sampled.
        """
        if not items or self._loop is None:
            return
        with self._outbox_lock:
            self._outbox.extend(items)
            if self._outbox_scheduled:
                return
            self._outbox_scheduled = True
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._drain_outbox)

    def _drain_outbox(self) -> None:
        with self._outbox_lock:
            items, self._outbox, self._outbox_scheduled = self._outbox, [], False
        for seq, item in items:
            seq.queue.put_nowait(item)


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of buffers with spare columns.

    Appending a decode step is a copy into the spare columns instead of a `torch.cat` that reallocates
    the whole cache at every step. When `keys`/`values` are replaced from outside (merging, dropping
    rows, trimming), the next update re-buffers them (one copy) with fresh spare room.
    """

    SPARE = 64

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        new = old + key_states.shape[-2]
        buffer = getattr(self, "_key_buffer", None)
        owned = (
            buffer is not None
            and old > 0
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.shape[:2] == buffer.shape[:2]
        )
        if not owned or new > buffer.shape[-2]:
            shape = (*key_states.shape[:2], new + self.SPARE, key_states.shape[-1])
            keys, values = key_states.new_empty(shape), value_states.new_empty(shape)
            if old:
                keys[:, :, :old], values[:, :, :old] = self.keys, self.values
            self._key_buffer, self._value_buffer = keys, values
        self._key_buffer[:, :, old:new] = key_states
        self._value_buffer[:, :, old:new] = value_states
        self.keys, self.values = self._key_buffer[:, :, :new], self._value_buffer[:, :, :new]
        return self.keys, self.values


def _pad_left(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """Left-pad a [B, H, L, D] cache tensor with `columns` zero columns (zeros keep attention finite)."""
    return F.pad(tensor, (0, 0, columns, 0)) if columns else tensor
