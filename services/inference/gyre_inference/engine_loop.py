"""The torch engine's loop: the engine thread's side of `TorchBackend` (torch_backend.py).

`EngineLoop` is a base class of `TorchBackend`. The backend's asyncio side queues sequences (`_waiting`) and
weight swaps (`_swap`) under `_cond`; the engine thread (`_run`) owns the model and the batch, schedules
every step and hands each step's token events to the event loop in one coalesced callback (`_deliver`).

Each engine iteration: apply a pending weight swap, retire cancelled rows, admit and prefill what fits,
then one decode step for every live row, whose tokens reach the event loop in one hand-off. A weight swap
copies into the parameters in place between two steps: rows in flight keep their KV cache (computed by
the old weights) and continue on the new weights, every token reports the version that computed it, and
no new sequence reuses blocks cached under the old weights.

The overlapped loop (`overlap`, on by default on CUDA; vLLM's async scheduling, SGLang's overlap scheduler).
A synchronous step is host work (inputs, upload), then the device, then host work again (read the tokens,
finish reasons, events), and the device idles while the host works. In the steady state (no admission, no
swap, no structured-output row, no min_tokens boundary, no bad word of several tokens, blocks for every
row's next position) the engine instead prepares and launches step n+1 assuming every row advances one
position, and only then reads step n and hands its tokens over, while step n+1 runs: a row's input token for
step n+1 is step n's sample, taken on the device (the CARRY flag, model_runner.py), so no host round trip
sits between two steps. A row whose last token comes from step n by length is left out of step n+1; a row
that stops at step n (stop token, cancellation) computes step n+1 for nothing, its sample discarded, and its
blocks are released only once step n+1 has been read (nothing may reuse a block a launched step writes).
Anything else drains first (read the step in flight, hand its tokens over) and runs the synchronous
iteration exactly as before: admission and prefill, swaps, constraints, preemption. Sampling is a function
of each row's seed and token index and never of the loop, so both loops give the same tokens (tested).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gyre_inference.backend import BackendStoppedError, TokenEvent, WeightsIncompatibleError
from gyre_inference.batch import Batch, Sequence
from gyre_inference.engine_stats import EngineStats
from gyre_inference.model_runner import LaunchedStep, ModelRunner
from gyre_inference.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from gyre_inference.adapters import AdapterBank

log = logging.getLogger(__name__)


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
    slot: int | None = None  # the adapter's slot, found by the engine thread (`AdapterBank.slot_for`)
    # model weights: after this swap, every weight an adapter does not touch is the base model's
    others_are_base: bool = True


class EngineLoop:
    """The engine thread's scheduler loop over a `Batch` and its `ModelRunner` (a base class of `TorchBackend`)."""

    # Set by the backend: with the model (`TorchBackend._load_model`) and by weight swaps (`_copy_in`).
    _bank: AdapterBank | None  # named adapters (multi-run), when max_adapters > 0
    _version: int  # the model weights' version
    _others_are_base: bool  # every weight an adapter does not touch is the base model's (read by adapter merges)
    _max_model_len: int
    _weights: dict[str, torch.Tensor]  # the tensors a swap copies into, by name
    threads: int  # torch threads of the engine thread on CPU

    def __init__(self, device: torch.device, *, max_batch_size: int, overlap: bool | None):
        self.device = device
        self.max_batch_size = max_batch_size
        # the overlapped decode loop: on by default on CUDA; on CPU a step's compute runs on the engine thread
        # itself, so there is nothing to overlap (forced on in tests: the same loop, checked token for token)
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._in_flight: _InFlight | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # where `_deliver` hands events to (set by `start`)
        self._cond = threading.Condition()
        self._waiting = WaitingQueue()  # by priority, then arrival
        self._swap: _Swap | None = None
        self._stopping = False
        self._admitting = 0  # sequences taken off the queue whose prefill is under way
        self._outbox: list[tuple[Sequence, object]] = []  # events waiting for the event loop
        self._outbox_lock = threading.Lock()
        self._outbox_scheduled = False
        # Touched only by the engine thread (created with the model).
        self._runner: ModelRunner | None = None
        self._batch: Batch | None = None
        self.stats = EngineStats()

    @property
    def _rows(self) -> list[Sequence]:
        """The running sequences, in row order."""
        return self._batch.live if self._batch is not None else []

    # ---- engine thread --------------------------------------------------------------------------
    def _give_slot(self, swap: _Swap, admitted: list[Sequence]) -> _Swap | None:
        """Under `_cond`: the adapter's slot, evicting an idle one if need be (None: refused, told to the caller).
        Every slot a queued, admitted or running row uses is busy: those rows keep their adapter. A new name gets
        the slot only once the swap has filled it (`AdapterBank.load`)."""
        busy = {seq.adapter for seq in (*self._rows, *admitted, *self._waiting)}
        try:
            swap.slot = self._bank.slot_for(swap.adapter, busy)
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
                        # the admitted hold rows now, which load_stats counts: counted as admitting too, they were
                        # running twice for as long as their prefill took (GetStatus, the running gauge)
                        self._admitting = len(back)
                        if back and not admitted and not self._rows:
                            # not even an empty cache holds it (the context is clamped to the cache at load)
                            self._deliver([(back.pop(0), RuntimeError("the sequence does not fit in the KV cache"))])
                        self._requeue(back)
                        self._admitting = 0  # the others are queued again (counted as waiting)
                        if admitted:
                            self._prefill(admitted)
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
        """Back to the queue, each at the place it first got (admission waits for blocks; preempted rows)."""
        if seqs:
            with self._cond:
                self._waiting.extend(seqs)

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
        self._requeue(self._batch.prepare_decode())
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

    # ---- weight swaps, between two steps ---------------------------------------------------------
    def _apply_swap(self, swap: _Swap) -> None:
        started = time.perf_counter()
        try:
            self._copy_in(swap)
        except Exception as error:
            if swap.adapter is not None:
                raise  # an adapter's slot serves no request until its load completes (`AdapterBank.load`)
            # the copy is tensor by tensor: failed part way, the model holds a mix of two versions and the weights
            # served before are gone (vLLM loads them back first, `_load_back`). Serving on stamped the samples of no
            # policy with the old version: the engine stops, and the service exits so that the replica restarts
            with self._cond:
                self._stopping = True
            raise BackendStoppedError(
                f"copying in weights version {swap.version} failed part way ({error}): the weights are a mix of two "
                "versions, so the engine is stopped; the replica exits to be restarted"
            ) from error
        self.stats.swaps += 1
        self.stats.swap_seconds += time.perf_counter() - started
        swap.done.set_result(None)

    def _copy_in(self, swap: _Swap) -> None:
        if swap.adapter is not None:
            self._bank.load(swap.adapter, swap.tensors, swap.version, swap.source, swap.slot, lock=self._cond)
            self._batch.new_weights(self._bank.slots[swap.adapter])
            return
        state = self._weights
        with torch.no_grad():  # one fused copy: a loop pays a dispatch per tensor, ~1/3 of a small model's swap
            torch._foreach_copy_([state[name] for name in swap.tensors], list(swap.tensors.values()))
        self._batch.new_weights()
        self._version, self._others_are_base = swap.version, swap.others_are_base

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
            if seq.penalised:  # its token counts are the host's: the step's sample must be counted before the next
                return False
            if seq.watches_words:  # a bad word's ban follows the row's last tokens, the one in flight too
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
            if params.final_only:  # one hand-off when it ends (SamplingParams.final_only)
                first = time.monotonic() if generated == 1 else None
                seq.held.append(TokenEvent(token, logprobs[i], version, top, reason, prompt, sampled_at=first))
                if reason is not None:
                    events.append((seq, seq.held))
            else:
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
