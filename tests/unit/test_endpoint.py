"""`gyre.endpoint.Endpoint` (judges, reward models, the teacher) over real HTTP with the official openai client,
against the scripted OpenAI-compatible server of tests/support/judge_server.py: which refusals are one request's
(`RequestRefused`: the caller may skip that sample) and which stop the run (`EndpointError`)."""

from __future__ import annotations

import asyncio

import pytest
from gyre.config.endpoint import EndpointConfig
from gyre.endpoint import MAX_REFUSED_IN_A_ROW, Endpoint, EndpointError, RequestRefused
from support.judge_server import ScriptedServer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def scripted():
    with ScriptedServer() as server:
        yield server


def endpoint(server, **settings) -> Endpoint:
    return Endpoint(EndpointConfig(url=server.url, model="judge-model", **settings), name="teacher")


def refusal(server, client: Endpoint, status: int) -> EndpointError:
    """What one request answered with `status` raises (asserting it names the status)."""

    async def scenario():
        server.script[:] = [("status", status)]
        with pytest.raises(EndpointError, match=f"refused the request: {status}") as raised:
            await client.chat(MESSAGES)
        await client.aclose()
        return raised.value

    return asyncio.run(scenario())


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_request_refused_for_what_it_holds_is_request_refused(scripted, status):
    """A 400/413/422 (a sample too long for the context, a token out of vocabulary) is that request's: the
    teacher skips the sample, a judge scores it as failed-to-judge. Before, every 4xx was the same EndpointError
    and stopped the run."""
    client = endpoint(scripted)
    error = refusal(scripted, client, status)
    assert isinstance(error, RequestRefused) and error.status == status
    assert client.stats["refused"] == 1 and client.stats["failures"] == 1 and client.stats["retries"] == 0


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_refusal_of_the_setup_stops_the_run(scripted, status):
    """A key, a permission, a model or URL not found: every request would be refused; never skipped."""
    client = endpoint(scripted)
    assert not isinstance(refusal(scripted, client, status), RequestRefused) and client.stats["refused"] == 0


def test_refusals_in_a_row_are_the_configurations_fault(scripted):
    """A server that refuses every request (a judge asking for structured output the server does not serve, a
    teacher of a shorter context than every sample) would skip every sample: after MAX_REFUSED_IN_A_ROW refusals
    with no answer between them the refusal is an EndpointError that stops the run. An answer resets the count."""
    client = endpoint(scripted)

    async def scenario():
        scripted.script[:] = (
            [("status", 400)] * (MAX_REFUSED_IN_A_ROW - 1) + ["ok"] + [("status", 400)] * (MAX_REFUSED_IN_A_ROW)
        )
        for _ in range(MAX_REFUSED_IN_A_ROW - 1):
            with pytest.raises(RequestRefused):
                await client.chat(MESSAGES)
        await client.chat(MESSAGES)
        for _ in range(MAX_REFUSED_IN_A_ROW - 1):
            with pytest.raises(RequestRefused):
                await client.chat(MESSAGES)
        with pytest.raises(EndpointError, match=f"{MAX_REFUSED_IN_A_ROW} requests refused in a row") as last:
            await client.chat(MESSAGES)
        await client.aclose()
        return last.value

    assert not isinstance(asyncio.run(scenario()), RequestRefused)


def test_a_missing_key_names_the_endpoint_and_the_setting(tmp_path):
    """Several judges and a teacher each name a key: the error says whose (it named only the setting)."""
    config = EndpointConfig(url="http://127.0.0.1:9", api_key_env="GYRE_TEST_KEY_NOT_SET")
    with pytest.raises(ValueError, match="^judge 'style': api_key_env: the environment variable GYRE_TEST_KEY_NOT"):
        Endpoint(config, name="judge 'style'")
    config = EndpointConfig(url="http://127.0.0.1:9", api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="^teacher: api_key_file: cannot read"):
        Endpoint(config, name="teacher")


def test_a_rate_limit_is_waited_out_as_the_server_asks(scripted):
    """A hosted judge's 429 says when its window opens (Retry-After): it was retried within our own backoff
    (here 10 ms), every retry spent in a moment, the sample failed and, after sample_attempts, the run."""
    import time

    client = endpoint(scripted, retries=1)
    client.backoff_s = 0.01

    async def scenario():
        scripted.script[:] = [("status", 429, {"retry-after": "1"}), "ok"]
        start = time.monotonic()
        await client.chat(MESSAGES)
        await client.aclose()
        return time.monotonic() - start

    assert asyncio.run(scenario()) >= 0.95 and client.stats["retries"] == 1 and client.stats["ok"] == 1


@pytest.mark.parametrize("url", ["judge:8000", "localhost:8000/v1", "api.openai.com/v1"])
def test_a_url_without_a_scheme_is_refused_naming_the_key(url):
    """It was accepted, and every call failed as a retried 'Connection error.' that named no setting."""
    from gyre.config import ConfigError, load_config
    from gyre.config.orchestrator import OrchestratorConfig

    with pytest.raises(ConfigError, match=r"teacher\.url.*not an http\(s\) URL"):
        load_config(OrchestratorConfig, [], teacher={"url": url})


def test_other_forms_of_a_refused_request_count_once_toward_the_refusals_in_a_row(scripted):
    """The teacher asks a refused sample again in two other forms (echo, one token shorter): three refusals of one
    sample counted as three, so 6 samples too long for a teacher in a row stopped the run as a configuration error.
    Refused samples are what is counted."""
    client = endpoint(scripted)

    async def scenario():
        scripted.script[:] = [("status", 400)] * (3 * (MAX_REFUSED_IN_A_ROW - 1))
        for _ in range(MAX_REFUSED_IN_A_ROW - 1):
            for again in (False, True, True):
                with pytest.raises(RequestRefused):
                    await client.post("/v1/chat/completions", {"messages": MESSAGES}, again=again)
        await client.aclose()

    asyncio.run(scenario())
    assert client.stats["refused"] == 3 * (MAX_REFUSED_IN_A_ROW - 1)


def test_an_empty_key_file_is_refused_at_start(tmp_path):
    """An empty mounted Secret was read as no key: every call went out without one, and the run stopped on the
    first 401 (or, on a server without auth, ran with a key the user thought was sent)."""
    key = tmp_path / "key"
    key.write_text("\n")
    with pytest.raises(ValueError, match=f"^judge 'style': api_key_file: {key} is empty"):
        Endpoint(EndpointConfig(url="http://127.0.0.1:9", api_key_file=str(key)), name="judge 'style'")


@pytest.mark.parametrize("status", [408, 409])
def test_a_proxy_timeout_or_conflict_is_retried(scripted, status):
    """408 Request Timeout (a proxy in front of the judge) and 409 are retried, as the openai client itself does;
    they were refusals of the setup that stopped the run."""
    client = endpoint(scripted, retries=1)
    client.backoff_s = 0.01

    async def scenario():
        scripted.script[:] = [("status", status), "ok"]
        answer = await client.chat(MESSAGES)
        await client.aclose()
        return answer

    assert asyncio.run(scenario())["choices"][0]["message"]["content"] == "ok"
    assert client.stats["retries"] == 1 and client.stats["errors"] == 1 and client.stats["failures"] == 0


def test_a_check_answered_with_broken_json_or_too_slowly_is_an_endpoint_error(scripted):
    """`post_once` (the teacher's check before the run) let the decoder's ValueError through, and waited on a server
    trickling its answer for as long as it trickled: it raises EndpointError, naming the server, within timeout_s."""
    import time

    client = endpoint(scripted, timeout_s=0.5)

    async def scenario():
        scripted.script[:] = [("raw", '{"tokens": [1,', "application/json"), ("trickle", 5, "ok")]
        with pytest.raises(EndpointError, match="JSONDecodeError"):
            await client.post_once("/v1/chat/completions", {"model": "judge-model", "messages": MESSAGES})
        start = time.monotonic()
        with pytest.raises(EndpointError, match="TimeoutError"):
            await client.post_once("/v1/chat/completions", {"model": "judge-model", "messages": MESSAGES})
        await client.aclose()
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 3


def test_the_backoff_between_attempts_is_bounded(scripted, monkeypatch):
    """The jittered exponential backoff had no ceiling: with retries = 20 the sleep before the last attempt was up
    to 0.5 * 2**19 s (three days), a hung run. Each is at most MAX_BACKOFF_S (here made 50 ms)."""
    import time

    import gyre.endpoint

    monkeypatch.setattr(gyre.endpoint, "MAX_BACKOFF_S", 0.05)
    client = endpoint(scripted, retries=3)
    client.backoff_s = 1000.0  # every uncapped sleep: up to 1000 s, 2000 s, 4000 s

    async def scenario():
        scripted.script[:] = [("status", 503)] * 3 + ["ok"]
        start = time.monotonic()
        await asyncio.wait_for(client.chat(MESSAGES), 5)
        await client.aclose()
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 2 and client.stats["retries"] == 3


def test_a_refusal_of_the_setup_names_the_settings_to_check(scripted, monkeypatch):
    """A 404 (a URL or model the server does not have) or a 401 said only what the server said, which rarely names a
    setting: the error names the url, the model and where the key comes from."""
    monkeypatch.setenv("GYRE_TEST_JUDGE_KEY", "sk-x")
    missing = refusal(scripted, endpoint(scripted), 404)
    assert f"check url = '{scripted.url}' and model = 'judge-model'" in str(missing)
    keyed = Endpoint(EndpointConfig(url=scripted.url, model="m", api_key_env="GYRE_TEST_JUDGE_KEY"), name="judge")
    assert "check the key: api_key_env = 'GYRE_TEST_JUDGE_KEY'" in str(refusal(scripted, keyed, 401))


@pytest.mark.parametrize("value", ["", " \n"])
def test_an_empty_key_variable_is_refused_at_start(monkeypatch, value):
    """A variable set from an empty Secret (whitespace, a newline) passed the check and was stripped to no key:
    every call went out with a placeholder key and the run stopped on the first 401."""
    monkeypatch.setenv("GYRE_TEST_EMPTY_KEY", value)
    config = EndpointConfig(url="http://127.0.0.1:9", api_key_env="GYRE_TEST_EMPTY_KEY")
    with pytest.raises(ValueError, match="^judge 'style': api_key_env: the environment variable GYRE_TEST_EMPTY_KEY"):
        Endpoint(config, name="judge 'style'")


def test_a_server_url_left_unresolved_is_refused_at_start():
    """`url = "server:judge"` is resolved by gyre rl and the chart; given to gyre orchestrator or gyre eval directly,
    every call failed as a retried 'Connection error.' at the first scoring. The start fails, naming it."""
    with pytest.raises(ValueError, match="^judge 'style': url = 'server:judge' names a server that only gyre rl"):
        Endpoint(EndpointConfig(url="server:judge"), name="judge 'style'")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_still_loading_is_waited_for_until_it_answers(scripted, caplog):
    """A judge pod loading its model answers 503: the wait asks /v1/models again until it answers, logs once that
    it waits (naming the endpoint, its URL and the reason) and once that it is up; the calls' counters stay 0."""
    scripted.models_script[:] = [('{"error": "loading"}', "application/json", 503)] * 3
    client = endpoint(scripted)

    async def scenario():
        await client.wait_ready(poll_s=0.05)
        await client.aclose()

    with caplog.at_level("INFO", logger="gyre.endpoint"):
        asyncio.run(scenario())
    assert scripted.models_script == [] and sum(client.stats.values()) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "gyre.endpoint"]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"waiting for teacher at {scripted.url} (") and "503" in lines[0]
    assert lines[1].startswith(f"teacher at {scripted.url} is up")


def test_a_long_wait_says_every_so_often_what_it_waits_for(scripted, caplog):
    """One line at the start left the rest of a wait of up to startup_timeout_s (30 min) silent: `gyre eval` with
    a judge that is not up looked hung. The wait says again, every `log_s`, what it waits for and how long."""
    scripted.models_script[:] = [('{"error": "loading"}', "application/json", 503)] * 12
    client = endpoint(scripted)

    async def scenario():
        await client.wait_ready(poll_s=0.05, log_s=0.2)
        await client.aclose()

    with caplog.at_level("INFO", logger="gyre.endpoint"):
        asyncio.run(scenario())
    still = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still waiting")]
    assert 1 <= len(still) <= 4, still
    # warnings: `gyre rl`'s console shows a service's warnings, not its info lines
    assert all(r.levelname == "WARNING" for r in caplog.records if r.getMessage().startswith("still waiting"))
    assert still[0].startswith(f"still waiting for teacher at {scripted.url} (") and "503" in still[0]
    assert "of startup_timeout_s = 1800s" in still[0]


def test_a_rotated_key_is_taken_up_by_the_startup_wait(tmp_path, scripted):
    """The start-up wait's 401 re-reads the key as a call's does (gyre.endpoint, rotated keys)."""
    key = tmp_path / "key"
    key.write_text("sk-old")
    client = endpoint(scripted, api_key_file=str(key))
    key.write_text("sk-new")
    scripted.models_script[:] = [('{"error": {"message": "bad key"}}', "application/json", 401)]

    async def scenario():
        await asyncio.wait_for(client.wait_ready(poll_s=0.05), timeout=5)
        await client.aclose()

    asyncio.run(scenario())
    assert scripted.models_script == [] and client._key == "sk-new"


def test_a_server_not_listening_yet_is_waited_for():
    """Nothing listens on the port for the first 1.5 s (a pod not started yet): connection refused is waited out."""
    import threading
    import time

    port = free_port()
    client = Endpoint(EndpointConfig(url=f"http://127.0.0.1:{port}"), name="judge 'j'")
    started = threading.Event()
    stop = threading.Event()

    def serve_later():
        time.sleep(1.5)
        with ScriptedServer(port=port):
            started.set()
            stop.wait(30)

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()

    async def scenario():
        await client.wait_ready(poll_s=0.1)
        await client.aclose()

    try:
        begin = time.monotonic()
        asyncio.run(scenario())
        assert started.is_set() and time.monotonic() - begin >= 1.5
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_refusal_of_the_setup_is_not_waited_for(scripted, status):
    """A key, a permission or a URL refused: no wait mends it, so the run stops at once with the call's message."""
    scripted.models_script[:] = [('{"error": {"message": "no"}}', "application/json", status)] * 100
    client = endpoint(scripted, api_key_env="HOME")

    async def scenario():
        with pytest.raises(EndpointError, match=f"teacher: {scripted.url} refused the request: {status}") as raised:
            await asyncio.wait_for(client.wait_ready(poll_s=0.05), timeout=5)
        await client.aclose()
        return str(raised.value)

    message = asyncio.run(scenario())
    assert ("check the key: api_key_env = 'HOME'" if status != 404 else "check url") in message
    assert len(scripted.models_script) == 99
    scripted.models_script.clear()


def test_the_startup_wait_is_bounded_and_a_stop_ends_it_at_once():
    """Past startup_timeout_s the wait fails naming the setting and the last reason; a cancelled wait (SIGTERM)
    ends at once; startup_timeout_s = 0 asks nothing."""
    import time

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    bounded = Endpoint(EndpointConfig(url=url, startup_timeout_s=0.5), name="reward model 'rm'")
    with pytest.raises(EndpointError, match=r"reward model 'rm': .*/v1/models did not answer within "
                                            r"startup_timeout_s = 0.5s \(last: .*onnection"):  # fmt: skip
        asyncio.run(bounded.wait_ready(poll_s=0.1))

    async def cancelled():
        client = Endpoint(EndpointConfig(url=url), name="teacher")
        wait = asyncio.create_task(client.wait_ready(poll_s=0.1))
        await asyncio.sleep(0.3)
        begin = time.monotonic()
        wait.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wait
        return time.monotonic() - begin

    assert asyncio.run(cancelled()) < 0.5
    off = Endpoint(EndpointConfig(url=url, startup_timeout_s=0), name="teacher")
    asyncio.run(asyncio.wait_for(off.wait_ready(), timeout=0.5))  # would fail with nothing listening


def test_waiting_for_several_stops_at_the_first_refusal(scripted):
    """wait_all_ready: one endpoint refused (401) ends the waits of the others (one never up) at once."""
    from gyre.endpoint import wait_all_ready

    scripted.models_script[:] = [('{"error": {"message": "no"}}', "application/json", 401)]
    never = Endpoint(EndpointConfig(url=f"http://127.0.0.1:{free_port()}"), name="judge 'never'")
    refused = endpoint(scripted)
    with pytest.raises(EndpointError, match="refused the request: 401"):
        asyncio.run(asyncio.wait_for(wait_all_ready([never, refused]), timeout=5))


def test_a_host_that_does_not_exist_is_not_waited_for():
    """`url = "http://judeg:8000"`: a name no resolver knows is a typo, not a pod starting (a Kubernetes Service's
    name resolves from the moment it exists, before its pods are ready), so it fails at once naming the url; it
    waited out the whole startup_timeout_s (30 minutes by default) with one log line."""
    import socket
    import time

    try:  # `.invalid` never resolves (RFC 6761); a resolver that cannot be reached answers EAI_AGAIN instead
        socket.getaddrinfo("no-such-judge.invalid", 8000)
    except socket.gaierror as e:
        if e.errno != socket.EAI_NONAME:
            pytest.skip(f"this machine's resolver answers {e} for a name that does not exist")
    else:
        pytest.skip("this machine's resolver answers for a name that does not exist")
    client = Endpoint(EndpointConfig(url="http://no-such-judge.invalid:8000"), name="judge 'j'")
    begin = time.monotonic()
    with pytest.raises(EndpointError, match=r"judge 'j': the host of http://no-such-judge.invalid:8000 does not "
                                            r"exist \(.*\): check url"):  # fmt: skip
        asyncio.run(asyncio.wait_for(client.wait_ready(poll_s=0.1), timeout=20))
    assert time.monotonic() - begin < 15


def test_a_model_lookup_failing_after_its_callers_left_is_logged_once(caplog):
    """The server is down and the only caller of model() is cancelled (its rollout dropped) before the lookup
    fails: asyncio logged "Task exception was never retrieved" with a traceback; now one warning says what failed.
    A caller still waiting gets the error itself, and nothing is logged for it."""
    import gc

    client = Endpoint(EndpointConfig(url=f"http://127.0.0.1:{free_port()}", retries=1), name="judge 'j'",
                      backoff_s=0.05)  # fmt: skip

    async def scenario():
        caller = asyncio.ensure_future(client.model())
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        while not client._model.done():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # its callbacks
        with pytest.raises(EndpointError, match="failed 2 times"):
            await client.model()  # asked again, the error raised to this caller
        await client.aclose()

    with caplog.at_level("WARNING"):
        asyncio.run(scenario())
        gc.collect()  # an unread exception is logged when its task is collected
    assert "never retrieved" not in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.name == "gyre.endpoint"]
    assert len(warnings) == 1 and "judge 'j'" in warnings[0] and "failed 2 times" in warnings[0], warnings
