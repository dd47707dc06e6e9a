"""`verifiers:<taskset-id>`: an environment from the `verifiers` 0.4 library (`verifiers.v1`), run through Gyre.

    [orchestrator.env]
    name = "verifiers:my_taskset"            # an installed package, or any importable module path
    args = { taskset = { task = {} }, agent = { harness = { id = "my_taskset" } }, num_eval = 32 }

Needs the optional extra (`pip install 'gyre[verifiers]'`, which pins `openai<3`: see docs/dependencies.md).

What the id names: a module that exports (in `__all__`) a `vf.Taskset` subclass and, optionally, its own
`vf.Harness` and `vf.Env` — verifiers' own plugin rule. `args` other than Gyre's split knobs (`num_eval`,
`eval_seed`, `max_tasks`) are the verifiers env config (`taskset`, `agent`, `retries`, ...); the agent runs in the
local `subprocess` runtime unless `agent.runtime` says otherwise (verifiers' default is a remote sandbox).

How an episode runs: the verifiers env plays the task with its harness; every model call the harness makes reaches
verifiers' interception server, which here hands it to a Gyre model client (`GyreModelCalls`) instead of verifiers'
own: one call = one `ModelClient.chat` turn through the orchestrator's replicas, so Gyre's version-aware routing,
retries, concurrency bound and per-turn policy versions all apply. The server returns the prompt and completion
token ids and log-probs, which verifiers records in the trace's message graph.

Mapping onto a Gyre sample (one per episode): the first trainable branch of the episode's first trace gives
`token_ids`, `loss_mask` (verifiers' `sampled_mask`: True only on tokens the model sampled, so user, tool and
template tokens between turns are masked out) and `logprobs`; the policy versions span every turn of the episode;
the reward is the trace's weighted reward (`Score.per_function` holds each named reward; a NaN or inf one counts 0
and is named in `Score.errors`, and so does a reward that raised: verifiers records it as a TaskError "scoring: ...",
which here is no rollout error; but a judge's client whose server failed, "scoring: APIConnectionError" (a timeout,
a 5xx, a 429), is a `ScoringError`, counted as a Gyre judge's failure; not `rescorable`, verifiers having scored
inside the episode, so the sample is generated again), plus the weighted scores of the judges
and reward models the run joins to the environment's Gyre rubric (`[[orchestrator.judges]]`; a name verifiers uses
too is reported as `gyre:<name>`). A second branch (a turn whose prompt no longer extended the recorded tokens, or
compaction) is dropped and the rollout marked "drift". An episode that raised (task, harness or env code) comes back
with `Rollout.error` set: the orchestrator counts it (`rollouts{outcome="error"}`, `rollout_errors` in the step
record) and generates the sample again.

Splits: the taskset's tasks (the first `max_tasks` of an infinite one) are loaded once; `num_eval` of them, chosen
with `eval_seed`, are the eval split (or all of `eval_taskset`, a second taskset config, when given); the rest are
the endless train split, epoch by epoch in an order seeded by (`seed`, epoch). A train task whose prompt is also an
eval task's is left out of training (with a warning), so eval stays held out.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import functools
import logging
import math
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gyre.envs.base import Environment
from gyre.envs.parsers import split_reasoning
from gyre.envs.splits import TaskSource, hold_out, listed_tasks
from gyre.envs.types import (
    ContextLengthExceeded,
    Messages,
    ModelClient,
    Rollout,
    SamplingParams,
    Score,
    ScoringError,
    Split,
    StopReason,
    Task,
    Turn,
)

log = logging.getLogger(__name__)

# The Gyre model calls of the episode running in the current asyncio task (see `GyreInterception`).
_CURRENT: contextvars.ContextVar[GyreModelCalls] = contextvars.ContextVar("gyre_verifiers_calls")
# Where the harness's program reaches the model is verifiers' interception server; the client config it carries
# keeps the server on its non-streaming, token-recording path (a train config), and its URL is dialled only by the
# interception's relay of GET /v1/models, which `_models_server` answers (the model calls never leave the process).
MODEL_ID = "gyre"
# How the harness is told that a turn no longer fits the model's context (the episode then ends as a length stop).
CONTEXT_FULL = "context_length_exceeded"


def import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            "verifiers environments need the verifiers package: pip install 'gyre[verifiers]' "
            f"(with -c constraints.txt); import failed: {exc}"
        ) from exc
    return vf


def _text(content: Any) -> str:
    """Message content as plain text (verifiers allows a list of parts; Gyre's server takes text)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(getattr(part, "text", None) or (part.get("text", "") if isinstance(part, dict) else "")
                   for part in content)  # fmt: skip


def wire_messages(messages) -> Messages:
    """verifiers messages -> OpenAI chat dicts (what Gyre's inference server renders with its chat template)."""
    from verifiers.v1.dialects.chat import message_to_wire

    out = []
    for message in messages:
        wire = message_to_wire(message)
        if "content" in wire and wire["content"] is not None:
            wire["content"] = _text(wire["content"])
        if wire["role"] == "tool":  # verifiers keeps the tool's name for Harmony; OpenAI's tool message has none
            wire.pop("name", None)
        out.append(wire)
    return out


class GyreModelCalls:
    """One episode's model calls: a verifiers `Client` whose turns go through a Gyre `ModelClient`.

    Records every Gyre `Turn` (with the policy versions that produced it) and a transport failure the harness did not
    recover from (a later call that is answered clears it, as verifiers clears its session's error), so the adapter
    can report versions per sample and tell a Gyre inference failure from an environment bug. A failure the harness's
    SDK retried past discarded the whole episode, every turn of it sound, to be generated again.
    """

    def __init__(self, client: ModelClient, sampling: SamplingParams, warned: set[str] | None = None) -> None:
        self.client = client
        self.sampling = sampling
        self.warned = set() if warned is None else warned  # sampling keys already named (one warning per env)
        self.turns: list[Turn] = []
        self.failure: BaseException | None = None
        self.context_full = False  # a turn was refused as longer than the model's context
        # (content, reasoning_content) of each reply handed to verifiers with its reasoning apart -> the content as
        # sampled (`_as_sampled`)
        self.sampled: dict[tuple[str, str], str] = {}

    def as_verifiers_client(self):
        return _gyre_client_class()(self)

    async def respond(self, dialect, body: dict, pending):
        from verifiers.v1.clients.train import serialize_completion, tool_to_wire
        from verifiers.v1.errors import ProviderError
        from verifiers.v1.types import AssistantMessage, Response, ToolCall, TurnTokens, Usage

        self._note_ignored_sampling(body)
        if pending is not None:
            prompt, tools = pending.prompt, pending.tools
        else:
            request = dialect.parse_request(body)
            prompt, tools = request.messages, request.tools
        try:
            turn = await self.client.chat(
                [self._as_sampled(m) for m in wire_messages(prompt)],
                tools=[tool_to_wire(t) for t in tools] or None,
                sampling=self.sampling,
            )
        except ContextLengthExceeded as exc:  # the conversation outgrew the context: a 400 no SDK retries
            self.context_full = True
            raise ProviderError(f"{CONTEXT_FULL}: {exc}", status_code=400) from exc
        except Exception as exc:  # the harness sees an HTTP error; the adapter re-raises the original
            self.failure = exc
            raise ProviderError(f"gyre inference failed: {exc}", status_code=502) from exc
        self.failure = None
        self.turns.append(turn)
        message = turn.assistant_message()
        reasoning, content = message.get("reasoning_content"), message["content"]
        if reasoning is None:  # reasoning in the text (a <think> block) goes apart, as verifiers' own client has it
            reasoning, content = split_reasoning(content)
            if reasoning is not None:
                self.sampled[(content, reasoning)] = message["content"]
        calls = [ToolCall(id=c["id"] or f"call_{i}", name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for i, c in enumerate(message.get("tool_calls") or [])]  # fmt: skip
        finish = turn.finish_reason if turn.finish_reason in ("stop", "length", "tool_calls") else None
        response = Response(
            id=f"gyre-{len(self.turns)}",
            created=0,
            model=str(body.get("model") or "gyre"),
            message=AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None),
            finish_reason=finish,
            usage=Usage(prompt_tokens=len(turn.prompt_token_ids), completion_tokens=len(turn.completion_token_ids)),
            tokens=TurnTokens(
                prompt_ids=list(turn.prompt_token_ids),
                completion_ids=list(turn.completion_token_ids),
                completion_logprobs=list(turn.completion_logprobs),
            ),
        )
        response.raw = serialize_completion(response, response.model)
        return response

    def _as_sampled(self, message: dict) -> dict:
        """An assistant message of the history as Gyre's client sends it: a reply verifiers got with its reasoning
        apart goes back as the text that was sampled (the <think> block in its content), so the prompt holds exactly
        the sampled tokens whatever the chat template does with `reasoning_content` (most drop it, or render it
        with other whitespace: the turn would drift). Other messages are sent as they are."""
        key = (message.get("content") or "", message.get("reasoning_content"))
        if message.get("role") != "assistant" or key not in self.sampled:
            return message
        sent = {k: v for k, v in message.items() if k != "reasoning_content"}
        return {**sent, "content": self.sampled[key]}

    def _note_ignored_sampling(self, body: dict) -> None:
        """Name (once per environment and key) a harness's own sampling that differs from the run's: every turn is
        sampled with `[orchestrator.sampling]`, and a harness asking for temperature 0 or a short max_tokens was
        ignored without a word."""
        for key, ours in _SAMPLING_KEYS.items():
            value = body.get(key)
            if value is None or key in self.warned or value == getattr(self.sampling, ours):
                continue
            self.warned.add(key)
            log.warning("a verifiers harness asked for %s=%s, which Gyre does not apply: every turn is sampled with "
                        "the run's [orchestrator.sampling] (%s=%s); set it there", key, value, ours,
                        getattr(self.sampling, ours))  # fmt: skip


# A harness's request keys -> the Gyre sampling setting that is used instead
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_tokens",
                  "max_completion_tokens": "max_tokens"}  # fmt: skip


@functools.cache
def _gyre_client_class():
    """The verifiers `Client` subclass (built on first use: verifiers is an optional import)."""
    vf = import_verifiers()

    class GyreClient(vf.Client):
        def __init__(self, calls: GyreModelCalls) -> None:
            self.calls = calls

        async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
            return await self.calls.respond(dialect, body, turn)

    return GyreClient


@contextlib.asynccontextmanager
async def _models_server() -> AsyncIterator[str]:
    """A local server answering GET /v1/models with the episode's model id; yields its URL. verifiers relays a
    harness's model listing (an agent reading the context window) to the client config's URL: an unused port
    failed it three times per episode, each a WARNING "models call failed: All connection attempts failed" (a log
    line per rollout, a flood in training) and a retried 502 the harness waited out. The answer has no
    `max_model_len` (the replicas are the orchestrator's), so the harness keeps its no-compaction fallback."""
    from aiohttp import web  # verifiers' own interception server runs on aiohttp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "gyre"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def gyre_interception(inner):
    """Wrap verifiers' interception so each rollout's model calls go to the Gyre client of its episode.

    verifiers registers a rollout on its interception server from inside the episode's own asyncio task, so the
    episode's `GyreModelCalls` (a context variable set around the episode) is visible there.
    """
    from verifiers.v1.interception import Interception

    class GyreInterception(Interception):
        async def start(self) -> None:  # the wrapped interception's owner (Env.serving) runs its lifecycle
            return None

        @contextlib.asynccontextmanager
        async def acquire(self, session) -> AsyncIterator:
            calls = _CURRENT.get(None)
            if calls is None:
                raise RuntimeError("a verifiers rollout started outside a Gyre episode; no model client for it")
            async with inner.acquire(session) as slot:
                session.client = calls.as_verifiers_client()
                yield slot

    return GyreInterception()


class VerifiersEnv(Environment):
    """A verifiers 0.4 env as a Gyre `Environment` (see the module docstring)."""

    def __init__(
        self,
        *,
        env_id: str,
        config: Mapping[str, Any] | None = None,
        eval_config: Mapping[str, Any] | None = None,
        num_eval: int = 32,
        eval_seed: int = 1234,
        max_tasks: int = 100_000,
    ) -> None:
        vf = import_verifiers()
        super().__init__(num_eval=num_eval, eval_seed=eval_seed)
        self.name = f"verifiers:{env_id}"
        self.vf_env = vf.load_environment(self._config(vf, env_id, config))
        tasks = self._load(self.vf_env.taskset, max_tasks)
        if eval_config is not None:
            evals = self._load(vf.load_environment(self._config(vf, env_id, eval_config)).taskset, max_tasks)
            train = tasks
        else:
            if len(tasks) <= num_eval:
                raise ValueError(
                    f"{self.name}: {len(tasks)} tasks and num_eval={num_eval} leave none to train on; lower num_eval "
                    "or give eval_taskset"
                )
            train, evals = hold_out(tasks, num_eval, f"verifiers/eval/{eval_seed}")
        self.vf_tasks = train + evals
        self.eval_tasks = [self._task(len(train) + i, f"eval-{i}") for i in range(len(evals))]
        # A task in both splits (an eval_taskset overlapping the train one, a taskset listing a task twice) would be
        # trained on and then scored as held out: its train copies go, as in the `dataset` environment.
        eval_keys = {task.key for task in self.eval_tasks}
        every_train = [self._task(i, f"train-{i}") for i in range(len(train))]
        self.train_tasks = [task for task in every_train if task.key not in eval_keys]
        if len(self.train_tasks) < len(every_train):
            log.warning("%s: %d train tasks repeat an eval task's prompt and are left out of training", self.name,
                        len(every_train) - len(self.train_tasks))  # fmt: skip
        if not self.train_tasks:
            raise ValueError(f"{self.name}: every train task is also in the eval split; nothing to train on")
        # The turn budget sizes the generation budget (Dr.GRPO's normaliser, DAPO's overlong shaping): the agent's
        # max_turns where the config sets one; else the harness decides its turns and 1 stands in (the shaping then
        # takes the turns each episode took)
        agent_turns = getattr(getattr(self.vf_env.config, "agent", None), "max_turns", None)
        self.max_turns = agent_turns if isinstance(agent_turns, int) and agent_turns >= 1 else 1
        self._serving: tuple[asyncio.AbstractEventLoop, contextlib.AsyncExitStack] | None = None
        self._serving_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._models_url = ""  # set when serving starts: see _models_server
        self._sampling_warned: set[str] = set()  # the harness sampling keys already named (GyreModelCalls)

    @staticmethod
    def _config(vf, env_id: str, config: Mapping[str, Any] | None):
        raw = copy.deepcopy(dict(config or {}))
        taskset = raw.setdefault("taskset", {})
        if not isinstance(taskset, dict):
            raise ValueError(f"verifiers:{env_id}: 'taskset' must be a table of the taskset's config")
        taskset.setdefault("id", env_id)
        agent = raw.setdefault("agent", {})
        if isinstance(agent, dict):  # local by default: verifiers' default runtime is a remote sandbox
            agent.setdefault("runtime", {"type": "subprocess"})
        try:
            return vf.resolve_env_config(raw)
        except (ValueError, TypeError, ModuleNotFoundError, AttributeError) as exc:
            raise ValueError(f"verifiers:{env_id}: cannot build the environment config: {exc}") from exc

    @staticmethod
    def _load(taskset, max_tasks: int) -> list:
        view = taskset if taskset.bounded else taskset.take(max_tasks)
        return list(view)

    def _task(self, index: int, task_id: str) -> Task:
        data = self.vf_tasks[index].data
        prompt = data.prompt
        messages: Messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += wire_messages(prompt)
        answer = getattr(data, "answer", "")
        return Task(id=task_id, prompt=messages, answer="" if answer is None else str(answer),
                    info={"verifiers_index": index})  # fmt: skip

    def tasks(self, split: Split, seed: int = 0) -> TaskSource:
        return listed_tasks(self.train_tasks, self.eval_tasks, split, seed, "verifiers")

    # --- episodes ---------------------------------------------------------------------------------------------

    async def _ensure_serving(self) -> None:
        """Enter verifiers' serving resources once per event loop (tool servers, the interception server)."""
        loop = asyncio.get_running_loop()
        if self._serving is not None and self._serving[0] is loop:
            return
        if self._serving_lock is None or self._serving_lock[0] is not loop:  # an asyncio lock binds to one loop
            self._serving_lock = (loop, asyncio.Lock())
        async with self._serving_lock[1]:
            if self._serving is not None and self._serving[0] is loop:
                return
            stack = contextlib.AsyncExitStack()
            self._models_url = await stack.enter_async_context(_models_server())
            await stack.enter_async_context(self.vf_env.serving())
            # verifiers 0.4 has no public hook for a custom model client: wrap the interception serving() built.
            self.vf_env._interception = gyre_interception(self.vf_env._interception)
            self._serving = (loop, stack)

    async def aclose(self) -> None:
        """Tear down verifiers' serving resources (call from the loop that ran the episodes)."""
        if self._serving is not None:
            _, stack = self._serving
            self._serving = None
            await stack.aclose()

    async def rollout(self, client: ModelClient, task: Task, sampling: SamplingParams) -> Rollout:
        from verifiers.v1.clients import ModelContext, TrainClientConfig

        await self._ensure_serving()
        calls = GyreModelCalls(client, sampling, self._sampling_warned)
        ctx = ModelContext(
            model=MODEL_ID, client=TrainClientConfig(base_url=self._models_url, api_key_var="GYRE_UNUSED")
        )
        token = _CURRENT.set(calls)
        try:
            slot = self.vf_env.slots(self.vf_tasks[task.info["verifiers_index"]])[0]
            episode = await self.vf_env.run_slot(slot, ctx)
        finally:
            _CURRENT.reset(token)
        if calls.failure is not None:
            raise calls.failure  # Gyre inference failed (after its own retries): the caller retries the rollout
        if calls.context_full and not calls.turns:
            raise ContextLengthExceeded(f"task {task.id}: its prompt does not fit the model's context")
        return to_rollout(task, episode, calls.turns, context_full=calls.context_full)

    async def score(self, task: Task, rollout: Rollout) -> Score:
        """The trace's verifiers rewards plus Gyre's own rubric (judges and reward models joined to it from
        `[[orchestrator.judges]]` / `[[orchestrator.reward_models]]`, which verifiers knows nothing about)."""
        trace = rollout.state.get("trace")
        if trace is None:
            return Score(reward=0.0, per_function={})
        served = [e for e in rollout.state.get("scoring_errors") or [] if _JUDGE_SERVER_FAILED.search(e)]
        if served:  # the judge's server, not the reward: never a 0. verifiers scored inside the episode, so asking
            # score() again reads the same failure (re-scoring stopped the run): the sample is generated again
            failure = ScoringError(f"a verifiers judge's server failed: {served[0]}")
            failure.rescorable = False
            raise failure
        own = await self.rubric.score(task, rollout) if self.rubric.funcs else None
        # verifiers keeps whatever float a reward returned: a NaN or inf one counts 0 and is named, as in a Gyre
        # Rubric, so it never reaches the advantages (a NaN there poisons the whole batch's loss).
        rewards: dict[str, float] = {}
        errors: dict[str, str] = {}
        reward = 0.0
        for name, r in trace.rewards.items():
            if r is None:  # scoring raised (the error names the function) or timed out
                errors[name] = "; ".join(rollout.state.get("scoring_errors") or []) or "not scored"
            elif not (math.isfinite(r.score) and math.isfinite(r.value)):
                rewards[name], errors[name] = 0.0, f"ValueError: returned {r.score} (weight {r.weight})"
            else:
                rewards[name] = r.score
                reward += r.value
        if own is not None:
            for name, value in own.per_function.items():
                key = name if name not in rewards and name not in errors else f"gyre:{name}"  # names may collide
                rewards[key] = value
                if name in own.errors:
                    errors[key] = own.errors[name]
            reward += own.reward
        return Score(reward=reward, per_function=rewards, errors=errors)

    def sft_example(self, task: Task) -> Messages:
        if not task.answer:
            raise ValueError(f"{self.name}: task {task.id} has no 'answer' field to use as an SFT reply")
        return super().sft_example(task)


# verifiers wraps an exception raised by a reward, metric or judge as a TaskError "[task <Name> ]scoring: ..." (typed
# errors such as a SandboxError pass through unchanged: those are the runtime's, not the reward's).
_SCORING_ERROR = re.compile(r"TaskError: (?:task \S+ )?scoring\b")
# ...and one raised by a judge's client whose server failed (the openai client's types for a refused or reset
# connection, a timeout, a 5xx, a 429), after that client's own retries: the server's fault, not the reward's
_JUDGE_SERVER_FAILED = re.compile(
    r"scoring: (?:APIConnectionError|APITimeoutError|InternalServerError|RateLimitError)\b"
)


# verifiers' stop conditions that are limits on tokens, not on turns
_LENGTH_LIMITS = frozenset({"max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed"})


def _errors(episode) -> list[str]:
    found = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        found += [f"{e.type}: {e.message}" for e in trace.errors]
    return found


def to_rollout(task: Task, episode, turns: list[Turn], context_full: bool = False) -> Rollout:
    """A finished verifiers episode as a Gyre rollout (see the module docstring for the mapping). With
    `context_full`, a turn was refused as longer than the model's context: the episode ends there as a length stop
    (like Gyre's own environments), and the refusal the harness saw is not an error."""
    branches = [(trace, b) for trace in episode.traces for b in trace.branches if b.trainable and any(b.sampled_mask)]
    errors = [e for e in _errors(episode) if not (context_full and e.startswith(f"ProviderError: {CONTEXT_FULL}"))]
    # A reward that raised is a reward bug, scored 0 and named (`score`), as in a Gyre Rubric: as a rollout error the
    # sample was generated again, failing the same way until the run stopped.
    scoring = [e for e in errors if _SCORING_ERROR.match(e)]
    errors = [e for e in errors if e not in scoring]
    versions = [v for turn in turns for v in (turn.policy_version_min, turn.policy_version_max)]
    state: dict[str, Any] = {"episode_id": episode.id, "branches": len(branches), "scoring_errors": scoring}
    stop: StopReason
    if not branches:
        state["trace"] = episode.traces[0] if episode.traces else None
        return Rollout(
            task_id=task.id,
            prompt=copy.deepcopy(task.prompt),
            completion=[],
            turns=turns,
            token_ids=[],
            loss_mask=[],
            logprobs=[],
            prompt_len=0,
            sequence_turns=0,
            policy_version_min=min(versions, default=0),
            policy_version_max=max(versions, default=0),
            stop_reason="error",
            error="; ".join(errors) or "the episode made no model call",
            state=state,
        )
    trace, branch = branches[0]
    state["trace"] = trace
    mask = [bool(m) for m in branch.sampled_mask]
    messages = wire_messages(branch.messages)
    first_reply = next(i for i, node in enumerate(branch.nodes) if node.sampled)
    if errors:
        stop = "error"
    elif len(branches) > 1:
        stop = "drift"
    elif context_full:
        stop = "length"
    elif trace.is_truncated:
        last = next((c for c in reversed(trace.calls) if c.error is None), None)
        cut = last is not None and last.finish_reason == "length"
        # a token budget of the agent's spent (its output: the episode's max_tokens; its input or total: its context)
        # is a length stop as in Gyre's own environments, which advantage.mask_truncated leaves out; as "max_turns"
        # it was trained on (a failed compaction too: the context was full)
        stop = "length" if cut or trace.stop_condition in _LENGTH_LIMITS else "max_turns"
    else:
        stop = "done"
    return Rollout(
        task_id=task.id,
        prompt=messages[:first_reply],
        completion=messages[first_reply:],
        turns=turns,
        token_ids=list(branch.token_ids),
        loss_mask=mask,
        logprobs=list(branch.logprobs),
        prompt_len=mask.index(True),
        sequence_turns=sum(1 for node in branch.nodes if node.sampled),
        policy_version_min=min(versions, default=0),
        policy_version_max=max(versions, default=0),
        stop_reason=stop,
        error="; ".join(errors) or None,
        state=state,
    )


def load_environment(
    taskset_id: str,
    taskset: dict[str, Any] | None = None,
    agent: dict[str, Any] | None = None,
    eval_taskset: dict[str, Any] | None = None,
    num_eval: int = 32,
    eval_seed: int = 1234,
    max_tasks: int = 100_000,
    **env_config: Any,
) -> VerifiersEnv:
    """Args: the taskset id, its config (`taskset`), the agent seat (`agent`), more verifiers env config, and the
    split knobs (`eval_taskset`, `num_eval`, `eval_seed`, `max_tasks`)."""
    config = {**env_config, "taskset": dict(taskset or {}), "agent": dict(agent or {})}
    eval_config = None if eval_taskset is None else {**config, "taskset": dict(eval_taskset)}
    return VerifiersEnv(env_id=taskset_id, config=config, eval_config=eval_config, num_eval=num_eval,
                        eval_seed=eval_seed, max_tasks=max_tasks)  # fmt: skip
