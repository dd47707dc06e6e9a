"""`gyre bench inference`: throughput of the inference service and where a decode step's time goes.

    gyre bench inference                          # tiny model made on the fly, ~2 minutes on 2 CPU cores
    gyre bench inference --model outputs/run/model --clients 32 --max-tokens 64 --threads 2

1. Concurrency (real HTTP): a `gyre inference` process is started; the official `openai` client sends
   completions one at a time, then from `clients` concurrent clients, alternately `http_repeats` times (best
   of each). Ratio = aggregate tokens/s with `clients` clients / tokens/s of one client at a time (target
   >= 8x at 32 clients).
2. Engine vs transformers (in-process, same model, same device and dtype, same threads), for each batch
   size (`batch_sizes`, default `clients`): that many sequences of `prompt_tokens`-token prompts and
   `max_tokens` new tokens, sampled at T=1, through the torch backend and through `model.generate` on the
   same prompts, interleaved (best of `repeats` each). Ratio = ours / transformers (target >= 1.0 on CPU,
   >= 3 on a GPU). Per engine run: the decode step's split, device time (inside its CUDA graphs, by CUDA
   events; on CPU the forward and sampling) against host time (the rest of the step: scheduling, inputs,
   handing tokens to the event loop), and on CUDA the fraction of the memory-bound limit: a decode step
   must read every weight and every row's KV cache once, so batch B cannot beat
   B * bandwidth / (weight bytes + B * mean context * KV bytes per token) tokens/s (peak HBM bandwidth
   from a table by device name, e.g. H100 SXM 3.35 TB/s, H200 4.8 TB/s). Beside it (`overlap_compare`), the
   same engine with its overlapped decode loop switched the other way (off on CUDA, where it is on by
   default; forced on on CPU), interleaved in the same run: ratio = overlap on / off, with both step splits
   (overlapped, the host column is the host time the device waited for).
3. GRPO-shaped workload (`grpo`): the same batch as groups of `rollouts` sequences sharing one
   `grpo_prompt_tokens`-token prompt, prefix sharing on (each group's prompt computed once) and off
   (prefill per sequence), fresh prompts every run; tokens/s count generated tokens, prefill included.
4. Constrained vs free decoding (`constrained`): the batch of `clients` sequences through the torch
   backend free, every sequence constrained by a JSON schema (structured outputs: a grammar matcher per
   row, the batched mask each step), and half of them constrained (a mixed batch), interleaved. The
   schema's one string is longer than `max_tokens` can finish, so every run generates the same tokens.
   Ratio = constrained / free tokens/s (the cost of the masks), also per CPU-second of the process (the
   robust figure on a shared CPU machine, where wall time mostly measures the neighbours).
5. Serving cost (`serving_clients`, bench_serving.py): `serving_clients` concurrent non-streaming chat requests
   (the orchestrator's shape) through real HTTP; the CPU time of the server's event-loop thread per generated
   token, and the tokens/s the event loop alone could carry (it shares the GIL with the engine thread).
Every request ignores EOS so all runs generate exactly the same number of tokens.

GPU (0.6B Qwen3-shaped model, 128 new tokens; scripts/gpu/check.sh parts `inference` and `overlap`):

    gyre bench inference --model /path/to/model --batch-sizes 64,256 --max-tokens 128 --http false --repeats 3
    gyre bench inference --model /path/to/model --batch-sizes 64 --max-tokens 128 --http false --repeats 1 \
        --grpo false --constrained false --transformers-max-batch 0        # overlap on vs off only
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
from pydantic import Field, field_validator

from gyre_inference.bench_serving import serving_cost


class InferenceBenchConfig(GyreSettings):
    """Benchmark the inference service; each part prints ratios measured side by side in one run:
    (1) `clients` concurrent HTTP clients / one at a time; (2) the torch engine / `transformers.generate` per
    batch size, with the decode step's device/host split and, on CUDA, the fraction of the memory-bound limit;
    (3) a GRPO-shaped batch with prefix sharing on / off; (4) JSON-schema constrained / free decoding;
    (5) the server's event-loop CPU per generated token. Parts switch off with --http, --grpo, --constrained
    false and --serving-clients 0. docs/benchmarks.md explains every figure."""

    model: Path | None = Field(None, description="Model folder; default: a fresh `tiny` model in a temp dir.")
    clients: int = Field(32, ge=1, description="Concurrent clients (and the batch of the engine comparison).")
    requests_per_client: int = Field(2, ge=1, description="Requests each concurrent client sends.")
    sequential_requests: int = Field(6, ge=1, description="Requests sent one at a time for the baseline.")
    http_repeats: int = Field(3, ge=1, description="HTTP part: best of this many interleaved runs of the "
                              "baseline and of the concurrent clients each (one disturbed run does not set the "
                              "ratio).")  # fmt: skip
    prompt_tokens: int = Field(32, ge=1, description="Prompt length in tokens.")
    max_tokens: int = Field(64, ge=1, description="Generated tokens per request.")
    threads: int = Field(1, ge=1, description="torch threads of the server and of the engine comparison.")
    repeats: int = Field(5, ge=1, description="Engine comparison: best of this many interleaved runs each.")
    http: bool = Field(True, description="Run the HTTP concurrency part (false: only the engine comparison).")
    engine: bool = Field(True, description="Run the engine comparison (part 2, with the GRPO workload and the "
                         "overlap comparison).")  # fmt: skip
    batch_sizes: list[int] = Field(default_factory=list, description="Batch sizes of the engine comparison "
                                   "(comma-separated; default: clients).")  # fmt: skip
    grpo: bool = Field(True, description="Also run the GRPO-shaped workload, prefix sharing on vs off.")
    rollouts: int = Field(8, ge=1, description="GRPO workload: sequences sharing one prompt.")
    grpo_prompt_tokens: int = Field(256, ge=1, description="GRPO workload: prompt length in tokens.")
    transformers_max_batch: int = Field(256, ge=0, description="Largest batch also run through transformers "
                                       "(0: none).")  # fmt: skip
    overlap_compare: bool = Field(True, description="Also run the engine with its overlapped decode loop switched "
                                  "the other way (engine.overlap), side by side: ratio overlap on / off.")  # fmt: skip
    constrained: bool = Field(True, description="Also time structured-output (grammar-constrained) decoding.")
    serving_clients: int = Field(256, ge=0, description="Serving cost: concurrent non-streaming chat requests whose "
                                 "event-loop CPU per generated token is measured (0: skip).")  # fmt: skip

    @field_validator("batch_sizes", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return [int(part) for part in value.split(",") if part.strip()] if isinstance(value, str) else value


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
        rows, device, overlap = _engine_vs_transformers(model, config) if config.engine else ([], "", False)
        constrained = _constrained_vs_free(model, prompt, config) if config.constrained else []
        serving = None
        if config.serving_clients:
            serving = serving_cost(model, clients=config.serving_clients, max_tokens=config.max_tokens,
                                   threads=config.threads, repeats=config.http_repeats)  # fmt: skip
    print()
    if single is not None or rows or constrained:
        print(f"{'measure':<48}{'tokens/s':>10}{'limit':>8}{'step ms':>9}{'device':>8}{'host':>8}")
    if single is not None:
        print(f"{'HTTP, 1 client at a time':<48}{single:>10.0f}")
        print(f"{f'HTTP, {config.clients} concurrent clients':<48}{crowd:>10.0f}")
    for row in [*rows, *(row for row, _ in constrained)]:
        print(row.line())
    print()
    if single is not None:
        print(f"concurrency ratio ({config.clients} clients / 1):  {crowd / single:6.2f}x   (target >= 8)")
    target = "3" if device.startswith("cuda") else "1.0"
    by_name = {row.name: row for row in rows}
    for batch in (config.batch_sizes or [config.clients]) if config.engine else []:
        ours, theirs = by_name.get(f"torch engine, batch {batch}"), by_name.get(f"transformers.generate, batch {batch}")
        if ours and theirs:
            ratio = ours.rate / theirs.rate
            print(f"engine ratio, batch {batch} (ours / transformers): {ratio:6.2f}x   (target >= {target})")
        on, off = by_name.get(f"GRPO {batch}, prefix sharing on"), by_name.get(f"GRPO {batch}, prefix sharing off")
        if on and off:
            print(f"GRPO batch {batch}: prefix sharing on / off:      {on.rate / off.rate:6.2f}x")
        default, other = ours, by_name.get(f"torch engine, batch {batch}, overlap {'off' if overlap else 'on'}")
        if default and other:
            on, off = (default, other) if overlap else (other, default)
            print(
                f"overlap on / off, batch {batch}:             {on.rate / off.rate:6.2f}x   (step {on.step:.2f} vs "
                f"{off.step:.2f} ms, host not overlapped {on.step - on.device:.2f} vs {off.step - off.device:.2f})"
            )
    if constrained:
        (free, free_cpu), (every, every_cpu), (half, half_cpu) = [(row.rate, cpu) for row, cpu in constrained]
        print(f"constrained / free decoding:           {every / free:6.2f}x   (mixed batch: {half / free:.2f}x; "
              f"per CPU-second {every_cpu / free_cpu:.2f}x and {half_cpu / free_cpu:.2f}x)")  # fmt: skip
    if serving is not None:
        print(f"serving, {serving.clients} concurrent chat requests: {serving.tokens_per_s:.0f} tokens/s; event loop "
              f"{serving.loop_us_per_token:.1f} us CPU per token (alone it could carry {serving.loop_ceiling:.0f} "
              f"tokens/s)")  # fmt: skip
    elif config.serving_clients:
        print("serving cost: not measured (no per-thread CPU time in /proc on this system)")
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

                async def client_loop(requests: int) -> int:
                    return sum([await one() for _ in range(requests)])

                async def rate(clients: int, requests: int) -> float:
                    started = time.perf_counter()
                    tokens = sum(await asyncio.gather(*(client_loop(requests) for _ in range(clients))))
                    return tokens / (time.perf_counter() - started)

                await one()  # warm-up
                single = crowd = 0.0
                for _ in range(config.http_repeats):  # interleaved, best of each: a neighbour's burst hits one run
                    single = max(single, await rate(1, config.sequential_requests))
                    crowd = max(crowd, await rate(config.clients, config.requests_per_client))
                print(f"  1 client: {single:.0f} tokens/s, {config.clients} clients: {crowd:.0f} tokens/s "
                      f"(best of {config.http_repeats} each)", flush=True)  # fmt: skip
                return single, crowd

        return asyncio.run(run())
    finally:
        server.stop(timeout=60)


class _Row:
    """One measured run: tokens/s and, for the engine, the decode step's split."""

    def __init__(self, name: str, rate: float, limit: float | None = None, stats=None):
        self.name, self.rate, self.limit = name, rate, limit
        self.step = self.device = None
        if stats is not None and stats.decode_steps:
            self.step = stats.decode_seconds / stats.decode_steps * 1e3
            self.device = stats.device_seconds / stats.decode_steps * 1e3

    def line(self) -> str:
        limit = f"{self.rate / self.limit:>8.1%}" if self.limit else f"{'':>8}"
        split = f"{self.step:>9.2f}{self.device:>8.2f}{self.step - self.device:>8.2f}" if self.step else ""
        return f"{self.name:<48}{self.rate:>10.0f}{limit}{split}"


def _engine_vs_transformers(model: Path, config: InferenceBenchConfig) -> tuple[list[_Row], str, bool]:
    """The measured rows, on the device and dtype the torch backend picks (CUDA bf16 when there is a GPU,
    else CPU fp32), that device, and whether the engine's overlapped loop is on by default there."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from gyre_inference.backend import SamplingParams
    from gyre_inference.model_runner import kv_bytes_per_token
    from gyre_inference.torch_backend import TorchBackend

    torch.set_num_threads(config.threads)
    batches, new = config.batch_sizes or [config.clients], config.max_tokens
    probe = AutoModelForCausalLM.from_pretrained(model, dtype="auto")
    per_token = kv_bytes_per_token(probe.config, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    longest = max(config.prompt_tokens, config.grpo_prompt_tokens) + new + 16
    cache_gb = max(batches) * longest * per_token * 1.25 / 2**30  # every sequence of the largest batch at once
    vocab = probe.config.vocab_size
    del probe
    backend = TorchBackend(model, threads=config.threads, max_batch_size=max(batches), kv_cache_gb=cache_gb)
    device, dtype = backend.device, backend.dtype
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = peak_bandwidth(name) if device.type == "cuda" else None
    print(f"  device {name}, {dtype}, weights {weight_bytes / 1e9:.3f} GB, KV {per_token / 1024:.0f} KiB/token"
          + (f", peak bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "")
          + f"; overlapped decode loop {'on' if backend.overlap else 'off'} by default", flush=True)  # fmt: skip
    overlap = backend.overlap
    fresh = iter(range(1, 1 << 30))

    def prompts(count: int, length: int) -> list[list[int]]:
        """`count` prompts nobody saw before (no prefix-cache hits across runs)."""
        return [[(7 * i + 13 * next(fresh)) % (min(vocab, 1000) - 5) + 5 for i in range(length)] for _ in range(count)]

    def limit(batch: int, prompt_tokens: int) -> float | None:
        context = prompt_tokens + new / 2
        return batch * bandwidth / (weight_bytes + batch * context * per_token) if bandwidth else None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def theirs_once(batch: int) -> float:
        ids = torch.tensor(prompts(batch, config.prompt_tokens), device=device)
        sync()
        started = time.perf_counter()
        with torch.inference_mode():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                     pad_token_id=0)  # fmt: skip
        sync()
        return (out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - started)

    async def ours_once(batch_prompts: list[list[int]], sharing: bool = True):
        backend._batch.prefix_caching = sharing
        before = dataclasses.replace(backend.stats)

        async def sequence(prompt: list[int], seed: int) -> int:
            params = SamplingParams(max_tokens=new, seed=seed)
            return len([e async for e in backend.generate(prompt, params)])

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(sequence(p, i) for i, p in enumerate(batch_prompts))))
        rate = tokens / (time.perf_counter() - started)
        after = backend.stats
        delta = dataclasses.replace(after, **{f.name: getattr(after, f.name) - getattr(before, f.name)
                                              for f in dataclasses.fields(after)})  # fmt: skip
        return rate, delta

    def best(runs):
        return max(runs, key=lambda run: run[0])

    async def compare() -> list[_Row]:
        rows = []
        await backend.start()
        try:
            for batch in batches:
                with_theirs = batch <= config.transformers_max_batch
                await ours_once(prompts(batch, config.prompt_tokens))  # warm-up (captures the CUDA graphs)
                if with_theirs:
                    theirs_once(batch)
                ours, switched, theirs = [], [], []
                for _ in range(config.repeats):  # interleaved, so load from elsewhere hits both alike
                    ours.append(await ours_once(prompts(batch, config.prompt_tokens)))
                    if config.overlap_compare:  # the engine thread reads the switch at its next iteration
                        backend.overlap = not overlap
                        switched.append(await ours_once(prompts(batch, config.prompt_tokens)))
                        backend.overlap = overlap
                    if with_theirs:
                        theirs.append(theirs_once(batch))
                rate, stats = best(ours)
                rows.append(_Row(f"torch engine, batch {batch}", rate, limit(batch, config.prompt_tokens), stats))
                if switched:
                    label = f"torch engine, batch {batch}, overlap {'off' if overlap else 'on'}"
                    rate_switched, stats_switched = best(switched)
                    rows.append(_Row(label, rate_switched, limit(batch, config.prompt_tokens), stats_switched))
                if with_theirs:
                    rows.append(_Row(f"transformers.generate, batch {batch}", max(theirs)))
                print(f"  batch {batch}: engine {rate:.0f} tokens/s" +
                      (f", overlap {'off' if overlap else 'on'} {rate_switched:.0f}" if switched else "") +
                      (f", transformers.generate {max(theirs):.0f}" if with_theirs else ""), flush=True)  # fmt: skip
                if config.grpo and batch >= config.rollouts:
                    groups = batch // config.rollouts
                    for sharing in (True, False):
                        runs = []
                        for _ in range(max(1, config.repeats - 1)):
                            group_prompts = prompts(groups, config.grpo_prompt_tokens)
                            runs.append(await ours_once([p for p in group_prompts for _ in range(config.rollouts)],
                                                        sharing))  # fmt: skip
                        rate, stats = best(runs)
                        label = f"GRPO {batch}, prefix sharing {'on' if sharing else 'off'}"
                        rows.append(_Row(label, rate, limit(batch, config.grpo_prompt_tokens), stats))
                        print(f"  {label}: {rate:.0f} tokens/s, {stats.prefilled} prompt tokens computed", flush=True)
            return rows
        finally:
            await backend.shutdown()

    return asyncio.run(compare()), str(device), overlap


def _constrained_vs_free(model: Path, prompt: list[int], config: InferenceBenchConfig) -> list[tuple[_Row, float]]:
    """(row, tokens per CPU-second of this process) of the torch backend on one batch: free, every row constrained
    by a JSON schema, half of the rows constrained."""
    from gyre_inference.backend import SamplingParams
    from gyre_inference.structured import Guide
    from gyre_inference.text import ModelText
    from gyre_inference.torch_backend import TorchBackend

    batch, new = config.clients, config.max_tokens
    # one string field longer than `new` tokens can write: no row finishes early, so all runs make batch x new tokens
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 64 * new}},
              "required": ["text"], "additionalProperties": False}  # fmt: skip
    guide = Guide("json", schema)
    grammars = ModelText(model).grammars
    backend = TorchBackend(model, threads=config.threads, max_batch_size=batch)

    async def rate(constrained_rows: int) -> tuple[float, float]:
        def params(row: int) -> SamplingParams:
            constraint = grammars.matcher(guide) if row < constrained_rows else None
            return SamplingParams(max_tokens=new, seed=row, guide=guide if constraint else None, constraint=constraint)

        async def sequence(row: int) -> int:
            return len([e async for e in backend.generate(prompt, params(row))])

        started, cpu = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(sequence(row) for row in range(batch))))
        return tokens / (time.perf_counter() - started), tokens / (time.process_time() - cpu)

    async def compare() -> list[tuple[float, float]]:
        await backend.start()
        try:
            await rate(batch)  # warm-up
            runs: list[list[tuple[float, float]]] = [[], [], []]
            for _ in range(config.repeats):  # interleaved, so load from elsewhere hits all alike
                for rates, rows in zip(runs, (0, batch, batch // 2), strict=True):
                    rates.append(await rate(rows))
            return [(max(w for w, _ in rates), max(c for _, c in rates)) for rates in runs]
        finally:
            await backend.shutdown()

    labels = ("free", "JSON-constrained", "half constrained")
    result = asyncio.run(compare())
    print("  " + ", ".join(f"{label}: {wall:.0f} tokens/s ({cpu:.0f} per CPU-second)"
                           for label, (wall, cpu) in zip(labels, result, strict=True)), flush=True)  # fmt: skip
    return [(_Row(f"torch engine, batch {batch}, {label}", wall), cpu)
            for label, (wall, cpu) in zip(labels, result, strict=True)]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
