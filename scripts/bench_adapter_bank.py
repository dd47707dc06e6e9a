"""Decode throughput of the torch backend with named adapters (multi-run), side by side in one run.

    .venv/bin/python scripts/bench_adapter_bank.py /tmp/adapter-bench [--rounds 5] [--model DIR --device cuda]

By default the tiny model on CPU, one thread; 32 sequences x 64 tokens: no adapter bank vs a bank (2 slots,
rank 16 on every projection) with every row on the base, every row on one adapter, and rows mixed over two
adapters and the base. Prints tokens/s and the ratio to no bank (docs/benchmarks.md, "Adapter bank cost").
On a GPU (`--device cuda`, bf16, CUDA graphs as the server runs them) pass a bigger model with `--model`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import peft
import torch
from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config, adapter_tensors
from gyre.model_init import init_model
from gyre.transport import FetchedWeights
from gyre_inference.backend import SamplingParams
from gyre_inference.torch_backend import TorchBackend
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(model: Path, folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    wrapped = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model), config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    folder.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter_tensors(wrapped.state_dict()).items()}, folder / ADAPTER_FILE)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(16, 32, 0.0, TARGETS, str(model))))


async def rate(engine: TorchBackend, names: list[str | None], n: int, tokens: int = 64) -> float:
    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=tokens, seed=i, adapter=names[i % len(names)])
        return len([e async for e in engine.generate([5 + i, 17, 33, 2], params)])

    await asyncio.gather(*(one(i) for i in range(4)))  # warm-up
    start = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(done) / (time.perf_counter() - start)


async def main(out: Path, rounds: int, model: Path | None, device: str, n: int) -> None:
    if model is None:
        model = out / "tiny"
        if not model.exists():
            init_model(model, preset="tiny", seed=0)
    write_adapter(model, out / "a1", 1)
    write_adapter(model, out / "a2", 2)
    engine = {"threads": 1, "max_batch_size": n, "device": device}
    plain = TorchBackend(model, **engine)
    bank = TorchBackend(model, **engine, max_adapters=2, max_lora_rank=16, adapters=("a", "b"))
    print(f"{model}: {plain.device}, {plain.dtype}, {n} sequences x 64 tokens", flush=True)
    await plain.start()
    await bank.start()
    await bank.update_adapter("a", FetchedWeights.local(out / "a1", 1))
    await bank.update_adapter("b", FetchedWeights.local(out / "a2", 1))
    cases = {"bank, base rows": [None], "all rows adapter a": ["a"], "mixed a/b/base": ["a", "b", None]}
    ratios: dict[str, list[float]] = {label: [] for label in cases}
    try:
        for _ in range(rounds):  # each round: the reference, then every case right after it
            base = await rate(plain, [None], n)
            line = [f"no bank {base:.0f} tok/s"]
            for label, names in cases.items():
                value = await rate(bank, names, n)
                ratios[label].append(value / base)
                line.append(f"{label} {value:.0f} ({value / base:.2f}x)")
            print(" | ".join(line), flush=True)
        print("medians: " + " | ".join(f"{k} {statistics.median(v):.2f}x" for k, v in ratios.items()))
    finally:
        await plain.shutdown()
        await bank.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, nargs="?", default=Path("/tmp/adapter-bench"), help="work folder")
    parser.add_argument("--rounds", type=int, default=5, help="side-by-side rounds")
    parser.add_argument("--model", type=Path, help="model folder (default: a tiny model in FOLDER)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (the torch backend's choice)")
    parser.add_argument("--sequences", type=int, default=32, help="concurrent sequences (the engine batch)")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(args.folder, args.rounds, args.model, args.device, args.sequences))
