"""Torch backend: a transformers causal LM driven by our own paged-KV, continuous-batching engine.

One engine thread owns the model and the batch; the asyncio side only enqueues sequences and reads their
tokens from per-sequence queues (torch releases the GIL inside kernels, so HTTP stays responsive). This
module is the asyncio side: the `Backend` interface, loading the model, and reading and checking new
weights, which the engine thread copies in between two steps.

The engine (docs/inference.md, "Torch backend"):
- `engine_loop.py`: the engine thread's loop (`EngineLoop`, a base class of `TorchBackend`): each
  iteration's swap, admission, prefill and decode step, the overlapped decode loop, the hand-off of
  token events to the event loop;
- `kv_cache.py`: the paged KV cache's blocks, reference counts and LRU prefix cache;
- `batch.py`: rows, block tables, admission with prefix sharing (a group's n rollouts computed once),
  copy-on-write, preemption under block pressure, the step's inputs;
- `model_runner.py`: packed prefill and the decode step over the model's own modules, the whole step
  (all layers and sampling) captured as CUDA graphs per batch-size bucket;
- `paged_attention.py` / `triton_kernels.py`: attention on the paged cache (torch; a Triton decode
  kernel on CUDA);
- `sampling.py`: sampling on the device (temperature, top-k/top-p/min-p, biases, bitmask, log-probs).

Only full-attention decoder models are supported: Llama, Mistral, Qwen2 (no sliding window), Qwen3.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from gyre.model_shape import served_context
from gyre.transport import FetchedWeights

from gyre_inference.backend import (
    AdapterGoneError,
    AdapterSlotsBusyError,
    Backend,
    BackendStoppedError,
    SamplingParams,
    TokenEvent,
    WeightsIncompatibleError,
    wait_out,
)
from gyre_inference.batch import Batch, Sequence
from gyre_inference.cpus import default_engine_threads
from gyre_inference.engine_loop import EngineLoop, _Swap
from gyre_inference.engine_stats import EngineStats
from gyre_inference.kv_cache import BlockPool
from gyre_inference.model_runner import BLOCK_SIZE, ModelRunner, check_supported, kv_bytes_per_token

log = logging.getLogger(__name__)


MAX_PREFILL_TOKENS = 4096  # new tokens one prefill computes at most (a longer prompt goes alone)
SLOT_WAIT_SECONDS = 0.05  # how often a request for an evicted adapter checks for a free slot (all busy)


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


class TorchBackend(EngineLoop, Backend):
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
        capture_graphs_at_start: bool = True,
    ):
        super().__init__(resolve_device(device), max_batch_size=max_batch_size, overlap=overlap)
        self._capture_at_start = capture_graphs_at_start
        self.model_path = Path(model_path)
        self.dtype = resolve_dtype(dtype, self.device)
        self._requested_max_len = max_model_len
        self._threads = threads
        # CUDA graphs for the decode step: on by default on CUDA (no effect on CPU).
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._rng = random.Random(seed)  # seeds of requests that bring none
        self._kv_cache_gb, self.prefix_caching = kv_cache_gb, prefix_caching
        # decode step: "auto" (the fused Triton kernels on CUDA when they pass their self-check), "torch" (the
        # model's modules, gathered attention), "fused-torch" / "triton" (tests)
        self._attention = attention
        # named adapters (multi-run): created with the model when max_adapters > 0
        self._adapter_settings = (max_adapters, max_lora_rank, tuple(adapters))
        self._bank = None
        self._model = None
        self._max_model_len = 0
        self._base: dict[str, torch.Tensor] | None = None  # base weights on CPU, read at the first adapter
        self._others_are_base = True  # every weight an adapter does not touch is the base model's
        self._version = 0
        self._thread: threading.Thread | None = None
        self._slot_waiters = 0  # requests waiting for an adapter slot (all busy), not queued yet
        self._swap_lock = asyncio.Lock()  # one read-and-swap at a time: updates and reloads of evicted adapters

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
        return len(self._rows) + self._admitting, len(self._waiting) + self._slot_waiters

    def engine_stats(self) -> EngineStats | None:
        # read without the lock, like load_stats: counters may be one step apart from each other
        if self._runner is None:
            return None
        pool = self._batch.pool
        running, waiting = self.load_stats()
        return self.stats.snapshot(
            running=running, waiting=waiting, kv_cache_usage=1 - pool.free_blocks / (pool.num_blocks - 1),
            captures=self._runner.captures, capture_seconds=self._runner.capture_seconds,
            preemptions=self._batch.preempted,
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

    async def remove_adapter(self, name: str) -> None:
        if self._bank is None:
            raise KeyError(name)
        async with self._swap_lock:  # not while `name` is being loaded (back): the load would serve it again
            with self._cond:  # the asyncio side queues rows on a name's slot under it (`generate`)
                self._bank.forget(name)

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
            # its folder gone (pruned: FileNotFoundError) or unreadable: forgotten; a relay probing the name (version 0
            # now) sends it again
            except (WeightsIncompatibleError, OSError) as error:
                del self._bank.versions[name], self._bank.sources[name]
                raise AdapterGoneError(f"adapter {name!r} was evicted and cannot be loaded back: {error}") from None
            await self._swap_in(tensors, version, adapter=name, source=source)
            # after the swap, not before: an attempt that finds every slot busy (AdapterSlotsBusyError) is retried
            # once one frees, and logging each try said "loading" twice for one load
            log.info("loaded evicted adapter %r back (version %d from %s)", name, version, source)

    def _a_slot_is_idle(self) -> bool:
        """Whether an adapter slot is free or serves no queued or running row (the engine thread's check,
        `EngineLoop._give_slot`, is the one that counts: this one only paces a wait for it)."""
        with self._cond:
            busy = {seq.adapter for seq in (*self._rows, *self._waiting)}
            # every slot no row uses: held by an idle name, or by none (an unloaded name's slot once its rows end)
            return bool(set(range(1, self._bank.max_adapters + 1)) - busy)

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if not self.ready:
            raise BackendStoppedError("the torch engine is not running")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(list(prompt), params, asyncio.Queue(), seed)
        name = params.adapter
        reloads = 0
        while True:
            with self._cond:  # the slot is read and the row queued at once: its slot is busy from now on
                # under the lock the engine thread takes its last look at the queue with: a row queued once it
                # stops (the thread still alive, so `ready` said yes; an adapter loaded back meanwhile) was read
                # by nobody, and its request waited until uvicorn cut it
                if self._stopping:
                    raise BackendStoppedError("the torch engine is stopping")
                if name is None or (self._bank is not None and name in self._bank.slots):
                    if name is not None:
                        seq.adapter = self._bank.slots[name]
                        self._bank.touch(name)
                    self._waiting.append(seq)
                    self._cond.notify()
                    break
            if reloads == 3:  # an adapter evicted again before its request is queued is loaded again, up to 3 times
                raise WeightsIncompatibleError(f"adapter {name!r}: evicted again at once; raise lora.max_loras")
            try:
                await self._reload(name)
                reloads += 1
            except AdapterSlotsBusyError:
                # every slot serves queued or running rows of other names: wait until one ends (vLLM's scheduler
                # queues a request whose adapter does not fit max_loras the same way), then load it back
                self._slot_waiters += 1  # counted as waiting (GetStatus, metrics) like a queued request
                try:
                    while not self._a_slot_is_idle():
                        await asyncio.sleep(SLOT_WAIT_SECONDS)
                finally:
                    self._slot_waiters -= 1
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for event in item if isinstance(item, list) else (item,):  # a list: a final-only sequence's
                    yield event
                    if event.finish_reason is not None:
                        return
        finally:
            with self._cond:  # a sequence still queued leaves the queue now, not when the engine comes to it
                seq.cancelled = True
                self._waiting.discard(seq)

    async def update_weights(self, weights: FetchedWeights) -> None:
        from gyre.lora import ADAPTER_CONFIG

        path, version = Path(weights.folder), weights.step
        adapter = (path / ADAPTER_CONFIG).is_file()
        read = self._read_adapter if adapter else self._read_weights
        async with self._swap_lock:
            tensors = await asyncio.to_thread(read, path)
            # after a full set, weights no adapter touches may differ from the base: the next adapter restores them
            # (noted by the engine thread with the weights and the version, all or nothing)
            await self._swap_in(tensors, version, others_are_base=adapter or version == 0)

    async def reload_base(self) -> None:
        await self.update_weights(FetchedWeights.local(self.model_path))

    # ---- loading --------------------------------------------------------------------------------
    def _load_model(self) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model.to(self.device).eval().requires_grad_(False)
        self._max_model_len = served_context(model.config, self._requested_max_len)
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
        if self._capture_at_start and self._runner.cuda_graphs and self._runner.paged_kernel:
            started = time.perf_counter()
            # After the adapter bank, as a decode step sees it (every row on the base): its hooks and their static
            # slot buffer are part of the captured step; captured with the bank idle, no replay would add an adapter.
            self._use_adapters([])
            sizes = self._runner.capture_all()
            log.info("captured the decode step's CUDA graphs for %d batch sizes (1 to %d) in %.1f s", sizes,
                     self.max_batch_size, time.perf_counter() - started)  # fmt: skip
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
            a, b = ab["A"], ab["B"]
            fits = weight is not None and a.dim() == 2 and a.shape[1] == weight.shape[1]
            if not fits or b.shape != (weight.shape[0], a.shape[0]):
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
            # another float dtype is cast (a bf16 checkpoint for an fp32 replica); integers (a quantized export,
            # raw bytes) would be cast into garbage weights that serve without an error
            if tensor.is_floating_point() != state[name].is_floating_point():
                raise WeightsIncompatibleError(f"{path}: {name} is {tensor.dtype}, the model's is {state[name].dtype}")
        # Names of one tied tensor given with different values (weights trained untied): the copy would keep the
        # last one and serve the other silently changed. Compared only when a folder holds several (HF saves one).
        for given in ([n for n in names if n in tensors] for names in self._tied.values()):
            if any(not torch.equal(tensors[given[0]], tensors[n].to(tensors[given[0]].dtype)) for n in given[1:]):
                raise WeightsIncompatibleError(
                    f"{path}: {' and '.join(given)} are one tensor in the served model (tied embeddings, "
                    "tie_word_embeddings) but differ in the folder: weights trained untied cannot be served tied"
                )
        return {name: tensor.to(self.device, self.dtype) for name, tensor in tensors.items()}

    async def _swap_in(self, tensors: dict, version: int, adapter: str | None = None, source: Path | None = None,
                       others_are_base: bool = True):  # fmt: skip
        swap = _Swap(tensors, version, adapter=adapter, source=source, others_are_base=others_are_base)
        with self._cond:
            if self._stopping or not self.ready:
                raise BackendStoppedError("the torch engine is not running")
            # The caller serialises updates; never drop one silently. A pending swap whose caller gave up (an
            # UpdateWeights past its deadline, the engine busy with a long step) is dropped by the engine anyway:
            # its retry takes its place instead of failing.
            if self._swap is not None and not self._swap.done.cancelled():
                raise RuntimeError("a weight swap is already pending")
            self._swap = swap
            self._cond.notify()
        done = asyncio.wrap_future(swap.done)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # The caller gave up (an UpdateWeights past its deadline, a request that waited for its adapter). A swap
            # the engine has not taken is dropped; one it is copying in is applied all the same, and this call (and
            # with it the swap lock) waits until it is: the next update must read the weights, version and
            # `_others_are_base` this one leaves (read earlier, an adapter merged onto a full set it took for the base).
            if not swap.done.cancel() and await wait_out(done) is None and not done.cancelled():
                log.warning("weights version %d was applied after its caller gave up", version)
            raise
