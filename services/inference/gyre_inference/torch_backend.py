"""Torch backend: a transformers causal LM driven by our own paged-KV, continuous-batching engine.

One engine thread owns the model and the batch; the asyncio side only enqueues sequences and reads their
tokens from per-sequence queues (torch releases the GIL inside kernels, so HTTP stays responsive).

The engine (docs/inference.md, "Torch backend"):
- `kv_cache.py`: the paged KV cache's blocks, reference counts and LRU prefix cache;
- `batch.py`: rows, block tables, admission with prefix sharing (a group's n rollouts computed once),
  copy-on-write, preemption under block pressure, the step's inputs;
- `model_runner.py`: packed prefill and the decode step over the model's own modules, the whole step
  (all layers and sampling) captured as CUDA graphs per batch-size bucket;
- `paged_attention.py` / `triton_kernels.py`: attention on the paged cache (torch; a Triton decode
  kernel on CUDA);
- `sampling.py`: sampling on the device (temperature, top-k/top-p/min-p, biases, bitmask, log-probs).

Each engine iteration: apply a pending weight swap, retire cancelled rows, admit and prefill what fits,
then one decode step for every live row, whose tokens reach the event loop in one hand-off. A weight swap
copies into the parameters in place between two steps: rows in flight keep their KV cache (computed by
the old weights) and continue on the new weights, every token reports the version that computed it, and
no new sequence reuses blocks cached under the old weights.

The overlapped loop (`overlap`, on by default on CUDA; vLLM's async scheduling, SGLang's overlap scheduler).
A synchronous step is host work (inputs, upload), then the device, then host work again (read the tokens,
finish reasons, events), and the device idles while the host works. In the steady state (no admission,
no swap, no structured-output row, no min_tokens boundary, blocks for every row's next position) the
engine instead prepares and launches step n+1 assuming every row advances one position, and only then
reads step n and hands its tokens over, while step n+1 runs: a row's input token for step n+1 is step
n's sample, taken on the device (the CARRY flag, model_runner.py), so no host round trip sits between two
steps. A row whose last token comes from step n by length is left out of step n+1; a row that stops at
step n (stop token, cancellation) computes step n+1 for nothing, its sample discarded, and its blocks are
released only once step n+1 has been read (nothing may reuse a block a launched step writes). Anything
else drains first (read the step in flight, hand its tokens over) and runs the synchronous iteration
exactly as before: admission and prefill, swaps, constraints, preemption. Sampling is a function of each
row's seed and token index and never of the loop, so both loops give the same tokens (tested).

Only full-attention decoder models are supported: Llama, Mistral, Qwen2 (no sliding window), Qwen3.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gyre.transport import FetchedWeights

from gyre_inference.backend import (
    AdapterGoneError,
    Backend,
    BackendStoppedError,
    SamplingParams,
    TokenEvent,
    WeightsIncompatibleError,
)
from gyre_inference.batch import Batch, Sequence
from gyre_inference.cpus import default_engine_threads
from gyre_inference.engine_stats import EngineStats
from gyre_inference.kv_cache import BlockPool
from gyre_inference.model_runner import BLOCK_SIZE, LaunchedStep, ModelRunner, check_supported, kv_bytes_per_token

log = logging.getLogger(__name__)


MAX_PREFILL_TOKENS = 4096  # new tokens one prefill computes at most (a longer prompt goes alone)


@dataclass
class _InFlight:
    """A decode step launched and not read yet (the overlapped loop)."""

    seqs: list[Sequence]  # its rows' sequences
    step: LaunchedStep
    members: set[Sequence] = field(init=False)

    def __post_init__(self):
        self.members = set(self.seqs)


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
        kv_cache_gb: float | None = None,
        prefix_caching: bool = True,
        attention: str = "auto",
        overlap: bool | None = None,
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
        self._kv_cache_gb, self.prefix_caching = kv_cache_gb, prefix_caching
        # decode step: "auto" (the fused Triton kernels on CUDA when they pass their self-check), "torch" (the
        # model's modules, gathered attention), "fused-torch" / "triton" (tests)
        self._attention = attention
        # the overlapped decode loop: on by default on CUDA; on CPU a step's compute runs on the engine thread
        # itself, so there is nothing to overlap (forced on in tests: the same loop, checked token for token)
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._in_flight: _InFlight | None = None
        # named adapters (multi-run): created with the model when max_adapters > 0
        self._adapter_settings = (max_adapters, max_lora_rank, tuple(adapters))
        self._bank = None
        self._model = None
        self._max_model_len = 0
        self._base: dict[str, torch.Tensor] | None = None  # base weights on CPU, read at the first adapter
        self._others_are_base = True  # every weight an adapter does not touch is the base model's
        self._version = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._swap: _Swap | None = None
        self._swap_lock = asyncio.Lock()  # one read-and-swap at a time: updates and reloads of evicted adapters
        self._stopping = False
        self._admitting = 0  # sequences taken off the queue whose prefill is under way
        self._outbox: list[tuple[Sequence, object]] = []  # events waiting for the event loop
        self._outbox_lock = threading.Lock()
        self._outbox_scheduled = False
        # Touched only by the engine thread (created with the model).
        self._runner: ModelRunner | None = None
        self._batch: Batch | None = None
        self.stats = EngineStats()

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
    def _rows(self) -> list[Sequence]:
        """The running sequences, in row order."""
        return self._batch.live if self._batch is not None else []

    def load_stats(self) -> tuple[int, int]:
        # read without the lock: a scrape may be off by the sequences moving between the two lists
        return len(self._rows) + self._admitting, len(self._waiting)

    def engine_stats(self) -> EngineStats | None:
        # read without the lock, like load_stats: counters may be one step apart from each other
        if self._runner is None:
            return None
        pool = self._batch.pool
        running, waiting = self.load_stats()
        return self.stats.snapshot(
            running=running, waiting=waiting, kv_cache_usage=1 - pool.free_blocks / (pool.num_blocks - 1),
            captures=self._runner.captures, capture_seconds=self._runner.capture_seconds,
        )  # fmt: skip

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

    async def update_adapter(self, name: str, weights: FetchedWeights) -> None:
        path, version = weights.folder, weights.step
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
        seq = Sequence(list(prompt), params, asyncio.Queue(), seed)
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

    async def update_weights(self, weights: FetchedWeights) -> None:
        from gyre.lora import ADAPTER_CONFIG

        path, version = Path(weights.folder), weights.step
        adapter = (path / ADAPTER_CONFIG).is_file()
        read = self._read_adapter if adapter else self._read_weights
        async with self._swap_lock:
            tensors = await asyncio.to_thread(read, path)
            await self._swap_in(tensors, version)
        # after a full set, weights no adapter touches may differ from the base: the next adapter restores them
        self._others_are_base = adapter or version == 0

    async def reload_base(self) -> None:
        await self.update_weights(FetchedWeights.local(self.model_path))

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
        check_supported(model.config)
        num_blocks = self._kv_cache_blocks(model.config)
        fits = (num_blocks - 1) * BLOCK_SIZE
        if fits < self._max_model_len:
            # A request that can never fit is refused up front (context_length_exceeded), not by an OOM.
            log.warning("the KV cache holds %d tokens: serving context %d instead of %d (set engine.kv_cache_gb "
                        "for longer contexts)", fits, fits, self._max_model_len)  # fmt: skip
            self._max_model_len = fits
        self._runner = ModelRunner(model, rows=self.max_batch_size, num_blocks=num_blocks,
                                   max_model_len=self._max_model_len, cuda_graphs=self.cuda_graphs)  # fmt: skip
        if self._attention == "auto" and self.device.type == "cuda":
            from gyre_inference import triton_kernels

            triton_kernels.install(self._runner)
        elif self._attention == "fused-torch":  # the fused step's wiring with torch ops (tests, CPU)
            from gyre_inference.model_runner import TorchOps

            self._runner.use_ops(TorchOps())
        elif self._attention == "triton":  # the Triton kernels unconditionally (tests: the interpreter on CPU)
            from gyre_inference.triton_kernels import TritonOps

            self._runner.use_ops(TritonOps())
        pool = BlockPool(num_blocks, BLOCK_SIZE, on_fresh=lambda block: self._runner.zero_blocks(block + 1))
        self._batch = Batch(self._runner, pool, prefix_caching=self.prefix_caching,
                            max_prefill_tokens=max(MAX_PREFILL_TOKENS, self._max_model_len))  # fmt: skip
        max_adapters, max_rank, names = self._adapter_settings
        if max_adapters:
            from gyre_inference.adapters import AdapterBank

            self._bank = AdapterBank(model, max_adapters=max_adapters, max_rank=max_rank,
                                     always=self._runner.cuda_graphs)  # fmt: skip
            for name in names:
                self._bank.declare(name)
        # the tensors a swap copies into, by name, and names that share one tensor (tied embeddings): fixed once
        # loaded (adapters hook modules, they add no weights), so not recomputed for every swap
        self._weights = model.state_dict(keep_vars=True)
        self._tied: dict[int, list[str]] = {}
        for name, tensor in self._weights.items():
            self._tied.setdefault(id(tensor), []).append(name)
        self._model = model
        log.info("loaded %s (%s, %s), context %d, KV cache %d blocks of %d tokens, decode attention %s, "
                 "decode loop %s", self.model_path, self.device, self.dtype, self._max_model_len, num_blocks,
                 BLOCK_SIZE, self._runner.ops.name if self._runner.ops is not None else "torch",
                 "overlapped" if self.overlap else "synchronous")  # fmt: skip

    def _kv_cache_blocks(self, config) -> int:
        """Blocks of the KV cache: `engine.kv_cache_gb` when set; else what max_batch_size full contexts need,
        at most half the GPU memory free after the model loaded (the rest: activations, graphs, and a trainer
        sharing the GPU) or, on CPU, 1 GiB (only blocks in use are ever touched there)."""
        per_block = kv_bytes_per_token(config, self.dtype) * BLOCK_SIZE
        wanted = self.max_batch_size * (-(-self._max_model_len // BLOCK_SIZE) + 1) + 1
        if self._kv_cache_gb is not None:
            return max(2, int(self._kv_cache_gb * 2**30) // per_block)
        if self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] // 2
        else:
            budget = 2**30
        return max(2, min(wanted, budget // per_block))

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
        started = time.perf_counter()
        self._copy_in(swap)
        self.stats.swaps += 1
        self.stats.swap_seconds += time.perf_counter() - started
        swap.done.set_result(None)

    def _copy_in(self, swap: _Swap) -> None:
        if swap.adapter is not None:
            self._bank.load(swap.adapter, swap.tensors, swap.version, swap.source, swap.slot)
            self._batch.new_weights(self._bank.slots[swap.adapter])
            return
        state = self._weights
        with torch.no_grad():  # one fused copy: a loop pays a dispatch per tensor, ~1/3 of a small model's swap
            torch._foreach_copy_([state[name] for name in swap.tensors], list(swap.tensors.values()))
        self._batch.new_weights()
        self._version = swap.version

    # ---- engine thread --------------------------------------------------------------------------
    def _give_slot(self, swap: _Swap, admitted: list[Sequence]) -> _Swap | None:
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
        batch = self._batch
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
                    candidates = []
                    while self._waiting and len(self._rows) + len(candidates) < self.max_batch_size:
                        seq = self._waiting.popleft()
                        if not seq.cancelled:
                            candidates.append(seq)
                    self._admitting = len(candidates)
                    if swap is not None and swap.adapter is not None:
                        swap = self._give_slot(swap, candidates)
                try:
                    self._retire()
                    step = self._next_step() if self.overlap and swap is None and not candidates else []
                    ahead = self._can_overlap(step)
                    if self._in_flight is not None and not ahead:
                        self._drain()  # anything but a plain decode step runs on the host state of every token
                    if swap is not None:
                        self._apply_swap(swap)
                    # Admit and prefill newcomers, then one decode step for everyone: arrivals never starve the batch.
                    if candidates:
                        admitted, back = batch.plan_prefill(candidates)
                        if back and not admitted and not self._rows:
                            # not even an empty cache holds it (the context is clamped to the cache at load)
                            self._deliver([(back.pop(0), RuntimeError("the sequence does not fit in the KV cache"))])
                        self._requeue(back)
                        if admitted:
                            self._prefill(admitted)
                        self._admitting = 0
                    if self._rows:
                        self._decode_ahead(step) if ahead else self._decode()
                except Exception as error:  # a failed step fails its sequences, never the engine
                    log.exception("engine step failed")
                    self._abandon_in_flight()
                    if swap is not None and not swap.done.done():
                        swap.done.set_exception(error)
                    failed = {id(seq): seq for seq in self._rows + candidates}.values()
                    self._deliver([(seq, error) for seq in failed])
                    batch.reset()
                    self._admitting = 0
        self._abandon_in_flight()
        with self._cond:
            stranded = self._rows + list(self._waiting)
            self._waiting.clear()
            if self._swap is not None and self._swap.done.set_running_or_notify_cancel():
                self._swap.done.set_exception(BackendStoppedError("engine stopped"))
        self._deliver([(seq, BackendStoppedError("the inference engine stopped")) for seq in stranded])
        batch.reset()

    def _requeue(self, seqs: list[Sequence]) -> None:
        """Back to the front of the queue, in order (admission waits for blocks; preempted rows)."""
        if seqs:
            with self._cond:
                self._waiting.extendleft(reversed(seqs))

    def _use_adapters(self, seqs: list[Sequence], per_token: list[int] | None = None) -> None:
        if self._bank is None:
            return
        if per_token is None:  # decode: one adapter slot per batch row
            # pinned on CUDA: copied without waiting (a copy from pageable memory may wait for the step in flight)
            rows = torch.zeros(self.max_batch_size, dtype=torch.long, pin_memory=self.device.type == "cuda")
            for seq in seqs:
                rows[seq.row] = seq.adapter
            self._bank.use_decode(rows)
        else:
            self._bank.use(torch.tensor(per_token))

    def _prefill(self, seqs: list[Sequence]) -> None:
        started = time.perf_counter()
        admitted = [len(seq.prompt) + len(seq.tokens) for seq in seqs]  # before their first sample is appended
        new = [length - seq.computed for seq, length in zip(seqs, admitted, strict=True)]
        self._use_adapters(seqs, [seq.adapter for seq, n in zip(seqs, new, strict=True) for _ in range(n)])
        samples = self._batch.prefill(seqs)
        self._emit(seqs, range(len(seqs)), samples, decode=False)
        self._retire()
        stats = self.stats
        stats.prefills += 1
        stats.prefill_seconds += time.perf_counter() - started
        stats.prefilled += sum(new)
        stats.admitted_tokens += sum(admitted)

    def _decode(self) -> None:
        """One decode step for every live row, read before the next one is prepared (the synchronous loop)."""
        started = time.perf_counter()
        self._requeue(sorted(self._batch.prepare_decode(), key=lambda seq: seq.admitted))
        if not self._rows:
            return
        self._use_adapters(self._rows)
        device_before = self._runner.device_seconds
        live, samples = self._batch.decode()
        self._emit(live, [seq.row for seq in live], samples, decode=True)
        self._retire()
        stats = self.stats
        stats.decode_steps += 1
        stats.decode_tokens += len(live)
        stats.decode_seconds += time.perf_counter() - started
        stats.device_seconds += self._runner.device_seconds - device_before

    # ---- the overlapped loop (module docstring) --------------------------------------------------
    def _next_step(self) -> list[Sequence]:
        """The rows of the next decode step: live rows that are not over, nor will be after the step in flight."""
        flying = self._in_flight.members if self._in_flight is not None else ()
        return [seq for seq in self._rows if not self._finished(seq) and not (seq in flying and self._ends(seq))]

    def _ends(self, seq: Sequence) -> bool:
        """The token in flight is the sequence's last by length (max_tokens or the context)."""
        generated = len(seq.tokens) + 1
        return generated >= seq.params.max_tokens or len(seq.prompt) + generated >= self._max_model_len

    def _can_overlap(self, step: list[Sequence]) -> bool:
        """Whether the next step (its rows) may be launched before the step in flight is read: none of its inputs
        depends on the host knowing the tokens in flight, and it needs no preemption."""
        if not step:
            return False
        flying = self._in_flight.members if self._in_flight is not None else set()
        for seq in step:
            if seq.constraint is not None:  # its bitmask follows its matcher, which must see every token first
                return False
            min_tokens = seq.params.min_tokens
            if min_tokens and seq in flying and len(seq.tokens) + 1 == min_tokens:  # its biases change with it
                return False
        return self._batch.blocks_needed(step, flying) <= self._batch.pool.free_blocks  # else preemption

    def _decode_ahead(self, step: list[Sequence]) -> None:
        """Prepare and launch the next step (its rows), then read the step in flight and hand its tokens over while
        the new one runs on the device."""
        started = time.perf_counter()
        previous = self._in_flight
        self._batch.prepare_decode(step, previous.members if previous is not None else ())
        self._use_adapters(step)
        self._in_flight = _InFlight(step, self._batch.launch(step))
        if previous is not None:
            self.stats.overlapped_steps += 1
            self._collect(previous)
        self.stats.decode_seconds += time.perf_counter() - started

    def _collect(self, flight: _InFlight) -> None:
        """Read a launched step and hand over the tokens of its rows that were not over already."""
        device_before = self._runner.device_seconds
        samples = self._runner.collect(flight.step)
        live = [seq for seq in flight.seqs if not seq.finished]  # the others stopped at the step before
        self._emit(live, [seq.row for seq in live], samples, decode=True)
        stats = self.stats
        stats.decode_steps += 1
        stats.decode_tokens += len(live)
        stats.wasted_rows += len(flight.seqs) - len(live)
        stats.device_seconds += self._runner.device_seconds - device_before

    def _drain(self) -> None:
        """Read the step in flight (no step is launched behind it) and retire the rows that are over."""
        started = time.perf_counter()
        flight, self._in_flight = self._in_flight, None
        self._collect(flight)
        self._retire()
        self.stats.decode_seconds += time.perf_counter() - started

    def _retire(self) -> None:
        """Release the rows that are over, except those in the step in flight: it still writes their blocks."""
        self._runner.inputs.wait_uploaded()  # releasing a row writes the input mirrors (see StepBuffers)
        flying = self._in_flight.members if self._in_flight is not None else ()
        self._batch.free(lambda seq: self._finished(seq) and seq not in flying)

    def _abandon_in_flight(self) -> None:
        """After a failure or at shutdown: wait for the step in flight (its writes) and forget it."""
        if self._in_flight is not None:
            self._in_flight = None
            if self.device.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)

    def _emit(self, seqs: list[Sequence], index, samples, *, decode: bool) -> None:
        """Turn one step's samples into token events (finish reasons, versions) and hand them over at once."""
        tokens, logprobs = samples[0].tolist(), samples[1].tolist()
        top_values, top_ids = (samples[2].tolist(), samples[3].tolist()) if len(samples) > 2 else (None, None)
        versions = {0: self._version}
        events = []
        for seq, i in zip(seqs, index, strict=True):
            token = tokens[i]
            self._batch.advance(seq, token, computed=decode)
            params, generated = seq.params, len(seq.tokens)
            constraint = params.constraint
            if constraint is not None:
                constraint.accept_token(token)
            if token in params.stop_token_ids or (constraint is not None and constraint.is_terminated()):
                reason = "stop"
            elif generated >= params.max_tokens or len(seq.prompt) + generated >= self._max_model_len:
                reason = "length"
            else:
                reason = None
            n_top = params.top_logprobs
            top = tuple(zip(top_ids[i][:n_top], top_values[i][:n_top], strict=True)) if n_top else ()
            version = versions.get(seq.adapter)
            if version is None:
                version = versions[seq.adapter] = self._bank.version_of_slot(seq.adapter)
            prompt, seq.prompt_logprobs = seq.prompt_logprobs, None  # on the first event only
            events.append((seq, TokenEvent(token, logprobs[i], version, top, reason, prompt)))
            seq.finished = reason is not None
        self._deliver(events)

    @staticmethod
    def _finished(seq: Sequence) -> bool:
        return seq.cancelled or seq.finished

    def _deliver(self, items: list[tuple[Sequence, object]]) -> None:
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
