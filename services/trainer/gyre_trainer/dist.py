"""Process topology for the trainer: one process, or `torchrun --nproc-per-node N` with FSDP2.

The same code runs in both cases; `DistContext` says which. Under torchrun the environment carries
`RANK`, `WORLD_SIZE`, `LOCAL_RANK` (and the rendezvous address); the backend is NCCL for CUDA and
gloo on CPU, which is how the tests exercise the sharded paths on a laptop.

Control traffic (the batch bytes rank 0 reads from Redis, stop/wait signals, small metric gathers)
always goes through a gloo group on CPU tensors, also when the model trains over NCCL: it is a few
MB per step and must never wait behind (or deadlock with) the model's collectives.

Invariants:
- every collective helper here must be called by every rank, in the same order;
- `full_state_dict` returns the whole unsharded state dict on rank 0 and `{}` elsewhere.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Rank 0 may block on Redis for a long time (a missing step is waited for); the other ranks wait in
# a broadcast meanwhile. Rank 0 sends a heartbeat every poll, so this is only a dead-peer timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: `rank` of `world_size`, training on `device`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control_group: object | None = None  # gloo group for control messages (None: default group or single process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistContext:
    """Join the torchrun process group when launched by torchrun, else a single-process context."""
    from gyre_trainer.model import resolve_device

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world_size == 1:
        return DistContext(device=dev)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=dev if dev.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if dev.type == "cuda" else None
    log.info("rank %d of %d on %s (backend %s)", rank, world_size, dev, dist.get_backend())
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, control_group=control)


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python and torch RNGs; in deterministic mode also force deterministic kernels.

    Deterministic mode is what makes "crash + resume" reproduce an uninterrupted run bit for bit
    (same thread count assumed: CPU reductions are only reproducible for a fixed number of threads).
    """
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        if torch.backends.cudnn.is_available():
            torch.backends.cudnn.benchmark = False


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm, lm_head).

    Per-layer units let FSDP2 all-gather one layer's parameters at a time (and prefetch the next),
    so peak memory is one full layer plus the shards. A no-op in a single process.
    """
    if not ctx.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (`model.model.layers` for Llama/Qwen/Mistral)."""
    if hasattr(model, "get_base_model"):  # a peft (LoRA) wrapper: the blocks are the base model's
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: no `model.layers` to shard; only decoder-only HF models are supported"
        )
    return list(layers)


# one process: the host copies `full_state_dict` returns, per model, reused from one step to the next
_HOST_COPIES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def full_state_dict(model: torch.nn.Module, ctx: DistContext, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded parameters as CPU tensors on rank 0 (`{}` on the others). Collective when sharded.
    `trainable_only`: without the frozen parameters (a LoRA adapter alone, not its base model's GBs).

    On one process the host tensors are the same from call to call (pinned when the model is on a GPU):
    a step's copy is then the transfer alone, without faulting in fresh host memory (a fresh copy of
    1.19 GB took 1.0 s on an H100 host). They hold the values of the latest call: use them before the next.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if ctx.distributed:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        return get_model_state_dict(model, options=options)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad} if trainable_only else set()
    copies = _HOST_COPIES.setdefault(model, {})
    state, on_gpu = {}, False
    for name, value in model.state_dict().items():
        if name in frozen:
            continue
        value = value.detach()
        on_gpu |= value.is_cuda
        host = copies.get(name)
        if host is None or host.shape != value.shape or host.dtype != value.dtype:
            host = copies[name] = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
        state[name] = host.copy_(value, non_blocking=value.is_cuda)
    if on_gpu:
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return state


def load_full_state_dict(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, trainable_only: bool = False
) -> None:
    """Load unsharded tensors (every rank passes the same dict) into a plain or FSDP2-sharded model.

    Missing keys are only tolerated for tied weights (e.g. `lm_head.weight` when it is the embedding) and,
    with `trainable_only`, for frozen parameters (LoRA adapters restored onto the base they train on).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    result = set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))
    tolerated = set(_tied_parameter_names(model))
    if trainable_only:
        tolerated |= {name for name, param in model.named_parameters() if not param.requires_grad}
        tolerated |= {name for name, _ in model.named_buffers()}
    missing = [k for k in result.missing_keys if k not in tolerated]
    if missing or result.unexpected_keys:
        raise ValueError(f"state dict does not fit the model: missing {missing}, unexpected {result.unexpected_keys}")


def _tied_parameter_names(model: torch.nn.Module) -> list[str]:
    names = getattr(model, "_tied_weights_keys", None) or []
    return list(names.keys()) if isinstance(names, dict) else list(names)


# ---- control messages (gloo, CPU tensors) -------------------------------------------------------


def broadcast_bytes(data: bytes | None, ctx: DistContext, header: tuple[int, int] = (0, 0)) -> tuple[int, int, bytes]:
    """Send `(kind, step)` and `data` from rank 0 to every rank; returns them on every rank.

    Rank 0 passes the bytes (or None for an empty message); the others pass None.
    """
    if not ctx.distributed:
        return header[0], header[1], data or b""
    size = len(data) if ctx.is_main and data else 0
    head = torch.tensor([header[0], header[1], size] if ctx.is_main else [0, 0, 0], dtype=torch.int64)
    dist.broadcast(head, src=0, group=ctx.control_group)
    kind, step, size = (int(x) for x in head)
    if size == 0:
        return kind, step, b""
    if ctx.is_main:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=ctx.control_group)
    return kind, step, data if ctx.is_main else buf.numpy().tobytes()


def gather_floats(values: list[float], ctx: DistContext) -> list[list[float]]:
    """Every rank's `values` (same length on all ranks), indexed by rank; available on every rank."""
    if not ctx.distributed:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(out, mine, group=ctx.control_group)
    return [t.tolist() for t in out]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier(group=ctx.control_group)


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's picklable `obj` on every rank (small things only: paths, plans, flags)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]
