"""Helpers of the trainer-core tests: random samples and TrainBatch layouts (import, not fixtures)."""

from __future__ import annotations

import numpy as np
from gyre.batch import MicroBatch, TrainBatch


def random_samples(rng: np.random.Generator, lengths, vocab_size: int = 1024) -> list[dict]:
    """Samples with a prompt (not in the loss), a completion (in the loss), one advantage per sample."""
    samples = []
    for i, length in enumerate(lengths):
        prompt = max(1, length // 3)
        samples.append(
            {
                "input_ids": rng.integers(3, vocab_size, length),
                "loss_mask": np.arange(length) >= prompt,
                "advantages": np.full(length, rng.normal(), dtype=np.float32),
                "inference_logprobs": (-rng.uniform(0.5, 8.0, length)).astype(np.float32),
                "sample_index": i,
            }
        )
    return samples


def make_batch(samples: list[dict], layout: list[list[list[int]]], step: int = 1) -> TrainBatch:
    """A TrainBatch whose rank r, micro-batch i packs samples `layout[r][i]` (global normalisers set)."""
    micro_batches = [[MicroBatch.from_samples([samples[j] for j in row]) for row in rank] for rank in layout]
    return TrainBatch(
        step=step,
        micro_batches=micro_batches,
        samples=[{"reward": 0.0} for _ in samples],
        num_loss_tokens=int(sum(np.count_nonzero(s["loss_mask"]) for s in samples)),
        num_samples=len(samples),
    ).validate()


def set_behaviour_logprobs(
    model, samples: list[dict], noise: float, rng: np.random.Generator, offset=0.0, temperature=1.0
) -> None:
    """inference_logprobs = the model's own log-probs (each sample alone, at `temperature`) − offset + N(0, noise)
    on loss tokens.

    noise = offset = 0 reproduces "identical weights on both sides" (r = 1 up to float64 rounding).
    """
    import torch
    from gyre_trainer.model import packed_logprobs

    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(s["input_ids"], dtype=torch.long)
            lp, _ = packed_logprobs(model, ids, torch.arange(len(ids)), [len(ids)], temperature)
            jitter = rng.normal(0.0, noise, len(ids)) if noise else 0.0
            s["inference_logprobs"] = np.where(s["loss_mask"], lp.numpy() - offset + jitter, 0.0).astype(np.float32)


def flat_grad(model):
    import torch

    return torch.cat([p.grad.flatten() for p in model.parameters()])


def dp_worker(rank: int, world_size: int, init_file: str, model_dir: str, samples, layout, loss_cfg, out_file: str):
    """One data-parallel rank over gloo: its share of the gradient, averaged over ranks like FSDP2/DDP do."""
    import torch
    import torch.distributed as dist
    from gyre.config.shared import ModelConfig
    from gyre_trainer.model import load_model
    from gyre_trainer.step import compute_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = load_model(ModelConfig(name=model_dir), "cpu", torch.float64)
        batch = make_batch(samples, layout)
        metrics = compute_gradients(model, batch, loss_cfg=loss_cfg, rank=rank, world_size=world_size)
        grad = flat_grad(model)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # gloo has no AVG; FSDP2 averages
        grad /= world_size
        if rank == 0:
            torch.save({"grad": grad, "metrics": metrics}, out_file)
        # ranks leave together: a gloo rank torn down while the other still runs can abort at exit (SIGABRT,
        # "terminate called without an active exception"), as the trainer service once did
        dist.barrier()
    finally:
        dist.destroy_process_group()
