"""`gyre bench inference`, part 5: what the server's event loop spends per generated token.

One `gyre inference` process serves `clients` concurrent non-streaming chat completions shaped as the
orchestrator's (log-probs and token ids of every token, a seed; through the official `openai` client),
`repeats` rounds. Measured: the CPU time of the server's main thread, where asyncio runs HTTP, request
validation, the hand-off of each token from the engine thread, the detokenizing and the log-prob entries of
the response, per generated token (`/proc/<pid>/task/<pid>/stat`, Linux). The engine runs in its own
thread, but both need the GIL: the event loop alone cannot carry more than 1e6 / (µs per token) tokens/s,
whatever the GPU decodes. CPU time, not wall time, so neighbours' load on a shared machine barely moves it.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gyre.inference_process import start_inference


@dataclass(frozen=True)
class ServingCost:
    clients: int
    tokens_per_s: float  # wall-clock generation rate of the best round
    loop_us_per_token: float  # event-loop CPU per generated token, best round

    @property
    def loop_ceiling(self) -> float:
        """Tokens/s the event loop could carry if it did nothing else."""
        return 1e6 / self.loop_us_per_token


def main_thread_cpu_s(pid: int) -> float | None:
    """CPU seconds of process `pid`'s main thread; None where /proc does not say. `schedstat` counts
    nanoseconds on the CPU; `stat`'s utime + stime (proc(5)) only clock ticks (10 ms), its fallback."""
    task = Path(f"/proc/{pid}/task/{pid}")
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serving_cost(model: Path, *, clients: int, max_tokens: int, threads: int, repeats: int) -> ServingCost | None:
    """Best of `repeats` rounds of `clients` concurrent chat requests; None where thread CPU is not readable."""
    from openai import AsyncOpenAI

    log_path = Path(tempfile.gettempdir()) / f"gyre-bench-serving-{os.getpid()}.log"
    args = ["--model.name", str(model), "--server.port", "0", "--control.port", "0", "--log.level", "WARNING",
            "--engine.threads", str(threads), "--engine.max-batch-size", str(clients)]  # fmt: skip
    server = start_inference(*args, log_path=log_path, timeout=600)
    pid = server.proc.pid
    try:

        async def run() -> ServingCost | None:
            async with AsyncOpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0, timeout=600) as client:
                model_id = (await client.models.list()).data[0].id

                async def one(i: int) -> int:
                    # the orchestrator's request (gyre_orchestrator.client): log-probs and token ids of every token
                    response = await client.chat.completions.create(
                        model=model_id, messages=[{"role": "user", "content": f"Reverse the text: request {i}"}],
                        max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=i, logprobs=True,
                        extra_body={"ignore_eos": True, "return_token_ids": True},
                    )  # fmt: skip
                    return response.usage.completion_tokens

                async def round_() -> tuple[float, float] | None:
                    before, started = main_thread_cpu_s(pid), time.perf_counter()
                    tokens = sum(await asyncio.gather(*(one(i) for i in range(clients))))
                    wall, after = time.perf_counter() - started, main_thread_cpu_s(pid)
                    if before is None or after is None:
                        return None
                    return tokens / wall, (after - before) / tokens * 1e6

                await round_()  # warm-up (first requests, caches)
                rounds = [await round_() for _ in range(repeats)]
                if any(r is None for r in rounds):
                    return None
                rate, cost = min(rounds, key=lambda r: r[1])
                return ServingCost(clients, rate, cost)

        return asyncio.run(run())
    finally:
        server.stop(timeout=60)
