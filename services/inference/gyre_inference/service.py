"""Wiring and lifecycle of one inference replica: HTTP (uvicorn) + gRPC control on one event loop.

Start-up order: bind both ports and answer at once (probes see "not ready" / NOT_SERVING while the
model loads), load the tokenizer and the backend, then flip readiness and print
`ready: http://HOST:PORT control: HOST:PORT version: N` (`gyre.inference_process.ready_line`).

SIGTERM/SIGINT (graceful, bounded by `server.shutdown_grace_s`): readiness and gRPC health go down,
uvicorn stops accepting connections and waits for in-flight requests (streams included) to finish,
gRPC stops with the same grace, then the backend stops. Requests still generating when the grace is over
end as on an engine that stopped: the backend is stopped then, so a request answers 503 `not_ready`
(which clients retry) and a stream ends with an error event; uvicorn's own deadline, CUT_S later, only
cancels what still runs after that. A second signal does not force anything beyond the grace.

An engine that stops on its own once ready (a weights load failed part way and loading the weights served before
back failed too, or the torch engine thread ended) makes the process exit 1 after the same shutdown: a replica up
but never ready again served nothing and was waited for for ever, while restarted (its pod; under `gyre rl`, by
`inference_restarts`) it comes back on the base
model and gets the newest version from the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from pathlib import Path

import uvicorn
from gyre.config.inference import InferenceConfig
from gyre.inference_process import ready_line
from gyre.net import bind_failure

from gyre_inference.api import AppState, create_app
from gyre_inference.api_key import ServerKey
from gyre_inference.backend import Backend
from gyre_inference.control import ControlServer
from gyre_inference.engine_stats import stats_line
from gyre_inference.lora_routes import runtime_updates_from_env
from gyre_inference.metrics import InferenceMetrics
from gyre_inference.serving import Serving

log = logging.getLogger(__name__)


def make_backend(config: InferenceConfig) -> Backend:
    engine, lora = config.engine, config.lora
    if config.runner == "pooling":
        from gyre_inference.classify import ClassifierBackend

        return ClassifierBackend(config.model.name, device=engine.device, dtype=config.model.dtype,
                                 max_model_len=engine.max_model_len, threads=engine.threads)  # fmt: skip
    if config.backend == "vllm":
        from gyre_inference.vllm_backend import VLLMBackend

        return VLLMBackend(config.model.name, dtype=config.model.dtype, max_model_len=engine.max_model_len,
                           seed=engine.seed, gpu_memory_utilization=engine.gpu_memory_utilization,
                           max_num_seqs=engine.max_batch_size, max_loras=lora.max_loras,
                           max_lora_rank=lora.max_rank, adapters=tuple(lora.adapters))  # fmt: skip
    from gyre_inference.torch_backend import TorchBackend

    return TorchBackend(config.model.name, device=engine.device, dtype=config.model.dtype,
                        max_batch_size=engine.max_batch_size, max_model_len=engine.max_model_len,
                        seed=engine.seed, threads=engine.threads, max_adapters=lora.max_loras,
                        max_lora_rank=lora.max_rank, adapters=tuple(lora.adapters), kv_cache_gb=engine.kv_cache_gb,
                        prefix_caching=engine.prefix_caching, overlap=engine.overlap,
                        capture_graphs_at_start=engine.capture_graphs_at_start)  # fmt: skip


class _HTTPServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service decides when and how to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def run_service(config: InferenceConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit status."""
    from gyre.transport import open_source

    from gyre_inference.text import ModelText

    backend = make_backend(config)
    model_id = config.served_model_name or config.model.name
    metrics = InferenceMetrics(config.run_id, backend)
    api_key = None
    if config.auth.api_key:  # from auth.api_key_file: read again when the Secret is rotated in place
        api_key = ServerKey(config.auth.api_key.get_secret_value(), lambda: config.auth.reread_secret("api_key"))
    token = None
    if config.auth.control_token:  # the same for the gRPC control server's token (the relay re-reads its own)
        token = ServerKey(config.auth.control_token.get_secret_value(),
                          lambda: config.auth.reread_secret("control_token"), name="auth.control_token")  # fmt: skip
    try:  # vLLM's switch for the runtime LoRA routes, an alias of lora.runtime_updates
        runtime_lora = config.lora.runtime_updates or runtime_updates_from_env()
    except ValueError as error:
        log.error("%s", error)
        return 1
    state = AppState(model_id, config.model.name, backend, metrics, api_key, serve_metrics=config.metrics.port is None,
                     max_request_bytes=config.server.max_request_bytes, runtime_lora=runtime_lora,
                     control_token=token)  # fmt: skip
    control = ControlServer(backend, metrics, model_id, token, source=open_source(config.weights))
    grace = config.server.shutdown_grace_s

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    sock = metrics_server = None
    # what is being bound: (host, its option, port, its option), for the error naming the one to change
    binding = (config.control.host, "control.host", config.control.port, "control.port")
    try:  # every port before anything serves: a failed bind stops what was started, and names the option
        control_port = await control.start(config.control.host, config.control.port)
        binding = (config.server.host, "server.host", config.server.port, "server.port")
        sock = _bind(config.server.host, config.server.port)
        if config.metrics.port is not None:
            from gyre.metrics import start_metrics_server

            # it was bound after uvicorn started: a busy port was a traceback, the gRPC server never stopped
            binding = (config.server.host, "server.host", config.metrics.port, "metrics.port")
            metrics_server, metrics_port = start_metrics_server(config.metrics.port, metrics.registry, binding[0])
            log.info("metrics: http://%s:%d/metrics", binding[0], metrics_port)
    except OSError as error:
        host, host_option, port, option = binding
        log.error("%s", bind_failure("inference", host, host_option, port, option, error.strerror or error))
        await control.stop(0)
        if sock is not None:
            sock.close()
        return 1
    http_port = sock.getsockname()[1]
    # http="auto": uvicorn's C parser httptools (a dependency) rather than pure-Python h11, whose parsing was a
    # sixth of the event loop's time at 256 requests in flight; h11 only where httptools is missing
    http = _HTTPServer(uvicorn.Config(create_app(state), log_config=None, access_log=False, lifespan="off",
                                      http="auto", timeout_keep_alive=config.server.keep_alive_s,
                                      timeout_graceful_shutdown=grace + CUT_S))  # fmt: skip
    http_task = asyncio.create_task(http.serve(sockets=[sock]))

    status = 0
    stats_task = None
    stopped = asyncio.create_task(stop.wait())
    log.info("loading %s with the %s backend", config.model.name, backend.name)
    loading = asyncio.create_task(_load(state, backend, config.model.name, ModelText))
    try:
        await asyncio.wait({loading, stopped, http_task}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done() and loading.exception() is None and not stop.is_set():
            # What loading built (torch, transformers, the model: millions of objects) lives as long as the process:
            # out of the garbage collector's sight, each full collection stops the event loop and the engine thread
            # for far less (vLLM does the same). Median event-loop CPU per token at 256 requests: 20.8 -> 17.1 us.
            gc.collect()
            gc.freeze()
            await control.set_serving(True)
            url, control_address = f"http://{config.server.host}:{http_port}", f"{config.control.host}:{control_port}"
            line = ready_line(url, control_address, backend.version)  # what launchers wait for
            if config.log.format == "text":  # in JSON mode the record below is the ready line (parse_ready reads it)
                print(line, flush=True)
            log.info("%s", line)
            if config.engine.log_stats_interval_s > 0 and backend.engine_stats() is not None:
                stats_task = asyncio.create_task(_log_engine_stats(backend, config.engine.log_stats_interval_s))
            engine_down = asyncio.create_task(_engine_stopped(backend))
            await asyncio.wait({stopped, http_task, engine_down}, return_when=asyncio.FIRST_COMPLETED)
            engine_down.cancel()
            if engine_down.done() and not engine_down.cancelled() and not stop.is_set():
                # up and never ready again, the replica served nothing and the relay waited for it for ever; exiting,
                # it is restarted (its pod; `gyre rl`: inference_restarts) on the base model and gets the newest version
                log.error("the %s engine stopped on its own (see the error above): exiting so that this replica is "
                          "restarted", backend.name)  # fmt: skip
                status = 1
        elif loading.done() and loading.exception() is not None:
            name = config.model.name
            # a relative folder that is not there reads as a hub id ("models/qwen"): say it was not found as either
            error = str(loading.exception()).strip() or type(loading.exception()).__name__
            if Path(name).expanduser().exists():
                log.error("cannot load model %s: %s", name, error)
            else:  # the hub client's first line only (the rest is its offline-mode advice): the message is one line
                log.error("cannot load model %s: no local folder %r, and as a Hugging Face hub id: %s", name, name,
                          error.splitlines()[0])  # fmt: skip
            status = 1
        if http_task.done() and http_task.exception() is not None:
            log.error("HTTP server failed: %s", http_task.exception())
            status = 1
    finally:
        log.info("shutting down (grace %.0fs)", grace)
        if stats_task is not None:
            stats_task.cancel()
        state.draining = True
        http.should_exit = True
        overdue = asyncio.create_task(_stop_generation_after(grace, http_task, backend)) if loading.done() else None
        await asyncio.gather(control.stop(grace), http_task, return_exceptions=True)
        if overdue is not None:
            overdue.cancel()
        if not loading.done():
            await asyncio.gather(loading, return_exceptions=True)  # a thread cannot be interrupted: let it end
        await backend.shutdown()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        stopped.cancel()
        log.info("stopped")
    return status


# After the grace, how long the requests the stopped engine ended have to send their 503 or error event before
# uvicorn cancels what is left (it answered a request it cancelled with a bare 500, cut a stream mid-chunk, and
# logged a traceback for each). The chart leaves 10 s between the grace and Kubernetes' kill.
CUT_S = 2.0


async def _stop_generation_after(grace: float, http_task: asyncio.Task, backend: Backend) -> None:
    """Once `grace` seconds pass with HTTP requests still in flight, stop the backend: every sequence still running
    or queued ends with BackendStoppedError (serving.py: a 503 `not_ready` with Retry-After, or a stream's error
    event), so the last answers are OpenAI errors that clients retry and the connections close on their own."""
    await asyncio.wait({http_task}, timeout=grace)
    if not http_task.done():
        running, waiting = backend.load_stats()
        log.warning("shutdown grace of %gs over with %d sequences running and %d waiting: stopping the engine, "
                    "their requests get 503 not_ready", grace, running, waiting)  # fmt: skip
        await backend.shutdown()


ENGINE_CHECK_S = 1.0  # how often a ready replica checks that its engine still runs


async def _engine_stopped(backend: Backend) -> None:
    """Returns once the backend is no longer ready: its engine stopped without being asked (the torch engine thread
    ended; either backend stops itself when a weights load failed part way and left weights of no version). Polled:
    the torch engine thread ends off the event loop."""
    while backend.ready:
        await asyncio.sleep(ENGINE_CHECK_S)


async def _log_engine_stats(backend: Backend, interval: float) -> None:
    """Every `interval` seconds, the engine's line for the interval (engine_stats.py), unless it was idle; when
    cancelled (shutdown), one line for the whole time it served (a run shorter than the interval gets one too)."""
    first = before = backend.engine_stats()
    started = then = time.monotonic()
    cpu_started = cpu_then = time.thread_time()  # this task runs on the event loop: its thread's CPU time
    try:
        while True:
            await asyncio.sleep(interval)
            now, at, cpu = backend.engine_stats(), time.monotonic(), time.thread_time()
            line = stats_line(now, before, at - then, cpu - cpu_then)
            if line is not None:
                log.info("%s", line)
            before, then, cpu_then = now, at, cpu
    finally:
        line = stats_line(backend.engine_stats(), first, time.monotonic() - started, time.thread_time() - cpu_started)
        if line is not None:
            log.info("%s", line.replace("engine:", "engine, whole run:", 1))


async def _load(state: AppState, backend: Backend, model_path: str, text_class) -> None:
    state.text = await asyncio.to_thread(text_class, model_path)
    await backend.start()
    state.serving = Serving(backend, state.text, state.model_id, state.metrics)
