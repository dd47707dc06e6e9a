"""`gyre bench inference`: throughput of the inference service, two ratios from one run.

    gyre bench inference                          # tiny model made on the fly, ~2 minutes on 2 CPU cores
    gyre bench inference --model outputs/run/model --clients 32 --max-tokens 64 --threads 2

1. Concurrency (real HTTP): a `gyre inference` process is started; the official `openai` client sends
   completions one at a time, then from `clients` concurrent clients. Ratio = aggregate tokens/s with
   `clients` clients / tokens/s of one client at a time (target >= 8x at 32 clients).
2. Engine vs transformers (in-process, same model, same device and dtype, same threads):
   `clients` sequences of the same prompt length and `max_tokens` new tokens, sampled at T=1, through
   the torch backend and through `model.generate` on the same batch. Ratio = ours / transformers
   (target >= 1.0 on CPU, >= 3 on a GPU).
   On CUDA it also prints the fraction of the memory-bound limit: a decode step must read every
   weight once, so batch B cannot beat B * bandwidth / weight_bytes tokens/s (peak HBM bandwidth
   from a table by device name, e.g. H100 SXM 3.35 TB/s, H200 4.8 TB/s).
Every request ignores EOS so all runs generate exactly the same number of tokens.

GPU, the issue-14 figure (0.6B Qwen3-shaped model, batch 64, 128 new tokens):

    gyre bench inference --model /path/to/model --clients 64 --max-tokens 128 --http false
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from gyre.config import GyreSettings, parse_or_exit
from gyre.inference_process import start_inference
from pydantic import Field


class InferenceBenchConfig(GyreSettings):
    """Benchmark the inference service (see the module docstring)."""

    model: Path | None = Field(None, description="Model folder; default: a fresh `tiny` model in a temp dir.")
    clients: int = Field(32, ge=1, description="Concurrent clients (and the batch of the engine comparison).")
    requests_per_client: int = Field(2, ge=1, description="Requests each concurrent client sends.")
    sequential_requests: int = Field(6, ge=1, description="Requests sent one at a time for the baseline.")
    prompt_tokens: int = Field(32, ge=1, description="Prompt length in tokens.")
    max_tokens: int = Field(64, ge=1, description="Generated tokens per request.")
    threads: int = Field(1, ge=1, description="torch threads of the server and of the engine comparison.")
    repeats: int = Field(5, ge=1, description="Engine comparison: best of this many interleaved runs each.")
    http: bool = Field(True, description="Run the HTTP concurrency part (false: only the engine comparison).")


# Peak HBM bandwidth (bytes/s) by device name, most specific first: the memory-bound limit's denominator.
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM (HBM3)
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("B200", 8.0e12),
)


def peak_bandwidth(device_name: str) -> float | None:
    return next((bandwidth for name, bandwidth in PEAK_BANDWIDTH if name in device_name), None)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_or_exit(InferenceBenchConfig, None if argv is None else list(argv), "gyre bench inference")
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as scratch:
        model = config.model
        if model is None:
            from gyre.model_init import init_model

            model = init_model(Path(scratch) / "model", preset="tiny", seed=0)
        prompt = [(7 * i + 3) % 900 + 5 for i in range(config.prompt_tokens)]
        print(f"model {model}, prompt {config.prompt_tokens} tokens, {config.max_tokens} new tokens, "
              f"{config.threads} thread(s)", flush=True)  # fmt: skip
        single, crowd = _http_throughput(model, prompt, config) if config.http else (None, None)
        ours, theirs, device, limit = _engine_vs_transformers(model, prompt, config)
    print()
    print(f"{'measure':<44}{'tokens/s':>12}")
    if single is not None:
        print(f"{'HTTP, 1 client at a time':<44}{single:>12.0f}")
        print(f"{f'HTTP, {config.clients} concurrent clients':<44}{crowd:>12.0f}")
    print(f"{f'torch backend, batch {config.clients} ({device})':<44}{ours:>12.0f}")
    print(f"{f'transformers.generate, batch {config.clients} ({device})':<44}{theirs:>12.0f}")
    if limit is not None:
        print(f"{'memory-bound limit (weights read once/step)':<44}{limit:>12.0f}")
    print()
    if single is not None:
        print(f"concurrency ratio ({config.clients} clients / 1):  {crowd / single:6.2f}x   (target >= 8)")
    target = "3" if device.startswith("cuda") else "1.0"
    print(f"engine ratio (ours / transformers):    {ours / theirs:6.2f}x   (target >= {target})")
    if limit is not None:
        print(f"fraction of the memory-bound limit:    {ours / limit:6.1%}")
    return 0


def _http_throughput(model: Path, prompt: list[int], config: InferenceBenchConfig) -> tuple[float, float]:
    from openai import AsyncOpenAI

    log_path = Path(tempfile.gettempdir()) / f"gyre-bench-inference-{os.getpid()}.log"
    args = ["--model.name", str(model), "--server.port", "0", "--control.port", "0", "--log.level", "WARNING"]
    args += ["--engine.threads", str(config.threads), "--engine.max-batch-size", str(max(64, config.clients))]
    server = start_inference(*args, log_path=log_path, timeout=600)
    url = server.url
    try:

        async def run() -> tuple[float, float]:
            async with AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600) as client:
                model_id = (await client.models.list()).data[0].id

                async def one() -> int:
                    response = await client.completions.create(
                        model=model_id, prompt=prompt, max_tokens=config.max_tokens, temperature=1.0,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    return response.usage.completion_tokens

                await one()  # warm-up
                started = time.perf_counter()
                tokens = 0
                for _ in range(config.sequential_requests):
                    tokens += await one()
                single = tokens / (time.perf_counter() - started)
                print(f"  1 client: {single:.0f} tokens/s", flush=True)

                async def client_loop() -> int:
                    return sum([await one() for _ in range(config.requests_per_client)])

                started = time.perf_counter()
                tokens = sum(await asyncio.gather(*(client_loop() for _ in range(config.clients))))
                crowd = tokens / (time.perf_counter() - started)
                print(f"  {config.clients} clients: {crowd:.0f} tokens/s", flush=True)
                return single, crowd

        return asyncio.run(run())
    finally:
        server.stop(timeout=60)


def _engine_vs_transformers(
    model: Path, prompt: list[int], config: InferenceBenchConfig
) -> tuple[float, float, str, float | None]:
    """(ours tokens/s, transformers tokens/s, device, memory-bound limit tokens/s or None) on the
    device and dtype the torch backend picks (CUDA bf16 when there is a GPU, else CPU fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gyre_inference.backend import SamplingParams
    from gyre_inference.torch_backend import TorchBackend

    torch.set_num_threads(config.threads)
    batch, new = config.clients, config.max_tokens
    backend = TorchBackend(model, threads=config.threads, max_batch_size=batch)
    device, dtype = backend.device, backend.dtype
    # The reference runs on the SAME device and dtype as the engine.
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt] * batch, device=device)
    weight_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = peak_bandwidth(name) if device.type == "cuda" else None
    limit = batch * bandwidth / weight_bytes if bandwidth else None
    print(f"  device {name}, {dtype}, weights {weight_bytes / 1e9:.3f} GB"
          + (f", peak bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""), flush=True)  # fmt: skip

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def theirs_once() -> float:
        sync()
        started = time.perf_counter()
        with torch.inference_mode():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                     pad_token_id=0)  # fmt: skip
        sync()
        return (out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - started)

    async def ours_once() -> float:
        async def sequence(seed: int) -> int:
            return len([e async for e in backend.generate(prompt, SamplingParams(max_tokens=new, seed=seed))])

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(sequence(i) for i in range(batch))))
        return tokens / (time.perf_counter() - started)

    async def compare() -> tuple[float, float]:
        await backend.start()
        try:
            await ours_once()  # warm-up both (captures the CUDA graphs)
            theirs_once()
            ours_rates, theirs_rates = [], []
            for _ in range(config.repeats):  # interleaved, so load from elsewhere hits both alike
                ours_rates.append(await ours_once())
                theirs_rates.append(theirs_once())
            return max(ours_rates), max(theirs_rates)
        finally:
            await backend.shutdown()

    ours_rate, theirs_rate = asyncio.run(compare())
    print(f"  torch backend: {ours_rate:.0f} tokens/s, transformers.generate: {theirs_rate:.0f} tokens/s", flush=True)
    return ours_rate, theirs_rate, str(device), limit


if __name__ == "__main__":
    raise SystemExit(main())
