"""Named LoRA adapters served next to the base model by the torch backend (multi-run: one per run).

A request picks its adapter by model name (`SamplingParams.adapter`); rows of different adapters and of
the base model share one batch. Every linear layer of the decoder blocks gets a forward hook that adds,
for each row b of the batch,

    y_b += (x_b @ A[i_b]^T) @ B[i_b]^T        (B stored pre-scaled by alpha / r)

where i_b is the row's adapter slot. Slot 0 is all zeros: the base model. The A and B of every slot live
in one stacked buffer per layer, [slots, max_rank, in] and [slots, out, max_rank]; an adapter of rank
r < max_rank fills the first r ranks and leaves zeros, which add nothing. Shapes never change and an
adapter is loaded by copying in place between two decode steps, so captured CUDA graphs stay valid.

The bank is bounded (vLLM's cache does the same): `max_adapters` (`lora.max_loras`) names are resident; a new name
when every slot is taken evicts the least recently used name whose slot no queued or running row uses (a
finished run's adapter, typically). The bank remembers every name's version and the folder it was loaded
from, so an evicted name is still served: its next request loads it back from that folder (the torch
backend does this, `TorchBackend._reload`), and its next UpdateWeights loads the new version as usual.

Trade-off, against keeping one merged copy of the weights per adapter (docs/inference.md, "Adapters by
model name"): memory is `slots x max_rank x (in + out)` per layer (a few % of the model at rank 16)
instead of a full model per run, and mixed batches need no weight swaps; the price is two small
batched matmuls per linear layer per step (and an index gather), paid whenever the bank exists: on CPU
only while some row uses an adapter, on CUDA always (a graph cannot branch on the rows).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from gyre_inference.backend import NOT_A_VERSION, AdapterSlotsBusyError, WeightsIncompatibleError

BASE = 0  # the slot of the base model (no adapter)


def read_adapter_folder(path: Path) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    """A PEFT adapter folder as (alpha / r, {module: {"A": ..., "B": ...}}); what cannot be used raises
    WeightsIncompatibleError naming the file, an I/O error its OSError (worth another try). Shared by the bank and
    the torch backend's merge."""
    from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, config_scale, split_lora
    from safetensors.torch import load_file

    try:
        config = json.loads((path / ADAPTER_CONFIG).read_bytes())
        scale = config_scale(config)
        # one alpha / r for every module, and only lora_A / lora_B applied: anything else would be dropped silently
        if patterns := [key for key in ("rank_pattern", "alpha_pattern") if config.get(key)]:
            raise ValueError(f"{ADAPTER_CONFIG}: per-module {' and '.join(patterns)} are not supported")
        others, adapters = split_lora(load_file(path / ADAPTER_FILE))
        if others:  # modules_to_save copies, LoRA biases
            raise ValueError(f"{ADAPTER_FILE} holds tensors besides lora_A/lora_B, not supported: {sorted(others)[:3]}")
    except OSError as error:
        if not isinstance(error, NOT_A_VERSION):  # an I/O error on the volume: may pass (FAILED_PRECONDITION)
            raise
        raise WeightsIncompatibleError(f"{path}: not a usable LoRA adapter ({error})") from None
    except ValueError as error:
        raise WeightsIncompatibleError(f"{path}: not a usable LoRA adapter ({error})") from None
    except Exception as error:  # safetensors' own error type for a malformed file
        raise WeightsIncompatibleError(f"{path / ADAPTER_FILE}: not a readable safetensors file ({error})") from None
    for module, ab in adapters.items():  # integers would be cast into a garbage delta that serves without an error
        if bad := [f"{key} is {t.dtype}" for key, t in ab.items() if not t.is_floating_point()]:
            raise WeightsIncompatibleError(f"{path}: the adapter for {module}: {', '.join(bad)}, not floating point")
    return scale, adapters


class AdapterBank:
    """Slots of named adapters over every decoder linear layer of `model` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, max_adapters: int, max_rank: int, always: bool = False):
        if max_adapters < 1 or max_rank < 1:
            raise ValueError("AdapterBank needs max_adapters >= 1 and max_rank >= 1")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self.always = always  # CUDA graphs: compute the hook even when no row uses an adapter
        self.slots: dict[str, int] = {}  # resident adapter name -> slot (1..max_adapters)
        # every name ever served, resident or evicted: the version it serves (0 = none yet = base) and the
        # folder that version was loaded from (None: declared, never loaded), to load it back after eviction
        self.versions: dict[str, int] = {}
        self.sources: dict[str, Path | None] = {}
        self._clock = itertools.count(1)
        self._used: dict[str, int] = {}  # resident name -> when it was last used (loaded or asked for)
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module name -> (A, B) stacks
        self._hooks = []
        n = max_adapters + 1
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                a = torch.zeros(n, max_rank, module.in_features, device=self.device, dtype=self.dtype)
                b = torch.zeros(n, module.out_features, max_rank, device=self.device, dtype=self.dtype)
                self.layers[name] = (a, b)
                self._hooks.append(module.register_forward_hook(self._hook(a, b)))
        if not self.layers:
            raise ValueError("AdapterBank: the model has no linear layers under .layers.")
        self.decode_rows = torch.zeros(0, dtype=torch.long, device=self.device)  # static: one slot per batch slot
        self.rows = self.decode_rows  # the slots of the rows of the next forward
        self.active = False

    # ---- names and versions ---------------------------------------------------------------------
    def declare(self, name: str) -> int:
        """Serve `name` from a slot as it is now (start-up: `lora.adapters`, the base until their first version);
        see `slot_for`."""
        slot = self.slot_for(name)
        self._assign(name, slot)
        return slot

    def slot_for(self, name: str, busy: Collection[int] = ()) -> int:
        """The slot adapter `name` is to be loaded into: its own when resident, else a free slot, else the slot of
        the least recently used name whose slot is not in `busy` (the slots queued or running rows use), which is
        evicted at once (its next request loads it back). The slot is not `name`'s until `load` has filled it: a
        request for `name` arriving meanwhile must not be queued on a slot that still holds the evicted adapter's
        weights (nor keep it, should the load fail)."""
        if name in self.slots:
            return self.slots[name]
        # a slot no name holds may still be busy: the rows of an unloaded adapter (`forget`) finish on its weights
        free = set(range(1, self.max_adapters + 1)) - set(self.slots.values()) - set(busy)
        if free:
            return min(free)
        idle = [n for n in self.slots if self.slots[n] not in busy]
        if not idle:
            raise AdapterSlotsBusyError(
                f"adapter {name!r}: all {self.max_adapters} adapter slots are in use by queued or running "
                f"requests ({sorted(self.slots)}); retry, or raise lora.max_loras"
            )
        victim = min(idle, key=self._used.__getitem__)
        del self._used[victim]
        return self.slots.pop(victim)

    def _assign(self, name: str, slot: int) -> None:
        self.slots[name] = slot
        self.versions.setdefault(name, 0)
        self.sources.setdefault(name, None)
        self.touch(name)

    def forget(self, name: str) -> None:
        """Stop serving `name` (unloaded, `POST /v1/unload_lora_adapter`); KeyError if it is not served. Its slot is
        free once no queued or running row uses it: those rows were started on its adapter and finish on it (as vLLM
        binds an adapter to a request for its whole life), so the slot's weights stay until then (`slot_for`)."""
        del self.versions[name]
        del self.sources[name]
        if self.slots.pop(name, None) is not None:
            del self._used[name]

    def touch(self, name: str) -> None:
        """`name` was just used: it is the last to be evicted."""
        self._used[name] = next(self._clock)

    def version_of_slot(self, slot: int) -> int:
        for name, s in self.slots.items():
            if s == slot:
                return self.versions[name]
        return 0

    # ---- rows of the next forward ---------------------------------------------------------------
    def use(self, slots: torch.Tensor) -> None:
        """The next forward's rows use these slots (a CPU tensor; prefill)."""
        self.rows = slots.to(self.device)
        self.active = self.always or bool(slots.any())

    def use_decode(self, slots: torch.Tensor) -> None:
        """Decode steps: rows are the batch slots; copied into a static buffer (CUDA graphs read it)."""
        if self.decode_rows.numel() != slots.numel():
            self.decode_rows = torch.zeros(slots.numel(), dtype=torch.long, device=self.device)
        self.decode_rows.copy_(slots, non_blocking=True)
        self.rows = self.decode_rows
        self.active = self.always or bool(slots.any())

    def _hook(self, a_stack: torch.Tensor, b_stack: torch.Tensor):
        def add_adapters(module, args, out):
            if not self.active:
                return None
            x = args[0]
            flat = x.dim() == 2
            x3 = x[:, None, :] if flat else x
            index = self.rows[: x3.shape[0]]
            low = torch.bmm(x3, a_stack.index_select(0, index).transpose(1, 2))  # [rows, tokens, max_rank]
            delta = torch.bmm(low, b_stack.index_select(0, index).transpose(1, 2))
            return out + (delta[:, 0, :] if flat else delta)

        return add_adapters

    # ---- loading --------------------------------------------------------------------------------
    def read(self, path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """A PEFT adapter folder as {module: (A padded to max_rank, scale * B padded)}, checked against the
        bank (WeightsIncompatibleError naming what does not fit). Runs off the engine thread."""
        scale, adapters = read_adapter_folder(path)
        if not adapters:
            raise WeightsIncompatibleError(f"{path}: the adapter holds no lora_A/lora_B tensors")
        padded = {}
        for module, ab in adapters.items():
            stacks = self.layers.get(module)
            if stacks is None:
                raise WeightsIncompatibleError(f"{path}: the model has no adapted linear layer {module}")
            a, b = ab["A"], ab["B"]
            rank = a.shape[0]
            if rank > self.max_rank:
                raise WeightsIncompatibleError(f"{path}: rank {rank} exceeds lora.max_rank {self.max_rank}")
            if a.shape[1] != stacks[0].shape[2] or b.shape != (stacks[1].shape[1], rank):
                raise WeightsIncompatibleError(f"{path}: the adapter for {module} does not fit the model")
            pa = torch.zeros(self.max_rank, a.shape[1], dtype=self.dtype)
            pb = torch.zeros(b.shape[0], self.max_rank, dtype=self.dtype)
            pa[:rank] = a.to(self.dtype)
            pb[:, :rank] = (b.float() * scale).to(self.dtype)
            padded[module] = (pa.to(self.device), pb.to(self.device))
        return padded

    def load(
        self, name: str, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], version: int,
        source: Path | None = None, slot: int | None = None, lock: AbstractContextManager = nullcontext(),
    ) -> None:  # fmt: skip
        """Serve `tensors` (from `read` of folder `source`) as adapter `name` at `version` (engine thread, between
        steps), in `slot` (from `slot_for`; by default found here). Layers the adapter does not touch are zeroed
        in its slot: the adapter replaces, never adds up. The name gets its slot and version only once the slot is
        filled: a request is never queued on a slot half loaded, or holding an evicted adapter's weights. `lock` is
        held while the name is assigned (the engine's condition: the asyncio side reads the slots under it)."""
        slot = self.slot_for(name) if slot is None else slot
        with torch.no_grad():
            for module, (a_stack, b_stack) in self.layers.items():
                pair = tensors.get(module)
                if pair is None:
                    a_stack[slot].zero_()
                    b_stack[slot].zero_()
                else:
                    a_stack[slot].copy_(pair[0])
                    b_stack[slot].copy_(pair[1])
        with lock:
            self.versions[name], self.sources[name] = version, source
            self._assign(name, slot)
