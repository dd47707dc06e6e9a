"""`gyre eval`: one evaluation of whatever policy the replicas serve, its result printed and appended to eval.jsonl.

The command around `gyre_orchestrator.evaluate`: its settings checked before anything connects (environments,
replicas, eval tasks, judges), the wait for the policy's server (`wait_for_inference`), the progress bar on a
terminal (`EvalProgress`) and the one-line errors. Its own module, apart from the evaluation itself, which a
training run's evals (`gyre_orchestrator.training_eval`) share.

    gyre eval --env.name reverse_text --inference.urls '["http://127.0.0.1:8000"]' --eval.num-examples 16
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

from gyre.config.loader import reveal
from gyre.endpoint import READY_LOG_S, READY_POLL_S
from gyre.envs import ContextLengthExceeded

from gyre_orchestrator.evaluate import EvalFailed, eval_plan, eval_tasks, evaluate_envs, mix_record, mix_shares

log = logging.getLogger(__name__)

#: `gyre eval`'s bound on one `/v1/models` question while waiting for the policy's server (a frozen one never answers)
READY_PROBE_S = 10.0


class EvalProgress:
    """`gyre eval`'s progress bar over the samples (tasks x k), on a terminal only: a log file or a pipe gets
    nothing but the final JSON line (a bar redrawn with carriage returns is noise there)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="eval", unit="sample", file=self.stream, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


async def wait_for_inference(client, limit_s: float, *, poll_s: float = READY_POLL_S, log_s: float = READY_LOG_S):
    """`gyre eval`'s first step (`inference.startup_timeout_s`): return once a replica answers `/v1/models` (a
    model still loading is waited for), asking every `poll_s` for up to `limit_s`, saying every `log_s` that it
    waits; `InferenceError` past it, and at once for what no wait mends: a 4xx (a key, a URL) or a host name that
    does not resolve. Without it `gyre eval` against a wrong port retried each sample with growing cooldowns,
    logging replica failures for many minutes, and never said what it waited for."""
    import openai
    from gyre.endpoint import describe, unknown_host

    from gyre_orchestrator.client import BadResponse, InferenceError

    start = time.monotonic()
    logged: float | None = None
    reason = "no replica is known yet (inference.urls / discovery)"
    while True:
        for replica in list(client.replicas):
            remaining = limit_s - (time.monotonic() - start)
            sent = client.api_key
            try:
                async with asyncio.timeout(max(min(client.timeout_s, READY_PROBE_S, remaining), 0.1)):
                    await client.served_model(replica)
                    await client.check_model(replica)  # a model it does not serve: every sample a 404
                if logged is not None:
                    log.info("inference is up: %s", replica.url)
                return
            except openai.APIStatusError as e:
                try:
                    if client.rekey(e.status_code, sent):  # a rotated key: asked again (once: then it is the same)
                        continue
                except ValueError as reread:  # the key file can no longer be read
                    raise InferenceError(f"{replica.url}/v1/models refused the request: {e.status_code}; re-reading "
                                         f"the key: {reread}") from None  # fmt: skip
                if e.status_code < 500 and e.status_code not in (408, 409, 429):  # 409: vLLM's model still loading
                    raise InferenceError(f"{replica.url}/v1/models refused the request: {e.status_code} {describe(e)} "
                                         "(check inference.urls, and inference.api_key or api_key_file)"
                                         ) from None  # fmt: skip
                reason = f"{replica.url}: {e.status_code} {describe(e)}"
            except (openai.APIError, BadResponse, TimeoutError, OSError) as e:
                if unknown_host(e):  # a typo: a Service's name resolves before its pods run
                    raise InferenceError(f"{replica.url}: the host name does not resolve (inference.urls)") from None
                reason = f"{replica.url}: {'no answer' if isinstance(e, TimeoutError) else describe(e)}"
        elapsed = time.monotonic() - start
        if elapsed >= limit_s:
            raise InferenceError(f"no replica answered /v1/models within {limit_s:g}s (last: {reason})")
        if logged is None or elapsed - logged >= log_s:
            log.info("%s inference (%s): %.0fs of %gs", "waiting for" if logged is None else "still waiting for",
                     reason, elapsed, limit_s)  # fmt: skip
            logged = elapsed
        await asyncio.sleep(min(poll_s, limit_s - elapsed))


async def _run_once(
    cfg, progress: Callable[[int, int], None] | None = None, envs=None, signals: dict | None = None
) -> dict:
    """One evaluation of every environment of `cfg` (label -> environment in `envs`, loaded when None); returns the
    `eval.jsonl` line it appended."""
    from gyre.config.endpoint import EVAL_STARTUP_TIMEOUT_S
    from gyre.envs import load_environment
    from gyre.envs.judge import add_to_rubric, held_by
    from gyre.events import EVAL, EventLog, events_dir

    from gyre_orchestrator.client import InferenceClient, close_replica_clients
    from gyre_orchestrator.replicas import ReplicaSet, make_discovery

    plan = eval_plan(cfg)
    envs = envs if envs is not None else {e.key: load_environment(e.name, **e.args) for e in cfg.envs
                                          if e.key in plan}  # fmt: skip
    if signals is None:
        signals = {}
        for env in envs.values():  # scored as in training
            signals = add_to_rubric(env, cfg.judges, cfg.reward_models, signals=signals or None)
    # and the judges the environments' own code made (a ported verifiers JudgeRubric's): waited for alike, up to
    # gyre eval's bound as a configured judge without its own startup_timeout_s
    held = held_by(envs, signals)
    for judge in held.values():
        if "startup_timeout_s" not in judge.config.model_fields_set:
            judge.config.startup_timeout_s = EVAL_STARTUP_TIMEOUT_S
    signals = {**signals, **held}
    replicas = ReplicaSet(cooldown_s=cfg.inference.failure_cooldown_s)
    discovery = make_discovery(cfg.inference, replicas)
    await discovery.start()
    client = InferenceClient(
        replicas,
        model=cfg.inference.model,
        api_key=reveal(cfg.inference.api_key),
        reread_key=lambda: cfg.inference.reread_secret("api_key"),  # a Secret rotated in place
        max_concurrency=cfg.inference.max_concurrency,
        timeout_s=cfg.inference.timeout_s,
        retries=cfg.inference.retries,
    )
    try:
        from gyre.endpoint import wait_all_ready

        if cfg.inference.startup_timeout_s:  # the policy's server, then the judges'
            await wait_for_inference(client, cfg.inference.startup_timeout_s)
        await wait_all_ready(signal.endpoint for signal in signals.values())  # a judge still loading its model
        results = await evaluate_envs(
            envs,
            client,
            plan,
            pass_threshold=cfg.eval.pass_threshold,
            progress=progress,
        )
    finally:
        for env in envs.values():
            aclose = getattr(env, "aclose", None)  # environments holding servers (verifiers) release them
            if aclose is not None:
                await aclose()
        for signal in signals.values():
            await signal.aclose()
        await discovery.stop()
        await close_replica_clients(list(replicas))
    record = mix_record(results, mix_shares(cfg), min(r.min_version for r in results.values()))
    with EventLog(events_dir(cfg.output_dir) / EVAL) as events:
        events.append(record)
    return record


def main(argv: list[str]) -> int:
    """`gyre eval`: one evaluation of the served policy; prints the result as JSON."""
    from gyre.config import parse_or_exit
    from gyre.config.orchestrator import GyreEvalConfig
    from gyre.logging import setup_logging

    summary = (
        "Evaluate the served model once on the environment's held-out split (env, inference, eval.*); print avg@k "
        "and pass@k as JSON and append them to {output_dir}/events/eval.jsonl. A progress bar over the samples shows "
        "on a terminal (stderr), nothing else when the output is a log or a pipe."
    )
    cfg = parse_or_exit(GyreEvalConfig, argv, "gyre eval", summary)
    setup_logging(cfg.log.level, cfg.log.file, "eval", cfg.log.format)
    if cfg.log.level != "DEBUG":  # the openai client's HTTP stack logs a line per request at INFO
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    from gyre.endpoint import EndpointError
    from gyre.envs import load_environment

    from gyre_orchestrator.client import InferenceError

    envs = {}
    plan = eval_plan(cfg, warn=True)
    for i, entry in enumerate(cfg.envs):
        key = f"env.{i}" if isinstance(cfg.env, list) else "env"
        if entry.key not in plan:  # eval.enabled = false: not evaluated, not loaded
            continue
        try:  # before anything connects: an unknown name or bad env.args was a traceback (exit 1)
            envs[entry.key] = load_environment(entry.name, **entry.args)
        except Exception as e:  # EnvironmentLoadError, or the environment's own argument checks
            print(f"gyre eval: error: config key '{key}': {e}", file=sys.stderr)
            return 2
    from gyre.envs.judge import add_to_rubric

    from gyre_orchestrator.replicas import ReplicaSet, make_discovery

    try:  # an inference.urls entry that is no URL (vLLM's host:port), a discovery without its name: a traceback
        make_discovery(cfg.inference, ReplicaSet())  # made, not started: nothing connects
    except ValueError as e:
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 2
    try:  # no eval tasks (an empty split, a num_eval the task space cannot hold): before anything connects
        for label, env in envs.items():
            eval_tasks(env, plan[label].num_examples, label, plan[label].key)
    except ValueError as e:
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 2
    try:  # a judge's missing API key: one line naming the judge and the setting, as gyre orchestrator (a traceback)
        signals: dict = {}
        for env in envs.values():  # a mix's entries share them
            signals = add_to_rubric(env, cfg.judges, cfg.reward_models, signals=signals or None)
    except ValueError as e:
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 2
    progress = EvalProgress()  # a long eval showed nothing until its JSON line
    try:
        record = asyncio.run(_run_once(cfg, progress, envs, signals))
    except EndpointError as e:  # a judge or reward model that never came up, or refused the key: one line
        progress.close()
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 1
    except (InferenceError, ContextLengthExceeded, EvalFailed) as e:  # nothing serves, no task fits, a sample
        # failed every attempt: one line, no traceback; it names the replica (the Python list of inference.urls in
        # front of it said nothing more, and named the default URL under dns or kubernetes discovery)
        progress.close()
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(json.dumps(record))
    return 0
