"""Torch backend: a transformers causal LM driven by our own continuous-batching decode loop.

One engine thread owns the model and the batch; the asyncio side only enqueues sequences and reads
their tokens from per-sequence queues (torch releases the GIL inside kernels, so HTTP stays responsive).

Batching scheme (continuous batching over a static cache, see static_decode.py):
- Every running sequence owns a slot: a row of a preallocated key/value buffer, where its token at
  position p lives in column p. Sequences of any lengths share the batch without padding; a new one
  takes the lowest free slot, a finished or cancelled one frees its slot (nothing is copied).
- Between decode steps, waiting sequences are prefilled together (a left-padded transformers
  forward) and their cache is copied into their slots. Then one decode step runs for every slot: a
  fixed-shape forward over the first `rows` slots and `width` columns (powers of two), which on CUDA
  is captured once per shape as a CUDA graph and replayed (one launch instead of hundreds of kernels
  and no Python per layer); on CPU the same step runs eagerly.
- A weight swap is applied between two steps. Rows in flight keep their KV cache (computed by the
  old weights) and continue on the new weights; every token reports the version that computed it.

Randomness: each sequence owns a `random.Random` seeded from its request (or from the engine's seeded
generator) and draws one uniform per token, so its tokens do not depend on what else is batched. (A
per-sequence `torch.Generator` gives the same guarantee but costs ~10 us per row per step to draw from.)

Only full-attention decoder models are supported: Llama, Mistral, Qwen2 (no sliding window), Qwen3.
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
from transformers.cache_utils import DynamicCache

from gyre_inference.backend import (
    AdapterGoneError,
    Backend,
    BackendStoppedError,
    SamplingParams,
    TokenEvent,
    WeightsIncompatibleError,
)
from gyre_inference.cpus import default_engine_threads
from gyre_inference.prompt_logprobs import prompt_logprobs
from gyre_inference.sampling import sample_next
from gyre_inference.static_decode import StaticDecoder, context_that_fits
from gyre_inference.structured import TokenMasks

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    rng: random.Random  # this sequence's own random stream: one uniform per sampled token
    adapter: int = 0  # its named adapter's slot (gyre_inference.adapters; 0 = the served model itself)
    generated: int = 0
    finished: bool = False  # its last token has been emitted
    cancelled: bool = False  # set by the asyncio side; the engine drops the row before its next step


@dataclass
class _Swap:
    tensors: dict[str, torch.Tensor]
    version: int
    done: Future = field(default_factory=Future)
    adapter: str | None = None  # a named adapter's (A, B) tensors instead of model weights
    source: Path | None = None  # the adapter's folder (an evicted adapter is loaded back from it)
    slot: int | None = None  # the adapter's slot, given by the engine thread (`AdapterBank.declare`)


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
    uses_constraints = True  # structured outputs: per-sequence matchers (SamplingParams.constraint)

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
        cuda_graphs: bool | None = None,
        max_adapters: int = 0,
        max_lora_rank: int = 16,
        adapters: tuple[str, ...] = (),
    ):
        self.model_path = Path(model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self._requested_max_len = max_model_len
        self._threads = threads
        # CUDA graphs for the decode step: on by default on CUDA (no effect on CPU).
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._rng = random.Random(seed)  # seeds of requests that bring none
        # named adapters (multi-run): created with the model when max_adapters > 0
        self._adapter_settings = (max_adapters, max_lora_rank, tuple(adapters))
        self._bank = None
        self._slot_adapter = torch.zeros(max_batch_size, dtype=torch.long)  # per slot: its adapter slot
        self._model = None
        self._max_model_len = 0
        self._base: dict[str, torch.Tensor] | None = None  # base weights on CPU, read at the first adapter
        self._others_are_base = True  # every weight an adapter does not touch is the base model's
        self._version = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._swap: _Swap | None = None
        self._swap_lock = asyncio.Lock()  # one read-and-swap at a time: updates and reloads of evicted adapters
        self._stopping = False
        self._admitting = 0  # sequences taken off the queue whose prefill is under way
        self._outbox: list[tuple[_Sequence, object]] = []  # events waiting for the event loop
        self._outbox_lock = threading.Lock()
        self._outbox_scheduled = False
        # Batch state, touched only by the engine thread.
        self._slots: list[_Sequence | None] = [None] * max_batch_size
        self._decoder: StaticDecoder | None = None
        self._next_input = torch.zeros(max_batch_size, dtype=torch.long)  # per slot: token fed at the next step
        self._positions = torch.zeros(max_batch_size, dtype=torch.long)  # per slot: that token's position

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

    @property
    def _rows(self) -> list[_Sequence]:
        """The running sequences, in slot order."""
        return [seq for seq in self._slots if seq is not None]

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

    @property
    def adapter_names(self) -> tuple[str, ...]:
        # every name served, also the evicted ones (`AdapterBank`): their next request loads them back
        return tuple(self._bank.versions) if self._bank is not None else ()

    def adapter_version(self, name: str) -> int:
        if self._bank is None:
            raise KeyError(name)
        return self._bank.versions[name]

    async def update_adapter(self, name: str, path: Path, version: int) -> None:
        if self._bank is None:
            raise WeightsIncompatibleError("this replica serves no named adapters: set lora.max_loras")
        async with self._swap_lock:
            tensors = await asyncio.to_thread(self._bank.read, Path(path))
            await self._swap_in(tensors, version, adapter=name, source=Path(path))

    async def _reload(self, name: str) -> None:
        """Load evicted adapter `name` back from the folder of the version it serves (LRU eviction, see
        `gyre_inference.adapters`); KeyError for a name never served, or whose folder is gone (forgotten)."""
        if self._bank is None or name not in self._bank.versions:
            raise KeyError(f"no adapter named {name!r}")
        async with self._swap_lock:  # an update of `name` cannot interleave: the version stays consistent
            if name in self._bank.slots:
                return
            source, version = self._bank.sources[name], self._bank.versions[name]
            try:
                tensors = {} if source is None else await asyncio.to_thread(self._bank.read, source)
            except WeightsIncompatibleError as error:
                del self._bank.versions[name], self._bank.sources[name]
                raise AdapterGoneError(f"adapter {name!r} was evicted and cannot be loaded back: {error}") from None
            log.info("loading evicted adapter %r back (version %d from %s)", name, version, source)
            await self._swap_in(tensors, version, adapter=name, source=source)

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if not self.ready:
            raise BackendStoppedError("the torch engine is not running")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = _Sequence(list(prompt), params, asyncio.Queue(), random.Random(seed))
        name = params.adapter
        for _ in range(3):  # an adapter evicted again before its request is queued is loaded again
            with self._cond:  # the slot is read and the row queued at once: its slot is busy from now on
                if name is None or (self._bank is not None and name in self._bank.slots):
                    if name is not None:
                        seq.adapter = self._bank.slots[name]
                        self._bank.touch(name)
                    self._waiting.append(seq)
                    self._cond.notify()
                    break
            await self._reload(name)
        else:
            raise WeightsIncompatibleError(f"adapter {name!r}: evicted again at once; raise lora.max_loras")
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
        from gyre.lora import ADAPTER_CONFIG

        path = Path(path)
        adapter = (path / ADAPTER_CONFIG).is_file()
        read = self._read_adapter if adapter else self._read_weights
        async with self._swap_lock:
            tensors = await asyncio.to_thread(read, path)
            await self._swap_in(tensors, version)
        # after a full set, weights no adapter touches may differ from the base: the next adapter restores them
        self._others_are_base = adapter or version == 0

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
        if self.device.type == "cuda":
            # The slot cache holds max_batch_size full contexts: shorten the context to what fits, so a
            # request that cannot fit is refused up front (context_length_exceeded), not by an OOM.
            free, _ = torch.cuda.mem_get_info(self.device)
            fits = context_that_fits(model.config, self.max_batch_size, self.dtype, free)
            if fits < self._max_model_len:
                log.warning("context %d x %d slots does not fit in GPU memory: serving context %d "
                            "(lower engine.max_batch_size for longer contexts)",
                            self._max_model_len, self.max_batch_size, fits)  # fmt: skip
                self._max_model_len = fits
        self._pad_id = model.config.pad_token_id or 0
        self._decoder = StaticDecoder(model, self.max_batch_size, self._max_model_len, cuda_graphs=self.cuda_graphs)
        self._masks = TokenMasks(model.config.vocab_size, self.max_batch_size, self.device)
        max_adapters, max_rank, names = self._adapter_settings
        if max_adapters:
            from gyre_inference.adapters import AdapterBank

            self._bank = AdapterBank(model, max_adapters=max_adapters, max_rank=max_rank,
                                     always=self._decoder.cuda_graphs)  # fmt: skip
            for name in names:
                self._bank.declare(name)
        # the tensors a swap copies into, by name, and names that share one tensor (tied embeddings): fixed once
        # loaded (adapters hook modules, they add no weights), so not recomputed for every swap
        self._weights = model.state_dict(keep_vars=True)
        self._tied: dict[int, list[str]] = {}
        for name, tensor in self._weights.items():
            self._tied.setdefault(id(tensor), []).append(name)
        self._model = model
        log.info("loaded %s (%s, %s), context %d", self.model_path, self.device, self.dtype, self._max_model_len)

    def _read_adapter(self, path: Path) -> dict[str, torch.Tensor]:
        """A LoRA adapter folder (PEFT files) as the tensors to swap in: `W_base + alpha/r · B @ A` for the
        adapted weights, from the base weights kept in host memory (read from disk once), merged on the
        serving device: a float32 merge of a 0.6B model's adapted weights costs seconds on a CPU, and on an
        H100 an adapter swap of that shape took 3x a full 1.19 GB one when the merge ran on the host."""
        from gyre.lora import merge

        from gyre_inference.adapters import read_adapter_folder

        scale, adapters = read_adapter_folder(path)
        base = self._base_weights()
        for module, ab in adapters.items():
            weight = base.get(f"{module}.weight")
            if weight is None or ab["B"].shape[0] != weight.shape[0] or ab["A"].shape[1] != weight.shape[1]:
                raise WeightsIncompatibleError(f"{path}: the adapter for {module} does not fit the model")
        on_device = {m: {k: t.to(self.device, non_blocking=True) for k, t in ab.items()} for m, ab in adapters.items()}
        targets = {f"{m}.weight": base[f"{m}.weight"].to(self.device, non_blocking=True) for m in adapters}
        merged = merge(targets, on_device, scale)  # every module was checked above
        tensors = merged if self._others_are_base else {**base, **merged}
        return {name: tensor.to(self.device, self.dtype) for name, tensor in tensors.items()}

    def _base_weights(self) -> dict[str, torch.Tensor]:
        if self._base is None:
            base = {k: v.to("cpu", copy=True) for k, v in self._read_weights(Path(self.model_path)).items()}
            # pinned on a GPU host: each adapter swap copies the adapted base weights to the device
            self._base = {k: v.pin_memory() for k, v in base.items()} if self.device.type == "cuda" else base
        return self._base

    def _read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """Read and check every tensor of `path` against the served model (before touching it)."""
        from gyre.safetensors_io import SafetensorsError, map_safetensors

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsIncompatibleError(f"{path} holds no *.safetensors files")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:  # mapped, not copied: the swap's one copy is into the model (or to the GPU)
                tensors.update(map_safetensors(file))
            except SafetensorsError as error:
                raise WeightsIncompatibleError(f"not a readable safetensors file: {error}") from None
        state = self._weights
        unknown = sorted(tensors.keys() - state.keys())
        if unknown:
            raise WeightsIncompatibleError(f"{path}: tensors the model does not have: {unknown[:5]}")
        # Tied weights (e.g. lm_head = embed_tokens) appear under several names; one of them is enough.
        missing = [names[0] for names in self._tied.values() if not any(n in tensors for n in names)]
        if missing:
            raise WeightsIncompatibleError(f"{path}: missing tensors {missing[:5]}")
        for name, tensor in tensors.items():
            if tensor.shape != state[name].shape:
                raise WeightsIncompatibleError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, the model {tuple(state[name].shape)}"
                )
        return {name: tensor.to(self.device, self.dtype) for name, tensor in tensors.items()}

    async def _swap_in(self, tensors: dict, version: int, adapter: str | None = None, source: Path | None = None):
        swap = _Swap(tensors, version, adapter=adapter, source=source)
        with self._cond:
            if self._stopping or not self.ready:
                raise BackendStoppedError("the torch engine is not running")
            if self._swap is not None:  # the caller serialises updates; never drop one silently
                raise RuntimeError("a weight swap is already pending")
            self._swap = swap
            self._cond.notify()
        await asyncio.wrap_future(swap.done)

    def _apply_swap(self, swap: _Swap) -> None:
        if swap.adapter is not None:
            self._bank.load(swap.adapter, swap.tensors, swap.version, swap.source, swap.slot)
            swap.done.set_result(None)
            return
        state = self._weights
        with torch.no_grad():  # one fused copy: a loop pays a dispatch per tensor, ~1/3 of a small model's swap
            torch._foreach_copy_([state[name] for name in swap.tensors], list(swap.tensors.values()))
        self._version = swap.version
        swap.done.set_result(None)

    # ---- engine thread --------------------------------------------------------------------------
    def _give_slot(self, swap: _Swap, admitted: list[_Sequence]) -> _Swap | None:
        """Under `_cond`: the adapter's slot, evicting an idle one if need be (None: refused, told to the caller).
        Every slot a queued, admitted or running row uses is busy: those rows keep their adapter."""
        busy = {seq.adapter for seq in (*self._rows, *admitted, *self._waiting)}
        try:
            swap.slot = self._bank.declare(swap.adapter, busy)
        except WeightsIncompatibleError as error:
            swap.done.set_exception(error)
            return None
        return swap

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
                    if swap is not None and not swap.done.set_running_or_notify_cancel():
                        swap = None  # its caller gave up (a cancelled UpdateWeights): not applied, nobody to tell
                    admitted = []
                    while self._waiting and len(self._rows) + len(admitted) < self.max_batch_size:
                        seq = self._waiting.popleft()
                        if not seq.cancelled:
                            admitted.append(seq)
                    self._admitting = len(admitted)
                    if swap is not None and swap.adapter is not None:
                        swap = self._give_slot(swap, admitted)
                try:
                    if swap is not None:
                        self._apply_swap(swap)
                    self._free(lambda seq: seq.cancelled)
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
            if self._swap is not None and self._swap.done.set_running_or_notify_cancel():
                self._swap.done.set_exception(BackendStoppedError("engine stopped"))
        self._deliver([(seq, BackendStoppedError("the inference engine stopped")) for seq in stranded])
        self._reset_batch()

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Run the prompts of `seqs` (left-padded), sample their first tokens, copy their cache into slots."""
        length = max(len(seq.prompt) for seq in seqs)
        ids = torch.full((len(seqs), length), self._pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        positions = torch.zeros(len(seqs), length, dtype=torch.long)
        for row, seq in enumerate(seqs):
            n = len(seq.prompt)
            ids[row, length - n :] = torch.tensor(seq.prompt)
            mask[row, length - n :] = 1
            positions[row, length - n :] = torch.arange(n)
        if self._bank is not None:
            self._bank.use(torch.tensor([seq.adapter for seq in seqs]))
        cache = DynamicCache()
        # The decoder, then the output head on the last position (what logits_to_keep=1 computes), so the prompt
        # log-probs some rows ask for come from the same hidden states: no second pass over their prompts.
        hidden = self._model.get_decoder()(
            input_ids=ids.to(self.device),
            # Without padding the causal mask is all there is: skip building a [B, 1, q, L] mask per layer.
            attention_mask=None if bool(mask.all()) else mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=cache,
            use_cache=True,
        ).last_hidden_state
        head = self._model.get_output_embeddings()
        prompt_lps = {
            row: prompt_logprobs(hidden[row, length - len(seq.prompt) : length - 1], head, seq.prompt,
                                 seq.params.prompt_logprobs)
            for row, seq in enumerate(seqs) if seq.params.prompt_logprobs is not None
        }  # fmt: skip
        tokens = self._sample_and_emit(seqs, head(hidden[:, -1, :]), prompt_lps)
        free = (slot for slot, seq in enumerate(self._slots) if seq is None)
        for row, (seq, slot) in enumerate(zip(seqs, free, strict=False)):
            self._decoder.load_prefill(slot, cache, row, len(seq.prompt))
            self._slots[slot] = seq
            self._slot_adapter[slot] = seq.adapter
            self._next_input[slot] = tokens[row]
            self._positions[slot] = len(seq.prompt)
        self._free(self._finished)

    def _decode(self) -> None:
        busy = [slot for slot, seq in enumerate(self._slots) if seq is not None]
        if self._bank is not None:
            self._bank.use_decode(self._slot_adapter)
        logits = self._decoder.step(self._next_input, self._positions, busy[-1] + 1)
        index = torch.tensor(busy)
        tokens = self._sample_and_emit([self._slots[slot] for slot in busy], logits[index.to(logits.device)])
        self._next_input[index] = tokens
        self._positions[index] += 1
        self._free(self._finished)

    def _sample_and_emit(self, seqs: list[_Sequence], logits: torch.Tensor, prompt_lps=None) -> torch.Tensor:
        """Sample one token per row and hand out its event; `prompt_lps` (row -> entries) go on first events."""
        logits = self._adjust(seqs, logits)
        # structured outputs: the constrained rows' logits masked on the device, in this same step
        constrained = [
            (row, seq.params.constraint) for row, seq in enumerate(seqs) if seq.params.constraint is not None
        ]
        logits = self._masks.apply(logits, constrained)
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
        for row, constraint in constrained:
            constraint.accept_token(token_list[row])
        events = []
        for row, seq in enumerate(seqs):
            token = token_list[row]
            seq.generated += 1
            constraint = seq.params.constraint
            if token in seq.params.stop_token_ids or (constraint is not None and constraint.is_terminated()):
                reason = "stop"
            elif seq.generated >= seq.params.max_tokens or len(seq.prompt) + seq.generated >= self._max_model_len:
                reason = "length"
            else:
                reason = None
            n_top = seq.params.top_logprobs
            top = tuple(zip(top_ids[row][:n_top], top_values[row][:n_top], strict=True)) if n_top else ()
            version = self._bank.version_of_slot(seq.adapter) if seq.adapter else self._version
            prompt = prompt_lps.get(row) if prompt_lps else None
            events.append((seq, TokenEvent(token, chosen[row], version, top, reason, prompt)))
            seq.finished = reason is not None
        self._deliver(events)
        return tokens.cpu()

    @staticmethod
    def _adjust(seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """logit_bias, and min_tokens (stop token ids at -inf while fewer tokens were generated); most steps
        have neither and pay one Python pass over the rows."""
        rows = [(row, seq.params) for row, seq in enumerate(seqs)
                if seq.params.logit_bias or seq.generated < seq.params.min_tokens]  # fmt: skip
        if not rows:
            return logits
        logits = logits.float().clone()
        for row, params in rows:
            for token, bias in params.logit_bias:
                logits[row, token] += bias
            if seqs[row].generated < params.min_tokens and params.stop_token_ids:
                logits[row, sorted(params.stop_token_ids)] = float("-inf")
        return logits

    @staticmethod
    def _finished(seq: _Sequence) -> bool:
        return seq.cancelled or seq.finished

    def _free(self, done) -> None:
        """Free the slots of the sequences for which `done(seq)` holds."""
        for slot, seq in enumerate(self._slots):
            if seq is not None and done(seq):
                # An idle slot inside the step's rows still runs: at position 0 it writes only its own
                # column 0 (overwritten by the next prefill) and does not widen the attention window.
                self._positions[slot] = self._next_input[slot] = self._slot_adapter[slot] = 0
                self._slots[slot] = None

    def _reset_batch(self) -> None:
        self._slots = [None] * self.max_batch_size
        self._slot_adapter.zero_()
        self._positions.zero_()
        self._next_input.zero_()

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
