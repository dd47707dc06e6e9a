"""The decode step's per-row inputs (`StepBuffers`): static device buffers the CUDA graphs read, and the host
mirrors the engine writes through numpy views (pinned on CUDA, so an upload never waits for the step in
flight; the same tensors on CPU). A row holds its token, position, cache slot, context length, sampling
parameters and uniform (the int and float rows below), its block table, sparse logit biases and, for
structured outputs, a token bitmask. model_runner.py's docstring says how a step uses them.
"""

from __future__ import annotations

import numpy as np
import torch

from gyre_inference.kv_cache import NULL_BLOCK
from gyre_inference.sampling import Penalties

# Row indices of the per-row int and float input buffers.
IDS, POSITIONS, SLOTS, CONTEXT, TOP_K, CARRY = range(6)
TEMPERATURE, TOP_P, MIN_P, UNIFORM = range(4)


def power_of_two(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


class StepBuffers:
    """Per-row inputs of the decode step, on the device, with host mirrors (pinned on CUDA; the same
    tensors on CPU) that the engine writes through numpy views."""

    def __init__(self, rows: int, max_blocks: int, vocab: int, device: torch.device, mirror: bool | None = None):
        self.device, self.rows = device, rows
        # mirror=True on CPU: separate host and device tensors, as on a GPU (tests of the upload path)
        self.on_host = not (device.type != "cpu" if mirror is None else mirror)
        pin = device.type == "cuda"

        def pair(shape, dtype, fill=0):
            host = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
            return host, self._on_device(host)

        self.ints_host, self.ints = pair((6, rows), torch.long)
        self.floats_host, self.floats = pair((4, rows), torch.float32)
        self.ints_host[CONTEXT] = 1  # idle rows: one (garbage) key of the null block
        self.table_host, self.table = pair((rows, max_blocks), torch.long, NULL_BLOCK)
        self.bitmask_host, self.bitmask = pair((rows, (vocab + 31) // 32), torch.int32, -1)
        self.bias_width = 0
        self.bias_ids_host = self.bias_ids = torch.zeros(rows, 0, dtype=torch.long)
        self.vocab = vocab
        # vLLM's penalties (sampling.Penalties): made on the first penalised request (two [rows, vocab] tensors); only
        # the eager step reads them, never a CUDA graph
        self.penalties: PenaltyRows | None = None
        self.bias_values_host = self.bias_values = torch.zeros(rows, 0)
        self.ints_np, self.floats_np = self.ints_host.numpy(), self.floats_host.numpy()
        self.table_np, self.bitmask_np = self.table_host.numpy(), self.bitmask_host.numpy()
        self._dirty_tables: set[int] = set()
        self._dirty_bias: set[int] = set()
        # Recorded after each upload's asynchronous copies from the pinned mirrors (CUDA only): see wait_uploaded.
        self._uploaded = torch.cuda.Event() if pin and not self.on_host else None

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.on_host:
            return host
        return host.clone() if self.device.type == "cpu" else host.to(self.device)

    def grow_bias(self, width: int) -> bool:
        """Make room for `width` sparse biases per row (True: the buffers moved, graphs must be recaptured)."""
        if width <= self.bias_width:
            return False
        width = power_of_two(width, 4)
        pin = self.device.type == "cuda"
        ids = torch.zeros(self.rows, width, dtype=torch.long, pin_memory=pin)
        values = torch.zeros(self.rows, width, pin_memory=pin)
        ids[:, : self.bias_width] = self.bias_ids_host
        values[:, : self.bias_width] = self.bias_values_host
        self.bias_ids_host, self.bias_values_host, self.bias_width = ids, values, width
        self.bias_ids, self.bias_values = self._on_device(ids), self._on_device(values)
        return True

    def set_bias(self, row: int, entries: list[tuple[int, float]]) -> None:
        self._dirty_bias.add(row)
        self.bias_ids_host[row].zero_()
        self.bias_values_host[row].zero_()
        if entries:
            ids, values = zip(*entries, strict=True)
            self.bias_ids_host[row, : len(ids)] = torch.tensor(ids)
            self.bias_values_host[row, : len(ids)] = torch.tensor(values)

    def penalty_rows(self) -> PenaltyRows:
        if self.penalties is None:
            self.penalties = PenaltyRows(self.rows, self.vocab, self.device)
        return self.penalties

    def set_table(self, row: int, blocks: list[int]) -> None:
        self.table_np[row, : len(blocks)] = blocks
        self._dirty_tables.add(row)

    def set_block(self, row: int, index: int, block: int) -> None:
        self.table_np[row, index] = block
        self._dirty_tables.add(row)

    def _staged(self, host: torch.Tensor) -> torch.Tensor:
        """A fresh host tensor on the device without waiting: a plain (blocking) copy from pageable memory would
        synchronize the stream, i.e. wait for the step in flight, which is what the overlapped loop must not
        do. Pinned by torch's caching host allocator, which keeps the block until the copy has run."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def upload(self, rows: int, masked: bool = False) -> None:
        """Copy the host's writes of this step to the device (nothing to do on CPU): the per-row inputs, and the
        block-table and bias rows written since the last upload. Nothing here waits for the device."""
        if self.on_host:
            self._dirty_tables.clear()
            self._dirty_bias.clear()
            return
        # Whole buffers (a few KiB), not the step's [:, :rows] columns: a strided slice is first copied into a
        # pageable temporary, and a copy from pageable memory may wait for the step in flight.
        self.ints.copy_(self.ints_host, non_blocking=True)
        self.floats.copy_(self.floats_host, non_blocking=True)
        for dirty, pairs in ((self._dirty_tables, ((self.table, self.table_host),)),
                             (self._dirty_bias, ((self.bias_ids, self.bias_ids_host),
                                                 (self.bias_values, self.bias_values_host)))):  # fmt: skip
            if dirty:
                index = torch.tensor(sorted(dirty), dtype=torch.long)
                on_device = self._staged(index)
                for target, source in pairs:
                    target.index_copy_(0, on_device, self._staged(source[index]))
                dirty.clear()
        if masked:
            self.bitmask[:rows].copy_(self.bitmask_host[:rows], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def wait_uploaded(self) -> None:
        """Block until the last upload's copies from the pinned mirrors have run: the host must not write a mirror
        an enqueued copy still reads (the overlapped loop enqueues step n+1, whose upload runs right after step n
        ends, and then writes step n+2's inputs). Waiting on one event, not double-buffering the mirrors: every
        mirror holds state that lives across steps (a row's sampling parameters, its block table), which a
        second set would have to mirror too, and by the time the host writes again (after reading step n) the
        copy has almost always run already, so the wait costs nothing."""
        if self._uploaded is not None:
            self._uploaded.synchronize()


class PenaltyRows:
    """What vLLM's penalties need per row, on the device: the count of each token in the row's generated tokens and
    the tokens seen in its prompt or output (`sampling.Penalties`), with the row's three penalties (host, uploaded by
    the step that reads them). Rows are set when a penalised sequence takes one (its prompt and the tokens it has
    already generated: a preempted sequence's recompute), then counted token by token, the host's tokens of a step
    added in one device op before the next sample reads them (a penalised row never takes the overlapped path)."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.device = device
        self.counts = torch.zeros(rows, vocab, device=device)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.params = np.zeros((3, rows), dtype=np.float32)  # repetition, frequency, presence
        self.params[0] = 1.0
        self._pending: dict[int, list[int]] = {}

    def take(self, row: int, params, prompt: list[int], tokens: list[int]) -> None:
        self.params[:, row] = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        self._pending.pop(row, None)
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.seen[row, torch.tensor(prompt + tokens, dtype=torch.long, device=self.device)] = True
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            self.counts[row].index_add_(0, ids, torch.ones(len(tokens), device=self.device))

    def vacate(self, row: int) -> None:
        self._pending.pop(row, None)
        self.params[:, row] = (1.0, 0.0, 0.0)

    def count(self, row: int, token: int) -> None:
        self._pending.setdefault(row, []).append(token)

    def flush(self) -> None:
        """Add the tokens counted since the last flush (one device op for all rows)."""
        if not self._pending:
            return
        rows = [row for row, tokens in self._pending.items() for _ in tokens]
        tokens = [token for row_tokens in self._pending.values() for token in row_tokens]
        self._pending.clear()
        index = (torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device))
        self.counts.index_put_(index, torch.ones(len(rows), device=self.device), accumulate=True)
        self.seen[index] = True

    def select(self, rows: torch.Tensor | slice) -> Penalties:
        """The `Penalties` of these rows (a slice of the step's rows, or the indices of a prefill's sequences)."""
        self.flush()
        if not isinstance(rows, slice):
            rows = rows.cpu().numpy()
        repetition, frequency, presence = torch.from_numpy(np.ascontiguousarray(self.params[:, rows])).to(self.device)
        if not isinstance(rows, slice):
            rows = torch.from_numpy(rows).to(self.device)
        return Penalties(self.counts[rows], self.seen[rows], repetition, frequency, presence)
