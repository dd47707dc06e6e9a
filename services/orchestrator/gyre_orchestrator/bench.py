"""`gyre bench orchestrator`: what the orchestrator costs per sample when inference costs nothing.

    gyre bench orchestrator                                     # echo backend, reverse_text
    gyre bench orchestrator --steps 10 --batch-size 32 --max-tokens 128
    gyre bench orchestrator --real-model outputs/run/model      # also one real tiny-model replica

The whole orchestrator runs as in production (`OrchestratorService`: environment, OpenAI client,
scheduler, scoring, advantages, packing, codec, Redis stream, events, metrics) against an *echo*
backend: a separate process that answers `/v1/chat/completions` at once with the reversed prompt
(byte-level "token ids", log-probs, policy versions) and serves a minimal InferenceControl. The echo
backend exists only for this measurement. Reported, from the orchestrator process only:
- CPU seconds per sample (`time.process_time`, every thread of the process) and samples/s;
- the share spent building batches (advantages + packing + encoding + XADD);
- with `--real-model`, the same run against a real `gyre inference` replica, and the ratio of the
  orchestrator's CPU per sample to the real wall time per sample.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from gyre.config import GyreSettings, load_config, parse_or_exit
from gyre.config.orchestrator import OrchestratorConfig
from gyre.events import ORCHESTRATOR_STEPS, events_dir, read_events
from gyre.inference_process import InferenceProcess, ready_line, start_inference
from gyre.net import free_port
from gyre.redis_server import EmbeddedRedis
from pydantic import Field

END_TOKEN = 2  # <|im_end|> of the built-in tokenizer


class OrchestratorBenchConfig(GyreSettings):
    """Benchmark orchestrator overhead per sample against an instant echo backend."""

    env: str = Field("reverse_text", description="Environment (single-turn ones make the echo answer sensible).")
    steps: int = Field(6, ge=1, description="Batches pushed per run (the first is a warm-up, not timed).")
    batch_size: int = Field(16, ge=1, description="Tasks per step.")
    rollouts_per_example: int = Field(8, ge=2, description="Samples per task.")
    max_tokens: int = Field(64, ge=1, description="Completion tokens the echo backend returns at most.")
    concurrency: int = Field(64, ge=1, description="inference.max_concurrency.")
    real_model: str | None = Field(None, description="Also run against a real `gyre inference` of this model.")


# ---- the echo backend (separate process) -------------------------------------------------------
def _echo_reply(body: dict) -> dict:
    messages = body.get("messages") or []
    text = "".join(str(m.get("content") or "") for m in messages)
    last_user = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    answer = last_user[::-1][: max(1, int(body.get("max_tokens") or 16) - 1)]
    prompt_ids = [1] + [3 + b for b in text.encode()[:512]]
    completion_ids = [3 + b for b in answer.encode()][: int(body.get("max_tokens") or 16) - 1] + [END_TOKEN]
    logprobs = [{"token": "x", "logprob": -0.1, "bytes": None, "top_logprobs": []} for _ in completion_ids]
    return {
        "id": "echo",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "echo",
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": answer},
                "logprobs": {"content": logprobs},
                "token_ids": completion_ids,
                "policy_version_min": 0,
                "policy_version_max": 0,
            }
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids), "total_tokens": 0},
    }


async def _echo_app(scope, receive, send):  # a bare ASGI app: the cheapest server uvicorn can run
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    status = 200
    if scope["path"] == "/v1/models":
        reply = {"object": "list", "data": [{"id": "echo", "object": "model", "created": 0, "owned_by": "gyre"}]}
    elif not scope["path"].endswith("/completions"):  # no tokenizer: /tokenize, /detokenize
        status, reply = 404, {"error": {"message": f"no route {scope['path']}", "type": "not_found"}}
    else:
        reply = _echo_reply(json.loads(body or b"{}"))
    data = json.dumps(reply).encode()
    headers = [(b"content-type", b"application/json"), (b"x-gyre-policy-version", b"0")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def serve_echo(http_port: int, control_port: int) -> None:
    """Run the echo backend (HTTP + InferenceControl) until SIGTERM."""
    import grpc
    import uvicorn
    from gyre.v1 import inference_pb2, inference_pb2_grpc

    class Control(inference_pb2_grpc.InferenceControlServicer):
        async def GetStatus(self, request, context):  # noqa: N802
            return inference_pb2.GetInferenceStatusResponse(model="echo", step=0, backend="echo", ready=True)

        async def UpdateWeights(self, request, context):  # noqa: N802
            return inference_pb2.UpdateWeightsResponse(step=request.step)

    async def main():
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceControlServicer_to_server(Control(), server)
        server.add_insecure_port(f"127.0.0.1:{control_port}")
        await server.start()
        config = uvicorn.Config(_echo_app, host="127.0.0.1", port=http_port, log_level="warning", access_log=False)
        http = uvicorn.Server(config)
        serving = asyncio.create_task(http.serve())
        while not http.started and not serving.done():
            await asyncio.sleep(0.05)
        print(ready_line(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{control_port}", 0), flush=True)
        await serving

    asyncio.run(main())


# ---- the measurement ---------------------------------------------------------------------------
def _start_backend(kind: str, model: str | None, log_path: Path) -> InferenceProcess:
    """The echo backend, or a real `gyre inference` of `model`; both print the replica's ready line."""
    if kind == "echo":
        http, control = free_port(), free_port()
        code = f"from gyre_orchestrator.bench import serve_echo; serve_echo({http}, {control})"
        return start_inference(log_path=log_path, name="echo", argv=[sys.executable, "-c", code], timeout=120)
    return start_inference("--model.name", str(model), "--server.port", "0", "--control.port", "0",
                           "--log.level", "WARNING", log_path=log_path, timeout=300)  # fmt: skip


async def _measure(cfg: OrchestratorConfig) -> dict:
    from gyre_orchestrator.service import OrchestratorService

    service = OrchestratorService(cfg)
    try:
        await service.start()
        warm = await service.scheduler.next_batch()  # connections, caches, first-call costs
        await service.push(warm)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await service.loop()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await service.close()
    steps = read_events(events_dir(cfg.output_dir) / ORCHESTRATOR_STEPS)[1:]
    samples = sum(e["num_samples"] for e in steps)
    return {
        "samples": samples,
        "samples_per_s": samples / wall,
        "cpu_ms_per_sample": 1000 * cpu / samples,
        "wall_ms_per_sample": 1000 * wall / samples,
        "build_share": sum(e["build_seconds"] for e in steps) / wall,
        "tokens_per_sample": sum(e["num_tokens"] for e in steps) / samples,
    }


def run(bench: OrchestratorBenchConfig, kind: str, redis_url: str, root: Path) -> dict:
    backend = _start_backend(kind, bench.real_model, root / f"{kind}.log")
    url, control = backend.url, backend.control
    try:
        cfg = load_config(
            OrchestratorConfig,
            [],
            run_id=f"bench-{kind}",
            output_dir=str(root / kind),
            redis={"url": redis_url},
            env={"name": bench.env},
            batch_size=bench.batch_size,
            rollouts_per_example=bench.rollouts_per_example,
            max_steps=bench.steps,
            max_async_level=bench.steps + 1,  # no trainer here: never wait for weights
            sampling={"max_tokens": bench.max_tokens},
            advantage={"drop_zero_signal": False},
            inference={"urls": [url], "control_urls": [control], "max_concurrency": bench.concurrency},
            server={"port": 0},
            metrics={"port": 0},
            final_weights_timeout_s=0,
            log={"level": "WARNING"},
        )
        return asyncio.run(_measure(cfg))
    finally:
        backend.stop(timeout=30)


def main(argv: list[str]) -> int:
    bench = parse_or_exit(OrchestratorBenchConfig, argv, "gyre bench orchestrator", OrchestratorBenchConfig.__doc__)
    from gyre.envs import load_environment
    from gyre.model_source import ModelUnavailable, check_model_source

    try:  # before Redis and a backend start: an unknown name was a traceback from inside the first run
        load_environment(bench.env)
    except Exception as e:  # EnvironmentLoadError, or the environment's own checks
        print(f"gyre bench orchestrator: error: config key 'env': {e}", file=sys.stderr)
        return 2
    try:
        if bench.real_model:
            check_model_source(bench.real_model, key="real_model", hint="give a model folder or hub id")
    except ModelUnavailable as e:
        print(f"gyre bench orchestrator: error: {e}", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.WARNING)
    kinds = ["echo"] + (["real"] if bench.real_model else [])
    with tempfile.TemporaryDirectory(prefix="gyre-bench-orch-") as tmp, EmbeddedRedis() as redis_server:
        results = {kind: run(bench, kind, redis_server.url, Path(tmp)) for kind in kinds}
    n = bench.batch_size * bench.rollouts_per_example
    print(f"gyre bench orchestrator: env={bench.env}, {bench.steps - 1} timed steps x {n} samples, "
          f"max_tokens={bench.max_tokens}, concurrency={bench.concurrency}")  # fmt: skip
    rows = [
        ("samples/s", "samples_per_s", "{:.1f}"),
        ("orchestrator CPU ms / sample", "cpu_ms_per_sample", "{:.2f}"),
        ("wall ms / sample", "wall_ms_per_sample", "{:.2f}"),
        ("batch building share of wall", "build_share", "{:.1%}"),
        ("tokens / sample", "tokens_per_sample", "{:.0f}"),
    ]
    print(f"{'':32}" + "".join(f"{kind:>12}" for kind in kinds))
    for label, key, fmt in rows:
        print(f"{label:32}" + "".join(f"{fmt.format(results[k][key]):>12}" for k in kinds))
    if "real" in results:
        ratio = results["echo"]["cpu_ms_per_sample"] / results["real"]["wall_ms_per_sample"]
        print(f"orchestrator CPU per sample / real generation time per sample: {ratio:.1%}")
    return 0
