"""`gyre_inference_*` metrics: what traffic does to them, promtool-clean exposition, separate metrics port."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

EXPECTED = {
    "gyre_inference_requests": "counter",
    "gyre_inference_prompt_tokens": "counter",
    "gyre_inference_generation_tokens": "counter",
    "gyre_inference_time_to_first_token_seconds": "histogram",
    "gyre_inference_request_latency_seconds": "histogram",
    "gyre_inference_running_requests": "gauge",
    "gyre_inference_waiting_requests": "gauge",
    "gyre_inference_policy_version": "gauge",
    "gyre_inference_weight_update_seconds": "histogram",
    "gyre_inference_weight_updates": "counter",
    "gyre_inference_engine_seconds": "counter",
    "gyre_inference_engine_decode_steps": "counter",
    "gyre_inference_engine_prompt_tokens": "counter",
    "gyre_inference_engine_preemptions": "counter",
    "gyre_inference_kv_cache_usage_ratio": "gauge",
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels) -> float:
    return samples(text).get((name, tuple(sorted({"run_id": "api-tests", **labels}.items()))), 0.0)


def test_traffic_moves_the_counters_and_histograms(server, client, model_id):
    before = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(before)}
    assert {name: families.get(name) for name in EXPECTED} == EXPECTED
    response = client.completions.create(model=model_id, prompt=[5, 6, 7, 8], max_tokens=6, n=2,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    list(client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    after = httpx.get(f"{server.url}/metrics").text
    assert response.usage.completion_tokens == 12
    delta = [
        value(after, name, **labels) - value(before, name, **labels)
        for name, labels in [
            ("gyre_inference_requests_total", {"endpoint": "completions", "outcome": "success"}),
            ("gyre_inference_requests_total", {"endpoint": "chat", "outcome": "success"}),
            ("gyre_inference_prompt_tokens_total", {}),
            ("gyre_inference_generation_tokens_total", {}),
            ("gyre_inference_time_to_first_token_seconds_count", {}),
            ("gyre_inference_request_latency_seconds_count", {"endpoint": "chat"}),
        ]
    ]
    chat = {"messages": [{"role": "user", "content": "x"}]}
    chat_prompt = len(httpx.post(f"{server.url}/tokenize", json=chat).json()["tokens"])
    assert delta == [1, 1, 4 + chat_prompt, 12 + 3, 2, 1]
    assert value(after, "gyre_inference_running_requests") == 0 and value(after, "gyre_inference_policy_version") == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_exposition(server, client, model_id):
    client.completions.create(model=model_id, prompt="hi", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


def test_a_separate_metrics_port(start_server):
    from gyre.net import free_port

    port = free_port()
    server = start_server("--metrics.port", str(port), "--run-id", "metrics-port")
    try:
        assert httpx.get(f"{server.url}/metrics").status_code == 404  # not on the API port any more
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'gyre_inference_policy_version{run_id="metrics-port"} 0.0' in text
    finally:
        assert server.stop() == 0


def test_the_engine_series_say_where_prompts_and_time_went(server, client, model_id):
    prompt = [(7 * i + 3) % 200 + 5 for i in range(40)]  # 2 full KV blocks of 16 and a partial one
    before = httpx.get(f"{server.url}/metrics").text
    client.completions.create(model=model_id, prompt=prompt, max_tokens=5, n=4, extra_body={"ignore_eos": True})
    client.completions.create(model=model_id, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    after = httpx.get(f"{server.url}/metrics").text

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    # the 4 choices share one prefill; the second request finds the 2 full blocks in the prefix cache
    assert moved("gyre_inference_engine_prompt_tokens_total", source="computed") == 40 + 40 - 32
    assert moved("gyre_inference_engine_prompt_tokens_total", source="cached") == 3 * 40 + 32
    assert moved("gyre_inference_engine_decode_steps_total") >= 4 + 4  # the first token comes from the prefill
    for phase in ("decode", "device", "prefill"):
        assert moved("gyre_inference_engine_seconds_total", phase=phase) > 0, phase
    assert moved("gyre_inference_engine_seconds_total", phase="capture") == 0  # no CUDA graphs on a CPU
    assert 0 <= value(after, "gyre_inference_kv_cache_usage_ratio") < 1


def wait_for_log(server, condition, timeout_s: float = 60.0) -> None:
    """Wait until `condition(the server's log text)` holds: an engine line is written at the first interval tick
    after what it counts, later on a loaded machine than any fixed wait after the work."""
    deadline = time.monotonic() + timeout_s
    while not condition(server.log_path.read_text()):
        assert server.proc.poll() is None and time.monotonic() < deadline, server.tail()
        time.sleep(0.05)


def decode_steps_logged(log: str) -> int:
    return sum(int(m[1]) for m in re.finditer(r"engine: .*\| decode (\d+) steps of", log))


def test_the_engine_logs_a_line_of_statistics_while_it_works(start_server):
    server = start_server("--engine.log-stats-interval-s", "0.2", "--log.level", "INFO", "--run-id", "stats-line")
    try:
        from openai import OpenAI

        with OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            c.completions.create(model=server.model_name, prompt=[5, 6, 7, 8] * 10, max_tokens=64, n=4,
                                 extra_body={"ignore_eos": True})  # fmt: skip
        wait_for_log(server, lambda log: decode_steps_logged(log) >= 63)  # every step of the work is on a line
        time.sleep(1.0)  # idle intervals after it (5), in which nothing more may be logged
    finally:
        assert server.stop() == 0
    log = server.log_path.read_text().splitlines()
    lines = [line for line in log if "engine: " in line]
    assert lines, server.tail()
    # and at shutdown one line for the whole time it served: the 4 choices' 64 tokens each
    assert sum("engine, whole run: " in line and "decode 63 steps of 4 rows" in line for line in log) == 1
    busy = [line for line in lines if "generation 0 tokens/s" not in line]
    assert busy and all("running" in line and "KV cache" in line for line in lines)
    assert any("decode " in line and "ms each" in line for line in busy)
    assert any("% from the prefix cache" in line and "prefill 1 call," in line for line in busy)  # n=4: one prefill
    # the event loop's share of its thread's CPU: present on every line, a percentage
    assert all(re.search(r"\| event loop \d+% busy$", line) for line in lines), lines
    # an idle engine logs nothing: the lines stop once the work is done (5 intervals of sleep, at most one line)
    assert len(lines) <= len(busy) + 1


def test_preemptions_under_kv_block_pressure_are_counted_and_logged(start_server):
    """A KV cache of 12 blocks of 16 tokens and 4 requests growing to 7 blocks each: rows are preempted (and
    finish anyway). Preemptions recompute, so they cost time, and nothing said so: no series, nothing in the
    engine's line (vLLM counts them, num_preemptions, and warns)."""
    from openai import OpenAI

    blocks = 12 * 16 * 4096 / 2**30  # the tiny model's keys and values take 4096 bytes a token
    server = start_server("--engine.kv-cache-gb", str(blocks), "--engine.log-stats-interval-s", "0.2",
                          "--run-id", "preemptions")  # fmt: skip
    try:
        with OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
            done = c.completions.create(model=server.model_name, prompt=[[5 + i, 6, 7, 8] * 5 for i in range(4)],
                                        max_tokens=90, extra_body={"ignore_eos": True})  # fmt: skip
        assert [choice.finish_reason for choice in done.choices] == ["length"] * 4
        metrics = httpx.get(f"{server.url}/metrics").text
        assert samples(metrics)[("gyre_inference_engine_preemptions_total", (("run_id", "preemptions"),))] > 0
        # the interval's line that counts them (its tick comes after the work, late on a loaded machine)
        wait_for_log(server, lambda log: re.search(r"\| preempted \d+ rows? \(KV cache full\)", log))
    finally:
        assert server.stop() == 0
    assert re.search(r"\| preempted \d+ rows? \(KV cache full\)", server.log_path.read_text()), server.tail()


@pytest.mark.asyncio
async def test_queued_requests_whose_clients_went_away_leave_the_waiting_count_at_once(start_server, tmp_path):
    """Two rows, both busy with long streams; 12 more requests queue, then their clients give up (timeouts, closed
    streams). They stayed counted as waiting (gauge, GetStatus) until the engine came to them, and kept an adapter
    slot busy meanwhile; vLLM drops an aborted request from its waiting queue."""
    from gyre.model_init import init_model
    from openai import AsyncOpenAI

    # the rows must stay busy for the whole test: on a loaded 2-core machine 1000 tokens of the tiny model (1024
    # positions) ended before the 12 requests had queued, and the queue drained into the freed rows. The same shape
    # with 16384 positions: the long streams outlast the test (they are cancelled at its end)
    model = init_model(tmp_path / "long-tiny", max_position_embeddings=16384)
    server = start_server("--engine.max-batch-size", "2", "--engine.max-model-len", "16384",
                          "--run-id", "gone-while-queued", model_path=model)  # fmt: skip

    def waiting() -> tuple[float, int]:
        scraped = samples(httpx.get(f"{server.url}/metrics").text)
        return scraped[("gyre_inference_waiting_requests", (("run_id", "gone-while-queued"),))], server.status().waiting

    async with AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
        long = dict(model=server.model_name, max_tokens=16000, extra_body={"ignore_eos": True})

        async def stream(prompt, **kwargs):
            async for _ in await client.completions.create(prompt=prompt, stream=True, **kwargs):
                pass

        running = [asyncio.create_task(stream([5 + i, 6], **long)) for i in range(2)]
        while server.status().running < 2:
            await asyncio.sleep(0.05)
        queued = [asyncio.create_task(stream([7, i], model=server.model_name, max_tokens=5)) for i in range(6)]
        queued += [asyncio.create_task(client.completions.create(prompt=[8, i], model=server.model_name, max_tokens=5))
                   for i in range(6)]  # fmt: skip
        deadline = time.monotonic() + 60
        while waiting() != (12, 12) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert waiting() == (12, 12)
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        # at once, not when the long streams end: waited for while both still run (a fixed 2 s deadline was short on
        # a loaded machine, where the long streams last longer too), with a deadline for a count that never drops
        deadline = time.monotonic() + 60
        while waiting() != (0, 0) and server.status().running == 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert waiting() == (0, 0) and server.status().running == 2
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


def test_a_non_streaming_requests_time_to_first_token_is_when_its_first_token_was_sampled(server, client, model_id):
    # its tokens reach the event loop in one piece at the end (SamplingParams.final_only), yet the time to first
    # token is the first token's, not the end's
    before = httpx.get(f"{server.url}/metrics").text
    client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=120, extra_body={"ignore_eos": True})
    after = httpx.get(f"{server.url}/metrics").text

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    first_token = moved("gyre_inference_time_to_first_token_seconds_sum")
    latency = moved("gyre_inference_request_latency_seconds_sum", endpoint="completions")
    assert moved("gyre_inference_time_to_first_token_seconds_count") == 1
    assert 0 < first_token < latency / 2, (first_token, latency)
